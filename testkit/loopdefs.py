"""Definitions with loops for the tests and the fuzz targets (``rrtod.loops``): a loop with
variants as torchvision's mask pasting records one, and how two compiles of one differ."""

from __future__ import annotations

import dataclasses
from typing import Any

from rrto.v1 import ops_pb2

SRC = ops_pb2.SeqSource


def tensor(i: int) -> ops_pb2.Value:
    return ops_pb2.Value(tensor=ops_pb2.TensorRef(id=i))


def call(op: str, outs: list[int], *args: ops_pb2.Value) -> ops_pb2.OpCall:
    return ops_pb2.OpCall(op=op, out_ids=outs, args=list(args))


def branched() -> ops_pb2.SequenceDef:
    """keep = nonzero(x) -> 10;  for i in range(len(keep)):  row = keep.select(0, i) -> 20;
    pos = row > 0 -> 21 (the app reads it: a guard);  if pos: y = row * 2 -> 30;  else:
    n = -row -> 31, y = n + 1 -> 32;  then total = keep.sum() -> 40.  Outputs: the guard, each
    iteration's y, and total."""
    d = ops_pb2.SequenceDef(id=7, thread=1, local_ids=[10, 20, 21, 40], outputs=[21, 40])
    x = ops_pb2.Value(tensor=ops_pb2.TensorRef(upload=ops_pb2.TensorData(
        meta=ops_pb2.TensorMeta(dtype="float32", shape=[4]))))
    d.calls.extend([
        call("aten::nonzero", [10], x),
        call("aten::select.int", [20], tensor(10), ops_pb2.Value(i=0), ops_pb2.Value(i=0)),
        call("aten::gt.Scalar", [21], tensor(20), ops_pb2.Value(i=0)),
        call("aten::sum", [40], tensor(10)),
    ])
    d.sources.add(kind=SRC.INPUT)
    for rid in (10, 20, 10):
        d.sources.add(kind=SRC.PRODUCED, id=rid)
    d.symbols.add(call=1, arg=2, index=True)
    loop = d.loops.add(start=1, body=2, tensor=10, dim=0, guards=[21])
    pos = loop.variants.add(when=[1.0], local_ids=[30], outputs=[30])
    pos.calls.append(call("aten::mul.Scalar", [30], tensor(20), ops_pb2.Value(i=2)))
    pos.sources.add(kind=SRC.PRODUCED, id=20)
    neg = loop.variants.add(when=[0.0], local_ids=[31, 32], outputs=[32])
    neg.calls.extend([call("aten::neg", [31], tensor(20)),
                      call("aten::add.Scalar", [32], tensor(31), ops_pb2.Value(i=1))])
    neg.sources.add(kind=SRC.PRODUCED, id=20)
    neg.sources.add(kind=SRC.PRODUCED, id=31)
    return d


def same_compiled(a: Any, b: Any) -> list[str]:
    """The fields in which two compiled sequences differ (how much they shared aside)."""
    return [f.name for f in dataclasses.fields(a)
            if f.name != "shared" and getattr(a, f.name) != getattr(b, f.name)]
