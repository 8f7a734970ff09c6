"""Loops whose count the data decides, folded out of an op log so that a search can find them.

A detector's post-processing often runs a Python loop over its detections (torchvision's
keypoint decoding, per-box crops, masks pasted one by one): the same calls once per box, a
different number of times every inference. No block of the log repeats then, and a search
finds at best the calls the inferences begin with (``rrtod.robot.search.common_prefix``).

``fold`` finds such loops and returns the log with each loop's iterations after the first left
out (and each list argument that gathers one tensor per iteration cut to its first item), so
that every inference has the same calls again and the ordinary search and verification run on
it unchanged. A loop is folded only when unrolling it from one recorded iteration will give
the calls the app makes (``rrtod.loops``), checked over every iteration in the log:

- the calls repeat with the same loose keys (``regions``: a run of at least two periods);
- each iteration reads only values made before the loop (the same tensor in every iteration:
  a buffer it fills, the boxes it walks), its own earlier calls' values (never an earlier
  iteration's) and the same weights; it uploads nothing but a constant with the same bytes
  every time; or, iteration ``i``, output ``i`` of a call before the loop with one output per
  iteration (``for c in t`` unbinds ``t``: a scattered call, cut to its first output);
- an integer argument that changes within a loop is the iteration's index (``boxes[i]``) or a
  size or read value of one of the iteration's own tensors (``int(w.item())``), the same one
  in every iteration;
- after the loop, a value an iteration made is read only as one item per iteration of a list
  argument, in order (``torch.stack(points)``).

The count of a loop must then be, in every inference, a size of a tensor made before it; that
and the rest are checked by the search on the folded log (``rrtod.robot.search``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from rrto.v1 import ops_pb2
from rrtod.robot.oplog import LoggedCall, copied, resolve_reads
from rrtod.robot.shapes import Path, SizeOf, Unexplained, _differing_ints, _product, _size_of
from rrtod.wire import iter_tensor_refs

MAX_BODY = 256  # calls in one iteration: longer repeats are whole inferences, not loops


@dataclass
class Region:
    start: int  # first call of the loop (in the log searched)
    body: int  # calls per iteration
    count: int  # iterations (at least 2)

    @property
    def end(self) -> int:
        return self.start + self.body * self.count


@dataclass
class Body:
    """What every iteration of the loops with these calls shares (positions in the body)."""

    index: list[tuple[int, Path]] = field(default_factory=list)  # integers that are ``i``
    symbols: dict[tuple[int, Path], SizeOf] = field(default_factory=dict)  # own sizes/values
    scatters: set[int] = field(default_factory=set)  # calls before the loop (offsets < 0)
    varies_from: int | None = None  # first call whose exact key differs between iterations


@dataclass
class Folded:
    entries: list[LoggedCall]  # the log with loops folded
    loops: dict[int, tuple[Region, Body]]  # folded position of a loop's first call -> it
    # folded position -> its gathered lists: (path, folded position of their loop)
    gathers: dict[int, list[tuple[Path, int]]] = field(default_factory=dict)


def regions(keys: np.ndarray, max_body: int = MAX_BODY) -> list[Region]:
    """Non-overlapping runs of at least two repetitions of a block of calls, longest first
    (for a run, its shortest period). One vectorised comparison per period."""
    n = len(keys)
    found: list[Region] = []
    for p in range(1, min(max_body, n // 2) + 1):
        same = np.concatenate(([False], keys[:-p] == keys[p:], [False]))
        edges = np.flatnonzero(np.diff(same.view(np.int8)))
        lo, hi = edges[::2], edges[1::2]
        long = np.flatnonzero(hi - lo >= p)  # keys[lo : hi + p] are p-periodic: 2+ periods
        for j in long.tolist():
            found.append(Region(int(lo[j]), p, (int(hi[j] - lo[j]) + p) // p))
    found.sort(key=lambda r: (-(r.body * r.count), r.body, r.start))
    taken: list[Region] = []
    busy = np.zeros(n, dtype=bool)
    for r in found:
        if not busy[r.start: r.end].any():
            busy[r.start: r.end] = True
            taken.append(r)
    # Inside each repeated block, the runs of one of its periods, in every period: a loop
    # whose count happened to be the same in consecutive inferences is inside a run of whole
    # inferences (``fold`` then groups it with the loop's runs elsewhere).
    inner = [Region(r.start + j * r.body + x.start, x.body, x.count)
             for r in taken if r.body > 2
             for x in regions(keys[r.start: r.start + r.body], max_body)
             for j in range(r.count)]
    return sorted(taken + inner, key=lambda r: (r.start, -r.body * r.count))


def fold(log: list[LoggedCall]) -> Folded | None:
    """``log`` (compared by ``key``) with its loops folded; None if it has none that can be."""
    if log and len(log[0].reads) != len(log[0].refs):
        resolve_reads(log)
    keys = np.fromiter((e.key for e in log), dtype=np.int64, count=len(log))
    # A loop is the same calls after the same call, every inference; one that runs as many
    # times in each is a model's fixed structure (two equal layers), not for folding.
    groups: dict[tuple[Any, ...], list[Region]] = {}
    for r in regions(keys):
        before = int(keys[r.start - 1]) if r.start else None
        groups.setdefault((before, *keys[r.start: r.start + r.body].tolist()), []).append(r)
    kept: list[tuple[Region, Body]] = []
    for group in groups.values():
        if len({r.count for r in group}) < 2:
            continue
        body = _body(log, group)
        if body is not None:
            kept += [(r, body) for r in group]
    kept.sort(key=lambda x: (x[0].start, -x[0].end))
    kept = _outermost(kept)
    if not kept:
        return None
    # old position -> new; an iteration after the first maps onto the first's call
    where = np.arange(len(log))
    drop = np.zeros(len(log), dtype=bool)
    for r, _ in kept:
        rel = np.arange(r.start + r.body, r.end)
        where[rel] = r.start + (rel - r.start) % r.body
        drop[r.start + r.body: r.end] = True
    last = kept[-1][0]
    rest = len(log) - last.end
    if 0 < rest < last.body and (keys[last.end:] == keys[last.start: last.start + rest]).all():
        drop[last.end:] = True  # an iteration under way when the search ran: left out too
        where[last.end:] = np.arange(last.start, last.start + rest)
    scattered = {r.start + off: r for r, body in kept for off in body.scatters}
    new = np.cumsum(~drop) - 1
    remap = new[where]
    out: list[LoggedCall] = []
    gathers: dict[int, list[tuple[Path, int]]] = {}
    inside = sorted((r.start, r.end, r) for r, _ in kept)
    for i, e in enumerate(log):
        if drop[i]:
            continue
        e2 = _scattered(e) if i in scattered else _gathered(e, inside, i)
        if e2 is None:
            return None  # reads what one iteration made, not as a gathered list: not a loop
        e2, paths = e2
        if paths:
            gathers[len(out)] = [(path, int(new[r.start])) for path, r in paths]
        e2.index = len(out)
        e2.reads = tuple((int(remap[p]) if p >= 0 else p, o, int(remap[b]) if b >= 0 else b)
                         for p, o, b in e2.reads)
        out.append(e2)
    return Folded(out, {int(new[r.start]): (r, body) for r, body in kept}, gathers)


def _outermost(kept: list[tuple[Region, Body]]) -> list[tuple[Region, Body]]:
    """The loops not inside another one kept (sorted by start, longest first): a loop's
    iterations are folded whole."""
    out: list[tuple[Region, Body]] = []
    for r, body in kept:
        if not out or r.start >= out[-1][0].end:
            out.append((r, body))
    return out


def _iteration_of(pos: int, inside: list[tuple[int, int, Region]]) -> tuple[Region, int] | None:
    for a, end, r in inside:
        if a <= pos < end:
            return r, (pos - a) // r.body
    return None


def _scattered(e: LoggedCall) -> tuple[LoggedCall, list[tuple[Path, Region]]] | None:
    """A call whose outputs are one per iteration of the loop after it, cut to its first
    output (what iteration 0 reads) and keyed without their number, as the loop is folded to
    its first iteration: inferences with other counts have the same calls again."""
    if e.raw is None or not e.outputs:
        return None
    call = ops_pb2.OpCall()
    call.CopyFrom(e.raw)
    del call.out_ids[1:], call.out_meta[1:]
    e2 = replace(e, raw=call, outputs=e.outputs[:1])
    _rekey(e2, e, "scattered", e.loose)
    return e2, []


def _rekey(e2: LoggedCall, e: LoggedCall, why: str, loose: Any) -> None:
    """Keys of ``e2``, a rewritten ``e``: its exact key from its call without ids, outputs
    and sequence number; its loose one from ``loose``; the searched one of the same kind as
    ``e``'s."""
    blank = ops_pb2.OpCall()
    blank.CopyFrom(e2.raw)
    for ref in iter_tensor_refs(blank):
        ref.Clear()
    del blank.out_ids[:], blank.out_meta[:]
    blank.seq = 0
    e2.exact = hash((why, blank.SerializeToString(deterministic=True)))
    e2.loose = hash((why, loose))
    e2.key = e2.loose if e.key == e.loose else e2.exact


