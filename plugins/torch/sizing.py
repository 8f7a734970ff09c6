"""Sizes before memory: the bytes an operator call will allocate, computed on the host.

The client declares its outputs' metadata, but a client may lie (``ones`` of 1 GiB declared as
one element), and memory allocated before the quota check has already been taken. So the host
runs each call first on meta tensors (same dtypes, shapes, strides; no data, no memory) and
charges what that allocates: every output storage that is not one of the inputs', plus the
growth of input storages (``resize_``, ``out=`` arguments). Meta execution costs 80-600 us
(measured here), so results are cached per operator and argument signature: a repeated call
costs one dictionary lookup after its signature (~1 us per tensor argument). Two kinds need no
meta execution at all, which matters where sizes change every inference (a detector's box count
makes every call after it a new signature): views allocate nothing, and a pointwise operator's
output is the broadcast shape of its arguments in an item size known per dtypes.

Operators whose output size depends on data (``nonzero``, boolean masks, ``unique``) cannot be
executed on meta tensors; their outputs are bounded by their inputs instead (``nonzero``:
numel x ndim int64 indices). Those with no such bound (``bincount``, ``repeat_interleave``
without ``output_size``, ``one_hot`` without ``num_classes``) and operators without a meta
kernel that return tensors are refused (``Unsizable``): their memory could not be checked
before it is taken.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from . import libops, pointwise, resampling


class Unsizable(Exception):
    """The call's output size cannot be known before it runs; it is refused."""


class MetaFailed(Exception):
    """The call fails on meta tensors as it would on the device (bad shapes, dtypes)."""


_CACHE_MAX = 65_536
_cache: dict[Any, int | Exception] = {}


def signature(x: Any) -> Any:
    """A hashable signature of an argument: tensors by their metadata."""
    if isinstance(x, torch.Tensor):
        return (x.dtype, tuple(x.shape), x.stride(), x.storage_offset(), x.layout)
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(signature(v) for v in x))
    if isinstance(x, float) and x != x:
        return ("nan",)
    return x


def _small(args: list[Any], limit: int = 256) -> bool:
    return all(not isinstance(a, (list, tuple)) or len(a) <= limit for a in args)


def new_bytes(op: torch._ops.OpOverload, args: list[Any], kwargs: dict[str, Any]) -> int:
    """Bytes of memory the call allocates for its outputs (cached per signature). Raises
    Unsizable or MetaFailed."""
    key = (op, signature(args), signature(tuple(kwargs.items())) if kwargs else None)
    hit = _cache.get(key)
    if hit is None:
        hit = measure(op, args, kwargs)
        if _small(args) and _small(list(kwargs.values())):  # a key holds its lists: keep
            if len(_cache) >= _CACHE_MAX:                     # huge ones out of the cache
                _cache.clear()
            _cache[key] = hit
    if isinstance(hit, Exception):
        # a new instance each time: raising the cached one would chain every raise's traceback
        # onto it, keeping each failed call's frames and tensors alive (fuzzing found it)
        raise type(hit)(*hit.args)
    return hit


def measure(op: torch._ops.OpOverload, args: list[Any],
            kwargs: dict[str, Any]) -> int | Exception:
    """``new_bytes`` without the cache; an exception to raise instead of a size."""
    bound = _DATA_DEPENDENT.get(op._schema.name)
    rule = _library_rule(op)
    if rule is not None:  # a reviewed library operator's shape rule bounds its outputs
        try:
            return libops.bound_bytes(rule, op, args, kwargs)
        except ValueError as exc:  # the call does not fit the rule
            return MetaFailed(str(exc))
    try:
        if bound is not None:
            return bound(op, args, kwargs)
        if _is_view(op) or _in_place(op):
            return 0
        fast = _pointwise_bytes(op, args, kwargs)
        if fast is not None:
            return fast
        resized = resampling.resized(op, args, kwargs)
        if resized is not None:
            shape, _strides, dtype = resized
            return math.prod(shape) * dtype.itemsize
        return _meta_bytes(op, args, kwargs)
    except (Unsizable, MetaFailed) as exc:
        return exc
    except NotImplementedError as exc:  # no meta kernel
        if not _returns_tensors(op):
            return 0
        return Unsizable(f"operator {op._schema.name}.{op._overloadname or 'default'} has no "
                         f"meta kernel: its output size cannot be checked before it runs ({exc})")
    except Exception as exc:  # noqa: BLE001 - what the operator itself would raise
        if not _returns_tensors(op):
            return 0  # item(), equal(): a Python value, nothing allocated
        return MetaFailed(f"{type(exc).__name__}: {exc}")


