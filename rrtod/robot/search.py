"""Sequence search results, and their verification.

A search plugin proposes candidates, ``(start, period)`` positions in one thread's op log; it is
never trusted. ``verify`` accepts a candidate only when the log shows the block
``[start, start+period)`` repeated at least twice with identical operators and an identical,
closed dataflow: every tensor an op reads is an upload (an input of the inference), a persistent
tensor, an output of an earlier op of the same block at the same relative position, or one fixed
tensor that existed before the steady state (a constant, such as a grid built on the first call,
or a buffer the model updates in place, which keeps its id). Anything else, such as a value
carried from one inference into the next under a new id, rejects the candidate.

Reads resolve to the latest write before them, in log order (``LoggedCall.reads``): an op that
writes a value in place (``relu_``, ``+=``) returns the id it read, so an id may be written
several times. ``search_log`` first screens each candidate with a vectorised check of the
keys and of the reads that cross block boundaries (so a wrong candidate costs microseconds, not
a pass over the log), then runs the exact check.

``search_log`` runs a plugin's candidates through ``verify`` under a time budget; plugins may
yield candidates lazily, so a search stops at the first verified one. It searches by exact keys
first, then, if nothing verified, by loose keys (``rrtod.robot.oplog``): a model whose shapes
follow its data repeats only under those, and ``rrtod.robot.shapes.explain`` must then account
for every difference between its repetitions. If still nothing verifies, the inferences may
differ in length because of a loop whose count the data decides: ``rrtod.robot.loopfold``
folds each loop to its first iteration, and the search runs again on the folded log (each loop
then needs a size of the inference that counts it: ``loopfold.loops_of``). Failing that, an
app whose first inference builds something it keeps (an anchor grid, a cache) repeats only from
its second inference on: ``without_first_extras`` takes the first inference, its extra calls
moved out, as the steady state's first repetition, so that a sequence is found after two
inferences, not three. Failing that, ``common_prefix`` finds the calls every recent inference
begins with, a *segment* replayed from one request, after which the inference goes on by
forwarding (one ``nms`` per class present, each reading the last: not a loop that unrolls).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from rrto.v1 import ops_pb2
from rrtod.hookspecs import Candidate, SequenceSearch
from rrtod.robot.loopfold import Folded, FoundLoop, fold, loops_of
from rrtod.robot.oplog import LoggedCall, copied, resolve_reads, with_loose_keys
from rrtod.robot.shapes import Shapes, Unexplained, explain, explain_call
from rrtod.wire import iter_tensor_refs

# (op position in block, ref position in op) -> where the tensor comes from
Source = tuple[str, object]


@dataclass
class Found:
    """A verified inference operator sequence (positions are indices into the searched log)."""

    start: int
    period: int
    repeats: int  # full repetitions seen in the log
    sources: dict[tuple[int, int], Source]  # every tensor input of every op of the block
    inputs: list[tuple[int, int]]  # (op, ref) positions that are uploads
    outputs: list[tuple[int, int]]  # (op, output index) values the app downloads
    keys: list[int] = field(default_factory=list)
    warmup: bool = False  # the calls before the steady state returned values to the app
    shapes: Shapes = field(default_factory=Shapes)  # sizes that follow the data
    # Loops folded out of the log (``rrtod.robot.loopfold``): ``entries`` is then the folded
    # log the positions refer to (None: the log searched).
    loops: list[FoundLoop] = field(default_factory=list)
    entries: list[LoggedCall] | None = None
    searched: int | None = None  # the entries of the log it was found in (None: all of it)

    @property
    def found_at(self) -> int:
        """Inferences seen when found: the steady-state repetitions, plus one for a prefix
        that downloaded something (a warm-up inference; a prefix that only binds weights or
        builds constants is part of the first repetition's inference)."""
        return self.repeats + (1 if self.warmup else 0)


class Outcome(NamedTuple):
    """What one search of one log gave."""

    found: Found | None
    rejected: int  # candidates proposed that verification refused
    timed_out: bool  # the time budget ran out before a candidate verified


def verify(log: list[LoggedCall], cand: Candidate, min_repeats: int = 2,
           quiet_period: int | None = None, blocks: list[int] | None = None) -> Found | None:
    """The sequence ``cand`` proposes, if every block is the same calls with the same dataflow
    and every difference is explained; else None. ``quiet_period``: the app downloaded nothing
    in its last inference, of this many calls (``Recorder``, from its inference marks), so a
    block of that length may return nothing but the shapes it was answered. The blocks are
    ``cand.period`` apart from ``cand.start`` to the log's end, or those ``blocks`` say (their
    starts, the first ``cand.start``; ``paired``): a value a block reads that was made after
    the first block began and not in the block itself is carried, so refused, wherever the
    blocks are."""
    s, period = cand.start, cand.period
    if period <= 0 or s < 0:
        return None
    repeats = (len(log) - s) // period if blocks is None else len(blocks)
    if repeats < min_repeats:
        return None
    if len(log[s].reads) != len(log[s].refs):
        resolve_reads(log)
    if blocks is None:
        blocks = [s + r * period for r in range(repeats)]
    sources: dict[tuple[int, int], Source] = {}
    for i in range(period):
        here = _sources_at(log, blocks, s, i)
        if here is None:
            return None
        sources.update(here)
    outputs = {(i, log[b + i].outputs.index(oid)) for b in blocks for i in range(period)
               for oid in log[b + i].downloads}
    if not outputs and not (period == quiet_period and any(log[s + i].result is not None
                                                           for i in range(period))):
        # An inference returns something to the app: values, or, for an app seen to download
        # nothing in its inferences, the shapes it was answered. Else a block with no
        # download is part of an inference (one class of a per-class loop).
        return None
    try:
        shapes = explain(log, blocks, period)
    except Unexplained:
        return None
    inputs = [pos for pos, src in sources.items() if src[0] == "input"]
    return Found(s, period, repeats, sources, sorted(inputs), sorted(outputs),
                 [e.key for e in log[s : s + period]], any(e.downloads for e in log[:s]), shapes)


class Screen:
    """A log's keys and reads as arrays, to reject most wrong candidates without a Python loop:
    the blocks' keys must repeat, and no read may cross from one block into a later one
    (except reads of values older than the steady state). Never accepts: ``verify`` decides."""

    def __init__(self, log: list[LoggedCall]):
        if log and len(log[0].reads) != len(log[0].refs):
            resolve_reads(log)
        self.keys = np.fromiter((e.key for e in log), dtype=np.int64, count=len(log))
        x, w, born = [], [], []
        for i, e in enumerate(log):
            for (kind, _), (pos, _, first) in zip(e.refs, e.reads, strict=True):
                if kind == "live":
                    x.append(i)
                    w.append(pos)
                    born.append(first)
        self.x = np.array(x, dtype=np.int64)  # reader positions (ascending)
        self.w = np.array(w, dtype=np.int64)  # latest writer before each read
        self.born = np.array(born, dtype=np.int64)  # the value's first write

    def rejects(self, cand: Candidate, min_repeats: int = 2) -> bool:
        s, p = cand.start, cand.period
        if p <= 0 or s < 0:
            return True
        repeats = (len(self.keys) - s) // p
        if repeats < min_repeats:
            return True
        end = s + repeats * p
        if not np.array_equal(self.keys[s: end - p], self.keys[s + p: end]):
            return True
        lo, hi = np.searchsorted(self.x, [s, end])
        x, w, born = self.x[lo:hi], self.w[lo:hi], self.born[lo:hi]
        crossing = (w >= s) & (born >= s) & ((w - s) // p != (x - s) // p)
        return bool(crossing.any())


# An upload with the same bytes in every block, up to this size, is a constant of the sequence
# (``SeqSource.fixed``): the host does not wait for it.
FIXED_MAX = 64 * 1024
# A prefix segment shorter than this is not worth a sequence (forwarding costs about as much).
MIN_SEGMENT = 16


def common_prefix(log: list[LoggedCall], inferences: int = 3,
                  min_length: int = MIN_SEGMENT) -> Found | None:
    """The longest run of calls that each of the last complete ``inferences`` (at least two;
    an inference starts at the first call after a download) begins with, with the same
    operators (loose keys), dataflow and explained differences (``verify``'s rules, with
    blocks that need not follow each other). None if shorter than ``min_length``."""
    if log and len(log[0].reads) != len(log[0].refs):
        resolve_reads(log)
    starts = [e.index for e in log if e.after_fetch]
    if len(starts) < 3:
        return None  # two complete inferences after a first one (which may be a warm-up)
    blocks = starts[-1 - inferences: -1] if len(starts) > inferences else starts[1:-1]
    blocks = blocks if len(blocks) >= 2 else starts[-3:-1]
    ends = [starts[starts.index(b) + 1] for b in blocks]
    first = blocks[0]
    sources: dict[tuple[int, int], Source] = {}
    shapes = Shapes()
    length = 0
    for i in range(min(end - b for b, end in zip(blocks, ends, strict=True))):
        here = _sources_at(log, blocks, first, i)
        if here is None:
            break
        try:
            explain_call(log, blocks, i, shapes)
        except Unexplained:
            break
        sources.update(here)
        length = i + 1
    if length < min_length:
        return None
    shapes.symbols = {k: v for k, v in shapes.symbols.items() if k[0] < length}
    outputs = {(i, log[b + i].outputs.index(oid)) for b in blocks for i in range(length)
               for oid in log[b + i].downloads}
    if not outputs and not any(log[first + i].result is not None for i in range(length)):
        return None  # the app waits for nothing in it: forwarding it costs no round trip
    inputs = [pos for pos, src in sources.items() if src[0] == "input"]
    return Found(first, length, len(blocks), sources, sorted(inputs), sorted(outputs),
                 [e.key for e in log[first: first + length]],
                 any(e.downloads for e in log[:first]), shapes)


def _sources_at(log: list[LoggedCall], blocks: list[int], first: int,
                i: int) -> dict[tuple[int, int], Source] | None:
    """Where the tensors of the calls at position ``i`` of each block come from, if the same
    in every block; None otherwise (another operator, or a read of a value the block did not
    make and that is younger than the first block)."""
    out: dict[tuple[int, int], Source] = {}
    f = log[first + i]
    for r, base in enumerate(blocks):
        e = log[base + i]
        if e.key != f.key or len(e.refs) != len(f.refs):
            return None
        for k, (kind, value) in enumerate(e.refs):
            if kind == "live":
                pos, out_index, born = e.reads[k]
                if base <= pos < base + i:
                    src: Source = ("produced", (pos - base, out_index))
                elif pos < first or born < first:
                    # fixed before the steady state, or an older value written in place
                    src = ("constant", value)
                else:
                    return None  # carried across inferences, or unknown: not replayable
            elif kind == "upload":
                src = ("input", None)
            else:
                src = ("persistent", value)
            if r == 0:
                out[(i, k)] = src
            elif out[(i, k)] != src:
                return None
    for (i_, k), src in out.items():
        if src[0] == "input" and _same_upload(log, blocks, i_, k):
            out[(i_, k)] = ("fixed", None)
    return out


def _same_upload(log: list[LoggedCall], blocks: list[int], i: int, k: int) -> bool:
    """The upload at tensor argument ``k`` of the calls at ``i`` has the same bytes and
    metadata in every block, and is small: a constant the app makes anew each inference."""
    first: ops_pb2.TensorData | None = None
    for b in blocks:
        raw = log[b + i].raw
        if raw is None:
            return False
        ref = next(itertools.islice(iter_tensor_refs(raw), k, None), None)
        if ref is None or ref.WhichOneof("ref") != "upload" or len(ref.upload.data) > FIXED_MAX:
            return False
        if first is None:
            first = ref.upload
        elif ref.upload != first:  # (bytes, metadata, and a palette the bytes index)
            return False
    return first is not None


def _looser(log: list[LoggedCall]) -> bool:
    """Whether loose keys make some calls equal that exact keys tell apart."""
    pairs = {(e.exact, e.loose) for e in log}
    return len({loose for _, loose in pairs}) < len(pairs)


# The calls of the steady state that must follow a run of a first inference's extra calls for
# the run to be taken as extra (``_extra_calls``).
RESYNC = 16


def _extra_calls(a: np.ndarray, b: np.ndarray, trailing: bool = True) -> list[int] | None:
    """Positions of the calls of ``a`` (an inference's keys) that ``b`` (the next one's) does
    not have, if ``b`` is ``a`` with runs of calls left out: each run the shortest after which
    the next ``RESYNC`` calls (or all that are left) agree again. None otherwise, or if
    ``trailing`` is false and a run is at the end of ``a``."""
    extra = len(a) - len(b)
    if extra <= 0:
        return None
    out: list[int] = []
    i = j = 0
    while j < len(b):
        n = min(len(a) - i, len(b) - j)
        differ = np.flatnonzero(a[i: i + n] != b[j: j + n])
        run = int(differ[0]) if len(differ) else n
        i, j = i + run, j + run
        if j == len(b):
            break
        k = min(RESYNC, len(b) - j)
        for skip in range(1, extra - len(out) + 1):
            if np.array_equal(a[i + skip: i + skip + k], b[j: j + k]):
                break
        else:
            return None
        out.extend(range(i, i + skip))
        i += skip
    if i < len(a) and not trailing:
        return None
    out.extend(range(i, len(a)))  # calls after the last of ``b``'s
    return out if len(out) == extra else None


def without_first_extras(log: list[LoggedCall], starts: list[int]) -> list[tuple[
        list[LoggedCall], int, int]]:
    """A first inference that built what later ones reuse (an anchor grid on the first call,
    a cache) has the steady state's calls and some more. For the two last complete
    inferences ``A`` and ``B`` (``starts``: where inferences begin, from the shim's marks; the
    log's start begins one too, so set-up calls before the first inference are extra calls
    of it), ``A``'s keys being ``B``'s with runs of calls added: the log with those extra calls
    moved before ``A`` (the rest of ``A``, ``A'``, then followed by ``B``), and ``A'``'s start
    and length (``_without``). Verified like any candidate, ``A'`` and ``B`` are two
    repetitions of one sequence; the values the extra calls made are constants of it, made
    before its first repetition, as they are for ``B``.

    ``B`` is the last two marks apart or, for a search at a download (whose inference's mark
    comes only with the next one's first call), from the last mark to the log's end; but a
    download may also be inside an inference, so ``B`` may be the start of one: then no run
    of extra calls may end ``A`` (``B`` would be all of ``A`` but its end, and ``A``'s end the
    run). Returns the ways found, marked ones first."""
    ends = [0, *(x for x in starts if 0 < x <= len(log))]
    out = []
    if len(ends) >= 3:
        out.append(_without(log, *ends[-3:], trailing=True))
    if ends[-1] < len(log) and len(ends) >= 2:
        out.append(_without(log, ends[-2], ends[-1], len(log), trailing=False))
    return [x for x in out if x is not None]


def _without(log: list[LoggedCall], a0: int, b0: int, b1: int,
             trailing: bool) -> tuple[list[LoggedCall], int, int] | None:
    """``without_first_extras`` for ``A = log[a0:b0]`` and ``B = log[b0:b1]``. Each read keeps
    the write it resolved to (moved along), so a call of ``A'`` that read what an extra call
    wrote in place reads a constant, and ``B``'s call must read the very same to verify."""
    keys = np.fromiter((e.key for e in log[a0: b1]), dtype=np.int64, count=b1 - a0)
    extra = _extra_calls(keys[: b0 - a0], keys[b0 - a0:], trailing)
    if extra is None:
        return None
    if log and len(log[0].reads) != len(log[0].refs):
        resolve_reads(log)
    moved = set(extra)
    order = [a0 + x for x in extra] + [a0 + x for x in range(b0 - a0) if x not in moved]
    where = np.arange(len(log))  # old position -> new
    where[order] = np.arange(a0, b0)
    out = list(log[:a0])
    for i in [*order, *range(b0, len(log))]:
        e = copied(log[i], log[i].key)
        e.index = len(out)
        e.reads = tuple((int(where[p]) if p >= 0 else p, o, int(where[b]) if b >= 0 else b)
                        for p, o, b in e.reads)
        out.append(e)
    return out, a0 + len(extra), b1 - b0


# Earlier inferences a search pairs with the last one (``paired``), newest first.
MAX_PAIRED = 8


def paired(log: list[LoggedCall], loose: list[LoggedCall], starts: list[int],
           folded_whole: Callable[[], Folded | None] | None = None) -> Iterator[
        tuple[list[LoggedCall], list[int], int, Folded | None]]:
    """An app whose inferences go one of several ways as the data decides (a size that is 1
    or not, a class present or not) may never make the same calls twice in a row, and a
    search of the log's end finds nothing. The last complete inference ``B`` (``starts``,
    from the shim's marks) and the earlier ones with the same calls (the last
    ``MAX_PAIRED``; exact keys, else loose ones, else loose with loops folded) are blocks of
    one sequence, in the log as it is: ``verify`` with those ``blocks``. Each block is its
    inference shifted by the calls logged after ``B`` (an app's calls on ``B``'s outputs
    after its mark, which the sequence ends with, as it ends with a download). Yields
    (log, blocks, period, the folded log or None) to verify: all such blocks, then each
    earlier one with ``B`` alone, newest first (not the one just before ``B``: the log's
    end was searched as it is); the log is folded only when those of the others failed
    (``folded_whole``: ``loose`` folded, where the caller has folded it already)."""
    ends = sorted({0, *(x for x in starts if 0 < x <= len(log))})
    if len(ends) < 4 or len(log) - ends[-1] >= ends[-1] - ends[-2]:
        return  # (or more calls after ``B`` than it has: not its outputs' reads)
    tried: set[tuple[int, ...]] = set()
    for stage in ("exact", "loose", "folded"):
        folded = None if stage != "folded" else \
            folded_whole() if folded_whole is not None else fold(loose)
        if stage == "folded" and folded is None:
            return
        keyed = log if stage == "exact" else loose if folded is None else folded.entries
        at = ends if folded is None else [
            int(folded.at[x]) if x < len(log) else len(keyed) for x in ends]
        shift = len(keyed) - at[-1]
        keys = np.fromiter((e.key for e in keyed), dtype=np.int64, count=len(keyed))
        period = at[-1] - at[-2]
        last = keys[at[-2] + shift:]
        same = [a + shift for a, b in itertools.pairwise(at[max(0, len(at) - 2 - MAX_PAIRED):-2])
                if b - a == period and np.array_equal(keys[a + shift: b + shift], last)]
        b0 = at[-2] + shift
        for blocks in ([*same, b0], *([a, b0] for a in reversed(same) if a + period < b0)):
            key = (folded is not None, *blocks)  # (the loose keys' are the log's positions)
            if len(blocks) >= 2 and key not in tried:
                tried.add(key)
                yield keyed, blocks, period, folded


def _found_without_first_extras(log: list[LoggedCall], starts: list[int], min_repeats: int,
                                quiet_period: int | None) -> Found | None:
    for entries, start, period in without_first_extras(log, starts):
        found = verify(entries, Candidate(start, period), min_repeats, quiet_period)
        if found is not None:  # found after two inferences: the first is a repetition
            found.entries, found.warmup = entries, False
            return found
    return None


def _looped(found: Found, loops: list[FoundLoop], folded: Folded, searched: int | None) -> Found:
    """``found`` in a folded log: its loops, the log its positions refer to, and where the
    calls whose sizes follow the data begin inside each loop."""
    found.loops, found.entries, found.searched = loops, folded.entries, searched
    for lp in loops:
        if lp.shared.varies_from is not None:
            found.shapes.note_varies(lp.start + lp.shared.varies_from)
    return found


def search_log(log: list[LoggedCall], search: SequenceSearch, min_repeats: int = 2,
               budget_s: float | None = None, quiet_period: int | None = None,
               starts: list[int] | None = None) -> Outcome:
    """The first verified candidate. With ``budget_s``, gives up (``timed_out``) when that
    many seconds have passed and no candidate verified; the budget is checked between
    candidates, so a plugin that yields them lazily is cut short too. ``quiet_period``: see
    ``verify``. ``starts``: where the log's inferences begin (``OpLog.inference_starts``),
    for ``without_first_extras`` and ``paired``."""
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    rejected = 0
    loose: list[LoggedCall] | None = None
    for keyed in (log, None):
        if keyed is None:  # nothing repeats exactly: try again with shapes left out
            if not _looser(log):
                break  # the same calls are equal under both keys: nothing new to find
            keyed = loose = with_loose_keys(log)
        screen: Screen | None = None
        for cand in search.candidates(keyed):
            if deadline is not None and time.perf_counter() > deadline:
                return Outcome(None, rejected, True)
            screen = screen or Screen(keyed)
            found = (None if screen.rejects(cand, min_repeats)
                     else verify(keyed, cand, min_repeats, quiet_period))
            if found is not None:
                return Outcome(found, rejected, False)
            rejected += 1
    # A loop whose count the data decides: folded, the inferences have the same calls again.
    # First without the inference under way, if any: a loop it has not ended is not folded (a
    # branched one's iterations are known once the last has ended), and its calls, longer than
    # an inference folded, would look like other inferences to verification. Then whole.
    loose = loose if loose is not None else with_loose_keys(log)
    ends = [*([starts[-1]] if starts and 0 < starts[-1] < len(loose) else []), len(loose)]
    # Folded logs by end: the whole log is folded once, not for ``paired`` again (a Mask
    # R-CNN log of three frames: 0.44 s a fold).
    folds: dict[int, Folded | None] = {}

    def folded_to(end: int) -> Folded | None:
        if end not in folds:
            folds[end] = fold(loose if end == len(loose) else loose[:end])
        return folds[end]

    for end in ends:
        folded = folded_to(end)
        if folded is None:
            continue
        screen = None
        for cand in search.candidates(folded.entries):
            if deadline is not None and time.perf_counter() > deadline:
                return Outcome(None, rejected, True)
            screen = screen or Screen(folded.entries)
            found = (None if screen.rejects(cand, min_repeats)
                     else verify(folded.entries, cand, min_repeats, quiet_period))
            loops = None if found is None else loops_of(folded, found.start, found.period,
                                                        found.repeats)
            if found is not None and loops:
                return Outcome(_looped(found, loops, folded, end), rejected, False)
            rejected += 1
    # A first inference with extra calls: found after the second inference.
    for keyed in (log, loose):
        found = _found_without_first_extras(keyed, starts or [], min_repeats, quiet_period)
        if found is not None:
            return Outcome(found, rejected, False)
    # Inferences alike that are not neighbours (an app whose inferences go several ways).
    for keyed, blocks, period, folded in paired(log, loose, starts or [],
                                                lambda: folded_to(len(loose))):
        if deadline is not None and time.perf_counter() > deadline:
            return Outcome(None, rejected, True)
        found = verify(keyed, Candidate(blocks[0], period), min_repeats, quiet_period, blocks)
        loops = None if found is None or folded is None else loops_of(
            folded, blocks[0], period, len(blocks), blocks)
        if found is not None and folded is None:
            return Outcome(found, rejected, False)
        if found is not None and folded is not None and loops:
            return Outcome(_looped(found, loops, folded, None), rejected, False)
        rejected += 1
    # Inferences of different lengths: the calls they all begin with, as a segment.
    segment = common_prefix(loose)
    return Outcome(segment, rejected, False)


def best(log: list[LoggedCall], search: SequenceSearch, min_repeats: int = 2,
         quiet_period: int | None = None) -> tuple[Found | None, int]:
    """The first verified candidate, and how many candidates verification rejected."""
    found, rejected, _ = search_log(log, search, min_repeats, quiet_period=quiet_period)
    return found, rejected
