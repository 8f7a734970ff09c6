"""Local operator parallelism (Hybrid-Parallel's LOP) on a recorded sequence: where robot and
host may each compute a band of the rows of the same values, and, for a split point, which.

A *split region* is a set of calls that read the app's input (which the robot holds whole) and
each other's values, each a local operator (its output rows read a band of its input rows, the
backend's ``rows`` rule: ``plugins.torch.rows``), with nothing else of the inference as input
but weights. Candidates grow by depth from the inputs (``Space.regions``): the first few
convolutions, then more, up to every local call. For a region and a split point ``f`` (the
robot's share of the rows at the region's edge), ``Space.bands`` says which rows each side
computes and holds: at the region's outputs (its values read outside it, or by the app) the
robot makes rows ``[0, round(f * H))`` and the host the rest; going back through the region,
each side makes the rows its later calls read (a convolution's window reaches past the split:
those rows are made on both sides, LOP's redundant computation instead of a transfer per
layer). Every value's two bands meet or overlap, so the whole value can always be put together
(an app that reads a value in the middle of an inference). What crosses the link: the host's
band of each input (up), and at the region's edge the robot's band of each output the host
reads on (up) or the host's band of each the robot reads on (down).

Pure and framework-neutral: the robot daemon (to plan), the shim and the GPU host (to run a
plan) work it out from the definition alone and agree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rrto.v1 import ops_pb2
from rrtod.partition import ITEMSIZE
from rrtod.wire import iter_tensor_refs

SRC = ops_pb2.SeqSource
Shape = tuple[int, ...] | None
# The backend's rule for a call (``InterceptionBackend.rows``): (call, shapes of its tensor
# arguments, shapes of its outputs) -> an object with ``kind``, ``rows_in``, ``rows_out``,
# ``height`` and ``need(lo, hi)``, or None if it is not a local operator.
RuleOf = Callable[[ops_pb2.OpCall, Sequence[Shape], Sequence[Shape]], Any]
ROW = -2  # the row dimension, from the end
MERGE_OP = "aten::cat.default"  # how the host puts a value together from the two bands


@dataclass(frozen=True)
class Region:
    calls: tuple[int, ...]  # ascending
    inputs: tuple[int, ...]  # local indices of the app inputs it reads rows of
    outputs: tuple[int, ...]  # local indices of its values read outside it or by the app


@dataclass(frozen=True)
class Bands:
    """Who makes which rows under one split. Per region call ``k``: the robot makes rows
    ``[0, robot[k])`` of its outputs that have rows, the host ``[host[k], height[k])`` (none:
    ``robot[k] == 0`` or ``host[k] == height[k]``). Per value with rows (``held``): the rows
    the robot holds ``[0, a)`` and the first the host holds, ``b`` (``a >= b``)."""

    region: Region
    robot: dict[int, int]
    host: dict[int, int]
    height: dict[int, int]
    held: dict[int, tuple[int, int]]
    rules: dict[int, Any]  # per region call, its row rule
    height_of: dict[int, int]  # per value in ``held``, its rows
    starts: dict[int, list[int | None]]  # per region call, per tensor argument: the first row
    # the host holds of it (None: read whole, a weight)


class Space:
    """The split regions of one definition and their bands (see the module's docstring)."""

    def __init__(self, d: ops_pb2.SequenceDef, rule_of: RuleOf,
                 movable: Sequence[bool] | None = None):
        self.d = d
        local = {rid: i for i, rid in enumerate(d.local_ids)}
        shape: dict[int, tuple[int, ...]] = {}
        itemsize: dict[int, int] = {}
        self.rules: dict[int, Any] = {}
        self.row_args: dict[int, list[int | None]] = {}  # per local call: per ref, local idx
        self.row_outs: dict[int, list[int]] = {}
        inputs: set[int] = set()
        readers: dict[int, set[int]] = {}
        slot = 0
        depth: dict[int, int] = {}
        maker: dict[int, int] = {}
        for k, call in enumerate(d.calls):
            refs = list(iter_tensor_refs(call))
            srcs = [d.sources[slot + j] for j in range(len(refs))]
            slot += len(refs)
            ins: list[int | None] = []
            shapes: list[Shape] = []
            for j, (ref, src) in enumerate(zip(refs, srcs, strict=True)):
                i = None
                if src.kind == SRC.PRODUCED and src.id in local:
                    i = local[src.id]
                elif src.kind == SRC.INPUT and ref.WhichOneof("ref") == "upload":
                    # the app's input: by its local index, or (read by this call alone) by
                    # its slot, as ``-1 - slot``
                    i = local.get(ref.bind_id, -1 - (slot - len(refs) + j))
                    shape[i] = tuple(ref.upload.meta.shape)
                    itemsize[i] = ITEMSIZE.get(ref.upload.meta.dtype, 4)
                    inputs.add(i)
                ins.append(i)
                shapes.append(shape.get(i) if i is not None else None)
                if i is not None:
                    readers.setdefault(i, set()).add(k)
            outs = [tuple(m.shape) for m in call.out_meta]
            for j, rid in enumerate(call.out_ids):
                if rid in local and j < len(outs):
                    shape[local[rid]] = outs[j]
                    itemsize[local[rid]] = ITEMSIZE.get(call.out_meta[j].dtype, 4)
                    maker.setdefault(local[rid], k)
            r = rule_of(call, shapes, outs) if len(outs) == len(call.out_ids) else None
            ok = r is not None and (movable is None or movable[k]) and not call.want_meta \
                and all(rid in local for rid in call.out_ids)
            deep = 0
            if ok:
                for j, i in enumerate(ins):
                    src = srcs[j]
                    if r.rows_in[j]:
                        if i is not None and i in inputs:
                            continue
                        if i is None or maker.get(i) not in depth:  # not a local call's
                            ok = False
                            break
                        deep = max(deep, depth[maker[i]])
                    elif src.kind not in (SRC.PERSISTENT,):
                        ok = False  # a value without rows made in the inference, a constant
                        break
            if ok:
                depth[k] = deep + (1 if r.kind != "same" else 0)
                self.rules[k] = r
                self.row_args[k] = [i if r.rows_in[j] else None for j, i in enumerate(ins)]
                self.row_outs[k] = [local[rid] for j, rid in enumerate(call.out_ids)
                                    if r.rows_out[j]]
        self._local = local
        self._shape = shape
        self._itemsize = itemsize
        self._readers = readers
        self._outputs = {local[o] for o in d.outputs if o in local}
        self._inputs = inputs
        self._maker = maker
        self._depth = depth

    def regions(self) -> list[Region]:
        """The candidate regions, smallest first: the local calls up to each depth (windows
        from the inputs), each closed over what it reads, kept if it is valid (its inputs are
        read by its calls only)."""
        out: list[Region] = []
        seen: set[tuple[int, ...]] = set()
        for top in sorted(set(self._depth.values())):
            calls = tuple(k for k, dk in sorted(self._depth.items()) if dk <= top)
            region = self.region(calls)
            if region is not None and region.calls not in seen:
                seen.add(region.calls)
                out.append(region)
        return out

    def region(self, calls: Sequence[int]) -> Region | None:
        """``calls`` as a region, or None if they are not one (a call that is not local or
        reads a value made outside them other than an input, an input read outside them)."""
        inside = set(calls)
        if not inside or any(k not in self.rules for k in inside):
            return None
        used: set[int] = set()
        for k in inside:
            for i in self.row_args[k]:
                if i is None:
                    continue
                if i in self._inputs:
                    used.add(i)
                elif self._maker.get(i) not in inside:
                    return None
        if any(not self._readers.get(i, set()) <= inside for i in used):
            return None
        outputs = sorted({i for k in inside for i in self.row_outs[k]
                          if i in self._outputs or not self._readers.get(i, set()) <= inside})
        if any(i in self._outputs for k in inside for i in self._made(k)
               if i not in self.row_outs[k]):
            return None  # the app downloads an output without rows (a max's indices)
        if any(self.height(i) < 2 for i in outputs):
            return None  # a value of one row cannot be split between the sides
        return Region(tuple(sorted(inside)), tuple(sorted(used)), tuple(outputs))

    def _made(self, k: int) -> list[int]:
        return [self._local[r] for r in self.d.calls[k].out_ids if r in self._local]

    def height(self, i: int) -> int:
        s = self._shape.get(i)
        return s[-2] if s is not None and len(s) >= 2 else 0

    def row_bytes(self, i: int) -> int:
        """Bytes of one row of value ``i``."""
        s = self._shape.get(i) or ()
        h = self.height(i)
        total = self._itemsize.get(i, 4)
        for x in s:
            total *= x
        return total // h if h else 0

    def bands(self, region: Region, split_at: float) -> Bands:
        """Which rows each side makes and holds when the robot takes ``split_at`` of the rows
        at the region's edge (see the module's docstring)."""
        a: dict[int, int] = {}
        b: dict[int, int] = {}
        for i in region.outputs:
            h = self.height(i)
            # each side makes a row at least: a band the host does not hold would leave it
            # nothing to put together with the robot's (or to push)
            a[i] = b[i] = min(max(round(split_at * h), 1), h - 1)
        robot: dict[int, int] = {}
        host: dict[int, int] = {}
        height: dict[int, int] = {}
        for k in reversed(region.calls):
            outs = self.row_outs[k]
            h = self.height(outs[0]) if outs else 0
            top = max((a.get(i, 0) for i in outs), default=0)
            bottom = min((b.get(i, h) for i in outs), default=h)
            top = max(top, bottom)  # the bands meet: the whole value can be put together
            robot[k], host[k], height[k] = top, bottom, h
            r = self.rules[k]
            for i in self.row_args[k]:
                if i is None:
                    continue
                if top > 0:
                    a[i] = max(a.get(i, 0), r.need(0, top)[1])
                if bottom < h:
                    b[i] = min(b.get(i, self.height(i)), r.need(bottom, h)[0])
        held: dict[int, tuple[int, int]] = {}
        for k in region.calls:
            for i in self.row_outs[k]:
                held[i] = (robot[k], host[k])
        for i in region.inputs:
            held[i] = (self.height(i), b.get(i, self.height(i)))
        starts = {k: [held[i][1] if i is not None else None for i in self.row_args[k]]
                  for k in region.calls}
        return Bands(region, robot, host, height, held, {k: self.rules[k] for k in region.calls},
                     {i: self.height(i) for i in held}, starts)

    def edges(self, region: Region) -> tuple[list[int], list[int]]:
        """The region's outputs read on by calls outside it, and those the app downloads."""
        inside = set(region.calls)
        read = [i for i in region.outputs if not self._readers.get(i, set()) <= inside]
        return read, [i for i in region.outputs if i in self._outputs]

    def bands_of(self, calls: Sequence[int], split_at: float) -> Bands:
        """``bands`` of the region ``calls``; ValueError if they are not one."""
        region = self.region(calls)
        if region is None:
            raise ValueError(f"sequence {self.d.id}: calls {list(calls)[:8]} are not a split "
                             "region (rrtod.lop)")
        return self.bands(region, split_at)


def merges(d: ops_pb2.SequenceDef, bands: Bands,
           robot: frozenset[int] = frozenset()) -> dict[int, list[tuple[int, int]]]:
    """Per host call outside ``bands``' region that reads region values: (its tensor
    argument, local index) of each, which the host puts together before it runs."""
    local = {rid: i for i, rid in enumerate(d.local_ids)}
    inside = set(bands.region.calls)
    made = set(bands.held) - set(bands.region.inputs)  # the region's values
    out: dict[int, list[tuple[int, int]]] = {}
    slot = 0
    for k, call in enumerate(d.calls):
        for j, _ref in enumerate(iter_tensor_refs(call)):
            src = d.sources[slot]
            slot += 1
            if k in inside or k in robot or src.kind != SRC.PRODUCED:
                continue
            i = local.get(src.id)
            if i in made:
                out.setdefault(k, []).append((j, i))
    return out
