"""The weight cache: content addressing, verification on every read, per-identity visibility,
LRU bound, restart survival."""

from __future__ import annotations

import pytest
import torch

from rrto.v1 import ops_pb2
from rrto_plugins.torch import codec
from rrtod.gpu.blobstore import BlobError, BlobStore
from rrtod.wire import hash_of

ME, OTHER = "robot-a", "robot-b"


def blob(seed: int, n: int = 256) -> tuple[bytes, ops_pb2.TensorData]:
    g = torch.Generator().manual_seed(seed)
    data = codec.tensor_data(torch.randn(n, generator=g))
    return hash_of(data), data


def test_put_get_roundtrip_and_restart(tmp_path):
    store = BlobStore(tmp_path, 1 << 20)
    key, data = blob(1)
    assert not store.has(key, ME)
    store.put(key, data, ME)
    assert store.has(key, ME)
    again = BlobStore(tmp_path, 1 << 20)  # a restarted daemon finds what the last one stored
    got = again.get(key, ME)
    assert got is not None and got.data == data.data and list(got.meta.shape) == [256]


def test_put_rejects_wrong_hash(tmp_path):
    store = BlobStore(tmp_path, 1 << 20)
    key, data = blob(1)
    _, other = blob(2)
    with pytest.raises(BlobError, match="does not match"):
        store.put(key, other, ME)
    assert not store.has(key, ME)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_same_bytes_other_shape_is_another_blob():
    a = codec.tensor_data(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    b = codec.tensor_data(torch.arange(6, dtype=torch.float32).reshape(3, 2))
    assert a.data == b.data and hash_of(a) != hash_of(b)


def test_lru_eviction_bounds_size_and_keeps_recent(tmp_path):
    k1, d1 = blob(1)
    size = len(d1.SerializeToString())
    store = BlobStore(tmp_path, 2 * size + 10)
    k2, d2 = blob(2)
    k3, d3 = blob(3)
    store.put(k1, d1, ME)
    store.put(k2, d2, ME)
    assert store.get(k1, ME) is not None  # k1 is now the most recently used
    store.put(k3, d3, ME)
    assert store.has(k1, ME) and store.has(k3, ME) and not store.has(k2, ME)
    assert store.stats()["bytes"] <= 2 * size + 10
    # The order survives a restart (file mtimes), and a smaller bound evicts at start.
    assert BlobStore(tmp_path, size + 10).stats()["blobs"] == 1


def test_blob_larger_than_cache_is_refused(tmp_path):
    key, data = blob(1, n=1024)
    with pytest.raises(BlobError, match="exceeds"):
        BlobStore(tmp_path, 100).put(key, data, ME)


def test_corrupt_file_is_dropped_not_served(tmp_path):
    store = BlobStore(tmp_path, 1 << 20)
    key, data = blob(1)
    store.put(key, data, ME)
    path = tmp_path / key.hex()[:2] / key.hex()[2:]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert store.get(key, ME) is None and not store.has(key, ME)
    assert not path.exists()  # dropped: the robot is told it is missing and uploads it again
    store.put(key, data, ME)
    assert store.get(key, ME).data == data.data


def test_tampered_blob_is_detected_on_read_by_the_executor(tmp_path):
    """A weight file changed on disk (same size, other values) is never used: the session
    reports it missing, the app uploads it again, and the offloaded model's output equals the
    local one."""
    from torch import nn

    from rrto_plugins.torch.testing import loopback

    def make_model() -> nn.Module:  # a restarted app: same weights, fresh objects
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()

    model = make_model()
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    blobs = BlobStore(tmp_path / "blobs", 1 << 20)
    first = loopback(tmp_path, blobs=blobs)  # identity "local" (ExecutorContext's default)
    with torch.no_grad():
        model(x).cpu()
    first.uninstall()
    weight = codec.tensor_data(model[0].weight.detach())
    path = tmp_path / "blobs" / hash_of(weight).hex()[:2] / hash_of(weight).hex()[2:]
    forged = ops_pb2.TensorData()
    forged.CopyFrom(weight)
    forged.data = codec.tensor_data(torch.zeros(16, 8)).data
    path.write_bytes(forged.SerializeToString())
    second = loopback(tmp_path, blobs=blobs)
    with torch.no_grad():
        got = make_model()(x).cpu()
    second.uninstall()
    assert torch.equal(got, expected)
    assert second.session.counters["blob_bytes_up"] == 16 * 8 * 4  # only the tampered one
    assert blobs.get(hash_of(weight), "local").data == weight.data


def test_entries_are_visible_only_to_their_uploaders(tmp_path):
    store = BlobStore(tmp_path, 1 << 20)
    key, data = blob(1)
    store.put(key, data, ME)
    assert store.has(key, ME) and not store.has(key, OTHER)
    assert store.get(key, OTHER) is None and store.missing([key], OTHER) == [key]
    restarted = BlobStore(tmp_path, 1 << 20)  # owners survive a restart
    assert restarted.has(key, ME) and not restarted.has(key, OTHER)
    restarted.put(key, data, OTHER)  # uploading the content makes it an owner
    assert restarted.get(key, OTHER).data == data.data
    assert BlobStore(tmp_path, 1 << 20).has(key, OTHER)


def test_shared_mode_shows_every_entry_to_everyone(tmp_path):
    store = BlobStore(tmp_path, 1 << 20, shared=True)
    key, data = blob(1)
    store.put(key, data, ME)
    assert store.has(key, OTHER) and store.get(key, OTHER).data == data.data


def test_files_of_older_versions_are_removed_at_start(tmp_path):
    """xxh3-128 names (16 bytes) and blobs without owners from before owners existed go."""
    old = tmp_path / "ab"
    old.mkdir()
    (old / ("cd" * 15)).write_bytes(b"old xxh3 blob")
    key, data = blob(1)
    sub = tmp_path / key.hex()[:2]
    sub.mkdir(exist_ok=True)
    (sub / key.hex()[2:]).write_bytes(data.SerializeToString())  # no owners file
    store = BlobStore(tmp_path, 1 << 20)
    assert store.stats()["blobs"] == 0
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_interrupted_write_is_cleaned_at_start(tmp_path):
    key, data = blob(1)
    sub = tmp_path / key.hex()[:2]
    sub.mkdir()
    (sub / f".{key.hex()[2:]}.123.456").write_bytes(b"partial")
    store = BlobStore(tmp_path, 1 << 20)
    assert store.stats()["blobs"] == 0 and not list(sub.iterdir())