def _gathered(e: LoggedCall, inside: list[tuple[int, int, Region]],
              i: int) -> tuple[LoggedCall, list[tuple[Path, Region]]] | None:
    """``e`` as the folded log has it: unchanged, unless it is after a loop and reads values
    its iterations made, which it may only as a list of one per iteration (cut to the first
    item, returned with the lists' paths). None if it reads them otherwise."""
    own = _iteration_of(i, inside)
    foreign = [k for k, (kind, _v) in enumerate(e.refs) if kind == "live"
               and (it := _iteration_of(e.reads[k][2], inside)) is not None
               and (own is None or it[0] is not own[0])]
    if not foreign:
        return copied(e, e.key), []
    if e.raw is None:
        return None
    call = ops_pb2.OpCall()
    call.CopyFrom(e.raw)
    paths: list[tuple[Path, Region]] = []
    firsts: list[int] = []  # the first item of each gathered list
    keep = list(range(len(e.refs)))
    ordinal = 0
    for top, v in [*enumerate(call.args), *((k, call.kwargs[k]) for k in sorted(call.kwargs))]:
        ordinal, ok = _cut(v, (top,), ordinal, e, inside, foreign, paths, firsts, keep)
        if not ok:
            return None
    if any(k in foreign and k not in firsts for k in keep):
        return None
    e2 = replace(e, raw=call, refs=tuple(e.refs[k] for k in keep),
                 reads=tuple(e.reads[k] for k in keep))
    _rekey(e2, e, "gathered", (e.op, tuple(p for p, _ in paths), len(keep)))
    return e2, paths


