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

A loop over a tensor the app iterates (``for mask, box in zip(masks, boxes)``: an ``unbind``
whose output ``j`` iteration ``j`` reads first) may go on differently in each iteration after
the calls they all make, as values the app reads there decide (``branched``: torchvision's mask
pasting reads ``box[0] < 0`` and the like). Such a loop is folded to its first iteration's
*body*, the calls every iteration begins with; each set of values its *guards* (the bools the
app reads in the body) took chooses a *variant*, the calls that follow, the same ones whenever
the values are the same, each checked over its iterations by the rules above
(``rrtod.loops``: ``SeqLoop.variants``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from rrto.v1 import ops_pb2
from rrtod.loops import MAX_GUARDS, MAX_VARIANTS
from rrtod.robot.oplog import LoggedCall, copied, resolve_reads
from rrtod.robot.shapes import VALUE, Path, SizeOf, Unexplained, _differing_ints, _product, _size_of
from rrtod.wire import int_of, iter_tensor_refs

MAX_BODY = 256  # calls in one iteration: longer repeats are whole inferences, not loops


@dataclass
class Region:
    start: int  # first call of the loop (in the log searched)
    body: int  # calls per iteration (a branched loop: those every iteration begins with)
    count: int  # iterations (at least 2)
    # A branched loop: where each iteration starts, and where the last one ends.
    starts: list[int] | None = None
    stop: int = 0

    @property
    def end(self) -> int:
        return self.stop if self.starts is not None else self.start + self.body * self.count

    def iteration(self, pos: int) -> int:
        """The iteration that call ``pos`` (inside the loop) belongs to."""
        if self.starts is None:
            return (pos - self.start) // self.body
        return bisect.bisect_right(self.starts, pos) - 1

    def first(self, j: int) -> int:
        """Where iteration ``j`` starts."""
        return self.start + j * self.body if self.starts is None else self.starts[j]


@dataclass
class Variant:
    """What the iterations whose guards took the values ``when`` make after the body: the calls
    of the first of them, where each of their tensor arguments comes from (``_origin``), what
    they share (positions from the iteration's start) and what the app downloads of them."""

    when: tuple[float, ...]
    calls: list[LoggedCall]
    body: list[LoggedCall]  # the body of the same iteration (its ids name what it made)
    region: Region  # the loop that iteration is in
    sources: list[list[tuple[Any, ...]]] = field(default_factory=list)
    shared: Body | None = None
    outputs: set[tuple[int, int]] = field(default_factory=set)  # (call, output)


@dataclass
class Branches:
    """A branched loop's guards, (body call, output) whose values the app reads, and the
    variants they chose."""

    guards: list[tuple[int, int]]
    variants: list[Variant]


@dataclass
class Body:
    """What every iteration of the loops with these calls shares (positions in the body)."""

    index: list[tuple[int, Path]] = field(default_factory=list)  # integers that are ``i``
    symbols: dict[tuple[int, Path], SizeOf] = field(default_factory=dict)  # own sizes/values
    scatters: set[int] = field(default_factory=set)  # calls before the loop (offsets < 0)
    varies_from: int | None = None  # first call whose exact key differs between iterations
    branches: Branches | None = None  # a branched loop's variants


@dataclass
class Folded:
    entries: list[LoggedCall]  # the log with loops folded
    loops: dict[int, tuple[Region, Body]]  # folded position of a loop's first call -> it
    # folded position -> its gathered lists: (path, folded position of their loop)
    gathers: dict[int, list[tuple[Path, int]]] = field(default_factory=dict)
    # per position of the log folded, the folded position of its call (a later iteration's
    # call: the first iteration's)
    at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


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
    kept += branched(log, keys)
    kept.sort(key=lambda x: (x[0].start, -x[0].end))
    kept = _outermost(kept)
    if not kept:
        return None
    # old position -> new; an iteration after the first maps onto the first's call
    where = np.arange(len(log))
    drop = np.zeros(len(log), dtype=bool)
    variant = np.zeros(len(log), dtype=bool)  # a branched loop's calls after its body
    for r, _ in kept:
        if r.starts is None:
            rel = np.arange(r.start + r.body, r.end)
            where[rel] = r.start + (rel - r.start) % r.body
            drop[r.start + r.body: r.end] = True
            continue
        for j, a in enumerate(r.starts):  # a body onto the first's; a variant out
            stop = r.starts[j + 1] if j + 1 < len(r.starts) else r.end
            where[a: a + r.body] = np.arange(r.start, r.start + r.body)
            where[a + r.body: stop] = r.start + r.body - 1
            variant[a + r.body: stop] = True
            drop[a if j else a + r.body: stop] = True
    last = kept[-1][0]
    rest = len(log) - last.end
    if last.starts is None and 0 < rest < last.body \
            and (keys[last.end:] == keys[last.start: last.start + rest]).all():
        drop[last.end:] = True  # an iteration under way when the search ran: left out too
        where[last.end:] = np.arange(last.start, last.start + rest)
    scattered = {r.start + off: r for r, body in kept for off in body.scatters}
    new = np.cumsum(~drop) - 1
    remap = new[where]
    for body in {id(b): b for _r, b in kept if b.branches is not None}.values():
        for v in body.branches.variants:  # type: ignore[union-attr]
            v.sources = [[_folded(x, v.region, new, where) for x in refs] for refs in v.sources]
    out: list[LoggedCall] = []
    gathers: dict[int, list[tuple[Path, int]]] = {}
    inside = sorted((r.start, r.end, r) for r, _ in kept)
    for i, e in enumerate(log):
        if drop[i]:
            continue
        e2 = _scattered(e) if i in scattered else _gathered(log, e, inside, i)
        if e2 is None:
            return None  # reads what one iteration made, not as a gathered list: not a loop
        e2, paths = e2
        if paths:
            gathers[len(out)] = [(path, int(new[r.start])) for path, r in paths]
        e2.index = len(out)
        reads = []
        for (kind, rid), (p, o, b) in zip(e2.refs, e2.reads, strict=True):
            if p >= 0 and variant[p]:  # a body's value a variant wrote (``im_mask[...] = m``)
                if kind != "live" or b < 0 or variant[b] or rid not in log[b].outputs:
                    return None  # not a body's value: not a loop either
                p, o = b, log[b].outputs.index(rid)
            reads.append((int(remap[p]) if p >= 0 else p, o, int(remap[b]) if b >= 0 else b))
        e2.reads = tuple(reads)
        out.append(e2)
    return Folded(out, {int(new[r.start]): (r, body) for r, body in kept}, gathers, remap)


def _folded(origin: tuple[Any, ...], r: Region, new: np.ndarray,
            where: np.ndarray) -> tuple[Any, ...]:
    """A variant's tensor argument read from before its loop, as an offset from the loop's
    start in the folded log (the same call in every inference's block: ``("before", offset,
    output)``), or by its id where it is older than the log (``("id", id)``)."""
    if origin[0] != "before":
        return origin
    _kind, pos, out, rid = origin
    if pos < 0:
        return ("id", rid)
    return ("before", int(new[where[pos]]) - int(new[r.start]), out)


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
            return r, r.iteration(pos)
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


def _gathered(log: list[LoggedCall], e: LoggedCall, inside: list[tuple[int, int, Region]],
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
        ordinal, ok = _cut(log, v, (top,), ordinal, e, inside, foreign, paths, firsts, keep)
        if not ok:
            return None
    if any(k in foreign and k not in firsts for k in keep):
        return None
    e2 = replace(e, raw=call, refs=tuple(e.refs[k] for k in keep),
                 reads=tuple(e.reads[k] for k in keep))
    _rekey(e2, e, "gathered", (e.op, tuple(p for p, _ in paths), len(keep)))
    return e2, paths


def _cut(log: list[LoggedCall], v: ops_pb2.Value, path: Path, ordinal: int, e: LoggedCall,
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
        if r.starts is None:
            rel = [(p - r.start) % r.body for p, _o, _b in reads]
            outs = {o for _p, o, _b in reads}
        else:  # by where each was made: a variant may write it (``im_mask[...] = m``)
            rel = [b - r.first(j) for j, (_p, _o, b) in enumerate(reads)]
            ids = [e.refs[k][1] for k in ks]
            if any(x >= r.body or rid not in log[b].outputs
                   for x, rid, (_p, _o, b) in zip(rel, ids, reads, strict=True)):
                return ordinal, False
            outs = {log[b].outputs.index(rid) for rid, (_p, _o, b) in zip(ids, reads, strict=True)}
        if (len(items) != r.count or any(k not in foreign for k in ks)
                or [_iteration_of(b, inside) for _p, _o, b in reads]
                != [(r, j) for j in range(r.count)]
                or len(set(rel)) != 1 or len(outs) != 1):
            return ordinal, False
        del items[1:]
        for k in ks[1:]:
            keep.remove(k)
        paths.append((path, r))
        firsts.append(ordinal)
        return ordinal + len(ks), True
    for j, item in enumerate(items):
        ordinal, ok = _cut(log, item, (*path, j), ordinal, e, inside, foreign, paths, firsts,
                            keep)
        if not ok:
            return ordinal, False
    return ordinal, True


def _body(log: list[LoggedCall], group: list[Region]) -> Body | None:
    """Check that every iteration of these loops does what unrolling the first would (the
    module docstring's rules); what they share, or None."""
    p = group[0].body
    return _shared(log, [(r, r.start + j * p, j) for r in group for j in range(r.count)], 0, p)


def _shared(log: list[LoggedCall], starts: list[tuple[Region, int, int]], lo: int,
            hi: int, across: bool = False) -> Body | None:
    """``_body`` for the calls ``lo .. hi - 1`` of the iterations at ``starts`` (loop, where
    the iteration starts, its index), which must be the same calls; positions count from the
    iteration's start. An integer that differs between iterations of one loop follows the
    data; with ``across``, also one that differs between loops (a variant's calls are not in
    the block the search checks, which finds the rest)."""
    body = Body()
    within: set[tuple[int, Path]] = set()
    by_loop: dict[int, list[int]] = {}
    for r, s, _j in starts:
        by_loop.setdefault(0 if across else id(r), []).append(s)
    for q in range(lo, hi):
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
        for ss in by_loop.values():
            calls = [log[s + q].raw for s in ss]
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
    if across:
        for q in range(lo, hi):
            _just_read(log, starts, q, body)
    return body


def _just_read(log: list[LoggedCall], starts: list[tuple[Region, int, int]], q: int,
               body: Body) -> None:
    """Integers of call ``q`` that are the values the app read just before it (``item()`` of
    its own tensors, answered one after the other: ``m[(y0 - box[1]):(y1 - box[1])]`` reads two
    and passes them to ``slice``), matched from the last backwards, the same ones in every
    iteration: symbols even when every iteration had the same value (a variant seen once)."""
    runs = [_reads_before(log, s, q) for _r, s, _j in starts]
    if not runs[0] or any(len(run) != len(runs[0]) for run in runs):
        return
    done = {path for qq, path in [*body.symbols, *body.index] if qq == q}
    k = len(runs[0]) - 1
    for path in reversed(_int_paths(log[starts[0][1] + q].raw)):
        if k < 0:
            return
        if path in done:
            continue
        jj, o, _v = runs[0][k]
        if all(run[k][:2] == (jj, o) and int_of(run[k][2]) == _int_at(log[s + q].raw, path)
               for run, (_r, s, _j) in zip(runs, starts, strict=True)):
            body.symbols[(q, path)] = (jj, o, VALUE, 0)
            k -= 1


def _reads_before(log: list[LoggedCall], s: int, q: int) -> list[tuple[int, int, Any]]:
    """The values the app read (answered ``item()`` calls) right before call ``q`` of the
    iteration at ``s``, in order: (call of the iteration, output, value)."""
    out = []
    p = q - 1
    while p >= 0:
        e = log[s + p]
        if e.outputs or e.raw is None or not e.raw.want_meta or len(e.refs) != 1 \
                or e.refs[0][0] != "live":
            break
        pos, o, _b = e.reads[0]
        value = log[pos].values.get(e.refs[0][1]) if s <= pos < s + p else None
        if value is None:
            break
        out.append((pos - s, o, value))
        p -= 1
    return out[::-1]


def _int_paths(call: ops_pb2.OpCall | None) -> list[Path]:
    """The paths of ``call``'s integer arguments, in order (``_int_at``'s)."""
    out: list[Path] = []

    def walk(v: ops_pb2.Value, path: Path) -> None:
        kind = v.WhichOneof("kind")
        if kind == "i":
            out.append(path)
        elif kind in ("list", "tuple"):
            for j, item in enumerate(getattr(v, kind).items):
                walk(item, (*path, j))
    if call is not None:
        for a, v in enumerate(call.args):
            walk(v, ("arg", a))
        for name in sorted(call.kwargs):
            walk(call.kwargs[name], ("kw", name))
    return out


def branched(log: list[LoggedCall], keys: np.ndarray) -> list[tuple[Region, Body]]:
    """The branched loops of ``log`` (module docstring), each with what its iterations share
    and its variants; those with the same body after the same call (every inference's) share
    one ``Body``, their variants gathered from all of them (a loop's last iteration ends where
    the calls of its variant, seen in any of them, end)."""
    groups: dict[tuple[Any, ...], list[_Candidate]] = {}
    for starts in _iterated(log):
        cand = _branches(log, keys, starts)
        if cand is not None:
            before = int(keys[starts[0] - 1]) if starts[0] else None
            key = (before, *keys[starts[0]: starts[0] + cand.body].tolist(), *cand.guards)
            groups.setdefault(key, []).append(cand)
    out: list[tuple[Region, Body]] = []
    for group in groups.values():
        after: dict[tuple[float, ...], tuple[int, ...]] = {}
        if any(after.setdefault(w, calls) != calls for cand in group
               for w, calls in cand.after.items()):
            continue  # the same values, other calls: something else decides
        regions = [r for cand in group if (r := _ended(log, keys, cand, after)) is not None]
        regions += _ended_new(log, keys, [c for c in group if c.whens[-1] not in after],
                              regions, after)
        if not regions or all(len(calls) == 0 for calls in after.values()):
            continue  # (every iteration makes the same calls: an ordinary loop)
        whens = {id(r): cand.whens for cand in group for r in regions if r.start == cand.starts[0]}
        body = _shared(log, [(r, s, j) for r in regions for j, s in enumerate(r.starts or ())],
                       0, regions[0].body)
        if body is None:
            continue
        chosen: dict[tuple[float, ...], list[tuple[Region, int, int]]] = {}
        for r in regions:
            for j, (s, w) in enumerate(zip(r.starts or (), whens[id(r)], strict=True)):
                chosen.setdefault(w, []).append((r, s, j))
        variants = [v for w, starts in chosen.items()
                    if (v := _variant(log, w, starts, body)) is not None]
        if len(variants) != len(chosen) or len(variants) > MAX_VARIANTS:
            continue
        body.branches = Branches(group[0].guards, variants)
        out += [(r, body) for r in regions]
    return out


@dataclass
class _Candidate:
    """A loop over a tensor's items whose iterations begin alike (``_branches``)."""

    starts: list[int]
    body: int
    guards: list[tuple[int, int]]
    whens: list[tuple[float, ...]]  # per iteration, its guards' values
    after: dict[tuple[float, ...], tuple[int, ...]]  # values -> the keys of the calls after


TAIL = 3  # calls after a branched loop that show where its last iteration ends


def _ended_new(log: list[LoggedCall], keys: np.ndarray, cands: list[_Candidate],
               ended: list[Region], after: dict[tuple[float, ...], tuple[int, ...]]) -> list[Region]:
    """Loops whose last iteration took values no other iteration had, ended where the calls
    that follow every other loop of theirs begin (the same ``TAIL`` calls after each); the
    calls before are that variant's (added to ``after``). The tail is compared by operator:
    its first call is often the gathering of the loop's results (``torch.stack(res)``), whose
    key follows the iteration count."""
    def ops(p: int) -> tuple[str, ...]:
        return tuple(e.op for e in log[p: p + TAIL])

    tails = {ops(r.stop) for r in ended}
    if len(tails) != 1 or len(next(iter(tails))) != TAIL:
        return []
    tail = next(iter(tails))
    out = []
    for cand in cands:
        a = cand.starts[-1] + cand.body
        for p in range(a, min(a + MAX_BODY, len(log) - TAIL) + 1):
            if ops(p) == tail:
                calls = tuple(keys[a: p].tolist())
                if after.setdefault(cand.whens[-1], calls) == calls:
                    out.append(Region(cand.starts[0], cand.body, len(cand.starts),
                                      list(cand.starts), p))
                break
    return out


def _ended(log: list[LoggedCall], keys: np.ndarray, cand: _Candidate,
           after: dict[tuple[float, ...], tuple[int, ...]]) -> Region | None:
    """``cand`` as a region, its last iteration ending where its variant's calls do; None if
    they are not known or not all in the log."""
    last = after.get(cand.whens[-1])
    if last is None:
        return None
    a = cand.starts[-1] + cand.body
    stop = a + len(last)
    if stop > len(log) or tuple(keys[a: stop].tolist()) != last:
        return None
    return Region(cand.starts[0], cand.body, len(cand.starts), list(cand.starts), stop)


def _iterated(log: list[LoggedCall]) -> list[list[int]]:
    """Where the iterations of each loop over a tensor's items start: calls whose outputs
    (two or more) are first read one after the other, output ``j`` by iteration ``j`` (an
    ``unbind``, as ``for box in boxes``). Such calls whose iterations line up are one loop
    (``zip(masks, boxes)``); an iteration starts with the first of their reads."""
    first: dict[int, dict[int, int]] = {}
    for p, e in enumerate(log):
        for (kind, _v), (pos, out, _b) in zip(e.refs, e.reads, strict=True):
            if kind == "live" and pos >= 0 and len(log[pos].outputs) >= 2:
                first.setdefault(pos, {}).setdefault(out, p)
    loops: list[list[int]] = []
    for pos in sorted(first):
        n, readers = len(log[pos].outputs), first[pos]
        if len(readers) != n:
            continue
        at = [readers[j] for j in range(n)]
        if any(a >= b for a, b in zip(at, at[1:], strict=False)):
            continue
        gap = min(b - a for a, b in zip(at, at[1:], strict=False))
        for other in loops:
            if len(other) == n and all(abs(a - b) < gap for a, b in zip(at, other, strict=True)):
                other[:] = [min(a, b) for a, b in zip(at, other, strict=True)]
                break
        else:
            loops.append(at)
    return loops


def _branches(log: list[LoggedCall], keys: np.ndarray, starts: list[int]) -> _Candidate | None:
    """The iterations starting at ``starts`` as a candidate branched loop: the calls they all
    begin with up to the last bool the app reads there (its guards), each iteration's values
    of them, and the calls each set of values goes on with (the last iteration's end is not
    known yet); None if they are not one."""
    limit = min([b - a for a, b in zip(starts, starts[1:], strict=False)]
                + [len(log) - starts[-1]])
    c = 0
    while c < limit and all(keys[a + c] == keys[starts[0] + c] for a in starts):
        c += 1
    guards: list[tuple[int, int]] = []
    for q in range(c):
        for o in range(len(log[starts[0] + q].outputs)):
            read = [log[a + q].outputs[o] in log[a + q].values for a in starts]
            if _dtype(log[starts[0] + q], o) == "bool" and any(read):
                if not all(read):
                    return None  # read in some iterations only: not the same body
                guards.append((q, o))
    if not guards or len(guards) > MAX_GUARDS:
        return None
    # The body ends with the last guard: what follows is the variant's, however many of its
    # first calls the variants seen so far happen to share.
    c = guards[-1][0] + 1
    whens = [tuple(float(log[a + q].values[log[a + q].outputs[o]]) for q, o in guards)
             for a in starts]
    after: dict[tuple[float, ...], tuple[int, ...]] = {}
    for j in range(len(starts) - 1):
        calls = tuple(keys[starts[j] + c: starts[j + 1]].tolist())
        if after.setdefault(whens[j], calls) != calls:
            return None  # the same values, other calls: something else decides
    return _Candidate(list(starts), c, guards, whens, after)


def _variant(log: list[LoggedCall], when: tuple[float, ...],
             starts: list[tuple[Region, int, int]], body: Body) -> Variant | None:
    """The variant the iterations at ``starts`` make after their body (``body``, whose
    scattered calls it may add to), checked over all of them; None if unrolling it would not
    give their calls."""
    r0, s0, j0 = starts[0]
    assert r0.starts is not None
    c = r0.body
    length = (r0.starts[j0 + 1] if j0 + 1 < r0.count else r0.stop) - s0 - c
    shared = _shared(log, starts, c, c + length, across=True)
    if shared is None:
        return None
    v = Variant(when, log[s0 + c: s0 + c + length], log[s0: s0 + c], r0, shared=shared)
    for q in range(c, c + length):
        e = log[s0 + q]
        refs = []
        for k, (kind, value) in enumerate(e.refs):
            scatter = _scatter_of(log, starts, q, k)
            if scatter is not None:
                body.scatters.add(scatter)
                refs.append(("scatter", scatter))
            elif kind == "persistent":
                refs.append(("persistent", value))
            elif kind == "upload":
                refs.append(("fixed",))
            else:
                pos, out, _born = e.reads[k]
                refs.append(("own", pos - s0, out) if s0 <= pos < s0 + q
                            else ("before", pos, out, value))
        v.sources.append(refs)
        for _r, s, _j in starts:
            v.outputs.update((q - c, o) for o, oid in enumerate(log[s + q].outputs)
                             if oid in log[s + q].downloads)
    return v


def _dtype(e: LoggedCall, o: int) -> str | None:
    """The dtype of output ``o`` of ``e``, as the app predicted it or the host replied."""
    metas = e.result.outs if e.result is not None else e.raw.out_meta if e.raw is not None else ()
    return metas[o].dtype if o < len(metas) else None


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
        key = ref.upload.SerializeToString()  # (bytes, metadata, a palette the bytes index)
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


def loops_of(folded: Folded, start: int, period: int, repeats: int,
             blocks: list[int] | None = None) -> list[FoundLoop] | None:
    """The loops of the block ``[start, start + period)`` of ``folded.entries``, the same in
    each of its ``repeats`` blocks (``period`` apart, or those ``blocks`` say), each counted
    by a size of a tensor made before it in its block (in every block); None if one is not."""
    log = folded.entries
    if blocks is None:
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
