"""The GPU host's positive operator allowlist (issue 10, finding 1).

A real GPU daemon spoken to with a raw gRPC client refuses the out-of-bounds alias that read the
daemon's heap, and keeps serving; internal/unsafe operators are refused unless the host's config
marks them ``unsafe:``; an unmarked unsafe entry is a config error naming file, key and reason;
every operator the correctness suite and the benchmark send is on the list.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch

from rrto.v1 import ops_pb2, peer_pb2, peer_pb2_grpc
from rrto_plugins.torch import codec
from rrto_plugins.torch.allowlist import Allowlist, builtin_entries, builtin_names
from rrtod import opnames
from rrtod.config import ConfigError, from_mapping, load
from rrtod.wire import BIND_OP
from testkit.daemons import TEST_DEFAULTS, Launcher
from testkit.peer import RawPeerSession

REPO = Path(__file__).resolve().parent.parent
OBSERVED = REPO / "bench" / "results" / "oplist"
UNSAFE_OPS = ("aten::_reshape_alias.default", "aten::_reshape_alias_copy.default",
              "aten::as_strided.default", "aten::as_strided_.default", "aten::_unsafe_index.Tensor",
              "aten::_nested_tensor_from_mask.default", "aten::_mkldnn_reshape.default",
              "aten::_sparse_coo_tensor_unsafe.default", "aten::set_.source_Storage",
              "aten::from_file.default", "aten::save.default", "aten::_print.default",
              "aten::_sleep.default", "aten::record_stream.default",
              "aten::_index_put_impl_.default")


class RawSession(RawPeerSession):
    """One Peer.Session stream driven frame by frame, as a hostile robot would."""

    def __init__(self, address: str):
        super().__init__(address, timeout=60)
        self.seq = 0

    def call(self, op: str, args: list[ops_pb2.Value], out_id: int) -> None:
        self.seq += 1
        self.send(call=ops_pb2.OpCall(seq=self.seq, op=op, args=args, out_ids=[out_id],
                                      sync=True))

    def fetch(self, tid: int) -> None:
        self.seq += 1
        self.send(fetch=ops_pb2.Fetch(seq=self.seq, id=tid))

    def close(self) -> None:
        self.send(close=ops_pb2.Close())
        super().close()


def ints(*xs: int) -> ops_pb2.Value:
    return ops_pb2.Value(list=ops_pb2.ValueList(items=[ops_pb2.Value(i=x) for x in xs]))


def upload(t: torch.Tensor, bind: int) -> ops_pb2.Value:
    return ops_pb2.Value(tensor=ops_pb2.TensorRef(upload=codec.tensor_data(t), bind_id=bind))


def ref(i: int) -> ops_pb2.Value:
    return ops_pb2.Value(tensor=ops_pb2.TensorRef(id=i))


@pytest.fixture(scope="module")
def gpu_daemon():
    with Launcher() as launcher:
        yield launcher.start("gpu", roles=["gpu"], **TEST_DEFAULTS)


def test_out_of_bounds_alias_is_refused_and_daemon_keeps_serving(gpu_daemon):
    s = RawSession(gpu_daemon.listen)
    try:
        # Finding 1: a 16-byte upload aliased to 65,536 elements, then fetched.
        s.call("aten::clone.default", [upload(torch.arange(4, dtype=torch.float32), bind=1)], 9)
        assert s.recv().WhichOneof("msg") == "result"
        s.call("aten::_reshape_alias.default", [ref(1), ints(65536), ints(1)], 2)
        refused = s.recv()
        assert refused.WhichOneof("msg") == "error", refused
        assert refused.error.code == "OP_NOT_ALLOWED"
        assert "internal or unsafe" in refused.error.message
        s.fetch(2)
        reply = s.recv()
        assert reply.WhichOneof("msg") == "error" and not reply.HasField("fetched"), reply
        # The same stream still computes, and only within the uploaded 16 bytes.
        s.call("aten::add.Tensor", [ref(1), ref(1)], 3)
        assert s.recv().WhichOneof("msg") == "result"
        s.fetch(3)
        fetched = s.recv()
        assert fetched.WhichOneof("msg") == "fetched"
        got = codec.from_tensor_data(fetched.fetched.tensor, torch.device("cpu"))
        assert got.tolist() == [0.0, 2.0, 4.0, 6.0]
    finally:
        s.close()
    # And a new client is served.
    with grpc.insecure_channel(gpu_daemon.listen) as channel:
        reply = peer_pb2_grpc.PeerStub(channel).Ping(peer_pb2.PingRequest(sent_ns=7), timeout=10)
    assert reply.sent_ns == 7 and gpu_daemon.proc.poll() is None


@pytest.mark.parametrize("name", UNSAFE_OPS)
def test_internal_and_unsafe_operators_refused_by_default(name):
    allow = Allowlist()
    assert not allow.allows(name)
    with pytest.raises(Exception, match="internal or unsafe"):
        allow.resolve(name)
    # a plain allow_extra entry does not enable it: only the unsafe: marker does
    assert not Allowlist(allow_extra=[name.split(".")[0], "aten::*"]).allows(name)


def test_unsafe_marker_enables_one_operator_deliberately():
    allow = Allowlist(allow_extra=["unsafe:aten::_reshape_alias"])
    assert allow.allows("aten::_reshape_alias.default")
    assert not allow.allows("aten::_reshape_alias_copy.default")
    assert not allow.allows("aten::as_strided.default")


def test_positive_list_refuses_what_no_model_needs_until_allow_extra_names_it():
    allow = Allowlist()
    for name in ("aten::add.Tensor", "aten::convolution.default", "aten::addmm.default",
                 "aten::_to_copy.default", "aten::copy_.default", BIND_OP,
                 "aten::_local_scalar_dense.default"):
        assert allow.allows(name), name
    # Real, safe, but no inference model sends them: refused, with the way to enable them.
    for name in ("aten::_foreach_add.Scalar", "aten::linalg_svd.default", "aten::fft_fft.default"):
        with pytest.raises(Exception, match="not on this host's allowlist.*allow_extra"):
            allow.resolve(name)
        assert Allowlist(allow_extra=[name.split(".")[0]]).allows(name)
    assert Allowlist(allow_extra=["aten::*"]).allows("aten::linalg_svd.default")
    assert not Allowlist(deny=["aten::add"]).allows("aten::add.Tensor")
    for bad in ("torchvision::nms.nope", "os::system", "aten::add.Tensor; rm -rf /",
                "builtins::eval", "aten::nope.default"):
        assert not allow.allows(bad), bad


def test_reviewed_internal_names_are_memory_safe():
    """The list may hold internal-looking names only when reviewed; ``_unsafe_view`` checks its
    size as ``view`` does, so it cannot reach outside its storage."""
    for name in builtin_entries():
        _, op, _ = opnames.split(name)
        if opnames.unsafe_reason(name) is None and "unsafe" in op:
            assert op.rstrip("_") in opnames.REVIEWED_SAFE, name
        assert opnames.unsafe_reason(name) is None, name
    with pytest.raises(RuntimeError):
        torch.ops.aten._unsafe_view(torch.zeros(4), [65536])


def test_list_is_small_and_classified():
    entries = builtin_entries()
    assert 150 < len(entries) < 700
    assert all(e.reason and e.seen_in and e.modes for e in entries.values())
    names = builtin_names()
    assert len(names) <= len(entries) and "aten::addmm.default" in names
    assert not any("from_file" in n or "_reshape_alias" in n for n in names)


def _observed(source: str) -> set[str]:
    ops: set[str] = set()
    for path in OBSERVED.glob(f"{source}-torch*.json"):
        ops |= set(json.loads(path.read_text())["ops"])
    return ops


@pytest.mark.parametrize("source", ["suite", "bench"])
def test_every_operator_the_suite_and_benchmark_send_is_allowed(source):
    ops = _observed(source)
    assert ops, f"no observations for {source}: run python -m bench.oplist"
    allow = Allowlist(allow_extra=["rrtotest::*"])  # the suite's own library op (custom_op.py)
    missing = sorted(n for n in ops if n.startswith("aten::") and not allow.allows(n))
    assert missing == []


def test_config_rejects_unmarked_unsafe_entry_with_file_key_reason(tmp_path):
    path = tmp_path / "rrtod.yaml"
    path.write_text("executor:\n  allow_extra: ['torchvision::nms', 'aten::_reshape_alias']\n")
    with pytest.raises(ConfigError) as err:
        load(path)
    assert err.value.file == str(path)
    assert err.value.key == "executor.allow_extra[1]"
    assert "internal or unsafe" in err.value.reason and "unsafe:aten::_reshape_alias" in \
        err.value.reason


@pytest.mark.parametrize("entries, why", [
    (["aten::as_strided"], "internal or unsafe"),
    (["aten::_nested_tensor_from_mask.default"], "internal or unsafe"),
    (["unsafe:aten::add"], "not an unsafe operator"),
    (["unsafe:aten::*"], "one by one"),
    (["aten add"], "not an operator name"),
    ([7], "expected an operator name"),
])
def test_config_validation_of_allow_extra(entries, why):
    with pytest.raises(ConfigError, match=why):
        from_mapping({"executor": {"allow_extra": entries}})


def test_config_accepts_marked_unsafe_namespace_and_deny_entries():
    c = from_mapping({"executor": {"allow_extra": ["unsafe:aten::_reshape_alias",
                                                   "torchvision::*", "aten::linalg_svd"],
                                   "deny": ["aten::tanh", "aten::_reshape_alias"]}})
    assert c.executor.allow_extra[0] == "unsafe:aten::_reshape_alias"
    with pytest.raises(ConfigError, match=r"executor\.deny\[0\].*belongs in allow_extra"):
        from_mapping({"executor": {"deny": ["unsafe:aten::_reshape_alias"]}})


def test_uninitialized_creation_never_returns_freed_bytes(tmp_path):
    """``empty`` hands out whatever the allocator held: a block another session freed. The
    host zeroes it. (Without that, about one ``empty`` in seven here returned the 7s.)"""
    from rrto_plugins.torch.executor import TorchExecutor
    from rrtod.executor import ExecutorContext
    from rrtod.gpu.blobstore import BlobStore

    ex = TorchExecutor(ExecutorContext(device="cpu", memory_quota=1 << 20, allow_extra=(),
                                       deny=(), blobs=BlobStore(tmp_path / "b", 1 << 20),
                                       state_dir=tmp_path))
    ex.open(ops_pb2.SessionOpen(app="t", executor="torch"))
    seq = 0
    for i in range(20):
        seq += 1
        a, b = 2 * i + 1, 2 * i + 2
        c = ops_pb2.OpCall(seq=seq, op="aten::clone.default",
                           args=[upload(torch.full((1024,), 7.0), bind=0)], out_ids=[a])
        assert list(ex.handle(ops_pb2.SessionUp(call=c))) == []
        list(ex.handle(ops_pb2.SessionUp(release=ops_pb2.Release(ids=[a]))))
        seq += 1
        c = ops_pb2.OpCall(seq=seq, op="aten::empty.memory_format", args=[ints(1024)],
                           kwargs={"dtype": ops_pb2.Value(dtype="float32")}, out_ids=[b])
        assert list(ex.handle(ops_pb2.SessionUp(call=c))) == []
        (down,) = ex.handle(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=seq, id=b)))
        got = codec.from_tensor_data(down.fetched.tensor, torch.device("cpu"))
        assert not got.any(), f"round {i}: empty returned {int((got == 7).sum())} freed 7s"


def test_rrtoctl_ops_lists_the_list_and_the_config(tmp_path, capsys):
    from rrtod import ctl

    path = tmp_path / "rrtod.yaml"
    path.write_text("executor:\n  allow_extra: ['unsafe:aten::as_strided_']\n  deny: ['aten::gelu']\n")
    assert ctl.main(["--config", str(path), "ops", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert len(listing["builtin"]) == len(builtin_entries())
    assert listing["allow_extra"] == ["unsafe:aten::as_strided_"]
    assert listing["deny"] == ["aten::gelu"]
    assert ctl.main(["--config", str(path), "ops"]) == 0
    table = capsys.readouterr().out
    assert "aten::convolution.default" in table and "conv/matmul" in table
    path.write_text("executor:\n  allow_extra: ['aten::as_strided_']\n")
    assert ctl.main(["--config", str(path), "ops"]) == 1
    assert "executor.allow_extra[0]" in capsys.readouterr().err