def _cut(v: ops_pb2.Value, path: Path, ordinal: int, e: LoggedCall,
         inside: list[tuple[int, int, Region]], foreign: list[int],
         paths: list[tuple[Path, Region]],
         firsts: list[int], keep: list[int]) -> tuple[int, bool]:
    """Walk ``v`` (refs numbered from ``ordinal``); cut a list that gathers a loop's values to
    its first item. Returns the next ordinal, and False for a list that reads them otherwise."""
    kind = v.WhichOneof("kind")
    if kind == "tensor":
        return ordinal + 1, True
    if kind not in ("list", "tuple"):
        return ordinal, True
    items = getattr(v, kind).items
    if items and all(it.WhichOneof("kind") == "tensor" for it in items) \
            and ordinal in foreign:
        ks = list(range(ordinal, ordinal + len(items)))
        reads = [e.reads[k] for k in ks]
        it0 = _iteration_of(reads[0][2], inside)
        if it0 is None:
            return ordinal, False
        r = it0[0]
        rel = [(p - r.start) % r.body for p, _o, _b in reads]
        if (len(items) != r.count or any(k not in foreign for k in ks)
                or [_iteration_of(b, inside) for _p, _o, b in reads]
                != [(r, j) for j in range(r.count)]
                or len(set(rel)) != 1 or len({o for _p, o, _b in reads}) != 1):
            return ordinal, False
        del items[1:]
        for k in ks[1:]:
            keep.remove(k)
        paths.append((path, r))
        firsts.append(ordinal)
        return ordinal + len(ks), True
    for j, item in enumerate(items):
        ordinal, ok = _cut(item, (*path, j), ordinal, e, inside, foreign, paths, firsts,
                            keep)
        if not ok:
            return ordinal, False
    return ordinal, True


