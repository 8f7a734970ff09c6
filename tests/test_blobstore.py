"""The weight cache: content addressing, verification, LRU bound, restart survival."""

from __future__ import annotations

import pytest
import torch

from rrto.v1 import ops_pb2
from rrto_plugins.torch import codec
from rrtod.blobstore import BlobError, BlobStore, hash_of


def blob(seed: int, n: int = 256) -> tuple[bytes, ops_pb2.TensorData]:
    g = torch.Generator().manual_seed(seed)
    data = codec.tensor_data(torch.randn(n, generator=g))
    return hash_of(data), data


def test_put_get_roundtrip_and_restart(tmp_path):
    store = BlobStore(tmp_path, 1 << 20)
    key, data = blob(1)
    assert not store.has(key)
    store.put(key, data)
    assert store.has(key)
    again = BlobStore(tmp_path, 1 << 20)  # a restarted daemon finds what the last one stored
    got = again.get(key)
    assert got is not None and got.data == data.data and list(got.meta.shape) == [256]


def test_put_rejects_wrong_hash(tmp_path):
    store = BlobStore(tmp_path, 1 << 20)
    key, data = blob(1)
    _, other = blob(2)
    with pytest.raises(BlobError, match="does not match"):
        store.put(key, other)
    assert not store.has(key)
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
    store.put(k1, d1)
    store.put(k2, d2)
    assert store.get(k1) is not None  # k1 is now the most recently used
    store.put(k3, d3)
    assert store.has(k1) and store.has(k3) and not store.has(k2)
    assert store.stats()["bytes"] <= 2 * size + 10
    # The order survives a restart (file mtimes), and a smaller bound evicts at start.
    assert BlobStore(tmp_path, size + 10).stats()["blobs"] == 1


def test_blob_larger_than_cache_is_refused(tmp_path):
    key, data = blob(1, n=1024)
    with pytest.raises(BlobError, match="exceeds"):
        BlobStore(tmp_path, 100).put(key, data)


def test_corrupt_file_is_dropped_not_served(tmp_path):
    store = BlobStore(tmp_path, 1 << 20)
    key, data = blob(1)
    store.put(key, data)
    path = tmp_path / key.hex()[:2] / key.hex()[2:]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert store.get(key) is None and not store.has(key)


def test_interrupted_write_is_cleaned_at_start(tmp_path):
    key, data = blob(1)
    sub = tmp_path / key.hex()[:2]
    sub.mkdir()
    (sub / f".{key.hex()[2:]}.123.456").write_bytes(b"partial")
    store = BlobStore(tmp_path, 1 << 20)
    assert store.stats()["blobs"] == 0 and not list(sub.iterdir())
