"""Replay on the GPU host: one ``ReplayStart`` runs a whole recorded inference.

Framework-neutral: a replayed call is the recorded call with its tensor refs rebound to this
inference (outputs to ``base_id + i``, inputs to the data the app streamed), handed to the
session's executor exactly as a forwarded call would be. So replay computes what forwarding
would have computed, with the same operator allowlist and quota.

Calls run as soon as their inputs are here; each value the app downloads is pushed back the
moment it exists (``Fetched`` with ``seq`` 0 and its id). A call whose result the app needs to
go on (output shapes that depend on data, recorded with ``want_meta``, or a value such as
``item()``) sends its reply as a ``ReplayAnswer`` as soon as it has run. Integer arguments that
are sizes of this inference's tensors, or values the app read of them (``SymbolicInt``), are
filled in from those tensors, so the host runs ahead through a detector's data-dependent head
without waiting for the app.

A start may join an inference the app began by forwarding (``ReplayStart.position`` and
``joined``: the definition reached the shim mid-inference): its first calls are not run, and
the values they made are read by the ids the app holds them under (``Active.id_of``).

On ``ReplayAbort(position)`` the values of calls before ``position`` stay in the session (the
app holds proxies of them), the rest are released; the session goes on forwarding.

A dropped sequence (an empty definition: the robot replaced it, was flushed, or the shim gave it
up) is retired, not forgotten: the robot's drop and an app thread's start of it cross on the way
here (the shim learns of the drop after the robot sent it), and a start refused after the app
matched its first calls would leave the app holding proxies of values no one made. The last
``RETIRED_KEPT`` dropped sequences still run such a start.
"""

from __future__ import annotations

import math
import resource
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rrto.v1 import ops_pb2
from rrtod import gcfreeze, loops, lop, partition
from rrtod.executor import ReplayExtension
from rrtod.wire import (
    READ_VALUE,
    RETIRED_KEPT,
    SPAN,
    final_writes_of,
    int_arg,
    iter_tensor_refs,
    release_of,
    released_ids,
)

Emit = Callable[[ops_pb2.SessionDown], None]
SRC = ops_pb2.SeqSource
MAX_UNROLLED = 64  # counts a sequence with a loop keeps compiled
MAX_TEMPLATES = 4096  # decoded calls its unrollings share (``HostReplayer._prepared``)
MAX_BATCHES = 1024  # native runs a session keeps built for reuse (``HostReplayer._run_of``)
# Replays of each plan of a sequence that are timed call by call, then reported to the robot
# (``SequenceProfile``): what a scheduler places with. A timed call waits for the device, so
# only these few are timed.
PROFILED = 3
# The fewest calls worth a native run (``Run``): building and admitting one costs a few calls.
MIN_RUN = 4
# The most: between runs the replayer takes the app's releases, so that values it dropped are
# freed after their last use and the next calls reuse their memory (fresh memory costs page
# faults: ``HostReplayer`` class docstring). yolo-pose in the benchmark: 64 calls a run took
# 4 600 page faults a replayed inference, 16 calls 440 (one by one: 1 600 in the same hour).
MAX_RUN = 16


class Runner(Protocol):
    """What the replayer drives: the session's ``handle`` and its executor's declared replay
    extension (``rrtod.executor``), as the peer service paces them."""

    replay: ReplayExtension | None

    def handle(self, frame: ops_pb2.SessionUp) -> Iterable[ops_pb2.SessionDown]: ...

    # Optional, together: ``held()``, when the replies the transport holds to share a message
    # must go (``time.monotonic``; 0.0: none held), and ``tick()``, which sends those past
    # their time. A native run asks between its calls (``run_batch``'s ``on_answer``).


@dataclass
class Run:
    """Calls ``[start, end)`` of a compiled sequence that the executor replays with one native
    call (``ReplayExtension.batch``): none of them waits for anything of the inference, pushes
    (but the last) or takes a symbolic integer, and each makes only values of this inference.
    Those the app waits for the answer of (``answered``) are answered from inside the run as
    each ran (a detector's per-class NMS loop is answered calls between a few others). Those
    that write in place (``writes``) write only such values; the executor copies what they
    overwrite just before each runs, unless the app has matched them already (no abort comes
    before them). Its external tensors are what it reads of the session that its own calls did
    not make; how each is found in an inference is ``_externals``."""

    end: int
    batch: Any
    # (local index or -1, slot, its recorded id; 0: none, it must be bound)
    externals: list[tuple[int, int, int]]
    slots: frozenset[int]  # the slots its calls read: an argument given for one is not batched
    constants: frozenset[int]  # the CONSTANT slots among them
    outs: list[int]  # the local indices of its calls' outputs, in order
    made_by: list[int]  # per output, the call that makes it
    writes: list[int]  # its calls that write in place (a value made before them)
    answered: list[int]  # its calls whose result the app is answered, from its start
    # externals that are bytes the definition holds (a tensor the app makes the same each
    # inference, ``torch.tensor(True)``): external index -> (recorded upload, local index of
    # its bind id or None): each inference gets its own copy, as on the one-by-one path
    uploads: dict[int, tuple[ops_pb2.TensorRef, int | None]] = field(default_factory=dict)
    # those the executor decoded once (``fixed_upload``): external index -> its object
    fixed: dict[int, Any] = field(default_factory=dict)
    # ``_externals``' work that holds until a weight or constant is bound again: the count of
    # binds it was done at, and the ids of the externals that are not this inference's values
    # (None at theirs), or None where one of them has no live id
    found: tuple[int, list[int | None] | None] | None = None


@dataclass
class Compiled:
    definition: ops_pb2.SequenceDef
    local: dict[int, int]  # recorded local id -> index
    inputs: list[list[int]]  # per call: slots it waits for (inputs; weights until first bound)
    outputs: set[int]  # local indices the app downloads
    pushes: list[tuple[int, ...]]  # per call: outputs whose final value it writes (pushed after)
    writes: list[list[int]]  # per call: positions of outputs that overwrite existing values
    mutates: list[bool]  # per call: writes arguments in place without returning them
    # per call, per tensor argument: (slot, recorded ref, its kind, local index of the upload's
    # bind id, local index of the producing call's output) - precomputed for ``_bind``
    binding: list[list[tuple[int, ops_pb2.TensorRef, str, int | None, int | None]]]
    # per call, per output: its local index, or None for an id the inference did not make
    # (an argument written in place and returned) - precomputed for ``_bind``
    out_local: list[list[int | None]]
    last_use: dict[int, int]  # local index -> the last call that reads or writes it
    free_after: list[tuple[int, ...]]  # per call: local indices it is the last to read or write
    written: Callable[[ops_pb2.OpCall], list[int]] | None = None
    sticky: dict[int, ops_pb2.TensorRef] = field(default_factory=dict)  # bound weights, constants
    prepared: list[Any] = field(default_factory=list)  # per call: the executor's, or None
    latest: dict[int, ops_pb2.TensorRef] = field(default_factory=dict)  # INPUT slot -> last upload
    # CONSTANT slots: recorded id -> its slots, and per call the slots it reads
    constants: dict[int, list[int]] = field(default_factory=dict)
    constants_at: list[tuple[int, ...]] = field(default_factory=list)
    # CONSTANT slots whose recorded tensor the app released (and nothing was bound since): a
    # call reading one waits, for the app can no longer match it (its abort follows)
    gone: set[int] = field(default_factory=set)
    # per call: its symbolic integers, as (path to the Value to set, local index of the tensor,
    # first dimension (READ_VALUE: its value), number of dimensions multiplied)
    symbols: dict[int, list[tuple[list[Any], int, int, int]]] = field(default_factory=dict)
    # calls whose output sizes may follow the data: answered ones, and from ``varies_from`` on
    varying: frozenset[int] = frozenset()
    answered: frozenset[int] = frozenset()  # calls whose result the app is answered (want_meta)
    # A definition with loops (``rrtod.loops``): this is its head; at the head's end the replay
    # goes on with ``unrolled[count]`` (``HostReplayer._unroll``), where ``counted`` is the
    # (local index, dimension) of the size that counts the loop.
    folded: ops_pb2.SequenceDef | None = None
    counted: tuple[int, int] | None = None
    layout: loops.Layout | None = None  # ``folded``'s, for each unrolling
    unrolled: dict[Any, Compiled] = field(default_factory=dict)
    # Checked when defined (``HostReplayer._compile``): ``folded`` passed ``loops.check`` (not
    # one unrolled from it), and ``pinned_by`` over every call its loops may run
    checked: bool = False
    pinned: str | None = None
    # A loop with variants: this is its head and the bodies of ``bodies_of`` iterations
    # (``loops.bodies``); at its end the guards are read and the replay goes on with the
    # variants they chose. Unrolled so, ``app_pos`` gives per call its position in the app's
    # order (the host runs every body first): an abort's position is the app's. None: the same.
    bodies_of: int | None = None
    app_pos: list[int] | None = None
    # The bodies' calls from ``app_upto`` on have no app position yet: it follows the variants
    # chosen after them (their sizes and answers wait for those: ``Active.held``). A resumed
    # replay's bodies (``ReplayStart.loop_choices``) follow ``done``, the choices of the
    # iterations before it, run in the app's order (``loops.unroll``'s ``ordered``).
    app_upto: int | None = None
    done: tuple[int, ...] = ()
    cut: bool = False  # unrolled up to an iteration no variant has: the app aborts at its end
    folded_canon: list[int] | None = None  # the bodies': their head's ``canon``
    # Unrolled: per slot, the slot of the defined sequence it comes from, under which a weight
    # is bound (``sticky``, shared with it: ``rrtod.loops``); None: the slots are its own.
    canon: list[int] | None = None
    robot: frozenset[int] = frozenset()  # calls the robot runs (this plan's: ``partition``)
    # A Hybrid-Parallel split (``rrtod.lop``): per region call this host makes a band of, its
    # row rule, per tensor argument the first row this host holds of it (None: whole), and
    # the band ``[lo, hi)``; per call outside the region that reads region values whole, the
    # (tensor argument, local index) of each (``compile_sequence``'s ``merges``).
    split: dict[int, tuple[Any, list[int | None], int, int]] = field(default_factory=dict)
    merges: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # Per plan of the definition (``SequenceDef.plans``): its compiled rewrite, sharing this
    # one's per-slot state (weights bound, latest inputs); a start names the one it runs.
    plans: list[Compiled] = field(default_factory=list)
    plan: int = 0  # which plan this is (0: the definition itself, every call here)
    # Per call, the time of the profiled replays that ran to their end, summed, and how many
    # (``SequenceProfile``, sent once ``PROFILED`` have run)
    profile_ns: list[int] = field(default_factory=list)
    profiled: int = 0
    base: bytes = b""  # the definition without its plans: what a redefinition must match
    # per call: its tensor arguments, and the ids it writes in place and its outputs view
    # (``compile_sequence``'s ``written``/``viewed``), kept for a definition sharing its calls
    refs: list[list[ops_pb2.TensorRef]] = field(default_factory=list)
    shared: int = 0  # its first calls compiled as its ``prefix``'s were (``_shared``)
    written_of: list[list[int]] = field(default_factory=list)
    viewed_of: list[list[int]] = field(default_factory=list)
    # Runs of calls the executor replays with one native call each (``Run``), by first call;
    # None until the first replay that may use them plans them (``HostReplayer._runs``), from
    # the call it is at (``runs_from``: an unrolling is entered where its head ended)
    runs: dict[int, Run] | None = None
    runs_from: int = 0
    # the ids its calls output, and per local index the first call that makes it: what a
    # sequence compiled on this one as its prefix continues from (``compile_sequence``)
    produced: frozenset[int] = frozenset()
    made_at: dict[int, int] = field(default_factory=dict)
    # A head with a loop: per recorded call of its unrollings (``loops.unroll``'s
    # ``made_from``), the executor's decoded form, shared by all of them (``_prepared``)
    templates: dict[Any, Any] = field(default_factory=dict)

    def bound(self, slot: int) -> ops_pb2.TensorRef | None:
        """The weight or constant bound for ``slot`` (``sticky``), if any."""
        return self.sticky.get(self.canon[slot] if self.canon is not None else slot)


