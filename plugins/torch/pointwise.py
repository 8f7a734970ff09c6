"""Functional aten pointwise calls, described without meta execution.

A functional pointwise operator (``torch.Tag.pointwise``, one Tensor returned, nothing written,
no seeded randomness) makes one dense output of the broadcast shape of its tensor arguments, in
a dtype that follows the arguments' dtypes, whether each is 0-dim (type promotion's
categories), the types of its Python numbers and the values of its other arguments (``dtype=``,
``rounding_mode=``), never their sizes. So the dtype is worked out once per such key
(``Dtypes``, on 1-element meta tensors) and a call whose sizes change from one inference to
the next (a detector's box count makes every later call a new signature) needs no meta
execution, which costs 0.08-2.9 ms a call here. Both ends use it: the app for a result's
template (``metadata.MetaCache``), the host for the bytes its quota admits (``sizing``).
Only aten operators: another library's tags are its author's word.
"""

from __future__ import annotations

from typing import Any

import torch

_KNOWN: dict[Any, bool] = {}
_NUMBERS = (int, float, complex)
# Arguments that keep an output C-contiguous when its operands are (``clone``'s default);
# another memory format is a call these rules do not describe.
_KEEPS_CONTIGUOUS = (torch.contiguous_format, torch.preserve_format)
DTYPES_MAX = 65_536


def is_pointwise(op: Any) -> bool:
    known = _KNOWN.get(op)
    if known is None:
        schema = op._schema
        known = _KNOWN[op] = (
            op.namespace == "aten" and torch.Tag.pointwise in op.tags and not schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in op.tags
            and len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor")
    return known


def describe(op: Any, args: Any, kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], list[torch.Tensor]] | None:
    """(the key its dtype follows, its tensor arguments) for a functional pointwise call with
    strided tensors and no list argument nor other memory format; None otherwise."""
    if not is_pointwise(op):
        return None
    tensors: list[torch.Tensor] = []
    key: list[Any] = [op]
    items: list[tuple[str | None, Any]] = [(None, v) for v in args]
    if kwargs:
        items += kwargs.items()
    for name, v in items:
        if isinstance(v, torch.Tensor):
            if v.layout is not torch.strided:
                return None
            tensors.append(v)
            key.append((name, v.dtype, v.dim() == 0))
        elif isinstance(v, (list, tuple)):
            return None  # a list argument: not the simple case
        elif isinstance(v, torch.memory_format) and v not in _KEEPS_CONTIGUOUS:
            return None  # ``clone(memory_format=channels_last)``: another layout
        elif isinstance(v, _NUMBERS) and not isinstance(v, bool):
            key.append((name, type(v)))
        else:
            try:
                hash(v)
            except TypeError:
                return None
            key.append((name, v))
    if not tensors:
        return None
    return tuple(key), tensors


class Dtypes:
    """Output dtypes of pointwise calls per ``describe`` key (None: the call fails on meta
    tensors; meta execution then decides, and reports)."""

    def __init__(self) -> None:
        self._known: dict[Any, torch.dtype | None] = {}

    def of(self, key: tuple[Any, ...], op: Any, args: Any,
           kwargs: dict[str, Any]) -> torch.dtype | None:
        dtype = self._known.get(key, False)
        if dtype is False:
            if len(self._known) >= DTYPES_MAX:
                self._known.clear()
            dtype = self._known[key] = _result_dtype(op, args, kwargs)
        return dtype  # type: ignore[return-value]


def _result_dtype(op: Any, args: Any, kwargs: dict[str, Any]) -> torch.dtype | None:
    """The output dtype for these argument dtypes and kinds, from 1-element meta tensors (a
    0-dim tensor stays 0-dim: type promotion treats it apart)."""
    def tiny(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.empty(() if v.dim() == 0 else (1,) * v.dim(), dtype=v.dtype,
                               device="meta")
        return v
    try:
        with torch.inference_mode():
            out = op(*[tiny(a) for a in args], **{k: tiny(v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 - meta execution then decides, and reports
        return None
    if not isinstance(out, torch.Tensor) or out.device.type != "meta":
        return None
    return out.dtype