def _library_rule(op: torch._ops.OpOverload) -> libops.ShapeRule | None:
    if op.namespace == "aten":
        return None
    lib_op = libops.entry(f"{op._schema.name}.{op._overloadname}")
    return lib_op.shape if lib_op is not None else None


def _returns_tensors(op: torch._ops.OpOverload) -> bool:
    return any("Tensor" in str(r.type) for r in op._schema.returns)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    shape, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
    size = 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True)) if all(shape) else 0
    base = torch.empty((offset + size,), dtype=t.dtype, device="meta")
    return base.as_strided(shape, stride, offset)


def _to_meta(x: Any, seen: dict[int, torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        if x.layout is not torch.strided:
            raise Unsizable(f"a {x.layout} argument cannot be sized before the call")
        m = seen.get(id(x))
        if m is None:
            m = seen[id(x)] = _meta_like(x)
        return m
    if isinstance(x, torch.device):
        return torch.device("meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v, seen) for v in x)
    return x


def flatten_tensors(value: Any, out: list[torch.Tensor]) -> None:
    """Append the tensors of an operator's result or argument (nested lists and tuples) to
    ``out``, in order: what the executor stores and what sizing charges are the same list."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            flatten_tensors(v, out)


def _device_arg(op: torch._ops.OpOverload) -> int | None:
    for i, a in enumerate(op._schema.arguments):
        if a.name == "device" and "Device" in str(a.type):
            return i
    return None


def _meta_bytes(op: torch._ops.OpOverload, args: list[Any], kwargs: dict[str, Any]) -> int:
    seen: dict[int, torch.Tensor] = {}
    margs = _to_meta(args, seen)
    mkwargs = {k: _to_meta(v, seen) for k, v in kwargs.items()}
    at = _device_arg(op)  # a factory (ones, empty, arange) left to its default device would
    if at is not None:    # allocate for real: on the CPU
        if at < len(margs):
            margs[at] = torch.device("meta")
        else:
            mkwargs["device"] = torch.device("meta")
    before = {m.untyped_storage()._cdata: m.untyped_storage().nbytes() for m in seen.values()}
    with torch.inference_mode():
        result = op(*margs, **mkwargs)
    outs: list[torch.Tensor] = []
    flatten_tensors(result, outs)
    if any(t.device.type != "meta" for t in outs):
        raise Unsizable(f"operator {op._schema.name} made an output off the meta device: its "
                        "size cannot be checked before it runs")
    total = 0
    counted: set[int] = set()
    for m in [*outs, *seen.values()]:
        st = m.untyped_storage()
        if st._cdata in counted:
            continue
        counted.add(st._cdata)
        total += max(0, st.nbytes() - before.get(st._cdata, 0))
    return total


# -- views and pointwise operators: sized without meta execution -------------------------------
_VIEWS: dict[Any, bool] = {}
_DTYPES = pointwise.Dtypes()


def _is_view(op: torch._ops.OpOverload) -> bool:
    """An aten view (``slice``, ``select``, ``view``, ``permute``, ``split``...): every output
    aliases an input and nothing is written, so it allocates nothing. Composite operators
    whose schema says alias but that may copy (``reshape``, ``contiguous``, ``to``) are not
    views here, nor another library's operators (their schema is their author's word)."""
    known = _VIEWS.get(op)
    if known is None:
        schema = op._schema
        known = _VIEWS[op] = (
            op.namespace == "aten" and not schema.is_mutable and bool(schema.returns)
            and all(r.alias_info is not None and not r.alias_info.is_write
                    for r in schema.returns)
            and not torch._C._dispatch_has_kernel_for_dispatch_key(
                op.name(), "CompositeImplicitAutograd"))
    return known


_IN_PLACE: dict[Any, bool] = {}


def _in_place(op: torch._ops.OpOverload) -> bool:
    """An aten operator that computes into its ``self`` and returns it (``relu_``,
    ``index_put_``, ``masked_fill_``: ``Tag.inplace``): its output is an existing tensor, and
    it writes no more than that tensor holds, so it allocates nothing for its outputs. Not
    those that change metadata, which may grow the storage (``resize_``, ``set_``: also
    ``Tag.inplace_view``), nor ``_resize_output_`` (tagged ``inplace`` alone: any name with
    "resize" is left to meta execution), nor ``out=`` variants (they may resize their
    output). The bytes are meta execution's (tests/test_sizing.py), without its ~50-100 us a
    call: a detector's per-class loop writes its keep-mask ~90 times an inference with index
    tensors of a new length each time, so a per-size cache never hits."""
    known = _IN_PLACE.get(op)
    if known is None:
        schema = op._schema
        args, returns = schema.arguments, schema.returns
        known = _IN_PLACE[op] = (
            op.namespace == "aten" and torch.Tag.inplace in op.tags
            and torch.Tag.inplace_view not in op.tags and "resize" not in schema.name
            and len(returns) == 1 and returns[0].alias_info is not None
            and returns[0].alias_info.is_write and bool(args) and args[0].name == "self"
            and args[0].alias_info is not None
            and args[0].alias_info.before_set == returns[0].alias_info.before_set
            and sum(a.alias_info is not None and a.alias_info.is_write for a in args) == 1)
    return known


def _pointwise_bytes(op: torch._ops.OpOverload, args: list[Any],
                     kwargs: dict[str, Any]) -> int | None:
    """The bytes of a functional pointwise call's one dense output (``pointwise``): its
    broadcast shape times its dtype's item size. None: meta execution decides. The bytes are
    exactly what meta execution gives (tests/test_sizing.py compares them)."""
    described = pointwise.describe(op, args, kwargs)
    if described is None:
        return None
    key, tensors = described
    first = tensors[0].shape
    if all(t.shape == first for t in tensors):
        shape = first  # the common case, without broadcasting (~20 us)
    else:
        try:
            shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        except RuntimeError:
            return None  # meta execution reports it as the operator would
    dtype = _DTYPES.of(key, op, args, kwargs)
    if dtype is None:
        return None
    return math.prod(shape) * dtype.itemsize


# -- operators whose output size depends on data: bounds from their inputs -------------------
def _arg(args: list[Any], kwargs: dict[str, Any], pos: int, name: str) -> Any:
    return args[pos] if pos < len(args) else kwargs.get(name)


def _nonzero(op: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    t = _arg(args, kwargs, 0, "self")
    return t.numel() * max(t.dim(), 1) * 8  # at most every element, one int64 per dimension


def _where(op: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    """``where(condition)`` is ``nonzero(condition, as_tuple=True)``; the other overloads
    (``where(condition, a, b)``) have a fixed shape."""
    if op._overloadname == "default":
        return _nonzero(op, args, kwargs)
    return _meta_bytes(op, args, kwargs)


def _masked_select(op: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    t, mask = _arg(args, kwargs, 0, "self"), _arg(args, kwargs, 1, "mask")
    try:
        shape = torch.broadcast_shapes(t.shape, mask.shape)
    except RuntimeError as exc:
        raise MetaFailed(f"RuntimeError: {exc}") from None
    return math.prod(shape) * t.element_size()


def _unique(op: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    t = _arg(args, kwargs, 0, "self")
    return t.numel() * (t.element_size() + 16)  # values, inverse and counts (int64)


def _index(op: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    """``x[i, j]``, ``x[mask]``: advanced indexing's output is the index tensors' broadcast
    shape, with the dimensions none of them index kept; a boolean mask of k dimensions selects
    at most ``mask.numel()`` positions, as k int64 index tensors of that length would. Worked
    out from the sizes, as the meta kernel would (tests/test_sizing.py compares), without its
    ~70 us: a detector indexes its boxes with a mask of a new length each time."""
    t, indices = _arg(args, kwargs, 0, "self"), _arg(args, kwargs, 1, "indices")
    if not isinstance(t, torch.Tensor) or not isinstance(indices, (list, tuple)):
        raise MetaFailed("index: expected a tensor and a list of indices")
    shapes: list[tuple[int, ...]] = []
    dim = 0  # the next dimension of ``t`` an index applies to
    kept = 1  # the product of the dimensions no index consumes
    for ix in indices:
        if ix is None:
            kept *= t.shape[dim] if dim < t.dim() else 1
            dim += 1
        elif not isinstance(ix, torch.Tensor):
            raise MetaFailed(f"index: an index is a {type(ix).__name__}")
        elif ix.dtype in (torch.bool, torch.uint8):
            if tuple(ix.shape) != tuple(t.shape[dim:dim + ix.dim()]):
                raise MetaFailed(f"IndexError: the shape of the mask {list(ix.shape)} does not "
                                 f"match the shape of the indexed tensor {list(t.shape)}")
            shapes.append((ix.numel(),))
            dim += ix.dim()
        elif ix.dtype.is_floating_point or ix.dtype.is_complex:
            raise MetaFailed(f"IndexError: tensors used as indices must be long, int, byte or "
                             f"bool tensors, not {ix.dtype}")
        else:
            shapes.append(tuple(ix.shape))
            dim += 1
    if dim > t.dim():
        raise MetaFailed(f"IndexError: too many indices for tensor of dimension {t.dim()}")
    kept *= math.prod(t.shape[dim:])  # the dimensions after the last index
    if len(shapes) == 1:  # one index (``boxes[keep]``): nothing to broadcast (~7 us less)
        return math.prod(shapes[0]) * kept * t.element_size()
    try:
        broadcast = torch.broadcast_shapes(*shapes) if shapes else torch.Size()
    except RuntimeError as exc:
        raise MetaFailed(f"IndexError: {exc}") from None
    return math.prod(broadcast) * kept * t.element_size()


def _repeat_interleave(op: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    """Repeats given as a tensor: the output length is their sum, unless ``output_size``
    says it (then the meta kernel sizes it)."""
    if op._overloadname == "self_int" or kwargs.get("output_size") is not None:
        return _meta_bytes(op, args, kwargs)
    raise Unsizable("aten::repeat_interleave with tensor repeats and no output_size: its output "
                    "size depends on data values and has no bound; pass output_size")


def _unbounded(name: str) -> Callable[..., int]:
    def bound(op: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
        raise Unsizable(f"{name}: its output size depends on data values and has no bound")
    return bound


def _one_hot(op: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
    t, classes = _arg(args, kwargs, 0, "self"), _arg(args, kwargs, 1, "num_classes")
    if classes is None or classes < 0:
        raise Unsizable("aten::one_hot without num_classes: its output size depends on data "
                        "values and has no bound; pass num_classes")
    return t.numel() * classes * 8


_DATA_DEPENDENT: dict[str, Callable[..., int]] = {
    "aten::nonzero": _nonzero,
    "aten::argwhere": _nonzero,
    "aten::where": _where,
    "aten::masked_select": _masked_select,
    "aten::_unique": _unique,
    "aten::_unique2": _unique,
    "aten::unique_consecutive": _unique,
    "aten::unique_dim": _unique,
    "aten::unique_dim_consecutive": _unique,
    "aten::index": _index,
    "aten::repeat_interleave": _repeat_interleave,
    "aten::one_hot": _one_hot,
    "aten::bincount": _unbounded("aten::bincount"),
}