def compile_sequence(d: ops_pb2.SequenceDef,
                     written: Callable[[ops_pb2.OpCall], list[int]] | None = None,
                     viewed: Callable[[ops_pb2.OpCall], list[int]] | None = None,
                     robot: frozenset[int] = frozenset(),
                     merges: dict[int, list[tuple[int, int]]] | None = None,
                     prefix: Compiled | None = None, copied: int = 0) -> Compiled:
    """Index a definition for replay; ValueError if it is inconsistent (never trusted blindly:
    a bad definition must fail here, not halfway through an inference). ``written``: the ids
    of arguments a call writes in place without returning them (from the executor).
    ``robot``: the calls the robot runs (a plan's, ``d`` then its ``partition.rewrite``).
    ``merges``: per call, (tensor argument, local index) of values of a split region it reads
    whole, put together from the robot's band (its INPUT there) and this host's (``lop``).
    ``prefix``: a compiled sequence whose first calls ``d`` may begin with (the head an
    unrolling continues): what those calls alone decide is taken from it (``_shared``);
    ``copied``: ``d``'s first calls are a copy of its definition's this far (not compared)."""
    if len(d.local_ids) > SPAN:  # inference k's ids are base + index: they would reach k+1's
        raise ValueError(f"sequence {d.id}: {len(d.local_ids)} local ids, more than an "
                         f"inference's id range holds ({SPAN}, rrtod.wire.SPAN)")
    local = {rid: i for i, rid in enumerate(d.local_ids)}
    shared = _shared(d, prefix, copied) if prefix is not None and not robot and not merges \
        else 0
    # The first ``shared`` calls are the prefix's (``p``): their per-call parts are taken from
    # it, and only the calls after them are worked out (an unrolling at each Mask R-CNN frame)
    p = prefix if shared else None
    whole = p is not None and shared == len(p.refs)  # every call of the prefix: its state too
    rest = list(d.calls[shared:])
    rest_refs = [iter_tensor_refs(call) for call in rest]
    counts = [len(r) for r in _first_calls(p, "refs", shared)] + [len(r) for r in rest_refs]
    if sum(counts) != len(d.sources):
        raise ValueError(f"sequence {d.id}: {len(d.sources)} sources for {sum(counts)} "
                         "tensor arguments")
    first_slot = sum(counts[:shared])  # the prefix's sources are its own, checked there
    for src in d.sources[first_slot:]:
        if src.kind == SRC.PRODUCED and src.id not in local:
            raise ValueError(f"sequence {d.id}: produced source {src.id} is not a local id")
    if any(o not in local for o in d.outputs):
        raise ValueError(f"sequence {d.id}: an output is not a local id")
    if robot and partition.why_not_split(d):
        raise ValueError(f"sequence {d.id} cannot be split: {partition.why_not_split(d)}")
    if robot and max(robot) >= len(d.calls):
        raise ValueError(f"sequence {d.id}: a robot call is not one of its calls")
    inputs, writes, mutates, binding, refs_of, written_of = (
        _first_calls(p, name, shared)
        for name in ("inputs", "writes", "mutates", "binding", "refs", "written_of"))
    n = first_slot
    # ids the calls so far output (the same call, sources and ids as the prefix's up to
    # ``shared``)
    produced: set[int] = set(p.produced) if whole else {  # type: ignore[union-attr]
        r for call in d.calls[:shared] for r in call.out_ids}
    robot_made: set[int] = set()  # ids only the robot has
    for k, (call, refs) in enumerate(zip(rest, rest_refs, strict=True), start=shared):
        own = list(range(n, n + len(refs)))
        n += len(refs)
        refs_of.append(refs)
        written_of.append(written(call) if written is not None else [])
        if k in robot:  # the robot runs it: nothing to wait for, run, snapshot or check
            binding.append([])
            inputs.append([])
            writes.append([])
            mutates.append(False)
            robot_made.update(r for r in call.out_ids if r not in produced)
            produced.update(call.out_ids)
            continue
        plan = []
        for s, ref in zip(own, refs, strict=True):
            kind = ref.WhichOneof("ref")
            src = d.sources[s]
            if src.kind == SRC.PRODUCED and src.id in robot_made:
                raise ValueError(f"sequence {d.id}: call {k} reads a value only the robot makes")
            plan.append((s, ref, kind, local.get(ref.bind_id) if kind == "upload" else None,
                         local[src.id] if src.kind == SRC.PRODUCED else None))
        binding.append(plan)
        # A weight's id is only known to be bound once the shim names it (its first use in this
        # session may be this very replay), so until then it is waited for like an input.
        # A fixed input is the recorded upload itself (``SeqSource.fixed``): not waited for.
        inputs.append([s for s in own if d.sources[s].kind == SRC.PERSISTENT
                       or (d.sources[s].kind == SRC.INPUT and not d.sources[s].fixed)])
        writes.append([j for j, r in enumerate(call.out_ids) if r in produced or r not in local])
        # (an argument written and returned, as ``relu_``'s, is one of ``writes`` already)
        mutates.append(bool(set(written_of[k]) - set(call.out_ids)))
        produced.update(call.out_ids)
    if any(o in robot_made for o in d.outputs):
        raise ValueError(f"sequence {d.id}: an output is made by the robot")
    outputs = {local[o] for o in d.outputs if o in local}
    # an output is pushed once nothing writes its storage any more (a view of it included)
    viewed_of = _first_calls(p, "viewed_of", shared) + [
        viewed(call) if viewed is not None else [] for call in rest]
    last_writer = final_writes_of(d, written_of, viewed_of)
    pushes = _grouped(len(d.calls), ((last_writer[i], i) for i in sorted(outputs)))
    last_use = dict(last_writer)
    for k, plan in enumerate(binding):
        for _slot, _ref, _kind, bind, source in plan:
            for i in (bind, source):
                if i is not None:
                    last_use[i] = max(last_use.get(i, k), k)
    for k, pairs in (merges or {}).items():
        for _j, i in pairs:
            last_use[i] = max(last_use.get(i, k), k)
    for sym in d.symbols:  # a size or value read when that call runs: kept until then
        if sym.tensor in local and sym.call < len(d.calls):
            i = local[sym.tensor]
            last_use[i] = max(last_use.get(i, sym.call), sym.call)
    free_after = _grouped(len(d.calls), ((k, i) for i, k in last_use.items()))
    constants: dict[int, list[int]] = {}
    for slot, src in enumerate(d.sources):
        if src.kind == SRC.CONSTANT:
            constants.setdefault(src.id, []).append(slot)
    constant_slots = {slot for slots in constants.values() for slot in slots}
    constants_at = [tuple(arg[0] for arg in plan if arg[0] in constant_slots)
                    if constant_slots else () for plan in binding]
    symbols: dict[int, list[tuple[list[Any], int, int, int]]] = {}
    # local index -> the first call that makes it
    made_at: dict[int, int] = dict(p.made_at) if whole else {}  # type: ignore[union-attr]
    for k, call in enumerate(rest if whole else d.calls, start=shared if whole else 0):
        for r in call.out_ids:
            if r in local:
                made_at.setdefault(local[r], k)
        for _s, _r, kind, bind, _p in binding[k]:
            if kind == "upload" and bind is not None:
                made_at.setdefault(bind, k)
    for sym in d.symbols:
        if sym.call >= len(d.calls) or sym.tensor not in local:
            raise ValueError(f"sequence {d.id}: symbolic integer of call {sym.call} names no "
                             "call or no tensor of the inference")
        int_arg(d.calls[sym.call], sym)  # the path must lead to an integer
        path = [sym.kwarg if sym.kwarg else sym.arg, *sym.items]
        symbols.setdefault(sym.call, []).append(
            (path, local[sym.tensor], READ_VALUE, 0) if sym.value
            else (path, local[sym.tensor], sym.dim, max(sym.span, 1)))
        # the tensor must exist when the call runs: made by an earlier call of the inference
        if made_at.get(local[sym.tensor], len(d.calls)) >= sym.call:
            raise ValueError(f"sequence {d.id}: call {sym.call} uses a size of a tensor made "
                             "after it")
    first = d.varies_from if d.HasField("varies_from") else len(d.calls)
    answered = frozenset(k for k in (p.answered if p is not None else ()) if k < shared) | {
        k for k, call in enumerate(rest, start=shared) if call.want_meta}
    varying = frozenset(range(first, len(d.calls))) | answered
    out_local = _first_calls(p, "out_local", shared) + [
        [local.get(r) for r in call.out_ids] for call in rest]
    return Compiled(d, local, inputs, outputs, pushes, writes, mutates, binding, out_local,
                    last_use, free_after, written=written, constants=constants,
                    constants_at=constants_at, symbols=symbols, varying=varying,
                    answered=answered, robot=robot, merges=merges or {}, refs=refs_of,
                    written_of=written_of, viewed_of=viewed_of, shared=shared,
                    produced=frozenset(produced), made_at=made_at)


