"""A run of prepared calls that the GPU host replays with one native call (``hostloop.cpp``).

The replayer (``rrtod.gpu.replay``) cuts each sequence into runs of consecutive calls that need
nothing of it between them (no input of the app's to wait for, no push, no symbolic integer)
and gives the executor each run with its dataflow: per call, per tensor argument, an *external*
tensor (a weight, a constant, a value made before the run, or bytes the definition holds) or a
value an earlier call of the run made. A run is eligible here when every call returns only
tensors and writes in place only what it returns (``relu_``: ``batchable``), and the native
loop is built (``native.module``). The loop answers the calls the app waits for as each ran,
and copies what an in-place call overwrites just before it runs where the replayer asks (the
app has not matched it: an abort may have to undo it).

Memory safety is the Python path's, not relaxed: the bytes each call allocates are the sizing
module's (meta execution per input sizes; for an operator whose output sizes follow the data,
its bound from the input sizes), learnt in a *calibrating* run - the calls one at a time with
their tensors, each admitted before it runs - and admitted as a whole before each native run,
which the loop only starts when every external tensor has the sizes, strides, dtype and device
it was calibrated with, and stops before any call whose output differs from its calibrated
layout; from there the run is *stepped* (each call admitted for its own sizes, then run alone).
A run whose sizes follow the data (its calibrated run met other sizes, within it or in its
external tensors: a detector's per-class loop, a mask head's boxes, every frame other counts)
would be stepped every time, ~30 us of Python around
each call; it runs *bounded* instead: the most each call allocated when stepped (its cap) is
admitted for the whole run, the loop takes any sizes, and it stops before a call whose new
outputs took more than its cap - one call past what was admitted, as a calibrated run's call
with other sizes is; it is then stepped from there, and its cap grows. Every output is checked
to stay inside its storage and conformed to the layout the app's proxy describes, as
``_run_plain`` does. Where a call fails, nothing of it is kept (what it wrote in
place is written back from its copy), and the replayer runs it and the rest through the Python
path, which reports what went wrong.
"""

from __future__ import annotations

from typing import Any

import torch

from .prepared import PreparedCall, _dense, _Hole, written_args

_PLACEHOLDER = torch.empty(0)  # a tensor argument's place in a template (the run fills it)


def _template(p: PreparedCall) -> tuple[list[Any], list[bool], list[tuple[int, int]]] | None:
    """The call's arguments in its schema's order, each hole replaced by a placeholder, which
    arguments take their defaults, and per hole (argument, item in its list or -1). None when
    a tensor sits deeper than a list of the top level, or the arguments do not fit the
    schema."""
    arguments = p.op._schema.arguments
    if len(p.args) > len(arguments):
        return None
    values: list[Any] = [None] * len(arguments)
    defaulted = [True] * len(arguments)
    at: dict[int, tuple[int, int]] = {}

    def place(i: int, v: Any) -> Any:
        if type(v) is _Hole:
            at[v.index] = (i, -1)
            return _PLACEHOLDER
        if isinstance(v, (list, tuple)):
            items = []
            for j, x in enumerate(v):
                if type(x) is _Hole:
                    at[x.index] = (i, j)
                    items.append(_PLACEHOLDER)
                elif isinstance(x, (list, tuple)) and _holds_hole(x):
                    raise LookupError("nested")
                else:
                    items.append(x)
            return type(v)(items)
        return v

    index = {a.name: i for i, a in enumerate(arguments)}
    try:
        for i, v in enumerate(p.args):
            values[i], defaulted[i] = place(i, v), False
        for name, v in p.kwargs.items():
            i = index[name]
            values[i], defaulted[i] = place(i, v), False
    except LookupError:
        return None
    if sorted(at) != list(range(len(at))):
        return None
    return values, defaulted, [at[h] for h in range(len(at))]


def _holds_hole(v: Any) -> bool:
    if type(v) is _Hole:
        return True
    return isinstance(v, (list, tuple)) and any(_holds_hole(x) for x in v)


