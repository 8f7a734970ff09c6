"""``aten::index.Tensor`` (``x[idx]`` with integer index tensors) described without meta
execution.

A detector picks its boxes, scores and labels with index tensors whose length the data decides
(``boxes[keep]``, ``scores[curr_indices]``): every frame makes new argument sizes, so the
per-signature cache of output templates misses, and meta execution of an ``index`` cost ~220 µs
a call here (RetinaNet's per-class NMS makes dozens a frame). The result follows from sizes
alone (NumPy's advanced indexing): the index tensors broadcast to one shape ``B``; if the
indexed dimensions are adjacent, ``B`` takes their place among the others, else it comes first.
Its dtype is the tensor's, and for a C-contiguous tensor and C-contiguous index tensors the
kernel (TensorIterator over the tensor restrided by the indices) makes a C-contiguous result.
That is the only case described here, with index tensors of one dimension or more (a 0-dim
one selects, and meta execution then gives other strides than the kernel) and a result that is
not empty (an empty one's strides are the kernel's own: 1 034 of 5 246 random empty results
were not C-contiguous, 0 of 6 599 with a size of 1, torch 2.13 and 2.14). A single box of a
class (``boxes[idx]`` with one index, a (1, 4) result) is described too: it was a meta
execution of ~200 us. Boolean masks are not described (their count is the data's, as
``nonzero``'s), nor is anything else: meta execution decides then.
"""

from __future__ import annotations

from typing import Any

import torch

from . import codec

_INDEX = torch.ops.aten.index.Tensor
_INTEGERS = (torch.int64, torch.int32)


def indexed(func: Any, args: tuple, kwargs: dict) -> tuple[tuple[int, ...], tuple[int, ...],
                                                            torch.dtype] | None:
    """(shape, strides, dtype) of ``func(*args, **kwargs)`` if it is an ``index.Tensor``
    described here, else None."""
    if func is not _INDEX or kwargs or len(args) != 2:
        return None
    x, indices = args
    if not isinstance(x, torch.Tensor) or not isinstance(indices, (list, tuple)) or not indices:
        return None
    shape = tuple(x.shape)
    if len(indices) > len(shape) or x.stride() != codec.contiguous_strides(shape):
        return None
    at: list[int] = []
    tensors: list[torch.Tensor] = []
    for d, i in enumerate(indices):
        if i is None:
            continue
        if (not isinstance(i, torch.Tensor) or i.dtype not in _INTEGERS or not i.dim()
                or i.stride() != codec.contiguous_strides(tuple(i.shape))):
            return None
        at.append(d)
        tensors.append(i)
    if not tensors:
        return None
    if len(tensors) == 1:  # one index (``boxes[keep]``): nothing to broadcast (~7 us less)
        b = tuple(tensors[0].shape)
    else:
        try:
            b = tuple(torch.broadcast_shapes(*(tuple(t.shape) for t in tensors)))
        except RuntimeError:
            return None  # the host reports the app's error verbatim
    if at == list(range(at[0], at[-1] + 1)):  # adjacent: in their place
        out = (*shape[:at[0]], *b, *shape[at[-1] + 1:])
    else:
        out = (*b, *(s for d, s in enumerate(shape) if d not in at))
    if not all(out):
        # an empty result leaves its strides to the kernel (stride 0 where C-contiguous says
        # 9), and an index into an empty dimension is the host's error to report
        return None
    return out, codec.contiguous_strides(out), x.dtype
