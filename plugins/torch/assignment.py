"""Indexed assignment of a value with leading ones: the same calls whatever the data's count.

``result[idx] = v`` views ``v`` without its leading size-1 dimensions before ``index_put_``
whenever it has any (PyTorch's NumPy rule, in ``THPVariable_setitem``). Where ``v`` holds as
many rows as the data decided (torchvision's ``MultiScaleRoIAlign`` writes each feature level's
pooled boxes so), a frame whose level got exactly one box makes an ``aten::view`` the others
lack: which calls an inference makes then depends on the data, and with four levels a detector
goes one of sixteen ways, each a sequence of its own to learn.

So under ``__setitem__`` of a proxy with leading ones the shim does not send that view; it
answers it with a proxy on the value's own handle and looks at the call that takes it:

- ``index_put_`` gets the value itself. Broadcasting adds leading ones where they are missing,
  so both give the same values whenever the indexed shape has at least as many dimensions as
  the value (checked here; the count's rows and no others are written either way);
- any other call (``copy_`` of a basic slice, an indexed shape of fewer dimensions) gets the
  view, sent then, right before it, as it would have been.

The deferred view is the last thing ``__setitem__`` computes before the call that takes it, so
nothing else can see it. Recorded and replayed inferences thus call the same operators for a
count of one as for any other.
"""

from __future__ import annotations

from typing import Any

import torch

from .proxy import RemoteTensor, new_proxy
from .session_api import Session

_VIEW = torch.ops.aten.view.default
_INDEX_PUT = (torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default)


def leading_ones(shape: Any) -> int:
    """How many of ``shape``'s first sizes are 1: what PyTorch's ``slicePrefix1sSize`` strips
    (all of them for a shape of ones only)."""
    k = 0
    for s in shape:
        if s != 1:
            break
        k += 1
    return k


class Assignment:
    """One ``__setitem__`` of a proxy value with leading ones, in the thread making it."""

    __slots__ = ("value", "sizes", "view", "done")

    def __init__(self, value: RemoteTensor):
        self.value = value
        self.sizes = list(value.shape[leading_ones(value.shape):])
        self.view: RemoteTensor | None = None
        self.done = False

    def defer(self, func: Any, args: tuple) -> RemoteTensor | None:
        """The value's view without its leading ones, answered here (None: another call)."""
        if (self.view is not None or func is not _VIEW or args[0] is not self.value
                or list(args[1]) != self.sizes):
            return None
        v = self.value
        k = v.dim() - len(self.sizes)
        self.view = new_proxy(v._rrto_handle, self.sizes, v.stride()[k:], v.storage_offset(),
                              v.dtype, v.device, v.requires_grad)
        return self.view

    def taken(self, session: Session, func: Any, args: tuple) -> tuple:
        """``args`` of the call that takes the deferred view: with the value itself where
        ``index_put_`` broadcasts it to the same result, else with the view, sent now."""
        if self.view is None or not any(a is self.view for a in args):
            return args
        self.done = True
        if func in _INDEX_PUT and len(args) > 2 and args[2] is self.view and _fits(
                args[0], args[1], self.value) and session.lost is None:
            put: Any = self.value
        else:
            put = session.dispatch(_VIEW, (self.value, self.sizes), {})
        return tuple(put if a is self.view else a for a in args)


def _fits(target: torch.Tensor, indices: Any, value: torch.Tensor) -> bool:
    """``value`` broadcasts to the shape ``target[indices]`` has, leading ones and all: that
    shape has as many dimensions (the view's sizes, without them, already broadcast)."""
    # per index tensor: (dimensions it indexes, dimensions it makes); a mask makes one
    dims = [(i.dim(), 1) if i.dtype in (torch.bool, torch.uint8) else (1, i.dim())
            for i in indices if i is not None]
    if not dims:
        return False
    return value.dim() <= target.dim() - sum(d for d, _ in dims) + max(m for _, m in dims)
