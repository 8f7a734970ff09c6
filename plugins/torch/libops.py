"""Operators of other libraries that a host runs: a reviewed table, one entry per operator.

A library such as torchvision registers its operators with the dispatcher when it is imported
(``torchvision::nms``, ``torchvision::roi_align``). Detectors call them between aten operators on
the same tensors; if the host refused them, the app would download their inputs and run them on
the robot, a waited round trip and the feature maps on the wire each time. The host runs them
when it has the library: a library namespace in this table is *probed* by importing its module
(the import registers the operators; a host without it refuses with the import's error), and an
operator runs only if this table names it with a reason why it is safe and why models need it.

This table is code, reviewed like code. A config cannot add to it and a client cannot name a
module to import: ``executor.allow_extra`` (docs/allowlist.md) stays the host owner's only way to
admit operators the table does not list, and the namespace it names must already be registered.
A plugin loaded into the GPU daemon, trusted like the daemon itself, may add a library of its own
with ``register`` (the test suite does so for its ``rrtotest`` library).

Each entry also carries:

- a **guard**: a check of the inputs the host runs before the operator, for what the library's
  kernel does not check itself (the RoI operators read the feature map at the batch index in
  each box without a bounds check, and turn NaN coordinates into indices);
- a **shape rule**: which outputs have a data-dependent size and what bounds it. An operator
  without one has a meta kernel that gives its outputs' metadata from their inputs' (the app
  computes it locally, as for aten). With one, the app asks the host for the outputs' metadata
  (one waited round trip, ``OpCall.want_meta``), the host charges the bound against the session's
  memory before running it, and the symbolic recorder (issue 13) can give the data-dependent
  dimension a symbol bounded by the same expression.
"""

from __future__ import annotations

import importlib
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DataDim", "Library", "LibraryOp", "Output", "ShapeRule", "bound_bytes", "entry",
           "guarded", "libraries", "probe", "register"]


@dataclass(frozen=True)
class DataDim:
    """An output dimension whose size depends on the input values: between 0 and dimension
    ``dim`` of argument ``arg`` (``nms`` keeps at most as many boxes as it was given)."""

    arg: str
    dim: int


# One output dimension: a constant, ``(arg, dim)`` (equal to an input's dimension), or DataDim.
Dim = int | tuple[str, int] | DataDim


@dataclass(frozen=True)
class Output:
    """One tensor output of a data-dependent operator: its dtype (a dtype, or the name of the
    argument whose dtype it has) and its shape."""

    dtype: torch.dtype | str
    shape: tuple[Dim, ...]


@dataclass(frozen=True)
class ShapeRule:
    """All tensor outputs of an operator whose output sizes depend on data, in order."""

    outputs: tuple[Output, ...]

    def data_dependent(self) -> tuple[int, ...]:
        """Indices of the outputs with at least one data-dependent dimension."""
        return tuple(k for k, o in enumerate(self.outputs)
                     if any(isinstance(d, DataDim) for d in o.shape))


# A guard gets the call's arguments by schema name and returns why it refuses them, or None.
Guard = Callable[[Mapping[str, Any]], "str | None"]


@dataclass(frozen=True)
class LibraryOp:
    """One reviewed operator: ``ns::op.overload``, why a host may run it, its guard and its
    shape rule (None: its meta kernel gives its outputs' metadata)."""

    name: str
    reason: str
    shape: ShapeRule | None = None
    guard: Guard | None = None


@dataclass(frozen=True)
class Library:
    """A library's reviewed operators and the module whose import registers them."""

    namespace: str
    module: str
    ops: tuple[LibraryOp, ...]
    by_name: dict[str, LibraryOp] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for op in self.ops:
            if not op.name.startswith(self.namespace + "::"):
                raise ValueError(f"{op.name} is not in namespace {self.namespace}")
        object.__setattr__(self, "by_name", {op.name: op for op in self.ops})


# -- guards ----------------------------------------------------------------------------------
def _real(t: torch.Tensor) -> bool:
    """A tensor with values to check (sizing runs operators on meta tensors first)."""
    return t.device.type != "meta"


def _rois_guard(args: Mapping[str, Any]) -> str | None:
    """RoI pooling kernels read ``input[rois[k, 0]]`` unchecked and cast coordinates to ints:
    the batch index must be in range and every coordinate finite."""
    inp, rois = args.get("input"), args.get("rois")
    if not isinstance(inp, torch.Tensor) or not isinstance(rois, torch.Tensor):
        return "input and rois must be tensors"
    if rois.dim() != 2 or rois.size(1) != 5:
        return f"rois must have shape [K, 5], not {list(rois.shape)}"
    if inp.dim() != 4:
        return f"input must have 4 dimensions, not {inp.dim()}"
    if not _real(rois) or rois.numel() == 0:
        return None
    if not rois.is_floating_point():
        return f"rois must be floating point, not {rois.dtype}"
    if not bool(torch.isfinite(rois).all()):
        return "rois must be finite (a NaN coordinate becomes an arbitrary index)"
    b = rois[:, 0]
    if not bool(((b >= 0) & (b < inp.size(0))).all()):
        return f"a box's batch index (rois[:, 0]) is outside the input's {inp.size(0)} images"
    return None


