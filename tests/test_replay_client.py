"""The shim's replay client without a connection: what it keeps of the definitions and answers
the host sends it."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from rrto.v1 import ops_pb2
from rrto_plugins.torch.replay import MAX_PER_THREAD, MISS, ReplayClient, decode_answer


class Session:
    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.released: list[int] = []
        self.lost: str | None = None
        self.sent: list[Any] = []

    def send_frames(self, frames: list[Any]) -> None:
        self.sent += frames


def definition(seq_id: int) -> ops_pb2.SequenceDef:
    d = ops_pb2.SequenceDef(id=seq_id, local_ids=[1, 2], outputs=[2])
    call = d.calls.add(op="aten::relu.default", out_ids=[2])
    call.args.add().tensor.CopyFrom(ops_pb2.TensorRef(bind_id=1, upload=ops_pb2.TensorData(
        meta=ops_pb2.TensorMeta(dtype="float32", shape=[4], stride=[1]))))
    d.sources.add(kind=ops_pb2.SeqSource.INPUT)
    return d


def test_a_thread_keeps_a_bounded_number_of_sequences():
    """Variants (input shapes, models, branches) each get a sequence; beyond the bound the
    one found longest ago is dropped, and the robot is told (it drops it on the host)."""
    client = ReplayClient(Session())  # type: ignore[arg-type]
    for i in range(1, MAX_PER_THREAD + 2):
        client.define(definition(i))
    assert [s.id for s in client.sequences[0]] == list(range(MAX_PER_THREAD + 1, 1, -1))
    assert client._give_up == [1] and client.counters["dropped"] == 1


def test_an_answer_decodes_as_forwarding_would_or_not_at_all():
    """A ``ReplayAnswer`` from the network: proxies with the sizes the host found, a value;
    metadata that cannot be a tensor's is no answer (MISS: the call is forwarded)."""
    session = Session()
    ok = ops_pb2.OpResult(outs=[ops_pb2.TensorMeta(dtype="int64", shape=[3, 1], stride=[1, 1])],
                          value=ops_pb2.Value(tensor=ops_pb2.TensorRef(id=7)))
    t = decode_answer(ok, session, torch.device("cpu"))  # type: ignore[arg-type]
    assert tuple(t.shape) == (3, 1) and t.dtype == torch.int64 and t._rrto_handle.id == 7
    assert decode_answer(ops_pb2.OpResult(value=ops_pb2.Value(b=True)), session,  # type: ignore[arg-type]
                         torch.device("cpu")) is True
    bad = ops_pb2.OpResult(outs=[ops_pb2.TensorMeta(dtype="int64", shape=[3], stride=[1, 1])],
                           value=ops_pb2.Value(tensor=ops_pb2.TensorRef(id=7)))
    assert decode_answer(bad, session, torch.device("cpu")) is MISS  # type: ignore[arg-type]
    missing = ops_pb2.OpResult(value=ops_pb2.Value(tensor=ops_pb2.TensorRef(id=7)))
    assert decode_answer(missing, session, torch.device("cpu")) is MISS  # type: ignore[arg-type]
