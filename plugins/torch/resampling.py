"""Image resampling calls (``upsample_*``) to a given size, described without meta execution.

``F.interpolate(x, size=...)`` reaches the dispatcher as ``aten::upsample_<mode>.default(x,
output_size, ...)``: one output of ``x``'s batch and channel sizes and ``output_size``, in
``x``'s dtype, laid out in ``x``'s suggested memory format. Their meta kernels are Python
decompositions: 37 ms a call here for a 28×28 mask. Mask R-CNN's post-processing resizes each
detection's mask to its box's own size, so every call is a new signature and each end paid
that per box (the app for a result's template, ``metadata.MetaCache``; the host for the bytes
its quota admits, ``sizing``). Only inputs whose suggested format is the contiguous one are
described here (the output is then C-contiguous, as every kernel allocates it); channels-last
inputs keep meta execution, which knows each device's layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import suggest_memory_format

from .codec import contiguous_strides

_UPSAMPLE = frozenset({
    "aten::upsample_nearest1d", "aten::upsample_nearest2d", "aten::upsample_nearest3d",
    "aten::_upsample_nearest_exact1d", "aten::_upsample_nearest_exact2d",
    "aten::_upsample_nearest_exact3d", "aten::upsample_linear1d", "aten::upsample_bilinear2d",
    "aten::upsample_trilinear3d", "aten::upsample_bicubic2d", "aten::_upsample_bilinear2d_aa",
    "aten::_upsample_bicubic2d_aa"})


def resized(op: Any, args: Any, kwargs: dict[str, Any]
            ) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype] | None:
    """(shape, strides, dtype) of the output of a resampling call to an explicit size; None
    when this is not one (or its input is not laid out contiguously): meta execution decides.
    Both overloads: ``.default`` and ``.vec`` (``output_size`` optional, beside
    ``scale_factors``), which ``F.interpolate`` reaches on a tensor subclass; a ``.vec`` call
    given only scale factors is left to meta execution."""
    if getattr(op, "_overloadname", None) not in ("default", "vec") \
            or op._schema.name not in _UPSAMPLE:
        return None
    if len(args) < 2 or "output_size" in kwargs:
        return None
    x, size = args[0], args[1]
    if not isinstance(x, torch.Tensor) or x.layout is not torch.strided:
        return None
    if not isinstance(size, (list, tuple)) or len(size) != x.dim() - 2 or not all(
            type(s) is int and s > 0 for s in size):
        return None
    if suggest_memory_format(x) is not torch.contiguous_format:
        return None
    shape = (*x.shape[:2], *size)
    return shape, contiguous_strides(shape), x.dtype
