"""Basic indexing of a proxy (``x[a:b, i]``, ``x[a:b] = v``) made the same calls whatever the
slice bounds' values.

PyTorch's indexing makes no ``slice`` call for a slice that spans its whole dimension (start 0,
stop at or past the size, step 1): ``x[0:4]`` of a 4-row tensor is ``x`` itself. Where the
bounds come from the data, the calls then depend on the values: torchvision's mask pasting
(``im_mask[y0:y1, x0:x1] = mask[y0 - box[1]:y1 - box[1], ...]``) makes one ``slice`` fewer for
a box whose mask fills the image's width, and a replayed Mask R-CNN frame with such a box left
its sequence (2 of its 13 misses in 70 frames, docs/benchmark.md, "2026-11-30").

Here an index with a slice that names a bound or a step (``a:b``, ``a:``, ``::2``; not a bare
``:``, whose elision never depends on data) is applied one dimension at a time with the calls
PyTorch makes when it slices (``aten::slice.Tensor`` with the same start, stop and step,
``select`` for an integer, ``unsqueeze`` for ``None``), a ``slice`` for every such slice. An
assignment slices so, then assigns to the whole view (``view[...] = value``: PyTorch's own
handling of the value, broadcasting and scalars). Every other index (tensors, lists, booleans,
more indices than dimensions) is PyTorch's, unchanged.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

_SLICE = torch.ops.aten.slice.Tensor
_SELECT = torch.ops.aten.select.int
_UNSQUEEZE = torch.ops.aten.unsqueeze.default
_SCALAR = torch.ops.aten._local_scalar_dense.default
_END = (1 << 63) - 1  # a slice's stop when it names none (as PyTorch passes it)


def bounded(index: Any) -> bool:
    """Whether ``index`` is a basic index (integers, slices, ``None``, one ``...``) with a
    slice that names a bound or a step: one applied here (``view``)."""
    items = index if type(index) is tuple else (index,)
    found = False
    for item in items:
        kind = type(item)
        if kind is slice:
            if item.start is not None or item.stop is not None or item.step is not None:
                found = True
        elif kind is not int and item is not None and item is not Ellipsis:
            return False  # a tensor, a list, a bool: PyTorch's advanced indexing
    return found and sum(1 for item in items if item is Ellipsis) <= 1


def _pytorch(t: torch.Tensor, index: Any) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.__getitem__(t, index)


def _bound(value: Any, default: int) -> int:
    """A slice bound as PyTorch takes it: an integer tensor's value by the call PyTorch's own
    slicing makes (``_local_scalar_dense``, an operator a replay answers), anything else by
    its ``__index__``."""
    if value is None:
        return default
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype is not torch.bool:
        return int(_SCALAR(value))
    return operator.index(value)


def view(t: torch.Tensor, index: Any) -> torch.Tensor:
    """``t[index]`` for an index ``bounded`` accepts, with a ``slice`` call for each slice that
    names a bound or a step. An index PyTorch would refuse (more indices than dimensions, a
    zero step, an integer out of range) raises as PyTorch raises."""
    items = index if type(index) is tuple else (index,)
    used = sum(1 for item in items if item is not None and item is not Ellipsis)
    if used > t.dim():
        return _pytorch(t, index)  # its own error
    out, dim = t, 0
    for item in items:
        if item is Ellipsis:
            dim += t.dim() - used
        elif item is None:
            out = _UNSQUEEZE(out, dim)
            dim += 1
        elif type(item) is int:
            out = _SELECT(out, dim, item)
        elif item.start is None and item.stop is None and item.step is None:
            dim += 1  # ``:``, left out as PyTorch leaves it out
        else:
            start, stop = _bound(item.start, 0), _bound(item.stop, _END)
            step = _bound(item.step, 1)
            if step <= 0:
                return _pytorch(t, index)  # its own error
            out = _SLICE(out, dim, start, stop) if step == 1 else _SLICE(out, dim, start, stop,
                                                                          step)
            dim += 1
    return out
