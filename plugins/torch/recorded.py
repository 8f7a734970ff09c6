"""How a replayed step's recorded arguments are compared with a call's (``replay.py``, and
the hot path's descriptions, ``hotpath.py``): tensors stand as ``TENSOR`` in an argument
structure, and the other values compare with ``==`` only where that is safe."""

from __future__ import annotations

from typing import Any

import torch

from rrto.v1 import ops_pb2

TENSOR = object()  # a tensor's place in an argument structure


class Placeholder:
    """A recorded tensor argument, where ``strip`` finds it."""

    __slots__ = ("ref",)

    def __init__(self, ref: ops_pb2.TensorRef):
        self.ref = ref


def strip(x: Any, found: list[Any]) -> Any:
    """``x`` with every tensor (or placeholder) replaced by ``TENSOR``, collected in order."""
    if isinstance(x, (torch.Tensor, Placeholder)):
        found.append(x)
        return TENSOR
    if isinstance(x, (list, tuple)):
        return type(x)([strip(v, found) for v in x])
    return x


SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
           torch.memory_format)


def is_plain(v: Any) -> bool:
    """A value compared with ``==`` safely: never a tensor (whose ``==`` is an operator)."""
    if isinstance(v, (list, tuple)):
        return all(type(x) in SCALARS for x in v)
    return type(v) in SCALARS


def same_plain(a: Any, v: Any) -> bool:
    """``a`` is the recorded plain value ``v``: equal, and of its type (1 and 1.0 are equal
    but make different result dtypes) or a subclass of it (an IntEnum where an int was)."""
    return ((type(a) is type(v) or isinstance(a, type(v))) and is_plain(a) and a == v)
