"""Replay on the GPU host: one ``ReplayStart`` runs a whole recorded inference.

Framework-neutral: a replayed call is the recorded call with its tensor refs rebound to this
inference (outputs to ``base_id + i``, inputs to the data the app streamed), handed to the
session's executor exactly as a forwarded call would be. So replay computes what forwarding
would have computed, with the same operator allowlist and quota.

Calls run as soon as their inputs are here; each value the app downloads is pushed back the
moment it exists (``Fetched`` with ``seq`` 0 and its id). On ``ReplayAbort(position)`` the
values of calls before ``position`` stay in the session (the app holds proxies of them), the
rest are released; the session goes on forwarding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rrto.v1 import ops_pb2
from rrtod.oplog import iter_tensor_refs

Emit = Callable[[ops_pb2.SessionDown], None]
SRC = ops_pb2.SeqSource


@dataclass
class Compiled:
    definition: ops_pb2.SequenceDef
    local: dict[int, int]  # recorded local id -> index
    slots: list[list[int]]  # per call: its slots (indices into sources), in ref order
    inputs: list[list[int]]  # per call: slots it waits for (inputs; weights until first bound)
    outputs: set[int]  # local indices the app downloads
    pushes: list[list[int]]  # per call: outputs whose final value it writes (pushed after it)
    writes: list[list[int]]  # per call: positions of outputs that overwrite existing values
    mutates: list[bool]  # per call: writes arguments in place without returning them
    written: Callable[[ops_pb2.OpCall], list[int]] | None = None
    sticky: dict[int, ops_pb2.TensorRef] = field(default_factory=dict)  # bound weights, constants
    latest: dict[int, ops_pb2.TensorRef] = field(default_factory=dict)  # INPUT slot -> last upload


def compile_sequence(d: ops_pb2.SequenceDef,
                     written: Callable[[ops_pb2.OpCall], list[int]] | None = None) -> Compiled:
    """Index a definition for replay; ValueError if it is inconsistent (never trusted blindly:
    a bad definition must fail here, not halfway through an inference). ``written``: the ids
    of arguments a call writes in place without returning them (from the executor)."""
    local = {rid: i for i, rid in enumerate(d.local_ids)}
    counts = [sum(1 for _ in iter_tensor_refs(call)) for call in d.calls]
    if sum(counts) != len(d.sources):
        raise ValueError(f"sequence {d.id}: {len(d.sources)} sources for {sum(counts)} "
                         "tensor arguments")
    for src in d.sources:
        if src.kind == SRC.PRODUCED and src.id not in local:
            raise ValueError(f"sequence {d.id}: produced source {src.id} is not a local id")
    if any(o not in local for o in d.outputs):
        raise ValueError(f"sequence {d.id}: an output is not a local id")
    slots, inputs, writes, mutates, n = [], [], [], [], 0
    produced: set[int] = set()
    for call, count in zip(d.calls, counts, strict=True):
        own = list(range(n, n + count))
        n += count
        slots.append(own)
        # A weight's id is only known to be bound once the shim names it (its first use in this
        # session may be this very replay), so until then it is waited for like an input.
        inputs.append([s for s in own if d.sources[s].kind in (SRC.INPUT, SRC.PERSISTENT)])
        writes.append([j for j, r in enumerate(call.out_ids) if r in produced or r not in local])
        mutates.append(bool(written and written(call)))
        produced.update(call.out_ids)
    outputs = {local[o] for o in d.outputs if o in local}
    last_writer = {local[r]: k for k, call in enumerate(d.calls) for r in call.out_ids if r in local}
    pushes: list[list[int]] = [[] for _ in d.calls]
    for i in sorted(outputs):
        pushes[last_writer[i]].append(i)
    return Compiled(d, local, slots, inputs, outputs, pushes, writes, mutates, written=written)


@dataclass
class Active:
    seq: Compiled
    base: int
    position: int = 0  # next call to run
    args: dict[int, ops_pb2.TensorRef] = field(default_factory=dict)
    failed: bool = False
    snapshots: list[tuple[int, Any]] = field(default_factory=list)  # (call, executor token)


class HostReplayer:
    """Drives one session's executor through replays. Calls run ahead of the app, so a call
    that overwrites an existing value in place (``relu_`` on an earlier output, a running
    statistic) is preceded by an executor snapshot of that value: an abort before it restores
    what forwarding would have left."""

    def __init__(self, executor: Any):
        self.executor = executor
        self.handle = executor.handle
        self.sequences: dict[int, Compiled] = {}
        self.active: Active | None = None
        # A replay the host completed ahead of the app: it may still be aborted, until the app
        # shows it matched to the end (a new start, or a forwarded call).
        self.last: Active | None = None
        self.replays = 0
        self.aborts = 0
        self.refused = False  # the last start named an unknown sequence

    def process(self, frame: ops_pb2.SessionUp, emit: Emit) -> None:
        kind = frame.WhichOneof("msg")
        if kind == "define":
            self._define(frame.define, emit)
        elif kind == "start":
            self._finish(emit)  # a new inference: the previous one runs to its end first
            self.last = None
            seq = self.sequences.get(frame.start.sequence)
            self.refused = seq is None
            if seq is None:  # its arguments follow: they are dropped without more errors
                emit(_error("UNKNOWN_SEQUENCE", f"no sequence {frame.start.sequence} defined",
                            frame.start.sequence))
                return
            self.active = Active(seq, frame.start.base_id)
            self.replays += 1
            self._advance(emit)
        elif kind == "arg":
            act = self.active
            if act is None:
                if not self.refused:
                    emit(_error("NO_REPLAY", "replay argument outside a replay"))
                return
            self._arg(act, frame.arg, emit)
        elif kind == "abort":
            self._abort(frame.abort.position, emit)

    def forwarded(self, frame: ops_pb2.SessionUp, emit: Emit) -> None:
        """A forwarded frame during or after a replay: the calls it may read run first. A
        release is safe here: the app only holds (and drops) values of calls it has matched,
        whose inputs have all arrived, so ``_advance`` has run them."""
        if self.active is not None:
            self._advance(emit)
        if frame.WhichOneof("msg") == "call":
            self.last = None
        for down in self.handle(frame):
            emit(down)

    # ----- internals -----
    def _arg(self, act: Active, arg: ops_pb2.ReplayArg, emit: Emit) -> None:
        """Take one argument. What it says about the slot is kept even when this inference
        failed: the shim's next one may repeat it by ``same_as``, or rely on a rebind."""
        seq, slot = act.seq, arg.slot
        sources = seq.definition.sources
        which = arg.WhichOneof("value")
        tensor, bad = None, None
        if slot >= len(sources):
            bad = f"sequence {seq.definition.id} has no slot {slot}"
        elif which == "tensor":
            tensor = arg.tensor
        elif which == "same_as":
            tensor = seq.latest.get(arg.same_as)
            if tensor is None or sources[slot].kind != SRC.INPUT:
                tensor = None
                seq.latest.pop(slot, None)  # a later repeat of it must fail, not read older data
                bad = (f"sequence {seq.definition.id}: slot {slot} repeats slot {arg.same_as}, "
                       "which holds no input data")
        else:
            bad = f"sequence {seq.definition.id}: no tensor for slot {slot}"
        if tensor is None:
            if not act.failed:
                act.failed = True
                emit(_error("BAD_ARG", bad or "", seq.definition.id))
            return
        if sources[slot].kind == SRC.INPUT:
            if tensor.WhichOneof("ref") == "upload":
                seq.latest[slot] = tensor
            act.args[slot] = tensor
        else:  # a weight or constant (re)bound: it holds for later inferences too
            seq.sticky[slot] = tensor
        if not act.failed:  # else already reported; the rest of this inference is not run
            self._advance(emit)

    def _define(self, d: ops_pb2.SequenceDef, emit: Emit) -> None:
        if not d.calls:
            self.sequences.pop(d.id, None)  # an empty definition drops the sequence
            return
        try:
            compiled = compile_sequence(d, getattr(self.executor, "written_ids", None))
            if (any(compiled.writes) or any(compiled.mutates)) and not hasattr(self.executor, "snapshot"):
                raise ValueError(f"sequence {d.id} writes values in place and this executor "
                                 "cannot snapshot them")
        except (ValueError, KeyError) as exc:
            emit(ops_pb2.SessionDown(defined=ops_pb2.SequenceAck(id=d.id, reason=str(exc))))
            return
        self.sequences[d.id] = compiled
        emit(ops_pb2.SessionDown(defined=ops_pb2.SequenceAck(id=d.id, accepted=True)))

    def _finish(self, emit: Emit) -> None:
        act = self.active
        if act is not None:
            self._advance(emit)
            if act.position < len(act.seq.definition.calls) and not act.failed:
                emit(_error("REPLAY_INCOMPLETE",
                            f"replay of sequence {act.seq.definition.id} stopped at call "
                            f"{act.position}: inputs missing", act.seq.definition.id))
            self._close(act)

    def _close(self, act: Active, complete: bool = False) -> None:
        if self.active is act:
            self.active = None
        self.last = act if complete else None
        if not complete:
            act.snapshots.clear()

    def _advance(self, emit: Emit, limit: int | None = None) -> None:
        act = self.active
        if act is None or act.failed:
            return
        calls = act.seq.definition.calls
        stop = len(calls) if limit is None else min(limit, len(calls))
        while act.position < stop:
            k = act.position
            if any(s not in act.args and s not in act.seq.sticky for s in act.seq.inputs[k]):
                return  # waits for the app to produce this input
            call = self._rebind(act, k)
            if act.seq.writes[k] or act.seq.mutates[k]:
                ids = [call.out_ids[j] for j in act.seq.writes[k]]
                if act.seq.mutates[k] and act.seq.written is not None:
                    ids += act.seq.written(call)  # ids as rebound for this inference
                act.snapshots.append((k, self.executor.snapshot(ids)))
            for down in self.handle(ops_pb2.SessionUp(call=call)):
                if down.WhichOneof("msg") == "error":
                    act.failed = True
                    down.error.sequence = act.seq.definition.id
                    emit(down)
                    return
                if down.WhichOneof("msg") != "result":
                    emit(down)
            act.position += 1
            for i in act.seq.pushes[k]:
                self._push(act.base + i, emit)
        if act.position == len(calls) and limit is None:
            self._close(act, complete=True)

    def _push(self, oid: int, emit: Emit) -> None:
        for down in self.handle(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=0, id=oid))):
            if down.WhichOneof("msg") == "fetched":
                down.fetched.id = oid
            emit(down)

    def _rebind(self, act: Active, k: int) -> ops_pb2.OpCall:
        seq = act.seq
        call = ops_pb2.OpCall()
        call.CopyFrom(seq.definition.calls[k])
        call.seq = 0
        call.sync = False
        call.want_meta = False
        for j, rid in enumerate(call.out_ids):
            i = seq.local.get(rid)
            if i is not None:
                call.out_ids[j] = act.base + i
        renamed: dict[int, int] = {}  # a rebound weight/constant: recorded id -> its id now
        for slot, ref in zip(seq.slots[k], iter_tensor_refs(call), strict=True):
            given = act.args.get(slot)
            if given is not None:
                bind = ref.bind_id if ref.WhichOneof("ref") == "upload" else 0
                ref.CopyFrom(given)
                if bind in seq.local and given.WhichOneof("ref") == "upload":
                    ref.bind_id = act.base + seq.local[bind]  # read again later by id
                continue
            sticky = seq.sticky.get(slot)
            if sticky is not None:
                if ref.WhichOneof("ref") == "id" and sticky.WhichOneof("ref") == "id":
                    renamed[ref.id] = sticky.id
                ref.CopyFrom(sticky)
                continue
            src = seq.definition.sources[slot]
            if src.kind == SRC.PRODUCED:
                ref.Clear()
                ref.id = act.base + seq.local[src.id]
            elif ref.WhichOneof("ref") == "upload" and ref.bind_id in seq.local:
                ref.bind_id = act.base + seq.local[ref.bind_id]
        if renamed:  # written in place and returned: the result is the rebound tensor too
            for j, rid in enumerate(call.out_ids):
                call.out_ids[j] = renamed.get(rid, rid)
        return call

    def _abort(self, position: int, emit: Emit) -> None:
        act = self.active or self.last
        if act is None:
            return
        self.aborts += 1
        if self.active is act:
            self._advance(emit, limit=position)  # the app holds proxies of every call before it
        for k, token in reversed(act.snapshots):
            if k >= position:
                self.executor.restore(token)
        fresh = set()
        for call in act.seq.definition.calls[:position]:
            fresh.update(call.out_ids)
        drop = []
        for call in act.seq.definition.calls[position:act.position]:
            drop += [act.base + act.seq.local[r] for r in call.out_ids
                     if r in act.seq.local and r not in fresh]
        if drop:
            list(self.handle(ops_pb2.SessionUp(release=ops_pb2.Release(ids=drop))))
        self._close(act)


def _error(code: str, message: str, sequence: int = 0) -> ops_pb2.SessionDown:
    return ops_pb2.SessionDown(error=ops_pb2.Error(code=code, message=message, sequence=sequence))
