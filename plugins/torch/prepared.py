"""A recorded call decoded once for replay (``PreparedCall``): its operator, its non-tensor
arguments and a hole per tensor argument. The executor fills the holes with an inference's tensors
(``TorchExecutor.run_prepared``); the native loop builds its call templates from the same
(``batch``)."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from rrto.v1 import ops_pb2
from rrtod.wire import BIND_OP

from . import codec

_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}


def written_args(op: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``op``'s schema says it writes (``Tensor(a!)``):
    an in-place operator may change their sizes and strides, not only their values."""
    hit = _WRITTEN.get(op)
    if hit is None:
        hit = _WRITTEN[op] = tuple(
            (i, a.name) for i, a in enumerate(op._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write)
    return hit


Layout = tuple[tuple[int, ...], tuple[int, ...]]  # (shape, stride) the app's proxy describes


def _layout(meta: ops_pb2.TensorMeta) -> Layout:
    return tuple(meta.shape), tuple(meta.stride)


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a (shape, stride) layout spans exactly numel elements: the only layouts the
    host copies an output into, so that a client's strides cannot size an allocation."""
    if len(shape) != len(stride) or any(st < 0 for st in stride):
        return False
    numel = 1
    for size in shape:
        numel *= size
    if numel == 0:
        return True
    return 1 + sum((size - 1) * st for size, st in zip(shape, stride, strict=True)) == numel


class _Hole:
    """Where a tensor argument goes in a prepared call's arguments."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    if type(value) is _Hole:
        return tensors[value.index]
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, tensors) for v in value)
    return value


def _with_int(value: Any, path: list[int], n: int) -> Any:
    """``value`` (an integer, or nested lists of them) with ``n`` at ``path``; lists copied,
    the prepared arguments stay as recorded."""
    if not path:
        return n
    items = list(value)
    items[path[0]] = _with_int(items[path[0]], path[1:], n)
    return type(value)(items)


class PreparedCall:
    """A recorded call decoded once: its operator, its non-tensor arguments, and a hole per
    tensor argument, numbered in ``iter_tensor_refs`` order (positional, then keyword
    arguments by name)."""

    __slots__ = ("op", "what", "args", "kwargs", "top", "layouts", "outs", "counts", "sizes",
                 "written", "plain", "tensors", "native")

    def __init__(self, op: Any, call: ops_pb2.OpCall, device: Any):
        holes = itertools.count()

        def hole(_ref: ops_pb2.TensorRef) -> _Hole:
            return _Hole(next(holes))

        self.op = op
        self.what = f"{call.op} (replayed)"
        self.args = [codec.decode_value(v, hole, device) for v in call.args]
        self.kwargs = {k: codec.decode_value(call.kwargs[k], hole, device)
                       for k in sorted(call.kwargs)}
        self.layouts = [_layout(m) for m in call.out_meta]
        # how many outputs it names: one the app is answered the sizes of has no layouts
        self.outs = len(call.out_ids)
        # Bytes the call allocates, per metadata of its tensor arguments (``size_key``): a
        # replay finds its inputs' metadata here and pays no meta execution.
        self.sizes: dict[Any, int] = {}
        self.written = bool(written_args(op))
        self.counts = not (call.op == BIND_OP and call.args[0].tensor.HasField("persistent"))
        self.tensors = next(holes)  # how many tensor arguments it has
        self.native: bool | None = None  # whether the native loop can run it (``batch``)
        top = [(i, v.index) for i, v in enumerate(self.args) if type(v) is _Hole]
        # The common case: every tensor is a positional argument of its own.
        self.top = top if not self.kwargs and len(top) == self.tensors else None
        # ... of an operator that writes nothing and returns one tensor: ``run_plain``. Its
        # tensors may sit in lists (``index.Tensor``'s indices): ``fill`` places them.
        returns = op._schema.returns
        self.plain = (not self.written and len(returns) == 1
                      and str(returns[0].type) == "Tensor" and len(self.layouts) == 1)

    @staticmethod
    def size_key(tensors: list[torch.Tensor]) -> tuple[Any, ...]:
        return tuple((t.dtype, t.shape, t.stride(), t.storage_offset()) for t in tensors)

    def fill(self, tensors: list[torch.Tensor],
             ints: list[tuple[list[Any], int]] | None = None) -> tuple[list[Any], dict[str, Any]]:
        """The arguments with this inference's tensors and symbolic integers in place."""
        if self.top is not None:
            args: list[Any] = list(self.args)
            for i, j in self.top:
                args[i] = tensors[j]
            kwargs: dict[str, Any] = {}
        else:
            args = [_fill(v, tensors) for v in self.args]
            kwargs = {k: _fill(v, tensors) for k, v in self.kwargs.items()}
        for path, n in ints or ():
            where: Any = kwargs if isinstance(path[0], str) else args
            where[path[0]] = _with_int(where[path[0]], path[1:], n)
        return args, kwargs