def _first_calls(prefix: Compiled | None, name: str, shared: int) -> list[Any]:
    """A per-call list of ``prefix`` (``Compiled``'s field ``name``) for its first ``shared``
    calls, to be extended; empty without a prefix."""
    return list(getattr(prefix, name)[:shared]) if prefix is not None else []


def _grouped(n: int, pairs: Iterable[tuple[int, int]]) -> list[tuple[int, ...]]:
    """Per call ``k < n``, the items paired with it, in order; the empty tuple where none.
    (Three empty lists a call were most of the objects a Mask R-CNN host tracked, each
    unrolling another thousand calls' worth: tuples of ints leave the garbage collector.)"""
    by: dict[int, list[int]] = {}
    for k, i in pairs:
        by.setdefault(k, []).append(i)
    return [tuple(by[k]) if k in by else () for k in range(n)]


def _shared(d: ops_pb2.SequenceDef, prefix: Compiled, copied: int = 0) -> int:
    """How many first calls of ``d`` take ``prefix``'s compile (``loops.shared_calls``):
    compiling an unrolling's head again each inference was most of its cost (Mask R-CNN: 714
    calls of a frame's 740 to 956)."""
    p = prefix.definition
    if p.loops or prefix.robot or prefix.merges or prefix.split:
        return 0
    return loops.shared_calls(d, p, [len(r) for r in prefix.refs], prefix.out_local, copied)


def pinned_by(seq: Compiled) -> str | None:
    """Why ``seq``'s inferences must all run on this host (``SequenceAck.pinned``), or None:
    a call that writes a value the inference did not make (a weight or buffer updated in
    place, state kept for the next inference), so that the next inference reads what this one
    left on this host; or outputs only this host can name (ids it assigns itself)."""
    d = seq.definition
    for k, call in enumerate(d.calls):
        if k in seq.robot:
            continue
        outside = [r for r in call.out_ids if r not in seq.local]
        if seq.written is not None:
            outside += [r for r in seq.written(call) if r not in seq.local]
        if outside:
            return f"call {k} ({call.op}) writes a value that outlives the inference"
        if call.want_meta:
            return f"call {k} ({call.op}) has outputs whose number only the host knows"
    return None


@dataclass
class Active:
    seq: Compiled
    base: int
    position: int = 0  # next call to run
    args: dict[int, ops_pb2.TensorRef] = field(default_factory=dict)
    failed: bool = False
    snapshots: list[tuple[int, Any]] = field(default_factory=list)  # (call, executor token)
    # The app matched every call before this position (``Release.progress``): no abort comes
    # before it, so a call before it that writes in place needs no snapshot
    matched: int = 0
    dropped: set[int] = field(default_factory=set)  # local indices the app let go of
    # joined under way (``ReplayStart.joined``): local index -> the id the app holds it under
    joined: dict[int, int] = field(default_factory=dict)
    start: int = 0  # the first call this replay runs (``ReplayStart.position``)
    # per call whose output sizes follow the data: those sizes (``ReplayedPrefix``)
    sizes: dict[int, list[tuple[int, ...] | None]] = field(default_factory=dict)
    # ... and of those with one dense output, (app position, sizes) not sent to the shim yet
    # (``ReplaySizes``)
    shapes: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    started_ns: int = field(default_factory=time.perf_counter_ns)  # its start frame ran
    cpu_ns: int = 0  # this thread's CPU running its calls (operators and the Python around)
    faults: int = 0  # ... and the minor page faults it took meanwhile (fresh memory touched)
    timing: list[int] | None = None  # per call, its time (a profiled replay: ``PROFILED``)
    # data uploaded for it after its start frame, and when the last of it came (ReplayTiming)
    upload_bytes: int = 0
    uploaded_ns: int = 0
    resumed: bool = False  # a loop resumed after a cut (``ReplayStart.loop_choices``)
    # a join's native runs, from where it joined when no run of the sequence's starts there
    runs: dict[int, Run] | None = None
    # per call with no app position yet (``Compiled.app_upto``): its answer or its sizes, as
    # (call, result or None, sizes), sent once the variants are chosen
    held: list[tuple[int, ops_pb2.OpResult | None, tuple[int, ...]]] = field(
        default_factory=list)

    def id_of(self, i: int) -> int:
        """The id of local value ``i`` in this inference."""
        return self.joined.get(i, self.base + i) if self.joined else self.base + i

    def app_position(self, k: int) -> int:
        """The app's position of call ``k`` of ``seq`` (which may run them in another order:
        ``Compiled.app_pos``): where an answer to it is for. -1: not known yet (a body's,
        before the variants are chosen: ``Compiled.app_upto``)."""
        app = self.seq.app_pos
        if app is None:
            upto = self.seq.app_upto
            return k if upto is None or k < upto else -1
        return k if k >= len(app) else app[k]

    def app_failed(self, k: int) -> int:
        """The app's first call that call ``k`` failing leaves unrun: an error's position (the
        shim replays the calls before it, which ran)."""
        app = self.seq.app_pos
        if app is None:
            upto = self.seq.app_upto
            return k if upto is None else min(k, upto)
        return min(app[k:], default=len(app))


