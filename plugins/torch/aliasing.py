"""What a recorded call writes and what its outputs share storage with, from its operator's
schema: the host and the shim must agree on when a replayed output is final.

An output is final after the last call that writes its storage: the call that makes it, a later
one that writes it in place, or one that writes a view of it (``scores[i, :] = v`` writes
``scores`` through ``select``; torchvision's keypoint and mask post-processing fill a buffer
so, then return the buffer). The host pushes an output then, and the shim takes a push only
after that call (``rrtod.wire.final_writes``, fed by these two functions on both ends).
"""

from __future__ import annotations

from typing import Any

from rrto.v1 import ops_pb2


def _training(call: ops_pb2.OpCall) -> bool:
    return len(call.args) > 5 and call.args[5].WhichOneof("kind") == "b" and call.args[5].b


# Composite operators that update running statistics in place although their schema does not
# say so: name -> (when, argument positions written).
HIDDEN_WRITES: dict[str, tuple[Any, tuple[int, ...]]] = {
    f"aten::{name}.default": (_training, (3, 4))
    for name in ("batch_norm", "native_batch_norm", "_batch_norm_impl_index", "cudnn_batch_norm",
                 "miopen_batch_norm", "instance_norm")
}


def _tensor_id(call: ops_pb2.OpCall, position: int, name: str) -> int:
    v = call.args[position] if position < len(call.args) else call.kwargs.get(name)
    return v.tensor.id if v is not None and v.WhichOneof("kind") == "tensor" else 0


def written_ids(op: Any, call: ops_pb2.OpCall) -> list[int]:
    """Ids of the tensor arguments ``call`` (of OpOverload ``op``) writes in place: those its
    schema marks ``Tensor(a!)``, and the running statistics a batch norm in training mode
    updates without saying so."""
    ids = []
    hidden = HIDDEN_WRITES.get(call.op)
    if hidden is not None and hidden[0](call):
        ids += [call.args[i].tensor.id for i in hidden[1]
                if i < len(call.args) and call.args[i].tensor.id]
    for i, arg in enumerate(op._schema.arguments):
        info = arg.alias_info
        if info is not None and info.is_write:
            tid = _tensor_id(call, i, arg.name)
            if tid:
                ids.append(tid)
    return ids


def viewed_ids(op: Any, call: ops_pb2.OpCall) -> list[int]:
    """Per output id of ``call``: the id of the tensor argument whose storage it shares (a
    view, ``Tensor(a) self -> Tensor(a)``, or an in-place op's ``self``), 0 for new storage.
    A ``Tensor(a)[]`` return (``split``, ``unbind``) shares it for every output."""
    schema = op._schema
    by_set: dict[str, int] = {}
    wildcard = 0  # ``Tensor(a -> *) self``: what a ``Tensor(a)[]`` return's elements view
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None:
            tid = _tensor_id(call, i, arg.name)
            if tid:
                for s in arg.alias_info.before_set:
                    by_set[s] = tid
                if "*" in arg.alias_info.after_set:
                    wildcard = wildcard or tid

    def source(ret: Any) -> int:
        info = ret.alias_info
        if info is None:
            return 0
        if not info.before_set:  # a list's alias shows only on its argument's ``-> *``
            return wildcard
        return next((by_set[s] for s in info.before_set if s in by_set), 0)

    returns, n = schema.returns, len(call.out_ids)
    if len(returns) == n:
        return [source(r) for r in returns]
    if len(returns) == 1:
        return [source(returns[0])] * n
    return [0] * n
