"""Record/replay coordination for one app session, on the robot daemon.

Every frame the relay forwards is logged (cheap: the frame is kept as parsed). After a download,
when no sequence is in use for that thread, a sequence search runs in a worker thread, off the
relay's path, within a search budget (``SearchBudget``: failed searches back off). A verified
result becomes a ``SequenceDef`` pushed to the GPU host (which will replay it) and to the shim
(which will match the app's calls against it), and is saved in the state directory so that the
app, restarted, replays from its first inference: saved sequences are offered as soon as the
app has shown the persistent tensors (weights) they use.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from rrto.v1 import ops_pb2
from rrtod import loops
from rrtod.robot.loopfold import FoundLoop
from rrtod.robot.oplog import (
    REBUILT_SEQS,
    LoggedCall,
    OpLog,
    answered_value,
    copied,
    resolve_reads,
)
from rrtod.robot.search import Found, SequenceSearch, search_log
from rrtod.robot.sequences import SequenceStore
from rrtod.robot.shapes import VALUE
from rrtod.wire import (
    REPLAY_BASE,
    RETIRED_KEPT,
    SPAN,
    int_arg,
    int_of,
    iter_tensor_refs,
    scalar_of,
)

log = structlog.get_logger("rrtod.recorder")
SRC = ops_pb2.SeqSource
# How a definition reaches the host (and, for a drop, the shim): the relay's ``push_sequence``.
Push = Callable[[ops_pb2.SequenceDef], Awaitable[None]]

# Calls forwarded on a thread with no replay, beyond which its sequences are stale: this many
# times the longest one's length, plus a margin for occasional extra work between inferences.
STALE_FACTOR, STALE_MARGIN = 2, 8
# Searches of an inference that left a sequence with variants, with the log that sequence was
# found in, per inference mark (``Recorder.search_now``).
MERGE_TRIES = 3
# Aborted replays whose calls the robot waits to put into its log (``ReplayedPrefix``).
MAX_CUTS = 4
WHOLE = 1 << 32  # ``_Replaying.cut`` of a resumed replay the app has not aborted: all its calls
# Seqs of the calls of aborted replays that the host answered (``want_meta``), rebuilt into the
# log with their answers as replies: above any seq an app's forwarded call has.
_REBUILT_SEQS = itertools.count(REBUILT_SEQS)
# The app's next inference start waits for a search (``SearchHint``) only while the session has
# no sequence in use, and while the searches it was told of since the log was cleared have taken
# less than this in all (from hint to end, an upper bound of the app's waits): an inference may
# download several values, each starting a search, and a model that never replays must not
# wait at every download. Defaults of the config's ``record.hint_budget``, ``record.search_wait``.
HINT_BUDGET_S = 0.2
SEARCH_WAIT_S = 0.1


@dataclass
class _Replaying:
    """A replay as the relay saw it go up: what the robot needs to put the calls it ran into
    the op log, should the app abort it (``Recorder.observe_replayed``)."""

    d: ops_pb2.SequenceDef
    base: int
    start: int  # ``ReplayStart.position``
    joined: dict[int, int]
    args: dict[int, ops_pb2.TensorRef] = field(default_factory=dict)  # slot -> what the app sent
    answers: dict[int, ops_pb2.OpResult] = field(default_factory=dict)  # position -> host's answer
    pushed: set[int] = field(default_factory=set)  # local indices the host pushed
    values: dict[int, int | float] = field(default_factory=dict)  # ... those one number: its value
    cut: int = 0  # where the app's call differed (``ReplayAbort.position``)
    at: int = 0  # calls logged then
    fetches: int = 0  # fetches logged then
    log_state: tuple[int, int] = (0, 0)  # the log's (cleared, truncated) then
    switched: bool = False  # the shim went on with a variant: no calls were forwarded
    partial: bool = False  # itself a variant switched to: the calls before it are not logged
    # A loop resumed after a cut (``ReplayStart.loop_count``, ``loop_choices``): its count and
    # the choices of the iterations before the resumed one. Logged where it started, whether
    # the app aborts it or not (the host accounts for both: ``ReplayedPrefix``).
    resume: tuple[int, tuple[int, ...]] | None = None
    # what the calls rebuilt made (``replayed_calls``): a resumed replay's calls read them
    shapes: dict[int, list[int]] = field(default_factory=dict)


def _contiguous(shape: list[int]) -> list[int]:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= max(size, 1)
    return strides[::-1]


def replayed_calls(r: _Replaying, sizes: ops_pb2.ReplayedPrefix,
                   before: _Replaying | None = None) -> list[ops_pb2.OpCall]:
    """The calls an aborted replay ran, as forwarding would have logged them: the recorded
    calls with this inference's ids (``base + local index``, or the ids it joined), the inputs
    the app sent, the sizes the host found for outputs that follow the data, and this
    inference's symbolic integers (a size of its tensors, a value the app read: else a search
    would see the recorded ones, which need not be this inference's). Empty if one cannot be
    rebuilt (an input the relay did not see, an answer or a value it missed). A loop is
    unrolled as both ends did, by the count this inference's sizes give. A resumed replay
    (``_Replaying.resume``) is unrolled as it resumed; the shapes and values of what was made
    before it are those ``before`` (the replay cut there, rebuilt) found."""
    d = r.d
    if before is not None:
        r.values = {**before.values, **r.values}
    try:
        loops.check(d)
        if r.resume is not None:
            d = _resumed(d, *r.resume, r.values)
    except ValueError:
        return []
    head = len(loops.head(d).calls) if d.loops else len(d.calls)
    local = {rid: i for i, rid in enumerate(d.local_ids)}
    symbols: dict[int, list[ops_pb2.SymbolicInt]] = {}
    for sym in d.symbols:
        symbols.setdefault(sym.call, []).append(sym)
    shapes: dict[int, list[int]] = dict(before.shapes) if before is not None else {}
    r.shapes = shapes  # local index -> its shape in this inference

    def id_of(rid: int) -> int:
        i = local.get(rid)
        return rid if i is None else r.joined.get(i, r.base + i)
    slot = sum(1 for call in d.calls[: r.start] for _ in iter_tensor_refs(call))
    out = []
    k = r.start
    short = False
    while k < min(r.cut, len(d.calls)):
        if k == head and d.loops:  # unrolled for this inference's count
            loop = d.loops[0]
            shape = shapes.get(local[loop.tensor], [])
            if loop.dim >= len(shape):
                return []
            try:
                choices = None
                if loop.variants:  # chosen by the guards' values, pushed by the host
                    body = {rid: i for i, rid in enumerate(
                        loops.bodies(d, shape[loop.dim]).local_ids)}
                    choices = loops.choose_known(loop, [
                        tuple(r.values.get(body.get(g, -1), math.nan) for g in gs)
                        for gs in loops.guards(d, shape[loop.dim])])
                d = loops.unroll(d, shape[loop.dim], choices=choices,
                                 cut=choices is not None)
                short = choices is not None and len(choices) < shape[loop.dim]
            except ValueError:
                return []
            head = len(loops.head(d).calls) if d.loops else len(d.calls)
            local = {rid: i for i, rid in enumerate(d.local_ids)}
            symbols = {}
            for sym in d.symbols:
                symbols.setdefault(sym.call, []).append(sym)
            continue
        at, k = k, k + 1
        call = ops_pb2.OpCall()
        call.CopyFrom(d.calls[at])
        call.seq, call.sync = 0, False
        read: list[int] = []  # the local indices of the values the call reads
        for ref in iter_tensor_refs(call):
            src, given = d.sources[slot], r.args.get(slot)
            slot += 1
            if src.kind == SRC.PRODUCED and src.id in local:
                read.append(local[src.id])
            if given is not None:
                if ref.bind_id in local and given.WhichOneof("ref") == "upload":
                    shapes[local[ref.bind_id]] = list(given.upload.meta.shape)
                ref.CopyFrom(given)
            elif src.kind == SRC.PRODUCED:
                ref.Clear()
                ref.id = id_of(src.id)
            elif src.kind == SRC.INPUT and not src.fixed:
                return []
        if call.want_meta:  # the host's answer named its outputs, as a forwarded reply does
            answer = r.answers.get(at)
            if answer is None or len(answer.outs) != len(call.out_ids):
                return []
            for rid, meta in zip(call.out_ids, answer.outs, strict=True):
                if rid in local:
                    shapes[local[rid]] = list(meta.shape)
            value = answered_value(answer)  # ``item()``: a value the app read
            if value is not None and len(read) == 1:
                r.values[read[0]] = value
            del call.out_ids[:]  # in the reply (``OpLog.results``), as when forwarded
            del call.out_meta[:]
        else:
            outs = sizes.calls[at - r.start].outs if at - r.start < len(sizes.calls) else ()
            for meta, size in zip(call.out_meta, outs, strict=False):
                if size.known and len(size.dims) == len(meta.shape):
                    contiguous = list(meta.stride) == _contiguous(list(meta.shape))
                    meta.shape[:] = size.dims
                    if contiguous:
                        meta.stride[:] = _contiguous(list(size.dims))
        for rid, meta in zip(call.out_ids, call.out_meta, strict=False):
            if rid in local:
                shapes[local[rid]] = list(meta.shape)
        for sym in symbols.get(at, ()):
            n = _symbol_now(sym, local.get(sym.tensor), shapes, r.values)
            if n is None:
                return []
            try:
                int_arg(call, sym).i = n
            except ValueError:
                return []
        call.out_ids[:] = [id_of(x) for x in call.out_ids]
        out.append(call)
    if short and k < r.cut:  # cut at a branch no variant has (``loops.unroll(cut=)``) and
        return []  # the app left later: the calls in between are not known here
    return out


def _resumed(d: ops_pb2.SequenceDef, count: int, done: tuple[int, ...],
             values: dict[int, int | float]) -> ops_pb2.SequenceDef:
    """``d`` unrolled as a replay resumed after the iterations ``done`` ran (``ReplayStart
    .loop_choices``) unrolled it in the app's order: the later iterations' variants chosen by
    the guards' values the host pushed (``values``, by local index). ValueError if it cannot
    be."""
    if not d.loops or not d.loops[0].variants or not 0 < len(done) <= count:
        raise ValueError("no loop with variants to resume")
    loop = d.loops[0]
    body = {rid: i for i, rid in enumerate(loops.bodies(d, count).local_ids)}
    more = loops.choose_known(loop, [tuple(values.get(body.get(g, -1), math.nan) for g in gs)
                                     for gs in loops.guards(d, count)[len(done):]])
    return loops.unroll(d, count, choices=[*done, *more], cut=True)


def _reads(calls: list[ops_pb2.OpCall], r: _Replaying) -> list[tuple[int, int, int | float | None]]:
    """The outputs pushed for ``calls`` (an aborted replay's, rebuilt), which the app took
    from the pushes instead of fetching them, as ``OpLog.insert``'s reads: each right after
    the call that made it (where forwarding logs an ``item()``), with its value if it is one
    number."""
    return [(k + 1, oid, r.values.get(oid - r.base)) for k, call in enumerate(calls)
            for oid in call.out_ids if oid - r.base in r.pushed]


def _signature(keys: list[int], d: ops_pb2.SequenceDef) -> tuple[Any, ...]:
    """What makes two sequences of a thread the same: their calls' keys (loose where shapes
    follow the data) and which of their integers are symbols of what (by local index): a
    sequence found again with an integer that follows a value read, where the one in use has
    the constant it happened to be, is another sequence, and the one to replay."""
    local = {rid: i for i, rid in enumerate(d.local_ids)}
    symbols = sorted((s.call, s.arg, s.kwarg, tuple(s.items), s.dim, s.span, s.value, s.index,
                      local.get(s.tensor, -1)) for s in d.symbols)
    loops_ = tuple((lp.start, lp.body, local.get(lp.tensor, -1), lp.dim, tuple(lp.scatters),
                    tuple(tuple(v.when) for v in lp.variants))
                   for lp in d.loops)
    return (tuple(keys), tuple(symbols), d.varies_from if d.HasField("varies_from") else None,
            loops_)


def _same_calls(old: tuple[Any, ...] | None, new: tuple[Any, ...]) -> bool:
    """Whether two sequences' signatures (``_signature``) have the same calls, or the calls of
    one begin the other's (one ends at the app's last read of an output, the other after the
    calls the app made on its outputs then)."""
    if old is None:
        return False
    a, b = old[0], new[0]
    return a[: len(b)] == b or b[: len(a)] == a


def _symbol_now(sym: ops_pb2.SymbolicInt, i: int | None, shapes: dict[int, list[int]],
                values: dict[int, int | float]) -> int | None:
    """A symbolic integer's value in this inference, from the shapes and values of its
    tensor (local index ``i``) seen so far; None if not known."""
    if i is None:
        return None
    if sym.value:
        return int_of(values.get(i))
    shape, span = shapes.get(i), max(sym.span, 1)
    if shape is None or sym.dim + span > len(shape):
        return None
    return math.prod(shape[sym.dim: sym.dim + span])


def build_definition(entries: list[LoggedCall], found: Found, persistent: dict[int, bytes],
                     seq_id: int, thread: int) -> ops_pb2.SequenceDef:
    """The SequenceDef of a verified block: its recorded calls as templates, and for every
    tensor argument where it comes from."""
    block = entries[found.start: found.start + found.period]
    metas = {oid: meta for e in entries[: found.start] if e.raw is not None
             for oid, meta in zip(e.raw.out_ids, e.raw.out_meta, strict=False)}
    d = ops_pb2.SequenceDef(id=seq_id, thread=thread)
    # Local ids: values created by this inference. An output id that existed before the block
    # is a value written in place (a constant, a running statistic) and keeps its id.
    before = {oid for e in entries[: found.start] for oid in e.outputs} | set(persistent)
    local: dict[int, int] = {}
    for e in block:
        assert e.raw is not None
        d.calls.append(e.raw)
        if e.result is not None:  # ``want_meta``: the host named its outputs; so does replay
            d.calls[-1].out_ids.extend(e.outputs)
        for ref in iter_tensor_refs(e.raw):
            if ref.WhichOneof("ref") == "upload" and ref.bind_id:
                local.setdefault(ref.bind_id, len(local))
        for oid in e.outputs:
            if oid not in before:
                local.setdefault(oid, len(local))
    d.local_ids.extend(local)
    for i, e in enumerate(block):
        for k, (_kind, _value) in enumerate(e.refs):
            what, value = found.sources[(i, k)]
            if what == "input":
                d.sources.add(kind=SRC.INPUT)
            elif what == "fixed":  # the same small upload every inference: kept, not waited for
                d.sources.add(kind=SRC.INPUT, fixed=True)
            elif what == "produced":
                pos, out = value  # type: ignore[misc]
                producer = block[pos]
                rid = producer.outputs[out] if out >= 0 else producer.refs[-out - 1][1]
                if rid in local:
                    d.sources.add(kind=SRC.PRODUCED, id=rid)  # type: ignore[arg-type]
                else:
                    # State written in place earlier in this inference (a buffer's ``add_``,
                    # an EMA copy's ``mul_``) that existed before it: the same tensor every
                    # inference, so a constant by id; the host reads it after the write, as
                    # it runs the calls in order, and carries it to the next inference.
                    src = d.sources.add(kind=SRC.CONSTANT, id=rid)  # type: ignore[arg-type]
                    if rid in metas:
                        src.meta.CopyFrom(metas[rid])  # type: ignore[index]
            elif what == "constant" and value in persistent:
                d.sources.add(kind=SRC.PERSISTENT, id=value, hash=persistent[value])  # type: ignore[index]
            elif what == "constant":
                src = d.sources.add(kind=SRC.CONSTANT, id=value)  # type: ignore[arg-type]
                if value in metas:
                    src.meta.CopyFrom(metas[value])  # type: ignore[index]
            else:
                d.sources.add(kind=SRC.PERSISTENT, hash=value)  # type: ignore[arg-type]
    # An input's recorded bytes are never replayed (each inference streams its own): keep only
    # its metadata, so the definition stays small on the wire and on disk.
    refs = (ref for call in d.calls for ref in iter_tensor_refs(call))
    for src, ref in zip(d.sources, refs, strict=True):
        if src.kind == SRC.INPUT and not src.fixed and ref.WhichOneof("ref") == "upload":
            ref.upload.ClearField("data")
    for out_index in found.outputs:
        i, k = out_index
        d.outputs.append(block[i].outputs[k])
    _add_shapes(d, block, found, local)
    _add_loops(d, block, found, local, persistent)
    return d


def _symbol_path(sym: ops_pb2.SymbolicInt) -> tuple[Any, ...]:
    return ("kw", sym.kwarg, *sym.items) if sym.kwarg else ("arg", sym.arg, *sym.items)


def _add_loops(d: ops_pb2.SequenceDef, block: list[LoggedCall], found: Found,
               local: dict[int, int], persistent: dict[int, bytes]) -> None:
    """The loops folded out of the log (``rrtod.robot.loopfold``): each with its count, the
    integers of its body that are the iteration's index or its own sizes and values (these,
    checked over every iteration, replace what the search found from the first iterations
    alone), and the lists after it that gather one tensor per iteration."""
    for lp in found.loops:
        j, o, dim = lp.count
        tensor = block[j].outputs[o]
        if tensor not in local:
            raise ValueError(f"loop at call {lp.start}: counted by tensor {tensor}, which this "
                             "inference does not make")
        loop = d.loops.add(start=lp.start, body=lp.body, tensor=tensor, dim=dim,
                           scatters=lp.scatters)
        own = {(lp.start + q, path) for q, path in [*lp.shared.symbols, *lp.shared.index]}
        kept = [sym for sym in d.symbols if (sym.call, _symbol_path(sym)) not in own]
        del d.symbols[:]
        d.symbols.extend(kept)
        for q, (_where, at, *items) in lp.shared.index:
            _name_arg(d.symbols.add(call=lp.start + q, index=True, items=items), at)
        for (q, path), (jj, oo, dd, span) in lp.shared.symbols.items():
            _add_symbol(d, lp.start + q, path, block[lp.start + jj].outputs[oo], dd, span)
        for call, (top, *items) in lp.gathers:
            _name_arg(loop.gathers.add(call=call, items=items), top)
        if lp.shared.branches is not None:
            _add_variants(loop, block, lp, local, persistent)
    if found.loops:
        d.symbols.sort(key=lambda sym: sym.call)
        loops.check(d)


def _add_variants(loop: ops_pb2.SeqLoop, block: list[LoggedCall], lp: FoundLoop,
                  local: dict[int, int], persistent: dict[int, bytes]) -> None:
    """A branched loop's guards and variants (``rrtod.robot.loopfold.branched``). A variant's
    calls are those of one iteration, maybe of another inference than the block's: what they
    read of the body is named as the block's first iteration names it, what they read from
    before the loop as the block does at the same place, what they make as recorded (both
    replay ends rename it per iteration). ValueError for a read the block cannot name."""
    branches = lp.shared.branches
    assert branches is not None
    c = lp.body

    def body_id(q: int, o: int) -> int:
        return block[lp.start + q].outputs[o]

    loop.guards.extend(body_id(q, o) for q, o in branches.guards)
    for var in branches.variants:
        v = loop.variants.add(when=var.when)
        ids = {rid: body_id(q, o) for q, e in enumerate(var.body)
               for o, rid in enumerate(e.outputs)}  # the iteration's body -> the block's
        for q, (e, origins) in enumerate(zip(var.calls, var.sources, strict=True)):
            assert e.raw is not None
            call = v.calls.add()
            call.CopyFrom(e.raw)
            if e.result is not None:
                call.out_ids.extend(e.outputs)
            for ref, origin in zip(iter_tensor_refs(call), origins, strict=True):
                what = origin[0]
                if what == "persistent":
                    v.sources.add(kind=SRC.PERSISTENT, hash=origin[1])
                    continue
                if what == "fixed":
                    v.sources.add(kind=SRC.INPUT, fixed=True)
                    continue
                if what == "own":
                    _what, at, o = origin
                    rid = body_id(at, o) if at < c else ids.get(
                        var.calls[at - c].outputs[o], var.calls[at - c].outputs[o])
                elif what == "scatter":
                    rid = block[lp.start + origin[1]].outputs[0]
                elif what == "before" and 0 <= lp.start + origin[1] < lp.start:
                    rid = block[lp.start + origin[1]].outputs[origin[2]]
                elif what == "id" and origin[1] in persistent:
                    rid = origin[1]
                else:
                    raise ValueError(f"loop at call {lp.start}: a variant reads a value from "
                                     "before this inference")
                ids[ref.id] = rid
                if rid in persistent and rid not in local:
                    v.sources.add(kind=SRC.PERSISTENT, id=rid, hash=persistent[rid])
                elif rid in local or what in ("own", "scatter"):
                    v.sources.add(kind=SRC.PRODUCED, id=rid)
                else:
                    raise ValueError(f"loop at call {lp.start}: a variant reads a value this "
                                     "inference does not make")
                ref.Clear()
                ref.id = rid
            made = [rid for rid in call.out_ids if rid not in ids]
            v.local_ids.extend(made)
            call.out_ids[:] = [ids.get(rid, rid) for rid in call.out_ids]
            v.outputs.extend(call.out_ids[o] for qq, o in sorted(var.outputs)
                             if qq == q and call.out_ids[o] in made)
        assert var.shared is not None
        for qq, (_where, at, *items) in var.shared.index:
            _name_arg(v.symbols.add(call=qq - c, index=True, items=items), at)
        for (qq, path), (jj, oo, dd, span) in var.shared.symbols.items():
            tensor = body_id(jj, oo) if jj < c else var.calls[jj - c].outputs[oo]
            _add_symbol(v, qq - c, path, tensor, dd, span)  # type: ignore[arg-type]


def _name_arg(msg: ops_pb2.SymbolicInt | ops_pb2.Gather, at: int | str) -> None:
    """Point ``msg`` at positional argument ``at``, or at keyword argument ``at``."""
    if isinstance(at, str):
        msg.kwarg = at
    else:
        msg.arg = at


def _add_symbol(d: ops_pb2.SequenceDef | ops_pb2.LoopVariant, call: int,
                path: tuple[Any, ...], tensor: int, dim: int, span: int) -> None:
    """A ``SymbolicInt`` of ``call`` at ``path`` (``rrtod.robot.shapes.Path``): size ``dim``
    (times the next ``span - 1``) of ``tensor``, or its value read (``dim`` is ``VALUE``)."""
    _where, at, *items = path
    sym = (d.symbols.add(call=call, tensor=tensor, value=True, items=items) if dim == VALUE
           else d.symbols.add(call=call, tensor=tensor, dim=dim, span=span, items=items))
    _name_arg(sym, at)


def _add_shapes(d: ops_pb2.SequenceDef, block: list[LoggedCall], found: Found,
                local: dict[int, int]) -> None:
    """What follows the data (``rrtod.robot.shapes``): symbolic integers, inputs of any
    shape, and where shapes start to vary."""
    shapes = found.shapes
    for (i, path), (j, o, dim, span) in sorted(shapes.symbols.items(),
                                               key=lambda x: (x[0][0], str(x[0][1]))):
        tensor = block[j].outputs[o]
        if tensor not in local:
            raise ValueError(f"call {i}: a size of tensor {tensor}, which this inference "
                             "does not make")
        _add_symbol(d, i, path, tensor, dim, span)
    if shapes.any_shape:
        slot = 0
        for i, e in enumerate(block):
            for k in range(len(e.refs)):
                if (i, k) in shapes.any_shape:
                    d.sources[slot].any_shape = True
                slot += 1
    if shapes.varies_from is not None:
        d.varies_from = shapes.varies_from


def _own_log(entries: list[LoggedCall]) -> list[LoggedCall]:
    """``entries`` as a log of their own (copies, with their reads resolved within it: what
    was written before them is a constant to it)."""
    out = [copied(e, e.key) for e in entries]
    resolve_reads(out)
    return out


def _joined(kept: tuple[list[LoggedCall], list[int]], entries: list[LoggedCall],
            starts: list[int], most: int) -> tuple[list[LoggedCall], list[int]]:
    """The log a sequence was found from (``kept``: its entries and inference starts), then
    ``entries`` (inferences since, which went another way), as one log of its own (copies,
    reads resolved within it), at most ``most`` entries: the oldest inferences are left out."""
    old, old_starts = kept
    # The first of ``entries`` begins an inference (``_variant_from``). The kept log ends
    # where the search that found the sequence looked, often at a download before the mark
    # that ended its last inference: without that start, Mask R-CNN's 3rd frame (joined to
    # the kept log, 15 926 calls) had two inferences run together in its search, which
    # folded nothing, and its new loop count was learnt only from the 4th, two frames later.
    at = sorted({*old_starts, len(old), *(len(old) + x for x in starts if x > 0)})
    first = next((x for x in [0, *at] if len(old) + len(entries) - x <= most), len(old))
    return _own_log([*old[first:], *entries[max(0, first - len(old)):]]), \
        [x - first for x in at if x >= first]


def _is_bind(call: ops_pb2.OpCall) -> bool:
    """A bind-only call (a persistent tensor's first use gets its id): not the app's work."""
    return len(call.args) == 1 and call.args[0].tensor.HasField("persistent")


@dataclass(frozen=True)
class SearchBudget:
    """What sequence search may cost the robot. Searches run after every download until failed
    searches have scanned ``eager_work`` log entries in all (cheap while logs are short: the
    first inferences of any model); after that each failed search waits for the log to grow
    by ``growth`` times the frames recorded so far, at most ``max_gap`` frames."""

    max_calls: int = 50_000  # op log cap: when full, the older half is dropped
    eager_work: int = 100_000  # log entries failed searches may scan with no backoff
    growth: float = 1.0  # backoff: wait for this many times the frames recorded so far...
    max_gap: int = 200_000  # ...but never for more frames than this
    time_s: float = 1.0  # one search gives up (and counts as failed) after this long
    search_wait: float = SEARCH_WAIT_S  # an inference start waits at most this for a search...
    hint_budget: float = HINT_BUDGET_S  # ...while the hinted searches took less in all


# Frames since the app's last inference mark past which a value read inside a forward is
# searched at as any download: an app whose forward never returns (its loop inside a module)
# marks nothing. Mask R-CNN with 100 detections logs ~5 000 calls a frame.
UNMARKED_FRAMES = 20_000


class Recorder:
    """One per app session: it logs the frames the relay forwards (``observe``), decides when a
    search is due and runs it off the event loop (``request_search``), tracks the definitions
    on their way to the host (``offered``, ``acknowledged``) and the sequences in use, and keeps
    the saved ones (in a ``SequenceStore``) for the app's next start."""

    def __init__(self, app: str, session: str, search: SequenceSearch, store_dir: Path,
                 budget: SearchBudget | None = None):
        self.app = app
        self.session = session
        self.search = search
        self.store = SequenceStore(store_dir)
        self.budget = budget or SearchBudget()
        self.log = OpLog(self.budget.max_calls)
        # Search budget state: failed searches since the log was last cleared, the log entries
        # they scanned, and the log position (frames recorded) before which none is due.
        self.failed = self.failed_work = self.next_search = 0
        self.hinted_s = 0.0  # time the app waited for searches, as its shim says (``app_waited``)
        self._quiet = True  # no download since the app's last inference mark
        # A download the app made inside a forward came since the last mark, its search left
        # to the next mark (``observe``).
        self._deferred = False
        # Frames recorded at the last mark; the calls of the inference that mark ended, if it
        # downloaded nothing (frames between marks, no fetch among them): a sequence that
        # returns no value must have this period (``verify``).
        self._mark_at = 0
        self.quiet_period: int | None = None
        self._cleared = 0
        self.sequences: dict[int, dict[str, Any]] = {}  # id -> summary, for those in use
        self.active_threads: set[int] = set()
        # One search at a time per session; its duration is the natural rate limit. A search
        # requested while one runs sets ``_rerun``: that one looks again once it has ended.
        self._searching: asyncio.Task[None] | None = None
        self._rerun = False
        self.last_search = 0.0
        self.search_stats: list[dict[str, Any]] = []
        self.seen_hashes: set[bytes] = set()
        self._pending: dict[int, ops_pb2.SequenceDef] = {}  # sent to the host, not yet accepted
        # Variants: the definitions in use, the replay in progress, aborted ones waiting for
        # the host's account of what they ran, and each sequence's latest input per slot.
        self.definitions: dict[int, ops_pb2.SequenceDef] = {}
        # Dropped ones an app thread may still start (the shim learns of a drop after the
        # host does, which still runs such a start: ``rrtod.wire.RETIRED_KEPT``).
        self._retired: dict[int, ops_pb2.SequenceDef] = {}
        self._replay: _Replaying | None = None
        self._cuts: dict[int, _Replaying] = {}
        self._rebuilt: dict[int, _Replaying] = {}  # the last cuts rebuilt, by base
        self._last_cut: _Replaying | None = None  # aborted, nothing forwarded since
        self._latest: dict[int, dict[int, ops_pb2.TensorRef]] = {}
        self.variant_threads: set[int] = set()  # active threads with a variant in the log
        self._ended_in_log: set[int] = set()  # threads with an inference mark in the log
        self._variant_from: dict[int, ops_pb2.OpCall] = {}  # thread -> its first variant call
        self._keys: dict[int, tuple[Any, ...]] = {}  # sequence -> its ``_signature``
        # A sequence whose loop has variants: the log it was found from (entries, inference
        # starts). An inference that left it for values no variant has is searched with that
        # log (``search_now``): the sequence found has every variant, and replaces it once the
        # host has accepted it (``_replacing``: new id -> the id it replaces; ``acknowledged``
        # moves that one to ``_superseded``, which ``superseded`` drops). Until then the shim
        # replays the old one: dropped as the new one went to the host, it left the thread no
        # sequence for as long as the host took to define the new one, and Mask R-CNN's
        # frames meanwhile were forwarded whole (~100 round trips each, one or two frames
        # every time a variant was learnt).
        self._found_from: dict[int, tuple[list[LoggedCall], list[int]]] = {}
        self._replacing: dict[int, int] = {}
        self._superseded: list[int] = []
        # thread -> ((log cleared, marks), searches with the log kept since that mark)
        self._merge_tries: dict[int, tuple[tuple[int, int] | None, int]] = {}
        # How long the app forwarded in its last inference after leaving a replay: from an
        # abort to the next start or mark (``observe``), summed at the mark (``forwarded_s``).
        # What a variant found at that mark saves the next inference, so what its start may
        # wait for that search (``variant_wait``), until one such wait found nothing. Kept per
        # session: threads that leave their replays at once add up (a longer bound, no more).
        self._left_at: float | None = None
        self._forwarding_s = 0.0
        self.forwarded_s = 0.0
        self.variant_hints = True
        self._variant_hinted = False
        self.strays: dict[int, int] = {}  # thread -> calls forwarded since its last replay
        # Inferences of this session that started as replays, whatever became of their
        # sequence since (one with more loop variants replaces the one it came from, and the
        # replays listed per sequence leave with it): ``describe``'s ``replays``.
        self.replays = 0
        self.saved: list[tuple[dict[str, Any], ops_pb2.SequenceDef]] = self.store.load(app)

    # ----- observe the relayed frames -----
    def observe_result(self, result: ops_pb2.OpResult) -> None:
        """The host's reply to a call forwarded with ``want_meta`` (its outputs' ids and
        shapes, which the op log needs for that call)."""
        self.log.record_result(result)

    def observe_fetched(self, fetched: ops_pb2.Fetched) -> None:
        """The host's reply to a fetch (a number the app read is kept for the search), or a
        replayed output it pushed unasked (seq 0: ``observe_pushed``)."""
        if fetched.seq:
            self.log.record_fetched(fetched)
        else:
            self.observe_pushed(fetched)

    def observe(self, frame: ops_pb2.SessionUp) -> bool:
        """Log a frame; True when a search is due (the relay then calls ``request_search``;
        a test or benchmark may call ``search_now`` itself)."""
        kind = frame.WhichOneof("msg")
        if kind in ("call", "fetch"):
            self._last_cut = None
            if kind == "call" and self.active_threads:
                self._stray(frame.call)
            self.log.record(frame)
            if kind == "fetch":
                self._quiet = False
                if self.searching:
                    if self.searches_at(frame.fetch):
                        return self.search_due()
                    # A value the model reads (Mask R-CNN reads each box's corners, dozens a
                    # frame): no inference ends here, and a search at each held the robot's
                    # CPU for seconds a frame and spent the search budget within a few frames.
                    self._deferred = True
        elif kind == "start":
            if self._left_at is not None:  # a variant switched to, or a loop resumed
                self._forwarding_s += time.monotonic() - self._left_at
                self._left_at = None
            summary = self.sequences.get(frame.start.sequence)
            resume = frame.start.loop_count or frame.start.loop_choices
            if resume:  # the same inference, resumed after a branch it forwarded
                if summary is not None:
                    summary["resumed"] = summary.get("resumed", 0) + 1
            else:
                self.replays += 1
                if summary is not None:
                    summary["replays"] += 1
            if summary is not None:
                self.strays[summary["thread"]] = 0
            cut, self._last_cut = self._last_cut, None
            if cut is not None and frame.start.position == cut.cut and frame.start.position \
                    and not resume:
                cut.switched = True  # the shim went on with a variant from there
                self.replays -= 1  # the same inference
                left = self.sequences.get(cut.d.id)
                if left is not None:  # a branch taken, not a mismatch: counted as such
                    left["replays"] -= 1
                    left["mismatches"] -= 1
                    left["switched"] = left.get("switched", 0) + 1
            d = self.definitions.get(frame.start.sequence) \
                or self._retired.get(frame.start.sequence)
            self._replay = r = None if d is None else _Replaying(
                d, frame.start.base_id, frame.start.position, dict(frame.start.joined),
                partial=cut is not None and cut.switched and not resume)
            if r is not None and resume:  # logged where it starts, aborted or not
                r.resume = (frame.start.loop_count, tuple(frame.start.loop_choices))
                r.cut, r.at, r.fetches = WHOLE, len(self.log.calls), len(self.log.fetched)
                r.log_state = (self.log.cleared, self.log.truncated)
                self._keep_cut(r)
        elif kind == "arg":
            if self._replay is not None:
                self._arg(self._replay, frame.arg)
        elif kind == "abort":
            if self._left_at is None:
                self._left_at = time.monotonic()
            r, self._replay = self._replay, None
            summary = self.sequences.get(r.d.id) if r is not None else None
            if summary is not None:
                summary["mismatches"] += 1
            if r is not None and frame.abort.position > r.start and not r.partial:
                if r.resume is None:
                    r.at, r.fetches = len(self.log.calls), len(self.log.fetched)
                    r.log_state = (self.log.cleared, self.log.truncated)
                r.cut = frame.abort.position
                self._keep_cut(r)
                self._last_cut = r
        elif kind == "query":
            self.seen_hashes.update(bytes(h) for h in frame.query.hashes)
        return False

    def searches_at(self, fetch: ops_pb2.Fetch) -> bool:
        """Whether a search may start at ``fetch`` (``observe``), the budget aside: a value
        the app reads outside its forward, or inside one that has gone on unmarked too long.
        (A value read inside the forward defers the search to the inference's mark.)"""
        return not fetch.in_forward or self.log.recorded - self._mark_at > UNMARKED_FRAMES

    def _keep_cut(self, r: _Replaying) -> None:
        """``r``'s calls go into the log when the host's account of them comes."""
        self._cuts[r.base] = r
        for old in list(self._cuts)[:-MAX_CUTS]:
            del self._cuts[old]

    @property
    def searching(self) -> bool:
        """A search may find something: no sequence is in use, a thread that went another
        way than its sequences is looked at for a variant, or a thread with calls logged
        has no sequence in use while another has (two streams, each a thread of its own:
        the second was never searched once the first replayed). Only a thread that ended an
        inference in the log counts: a helper thread's calls on an output are no stream, and
        failed searches of them would back off the session's searches (its variants')."""
        return not self.active_threads or bool(self.variant_threads) \
            or any(t not in self.active_threads for t in self._ended_in_log)

    def inference_ended(self, thread: int = 0) -> bool:
        """The app's shim says an inference of ``thread`` ended (its ``InferenceMark``; the
        relay has logged the frames before it): the log notes where that thread's next one
        starts (``OpLog.mark``). True when a search is due on it: only if the app downloaded
        nothing since the last mark. A download is where searches run (an inference ends by
        handing values to the app), but an inference may end without one: a detector that
        found nothing, whose app only looks at the count it was answered (``want_meta``),
        reads no value. Such an app would never be searched. The calls between the last two
        marks are what a sequence returning no value must be (``quiet_period``): a shorter
        block is a part of an inference. Also due when the app read values inside its forward
        since the last mark (``Fetch.in_forward``), whose searches wait for this."""
        self.search_due()  # a cleared log starts afresh (the marks' positions too)
        self.log.mark(thread)
        self._ended_in_log.add(thread)
        if self._left_at is not None:
            self._forwarding_s += time.monotonic() - self._left_at
            self._left_at = None
        self.forwarded_s, self._forwarding_s = self._forwarding_s, 0.0
        quiet, self._quiet = self._quiet, True
        deferred, self._deferred = self._deferred, False
        span, self._mark_at = self.log.recorded - self._mark_at, self.log.recorded
        self.quiet_period = span if quiet and span > 0 else None
        if thread in self.variant_threads and self._merge_base(thread) is not None:
            return self.search_due()  # a variant ended: searched with the log kept
        if not (quiet or deferred) or not self.searching:
            return False
        return self.search_due()

    def _merge_due(self, thread: int) -> bool:
        """Whether ``thread``'s inference that left its sequence with variants is searched
        with the log kept now: once it has ended (a mark after its first call), at that mark
        and the downloads after it (the calls on its outputs come after the mark), at most
        ``MERGE_TRIES`` times per mark. Not at every download in between: a forwarded Mask
        R-CNN frame has thousands, and a search of its 20 000-call log at each held the GIL
        for a minute, the app's frame with it."""
        first = self._variant_from.get(thread)
        at = next((i for i, c in enumerate(self.log.calls) if c is first), None)
        ended = sum(1 for m, t in self.log.marks if t == thread and at is not None and m > at)
        marks, tries = self._merge_tries.get(thread, (None, 0))
        if (self.log.cleared, ended) != marks:
            marks, tries = (self.log.cleared, ended), 0
        if not ended or tries >= MERGE_TRIES:
            return False
        self._merge_tries[thread] = (marks, tries + 1)
        return True

    def _merge_base(self, thread: int) -> int | None:
        """A sequence of ``thread`` in use whose loop has variants (its log kept), not one
        that a sequence on its way to the host replaces (that one has more variants)."""
        replaced = set(self._replacing.values())
        return next((i for i in self._found_from if i not in replaced
                     and self.sequences.get(i, {}).get("thread") == thread), None)

    def _arg(self, r: _Replaying, arg: ops_pb2.ReplayArg) -> None:
        """What the app sent for a slot of the replay in progress (a repeat by ``same_as`` is
        the slot's latest upload, as the host resolves it)."""
        latest = self._latest.setdefault(r.d.id, {})
        which = arg.WhichOneof("value")
        if which == "tensor":
            r.args[arg.slot] = arg.tensor
            if arg.tensor.WhichOneof("ref") == "upload":
                latest[arg.slot] = arg.tensor
        elif which == "same_as" and arg.same_as in latest:
            r.args[arg.slot] = latest[arg.same_as]

    def observe_answer(self, answer: ops_pb2.ReplayAnswer) -> None:
        """The host's answer to a replayed call (kept until the replay ends or is aborted:
        an aborted replay's answered calls go into the log with the outputs it named)."""
        r = self._replay if self._replay is not None and self._replay.base == answer.base_id \
            else self._cuts.get(answer.base_id)
        if r is not None:
            r.answers[answer.position] = answer.result

    def observe_pushed(self, fetched: ops_pb2.Fetched) -> None:
        """An output the host pushed unasked (a replay's), noted in case the replay is aborted:
        its calls are then rebuilt into the log (``replayed_calls``) with the app's downloads
        of the pushed outputs, which forwarding would have logged as fetches, and the values of
        one-number ones, which the app may have passed on as integers (``SymbolicInt.value``),
        so that a search can explain those integers."""
        base = REPLAY_BASE + (fetched.id - REPLAY_BASE) // SPAN * SPAN
        r = self._replay if self._replay is not None and self._replay.base == base \
            else self._cuts.get(base)
        if r is None:
            return
        r.pushed.add(fetched.id - base)
        value = scalar_of(fetched.tensor) if len(fetched.tensor.data) <= 8 else None
        if value is not None:
            r.values[fetched.id - base] = value

    def observe_replayed(self, sizes: ops_pb2.ReplayedPrefix) -> None:
        """The host's account of a replay the app aborted: its calls go into the op log where
        the abort was, before the calls that were forwarded after it, so that an inference that
        branched off a sequence (a variant) is in the log whole and can be found as a sequence
        of its own, next to the one it branched off (``search_now``)."""
        r = self._cuts.pop(sizes.base_id, None)
        if r is None or r.switched or r.log_state != (self.log.cleared, self.log.truncated):
            return
        before = None
        if r.resume is not None:  # the replay cut where this one resumed: the latest it joined
            bases = {REPLAY_BASE + (v - REPLAY_BASE) // SPAN * SPAN for v in r.joined.values()
                     if v >= REPLAY_BASE}
            before = self._rebuilt.get(max(bases)) if bases else None
        calls = replayed_calls(r, sizes, before)
        self._rebuilt[r.base] = r
        for old in list(self._rebuilt)[:-MAX_CUTS]:
            del self._rebuilt[old]
        if calls:
            reads = _reads(calls, r)
            for other in self._cuts.values():  # logged after these: moved along
                if other.at >= r.at:
                    other.at += len(calls)
                    other.fetches += len(reads) if other.fetches >= r.fetches else 0
            for k, call in enumerate(calls, start=r.start):
                call.thread = r.d.thread
                if call.want_meta:  # its reply, under a seq no forwarded call has
                    call.seq = next(_REBUILT_SEQS)
                    self.log.results[call.seq] = r.answers[k]
            self.log.insert(r.at, r.fetches, calls, reads)
            # A variant's search starts at an inference's first call: a replay that joined its
            # inference under way has its first calls forwarded, logged before it.
            first = calls[0] if r.start == 0 else self._joined_from(r)
            if first is not None and r.d.thread not in self.variant_threads:
                self.variant_threads.add(r.d.thread)
                self._variant_from[r.d.thread] = first

    def _joined_from(self, r: _Replaying) -> ops_pb2.OpCall | None:
        """The first call of the inference that replay ``r`` joined under way: the shim
        mapped the calls its thread forwarded last onto the sequence's first ``r.start``, so
        it is the ``r.start``-th of that thread's calls (binds aside) logged before ``r``.
        None unless it is the sequence's first operator. Searched from there, that inference
        is learnt as a variant from its own end: Mask R-CNN's third frame, which joined its
        replay at call 441 and left it at 633, was not, and its new branch was learnt from the
        fourth, two frames later."""
        left = r.start
        calls = self.log.calls
        for k in range(min(r.at, len(calls)) - 1, -1, -1):
            call = calls[k]
            if call.thread != r.d.thread or _is_bind(call):
                continue
            left -= 1
            if left == 0:
                return call if call.op == r.d.calls[0].op else None
        return None

    def _stray(self, call: ops_pb2.OpCall) -> None:
        """A call forwarded on a thread that has sequences. Many of them with no replay in
        between: the app runs something else now (another model, another input shape); record
        that thread again so that its new sequence is found too. The old ones stay usable."""
        t = call.thread
        if t not in self.active_threads or _is_bind(call):
            return
        self.strays[t] = n = self.strays.get(t, 0) + 1
        longest = max((s.get("longest", s["operators"]) for s in self.sequences.values()
                       if s["thread"] == t), default=0)
        if n > STALE_FACTOR * longest + STALE_MARGIN:
            self.active_threads.discard(t)
            self.strays[t] = 0
            self.log.clear()
            log.info("no sequence matches: recording again", session=self.session, app=self.app,
                     thread=t, forwarded=n)

    def restorable(self) -> list[ops_pb2.SequenceDef]:
        """Saved sequences whose persistent tensors the app has now shown: replay them from
        the first inference. Each is offered once."""
        ready = []
        for summary, d in list(self.saved):
            needed = {bytes(s.hash) for s in d.sources if s.kind == SRC.PERSISTENT}
            if needed and needed <= self.seen_hashes:
                self.saved.remove((summary, d))
                self._adopt(d, summary | {"session": self.session, "restored": True})
                ready.append(d)
        return ready

    # ----- search scheduling (on the event loop) -----
    def app_waited(self, seconds: float) -> None:
        """The app's shim says it waited this long for searches since its previous mark
        (``InferenceMark.search_wait_us``): charged to the hint budget (``hint_wait``)."""
        self.hinted_s += seconds

    def hint_wait(self) -> float | None:
        """Asked before a download is logged (or an inference mark noted): seconds the app's
        next call may wait for the search that starts there (``SearchHint``): the budget's
        ``search_wait``, or what is left of its ``hint_budget``. The robot says when the search
        is over, so this bounds only a search or a host answer that is slow. None when it is
        not worth waiting for: a sequence is in use (a variant search), no inference has ended
        yet (no mark: set-up, or the first inference, which a search cannot find alone), the
        search budget makes this one wait, or the hint budget is spent."""
        self.search_due()  # a cleared log starts the budgets afresh
        left = self.budget.hint_budget - self.hinted_s
        if self.active_threads or not self.log.marks or left <= 0 \
                or self.log.recorded + 1 < self.next_search:
            return None
        return min(self.budget.search_wait, left)

    def variant_wait(self, thread: int, due: bool) -> float | None:
        """Asked at ``thread``'s mark, once counted (``inference_ended``; ``due``: a search is
        due there): seconds the app's next inference start may wait for the search of the
        way that inference went, a variant of a sequence in use (``SearchHint``), due there
        or running (one started at its last download). Else that inference replays the
        sequence it left, leaves it where this one did and forwards the rest: Mask R-CNN's
        4th frame forwarded ~1 300 calls while the variant its 3rd frame showed was
        searched (1.0-1.3 s). So the bound is how long the inference that ended forwarded
        after leaving its replay (``forwarded_s``): what the variant found saves. None when
        it forwarded nothing, when no search looks for a variant of ``thread``, or once a
        variant search waited for found nothing (an app whose frames keep going new ways
        would wait at every one); a variant found waits again."""
        if not self.variant_hints or self.forwarded_s <= 0 \
                or thread not in self.variant_threads \
                or not (due or self._searching is not None):
            return None
        self._variant_hinted = True
        return self.forwarded_s

    def awaiting_host(self) -> bool:
        """A definition is on its way to the host, or a search is running."""
        return bool(self._pending) or self._searching is not None

    def request_search(self, push: Push, ended: Callable[[], Awaitable[None]] | None = None) -> None:
        """A search is due: run one in a worker thread, off the relay's path, and ``push`` what
        it finds; then await ``ended``. While one runs, it looks again once it has ended instead
        (new downloads arrived meanwhile), so there is never more than one per session."""
        if self._searching is not None:
            self._rerun = True
            return
        self._searching = asyncio.get_running_loop().create_task(self._search(push, ended))

    async def _search(self, push: Push, ended: Callable[[], Awaitable[None]] | None) -> None:
        try:
            while True:
                self._rerun = False
                d = await asyncio.to_thread(self.search_now)
                if d is not None:
                    await push(d)  # (one it replaces goes once the host accepted it)
                if d is not None or not self._rerun:
                    break
        except Exception:  # a search bug costs replay, never the session
            d = None
            log.exception("sequence search failed", session=self.session, app=self.app)
        finally:
            self._searching = None
        if self._variant_hinted:  # the app waited for this search
            self._variant_hinted = False
            self.variant_hints = d is not None
        if ended is not None:
            await ended()

    async def search_done(self) -> None:
        """Wait for the running search (and its reruns), if any."""
        while (task := self._searching) is not None:
            await asyncio.wait({task})

    def close(self) -> None:
        """Session end: stop a running search; add this session's replay and mismatch counts
        to the saved sequences' files."""
        if self._searching is not None:
            self._searching.cancel()
        self.store.add_counts(self.app, self.sequences.values())

    # ----- search -----
    def search_due(self) -> bool:
        """Within the search budget: no backoff pending (a cleared log starts afresh)."""
        if self.log.cleared != self._cleared:
            self._cleared = self.log.cleared
            self.failed = self.failed_work = self.next_search = self._mark_at = 0
            self.quiet_period = None
            self.hinted_s = 0.0
            self.variant_threads.clear()  # their logged variants went with the log
            self._ended_in_log.clear()
            self._variant_from.clear()
        return self.log.recorded >= self.next_search

    def _searched(self, position: int, work: int) -> None:
        """A search of the log as it was at ``position`` (frames recorded) found nothing."""
        if self.log.cleared != self._cleared:
            return  # cleared meanwhile: the next search starts afresh
        self.failed += 1
        self.failed_work += work
        b = self.budget
        if self.failed_work <= b.eager_work:
            self.next_search = position + 1  # the next download
            return
        gap = max(1, min(b.max_gap, int(position * b.growth)))
        self.next_search = position + gap
        log.info("no sequence found: search backs off", session=self.session, app=self.app,
                 failed=self.failed, scanned=self.failed_work, log=len(self.log),
                 next_after_frames=gap)

    def search_now(self) -> ops_pb2.SequenceDef | None:
        """Runs in a worker thread. Searches each thread's log; returns at most one sequence."""
        if not self.search_due():  # a rerun the last failed search made wait
            return None
        self.last_search = time.monotonic()
        position, work, waiting = self.log.recorded, 0, False
        for thread in self.log.threads():
            if thread in self.active_threads and thread not in self.variant_threads:
                continue
            t0 = time.perf_counter()
            merged = self._merge_base(thread) if thread in self.active_threads else None
            if merged is not None and not self._merge_due(thread):
                waiting = True
                continue
            entries = self.log.entries(thread)
            starts = self.log.inference_starts(thread)
            if thread in self.active_threads:  # a variant: search from its first inference on
                first = self._variant_from.get(thread)
                cut = next((i for i, e in enumerate(entries) if e.raw is first), len(entries))
                starts = [x - cut for x in starts if x >= cut]
                if merged is None:
                    entries = _own_log(entries[cut:])
                else:  # with the log of the sequence it left: one inference is enough
                    entries, starts = _joined(self._found_from[merged], entries[cut:],
                                              [x for x in starts if x > 0],
                                              self.budget.max_calls)
            found, rejected, timed_out = search_log(entries, self.search,
                                                    budget_s=self.budget.time_s,
                                                    quiet_period=self.quiet_period,
                                                    starts=starts)
            elapsed = time.perf_counter() - t0
            work += len(entries)
            self.search_stats.append({"log": len(entries), "seconds": elapsed,
                                      "rejected": rejected, "found": found is not None,
                                      "timed_out": timed_out})
            del self.search_stats[:-50]
            if found is None:
                continue
            seq_id = int.from_bytes(os.urandom(6), "big")
            try:
                d = build_definition(found.entries or entries, found,
                                     self.log.persistent_bindings(), seq_id, thread)
            except ValueError as exc:  # verified, yet not a definition both ends can run
                log.warning("sequence not defined", session=self.session, app=self.app,
                            thread=thread, reason=str(exc))
                continue
            keys = _signature(found.keys, d)
            # A variant already in use on this thread (its inferences aborted for other
            # reasons); another thread's, the same model on a stream of its own, is not
            if any(k == keys and self.sequences.get(i, {}).get("thread") == thread
                   for i, k in self._keys.items()):
                continue
            # An inference of a sequence with loops may be longer than it: its longest
            # in the log (for ``_stray``).
            at = sorted({0, *starts, len(entries)}) if found.loops else [0, 0]
            longest = max(found.period, *(b - a for a, b in itertools.pairwise(at)))
            summary = {"id": seq_id, "app": self.app, "session": self.session, "thread": thread,
                       "operators": found.period, "longest": longest, "loops": len(found.loops),
                       "loop_variants": sum(len(lp.variants) for lp in d.loops),
                       "inputs": len(found.inputs),
                       "outputs": len(found.outputs), "found_at": found.found_at,
                       "search_s": round(elapsed, 6), "log_length": len(entries),
                       "replays": 0, "mismatches": 0, "created": time.time()}
            self._adopt(d, summary)
            self._keys[seq_id] = keys
            if any(lp.variants for lp in d.loops):  # the log it was found in
                end = found.searched or len(entries)
                self._found_from[seq_id] = (entries[:end], [x for x in starts if x <= end])
            if merged is not None and _same_calls(self._keys.get(merged), keys):
                # The same calls with more of its loop's variants: it replaces the one it came
                # from. Other calls (the inference went another way before or after the loop
                # too) make it a variant next to that one, which is kept.
                summary["replaces"] = merged
                self._replacing[seq_id] = merged
            if thread in self.variant_threads:  # found next to the one it branched off
                summary["variant"] = True
                self.variant_threads.discard(thread)
                self.log.clear()
            self.store.save(self.app, summary, d)
            log.info("sequence found", session=self.session, app=self.app, thread=thread,
                     operators=found.period, start=found.start, found_at=found.found_at,
                     search_ms=round(elapsed * 1e3, 2), rejected=rejected)
            self.failed = self.failed_work = self.next_search = 0
            return d
        if not (waiting and not work):
            # (A search that only found a variant's inference not ended yet is no failure:
            # counted as one, the search due at the mark that ends that inference waited for a
            # download after the mark, in Mask R-CNN's frames the next frame's end.)
            self._searched(position, work)
        return None

    def _adopt(self, d: ops_pb2.SequenceDef, summary: dict[str, Any]) -> None:
        self.sequences[d.id] = summary
        self.definitions[d.id] = d
        self.active_threads.add(d.thread)

    def drop(self, seq_id: int, forget: bool = False) -> ops_pb2.SequenceDef | None:
        """Stop replaying a sequence (flush, given up by the shim, refused by the host):
        recording resumes for its thread. ``forget`` also deletes its saved copy, so that a
        restarted app does not start from it again."""
        summary = self.sequences.pop(seq_id, None)
        self._pending.pop(seq_id, None)
        self._replacing.pop(seq_id, None)  # (a replacement dropped: the old one stays)
        d = self.definitions.pop(seq_id, None)
        if d is not None:
            self._retired[seq_id] = d
            while len(self._retired) > RETIRED_KEPT:  # the oldest first
                del self._retired[next(iter(self._retired))]
        self._keys.pop(seq_id, None)
        self._latest.pop(seq_id, None)
        self._found_from.pop(seq_id, None)
        if summary is None:
            return None
        if not any(s["thread"] == summary["thread"] for s in self.sequences.values()):
            self.active_threads.discard(summary["thread"])  # its variants stay in use
        self.log.clear()
        if forget:
            self.store.forget(self.app, seq_id)
        return ops_pb2.SequenceDef(id=seq_id)  # no calls: "drop" for the host and the shim

    def offered(self, d: ops_pb2.SequenceDef) -> None:
        """A definition is on its way to the host: held until the host's answer
        (``acknowledged``), so that the shim only gets definitions the host can replay."""
        self._pending[d.id] = d

    def acknowledged(self, ack: ops_pb2.SequenceAck) -> ops_pb2.SequenceDef | None:
        """The host's answer to a definition: the definition to pass on to the shim if it was
        accepted and is still wanted, else None (refused: dropped and forgotten)."""
        d = self._pending.pop(ack.id, None)
        replaced = self._replacing.pop(ack.id, None)
        if ack.accepted:
            if ack.id not in self.sequences:
                return None
            if replaced is not None:
                self._superseded.append(replaced)  # dropped after this reached the shim
            return d
        log.warning("GPU host refused sequence", session=self.session, app=self.app,
                    sequence=ack.id, reason=ack.reason)
        self.drop(ack.id, forget=True)  # (the one it would have replaced stays in use)
        return None

    def superseded(self) -> list[ops_pb2.SequenceDef]:
        """The sequences replaced by ones the host has accepted (``acknowledged``), dropped
        here and forgotten by the store: their drops, for the host and the shim, sent after
        the shim got the definitions that replace them, so that it is never without one."""
        gone = [self.drop(seq_id, forget=True) for seq_id in self._superseded]
        self._superseded.clear()
        return [d for d in gone if d is not None]

    def describe(self) -> dict[str, Any]:
        return {"log_length": len(self.log), "replays": self.replays,
                "sequences": list(self.sequences.values()),
                "searches": self.search_stats[-5:],
                "search_budget": {"failed": self.failed, "scanned": self.failed_work,
                                  "recorded": self.log.recorded,
                                  "next_search": self.next_search,
                                  "hinted_s": round(self.hinted_s, 6)}}
