"""Local operators (Hybrid-Parallel's LOP): an operator whose output rows each depend on a band
of its input's rows, so that robot and host can each compute a band of the rows of one value.

The row dimension is the second last (``H`` of ``NCHW``, and of the ``NHW`` maps a per-pixel
``argmax`` over channels makes). Three kinds:

- ``same``: output row ``r`` reads input row ``r`` (element-wise operators, batch norm in
  inference, a channel ``cat`` or ``split``, a reduction over a dimension before the rows);
- ``window``: output rows ``[lo, hi)`` read input rows ``[lo*s - p, (hi-1)*s - p + d(k-1) + 1)``
  (2-d convolution and pooling), the rows outside the input being the operator's padding;
- ``upsample``: nearest-neighbour upsampling by an integer factor ``f``: row ``r`` reads ``r // f``.

``rule`` says, from a recorded call alone (``ops_pb2.OpCall``, the shapes of its tensors), which
kind a call is, which of its tensors carry rows, and the input rows a band of output rows needs.
It is conservative where the recording leaves a parameter out (a convolution's kernel height,
from its input and output heights): what it asks for always covers what ``run`` reads. ``run``
computes rows ``[lo, hi)`` of a call's outputs from tensors that hold a band of their rows each
(``starts``: the first row each holds), with the live arguments' exact parameters: it takes
the rows it needs, pads where the band meets the input's edge as the operator pads there (zeros
for a convolution, nothing for a max), and runs the operator with no padding along the rows.

A band computed so is the operator's result on those rows up to the order of floating-point
sums: a convolution library picks its algorithm by shape, so a band may differ from the same
rows of the whole in the last bits (docs/scheduling.md, "Hybrid-Parallel").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rrto.v1 import ops_pb2

ROW = -2  # the row dimension, from the end

# Operators whose output row r reads row r of each input that has rows (broadcasting inputs
# without rows, such as a per-channel scale, are read whole).
_ELEMENTWISE = frozenset(f"aten::{n}" for n in (
    "relu.default", "relu_.default", "silu.default", "silu_.default", "sigmoid.default",
    "tanh.default", "hardswish.default", "hardsigmoid.default", "gelu.default", "elu.default",
    "leaky_relu.default", "hardtanh.default", "clamp.default", "clamp_min.default", "exp.default",
    "neg.default", "abs.default", "sqrt.default", "rsqrt.default", "log.default",
    "add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "add.Scalar", "sub.Scalar",
    "mul.Scalar", "div.Scalar", "pow.Tensor_Scalar", "maximum.default", "minimum.default",
    "where.self", "clone.default", "contiguous.default", "_to_copy.default",
    "native_batch_norm.default", "_native_batch_norm_legit_no_training.default",
    "batch_norm.default",
    "hardtanh_.default", "softmax.int", "_softmax.default", "log_softmax.int",
    "_log_softmax.default", "argmax.default", "argmin.default", "amax.default", "sum.dim_IntList",
    "mean.dim", "cat.default", "split.Tensor", "split_with_sizes.default", "chunk.default"))
# Of those, the ones that act along a dimension: local only when it is not the rows'.
_ALONG = {"softmax.int": 1, "_softmax.default": 1, "log_softmax.int": 1,
          "_log_softmax.default": 1, "argmax.default": 1, "argmin.default": 1,
          "amax.default": 1, "sum.dim_IntList": 1, "mean.dim": 1, "cat.default": 1,
          "split.Tensor": 2, "split_with_sizes.default": 2, "chunk.default": 2}
_CONV = {"aten::convolution.default", "aten::conv2d.default"}
_WINDOW = {*_CONV, "aten::max_pool2d_with_indices.default", "aten::max_pool2d.default"}
_UPSAMPLE = {"aten::upsample_nearest2d.default", "aten::upsample_nearest2d.vec"}

Shape = Sequence[int] | None


@dataclass(frozen=True)
class Rule:
    """What a call's output rows read of its inputs (see the module's docstring)."""

    op: str  # the operator's qualified name
    kind: str  # "same", "window" or "upsample"
    rows_in: tuple[bool, ...]  # per tensor argument (``iter_tensor_refs`` order): has rows
    rows_out: tuple[bool, ...]  # per output: has rows (else both sides make it whole)
    height: int  # the input's rows (of each argument that has them)
    k: int = 1  # window: extent (kernel height), stride, padding, dilation
    s: int = 1
    p: int = 0
    d: int = 1
    f: int = 1  # upsample: factor

    def need(self, lo: int, hi: int) -> tuple[int, int]:
        """The input rows ``[lo', hi')`` that output rows ``[lo, hi)`` read, clipped to the
        input (an empty band for an empty one)."""
        if hi <= lo:
            return 0, 0
        if self.kind == "window":
            a, b = lo * self.s - self.p, (hi - 1) * self.s - self.p + self.d * (self.k - 1) + 1
        elif self.kind == "upsample":
            a, b = lo // self.f, (hi - 1) // self.f + 1
        else:
            a, b = lo, hi
        return max(a, 0), min(b, self.height)


def _value(v: ops_pb2.Value) -> Any:
    kind = v.WhichOneof("kind")
    if kind in ("list", "tuple"):
        return [_value(x) for x in getattr(v, kind).items]
    if kind == "none" or kind is None:
        return None
    if kind == "tensor":
        return v.tensor
    return getattr(v, kind)


def _arg(call: ops_pb2.OpCall, i: int, name: str, default: Any = None) -> Any:
    if i < len(call.args):
        return _value(call.args[i])
    return _value(call.kwargs[name]) if name in call.kwargs else default


def rule(call: ops_pb2.OpCall, in_shapes: Sequence[Shape],
         out_shapes: Sequence[Shape]) -> Rule | None:
    """``call`` as a local operator, or None if it is not one (or its shapes are not known,
    or its arguments are not what the operator takes: a definition comes from the network)."""
    try:
        return _rule(call, in_shapes, out_shapes)
    except (TypeError, ValueError, IndexError, KeyError, AttributeError, ZeroDivisionError):
        return None


def _rule(call: ops_pb2.OpCall, in_shapes: Sequence[Shape],
          out_shapes: Sequence[Shape]) -> Rule | None:
    op = call.op
    if op not in _ELEMENTWISE and op not in _WINDOW and op not in _UPSAMPLE:
        return None
    outs = [s for s in out_shapes]
    if not outs or outs[0] is None or len(outs[0]) < 2:
        return None
    height = outs[0][ROW]
    if op in _ELEMENTWISE:
        if op in ("aten::native_batch_norm.default", "aten::batch_norm.default") \
                and _arg(call, 5, "training"):
            return None  # training: statistics over every row
        along = _ALONG.get(op.split("::", 1)[1])
        if along is not None:
            first = in_shapes[0] if in_shapes else None
            dim = _arg(call, along, "dim", 0 if "cat" in op or "split" in op else None)
            if first is None or dim is None or isinstance(dim, list) and len(dim) != 1:
                return None
            dim = int(dim[0] if isinstance(dim, list) else dim)
            n = len(first)
            dim = dim + n if dim < 0 else dim
            keep = bool(_arg(call, 2, "keepdim", False)) if "arg" in op or "amax" in op \
                or "sum" in op or "mean" in op else True
            if dim == n - 2 or (dim == n - 1 and not keep):
                return None  # along the rows, or it moves them
        rows_in = tuple(s is not None and len(s) >= 2 and s[ROW] == height and height > 1
                        for s in in_shapes)
        # a tensor of unknown shape (a weight) is read whole: only where it cannot have rows
        per_channel = "batch_norm" in op
        if not any(rows_in) or any(s is None for s in in_shapes) and not per_channel:
            return None
        if any(s is not None and len(s) >= 2 and s[ROW] not in (1, height)
               for s in in_shapes):
            return None
        rows_out = tuple(s is not None and len(s) >= 2 and s[ROW] == height for s in outs)
        return Rule(op, "same", rows_in, rows_out, height)
    first = in_shapes[0] if in_shapes else None
    if first is None or len(first) != 4 or len(outs[0]) != 4:
        return None
    rows_in = tuple(j == 0 for j in range(len(in_shapes)))
    rows_out = tuple(s is not None and len(s) == 4 for s in outs)
    h_in, h_out = first[ROW], outs[0][ROW]
    if h_in < 1 or h_out < 1:
        return None
    if op in _UPSAMPLE:
        if h_out % h_in:
            return None
        return Rule(op, "upsample", rows_in, rows_out, h_in, f=h_out // h_in)
    if op in _CONV:
        if op == "aten::convolution.default" and _arg(call, 6, "transposed"):
            return None
        s, p, d = (_two(_arg(call, 3, "stride"), 1)[0], _two(_arg(call, 4, "padding"), 0)[0],
                   _two(_arg(call, 5, "dilation"), 1)[0])
        if s < 1 or d < 1 or p < 0:
            return None
        # the kernel's height is not in the recording: the largest that gives these heights
        k = (h_in + 2 * p - 1 - (h_out - 1) * s) // d + 1
    else:
        k = _two(_arg(call, 1, "kernel_size"), 1)[0]
        s = _two(_arg(call, 2, "stride"), k)[0]
        p, d = _two(_arg(call, 3, "padding"), 0)[0], _two(_arg(call, 4, "dilation"), 1)[0]
    if k < 1 or s < 1 or d < 1 or p < 0:
        return None
    return Rule(op, "window", rows_in, rows_out, h_in, k=k, s=s, p=p, d=d)


# ----- running a band -------------------------------------------------------------------------

def run(op: Any, args: list[Any], kwargs: dict[str, Any], how: Rule, starts: dict[int, int],
        lo: int, hi: int) -> Any:
    """Rows ``[lo, hi)`` of each of ``op``'s outputs that has rows, computed from ``args`` as
    ``how`` (the call's ``rule``) reads them: each tensor whose ``id`` is in ``starts`` holds its
    rows from that row on (a band), the others are read whole. Outputs without rows come out
    whole. The window's parameters are the live arguments' (exact), its input's height
    ``how.height``."""
    if how.kind == "window":
        return _window(op, args, kwargs, how, starts, lo, hi)
    if how.kind == "upsample":
        return _upsample(op, args, kwargs, how.height, starts, lo, hi)

    def band(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and id(x) in starts:
            return x.narrow(x.dim() + ROW, lo - starts[id(x)], hi - lo)
        if isinstance(x, (list, tuple)):
            return type(x)(band(v) for v in x)
        return x

    return op(*[band(a) for a in args], **{k: band(v) for k, v in kwargs.items()})


def _rows(x: torch.Tensor, start: int, a: int, b: int) -> torch.Tensor:
    return x.narrow(x.dim() + ROW, a - start, b - a)


def _window(op: Any, args: list[Any], kwargs: dict[str, Any], how: Rule,
            starts: dict[int, int], lo: int, hi: int) -> Any:
    x, height = args[0], how.height
    conv = how.op in _CONV
    if conv:
        if kwargs or how.op == "aten::conv2d.default":  # defaults filled in: conv2d's schema
            names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
            given = dict(zip(names, args, strict=False)) | kwargs
            args = [given["input"], given["weight"], given.get("bias"),
                    _two(given.get("stride"), 1), _two(given.get("padding"), 0),
                    _two(given.get("dilation"), 1), given.get("groups", 1)]
            kwargs = {}
        k, s, p, d = args[1].shape[2], args[3][0], args[4][0], args[5][0]
    else:
        names = ("self", "kernel_size", "stride", "padding", "dilation", "ceil_mode")
        given = dict(zip(names, args, strict=False)) | kwargs
        kernel = _two(given["kernel_size"], 1)
        args = [x, kernel, _two(given.get("stride"), 0) if given.get("stride") else kernel,
                _two(given.get("padding"), 0), _two(given.get("dilation"), 1),
                bool(given.get("ceil_mode", False))]
        kwargs = {}
        k, s, p, d = args[1][0], args[2][0], args[3][0], args[4][0]
    a, b = lo * s - p, (hi - 1) * s - p + d * (k - 1) + 1
    top, bottom = max(0, -a), max(0, b - height)
    band = _rows(x, starts.get(id(x), 0), max(a, 0), min(b, height))
    if top or bottom:
        # the padding the operator would have added along the rows: zeros for a convolution;
        # for a max, values no window takes (the operator's own padding is never a maximum)
        band = torch.constant_pad_nd(band, [0, 0, top, bottom], 0.0 if conv else float("-inf"))
    new = list(args)
    new[0] = band
    new[4 if conv else 3] = [0, args[4 if conv else 3][1]]  # no padding along the rows
    out = op(*new, **kwargs)
    if isinstance(out, tuple) and len(out) == 2:  # a max's indices: into the whole input
        values, index = out
        return values, index + a * x.shape[-1]
    return out


def _two(v: Any, default: int) -> list[int]:
    """A 2-d parameter as ``[rows, columns]`` (given as one int, one item or two)."""
    if v is None or v == []:
        return [default, default]
    if isinstance(v, int):
        return [v, v]
    v = list(v)
    return v * 2 if len(v) == 1 else v


def _upsample(op: Any, args: list[Any], kwargs: dict[str, Any], height: int,
              starts: dict[int, int], lo: int, hi: int) -> Any:
    x = args[0]
    size = args[1] if len(args) > 1 else None
    if size:
        f, width = size[0] // height, size[1]
    else:  # ``.vec`` with scale factors
        f, width = int(args[2][0]), None
    a, b = lo // f, (hi - 1) // f + 1
    new = list(args)
    new[0] = _rows(x, starts.get(id(x), 0), a, b)
    if size:
        new[1] = [(b - a) * f, width]
    out = op(*new, **kwargs)
    return out.narrow(out.dim() + ROW, lo - a * f, hi - lo)
