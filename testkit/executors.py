"""A torch executor driven with raw frames: the helpers of the memory-safety and native-loop
tests (an executor on a temporary blob store, refs, uploads, calls and fetches as protobuf)."""

from __future__ import annotations

import torch

from rrto.v1 import ops_pb2
from rrto_plugins.torch import codec
from rrto_plugins.torch.executor import TorchExecutor
from rrtod.executor import ExecutorContext
from rrtod.gpu.blobstore import BlobStore

MiB = 1 << 20


class AllowAll:
    """Every operator that exists, as if the allowlist admitted it by mistake."""

    def resolve(self, name: str):
        ns, _, rest = name.partition("::")
        op, _, overload = rest.partition(".")
        return getattr(getattr(getattr(torch.ops, ns), op), overload or "default")


def make(tmp_path, quota=MiB, host=None, allow_all=False) -> TorchExecutor:
    ctx = ExecutorContext(device="cpu", memory_quota=quota, allow_extra=(), deny=(),
                          blobs=BlobStore(tmp_path / "blobs", MiB), state_dir=tmp_path,
                          host_memory=host)
    ex = TorchExecutor(ctx)
    ex.open(ops_pb2.SessionOpen(app="t", executor="torch"))
    if allow_all:
        ex.allow = AllowAll()
    return ex


def up(t: torch.Tensor, bind: int = 0) -> ops_pb2.Value:
    return ops_pb2.Value(tensor=ops_pb2.TensorRef(upload=codec.tensor_data(t), bind_id=bind))


def ref(i: int) -> ops_pb2.Value:
    return ops_pb2.Value(tensor=ops_pb2.TensorRef(id=i))


def ints(*v: int) -> ops_pb2.Value:
    return ops_pb2.Value(list=ops_pb2.ValueList(items=[ops_pb2.Value(i=i) for i in v]))


def call(ex, op, args, out_ids=(), seq=1, out_meta=(), **kw) -> list[ops_pb2.SessionDown]:
    c = ops_pb2.OpCall(seq=seq, op=op, args=args, out_ids=list(out_ids), out_meta=list(out_meta),
                       **kw)
    return list(ex.handle(ops_pb2.SessionUp(call=c)))


def fetch(ex, i, seq=99) -> ops_pb2.SessionDown:
    (down,) = ex.handle(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=seq, id=i)))
    return down


def meta(shape, dtype="float32") -> ops_pb2.TensorMeta:
    stride, n = [], 1
    for s in reversed(shape):
        stride.insert(0, n)
        n *= s
    return ops_pb2.TensorMeta(dtype=dtype, shape=shape, stride=stride, device="cpu")


# -- finding 1: out-of-bounds views -----------------------------------------------------------
