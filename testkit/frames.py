"""The frames an app's shim sends the robot daemon (``SessionUp``: operator calls and
downloads), built by hand for the recorder's and the search's tests and benchmark: calls are
numbered and output ids allocated as the shim does, a weight is a persistent tensor's name
(``bytes``), an int an earlier output's id, anything else an upload of fresh data."""

from __future__ import annotations

from rrto.v1 import ops_pb2
from rrtod.robot.oplog import OpLog

META = ops_pb2.TensorMeta(dtype="float32", shape=[1, 8], stride=[8, 1], device="cpu")
W1, W2, W3 = b"w1" * 8, b"w2" * 8, b"w3" * 8


class ShimFrames:
    """Builds frames; each goes to ``record``, which a subclass defines."""

    meta = META  # of every upload and output
    upload = b"\0" * 28  # an upload's bytes, then the call's number: fresh data every time

    def __init__(self) -> None:
        self.seq = 0
        self.next_id = 1

    def record(self, frame: ops_pb2.SessionUp) -> None:
        raise NotImplementedError

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def call(self, op: str, *inputs: object, outs: int = 1, scalar: float = 0.0,
             out_ids: list[int] | None = None) -> list[int]:
        """``out_ids``: the ids an in-place op returns (the ids it wrote)."""
        self.seq += 1
        c = ops_pb2.OpCall(seq=self.seq, op=op, grad_mode=ops_pb2.INFERENCE_MODE)
        for x in inputs:
            v = c.args.add()
            if isinstance(x, int):
                v.tensor.id = x
            elif isinstance(x, bytes):
                v.tensor.persistent = x
            else:  # an upload of fresh data
                v.tensor.upload.meta.CopyFrom(self.meta)
                v.tensor.upload.data = self.upload + self.seq.to_bytes(4, "little")
        c.args.add().f = scalar
        out = out_ids if out_ids is not None else [self._id() for _ in range(outs)]
        c.out_ids.extend(out)
        for _ in out:
            c.out_meta.add().CopyFrom(self.meta)
        self.record(ops_pb2.SessionUp(call=c))
        return out

    def fetch(self, oid: int) -> None:
        self.seq += 1
        self.record(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=self.seq, id=oid)))


class App(ShimFrames):
    """An app whose frames go into an op log, as the relay records them."""

    def __init__(self) -> None:
        super().__init__()
        self.log = OpLog()

    def record(self, frame: ops_pb2.SessionUp) -> None:
        self.log.record(frame)


def cnn(app: ShimFrames, grid: int | None = None) -> None:
    """One inference of a small detector: convolutions, a residual add, a split into boxes and
    scores, top-k; ``grid`` (an id) is a constant built before the first inference."""
    (x,) = app.call("aten::conv2d", "img", W1)
    (x,) = app.call("aten::relu", x)
    (y,) = app.call("aten::conv2d", x, W2)
    (y,) = app.call("aten::add.Tensor", y, x)
    if grid is not None:
        (y,) = app.call("aten::add.Tensor", y, grid, scalar=2.0)
    boxes, scores = app.call("aten::split", y, outs=2)
    (scores,) = app.call("aten::sigmoid", scores)
    (top,) = app.call("aten::topk", scores, W3)
    app.fetch(boxes)
    app.fetch(scores)
    app.fetch(top)