def _body(log: list[LoggedCall], group: list[Region]) -> Body | None:
    """Check that every iteration of these loops does what unrolling the first would (the
    module docstring's rules); what they share, or None."""
    p = group[0].body
    starts = [(r, r.start + j * p, j) for r in group for j in range(r.count)]
    body = Body()
    within: set[tuple[int, Path]] = set()
    for q in range(p):
        first = log[starts[0][1] + q]
        if any(len(log[s + q].outputs) != len(first.outputs) for _r, s, _j in starts):
            return None
        for k in range(len(first.refs)):
            scatter = _scatter_of(log, starts, q, k)
            if scatter is not None:
                body.scatters.add(scatter)
                continue
            seen: dict[Any, Any] = {}
            for r, s, _j in starts:
                e = log[s + q]
                ref_kind, value = e.refs[k]
                if ref_kind == "persistent":  # a weight: the same one in every iteration
                    if seen.setdefault("weight", value) != value:
                        return None
                    continue
                if ref_kind == "upload":
                    if not _same_bytes(log, starts, q, k):
                        return None  # fresh data every iteration: an input per box
                    break
                pos, out, born = e.reads[k]
                if s <= pos < s + q:
                    what: Any = ("own", pos - s, out)
                elif born < r.start:  # (-1: older than the log, as a weight bound long ago)
                    what = ("before", value)  # the same tensor in every iteration of a loop
                else:
                    return None  # another iteration's value, or one not in the log
                if seen.setdefault("kind", what[0]) != what[0]:
                    return None
                if seen.setdefault(id(r) if what[0] == "before" else "own", what) != what:
                    return None
        if any(log[s + q].exact != first.exact for _r, s, _j in starts) \
                and body.varies_from is None:
            body.varies_from = q
        for r in group:
            calls = [log[r.start + j * p + q].raw for j in range(r.count)]
            if any(c is None for c in calls):
                return None
            try:
                within.update((q, path) for path, _ in _differing_ints(calls))  # type: ignore[arg-type]
            except Unexplained:
                return None
    for q, path in sorted(within, key=lambda x: (x[0], str(x[1]))):
        calls = [log[s + q].raw for _r, s, _j in starts]
        values = [_int_at(c, path) for c in calls]  # type: ignore[arg-type]
        if values == [j for _r, _s, j in starts]:
            body.index.append((q, path))
            continue
        try:  # a size or read value of the iteration's own calls, the same in every iteration
            body.symbols[(q, path)] = _size_of(log, [s for _r, s, _j in starts], q, values)
        except Unexplained:
            return None
    return body


def _scatter_of(log: list[LoggedCall], starts: list[tuple[Region, int, int]], q: int,
                k: int) -> int | None:
    """If ref ``k`` of body call ``q`` reads, in iteration ``j`` of every loop, output ``j`` of
    the same call before the loop, one with an output per iteration: that call's offset from
    the loop's start (negative)."""
    offsets = set()
    for r, s, j in starts:
        e = log[s + q]
        if e.refs[k][0] != "live":
            return None
        pos, out, _born = e.reads[k]
        if not 0 <= pos < r.start or out != j or len(log[pos].outputs) != r.count:
            return None
        offsets.add(pos - r.start)
    return offsets.pop() if len(offsets) == 1 else None


def _same_bytes(log: list[LoggedCall], starts: list[tuple[Region, int, int]], q: int,
                k: int) -> bool:
    first = None
    for _r, s, _j in starts:
        raw = log[s + q].raw
        ref = next((x for n, x in enumerate(iter_tensor_refs(raw)) if n == k), None) \
            if raw is not None else None
        if ref is None or ref.WhichOneof("ref") != "upload":
            return False
        key = (ref.upload.data, ref.upload.meta.SerializeToString())
        if first is None:
            first = key
        elif key != first:
            return False
    return True


