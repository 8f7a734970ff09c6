"""What an operator's results look like, worked out in the app without the host.

A forwarded call returns proxies at once, so the app side must know each output's shape, stride,
offset and dtype before the host has run anything. This module works that out: per operator
overload, what its schema says (``OpInfo``: which arguments it writes, which outputs alias them);
per call, the result's structure with a placeholder for each new tensor (``MetaCache``: meta
execution, cached per operator and argument signature; None when the shapes depend on data,
then the host is asked: meta execution says so for aten, a library operator's shape rule in
``libops.py`` for the others); and the proxies that fill a template once the outputs have ids
(``materialize``). Both the forwarding path (``client.py``) and replay (``replay.py``) use it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.utils._mode_utils
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, FakeTensorMode

from . import codec, indexing, libops, pointwise, resampling
from .proxy import new_proxy

# Operators answered without the host: they only relabel a handle.
_LOCAL_ALIAS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default,
                torch.ops.aten.lift_fresh.default}
META_CACHE_ENTRIES = 50_000  # distinct (operator, argument signature) pairs kept
# Operators whose output layout the device kernel chooses: the meta kernel of a convolution
# always answers C-contiguous, while the CPU (mkldnn) and CUDA (cuDNN) kernels keep a
# channels-last input channels-last. torch's fake-tensor implementation asks the backend
# selector of the tensors' device, as eager does; the proxy must describe that layout, or the
# host copies its result into another layout and the next layout-sensitive kernels (GELU,
# reductions, ...) round differently from local execution.
# The app may be intercepted above the decomposition of ``conv2d`` and friends: every overload
# of the convolution entry points.
_DEVICE_LAYOUT = {
    getattr(packet, overload)
    for packet in (getattr(torch.ops.aten, name) for name in (
        "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
        "convolution", "_convolution"))
    for overload in packet.overloads()}


class OpInfo:
    """What the client needs to know about an operator, computed once per overload."""

    __slots__ = ("name", "value_op", "ret_alias", "writes", "probed", "local", "namespace",
                 "inplace_view", "alias_only", "func", "shape_rule")

    def __init__(self, func: torch._ops.OpOverload):
        self.func = func  # held: the client's table is keyed by its id
        self.alias_only = func in _LOCAL_ALIAS
        schema = func._schema
        self.namespace = func.namespace
        self.name = f"{func.namespace}::{schema.name.split('::')[-1]}.{func._overloadname}"
        self.value_op = any(str(r.type) not in ("Tensor", "List[Tensor]", "Tensor[]",
                                                "Optional[Tensor]") for r in schema.returns)
        self.writes: list[tuple[int, str]] = []  # mutated arguments: (position, name)
        sets: dict[str, tuple[int, str]] = {}
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                self.writes.append((i, a.name))
                for s in a.alias_info.before_set:
                    sets[s] = (i, a.name)
        self.ret_alias: list[tuple[int, str] | None] = []
        for r in schema.returns:
            hit = None
            if r.alias_info is not None and r.alias_info.is_write and str(r.type) == "Tensor":
                for s in r.alias_info.before_set:
                    hit = sets.get(s, hit)
            self.ret_alias.append(hit)
        self.probed = False
        self.local = False
        self.inplace_view = torch.Tag.inplace_view in func.tags  # transpose_, unsqueeze_, ...
        # A library operator's data-dependent output sizes (libops.py): the host says them.
        self.shape_rule = shape_rule(func)


def shape_rule(func: Any) -> libops.ShapeRule | None:
    """The shape rule of a reviewed library operator whose output sizes depend on data."""
    if getattr(func, "namespace", "aten") == "aten":
        return None
    entry = libops.entry(f"{func.namespace}::{func._schema.name.split('::')[-1]}."
                         f"{func._overloadname}")
    return entry.shape if entry is not None else None


def arg_at(args: tuple, kwargs: dict, pos: int, name: str) -> Any:
    """The argument at schema position ``pos`` (named ``name``), passed either way."""
    return args[pos] if pos < len(args) else kwargs.get(name)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    shape, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
    size = 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True)) if all(shape) else 0
    base = torch.empty((offset + size,), dtype=t.dtype, device="meta")
    return base.as_strided(shape, stride, offset)


def _sig(x: Any) -> Any:
    """A hashable signature of an argument for the metadata cache."""
    if isinstance(x, torch.Tensor):
        return (x.dtype, tuple(x.shape), x.stride(), x.storage_offset(), x.device.type)
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_sig(v) for v in x))
    if isinstance(x, float) and x != x:
        return ("nan",)
    return x


class Out:
    """Placeholder for the k-th tensor output in a cached result template."""

    __slots__ = ("k", "shape", "stride", "offset", "dtype")

    def __init__(self, k: int, t: torch.Tensor):
        self.k, self.shape, self.stride, self.offset, self.dtype = (
            k, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)


def _one_output(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
                ) -> tuple[Out, list[Out]]:
    """The template of a call whose result is one new tensor of this layout (offset 0), as
    the fast paths describe it without meta execution."""
    out = Out.__new__(Out)
    out.k, out.shape, out.stride, out.offset, out.dtype = 0, shape, stride, 0, dtype
    return (out, [out])


def _template(result: Any, outs: list[Out]) -> Any:
    if isinstance(result, torch.Tensor):
        o = Out(len(outs), result)
        outs.append(o)
        return o
    if isinstance(result, (list, tuple)):
        return type(result)(_template(r, outs) for r in result)
    return result


def _to_fake(x: Any, mode: FakeTensorMode) -> Any:
    if isinstance(x, torch.Tensor):
        return FakeTensor(mode, _meta_like(x), x.device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_fake(v, mode) for v in x)
    return x


def _any_channels_last(margs: tuple) -> bool:
    """Whether a tensor argument suggests another memory format than C-contiguous: only then
    can the device kernel's layout differ from the meta kernel's (and only then is the cost of
    a fake-tensor mode, whose first use imports TorchDynamo, ~1-2 s once per process, paid)."""
    return any(isinstance(a, torch.Tensor) and a.dim() >= 4
               and suggest_memory_format(a) != torch.contiguous_format for a in margs)


def _device_layout_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func``'s result as fake tensors on the arguments' devices: their layouts are those
    the device kernels give (see ``_DEVICE_LAYOUT``)."""
    mode = FakeTensorMode()
    fargs = _to_fake(args, mode)
    fkwargs = {k: _to_fake(v, mode) for k, v in kwargs.items()}
    with mode:
        return func(*fargs, **fkwargs)


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _meta_like(x)
    if isinstance(x, torch.device):
        return torch.device("meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    return x


class MetaCache:
    """Result templates of calls, cached per operator and argument signature."""

    def __init__(self, counters: Counter[str]):
        self._cache: dict[Any, Any] = {}
        self._dtypes = pointwise.Dtypes()  # of pointwise calls (``_pointwise``)
        self._counters = counters  # the session's: counts ``meta_fallbacks``

    def output_template(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """(result template, outputs as ``Out``) for this call; None when the output shapes
        depend on data (ask the host)."""
        key = (func, _sig(args), _sig(tuple(kwargs.items())) if kwargs else None)
        try:
            return self._cache[key]
        except KeyError:
            pass
        template = self._infer(func, args, kwargs)
        if len(self._cache) < META_CACHE_ENTRIES:
            self._cache[key] = template
        return template

    def _infer(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Output template from meta execution; None when the shapes depend on data."""
        if shape_rule(func) is not None:  # known to depend on data: no meta attempt
            return None
        fast = self._pointwise(func, args, kwargs)
        if fast is not None:
            return fast
        # (sizes alone decide these: no meta execution for each new count)
        sized = resampling.resized(func, args, kwargs) or indexing.indexed(func, args, kwargs)
        if sized is not None:
            return _one_output(*sized)
        margs = _to_meta(args)
        mkwargs = {k: _to_meta(v) for k, v in kwargs.items()}
        try:
            result = func(*margs, **mkwargs)
            if func in _DEVICE_LAYOUT and _any_channels_last(margs):
                result = _device_layout_call(func, args, kwargs)
        except DynamicOutputShapeException:
            return None
        except Exception:  # no meta kernel, or an error the host will report verbatim
            self._counters["meta_fallbacks"] += 1
            return None
        outs: list[Out] = []
        return (_template(result, outs), outs)

    def _pointwise(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The template of a functional pointwise call (``pointwise``) whose tensor arguments
        all have one shape and C-contiguous strides, but for 0-dim ones: PyTorch's
        TensorIterator gives such operands one C-contiguous output of that shape (a 0-dim
        operand broadcasts with stride 0 everywhere, and orders no dimension), in a dtype
        worked out once per argument dtypes and kinds. None: not this case (meta execution
        decides). A detector's box arithmetic makes a new signature every frame (the count
        changes); this spares it a meta execution per call, which for a comparison with a
        0-dim value (``labels == class_id`` in a per-class NMS loop) costs ~250 us."""
        described = pointwise.describe(func, args, kwargs)
        if described is None:
            return None
        key, tensors = described
        shape: tuple[int, ...] = ()
        for t in tensors:
            if t.dim():
                shape = tuple(t.shape)
                break
        strides = codec.contiguous_strides(shape)
        if any(t.dim() and (tuple(t.shape) != shape or t.stride() != strides)
               for t in tensors):
            return None
        if any(s < 2 for s in shape) and any(not t.dim() for t in tensors):
            # with a 0-dim operand the iterator's general setup lays out sizes 0 and 1 its own
            # way (stride 0 where a C-contiguous one is 3): meta execution decides those
            return None
        dtype = self._dtypes.of(key, func, args, kwargs)
        if dtype is None:
            return None
        return _one_output(shape, strides, dtype)


def app_device(args: tuple, kwargs: dict) -> torch.device:
    """The device the app sees a call's outputs on: its ``device=`` or first tensor's."""
    dev = kwargs.get("device")
    if isinstance(dev, torch.device):
        return dev
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0].device
    return torch.device("cpu")


def restride(func: Any, args: tuple, kwargs: dict) -> None:
    """Apply an in-place view op (``transpose_``) to the proxy's own metadata, without
    dispatching: the host changed its tensor's layout, the app's wrapper must follow."""
    with torch.utils._mode_utils.no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)


def materialize(x: Any, handles: list, info: OpInfo, args: tuple, kwargs: dict,
                device: torch.device) -> Any:
    """The call's result from its template: proxies on ``handles`` for new outputs, the
    argument itself for outputs that alias a mutated argument (handle None)."""
    if isinstance(x, Out):
        h = handles[x.k]
        if h is None:
            return arg_at(args, kwargs, *info.ret_alias[x.k])
        return new_proxy(h, x.shape, x.stride, x.offset, x.dtype, device)
    if isinstance(x, (list, tuple)):
        return type(x)(materialize(v, handles, info, args, kwargs, device) for v in x)
    return x