def _offset_guard(args: Mapping[str, Any]) -> str | None:
    """deform_conv2d bounds-checks sampling positions, but a NaN offset passes those checks
    and becomes an arbitrary index."""
    off = args.get("offset")
    if isinstance(off, torch.Tensor) and _real(off) and off.numel() and off.is_floating_point():
        if not bool(torch.isfinite(off).all()):
            return "offset must be finite (a NaN offset becomes an arbitrary index)"
    return None


_ROI = ("fixed-shape RoI pooling ({}) of detection heads; the guard checks each box's batch "
        "index and coordinates, which the kernel does not")

TORCHVISION = Library("torchvision", "torchvision", (
    LibraryOp("torchvision::nms.default",
              "non-maximum suppression of every torchvision detector; reads only its two inputs "
              "(shapes checked by the kernel) and returns indices into them",
              shape=ShapeRule((Output(torch.int64, (DataDim("dets", 0),)),))),
    LibraryOp("torchvision::roi_align.default", _ROI.format("Faster/Mask/Keypoint R-CNN"),
              guard=_rois_guard),
    LibraryOp("torchvision::roi_pool.default", _ROI.format("Fast R-CNN style heads"),
              guard=_rois_guard),
    LibraryOp("torchvision::ps_roi_align.default", _ROI.format("position-sensitive, R-FCN"),
              guard=_rois_guard),
    LibraryOp("torchvision::ps_roi_pool.default", _ROI.format("position-sensitive, R-FCN"),
              guard=_rois_guard),
    LibraryOp("torchvision::deform_conv2d.default",
              "deformable convolution (DCN backbones and heads); shapes of offset and mask are "
              "checked by the kernel, the guard checks offsets are finite",
              guard=_offset_guard),
))

_LIBRARIES: dict[str, Library] = {TORCHVISION.namespace: TORCHVISION}
_lock = threading.Lock()
_probed: dict[str, str | None] = {}  # module -> None (imported) or why it could not be


def register(library: Library) -> None:
    """Add a library's reviewed operators (for a plugin loaded into the daemon; never from
    configuration or a client). A namespace registered twice must be the same table."""
    with _lock:
        known = _LIBRARIES.get(library.namespace)
        if known is not None and known != library:
            raise ValueError(f"library namespace {library.namespace} is already registered "
                             "with other operators")
        _LIBRARIES[library.namespace] = library


def libraries() -> dict[str, Library]:
    """The reviewed libraries by namespace (docs, ``rrtoctl ops``, tests)."""
    return dict(_LIBRARIES)


def entry(name: str) -> LibraryOp | None:
    """The reviewed entry for a full overload name ``ns::op.overload``, if any."""
    lib = _LIBRARIES.get(name.split("::", 1)[0])
    return lib.by_name.get(name) if lib is not None else None


def probe(namespace: str) -> str | None:
    """Import the library of ``namespace`` once (its import registers its operators). None when
    the host has it (or the namespace is not a library of the table), else why not."""
    lib = _LIBRARIES.get(namespace)
    if lib is None:
        return None
    with _lock:
        if lib.module not in _probed:
            try:
                importlib.import_module(lib.module)
                _probed[lib.module] = None
            except Exception as exc:  # noqa: BLE001 - ImportError, or the library's own failure
                _probed[lib.module] = (f"this host does not have the library {lib.module} "
                                       f"({type(exc).__name__}: {exc})")
        return _probed[lib.module]


def _bind(op: Any, args: tuple | list, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments by schema name."""
    named = dict(kwargs)
    for a, v in zip(op._schema.arguments, args, strict=False):
        named[a.name] = v
    return named


class Guarded:
    """A library operator whose inputs are checked before it runs. Behaves as the OpOverload
    it wraps (schema, name) for the executor and for sizing."""

    __slots__ = ("op", "check")

    def __init__(self, op: torch._ops.OpOverload, check: Guard):
        self.op = op
        self.check = check

    def __getattr__(self, name: str) -> object:
        return getattr(self.op, name)

    def __call__(self, *args: object, **kwargs: object) -> object:
        why = self.check(_bind(self.op, args, kwargs))
        if why is not None:
            raise ValueError(f"{self.op._schema.name} refused its inputs: {why}")
        return self.op(*args, **kwargs)


def guarded(op: Any, lib_op: LibraryOp) -> Any:
    """``op`` wrapped in its entry's guard, if it has one."""
    return op if lib_op.guard is None else Guarded(op, lib_op.guard)


def _size(d: Dim, named: Mapping[str, Any]) -> int:
    if isinstance(d, int):
        return d
    arg, dim = (d.arg, d.dim) if isinstance(d, DataDim) else d
    t = named.get(arg)
    if not isinstance(t, torch.Tensor) or not -t.dim() <= dim < t.dim():
        raise ValueError(f"the shape rule names dimension {dim} of {arg!r}, which the call "
                         "does not have")
    return int(t.size(dim))


def bound_bytes(rule: ShapeRule, op: Any, args: tuple | list, kwargs: Mapping[str, Any]) -> int:
    """The most bytes the call's outputs can take, from its shape rule (each data-dependent
    dimension at its bound). Raises ValueError when the call does not fit the rule."""
    named = _bind(op, args, kwargs)
    total = 0
    for o in rule.outputs:
        dtype = o.dtype
        if isinstance(dtype, str):
            t = named.get(dtype)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"the shape rule takes the dtype of {dtype!r}, not a tensor")
            dtype = t.dtype
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        total += math.prod(_size(d, named) for d in o.shape) * itemsize
    return total