def _int_at(call: ops_pb2.OpCall, path: Path) -> int | None:
    where, at, *items = path
    v = call.kwargs[at] if where == "kw" else call.args[at]
    for j in items:
        v = getattr(v, v.WhichOneof("kind")).items[j]
    return v.i if v.WhichOneof("kind") == "i" else None


@dataclass
class FoundLoop:
    """A loop of a verified block of the folded log (positions relative to the block)."""

    start: int
    body: int
    count: tuple[int, int, int]  # (call, output, dimension) whose size is the count
    shared: Body
    gathers: list[tuple[int, Path]]  # (call after the loop, path of the gathered list)
    scatters: list[int] = field(default_factory=list)  # calls before it, one output per iteration


def loops_of(folded: Folded, start: int, period: int, repeats: int) -> list[FoundLoop] | None:
    """The loops of the block ``[start, start + period)`` of ``folded.entries``, the same in
    each of its ``repeats`` blocks, each counted by a size of a tensor made before it in its
    block (in every block); None if one is not."""
    log = folded.entries
    blocks = [start + r * period for r in range(repeats)]
    out: list[FoundLoop] = []
    for pos in sorted(p for p in folded.loops if start <= p < start + period):
        region, shared = folded.loops[pos]
        rel = pos - start
        here = [folded.loops.get(b + rel) for b in blocks]
        if any(h is None or h[0].body != region.body or h[1] is not shared for h in here):
            return None
        counts = [h[0].count for h in here]  # type: ignore[index]
        scatters = sorted(rel + off for off in shared.scatters)
        first = min([rel, *scatters])
        if first < (out[-1].start + out[-1].body if out else 0):
            return None  # a scattered call inside the previous loop or before the block
        count = ((_unbound(log, blocks, scatters[0], counts) if scatters else None)
                 or _counted_by(log, blocks, first, counts))
        if count is None:
            return None
        out.append(FoundLoop(rel, region.body, count, shared, [], scatters))
    by_start = {lp.start: lp for lp in out}
    for pos, paths in folded.gathers.items():
        if start <= pos < start + period:
            for path, loop_at in paths:
                owner = by_start.get(loop_at - start)
                if owner is None:
                    return None
                owner.gathers.append((pos - start, path))
    return out


def _unbound(log: list[LoggedCall], blocks: list[int], rel: int,
             counts: list[int]) -> tuple[int, int, int] | None:
    """If the scattered call at ``rel`` is ``unbind(t, dim)`` of a tensor made in its block
    whose size ``dim`` is ``counts[r]`` in block ``r``, for every block: (call, output, dim)
    of ``t``. The loop is then counted by what the app iterates, in any inference."""
    found = set()
    for b, c in zip(blocks, counts, strict=True):
        e = log[b + rel]
        if e.op != "aten::unbind.int" or e.raw is None or not e.reads or e.refs[0][0] != "live":
            return None
        args = e.raw.args
        dim = args[1].i if len(args) > 1 else e.raw.kwargs["dim"].i if "dim" in e.raw.kwargs else 0
        pos, out, _born = e.reads[0]
        if not b <= pos < b + rel or dim < 0 or _product(log[pos], out, dim, 1) != c:
            return None
        found.add((pos - b, out, dim))
    return found.pop() if len(found) == 1 else None


def _counted_by(log: list[LoggedCall], blocks: list[int], rel: int,
                counts: list[int]) -> tuple[int, int, int] | None:
    """The nearest (call, output, dimension) before ``rel`` (a loop's first call, or its first
    scattered call) whose size is ``counts[r]`` in block ``r``, for every block."""
    for j in range(rel - 1, -1, -1):
        for o, shape in enumerate(log[blocks[0] + j].out_shapes()):
            for d in range(len(shape)):
                if all(_product(log[b + j], o, d, 1) == c for b, c in zip(blocks, counts, strict=True)):
                    return (j, o, d)
    return None
