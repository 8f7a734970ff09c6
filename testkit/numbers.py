"""A framework-free host executor over numbers (``NumberExecutor``) for the host replay tests:
each tensor is one float64, so what a replay computed can be read off its pushes."""

from __future__ import annotations

import struct

from rrto.v1 import ops_pb2


def num(ref_value: float) -> ops_pb2.TensorData:
    return ops_pb2.TensorData(meta=ops_pb2.TensorMeta(dtype="float64", shape=[]),
                              data=struct.pack("<d", ref_value))


class NumberExecutor:
    """ops: ``add(a, b)``, ``mul(a, b)``, ``add_(a, b)`` (in place on a). Declares a replay
    extension without ``prepare`` support: every call replays through ``handle``."""

    @property
    def replay(self) -> NumberExecutor:
        return self

    def prepare(self, c: ops_pb2.OpCall) -> None:
        return None  # the generic path

    def run_prepared(self, prepared, refs, out_ids, ints=None, want_meta=False):
        raise AssertionError("never prepared")

    def __init__(self) -> None:
        self.store: dict[int, float] = {100: 10.0}  # 100: a constant made before the steady state
        self.calls: list[str] = []

    def _value(self, ref: ops_pb2.TensorRef) -> float:
        kind = ref.WhichOneof("ref")
        if kind == "id":
            return self.store[ref.id]
        value = struct.unpack("<d", ref.upload.data)[0]
        if ref.bind_id:
            self.store[ref.bind_id] = value
        return value

    def handle(self, frame: ops_pb2.SessionUp):
        kind = frame.WhichOneof("msg")
        if kind == "call":
            c = frame.call
            if c.op == "scale":  # a * an integer argument
                self.store[c.out_ids[0]] = self._value(c.args[0].tensor) * c.args[1].i
                self.calls.append(f"scale {c.args[1].i}")
                return
            a, b = (self._value(v.tensor) for v in c.args)
            self.calls.append(c.op)
            if c.op == "fail":
                yield ops_pb2.SessionDown(error=ops_pb2.Error(code="OP_FAILED", message="no"))
                return
            if c.op == "bump":  # returns a + b, and counts in b: written, not returned
                self.store[c.args[1].tensor.id] = b + 1
            self.store[c.out_ids[0]] = {"add": a + b, "mul": a * b, "add_": a + b,
                                        "bump": a + b}[c.op]
        elif kind == "fetch":
            yield ops_pb2.SessionDown(fetched=ops_pb2.Fetched(
                seq=frame.fetch.seq, tensor=num(self.store[frame.fetch.id])))
        elif kind == "release":
            for i in frame.release.ids:
                self.store.pop(i, None)

    def written_ids(self, c: ops_pb2.OpCall) -> list[int]:
        return [c.args[1].tensor.id] if c.op == "bump" else []

    def snapshot(self, ids):
        return {i: self.store[i] for i in ids}

    def restore(self, token):
        self.store.update(token)

    def missing(self, ids):
        return [i for i in ids if i not in self.store]

    def viewed_ids(self, c: ops_pb2.OpCall) -> list[int]:
        return [0] * len(c.out_ids)  # no views among these operators

    def shape(self, tid):  # a number n stands for a tensor of n elements (a loop's count)
        return (int(self.store[tid]),) if tid in self.store and self.store[tid] >= 0 else None

    def scalar(self, tid):
        return int(self.store[tid]) if tid in self.store else None
