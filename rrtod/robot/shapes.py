"""Shapes that follow the data: what may differ between the recorded repetitions of a sequence.

A detector's head keeps the boxes above a threshold (``nonzero``, a boolean mask, ``nms``): the
count differs every inference, so do the shapes of everything after it, and so do integer
arguments the app computes from those shapes (``boxes.view(n, -1)``, ``torch.zeros(n, 4)``).
The calls and their dataflow are still the same every inference; only sizes move.

Verification (``rrtod.robot.search.verify``) compares a candidate's repetitions by their loose
keys (operators, dataflow, dtypes and ranks). Where their exact keys differ, ``explain`` accounts
for every difference, or the candidate is refused:

- a tensor argument produced in the inference may have another shape (its producer's did);
- an upload (an input the app made, such as a ``torch.zeros(n, 4)`` of its own) may have
  another shape, not another dtype or rank: its slot is marked ``any_shape``;
- an integer argument may differ only where it equals, in every repetition, one size of a
  tensor produced earlier in the same inference, or the product of consecutive sizes (what
  ``flatten`` passes to ``view``), or ``int()`` of a one-element tensor of the inference whose
  value the app read (``interpolate(size=int(h.item()))`` in a pose head's per-box loop): it
  becomes a ``SymbolicInt``, which the host fills in from its own tensor and the shim checks
  against the app's call (a read value: against the value the app was given);
- anything else (a float, a string, an integer no size explains, a call that returns another
  number of tensors, such as ``unbind`` of a count) refuses the candidate: the host could not
  know what the app will pass or how many tensors to name.

A call the host answered with its output metadata (``want_meta``: shapes only the data
decides) or anything after a difference makes the rest of the sequence ``varies_from``: the
shim then works those calls' outputs out every inference instead of once.

A count the data decides can also happen to be the same in every recorded repetition (a
detector's RPN kept 257 boxes in both), and an integer the app derives from it then does not
differ (``torch.zeros((num_rois, 256, 7, 7))``, ``reshape(num_rois * num_classes, 4)``).
Recorded as a constant, every later frame with another count would mismatch there. So after
an answered call, an integer of at least ``MIN_COUNT`` is a ``SymbolicInt`` too (``_counts``)
when, in every repetition, it equals one size of an answered call's output, or the product of
consecutive sizes of a tensor made in the last ``COUNT_SCAN`` calls of which one is such a
size (the nearest). Where the app really passed a constant that happened to equal it, a later frame
with another count mismatches, is completed by forwarding, and its search, which sees the
integer differ from the count, records it as the constant it is: never a wrong result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rrto.v1 import ops_pb2
from rrtod.robot.oplog import LoggedCall
from rrtod.wire import READ_VALUE, int_of, iter_tensor_refs

# Where an integer sits in a call: ("arg", position, *list indices) or ("kw", name, *indices).
Path = tuple[Any, ...]
# The size it equals: (position in the block of the producing call, output index, first
# dimension, number of consecutive dimensions whose product it is); first dimension ``VALUE``:
# ``int()`` of that one-element output's value, which the app read.
SizeOf = tuple[int, int, int, int]
VALUE = READ_VALUE
# How far back a symbol's tensor is looked for, in calls (a detector's sizes are used close by).
SCAN_CALLS = 4096
# The least integer taken for an answered count it equals (``_counts``). A smaller count
# (a detector's few boxes) coincides too often with a constant of the model's own: from 2,
# Mask R-CNN's benchmark frames (1 to 9 detections) waited for 6.85 replies an inference
# against 2.65, from mismatches at such constants made symbols.
MIN_COUNT = 16
# How far back a tensor whose sizes include such a count is looked for (a reshape of it is
# close by); an answered call's own output is looked for further, up to ``SCAN_CALLS``.
COUNT_SCAN = 128


class Unexplained(Exception):
    """A difference between repetitions that replay cannot reproduce."""


@dataclass
class Shapes:
    """What ``explain`` found for a block (positions are relative to the block's start)."""

    symbols: dict[tuple[int, Path], SizeOf] = field(default_factory=dict)
    any_shape: set[tuple[int, int]] = field(default_factory=set)  # (call, tensor ref) uploads
    varies_from: int | None = None
    answered: list[int] = field(default_factory=list)  # calls the host answered, in order
    # per repetition, the sizes (at least ``MIN_COUNT``) of the answered calls' outputs so far
    counts: list[set[int]] = field(default_factory=list)

    def note_answered(self, log: list[LoggedCall], blocks: list[int], i: int) -> None:
        self.answered.append(i)
        if not self.counts:
            self.counts = [set() for _ in blocks]
        for seen, b in zip(self.counts, blocks, strict=True):
            seen.update(n for shape in log[b + i].out_shapes() for n in shape if n >= MIN_COUNT)

    def note_varies(self, i: int) -> None:
        if self.varies_from is None or i < self.varies_from:
            self.varies_from = i


def explain(log: list[LoggedCall], blocks: list[int], period: int) -> Shapes:
    """Account for every exact-key difference between the blocks of ``period`` calls that
    start at ``blocks``; raises ``Unexplained``. Cheap when nothing differs (a static
    model): one comparison of keys per call."""
    shapes = Shapes()
    for i in range(period):
        explain_call(log, blocks, i, shapes)
    return shapes


def explain_call(log: list[LoggedCall], blocks: list[int], i: int, shapes: Shapes) -> None:
    """``explain`` for the calls at position ``i`` of the blocks, into ``shapes``."""
    first = log[blocks[0] + i]
    if any(len(log[b + i].outputs) != len(first.outputs) for b in blocks):
        # ``unbind`` of a count, ``split`` into a count of parts: the host would make a
        # different number of tensors than the sequence names
        raise Unexplained(f"call {i}: another number of outputs")
    if any(log[b + i].exact != first.exact for b in blocks):
        shapes.note_varies(i)
        calls = [log[b + i].raw for b in blocks]
        if any(c is None for c in calls):
            raise Unexplained(f"call {i}: not recorded")
        _uploads(i, calls, shapes)  # type: ignore[arg-type]
        for path, values in _differing_ints(calls):  # type: ignore[arg-type]
            shapes.symbols[(i, path)] = _size_of(log, blocks, i, values)
    if shapes.answered and first.raw is not None:
        _counts(log, blocks, i, first.raw, shapes)
    if first.result is not None:
        shapes.note_varies(i)  # its outputs' shapes are the host's answer
        shapes.note_answered(log, blocks, i)


def _counts(log: list[LoggedCall], blocks: list[int], i: int, call: ops_pb2.OpCall,
            shapes: Shapes) -> None:
    """Integers of call ``i`` (the same in every repetition) that are a count the data
    decided, or a multiple of one: each a symbol of the nearest size that explains it."""
    ints: list[tuple[Path, int]] = []
    for a, v in enumerate(call.args):
        _ints(v, ("arg", a), ints)
    for name in sorted(call.kwargs):
        _ints(call.kwargs[name], ("kw", name), ints)
    for path, n in ints:
        if n < MIN_COUNT or (i, path) in shapes.symbols \
                or not any(n % c == 0 for c in shapes.counts[0]):
            continue
        size = _count_size(log, blocks, i, n, shapes)
        if size is not None:
            shapes.symbols[(i, path)] = size


def _ints(v: ops_pb2.Value, path: Path, out: list[tuple[Path, int]]) -> None:
    kind = v.WhichOneof("kind")
    if kind in ("list", "tuple"):
        for j, item in enumerate(getattr(v, kind).items):
            _ints(item, (*path, j), out)
    elif kind == "i":
        out.append((path, v.i))


def _count_size(log: list[LoggedCall], blocks: list[int], i: int, n: int,
                shapes: Shapes) -> SizeOf | None:
    """The nearest size, or product of consecutive sizes of which one is an answered count,
    that is ``n`` in every repetition: of a tensor of the last ``COUNT_SCAN`` calls, or of an
    answered call's output up to ``SCAN_CALLS`` back."""
    near = max(-1, i - 1 - COUNT_SCAN)
    answered = [j for j in reversed(shapes.answered) if near >= j >= i - SCAN_CALLS]
    for j in [*range(i - 1, near, -1), *answered]:
        for o, shape in enumerate(log[blocks[0] + j].out_shapes()):
            for span in range(1, len(shape) + 1):
                for d in range(len(shape) - span + 1):
                    if math.prod(shape[d:d + span]) == n and _counted(log, blocks, j, o, d,
                                                                      span, n, shapes):
                        return (j, o, d, span)
    return None


def _counted(log: list[LoggedCall], blocks: list[int], j: int, o: int, d: int, span: int,
             n: int, shapes: Shapes) -> bool:
    """Sizes ``d .. d + span`` of output ``o`` of call ``j`` multiply to ``n`` in every
    repetition, and one of them is an answered count in every repetition."""
    per_rep = []
    for b in blocks:
        shapes_b = log[b + j].out_shapes()
        if o >= len(shapes_b) or d + span > len(shapes_b[o]):
            return False
        sizes = shapes_b[o][d:d + span]
        if math.prod(sizes) != n:
            return False
        per_rep.append(sizes)
    return any(all(sizes[e] in seen for sizes, seen in zip(per_rep, shapes.counts, strict=True))
               for e in range(span))


def _uploads(i: int, calls: list[ops_pb2.OpCall], shapes: Shapes) -> None:
    """Uploads whose shape differs (dtype and rank are equal: the loose keys were)."""
    per_call = [list(iter_tensor_refs(c)) for c in calls]
    for k, ref in enumerate(per_call[0]):
        if ref.WhichOneof("ref") != "upload":
            continue
        shape = list(ref.upload.meta.shape)
        if any(list(refs[k].upload.meta.shape) != shape for refs in per_call[1:]):
            shapes.any_shape.add((i, k))


def _differing_ints(calls: list[ops_pb2.OpCall]) -> list[tuple[Path, list[int]]]:
    """Integer arguments that are not the same in every repetition; raises ``Unexplained``
    for any other non-tensor difference."""
    out: list[tuple[Path, list[int]]] = []
    first = calls[0]
    for a, v in enumerate(first.args):
        _walk(v, [c.args[a] for c in calls], ("arg", a), out)
    for name in sorted(first.kwargs):
        _walk(first.kwargs[name], [c.kwargs[name] for c in calls], ("kw", name), out)
    return out


def _walk(v: ops_pb2.Value, vs: list[ops_pb2.Value], path: Path,
          out: list[tuple[Path, list[int]]]) -> None:
    kind = v.WhichOneof("kind")
    if any(x.WhichOneof("kind") != kind for x in vs):
        raise Unexplained(f"argument {path}: of another kind")
    if kind in ("list", "tuple"):
        items = [getattr(x, kind).items for x in vs]
        if any(len(it) != len(items[0]) for it in items):
            raise Unexplained(f"argument {path}: another length")
        for j in range(len(items[0])):
            _walk(items[0][j], [it[j] for it in items], (*path, j), out)
    elif kind == "i":
        values = [x.i for x in vs]
        if any(x != values[0] for x in values):
            out.append((path, values))
    elif kind != "tensor" and any(x != vs[0] for x in vs):
        raise Unexplained(f"argument {path}: {kind} differs")


def _size_of(log: list[LoggedCall], blocks: list[int], i: int, values: list[int]) -> SizeOf:
    """The nearest size (or product of consecutive sizes) of a tensor made earlier in the
    block, or value the app read of one (``VALUE``), that equals ``values`` (one per
    repetition) in every repetition."""
    b0 = blocks[0]
    for j in range(i - 1, max(-1, i - 1 - SCAN_CALLS), -1):
        first = log[b0 + j]
        for o, shape in enumerate(first.out_shapes()):
            for span in range(1, len(shape) + 1):
                for d in range(len(shape) - span + 1):
                    if math.prod(shape[d:d + span]) != values[0]:
                        continue
                    if all(_product(log[b + j], o, d, span) == v
                           for b, v in zip(blocks[1:], values[1:], strict=True)):
                        return (j, o, d, span)
        if first.values:
            for o in range(len(first.outputs)):
                if all(_read_int(log[b + j], o) == v for b, v in zip(blocks, values, strict=True)):
                    return (j, o, VALUE, 0)
    raise Unexplained(f"call {i}: an integer argument {values} is no size of this inference "
                      "nor a value the app read")


def _read_int(e: LoggedCall, o: int) -> int | None:
    """``int()`` of the value the app read of output ``o`` of ``e`` (None if it read none)."""
    return int_of(e.values.get(e.outputs[o]) if o < len(e.outputs) else None)


def _product(e: LoggedCall, o: int, d: int, span: int) -> int | None:
    shapes = e.out_shapes()
    if o < len(shapes) and d + span <= len(shapes[o]):
        return math.prod(shapes[o][d:d + span])
    return None