def batchable(p: Any, native: Any) -> bool:
    """Whether the native loop can replay prepared call ``p``: an operator that returns only
    tensors (new ones, or views: checked like any output), writes in place only arguments it
    returns (so the written tensor's sizes and strides are checked as its output's), and whose
    arguments the loop can hold (tried once, kept on the call). An operator whose output sizes
    follow the data (``x[mask]``, ``nonzero``) is one: what it may allocate is bounded by its
    input sizes (``sizing``), and where its outputs differ from the calibrated ones the run is
    stepped from it."""
    if type(p) is not PreparedCall or not _outputs(p) \
            or (p.written and not _returns_writes(p.op)):
        return False
    if p.native is None:
        p.native = False
        if all(str(r.type) in ("Tensor", "List[Tensor]") for r in p.op._schema.returns):
            trial = native.Batch()
            trial.set_externals(p.tensors)
            try:
                _add(trial, p, list(range(p.tensors)))
                p.native = True
            except (ValueError, RuntimeError, TypeError):
                pass
    return p.native


def _returns_writes(op: Any) -> bool:
    """Whether every argument ``op`` writes in place is one it returns (``Tensor(a!)`` both
    ways, as ``relu_`` and ``index_put_``), not one it only writes (``out=``-style outputs are
    returned too; a batch norm's running statistics are not)."""
    schema = op._schema
    returned = {s for r in schema.returns if r.alias_info is not None and r.alias_info.is_write
                for s in r.alias_info.before_set}
    return all(a.alias_info.before_set <= returned for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write)


def _add(loop: Any, p: PreparedCall, sources: list[int]) -> None:
    made = _template(p)
    if made is None or len(made[2]) != len(sources):
        raise ValueError(f"{p.what}: its arguments do not fit a template")
    values, defaulted, holes = made
    loop.add(p.op._schema.name, p.op._schema.overload_name, values, defaulted,
             [(arg, item, s) for (arg, item), s in zip(holes, sources, strict=True)],
             [(list(shape), list(stride), _dense(shape, stride)) for shape, stride in p.layouts]
             or [([], [], False)] * p.outs)


def _outputs(p: PreparedCall) -> int:
    """How many outputs ``p`` makes: its layouts, or where the app is answered their sizes
    (it describes none: ``nonzero``, ``nms``), the ids it names; such outputs are kept as the
    operator laid them out, as ``run_prepared`` keeps them."""
    return len(p.layouts) or p.outs


class Batch:
    """One run of prepared calls, built into the native loop; calibrated by its first run.
    ``sources``: per call, per tensor argument, ``e >= 0`` for external tensor ``e``, or
    ``-(v + 1)`` for the run's ``v``-th value (its calls' outputs in order)."""

    __slots__ = ("loop", "calls", "sources", "total", "needs", "caps", "varies", "first",
                 "written", "what")

    def __init__(self, native: Any, calls: list[PreparedCall], sources: list[list[int]],
                 externals: int):
        self.loop = native.Batch()
        self.loop.set_externals(externals)
        written: list[list[int]] = []
        for p, src in zip(calls, sources, strict=True):
            _add(self.loop, p, src)
            written.append(_written_holes(p))
        self.calls = calls
        self.sources = sources
        self.total = 0  # bytes the calibrated run allocates, admitted before each run
        self.needs = [0] * len(calls)  # ... per call, as last stepped
        self.caps = [0] * len(calls)  # ... per call, the most it allocated stepped (``varies``)
        # its sizes follow the data within the run (a calibrated run stopped at a call whose
        # outputs differed, and which then ran): it runs *bounded* (``caps``), not calibrated
        self.varies = False
        self.first = [0]  # per call, the index of its first value among the run's
        for p in calls:
            self.first.append(self.first[-1] + _outputs(p))
        self.written = written  # per call, the holes it writes in place
        self.what = f"{calls[0].what} and {len(calls) - 1} more (replayed natively)"


def _written_holes(p: PreparedCall) -> list[int]:
    """The holes of the tensors ``p`` writes in place (``Tensor(a!)`` arguments)."""
    made = _template(p)
    if made is None:
        return []
    positions = {i for i, _name in written_args(p.op)}
    return [h for h, (arg, _item) in enumerate(made[2]) if arg in positions]