class HostReplayer:
    """Drives one session's executor through replays. Calls run ahead of the app, so a call
    that overwrites an existing value in place (``relu_`` on an earlier output, a running
    statistic) is preceded by an executor snapshot of that value: an abort before it restores
    what forwarding would have left. Not where the app has already matched that call: its
    release frames say how far it got (``Release.progress``), and no abort comes before that.
    A host slower than its app (the common case for a detector: the app runs ahead to its
    first data-dependent call while the host computes the backbone) so copies none of the
    backbone's activations (Faster R-CNN: 47-50 of its 143 in-place calls an inference, which
    then also run in native runs); a host ahead of its app copies as before, with time to
    spare.

    Values the app lets go of while the host still computes are freed right after their last
    use in the sequence, ahead of the release frame itself (``read``): the next calls then
    reuse memory that is still in the cache, as the app's own forward would, instead of
    touching a whole inference's worth of fresh buffers."""

    def __init__(self, executor: Runner):
        self.handle = executor.handle
        self.replay: ReplayExtension | None = executor.replay  # None: replays through handle
        # optional: the sizes of a live dense tensor, for ``ReplaySizes`` (``_sized``)
        self._dense: Callable[[int], tuple[int, ...] | None] | None = getattr(
            self.replay, "dense_sizes", None)
        # optional (rrtod.executor): frees without a Release frame per value
        self._release: Callable[[list[int]], None] | None = getattr(self.replay, "release", None)
        # optional too: a definition's upload decoded once for every inference's native runs
        self._fixed_upload: Callable[[ops_pb2.TensorRef], Any] | None = getattr(
            self.replay, "fixed_upload", None)
        # optional (``Runner``): the transport's held replies, asked of inside a native run
        self._pace = executor if hasattr(executor, "held") and hasattr(executor, "tick") \
            else None
        self.sequences: dict[int, Compiled] = {}
        self.retired: dict[int, Compiled] = {}  # dropped, oldest first (``RETIRED_KEPT``)
        # native runs built, by their decoded calls and dataflow (``_run_of``), oldest first
        self._batches: dict[Any, Any] = {}
        self.active: Active | None = None
        # A replay the host completed ahead of the app: it may still be aborted, until the app
        # shows it matched to the end (a new start, or a forwarded call).
        self.last: Active | None = None
        self.replays = 0
        self.aborts = 0
        # Calls that write in place: snapshotted before they ran, or not (the app had matched them)
        self.snapshots = 0
        self.snapshots_skipped = 0
        # Replays that ran to their end (``timings``): the CPU their calls took on the replay
        # thread, and the time from each start frame to its last call.
        self.completed = 0
        self.completed_cpu_ns = 0
        self.completed_faults = 0
        self.completed_wall_ns = 0
        self.refused = False  # the last start named an unknown sequence
        self.binds = 0  # weights and constants bound so far (``Run.found``)
        # Early releases, from the transport's thread: (inference base, ids).
        self._released: deque[tuple[int, Iterable[int]]] = deque()
        self._read_base: int | None = None  # the transport's view, in stream order
        self._pinned: set[int] = set()

    def read(self, frame: ops_pb2.SessionUp) -> None:
        """Called by the transport for every frame as it is read, before the frame waits in
        the session's queue. A release may be acted on early only if nothing queued before it
        can still read those ids: so only ids of the inference whose start was read last,
        while nothing but its arguments followed that start (a forwarded call, a download or
        an abort may read them), and never an id an argument names."""
        kind = frame.WhichOneof("msg")
        if kind == "release":
            self._progress(frame.release)
            base = self._read_base
            if base is not None and self.active is not None:
                self._released.append((base, [i for i in released_ids(frame.release)
                                              if i not in self._pinned]))
        elif kind == "arg":
            if frame.arg.tensor.WhichOneof("ref") == "id":
                self._pinned.add(frame.arg.tensor.id)
        elif kind == "start":
            self._read_base = frame.start.base_id
            self._pinned = set()
        else:
            self._read_base = None

    def process(self, frame: ops_pb2.SessionUp, emit: Emit) -> None:
        kind = frame.WhichOneof("msg")
        if kind == "define":
            self._define(frame.define, emit)
        elif kind == "start":
            self._finish(emit)  # a new inference: the previous one runs to its end first
            self.last = None
            seq = self.sequences.get(frame.start.sequence) \
                or self.retired.get(frame.start.sequence)
            self.refused = seq is None
            if seq is None:  # its arguments follow: they are dropped without more errors
                emit(_error("UNKNOWN_SEQUENCE", f"no sequence {frame.start.sequence} defined",
                            frame.start.sequence))
                return
            if frame.start.plan:
                if frame.start.plan > len(seq.plans):  # its arguments follow: dropped
                    self.refused = True
                    emit(_error("BAD_START", f"sequence {frame.start.sequence} has no plan "
                                f"{frame.start.plan}", frame.start.sequence))
                    return
                seq = seq.plans[frame.start.plan - 1]
            resumed = bool(frame.start.loop_count or frame.start.loop_choices)
            if resumed:
                try:
                    seq = self._resumed(seq, frame.start)
                except ValueError as exc:  # its arguments follow: dropped
                    self.refused = True
                    emit(_error("BAD_START", str(exc), frame.start.sequence))
                    return
            act = Active(seq, frame.start.base_id, resumed=resumed)
            if seq.definition.profile and seq.profiled < PROFILED and seq.folded is None \
                    and not resumed:
                act.timing = [0] * len(seq.definition.calls)
            if frame.start.position or frame.start.joined:
                why = _bad_join(seq, frame.start)
                if why is not None:  # its arguments follow: dropped like an unknown sequence's
                    self.refused = True
                    emit(_error("BAD_START", why, frame.start.sequence))
                    return
                act.position, act.joined = frame.start.position, dict(frame.start.joined)
                act.start = act.position
            self.active = act
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
        """A forwarded frame during or after a replay: the calls it may read run first. The
        app only holds (and drops) values of calls it has matched, whose inputs have all
        arrived, so ``_advance`` has run them; but a later call may still take a size or value
        of one (``SymbolicInt``), or put a split value together (``Compiled.merges``: the app
        matched that call and let the value go, the call still waits for the robot's band),
        while it waits for another input: a release of such a value frees it after that
        call."""
        act = self.active
        if act is not None:
            self._advance(emit)
        kind = frame.WhichOneof("msg")
        if kind == "call":
            self.last = None
        elif kind == "release":
            self._progress(frame.release)
            self._constants_released(frame.release)
            if act is not None and self.active is act and (act.seq.symbols or act.seq.merges):
                frame = self._defer_released(act, frame)
        for down in self.handle(frame):
            emit(down)

    def _progress(self, release: ops_pb2.Release) -> None:
        """How far the app has matched the replay under way (``Release.progress``), from the
        transport's thread as the frame is read, and again in stream order (a frame read
        before its replay's start was processed). Only ever raised: the app's position grows."""
        if not release.HasField("progress"):
            return
        act = self.active
        p = release.progress
        if act is not None and act.base == p.base_id and p.position > act.matched:
            act.matched = p.position

    def _defer_released(self, act: Active, frame: ops_pb2.SessionUp) -> ops_pb2.SessionUp:
        """``frame`` (a release) without the values of ``act`` still to be used, which go
        into ``act.dropped``: freed after their last use."""
        keep, later = [], False
        for oid in released_ids(frame.release):
            i = oid - act.base
            if 0 <= i < len(act.seq.local) and act.seq.last_use.get(i, -1) >= act.position:
                act.dropped.add(i)
                later = True
            else:
                keep.append(oid)
        return ops_pb2.SessionUp(release=release_of(keep)) if later else frame

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
                act.upload_bytes += len(tensor.upload.data) + len(tensor.upload.palette)
                act.uploaded_ns = time.perf_counter_ns()
            act.args[slot] = tensor
        else:  # a weight or constant (re)bound: it holds for later inferences too
            slot = seq.canon[slot] if seq.canon is not None else slot
            seq.sticky[slot] = tensor
            seq.gone.discard(slot)
            self.binds += 1
        if not act.failed:  # else already reported; the rest of this inference is not run
            self._advance(emit)

    def _define(self, d: ops_pb2.SequenceDef, emit: Emit) -> None:
        if not d.calls:  # an empty definition drops the sequence: retired
            gone = self.sequences.pop(d.id, None)
            if gone is not None:
                self.retired[d.id] = gone
                while len(self.retired) > RETIRED_KEPT:  # the oldest first
                    del self.retired[next(iter(self.retired))]
            return
        self.retired.pop(d.id, None)
        replay = self.replay
        known = self.sequences.get(d.id)
        base = partition.without_plans(d)
        if known is not None and known.base == base and len(d.plans) >= len(known.plans):
            # The same sequence with more plans (a scheduler placed it anew): what both ends
            # hold for it (bound weights, latest inputs) stays; the new plans are compiled.
            try:
                for k in range(len(known.plans) + 1, len(d.plans) + 1):
                    self._add_plan(known, d, k)
            except (ValueError, KeyError) as exc:
                emit(ops_pb2.SessionDown(defined=ops_pb2.SequenceAck(id=d.id, reason=str(exc))))
                return
            known.definition.plans.extend(d.plans[len(known.definition.plans):])
            emit(ops_pb2.SessionDown(defined=ops_pb2.SequenceAck(
                id=d.id, accepted=True, pinned=pinned_by(known) or "")))
            return
        try:
            compiled = self._compile(d)
            compiled.base = base
            for k in range(1, len(d.plans) + 1):
                self._add_plan(compiled, d, k)
            if (any(compiled.writes) or any(compiled.mutates)) and replay is None:
                raise ValueError(f"sequence {d.id} writes values in place and this executor "
                                 "cannot snapshot them (it declares no replay extension)")
            # A constant the app released before the definition got here (the search ran
            # meanwhile): no inference can match it, and running ahead would read freed memory.
            dead = replay.missing(sorted(compiled.constants)) if replay is not None else []
            if dead:
                raise ValueError(f"sequence {d.id} reads tensors the app has already released "
                                 f"as constants: {dead[:5]}")
        except (ValueError, KeyError) as exc:
            emit(ops_pb2.SessionDown(defined=ops_pb2.SequenceAck(id=d.id, reason=str(exc))))
            return
        compiled.prepared = [None if k in compiled.robot else self._prepare(call)
                             for k, call in enumerate(compiled.definition.calls)]
        self.sequences[d.id] = compiled
        # The compiled definition, out of the garbage collector's full collections
        # (``rrtod.gcfreeze``) if the last settle (at the session's start) is a minute old
        gcfreeze.settle(again=True)
        pinned = pinned_by(compiled) if not d.loops else compiled.pinned
        emit(ops_pb2.SessionDown(defined=ops_pb2.SequenceAck(
            id=d.id, accepted=True, pinned=pinned or "")))

    def _add_plan(self, seq: Compiled, d: ops_pb2.SequenceDef, k: int) -> None:
        """Compile plan ``k`` of ``d`` (``partition.rewrite``) beside ``seq``, sharing its
        per-slot state. ValueError if the plan is not one ``d`` can run."""
        robot = partition.plan_calls(d, k)
        replay = self.replay
        split = partition.plan_split(d, k)
        bands, skip, merges = None, robot, None
        if split is not None:
            rule_of = getattr(replay, "rows", None)
            if rule_of is None:
                raise ValueError(f"sequence {d.id}: this host's executor cannot split calls")
            try:
                bands = lop.Space(d, rule_of).bands_of(split.calls, split.at)
                merges = lop.merges(d, bands, robot)
            except (TypeError, IndexError, AttributeError, ZeroDivisionError) as exc:
                raise ValueError(f"sequence {d.id}: its split cannot be worked out: "
                                 f"{exc}") from exc
            # calls of the region whose band here is empty run on the robot only
            skip = robot | {c for c in split.calls if bands.host[c] >= bands.height[c]}
            if len(d.local_ids) + max(map(len, merges.values()), default=0) > SPAN:
                raise ValueError(f"sequence {d.id}: no ids left to put split values together")
        plan = compile_sequence(
            partition.rewrite(d, robot, frozenset(split.calls) if split else frozenset()),
            replay.written_ids if replay is not None else None,
            replay.viewed_ids if replay is not None else None, frozenset(skip), merges)
        if bands is not None:
            plan.split = {c: (bands.rules[c], bands.starts[c], bands.host[c], bands.height[c])
                          for c in bands.region.calls if c not in skip}
        plan.sticky, plan.latest, plan.gone = seq.sticky, seq.latest, seq.gone
        plan.plan = k
        plan.prepared = [None if j in skip else self._prepare(call)
                         for j, call in enumerate(plan.definition.calls)]
        seq.plans.append(plan)

    def _compile(self, d: ops_pb2.SequenceDef, check: bool = True,
                 prefix: Compiled | None = None, copied: int = 0) -> Compiled:
        """``compile_sequence`` with this executor's aliasing; a definition with loops compiles
        to its head. ``check``: it is also compiled unrolled (``loops.samples``: no iteration,
        one, two, each variant), so that a definition that cannot run fails here and not when
        an inference reaches its loop (``pinned_by`` over those is the head's ``pinned``: each
        compiled once, where a second pass compiled them all again); a later loop is checked
        so within the one-iteration sample only (checking it in every sample of the first
        loop compiled Mask R-CNN's per-box loop 102 times). An unrolling at replay time is of
        a definition checked so when it was defined: not checked again (it was 34 compiles of
        the whole inference per frame). ``prefix``: the compiled head an unrolling continues
        (``compile_sequence``, with ``copied``)."""
        replay = self.replay
        written = replay.written_ids if replay is not None else None
        viewed = replay.viewed_ids if replay is not None else None
        if not d.loops:
            return compile_sequence(d, written, viewed, prefix=prefix, copied=copied)
        why = None
        seq = compile_sequence(loops.head(d), written, viewed, prefix=prefix)
        if check:
            loops.check(d)  # (first: a definition that fails it may not even be laid out)
        layout = loops.layout_of(d)
        if check:  # (each sample compiled once, on the head: its ``pinned_by`` is read off it)
            for n, u in enumerate(loops.samples(d, layout)):
                sample = self._compile(u, check=n == 1, prefix=seq)
                why = why or (sample.pinned if n == 1 and u.loops else pinned_by(sample))
        seq.folded, seq.counted, seq.checked, seq.pinned = d, loops.counted_by(d), check, why
        seq.layout = layout
        return seq

    def _prepared(self, templates: dict[Any, Any], key: Any, call: ops_pb2.OpCall) -> Any:
        """``_prepare(call)``, kept in ``templates`` under ``key`` (the recorded call it was
        unrolled from: ``loops.unroll``'s ``made_from``, None for none) for every unrolling of
        the same definition: each Mask R-CNN frame unrolls its own count and variants, and
        decoding their calls anew, then trying each in the native loop and building its runs
        again, was ~10 ms of every frame. One decoded form per recorded call also lets the
        runs built of them be kept (``_run_of``)."""
        p = templates.get(key) if key is not None else None
        if p is not None and getattr(p, "what", None) == f"{call.op} (replayed)":
            return p
        p = self._prepare(call)
        if key is not None and p is not None:
            if len(templates) >= MAX_TEMPLATES:
                templates.clear()
            templates[key] = p
        return p

    def _prepare(self, call: ops_pb2.OpCall) -> Any:
        """The executor's decoded form of ``call`` (its replay extension's ``prepare``): a
        replayed call then costs the operator and little else. None keeps the generic path,
        which also reports whatever made preparing fail when the call is replayed."""
        if self.replay is None:
            return None
        try:
            return self.replay.prepare(call)
        except Exception:  # noqa: BLE001 - reported by the generic path at replay time
            return None

    def crashed(self) -> int:
        """Something raised while a frame was handled: the replay in progress, if any, fails
        (the caller names its sequence in the error, so the app stops waiting for its pushes
        and drops it; its remaining arguments are dropped here). 0: none was in progress."""
        act = self.active
        if act is None:
            return 0
        act.failed = True
        self._close(act)
        self.refused = True
        return act.seq.definition.id

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
            self._released.clear()  # the frames themselves free these
        self.last = act if complete else None
        if not complete:
            act.snapshots.clear()
        else:
            self.completed += 1
            self.completed_cpu_ns += act.cpu_ns
            self.completed_faults += act.faults
            self.completed_wall_ns += time.perf_counter_ns() - act.started_ns

    def timings(self) -> dict[str, float | int]:
        """Where a replayed inference's time goes on this host, for status and the benchmark:
        per replay that ran to its end, the replay thread's CPU for its calls (the operators
        and this module's Python around them; an operator's other threads not counted) and
        the time from its start frame to its last call (CPU plus waits for the app's inputs
        and for the thread), and the minor page faults the thread took running them (memory
        touched for the first time: a replay that frees late writes into fresh pages, where the
        app's own forward reuses cached ones). Divided by ``replays_completed`` they are per
        inference."""
        return {"replays_completed": self.completed,
                "replay_cpu_s": self.completed_cpu_ns / 1e9,
                "replay_wall_s": self.completed_wall_ns / 1e9,
                "replay_minor_faults": self.completed_faults,
                "replay_snapshots": self.snapshots,
                "replay_snapshots_skipped": self.snapshots_skipped}

    def _advance(self, emit: Emit, limit: int | None = None) -> None:
        act = self.active
        if act is None or act.failed:
            return
        t0, f0 = time.thread_time_ns(), _minor_faults()
        try:
            ended = self._run_on(act, emit, limit)
        finally:
            act.cpu_ns += time.thread_time_ns() - t0
            act.faults += _minor_faults() - f0
        self._send_shapes(act, emit)
        if ended and limit is None:
            self._close(act, complete=True)
            if act.resumed and not act.seq.cut:  # the robot logs them (``_account``); a cut
                # one when the app leaves it at the cut (``_abort``)
                self._account(act, len(act.seq.definition.calls), emit)
            if act.timing is not None:
                self._profiled(act, emit)
            if act.upload_bytes and act.seq.definition.profile:
                emit(ops_pb2.SessionDown(timing=ops_pb2.ReplayTiming(
                    sequence=act.seq.definition.id, plan=act.seq.plan,
                    upload_bytes=act.upload_bytes,
                    upload_ns=max(0, act.uploaded_ns - act.started_ns))))

    def _sized(self, act: Active, k: int, oid: int) -> list[tuple[int, ...] | None]:
        """The sizes of ``oid``, call ``k``'s one output, which follow the data. If it is
        dense they also go to the shim, ahead of the next answer (``ReplaySizes``): it makes
        its proxy from them instead of working them out."""
        dims = self._dense(oid) if self._dense is not None else None
        if dims is None:
            return [self.replay.shape(oid)]  # type: ignore[union-attr]
        at = act.app_position(k)
        if at < 0:
            act.held.append((k, None, dims))
        else:
            act.shapes.append((at, dims))
        return [dims]

    @staticmethod
    def _send_shapes(act: Active, emit: Emit) -> None:
        if act.shapes:
            shapes, act.shapes = act.shapes, []
            emit(ops_pb2.SessionDown(sizes=ops_pb2.ReplaySizes(
                base_id=act.base, positions=[p for p, _ in shapes],
                ranks=[len(d) for _, d in shapes], dims=[n for _, d in shapes for n in d])))

    def _profiled(self, act: Active, emit: Emit) -> None:
        """A timed replay ran to its end: add it to its plan's profile, and report the
        profile once ``PROFILED`` replays are in."""
        seq = act.seq
        if not seq.profile_ns:
            seq.profile_ns = [0] * len(act.timing or ())
        for k, ns in enumerate(act.timing or ()):
            seq.profile_ns[k] += ns
        seq.profiled += 1
        if seq.profiled == PROFILED:
            emit(ops_pb2.SessionDown(profile=ops_pb2.SequenceProfile(
                sequence=seq.definition.id, plan=seq.plan, replays=seq.profiled,
                call_ns=[ns // seq.profiled for ns in seq.profile_ns])))

    def _run_on(self, act: Active, emit: Emit, limit: int | None) -> bool:
        """Run what can run now, unrolling loops as their counts become known: True when the
        replay ran its last call."""
        while True:
            self._run(act, emit, limit)
            calls = act.seq.definition.calls
            if act.failed or act.position < len(calls) or act.seq.folded is None \
                    or (limit is not None and act.position >= limit):
                break
            if not self._unroll(act, emit):
                return False
        return act.position == len(calls) and not act.failed

    def _run(self, act: Active, emit: Emit, limit: int | None) -> None:
        """Run the calls of ``act.seq`` whose inputs are here, up to ``limit``."""
        calls = act.seq.definition.calls
        stop = len(calls) if limit is None else min(limit, len(calls))
        robot, timing = act.seq.robot, act.timing
        sync = getattr(self.replay, "synchronize", None)
        runs = act.seq.runs
        if (runs is None or act.position < act.seq.runs_from) and timing is None:
            runs = act.seq.runs = self._runs(act.seq, act.position)
            act.seq.runs_from = act.position
        elif act.joined and runs and timing is None and (act.runs is not None or (
                act.position not in runs and act.position > act.seq.runs_from)):
            if act.runs is None:  # joined inside a run: this inference's own, from there
                act.runs = self._runs(act.seq, act.position)
            runs = act.runs
        while act.position < stop:
            k = act.position
            if runs and k in runs and timing is None and self._run_native(act, runs[k], stop, emit):
                continue
            if k in robot:  # the robot runs it
                act.position += 1
                continue
            if any(s not in act.args and act.seq.bound(s) is None for s in act.seq.inputs[k]):
                return  # waits for the app to produce this input
            if act.seq.gone and any(s in act.seq.gone for s in act.seq.constants_at[k]):
                return  # reads a constant the app let go of: the app's abort follows
            refs, out_ids = self._bind(act, k)
            prepared = act.seq.prepared[k] if act.seq.prepared else None
            answered = k in act.seq.answered
            ints = None
            if k in act.seq.symbols:
                ints = self._symbol_values(act, k, emit)
                if ints is None:
                    return
            call = None
            if act.seq.writes[k] or act.seq.mutates[k]:
                if 0 <= act.app_position(k) < act.matched:
                    self.snapshots_skipped += 1  # the app matched it: no abort undoes it
                else:
                    ids = [out_ids[j] for j in act.seq.writes[k]]
                    if act.seq.mutates[k] and act.seq.written is not None:
                        call = self._rebind(act, k, refs, out_ids)
                        ids = list(dict.fromkeys(ids + act.seq.written(call)))  # as rebound now
                    act.snapshots.append((k, self.replay.snapshot(ids)))  # checked at define
                    self.snapshots += 1
            t_call = time.perf_counter_ns() if timing is not None else 0
            merged = None
            if k in act.seq.merges:
                merged, failure = self._merge(act, k, refs)
                if failure is not None:  # reported as the call's own error would be
                    act.failed = True
                    failure.error.sequence = act.seq.definition.id
                    failure.error.base_id, failure.error.position = act.base, act.app_failed(k)
                    emit(failure)
                    return
            split = act.seq.split.get(k) if act.seq.split else None
            if split is not None and prepared is not None:  # this host's band of its rows
                how, starts, lo, hi = split
                downs = self.replay.run_rows(prepared, refs, out_ids, how, starts, lo, hi)
            elif prepared is not None:  # only with a replay extension (``_prepare``)
                downs = self.replay.run_prepared(prepared, refs, out_ids, ints, answered)
            else:
                call = call or self._rebind(act, k, refs, out_ids)
                for path, n in ints or ():
                    _put_int(call, path, n)
                call.want_meta = answered
                downs = self.handle(ops_pb2.SessionUp(call=call))
            for down in downs:
                what = down.WhichOneof("msg")
                if what == "error":  # the app may never make this call: it is told where
                    down.error.sequence = act.seq.definition.id
                    down.error.base_id = act.base
                    if self._cut_at_failure(act, k, down, emit):
                        self._run(act, emit, limit)  # the variants before its iteration
                        return
                    act.failed = True
                    down.error.position = act.app_failed(k)
                    emit(down)
                    return
                if what == "result":  # what the app needs to go on: its answer
                    at = act.app_position(k)
                    if at < 0:
                        act.held.append((k, _copied(down.result), ()))
                        continue
                    self._send_shapes(act, emit)  # the sizes before it first: the app is behind
                    emit(_answer_frame(act.base, at, down.result))
                else:
                    emit(down)
            if merged:
                self._free(merged)
            if timing is not None:
                if sync is not None:
                    sync()  # the device's work for this call, not only its launch
                timing[k] = time.perf_counter_ns() - t_call
            if k in act.seq.varying and self.replay is not None:  # for an abort's account
                act.sizes[k] = (self._sized(act, k, out_ids[0])
                                if len(out_ids) == 1 and not answered
                                else [self.replay.shape(i) for i in out_ids])
            act.position += 1
            for i in act.seq.pushes[k]:
                if i not in act.joined:  # else the app holds it by its own id, and fetches it
                    self._push(act.base + i, emit)
            if self._released:
                self._take_released(act)
            free = [act.base + i for i in act.seq.free_after[k] if i in act.dropped]
            if free:
                self._free(free)

    def _runs(self, seq: Compiled, start: int = 0) -> dict[int, Run]:
        """Cut ``seq`` from call ``start`` on into the runs the executor can replay natively
        (``Run``), by first call; none where it has no native loop. An unrolled loop is
        entered at the end of the calls its head ran: building runs over those (a Mask R-CNN
        frame's 700 calls before its paste loop, each frame another unrolling) was a tenth of
        the host's time."""
        make = getattr(self.replay, "batch", None)
        if make is None or not seq.prepared or seq.split:
            return {}
        n = len(seq.definition.calls)
        native = self.replay.batchable  # type: ignore[union-attr]
        ok = [k >= start and self._batchable(seq, k) and (
            native(seq.prepared[k], answered=True) if k in seq.answered
            else native(seq.prepared[k])) for k in range(n)]
        found: dict[int, Run] = {}
        k = start
        while k < n:
            if not ok[k]:
                k += 1
                continue
            start = k
            while k < n and ok[k] and k - start < MAX_RUN:
                k += 1
                if seq.pushes[k - 1]:
                    break  # pushed as soon as made: the app may be waiting for it
            if k - start >= MIN_RUN:
                run = self._run_of(seq, start, k, make)
                if run is not None:
                    found[start] = run
        return found

    @staticmethod
    def _batchable(seq: Compiled, k: int) -> bool:
        """Whether call ``k`` can be part of a native run: nothing of it is per inference but
        its tensors, and it makes only values of this inference (writing one in place, if
        at all, and returning it)."""
        outs = seq.out_local[k]
        return (seq.prepared[k] is not None and k not in seq.robot and k not in seq.symbols
                and k not in seq.merges
                and not seq.mutates[k]
                and bool(outs) and None not in outs
                and all(kind != "upload" or slot not in seq.inputs[k]  # the app's input: waits
                        for slot, _r, kind, _b, _p in seq.binding[k]))

    def _run_of(self, seq: Compiled, start: int, end: int, make: Any) -> Run | None:
        made: dict[int, int] = {}  # local index -> its latest place among the run's values
        outs: list[int] = []  # per value the run makes, its local index (in place: again)
        externals: list[tuple[int, int, int]] = []
        produced_at: dict[int, int] = {}  # local index -> its external index
        sources: list[list[int]] = []
        slots: set[int] = set()
        uploads: dict[int, tuple[ops_pb2.TensorRef, int | None]] = {}
        for k in range(start, end):
            src = []
            for slot, rec, kind, bind, produced in seq.binding[k]:
                slots.add(slot)
                if produced is not None and produced in made:
                    src.append(-(made[produced] + 1))
                elif produced is not None:
                    if produced not in produced_at:
                        produced_at[produced] = len(externals)
                        externals.append((produced, slot, 0))
                    src.append(produced_at[produced])
                elif kind == "upload":  # bytes of the definition (``_batchable``)
                    uploads[len(externals)] = (rec, bind)
                    src.append(len(externals))
                    externals.append((-1, slot, 0))
                else:  # a weight waits to be bound (``inputs``): no recorded id stands in
                    src.append(len(externals))
                    waits = slot in seq.inputs[k]
                    externals.append((-1, slot, rec.id if kind == "id" and not waits else 0))
            sources.append(src)
            for i in seq.out_local[k]:
                made[i] = len(outs)  # type: ignore[index]
                outs.append(i)  # type: ignore[arg-type]
        calls = [seq.prepared[k] for k in range(start, end)]
        # The same decoded calls on the same dataflow (another unrolling's iteration: the
        # same ``_prepared`` forms) are the same run: built and calibrated once, kept
        key = (tuple(map(id, calls)), tuple(map(tuple, sources)), len(externals))
        batch = self._batches.get(key)
        if batch is None:
            batch = make(calls, sources, len(externals))
            if batch is None:
                return None
            if len(self._batches) >= MAX_BATCHES:
                self._batches.pop(next(iter(self._batches)))
            self._batches[key] = batch
        constants = frozenset(s for k in range(start, end) for s in seq.constants_at[k])
        return Run(end, batch, externals, frozenset(slots), constants, outs,
                   [k for k in range(start, end) for _ in seq.out_local[k]],
                   [k for k in range(start, end) if seq.writes[k]],
                   [k - start for k in range(start, end) if k in seq.answered], uploads)

    def _externals(self, act: Active, run: Run
                   ) -> list[int | ops_pb2.TensorRef | tuple[Any, int]] | None:
        """A run's external tensors in this inference, as ``_bind`` finds them: live ids, and
        the definition's uploads (each bound to its id, as the one-by-one path binds it:
        decoded once, ``Run.fixed``, where the executor can); None where one is not there
        (a weight not bound yet, a persistent tensor). What does not depend on the inference
        is worked out once per binding (``Run.found``): yolov8n's 17 runs looked up 320
        weights an inference."""
        found = run.found
        if found is None or found[0] != self.binds:
            found = run.found = (self.binds, self._fixed_externals(act.seq, run))
        fixed = found[1]
        if fixed is None:
            return None
        base = act.base
        ids: list[int | ops_pb2.TensorRef | tuple[Any, int]] = [
            (act.id_of(i) if act.joined else base + i) if f is None else f
            for (i, _slot, _rec), f in zip(run.externals, fixed, strict=True)]
        decode = self._fixed_upload
        for e, (rec, bind) in run.uploads.items():
            decoded = run.fixed.get(e) if decode is not None else None
            if decoded is None and decode is not None:
                decoded = decode(rec)
                if decoded is not None:
                    run.fixed[e] = decoded
            if decoded is not None:
                ids[e] = (decoded, 0 if bind is None else base + bind)
            else:
                ids[e] = rec if bind is None else _with_bind(rec, base + bind)
        return ids

    @staticmethod
    def _fixed_externals(seq: Compiled, run: Run) -> list[int | None] | None:
        """Per external of ``run``, its id if it is a weight or constant (bound, or the
        recorded one), None if it is a value of the inference; None if one has no live id."""
        ids: list[int | None] = []
        for e, (i, slot, recorded) in enumerate(run.externals):
            if i >= 0 or e in run.uploads:  # a value of the inference, or its upload
                if e in run.uploads and seq.bound(slot) is not None:
                    return None  # bound since (``_bind`` prefers that): one by one
                ids.append(None)
                continue
            sticky = seq.bound(slot)
            if sticky is None:
                if not recorded:
                    return None
                ids.append(recorded)
            elif sticky.WhichOneof("ref") == "id":
                ids.append(sticky.id)
            else:
                return None
        return ids

    def _run_native(self, act: Active, run: Run, stop: int, emit: Emit) -> bool:
        """Run ``run`` (starting at ``act.position``) with one native call, then push, take
        releases and free as the one-by-one path does after each call: True if any of its
        calls ran (the rest, if any, run one by one). A value the app released before the run
        and that no later call reads is let go of inside the run, after its last use."""
        seq = act.seq
        if run.end > stop or (act.args and not run.slots.isdisjoint(act.args)) \
                or (seq.gone and not run.constants.isdisjoint(seq.gone)) \
                or (act.joined and not act.joined.keys().isdisjoint(run.outs)):
            return False  # (a joined value the run writes: the app's, one by one)
        ids = self._externals(act, run)
        if ids is None:
            return False
        base = act.base
        k = act.position
        if self._released:
            self._take_released(act)
        drops = []
        if act.dropped:
            last, varying = seq.last_use, seq.varying
            drops = sorted((last[i] - k, v) for v, i in enumerate(run.outs)
                           if i in act.dropped and last.get(i, run.end) < run.end - 1
                           and not (varying and run.made_by[v] in varying))
        copy = [j - k for j in run.writes if not 0 <= act.app_position(j) < act.matched]
        snapshots: list[tuple[int, Any]] = []

        def answer(j: int, result: ops_pb2.OpResult | None) -> float:
            at = act.app_position(k + j) if result is not None else 0
            if at < 0:
                act.held.append((k + j, _copied(result), ()))  # type: ignore[arg-type]
            elif result is not None:
                self._send_shapes(act, emit)
                emit(_answer_frame(base, at, result))
            elif self._pace is not None:  # the time the last answer asked for came
                self._pace.tick()  # type: ignore[attr-defined]
            return self._pace.held() if self._pace is not None else 0.0  # type: ignore[attr-defined]

        done = self.replay.run_batch(  # type: ignore[union-attr]
            run.batch, ids, [base + i for i in run.outs], drops, writes=copy,
            answered=run.answered, on_answer=answer, snapshots=snapshots)
        if not done:
            return False
        act.position = k + done
        for j, token in snapshots:
            act.snapshots.append((k + j, token))
        if run.writes:
            self.snapshots += len(snapshots)
            self.snapshots_skipped += sum(1 for j in run.writes if j < k + done) - len(snapshots)
        if seq.varying:  # for an abort's account, as the one-by-one path keeps them
            for j in range(k, k + done):
                if j in seq.varying:
                    outs = seq.out_local[j]
                    act.sizes[j] = (
                        self._sized(act, j, base + outs[0])
                        if len(outs) == 1 and outs[0] is not None and j not in seq.answered
                        else [self.replay.shape(base + i)  # type: ignore[union-attr,operator]
                              for i in outs])
        for j in range(k, k + done):
            for i in seq.pushes[j]:
                self._push(base + i, emit)
        if self._released:
            self._take_released(act)
        if act.dropped:
            free = [base + i for j in range(k, k + done) for i in seq.free_after[j]
                    if i in act.dropped]
            if free:
                self._free(free)
        return True

    def _unroll(self, act: Active, emit: Emit) -> bool:
        """The head of a sequence with a loop has run: go on with the loop unrolled for this
        inference's count, a size of its own tensor (the shim unrolls the same from the sizes
        it was answered). What the head made keeps its local indices; outputs final before the
        loop are pushed now (a head pushes nothing: the loop may still write them). A loop with
        variants runs every iteration's body first, then the variants its guards chose, read
        here from this host's tensors (``rrtod.loops``). An iteration whose values no variant
        has cuts the unrolling there (``loops.unroll(cut=)``): the iterations before it replay,
        and the app goes on by forwarding from its branch (the shim cuts at the same iteration,
        from the guards pushed; its abort there undoes nothing the app took). False: no such
        size, or a guard with no value (the replay failed, reported)."""
        seq = act.seq
        folded = seq.folded
        assert folded is not None
        i, dim = seq.counted  # type: ignore[misc]
        shape = self.replay.shape(act.id_of(i)) if self.replay is not None else None
        try:
            if shape is None or dim >= len(shape):
                raise ValueError(f"no size {dim} of tensor {act.id_of(i)} counts its loop")
            n = shape[dim]
            variants = bool(folded.loops[0].variants)
            if variants and seq.bodies_of is not None:  # the bodies ran: their guards choose
                u = self._with_variants(seq, self._choices(act, n))  # (fewer: a cut)
            else:
                key: Any = ("bodies", n) if variants else n
                u = seq.unrolled.get(key)
                if u is None:
                    u = self._unrolling(seq, n, None, 0, None, cut=False)
                    if variants:  # the bodies: the guards come next
                        self._bodies_stage(u, seq, n,
                                           folded.loops[0].start + folded.loops[0].body)
                    self._keep_unrolled(seq, key, u)
        except ValueError as exc:
            act.failed = True
            down = _error("REPLAY_FAILED", f"sequence {seq.definition.id}: {exc}",
                          seq.definition.id)
            down.error.base_id, down.error.position = act.base, act.app_failed(act.position)
            emit(down)
            return False
        act.seq = u
        self._push_made(act, act.position, emit)
        self._flush_held(act, emit)  # the bodies' answers and sizes, where they are
        return True

    def _choices(self, act: Active, n: int, upto: int | None = None) -> list[int]:
        """The variants of ``act``'s loop iterations, after its bodies ran (``act.seq`` runs
        them: ``bodies_of``): those it was resumed after (``done``), then each later one's
        up to ``upto`` (all: None) chosen by its guards, read from this host's tensors, up to
        the first whose values no variant has. ValueError where a guard has no value."""
        seq = act.seq
        folded = seq.folded
        assert folded is not None
        where = loops.guard_locals(folded, n, seq.layout)[len(seq.done):upto]
        if any(i < 0 for gs in where for i in gs):
            raise ValueError("a guard of its loop is not a local value")
        return list(seq.done) + loops.choose_known(folded.loops[0], (
            tuple(self._scalar(act, i) for i in gs) for gs in where))

    def _with_variants(self, seq: Compiled, choices: list[int]) -> Compiled:
        """What follows ``seq`` (the bodies it ran, of ``seq.bodies_of`` iterations): a copy of
        them and the variants ``choices`` chose, then the calls after the loop; cut where the
        choices run out. Compiled once per (count, choices, resumed)."""
        folded, n, ordered = seq.folded, seq.bodies_of, len(seq.done)
        assert folded is not None and n is not None
        key = (n, tuple(choices)) if not ordered else (n, tuple(choices), ordered)
        u = seq.unrolled.get(key)
        if u is None:
            u = self._unrolling(seq, n, choices, ordered, seq.definition, cut=True)
            u.app_pos = loops.app_positions(folded, n, choices, ordered)
            u.cut = len(choices) < n
            self._keep_unrolled(seq, key, u)
        return u

    @staticmethod
    def _keep_unrolled(seq: Compiled, key: Any, u: Compiled) -> None:
        if len(seq.unrolled) >= MAX_UNROLLED:
            seq.unrolled.pop(next(iter(seq.unrolled)))
        seq.unrolled[key] = u

    def _push_made(self, act: Active, end: int, emit: Emit) -> None:
        """Push the outputs final after ``act``'s calls from its start up to ``end`` (those
        before its start ran before it; a value the app holds by its own id it fetches)."""
        for k in range(act.start, end):
            for j in act.seq.pushes[k]:
                if j not in act.joined:
                    self._push(act.base + j, emit)

    def _cut_at_failure(self, act: Active, k: int, down: ops_pb2.SessionDown,
                        emit: Emit) -> bool:
        """Call ``k``, of the body of loop iteration ``i``, failed while the host ran every
        body first (a degenerate box: the width the app read is 0, and it resizes to
        ``max(w, 1)`` where the host took the width read). Rather than fail the replay, cut its
        unrolling at ``i`` (``loops.unroll(cut=)``; earlier if an earlier iteration's values
        have no variant), as for values no variant has: run the variants of the iterations
        before it, push the outputs of the calls that ran (the guards the shim reads among
        them), and only then report the failure, at the app's position of call ``k``: the
        app replays up to it and resumes after that iteration (``ReplayClient._resume``).
        False: not such a call (the replay fails as any)."""
        seq = act.seq
        folded = seq.folded
        if seq.bodies_of is None or folded is None or seq.app_upto is None:
            return False
        loop = folded.loops[0]
        first, n, ordered = seq.app_upto - loop.body, seq.bodies_of, len(seq.done)
        if k < first:
            return False  # before the bodies: nothing to cut at
        try:
            u = self._with_variants(seq, self._choices(act, n, ordered + (k - first) // loop.body))
        except ValueError:
            return False
        act.seq, act.position = u, len(seq.definition.calls)  # the calls after ``k``: not run
        self._push_made(act, k, emit)
        self._flush_held(act, emit)
        down.error.position = u.app_pos[k]  # type: ignore[index]
        emit(down)
        return True

    def _flush_held(self, act: Active, emit: Emit) -> None:
        """The bodies' answers and sizes held for their app positions, now that
        ``act.seq`` gives them (``Active.held``)."""
        if act.held and act.seq.app_upto is None:
            held, act.held = act.held, []
            for k, result, dims in held:
                at = act.app_position(k)
                if result is None:
                    act.shapes.append((at, dims))
                else:
                    self._send_shapes(act, emit)
                    emit(_answer_frame(act.base, at, result))

    def _unrolling(self, seq: Compiled, n: int, choices: list[int] | None, ordered: int,
                   bodies: ops_pb2.SequenceDef | None, cut: bool) -> Compiled:
        """``seq``'s loop unrolled ``n`` times (``loops.unroll``, the bodies first where it has
        variants, ``cut`` where the choices run out), compiled on ``seq`` (``bodies``: its
        definition, the bodies it ran), with each call's prepared form and ``seq``'s per-slot
        state."""
        folded = seq.folded
        assert folded is not None
        origins: list[int] = []
        made_from: list[Any] = []
        u = self._compile(loops.unroll(folded, n, origins, choices=choices,
                                       bodies_first=bool(folded.loops[0].variants),
                                       checked=seq.checked, layout=seq.layout, bodies=bodies,
                                       made_from=made_from, ordered=ordered, cut=cut),
                          check=False, prefix=seq,
                          copied=len(bodies.calls) if bodies is not None else 0)
        # The calls it begins with are those ``seq`` ran (the head, or the head and the
        # bodies): their compiled and prepared forms are kept, each compared first (a
        # scattered call's outputs differ with the count).
        done, ready = seq.definition.calls, seq.prepared
        shared = min(u.shared, len(ready))
        u.prepared = ready[:shared] + [
            ready[k] if k < len(done) and k < len(ready) and call == done[k]
            else self._prepared(seq.templates, made_from[k], call)
            for k, call in enumerate(u.definition.calls[shared:], start=shared)]
        u.sticky, u.latest, u.gone = seq.sticky, seq.latest, seq.gone
        root = seq.canon if seq.bodies_of is None else seq.folded_canon
        u.canon = [root[o] if o < len(root) else o for o in origins] \
            if root is not None else origins
        return u

    @staticmethod
    def _bodies_stage(u: Compiled, head: Compiled, n: int, upto: int) -> None:
        """``u`` runs the bodies of ``n`` iterations: at its end the guards are read and the
        replay goes on with the variants they chose (``_unroll``). Its calls from ``upto`` on
        have no app position until then."""
        u.folded, u.counted, u.unrolled, u.bodies_of = head.folded, head.counted, \
            head.unrolled, n
        u.templates, u.layout, u.checked = head.templates, head.layout, head.checked
        u.folded_canon = head.canon
        u.app_upto = upto

    def _resumed(self, seq: Compiled, start: ops_pb2.ReplayStart) -> Compiled:
        """What a start that resumes ``seq``'s loop runs (``ReplayStart.loop_choices``): the
        loop unrolled with the iterations before the one resumed at in the app's order, then
        the later ones' bodies (their guards choose next, ``_unroll``), or, resumed after the
        last iteration, the whole unrolling. ValueError where that cannot be (no loop with
        variants, choices or a position that do not fit it)."""
        folded = seq.folded
        if folded is None or not folded.loops[0].variants or seq.bodies_of is not None \
                or start.plan:
            raise ValueError(f"sequence {start.sequence} has no loop with variants to resume")
        n, done = start.loop_count, list(start.loop_choices)
        if not 0 < len(done) <= n <= loops.MAX_COUNT:
            raise ValueError(f"sequence {start.sequence}: {len(done)} iterations of {n} done")
        if any(not loops.SKIP <= c < len(folded.loops[0].variants) for c in done):
            raise ValueError(f"sequence {start.sequence}: a choice no variant has")
        if start.position != loops.iteration_start(folded, done):
            raise ValueError(f"sequence {start.sequence}: iteration {len(done)} does not begin "
                             f"at call {start.position}")
        key = ("resume", n, tuple(done))
        u = seq.unrolled.get(key)
        if u is None:
            whole = len(done) == n
            u = self._unrolling(seq, n, done, len(done), None, cut=False)
            if not whole:
                self._bodies_stage(u, seq, n, start.position + folded.loops[0].body)
                u.done = tuple(done)
            self._keep_unrolled(seq, key, u)
        return u

    def _scalar(self, act: Active, i: int) -> float:
        """The value of local tensor ``i`` (a guard), as a number; ValueError if it has none."""
        v = self.replay.scalar(act.id_of(i)) if self.replay is not None else None
        if v is None:
            raise ValueError(f"tensor {act.id_of(i)}, a guard of its loop, has no value")
        return float(v)

    def _symbol_values(self, act: Active, k: int,
                       emit: Emit) -> list[tuple[list[Any], int]] | None:
        """This inference's values of call ``k``'s symbolic integers, each with its path. None
        (the replay failed, reported) when a tensor they name is not there."""
        values = []
        for path, i, dim, span in act.seq.symbols[k]:
            if dim == READ_VALUE:
                n = self.replay.scalar(act.id_of(i)) if self.replay is not None else None
            else:
                shape = self.replay.shape(act.id_of(i)) if self.replay is not None else None
                n = (None if shape is None or dim + span > len(shape)
                     else math.prod(shape[dim:dim + span]))
            if n is None:  # this inference's data took another path: the app will not match
                act.failed = True
                what = "the value" if dim == READ_VALUE else f"size {dim}"
                down = _error("REPLAY_FAILED", f"sequence {act.seq.definition.id}, call {k}: "
                              f"no {what} of tensor {act.id_of(i)}", act.seq.definition.id)
                down.error.base_id, down.error.position = act.base, act.app_failed(k)
                emit(down)
                return None
            values.append((path, n))
        return values

    def _constants_released(self, release: ops_pb2.Release) -> None:
        """The app let go of tensors: a sequence call that reads one as its recorded constant
        can no longer be matched by the app (a replacement is a mismatch), so the host must
        not run it ahead of the app either: the tensor is freed, or about to be."""
        seqs = [seq for seqs in (self.sequences, self.retired) for seq in seqs.values()
                if seq.constants]
        if not seqs:
            return
        for i in released_ids(release):
            for seq in seqs:
                for slot in seq.constants.get(i, ()):
                    if slot not in seq.sticky:
                        seq.gone.add(slot)

    def _take_released(self, act: Active) -> None:
        """Values of this inference the app released: free those past their last use in the
        sequence now, the rest right after it."""
        free = []
        n = len(act.seq.local)
        while self._released:
            base, ids = self._released.popleft()
            if base != act.base:
                continue  # another inference's: its release frame frees them in order
            for oid in ids:
                i = oid - base
                if 0 <= i < n:
                    if act.position > act.seq.last_use.get(i, -1):
                        free.append(oid)
                    else:
                        act.dropped.add(i)
        if free:
            self._free(free)

    def _free(self, ids: list[int]) -> None:
        if self._release is not None:
            self._release(ids)
            return
        for _ in self.handle(ops_pb2.SessionUp(release=ops_pb2.Release(ids=ids))):
            pass

    def _push(self, oid: int, emit: Emit) -> None:
        for down in self.handle(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=0, id=oid))):
            if down.WhichOneof("msg") == "fetched":
                down.fetched.id = oid
            emit(down)

    def _bind(self, act: Active, k: int) -> tuple[list[int | ops_pb2.TensorRef], list[int]]:
        """Call ``k`` of this inference: per tensor argument a live id or a ref to resolve
        (an upload, a persistent tensor), and its output ids. Arguments the app sent for this
        inference come first, then weights and constants it rebound, then what was recorded."""
        seq, base = act.seq, act.base
        refs: list[int | ops_pb2.TensorRef] = []
        renamed: dict[int, int] = {}  # a rebound weight/constant: recorded id -> its id now
        for slot, rec, kind, bind, produced in seq.binding[k]:
            given = act.args.get(slot)
            if given is not None:
                if bind is not None and given.WhichOneof("ref") == "upload":
                    given = _with_bind(given, base + bind)  # read again later by id
                refs.append(given)
                continue
            sticky = seq.bound(slot)
            if sticky is not None:
                if sticky.WhichOneof("ref") == "id":
                    if kind == "id":
                        renamed[rec.id] = sticky.id
                    refs.append(sticky.id)
                else:
                    refs.append(sticky)
            elif produced is not None:
                refs.append(act.id_of(produced))
            elif bind is not None:
                refs.append(_with_bind(rec, base + bind))
            else:
                refs.append(rec.id if kind == "id" else rec)
        outs = seq.out_local[k]
        if act.joined or None in outs:
            out_ids = [act.id_of(i) if i is not None else r for i, r in
                       zip(outs, seq.definition.calls[k].out_ids, strict=True)]
        else:  # the common case: every output a value of this inference, at base + index
            out_ids = [base + i for i in outs]
        if renamed:  # written in place and returned: the result is the rebound tensor too
            out_ids = [renamed.get(r, r) for r in out_ids]
        return refs, out_ids

    def _merge(self, act: Active, k: int, refs: list[int | ops_pb2.TensorRef]
               ) -> tuple[list[int], ops_pb2.SessionDown | None]:
        """Put together, for call ``k``, each region value it reads whole: the robot's band
        (the upload in its place) and this host's, by a ``cat`` along the rows through the
        executor like any call, under an id past the inference's values. ``refs`` then name
        the whole values; returns those ids (freed once ``k`` has run), and the error that
        stopped it, if one did."""
        made: list[int] = []
        spare = act.base + len(act.seq.definition.local_ids)
        for n, (j, i) in enumerate(act.seq.merges[k]):
            tid = spare + n
            call = ops_pb2.OpCall(op=lop.MERGE_OP, out_ids=[tid])
            parts = call.args.add().list
            top = refs[j]
            if isinstance(top, int):
                parts.items.add().tensor.id = top
            else:
                parts.items.add().tensor.CopyFrom(top)
            parts.items.add().tensor.id = act.id_of(i)
            call.args.add().i = lop.ROW
            for down in self.handle(ops_pb2.SessionUp(call=call)):
                if down.WhichOneof("msg") == "error":
                    self._free(made)
                    return [], down
            refs[j] = tid
            made.append(tid)
        return made, None

    def _rebind(self, act: Active, k: int, refs: list[int | ops_pb2.TensorRef],
                out_ids: list[int]) -> ops_pb2.OpCall:
        """The recorded call as forwarding would send it for this inference (``_bind``)."""
        call = ops_pb2.OpCall()
        call.CopyFrom(act.seq.definition.calls[k])
        call.seq = 0
        call.sync = False
        call.want_meta = False
        call.out_ids[:] = out_ids
        for ref, value in zip(iter_tensor_refs(call), refs, strict=True):
            if isinstance(value, int):
                ref.Clear()
                ref.id = value
            else:
                ref.CopyFrom(value)
        return call

    def _abort(self, position: int, emit: Emit) -> None:
        act = self.active or self.last
        if act is None:
            return
        self.aborts += 1
        calls = act.seq.definition.calls
        # ``position`` is the app's; the host may run the calls in another order (``app_pos``)
        app = act.seq.app_pos or range(len(calls))
        if self.active is act:  # the app holds proxies of every call before it
            self._advance(emit, limit=max((k + 1 for k, a in enumerate(app) if a < position),
                                          default=0))
        for k, token in reversed(act.snapshots):  # only with a replay extension (``_define``)
            if app[k] >= position:
                self.replay.restore(token)
        fresh = set()
        for k, call in enumerate(calls):
            if app[k] < position:
                fresh.update(call.out_ids)
        drop = []
        for k, call in enumerate(calls[:act.position]):
            if app[k] >= position:
                drop += [act.base + act.seq.local[r] for r in call.out_ids
                         if r in act.seq.local and r not in fresh]
        if drop:
            list(self.handle(ops_pb2.SessionUp(release=ops_pb2.Release(ids=drop))))
        self._close(act)
        if position > act.start:  # the robot's log has not seen these calls
            self._account(act, position, emit)

    @staticmethod
    def _account(act: Active, position: int, emit: Emit) -> None:
        """Tell the robot what the app's calls ``act.start .. position - 1`` of ``act`` made
        (``ReplayedPrefix``): they go into its log as forwarded calls would have, so that an
        inference that left its sequence is in the log whole (an aborted replay's calls, and a
        resumed one's, after the branch the app forwarded)."""
        app = act.seq.app_pos or range(len(act.seq.definition.calls))
        emit(ops_pb2.SessionDown(replayed=ops_pb2.ReplayedPrefix(
            base_id=act.base, start=act.start,
            calls=[ops_pb2.OutSizes(outs=[ops_pb2.Sizes(dims=s, known=True) if s is not None
                                          else ops_pb2.Sizes() for s in act.sizes.get(k, ())])
                   for k in _host_positions(app, act.start, position)])))



_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux


def _minor_faults() -> int:
    """This thread's minor page faults so far (0 where the kernel does not count per thread)."""
    return resource.getrusage(_RUSAGE_THREAD).ru_minflt if _RUSAGE_THREAD is not None else 0


def _host_positions(app: Any, start: int, end: int) -> list[int]:
    """The host's positions of the app's calls ``start .. end - 1`` (those it has)."""
    where = {a: k for k, a in enumerate(app)}
    return [where[a] for a in range(start, end) if a in where]


def _bad_join(seq: Compiled, start: ops_pb2.ReplayStart) -> str | None:
    """Why a start that joins an inference under way cannot be run, or None. Only the shape of
    the request is checked: the ids it names are looked up in the session's own tensors, as any
    forwarded call's are (an unknown one fails that call)."""
    n, calls = len(seq.local), len(seq.definition.calls)
    if start.position >= calls:
        return (f"sequence {start.sequence} has {calls} calls: cannot join at call "
                f"{start.position}")
    if any(i >= n for i in start.joined):
        return f"sequence {start.sequence}: a joined value is not one of its {n} local values"
    return None


def _put_int(call: ops_pb2.OpCall, path: list[Any], n: int) -> None:
    """Set the integer at ``path`` of ``call``'s arguments (a symbolic integer's value)."""
    v = call.kwargs[path[0]] if isinstance(path[0], str) else call.args[path[0]]
    for j in path[1:]:
        v = getattr(v, v.WhichOneof("kind")).items[j]
    v.i = n


def _with_bind(ref: ops_pb2.TensorRef, bind_id: int) -> ops_pb2.TensorRef:
    out = ops_pb2.TensorRef()
    out.CopyFrom(ref)
    out.bind_id = bind_id
    return out


def _copied(result: ops_pb2.OpResult) -> ops_pb2.OpResult:
    out = ops_pb2.OpResult()
    out.CopyFrom(result)
    return out


def _answer_frame(base: int, position: int, result: ops_pb2.OpResult) -> ops_pb2.SessionDown:
    """The app's answer to replayed call ``position`` of inference ``base``, built in place:
    ``result`` is copied once, not into a ``ReplayAnswer`` and that into the frame."""
    down = ops_pb2.SessionDown()
    answer = down.answer
    answer.base_id, answer.position = base, position
    answer.result.CopyFrom(result)
    return down


def _error(code: str, message: str, sequence: int = 0) -> ops_pb2.SessionDown:
    return ops_pb2.SessionDown(error=ops_pb2.Error(code=code, message=message, sequence=sequence))
