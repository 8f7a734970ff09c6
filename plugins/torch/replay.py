"""The shim's half of replay: match the app's calls against a verified sequence, answer them
locally, and make the GPU host replay the whole inference from one start message.

A call matches position ``k`` of the sequence when it is the same operator overload under the
same grad mode, with equal non-tensor arguments, and every tensor argument comes from where the
sequence says: the output of an earlier call of this inference (by identity), the same weight
(by content hash), the very constant recorded (another tensor in its place is a mismatch: the
host replays ahead of this matching, so it cannot be told of a replacement in time), or plain
app data with the recorded metadata (an input, streamed to the host as it appears). A matching
call gets proxies at once, with the metadata recorded for it, and no message. Anything else is
a mismatch: the host is told the position, keeps what came before and drops the rest, and the
call is forwarded as usual.

Sizes that follow the data (a detector's boxes above a threshold, ``rrtod.robot.shapes``): a
call whose output shapes only the data decides, or that returns a value (``item()``,
``bool(t)``), is answered by the host (``ReplayAnswer``), which runs ahead of the app; the app
waits only if it gets there first. An integer argument the sequence names as a size of this
inference's tensors (``SymbolicInt``) matches only if it is that size now. From the sequence's
``varies_from`` on, each call's outputs are worked out from its arguments every time (a cache
lookup per argument signature) instead of once.

A sequence that arrives while its thread is in the middle of an inference joins it
(``_join``): the calls forwarded since the last download are mapped onto the sequence's first
calls, and the host replays the rest from the values they made.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from time import perf_counter_ns, thread_time_ns
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from rrto.v1 import ops_pb2
from rrtod import gcfreeze, loops, lop, partition
from rrtod.switches import SwitchError, flag
from rrtod.wire import (
    HOST_ID_BASE,
    READ_VALUE,
    REPLAY_BASE,
    SPAN,
    final_writes_of,
    int_of,
    iter_tensor_refs,
    scalar_of,
)

from . import aliasing, codec, downloads, hotpath, rows
from .allowlist import lookup
from .errors import HostLost
from .metadata import OpInfo, Out, arg_at, materialize
from .proxy import Handle, RemoteTensor, new_proxy
from .recorded import TENSOR as _T
from .recorded import Placeholder as _Placeholder
from .recorded import is_plain as _plain
from .recorded import same_plain as _same_plain
from .recorded import strip as _strip
from .session_api import Session
from .sizing import flatten_tensors as sizing_flatten

SRC = ops_pb2.SeqSource
# Source kinds as plain ints: ``SRC.PRODUCED`` is a Python-level enum lookup on every use.
_PRODUCED, _INPUT, _PERSISTENT = SRC.PRODUCED, SRC.INPUT, SRC.PERSISTENT
MISS = object()  # dispatch: not answered by replay, forward it

# Consecutive mismatches before a sequence is dropped (its control flow keeps changing: record
# again). Not fewer: an inference that branches off it is recorded as a variant next to it
# (``ReplayedPrefix``), which takes a few inferences of that branch to be found.
GIVE_UP_AFTER = 8
# Forwarded calls a thread keeps since its last download, for a sequence that arrives during
# the inference to join it (``ReplayClient._join``); an inference longer than this is not joined.
MAX_TAIL = 8192
MAX_TAIL_BYTES = 64 << 20  # nor one whose forwarded frames (uploads included) exceed this
JOIN_TRIES = 4  # places in the kept calls where the inference under way may have begun
MAX_PER_THREAD = 8  # sequences a thread keeps (variants: other input shapes, models, branches)
RELEASE_EARLY_AT = 32  # released values worth a frame of their own while waiting for a push
RELEASE_STREAM_AT = 64  # ... and while the app runs ahead of the host (``_advance``)
# The longest an inference start waits for a search (``SearchHint``): the robot's
# ``record.search_wait`` bounds it (at most this); a guard against a robot's wrong value.
SEARCH_WAIT_MAX_S = 10.0
# How long an inference start waits for the robot's answer to the mark of an inference that
# left its replay (``InferenceMark.left_replay``): a write and a reply on the unix socket,
# ~1 ms; a robot busy elsewhere is not waited for past this.
MARK_ANSWER_S = 0.05
PROFILED = 3  # inferences of each plan whose robot steps are timed (``SequenceProfile``)
# Pushed sizes kept (``ReplaySizes``): inferences, and calls of each (beyond: planned here)
SIZED_INFERENCES = 16
SIZED_CALLS = 1 << 16
RETRY_PALETTE = 64  # uploads of an input slot between tries of a palette that did not fit


class _Unreplayable(Exception):
    pass


def _meta_key(m: ops_pb2.TensorMeta) -> tuple[Any, ...]:
    return (codec.dtype_of(m.dtype), tuple(m.shape), tuple(m.stride), m.storage_offset)


def _upload_key(m: ops_pb2.TensorMeta) -> tuple[Any, ...]:
    """An upload travels C-contiguous; its recorded metadata names dtype and shape."""
    return (codec.dtype_of(m.dtype), tuple(m.shape))


def _input_key(t: torch.Tensor) -> tuple[Any, ...]:
    """The live counterpart of ``_upload_key`` (any strides: it is uploaded C-contiguous, and
    the outputs' layout is the recorded one, see ``ReplayClient._plan``)."""
    return (t.dtype, tuple(t.shape))


# One new tensor of a replayed step's result, as its proxy is made: (local index, shape,
# stride, offset, dtype); its id is the inference's base + local index. A plain tuple: it is
# unpacked per replayed operator, and only an exact tuple unpacks on CPython's fast path.
NewOutput = tuple[int, tuple[int, ...], tuple[int, ...], int, torch.dtype]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """How a replayed step's result is made, worked out at its first replay (``_plan``).

    Read per replayed operator: a slotted dataclass reads its fields as fast as a tuple's
    items; a NamedTuple's attribute reads cost more on CPython 3.11."""

    template: Any  # the result's structure, ``metadata.Out`` for each tensor output
    outs: list[Out]
    plan: list[int | None]  # per output: local index of its new id, None: the argument itself
    device: torch.device  # the device the app sees the outputs on
    single: NewOutput | None  # the result is this one new tensor (the common case)
    multi: tuple[NewOutput, ...] | None  # the result is a tuple of these new tensors


@dataclass
class Step:
    op: str
    grad_mode: int
    args: Any
    kwargs: dict[str, Any]
    slots: list[int]  # indices into the sequence's sources, in argument order
    out_local: list[int | None]  # per output id: local index (None: not local, keep id)
    input_keys: dict[int, tuple[Any, ...]]  # slot -> recorded metadata of an INPUT
    out_meta: list[tuple[Any, ...]]  # recorded layout of each output
    # per tensor argument: (slot, source kind, local index / weight hash / constant id)
    checks: list[tuple[int, int, Any]] = field(default_factory=list)
    # flat positional arguments only: (count, tensor positions, per other argument: position,
    # recorded value, its type, and for a list or tuple its items' types)
    flat: tuple[int, tuple[int, ...], tuple[tuple[int, Any, type, tuple[type, ...] | None],
                                            ...]] | None = None
    built: StepPlan | None = None  # once known (the step's first replay)
    # A variable step whose result is one new C-contiguous tensor (offset 0): (its local
    # index, dtype, device, rank), made from the sizes the host pushes (``ReplaySizes``)
    dense: tuple[int, torch.dtype, torch.device, int] | None = None
    answered: bool = False  # its outputs' shapes are the host's answer (``ReplayAnswer``)
    variable: bool = False  # its shapes may differ each inference: planned every time
    # symbolic integers: (path into the stripped arguments, local index of the tensor, first
    # dimension (``READ_VALUE``: its value, as the app read it), number of dimensions whose
    # sizes multiply)
    syms: list[tuple[tuple[Any, ...], int, int, int]] = field(default_factory=list)
    any_shape: frozenset[int] = frozenset()  # INPUT slots of any shape (dtype and rank fixed)
    # INPUT slots with fixed bytes (``SeqSource.fixed``): slot -> (bytes, upload strides);
    # None: bytes nothing matches (``_fixed_bytes``)
    fixed: dict[int, tuple[bytes | None, tuple[int, ...]]] = field(default_factory=dict)
    # everything the step matches and makes, comparable across sequences (``same_prefix``)
    sig: tuple[Any, ...] = ()
    robot: bool = False  # run here, on the app's tensors (its plan's ``Plan.robot_calls``)
    # A Hybrid-Parallel split region's call (``rrtod.lop``): its row rule, the rows this
    # robot makes of its outputs, ``[0, top)``, and the first the host makes (``robot`` set)
    band: tuple[Any, int, int] | None = None
    # INPUT slots whose data goes up as a band of its rows ``[lo, hi)``: the host's band of an
    # app input a region call reads, the robot's of a region value a host call reads whole
    bands: dict[int, tuple[int, int]] = field(default_factory=dict)

    def signature(self) -> tuple[Any, ...]:
        return (self.op, self.grad_mode, repr(self.args), repr(sorted(self.kwargs.items())),
                tuple(self.checks), tuple(self.out_local), tuple(sorted(self.input_keys.items())),
                tuple(self.out_meta), self.answered, repr(self.syms), tuple(sorted(self.any_shape)),
                tuple(sorted((s, d) for s, (d, _) in self.fixed.items())), self.robot)


@dataclass
class Sequence:
    definition: ops_pb2.SequenceDef
    steps: list[Step]
    local: dict[int, int]
    last_writer: dict[int, int]  # output local index -> position of the call that finalises it
    outputs: set[int]
    # weight slot -> the weight the host uses there now (held, so its id stays live)
    bindings: dict[int, Handle] = field(default_factory=dict)
    # INPUT slot -> the data last uploaded for it, as the host keeps it (``ReplayArg.same_as``),
    # and per input metadata the slot uploaded with it last
    sent: dict[int, tuple[tuple[Any, ...], bytes]] = field(default_factory=dict)  # slot -> latest
    recent: dict[tuple[Any, ...], int] = field(default_factory=dict)
    # INPUT slot -> uploads left before a palette is tried for it again (``codes``)
    uncoded: dict[int, int] = field(default_factory=dict)
    mismatches: int = 0
    failed: bool = False  # the host could not replay it
    stale: bool = False  # a fixed input got other bytes: given up at the mismatch
    fresh: bool = True  # not looked at by its thread yet: it may join the inference under way
    sized: frozenset[int] = frozenset()  # local indices whose sizes symbolic integers use
    valued: frozenset[int] = frozenset()  # local indices whose values they use (read by the app)
    chain: list[int] = field(default_factory=list)  # per step: a hash of the steps up to it
    # A definition with loops (``rrtod.loops``): ``steps`` are its head's, ``counted`` the
    # (local index, dimension) of the size that counts its first loop; at the head's end the
    # inference goes on with ``unrolled[count]``, which shares this one's per-slot state.
    folded: ops_pb2.SequenceDef | None = None
    counted: tuple[int, int] | None = None
    layout: loops.Layout | None = None  # ``folded``'s, for each unrolling
    checked: bool = False  # ``folded`` passed ``loops.check`` (not one unrolled from it)
    # (a loop with variants: ``unrolled[(count, choices)]``; ``guards[count]``, the local
    # indices of each iteration's guards, whose values the host pushes: ``_guard_indices``)
    unrolled: dict[Any, Sequence] = field(default_factory=dict)
    guards: dict[int, list[list[int]]] = field(default_factory=dict)
    root: Sequence | None = None  # the sequence an unrolled one was made from
    # Unrolled up to an iteration whose values no variant has (``loops.unroll(cut=)``): the
    # inference leaves its sequence where this one ends (a mismatch there, never an end), and
    # may resume it at the next iteration (``ReplayClient._resume``).
    cut: bool = False
    count: int = 0  # unrolled: its loop's count, and the variant of each iteration
    choices: tuple[int, ...] | None = None
    # Unrolled: per slot, the slot of the defined sequence it comes from, under which a weight
    # is bound (``bindings``, shared with it; the host does the same); None: its own slots.
    canon: list[int] | None = None
    later: frozenset[int] = frozenset()  # head values the calls past the head read (joins)
    robot_reads: frozenset[int] = frozenset()  # host values robot steps read (pushed)
    # Placements (``SequenceDef.plans``): per plan its compiled rewrite (``root`` is this one,
    # whose per-slot state it shares), the one the next inferences run (0: none), and for a
    # plan its number and the robot steps' times of its first replays (``SequenceProfile``).
    plans: list[Sequence] = field(default_factory=list)
    current: int = 0
    plan: int = 0
    base: bytes = b""
    profile_ns: list[int] = field(default_factory=list)
    profiled: int = 0
    here: bool = False  # a plan with every call on the robot: its inferences may run unseen
    # per call: the ids it writes in place and its outputs view (``final_writes``), kept for
    # an unrolling that begins with its calls (``_shared``)
    written_of: list[list[int]] = field(default_factory=list)
    viewed_of: list[list[int]] = field(default_factory=list)
    # per step, its hot path description (``hotpath.Fast``) once it has one; False: none
    fast: list[Any] = field(default_factory=list)

    @property
    def host_failed(self) -> bool:
        """The host could not replay it (``failed``, kept on the sequence it was unrolled from)."""
        return (self.root or self).failed

    def same_prefix(self, other: Sequence, p: int) -> bool:
        """Whether this sequence's first ``p`` steps are exactly ``other``'s: the same calls
        from the same sources, making the same local values (so an inference that ran them
        under one holds what the other's would)."""
        return (p <= len(self.steps) and p <= len(other.steps)
                and self.chain[p - 1] == other.chain[p - 1]
                and all(a.sig == b.sig for a, b in zip(self.steps[:p], other.steps[:p],
                                                        strict=True)))

    @property
    def id(self) -> int:
        return self.definition.id

    def codes(self, slot: int) -> bool:
        """Whether to try a palette for this upload of INPUT ``slot`` (``codec.palette_of``).
        Data that was not on one (float data; a dtype or size never coded) is tried again
        only every ``RETRY_PALETTE`` uploads: the try's passes cost ~0.4 ms for a 128x128
        frame here, on every replayed inference of a model fed such data."""
        left = self.uncoded.get(slot, 0)
        if left:
            self.uncoded[slot] = left - 1
        return not left

    def coded(self, slot: int, fitted: bool) -> None:
        """The upload of ``slot`` was tried for a palette (``codes``) and ``fitted`` one, or
        not."""
        if not fitted:
            self.uncoded[slot] = RETRY_PALETTE

    def repeat_of(self, slot: int, key: tuple[Any, ...], raw: memoryview) -> int | None:
        """An INPUT slot whose latest data is exactly ``raw`` (with metadata ``key``): ``slot``
        itself (an input that did not change since the last inference), else the slot last
        sent with the same metadata (one tensor read by two calls). None: it must be sent."""
        for s in (slot, self.recent.get(key)):
            prev = self.sent.get(s) if s is not None else None
            # ``bytes == memoryview`` compares item by item in Python's buffer protocol (8 ms
            # for a 4.9 MB frame that did not change); ``startswith`` of the same length is
            # one memcmp (0.1 ms).
            if prev is not None and prev[0] == key and len(prev[1]) == len(raw) \
                    and prev[1].startswith(raw):
                return s
        return None


def _written_ids(call: ops_pb2.OpCall) -> list[int]:
    op = lookup(call.op)
    return aliasing.written_ids(op, call) if op is not None else []


def _viewed_ids(call: ops_pb2.OpCall) -> list[int]:
    op = lookup(call.op)
    return aliasing.viewed_ids(op, call) if op is not None else [0] * len(call.out_ids)


def compile_sequence(d: ops_pb2.SequenceDef, check: bool = True,
                     prefix: Sequence | None = None) -> Sequence:
    """The shim's form of a definition; one with loops compiles to its head, with what it needs
    to unroll at the head's end (``ReplayClient._unroll``). Its loops are checked
    (``loops.check``) unless ``check`` is False: an unrolling of a definition checked so.
    ``prefix``: the head an unrolling begins with, whose steps it shares (``_shared``)."""
    if not d.loops:
        seq = _compile(d, prefix=prefix)
        seq.base = partition.without_plans(d)
        add_plans(seq, d)
        return seq
    if d.plans:
        raise ValueError(f"sequence {d.id} has loops and plans")
    if check:
        loops.check(d)
    seq = _compile(loops.head(d), prefix=prefix)
    seq.folded, seq.counted, seq.checked = d, loops.counted_by(d), check
    seq.layout = loops.layout_of(d)
    seq.later = _read_later(d)
    seq.sized = seq.sized | {seq.counted[0]}  # type: ignore[index]
    return seq


def add_plans(seq: Sequence, d: ops_pb2.SequenceDef) -> None:
    """Compile the plans of ``d`` that ``seq`` (compiled from it, or from a definition with
    fewer plans) does not have yet, sharing its per-slot state, and take ``d``'s current
    plan. ValueError if a plan is not one ``d`` can run."""
    for k in range(len(seq.plans) + 1, len(d.plans) + 1):
        robot = partition.plan_calls(d, k)
        split = partition.plan_split(d, k)
        bands = lop.Space(d, rows.rule).bands_of(split.calls, split.at) if split else None
        plan = _compile(partition.rewrite(d, robot, frozenset(split.calls) if split
                                          else frozenset()), robot, bands, d)
        plan.bindings, plan.sent, plan.recent = seq.bindings, seq.sent, seq.recent
        plan.root, plan.plan = seq, k
        plan.here = bool(plan.steps) and all(st.robot and st.band is None for st in plan.steps)
        seq.plans.append(plan)
    if d.plan > len(seq.plans):
        raise ValueError(f"sequence {d.id} has no plan {d.plan}")
    seq.current = d.plan



# Counts a sequence keeps unrolled (each one's steps, planned at their first replay).
MAX_UNROLLED = 64


def _unrolled(seq: Sequence, count: int, choices: list[int] | None = None) -> Sequence:
    """``seq`` (a head) with its loop run ``count`` times (with ``choices``, the variant of each
    iteration), compiled once per count (and choices); it shares ``seq``'s per-slot state (the
    head's slots are its first ones; a weight past the head is bound under the recorded slot
    it comes from: ``canon``). ValueError if it cannot be unrolled."""
    key = count if choices is None else (count, tuple(choices))
    got = seq.unrolled.get(key)
    if got is not None:
        return got
    assert seq.folded is not None
    origins: list[int] = []
    u = compile_sequence(loops.unroll(seq.folded, count, origins, choices=choices,
                                      checked=seq.checked, layout=seq.layout,
                                      cut=choices is not None),
                         check=False, prefix=seq)
    u.cut = choices is not None and len(choices) < count
    u.count, u.choices = count, tuple(choices) if choices is not None else None
    u.bindings, u.sent, u.recent = seq.bindings, seq.sent, seq.recent
    u.canon = [seq.canon[o] if o < len(seq.canon) else o for o in origins] \
        if seq.canon is not None else origins
    u.root = seq.root or seq
    if len(seq.unrolled) >= MAX_UNROLLED:
        seq.unrolled.pop(next(iter(seq.unrolled)))
    seq.unrolled[key] = u
    return u


def _guard_indices(seq: Sequence, count: int) -> list[list[int]]:
    """Per iteration of ``seq``'s loop (one with variants) run ``count`` times, the local
    indices of its guards: the same in every unrolling (``rrtod.loops``)."""
    got = seq.guards.get(count)
    if got is None:
        assert seq.folded is not None
        got = loops.guard_locals(seq.folded, count)
        if any(i < 0 for gs in got for i in gs):
            raise ValueError("a guard is not a local value")
        if len(seq.guards) >= MAX_UNROLLED:
            seq.guards.pop(next(iter(seq.guards)))
        seq.guards[count] = got
    return got


def _palette_switch() -> bool:
    """``RRTO_PALETTE`` (default on); a value that is not a boolean is said and ignored."""
    try:
        return flag("RRTO_PALETTE", True)
    except SwitchError as exc:
        warnings.warn(f"{exc}: ignored", stacklevel=2)
        return True


def _fixed_bytes(upload: ops_pb2.TensorData) -> bytes | None:
    """The raw bytes a fixed input must have (``SeqSource.fixed``). A definition found in a
    log with replays that were cut holds their uploads as sent, palette-coded perhaps: decoded
    here, since the app's tensor is compared raw (None, which nothing matches, if it does not
    decode)."""
    if not upload.palette:
        return bytes(upload.data)
    try:
        return bytes(codec.raw_bytes(codec.from_tensor_data(upload)))
    except codec.CodecError:
        return None


def _shared(d: ops_pb2.SequenceDef, prefix: Sequence) -> int:
    """How many first calls of ``d`` are ``prefix``'s own steps (``loops.shared_calls``,
    with the same symbolic integers). Compiling an unrolling's head steps again for every
    count and choice of variants was half of what a Mask R-CNN frame cost the shim (and
    their plans were worked out again at their next replay)."""
    p = prefix.definition
    if p.loops or prefix.plans or prefix.root is not None or any(st.robot for st in prefix.steps):
        return 0
    shared = loops.shared_calls(d, p, [len(st.slots) for st in prefix.steps],
                                [st.out_local for st in prefix.steps])
    if [s for s in d.symbols if s.call < shared] != [s for s in p.symbols if s.call < shared]:
        return 0
    return shared


def _compile(d: ops_pb2.SequenceDef, robot: frozenset[int] = frozenset(),
             bands: lop.Bands | None = None, whole: ops_pb2.SequenceDef | None = None,
             prefix: Sequence | None = None) -> Sequence:
    """``d`` (a plan's rewrite of ``whole`` when placed) as the shim matches it. ``robot``:
    the calls it runs here; ``bands``: a Hybrid-Parallel split's, whose region's calls it runs
    here too, each on its band of rows (``Step.band``, ``Step.bands``). ``prefix``: a
    sequence ``d`` may begin with, whose steps it takes as they are (``_shared``)."""
    local = {rid: i for i, rid in enumerate(d.local_ids)}
    region = frozenset(bands.region.calls) if bands is not None else frozenset()
    robot = robot | region
    made_by: dict[int, int] = {}
    shared = _shared(d, prefix) if prefix is not None and not robot else 0
    steps, slot = [], 0
    for k in range(shared):  # (``variable`` follows ``d``'s own ``varies_from``)
        st = prefix.steps[k]  # type: ignore[union-attr]
        variable = d.HasField("varies_from") and k >= d.varies_from
        steps.append(st if st.variable == variable else replace(st, variable=variable, built=None,
                                                                    dense=None))
        slot += len(st.slots)
    for call in d.calls[shared:]:
        def keep(ref: ops_pb2.TensorRef) -> _Placeholder:
            return _Placeholder(ref)
        args = [codec.decode_value(v, keep, torch.device) for v in call.args]
        kwargs = {k: codec.decode_value(call.kwargs[k], keep, torch.device)
                  for k in sorted(call.kwargs)}
        found: list[Any] = []
        sargs = _strip(args, found)
        skw = {k: _strip(v, found) for k, v in kwargs.items()}
        refs = list(iter_tensor_refs(call))
        slots = list(range(slot, slot + len(refs)))
        slot += len(refs)
        input_keys = {s: _upload_key(r.upload.meta) for s, r in zip(slots, refs, strict=True)
                      if d.sources[s].kind == _INPUT and r.WhichOneof("ref") == "upload"}
        step = Step(call.op, call.grad_mode, sargs, skw, slots,
                    [local.get(r) for r in call.out_ids], input_keys,
                    [_meta_key(m) for m in call.out_meta])
        for s in slots:
            src = d.sources[s]
            aux = (local[src.id] if src.kind == _PRODUCED else bytes(src.hash)
                   if src.kind == _PERSISTENT else src.id)
            step.checks.append((s, src.kind, aux))
        step.answered = call.want_meta
        step.robot = len(steps) in robot
        step.variable = d.HasField("varies_from") and len(steps) >= d.varies_from
        step.any_shape = frozenset(s for s in slots if d.sources[s].any_shape)
        step.fixed = {s: (_fixed_bytes(r.upload), tuple(r.upload.meta.stride))
                      for s, r in zip(slots, refs, strict=True)
                      if d.sources[s].fixed and r.WhichOneof("ref") == "upload"}
        if not skw and not step.any_shape and all(a is _T or _plain(a) for a in sargs):
            step.flat = (len(sargs), tuple(i for i, a in enumerate(sargs) if a is _T),
                         tuple((i, a, type(a), tuple(map(type, a))
                                if isinstance(a, (list, tuple)) else None)
                               for i, a in enumerate(sargs) if a is not _T))
        steps.append(step)
        if robot:  # which step makes each value (an output, or an upload bound to it)
            for rid in (*call.out_ids, *(r.bind_id for r in refs if r.WhichOneof("ref") == "upload")):
                if rid in local:
                    made_by.setdefault(local[rid], len(steps) - 1)
    for sym in d.symbols:
        if sym.call >= len(steps) or sym.tensor not in local:
            raise ValueError(f"sequence {d.id}: a symbolic integer names no call or tensor")
        if sym.call < shared:
            continue  # the prefix's step has it
        step = steps[sym.call]
        step.syms.append(((sym.kwarg or sym.arg, *sym.items), local[sym.tensor],
                          READ_VALUE if sym.value else sym.dim,
                          0 if sym.value else max(sym.span, 1)))
        step.flat = None  # matched against this inference's sizes: the general path
    outputs = {local[o] for o in d.outputs}
    # as the host pushes them: once nothing writes their storage any more
    written_of = [prefix.written_of[k] if k < shared else _written_ids(call)  # type: ignore
                  for k, call in enumerate(d.calls)]
    viewed_of = [prefix.viewed_of[k] if k < shared else _viewed_ids(call)  # type: ignore
                 for k, call in enumerate(d.calls)]
    last_writer = final_writes_of(d, written_of, viewed_of)
    chain = list(prefix.chain[:shared]) if shared else []  # type: ignore[union-attr]
    h = chain[-1] if chain else 0
    for st in steps[shared:]:
        st.sig = st.signature()
        h = hash((h, st.sig))
        chain.append(h)
    robot_reads = frozenset(aux for k, st in enumerate(steps) if st.robot
                            for _s, kind, aux in st.checks
                            if kind == _PRODUCED and (not steps[made_by.get(aux, 0)].robot or (
                                k not in region and made_by.get(aux) in region)))
    if bands is not None and whole is not None:
        _add_bands(steps, bands, whole, local)
    return Sequence(d, steps, local, last_writer, outputs, robot_reads=robot_reads,
                    sized=frozenset(i for st in steps for _p, i, d, _n in st.syms
                                    if d != READ_VALUE),
                    valued=frozenset(i for st in steps for _p, i, d, _n in st.syms
                                     if d == READ_VALUE), chain=chain,
                    written_of=written_of, viewed_of=viewed_of)


def _add_bands(steps: list[Step], bands: lop.Bands, whole: ops_pb2.SequenceDef,
               local: dict[int, int]) -> None:
    """What a split adds to the steps: each region call's rule and the robot's rows of it,
    and which uploads go up as a band: the host's rows of the app inputs region calls read
    (when the host makes any rows of that call), the robot's of a region value a host call
    outside the region reads whole (``lop.merges``: the host puts it together)."""
    inputs = set(bands.region.inputs)
    slot = 0
    for k, call in enumerate(whole.calls):
        refs = list(iter_tensor_refs(call))
        step = steps[k]
        if k in bands.rules:
            step.band = (bands.rules[k], bands.robot[k], bands.host[k])
            if bands.host[k] < bands.height[k]:
                for j, ref in enumerate(refs):
                    src = whole.sources[slot + j]
                    i = local.get(ref.bind_id, -1 - (slot + j)) \
                        if src.kind == _INPUT and ref.WhichOneof("ref") == "upload" else None
                    if i in inputs:
                        height = bands.height_of[i]
                        step.bands[slot + j] = (bands.held[i][1], height)
        slot += len(refs)
    for k, pairs in lop.merges(whole, bands, frozenset(
            j for j, st in enumerate(steps) if st.robot and j not in bands.rules)).items():
        for j, i in pairs:
            steps[k].bands[steps[k].slots[j]] = (0, bands.held[i][1])


@dataclass
class Active:
    seq: Sequence
    base: int
    position: int = 0
    sizes: dict[int, tuple[int, ...]] = field(default_factory=dict)  # ``Sequence.sized`` now
    values: dict[int, int] = field(default_factory=dict)  # ``Sequence.valued`` as the app read
    # joined under way: local index -> the id the app already holds it under (forwarded)
    joined: dict[int, int] | None = None
    pulled: dict[int, torch.Tensor] = field(default_factory=dict)  # host values robot steps read
    taken: dict[int, ops_pb2.TensorData] = field(default_factory=dict)  # ...the app took first
    timing: list[int] | None = None  # per step, the robot's time running it (profiled)

    def id_of(self, i: int) -> int:
        return self.joined.get(i, self.base + i) if self.joined else self.base + i


def act_robot_reads(act: Active | None) -> frozenset[int]:
    return act.seq.robot_reads if act is not None else frozenset()


def _with_sizes(step: Step, act: Active) -> tuple[list[Any], dict[str, Any]] | None:
    """The step's stripped arguments with its symbolic integers set to this inference's
    sizes; None if a size is not known (its tensor was not made by this replay)."""
    args, kwargs = list(step.args), dict(step.kwargs)
    for path, i, dim, span in step.syms:
        if dim == READ_VALUE:
            n = act.values.get(i)
            if n is None:
                return None  # the app did not read it: its integer came from elsewhere
        else:
            shape = act.sizes.get(i)
            if shape is None or dim + span > len(shape):
                return None
            n = math.prod(shape[dim:dim + span])
        top, *items = path
        where: Any = kwargs if isinstance(top, str) else args
        where[top] = _put(where[top], items, n)
    return args, kwargs


def _wanted(step: Step, act: Active) -> tuple[Any, dict[str, Any]] | None:
    """The stripped arguments a call must have to be ``step`` in this inference (its symbolic
    integers set to this inference's sizes); None if a size is not known."""
    return _with_sizes(step, act) if step.syms else (step.args, step.kwargs)


def _put(x: Any, items: list[int], value: int) -> Any:
    """``x`` (a stripped argument) with the integer at ``items`` replaced by ``value``."""
    if not items:
        return value
    if not isinstance(x, (list, tuple)) or items[0] >= len(x):
        return x  # not the recorded structure: the comparison fails anyway
    out = list(x)
    out[items[0]] = _put(x[items[0]], items[1:], value)
    return type(x)(out)


def _resume_point(act: Active) -> tuple[Active, tuple[int, ...]] | None:
    """Where an inference that left its unrolled loop with variants at ``act.position`` may
    resume (``ReplayClient._resume``): ``act`` and the choices of the iterations up to the one
    it left, that one ``SKIP`` (the app runs the rest of it by forwarding). None: it left
    before the loop or after it."""
    seq = act.seq
    root = seq.root
    if seq.choices is None or root is None or root.folded is None:
        return None
    loop = root.folded.loops[0]
    at = loop.start
    if act.position < at:
        return None
    for k, c in enumerate(seq.choices):
        at += loop.body + (len(loop.variants[c].calls) if c != loops.SKIP else 0)
        if act.position < at:
            return act, (*seq.choices[:k], loops.SKIP)
    if seq.cut:  # in (or at the end of) the body of the iteration it is cut at
        return act, (*seq.choices, loops.SKIP)
    return None


def _read_after(seq: Sequence, p: int, joined: dict[int, int] | None) -> dict[int, int]:
    """The part of ``joined`` the host needs: values that steps from ``p`` on read, or whose
    sizes they use (the shim keeps all of it, to match those steps)."""
    if not joined:
        return {}
    used = {aux for st in seq.steps[p:] for _s, kind, aux in st.checks if kind == _PRODUCED}
    used.update(i for st in seq.steps[p:] for _p, i, _d, _n in st.syms)
    used |= seq.later
    return {i: v for i, v in joined.items() if i in used}


def _read_later(d: ops_pb2.SequenceDef) -> frozenset[int]:
    """Local indices of ``head(d)`` that calls from ``d``'s first loop on read, count by or
    take a size or value of: a join before the loop must tell the host where they are."""
    head = loops.head(d)
    index = {rid: i for i, rid in enumerate(head.local_ids)}
    start = loops.head_end(d)
    first = sum(1 for call in d.calls[:start] for _ in iter_tensor_refs(call))
    ids = {src.id for src in d.sources[first:] if src.kind == _PRODUCED}
    ids.update(sym.tensor for sym in d.symbols if sym.call >= start)
    ids.update(lp.tensor for lp in d.loops)
    for v in (v for lp in d.loops for v in lp.variants):
        ids.update(src.id for src in v.sources if src.kind == _PRODUCED)
        ids.update(sym.tensor for sym in v.symbols)
    return frozenset(index[r] for r in ids if r in index)


def decode_answer(reply: ops_pb2.OpResult, session: Session, device: torch.device) -> Any:
    """A ``ReplayAnswer``'s result as forwarding would have returned it: proxies with the
    metadata the host sent, or values; MISS if it does not decode (it came from the network:
    the call is then forwarded, never answered with a guess)."""
    metas = iter(reply.outs)

    def proxy(ref: ops_pb2.TensorRef) -> torch.Tensor:
        m = next(metas, None)
        if m is None or ref.WhichOneof("ref") != "id":
            raise codec.CodecError("an answer's tensor without its metadata")
        shape, stride = tuple(m.shape), tuple(m.stride)
        if len(shape) != len(stride) or any(x < 0 for x in (*shape, *stride, m.storage_offset)):
            raise codec.CodecError("an answer's tensor with impossible metadata")
        return new_proxy(Handle(session, ref.id), shape, stride, m.storage_offset,
                         codec.dtype_of(m.dtype), device)
    try:
        return codec.decode_value(reply.value, proxy, torch.device)
    except (codec.CodecError, RuntimeError, OverflowError, ValueError):
        return MISS


def _answered_dense(act: Active, step: Step, result: RemoteTensor) -> None:
    """An answered step whose answer is one new C-contiguous tensor under the id the step
    names: ``step.dense`` says so, and later answers of it can be made from their sizes alone
    (``answered`` keeps them). Its dtype follows from the operator and its arguments' dtypes,
    which the step matches, as a pushed size's does; the rank is checked per answer."""
    i = step.out_local[0]
    shape = tuple(result.shape)
    if (i is None or act.joined is not None or result._rrto_handle.id != act.base + i
            or result.storage_offset() or result.stride() != codec.contiguous_strides(shape)):
        return
    step.dense = (i, result.dtype, result.device, len(shape))


def _dense_answer(reply: ops_pb2.OpResult) -> tuple[int, ...] | None:
    """The sizes of an answer that is one tensor laid out as ``torch.empty`` of them would be
    (C-contiguous, offset 0), else None. It came from the network: negative sizes are None."""
    if len(reply.outs) != 1 or reply.value.WhichOneof("kind") != "tensor":
        return None
    m = reply.outs[0]
    dims = tuple(m.shape)
    if m.storage_offset or any(d < 0 for d in dims) \
            or tuple(m.stride) != codec.contiguous_strides(dims):
        return None
    return dims


class _ThreadKey:
    """Held in an app thread's ``threading.local``: collected when that thread ends, which
    drops its entry from ``ReplayClient._live``."""

    __slots__ = ("__weakref__",)


class ReplayClient:
    """Per session: sequences by thread, the replay in progress per thread, pushed outputs."""

    def __init__(self, session: Session):
        self.session = session
        # thread -> its sequences, newest first (an app that alternates models, or input
        # shapes, has one per variant: the robot records again when none matches for long)
        self.sequences: dict[int, list[Sequence]] = {}
        self._tls = threading.local()
        self._inference = itertools.count(0)
        self._pushed: dict[int, ops_pb2.TensorData] = {}
        self._rewritten: set[int] = set()  # replayed values forwarded calls wrote since
        self._aborted: dict[int, int] = {}  # inference base -> position of its mismatch
        # inference base -> (position, error) of a call the host failed while ahead of the app
        self._broken: dict[int, tuple[int, ops_pb2.Error]] = {}
        self._bases: dict[int, Sequence] = {}  # inference base -> the sequence it replays
        self._replied_bases: set[int] = set()  # inferences whose reply the app has read
        # Waits for a pushed output (by id) or an answer (by (base, position)).
        self._waiting: dict[Any, threading.Event] = {}
        self._answers: dict[tuple[int, int], ops_pb2.OpResult] = {}
        # inference base -> position -> the sizes of its dense output (``ReplaySizes``):
        # written by the reader thread under the lock, read without it (single dict reads)
        self._sizes: dict[int, dict[int, tuple[int, ...]]] = {}
        self._give_up: list[int] = []  # sequences the host failed: the robot records again
        self._lock = threading.Lock()
        # Each app thread's replay under way, by a key its ``_tls`` holds (gone with the
        # thread): a replay starts only while no other thread's is (``_replaying_elsewhere``)
        self._live: weakref.WeakKeyDictionary[_ThreadKey, Active | None] = \
            weakref.WeakKeyDictionary()
        self._upload_meta: dict[Any, bytes] = {}  # codec.replay_upload's metadata cache
        self._palette = _palette_switch()  # inputs palette-coded where they fit (``_upload``)
        # CPU time spent working out a step's outputs (at its first replay, or at each for a
        # step whose sizes vary), in the calls the client times (``dispatch``'s ``timed``):
        # apart from the per-operator cost (``replay_shim_ns``).
        self.planning_ns = 0
        # A sequence search the robot said is running (``SearchHint``): set when none is.
        self._search_over = threading.Event()
        self._search_over.set()
        self._search_until = 0.0  # monotonic time past which an inference start stops waiting
        # the last hint's bound, until counted again from the download it came before
        self._search_wait_s = 0.0
        self.counters = {"replays": 0, "mismatches": 0, "replayed_ops": 0, "dropped": 0,
                         "failed": 0, "failed_ahead": 0, "answer_waits": 0, "joined": 0,
                         "switches": 0, "abandoned": 0, "search_waits": 0, "search_wait_ns": 0,
                         "robot_ops": 0, "robot_ns": 0, "here": 0, "sized": 0, "hot": 0,
                         "cut": 0, "resumed": 0}
        session.progress = self._progress

    def _progress(self) -> ops_pb2.ReplayProgress | None:
        """This thread's replay under way, as far as the app has matched it: told to the host
        with each release frame, so that it keeps no undo copy for an in-place call the app
        has already matched (``ReplayProgress``)."""
        act = getattr(self._tls, "active", None)
        if act is None or not act.position:
            return None
        return ops_pb2.ReplayProgress(base_id=act.base, position=act.position)

    # ----- from the reader thread -----
    def define(self, d: ops_pb2.SequenceDef) -> None:
        if not d.calls:
            self._remove(d.id)
            return
        known = next((s for s in self.sequences.get(d.thread, []) if s.id == d.id), None)
        try:
            if known is not None and d.plans and not d.loops and known.base == partition.without_plans(d):
                add_plans(known, d)  # placed anew: what it holds stays
                return
            seq = compile_sequence(d)
        except (codec.CodecError, KeyError, ValueError, IndexError, TypeError, RuntimeError):
            return  # never replay what we cannot read: the calls keep being forwarded
        with self._lock:
            others = [s for s in self.sequences.get(d.thread, []) if s.id != d.id]
            kept = [seq, *others][:MAX_PER_THREAD]
            self.sequences = {**self.sequences, d.thread: kept}
            for old in others[MAX_PER_THREAD - 1:]:  # the least recently found: told to the
                self._give_up.append(old.id)        # robot, which drops it on the host too
                self.counters["dropped"] += 1
        # What the app keeps (its model, its libraries) out of the garbage collector's full
        # collections (``rrtod.gcfreeze``): settled when its second inference began
        # (``inference_started``; a saved sequence that arrives before it settles here), and
        # looked at again at a definition a minute or more after that
        gcfreeze.settle(again=True)

    def search_hint(self, hint: ops_pb2.SearchHint) -> None:
        """The robot's sequence search is running (for at most ``wait_us`` more, as far as an
        inference start cares) or over; a definition it found was passed to ``define`` before."""
        if hint.running:
            self._search_wait_s = min(hint.wait_us / 1e6, SEARCH_WAIT_MAX_S)
            self._search_until = time.monotonic() + self._search_wait_s
            self._search_over.clear()
        else:
            self._search_over.set()

    def left_inference(self) -> bool:
        """This thread's inference under way left a replay and forwarded after it."""
        return getattr(self._tls, "left", False)

    def await_answer(self) -> None:
        """The mark of an inference that left its replay is about to go: the next inference
        start waits for the robot's answer (``search_hint``), at most ``MARK_ANSWER_S``, as
        for a search. The robot may search for the way it went (a variant of the sequence it
        left), and that inference would otherwise replay the old one and leave it again at
        the same place. Set before the mark is written, so that the answer cannot come
        first."""
        self._search_until = max(self._search_until, time.monotonic() + MARK_ANSWER_S)
        self._search_over.clear()

    @property
    def search_pending(self) -> bool:
        """The robot said a search is running, and has not said it is over."""
        return not self._search_over.is_set()

    def _await_search(self) -> None:
        """The robot searches the inferences before the one this thread begins or has begun
        (told at a download, before its reply; or at an inference mark, which the shim sends
        with the next inference's first calls): wait for that search, within its bound, so
        that the sequence it finds replays this inference (or joins it, ``_join``) rather
        than the next one."""
        left = self._search_until - time.monotonic()
        if left <= 0:
            return
        t0 = time.perf_counter_ns()
        # (a hint that comes meanwhile moves the bound: the robot found a sequence, and the
        # wait now covers its definition by the host too)
        while not self._search_over.wait(left):
            left = self._search_until - time.monotonic()
            if left <= 0:
                break
        self.counters["search_waits"] += 1
        self.counters["search_wait_ns"] += time.perf_counter_ns() - t0

    def _remove(self, seq_id: int) -> list[Sequence]:
        """Forget a sequence; returns what was removed. Copy-on-write: app threads read
        ``sequences`` without the lock."""
        with self._lock:
            gone = [s for seqs in self.sequences.values() for s in seqs if s.id == seq_id]
            if gone:
                kept = {t: [s for s in seqs if s.id != seq_id]
                        for t, seqs in self.sequences.items()}
                self.sequences = {t: seqs for t, seqs in kept.items() if seqs}
        return gone

    def broken(self, err: ops_pb2.Error) -> None:
        """Call ``err.position`` of replayed inference ``err.base_id`` failed on the host,
        which ran ahead of the app: nothing from it on will be pushed. The app thread finds
        out at its next replayed call (``_check_broken``); downloads and answers of that
        inference waiting now are woken (they fetch, or forward, the usual way)."""
        base = err.base_id
        with self._lock:
            self._broken[base] = (err.position, err)
            self.counters["failed_ahead"] += 1
            woken = [k for k in self._waiting
                     if (k[0] if isinstance(k, tuple) else
                         REPLAY_BASE + ((k - REPLAY_BASE) // SPAN) * SPAN) == base]
            events = [self._waiting.pop(k) for k in woken]
        for event in events:
            event.set()

    def _finish_here(self, act: Active) -> bool:
        """``act``'s sequence failed on the host without saying where (``failed``): the calls
        the app matched may have made nothing there, and forwarding on from them would name
        values that do not exist. True when the inference goes on here from the values the
        session's journal rebuilds (its replay abandoned; the caller returns MISS and the
        session runs the call here); False: forwarded from here on (nothing to rebuild from,
        or ``fallback: error``)."""
        return act.position > 0 and self.session.finish_here("replay")

    def _check_broken(self, act: Active) -> bool:
        """Whether this call must be forwarded because the host failed a call of ``act``'s
        inference. Calls before the failed one still replay (the host ran them). The failed
        one is forwarded if the app makes it (then it fails as forwarding fails); a branch
        before it is a mismatch as usual. If the app had already made it when the error came,
        the error is the app's: raised at its next read."""
        position, err = self._broken[act.base]
        if act.position < position:
            return False
        del self._broken[act.base]
        if act.position > position:
            self.session.add_async_error(err)
        self._mismatch(act)
        return True

    def abandon(self) -> None:
        """This thread's inference goes on without the host (its deadline passed): the host
        stops replaying it (``ReplayAbort``, as at a mismatch), and its late pushes are never
        taken; the sequence is not blamed for it (no mismatch is counted)."""
        act = self.active
        if act is None:
            return
        self.session.send_frames([ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(
            position=act.position))])
        self._aborted[act.base] = act.position
        self._set_active(None)
        self.counters["abandoned"] += 1

    def wake(self) -> None:
        """The host is gone: every download or answer waiting for it stops waiting now (it
        finds nothing, and is served from the journal: ``RemoteSession.value_after_loss``)."""
        with self._lock:
            waiting = list(self._waiting.values())
            self._waiting.clear()
        self._search_over.set()
        for event in waiting:
            event.set()

    def failed(self, seq_id: int) -> None:
        """The host could not replay ``seq_id`` and did not say where (a start it refused, an
        argument it could not take): stop using it, and wake every download waiting for a
        push. An inference the app began with it may hold proxies of values the host never
        made: it is finished here (``_finish_here``). Marked on the inferences' own sequences
        too: the shim may have dropped it already (the robot's drop crossed the start)."""
        gone = self._remove(seq_id)
        with self._lock:
            gone += [s for s in list(self._bases.values()) if s.id == seq_id]
            for seq in gone:
                (seq.root or seq).failed = True
            self._give_up.append(seq_id)  # told to the robot by an app thread (never block here)
            waiting = list(self._waiting.values())
            self._waiting.clear()
            self.counters["failed"] += 1
        for event in waiting:
            event.set()

    def pushed(self, fetched: ops_pb2.Fetched) -> None:
        with self._lock:
            self._pushed[fetched.id] = fetched.tensor
            event = self._waiting.pop(fetched.id, None)
        if event is not None:
            event.set()

    def answered(self, answer: ops_pb2.ReplayAnswer) -> None:
        """The host's answer to a replayed call. Where it is one new C-contiguous tensor (a
        detector's ``nonzero``, boolean ``index``, ``nms``) its sizes are also kept as pushed
        sizes are: the hot path makes the call's proxy from them (``hotpath.describe``), read
        here on the stream's thread instead of decoded on the app's."""
        key = (answer.base_id, answer.position)
        dims = _dense_answer(answer.result)
        with self._lock:
            self._answers[key] = answer.result
            event = self._waiting.pop(key, None)
            if dims is not None:
                known = self._sizes.get(answer.base_id)
                if known is None and len(self._sizes) < SIZED_INFERENCES:
                    known = self._sizes[answer.base_id] = {}
                if known is not None and len(known) < SIZED_CALLS:
                    known[answer.position] = dims
        if event is not None:
            event.set()

    def sized(self, sizes: ops_pb2.ReplaySizes) -> None:
        """Sizes of an inference's outputs that follow the data, as the host made them (it
        runs ahead): kept for the steps the app has not reached yet, within bounds. They came
        from the network: a message whose parts do not add up is dropped, and sizes that do
        not fit their step are never used (``_dense``)."""
        positions, ranks, dims = sizes.positions, sizes.ranks, sizes.dims
        if len(positions) != len(ranks) or sum(ranks) != len(dims):
            return
        made, at = {}, 0
        for position, rank in zip(positions, ranks, strict=True):
            got = tuple(dims[at:at + rank])
            at += rank
            if all(d >= 0 for d in got):  # (checked here, off the app's calls)
                made[position] = got
        with self._lock:  # (``_forget_before`` walks the inferences)
            known = self._sizes.get(sizes.base_id)
            if known is None:
                if len(self._sizes) >= SIZED_INFERENCES:
                    return  # (inferences the app never reached: forgotten at its next start)
                known = self._sizes[sizes.base_id] = {}
            if len(known) + len(made) <= SIZED_CALLS:
                known.update(made)

    # ----- from the app's threads -----
    @property
    def active(self) -> Active | None:
        return getattr(self._tls, "active", None)

    def _key(self) -> _ThreadKey:
        """This thread's key in ``_live`` (made at its first use)."""
        key = getattr(self._tls, "key", None)
        if key is None:
            key = self._tls.key = _ThreadKey()
        return key

    def _set_active(self, act: Active | None) -> None:
        """This thread's replay under way (None: none), also kept where the other threads
        see it (``_replaying_elsewhere``)."""
        self._tls.active = act
        key = self._key()
        with self._lock:
            if act is None:
                self._live.pop(key, None)
            else:
                self._live[key] = act

    def _claim(self) -> bool:
        """Hold the session's replay for this thread's next unless another thread's is under
        way: checked and set at once, so that two threads that both saw none cannot both
        start. Claimed before the first call is matched, because matching commits what its
        frames bind and send (``Sequence.bindings``, ``Sequence.sent``): frames dropped after
        it would leave a weight the shim takes for bound that the host never got. A start
        that is not made gives the claim back (``_unclaim``); ``_set_active`` makes it this
        thread's replay once its start is sent (``_begin_claimed``)."""
        key = self._key()
        with self._lock:
            if any(k is not key for k in self._live.keys()):
                return False
            self._live[key] = None
        return True

    def _unclaim(self) -> None:
        """Give back a claim that began no replay (this thread has none under way)."""
        if getattr(self._tls, "active", None) is None:
            self._set_active(None)

    def _begin_claimed(self, act: Active, frames: list[Any]) -> None:
        """Send the start of ``act`` (claimed: ``_claim``) and make it this thread's replay;
        if its frames cannot go, the claim is given back."""
        try:
            self.session.send_frames(frames)
        except BaseException:
            self._set_active(None)
            raise
        self._set_active(act)

    def _replaying_elsewhere(self) -> bool:
        """Another app thread's replay is under way. The host runs one replay at a time per
        session, and a ``ReplayArg`` or ``ReplayAbort`` names no replay: a start while another
        thread's replay still takes arguments would hand them to the wrong one (two lanes
        with sequences, threads whose inferences overlap). So a replay starts only when no
        other thread's is under way; until then this thread's calls are forwarded."""
        if not self._live:
            return False
        key = getattr(self._tls, "key", None)
        with self._lock:
            return any(k is not key for k in self._live.keys())

    def dispatch(self, func: Any, args: tuple, kwargs: dict, info: OpInfo,
                 thread: int, grad_mode: int, timed: bool = False) -> Any:
        """The result of this call from the sequence in progress (or one it starts), with
        the frames it needs sent; ``MISS`` when replay does not answer it. ``timed``: the
        caller measures this call's CPU time, and the part spent planning is added to
        ``planning_ns``."""
        if self._give_up:
            self._tell_given_up()
        act = getattr(self._tls, "active", None)
        if act is not None and act.seq.host_failed:
            if self._finish_here(act):
                return MISS
            self._set_active(None)  # failed on the host: forward from here on
            act = None
        elif act is not None and self._broken and act.base in self._broken \
                and self._check_broken(act):
            return MISS
        if info.value_op and act is None:
            return MISS  # a value read outside a replay: forwarded (a sequence never starts so)
        if act is None and self._live and self._replaying_elsewhere():
            return MISS  # (no replay starts while another thread's is under way)
        resumed = self._resume(thread, args, kwargs, info, grad_mode) \
            if act is None and getattr(self._tls, "resumable", None) is not None else None
        if resumed is MISS:
            return MISS
        if resumed is not None:
            act = resumed  # (matched, its frames sent)
        elif act is None:
            if not self._search_over.is_set() and not getattr(self._tls, "left", False):
                # (not within an inference that left its replay: a sequence found now would
                # not join it, as the calls it replayed are no forwarded ones to map)
                self._await_search()
            if not any(s.fresh or s.steps[0].op == info.name
                       for s in self.sequences.get(thread, ())):
                return MISS  # it starts no sequence: an ordinary forwarded call
            if not self._claim():
                return MISS  # another thread's replay began meanwhile: forwarded
            try:
                act = self._start(thread, args, kwargs, info, grad_mode)
            finally:
                self._unclaim()  # (unless it began)
            if act is None:
                return MISS  # not the start of any sequence: an ordinary forwarded call
        else:
            frames = self._match(act, args, kwargs, info, grad_mode)
            if frames is None:
                switched = (self._switch(act, args, kwargs, info, grad_mode)
                            if len(self.sequences.get(thread, ())) > 1 else None)
                if switched is None:
                    self._mismatch(act)
                    return MISS
                act = switched
            elif frames:
                self.session.send_frames(frames)
        step = act.seq.steps[act.position]
        if step.robot:
            result = self._on_robot(act, step, func, args, kwargs, info)
            if result is MISS:
                self._mismatch(act)
                return MISS
            return self._advance(act, result)
        if step.answered or info.value_op:
            result = self._answer(act, args, kwargs)
            if result is MISS:
                if act.seq.host_failed and self._finish_here(act):
                    return MISS
                self._mismatch(act)
                return MISS
            if step.dense is not None and not kwargs:  # its next answers' sizes: the hot path
                self._describe(act.seq, act.position, step, func, info)
            return self._advance(act, result)
        built = step.built
        if built is None and step.dense is not None:
            result = self._dense(act, step)
            if result is not None:
                if act.seq.sized:
                    self._note_sizes(act, step, result)
                if not kwargs:
                    self._describe(act.seq, act.position, step, func, info)
                return self._advance(act, result)
        if built is None:
            t0 = thread_time_ns() if timed else 0
            try:
                built = self._plan(step, func, args, kwargs, info)
            except _Unreplayable:
                self._mismatch(act)
                return MISS
            finally:
                if timed:
                    self.planning_ns += thread_time_ns() - t0
            if not step.variable or not any(i is not None for i in built.plan):
                step.built = built  # (every output the argument itself: sizes do not matter)
            elif step.dense is None and built.single is not None:
                i, shape, stride, offset, dtype = built.single
                if not offset and stride == codec.contiguous_strides(shape):
                    step.dense = (i, dtype, built.device, len(shape))
        if act.joined is not None and any(i in act.joined for i in built.plan if i is not None):
            # A new tensor where the app holds a joined value: replay would name it base + i.
            # (A call that writes a joined value in place returns the app's own tensor: fine.)
            self._mismatch(act)
            return MISS
        single = built.single
        if single is not None:  # the common case: one new tensor
            i, shape, stride, offset, dtype = single
            result = new_proxy(Handle(self.session, act.base + i), shape, stride, offset,
                               dtype, built.device)
        elif built.multi is not None:  # a tuple of new tensors (native_batch_norm and co.)
            session, base, device = self.session, act.base, built.device
            result = tuple([new_proxy(Handle(session, base + i), shape, stride, offset, dtype,
                                      device)
                            for i, shape, stride, offset, dtype in built.multi])
        else:
            result = self._outputs(act, built, args, kwargs, info)
        if step.built is built and not kwargs:  # (a layout fixed at its first replay)
            self._describe(act.seq, act.position, step, func, info)
        if act.seq.sized:
            self._note_sizes(act, step, result)
        return self._advance(act, result)

    # ----- inferences the robot runs whole (a plan with every call on the robot) -----
    def runs_here(self, thread: int) -> Sequence | None:
        """The plan this thread's next inference runs here whole, if any: its one sequence's
        current plan puts every call on the robot, and that plan's profiled inferences are
        done (the scheduler has the robot's times). Then the app's forward runs on its own
        tensors, nothing intercepted (``TorchInterceptor``): matched call by call, each cost
        ~0.3 ms of the shim's Python beside its operator (resnet18: 100 ms against 77 here).
        Nothing can differ from local execution: it is local execution."""
        seqs = self.sequences.get(thread, ())
        if len(seqs) != 1 or self._give_up or getattr(self._tls, "active", None) is not None \
                or self._replaying_elsewhere():
            return None
        seq = seqs[0]
        if not seq.current:
            return None
        plan = seq.plans[seq.current - 1]
        if not plan.here or (plan.definition.profile and plan.profiled < PROFILED):
            return None
        return plan

    def ran_here(self, plan: Sequence) -> None:
        """An inference of ``plan`` runs here whole: its start goes to the robot daemon, which
        times the plan by it (``SessionPlacer.timed``), marked ``here``: the host runs none of
        its calls, so the robot daemon keeps it (no link traffic, no wake-up of the host)."""
        base = REPLAY_BASE + next(self._inference) * SPAN
        self.session.send_frames([ops_pb2.SessionUp(start=ops_pb2.ReplayStart(
            sequence=plan.id, base_id=base, inference=base, plan=plan.plan, here=True))])
        self.counters["replays"] += 1
        self.counters["here"] += 1

    # ----- calls the robot runs (a scheduler's placement) -----
    def _profiled(self, act: Active) -> None:
        """An inference of a plan, timed, ran to its end: add its robot steps' times to the
        plan's profile, and send the profile to the robot daemon once ``PROFILED`` are in."""
        seq = act.seq
        if not seq.profile_ns:
            seq.profile_ns = [0] * len(seq.steps)
        for k, ns in enumerate(act.timing or ()):
            seq.profile_ns[k] += ns
        seq.profiled += 1
        if seq.profiled == PROFILED:
            self.session.send_frames([ops_pb2.SessionUp(profile=ops_pb2.SequenceProfile(
                sequence=seq.id, plan=seq.plan, replays=seq.profiled,
                call_ns=[ns // seq.profiled for ns in seq.profile_ns]))])

    def _on_robot(self, act: Active, step: Step, func: Any, args: tuple, kwargs: dict,
                  info: OpInfo) -> Any:
        """Run a matched step here, on the app's copies of the weights, the values the robot
        made and those the host pushed (``rrtod.partition``). Its outputs are proxies whose
        value is here (``Handle.local``, never bound on the host): later robot steps and the
        app's reads use it, and a host step that reads one uploads it as its input. MISS if
        a value the host was to push never comes (then the call is forwarded)."""
        t0 = perf_counter_ns()
        if step.band is not None:
            return self._band_here(act, step, func, args, kwargs, t0)
        try:
            largs = [self._robot_value(act, a) for a in args]
            lkwargs = {k: self._robot_value(act, v) for k, v in kwargs.items()}
        except _Unreplayable:
            return MISS
        result = func(*largs, **lkwargs)
        flat, spec = tree_flatten(result)
        device = self.session.app_device(args, kwargs)
        k, made = 0, []
        for x in flat:
            if not isinstance(x, torch.Tensor):
                made.append(x)
                continue
            alias = info.ret_alias[k] if k < len(info.ret_alias) else None
            i = step.out_local[k] if k < len(step.out_local) else None
            k += 1
            if alias is not None:  # written in place: the proxy itself
                proxy = arg_at(args, kwargs, *alias)
                if isinstance(proxy, RemoteTensor) and proxy._rrto_handle.local is not None:
                    proxy._rrto_handle.local = x.detach()  # its layout, if that changed too
                made.append(proxy)
                continue
            if i is None:
                return MISS
            h = Handle(self.session, act.base + i, local=x.detach())
            h.bound = False  # lives here only: nothing to release on the host
            made.append(new_proxy(h, tuple(x.shape), x.stride(), x.storage_offset(), x.dtype,
                                  device, x.requires_grad))
        # What running it here cost, the shim's work around the op included (its profile:
        # a scheduler that priced the op alone saw robot calls cheaper than they are).
        took = perf_counter_ns() - t0
        if act.timing is not None:
            act.timing[act.position] = took
        self.counters["robot_ops"] += 1
        self.counters["robot_ns"] += took
        return tree_unflatten(made, spec)

    def _band_here(self, act: Active, step: Step, func: Any, args: tuple, kwargs: dict,
                   t0: int) -> Any:
        """A split region's call (``rrtod.lop``): make its outputs' rows ``[0, rows)`` here
        from the bands of the region's values and the app's inputs, whole. Its outputs are
        proxies of the whole value, whose handle holds this band (``Handle.split`` while the
        host holds the rest: ``downloads.whole`` puts it together where the app needs it);
        the host's band of it is kept under the same id, released as any value's."""
        how, top, host = step.band
        held: dict[int, int] = {}  # the tensors with rows: each holds its first rows
        n = itertools.count()

        def band(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                t = x
                if isinstance(x, RemoteTensor):
                    h = x._rrto_handle
                    if h.local is None:
                        raise _Unreplayable
                    t = h.local if h.split else downloads.shape_like(h.local, x)
                if how.rows_in[next(n)]:
                    held[id(t)] = 0
                return t
            if isinstance(x, (list, tuple)):
                return type(x)(band(v) for v in x)
            return x

        try:
            largs = [band(a) for a in args]
            lkwargs = {k: band(kwargs[k]) for k in sorted(kwargs)}
        except _Unreplayable:
            return MISS
        result = rows.run(func, largs, lkwargs, how, held, 0, top)
        flat = list(result) if isinstance(result, (tuple, list)) else [result]
        device = self.session.app_device(args, kwargs)
        made = []
        for k, (x, meta) in enumerate(zip(flat, step.out_meta, strict=True)):
            i = step.out_local[k]
            if i is None:
                return MISS
            h = Handle(self.session, act.base + i, local=x.detach())
            # the host holds its band under this id: released when the app lets go
            if how.rows_out[k] and host < meta[1][rows.ROW]:
                h.split = meta[1][rows.ROW]
            h.bound = bool(h.split)
            made.append(new_proxy(h, meta[1], meta[2], meta[3], meta[0], device, False))
        took = perf_counter_ns() - t0
        if act.timing is not None:
            act.timing[act.position] = took
        self.counters["robot_ops"] += 1
        self.counters["robot_ns"] += took
        if isinstance(result, (tuple, list)):
            return type(result)(made)
        return made[0]

    def _robot_value(self, act: Active, x: Any) -> Any:
        """``x`` (an argument) as the robot computes on it: a proxy's local value, or the one
        the host pushed (taken once per inference: ``Active.pulled``)."""
        if isinstance(x, RemoteTensor):
            h = x._rrto_handle
            if h.split and h.local is not None and h.local.shape[rows.ROW] != h.split:
                # a split region's value, read whole here: the host pushed its band
                data = act.taken.pop(h.id, None) or self._peek(act, h.id)
                if data is None:
                    raise _Unreplayable
                self.session.counters["bytes_down"] += len(data.data) + len(data.palette)
                downloads.put_together(h, codec.from_tensor_data(data))
            if h.local is not None:
                return downloads.shape_like(h.local, x)
            got = act.pulled.get(h.id)
            if got is None:
                data = act.taken.pop(h.id, None)
                if data is None and self._expects(h.id):
                    data = self._peek(act, h.id)
                    if data is None:
                        raise _Unreplayable
                if data is not None:
                    self.session.counters["bytes_down"] += len(data.data) + len(data.palette)
                    got = downloads.shape_like(codec.from_tensor_data(data), x)
                else:  # a value the host holds but does not push (forwarded before a join)
                    got = downloads.read_value(self.session, x)
                act.pulled[h.id] = got
            return got
        if isinstance(x, (list, tuple)):
            return type(x)(self._robot_value(act, v) for v in x)
        return x

    # ----- variants -----
    def _switch(self, act: Active, args: tuple, kwargs: dict, info: OpInfo,
                grad_mode: int) -> Active | None:
        """The app's call differs from the sequence in progress at position ``p``: if another
        sequence of this thread has exactly the same first ``p`` steps (a variant: the same
        inference up to a branch on a value, such as no detections against some) and this
        call is its step ``p``, go on with that one. The host is told to abort the first at
        ``p`` and to run the variant from ``p`` (a join, ``ReplayStart.position``) on the
        values the first one made, under a new base so that nothing the first one ran ahead
        can be taken for the variant's. None: no variant matches (a mismatch)."""
        p, a = act.position, act.seq
        if p == 0 or any(st.robot for st in a.steps[:p]):
            return None  # (values the robot made before p are not on the host to join)
        for b in self.sequences.get(a.definition.thread, ()):
            if b is a or len(b.steps) <= p or b.steps[p].op != info.name \
                    or not b.same_prefix(a, p):
                continue
            joined = {i: act.id_of(i) for st in a.steps[:p] for i in st.out_local
                      if i is not None}
            new = Active(b, REPLAY_BASE + next(self._inference) * SPAN, position=p,
                         sizes=dict(act.sizes), values=dict(act.values), joined=joined)
            frames = self._match(new, args, kwargs, info, grad_mode)
            if frames is None:
                continue
            start = ops_pb2.SessionUp(start=ops_pb2.ReplayStart(
                sequence=b.id, base_id=new.base, inference=new.base, position=p,
                joined=_read_after(b, p, joined)))
            self.session.send_frames([ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=p)),
                                      start, *frames])
            self._aborted[act.base] = p
            self._bases[new.base] = b
            self._set_active(new)
            self.counters["switches"] += 1
            return new
        return None

    def _start(self, thread: int, args: tuple, kwargs: dict, info: OpInfo,
               grad_mode: int) -> Active | None:
        """Begin the replay this call starts: the first call of one of the thread's
        sequences, or a call that joins a sequence that arrived during this inference
        (``_join``). Its start and the call's frames are sent; None: it starts none. The
        session's replay is this thread's claim (``_claim``)."""
        seqs = self.sequences.get(thread, ())
        for seq in seqs:
            if seq.steps[0].op != info.name:
                continue
            if seq.current:  # placed: run the plan the robot chose
                seq = seq.plans[seq.current - 1]
            act = Active(seq, REPLAY_BASE + next(self._inference) * SPAN)
            if seq.plan and seq.profiled < PROFILED and seq.definition.profile:
                act.timing = [0] * len(seq.steps)
            frames = self._match(act, args, kwargs, info, grad_mode)
            if frames is not None:
                break
        else:
            fresh = [s for s in seqs if s.fresh]
            joined = None
            if fresh:  # looked at once: its first call after it arrived
                for s in fresh:
                    s.fresh = False
                joined = self._join(fresh, args, kwargs, info, grad_mode)
            if joined is None:
                return None
            act, frames = joined
            seq = act.seq
        for s in seqs:
            s.fresh = False
        self._tls.tail, self._tls.tail_bytes = [], 0
        self._tls.resumable = None
        self._forget_before(act.base - 4 * SPAN)
        self._bases[act.base] = seq
        start = ops_pb2.SessionUp(start=ops_pb2.ReplayStart(
            sequence=seq.id, base_id=act.base, inference=act.base, plan=seq.plan,
            position=act.position, joined=_read_after(seq, act.position, act.joined)))
        self._begin_claimed(act, [start, *frames])
        self.counters["replays"] += 1
        return act

    # ----- resuming a loop after a cut -----
    def _resume(self, thread: int, args: tuple, kwargs: dict, info: OpInfo,
                grad_mode: int) -> Active | Any | None:
        """This thread's replay left its loop in iteration ``k`` (``_resume_point``: cut there,
        at values no variant has, or a call that differed inside it) and the app forwards the
        rest of that iteration: if this call begins iteration ``k + 1`` (or the calls after the
        loop), go on replaying from it. The host
        runs the rest of the inference from one start (``ReplayStart.loop_choices``: the
        choices so far, ``SKIP`` for ``k``), reading what was made before by the ids the app
        holds (``joined``); the shim reads the guards of the iterations left, as at the head's
        end, and matches the rest as any replay. Not this call: None (forwarded, and each call
        of the branch is looked at so). MISS: it started but the guards never came (a mismatch
        there, as ``_unroll``'s)."""
        old, done = self._tls.resumable
        cut = old.seq
        root = cut.root
        folded = root.folded if root is not None else None
        count = cut.count
        if folded is None or root.host_failed or self.session.lost is not None:
            self._tls.resumable = None  # (failed since: no resuming it; one replaced since is
            return None  # resumed still, as the host keeps it: ``RETIRED_KEPT``)
        loop = folded.loops[0]
        at = loop.start if len(done) < count else loop.start + loop.body
        if at >= len(folded.calls):
            self._tls.resumable = None  # nothing after the loop to resume at
            return None
        if folded.calls[at].op != info.name:
            return None
        try:
            probe = _unrolled(root, count, list(done))
        except ValueError:
            self._tls.resumable = None
            return None
        p = loops.iteration_start(folded, list(done))
        # What the calls before ``p`` made (the app's calls on iteration k made the rest: the
        # app holds them by its own ids), but the values of the head no later call reads
        ids, before = probe.definition.local_ids, root.layout.before  # type: ignore[union-attr]
        later = {probe.local[r] for r in (root.definition.local_ids[j] for j in root.later)
                 if r in probe.local}
        joined = {i: old.id_of(i) for st in cut.steps[:old.position] for i in st.out_local
                  if i is not None and (ids[i] not in before or i in later)}
        act = Active(probe, REPLAY_BASE + next(self._inference) * SPAN, position=p,
                     sizes=dict(old.sizes), values=dict(old.values), joined=joined)
        if not self._claim():
            return MISS  # another thread's replay began meanwhile: forwarded
        frames = None
        try:
            frames = self._match(act, args, kwargs, info, grad_mode)
        finally:
            if frames is None:
                self._unclaim()
        if frames is None:
            return None
        self._tls.resumable = None
        self._forget_before(act.base - 4 * SPAN)
        self._bases[act.base] = probe
        start = ops_pb2.SessionUp(start=ops_pb2.ReplayStart(
            sequence=root.id, base_id=act.base, inference=act.base, position=p, joined=joined,
            loop_count=count, loop_choices=done))
        self._begin_claimed(act, [start, *frames])
        self.counters["resumed"] += 1
        if len(done) < count:
            try:
                more = loops.choose_known(loop, self._guards(act, root, count, len(done)))
                act.seq = _unrolled(root, count, [*done, *more])
            except ValueError:
                self._mismatch(act)
                return MISS
            with self._lock:
                self._bases[act.base] = act.seq
        return act

    # ----- joining an inference under way -----
    def forwarded(self, call: ops_pb2.OpCall, result: Any) -> None:
        """A call of this thread was forwarded: kept (the frame itself, and for a call whose
        outputs the host named, their ids and shapes) until the thread's next download, in
        case a sequence arrives during this inference and joins it (``_join``)."""
        tail = getattr(self._tls, "tail", None)
        if tail is None:
            tail = self._tls.tail = []
            self._tls.tail_bytes = 0
        elif len(tail) >= MAX_TAIL:
            return
        size = self._tls.tail_bytes + call.ByteSize()
        if size > MAX_TAIL_BYTES:  # the frames hold the uploads' bytes: this inference is not
            tail.clear()           # joined, and nothing more is kept until the next download
            self._tls.tail_bytes = size
            return
        self._tls.tail_bytes = size
        outs = None
        if call.want_meta:
            found: list[Any] = []
            sizing_flatten(result, found)
            outs = [(t._rrto_handle.id, tuple(t.shape)) if isinstance(t, RemoteTensor) else None
                    for t in found]
        tail.append((call, outs))

    def downloaded(self) -> None:
        """The app read a value: an inference ends here (the robot's search sees it so too).
        A search hinted before this download's reply is waited for from here: the hint comes
        as the robot forwards the download, which the host answers only once it has run the
        inference's calls queued before it (resnet50 forwarded back to back: 127 ms, past the
        hint's 100 ms, so its third inference began without waiting and was forwarded)."""
        self._tls.read_since_begin = True
        # (the first download after the hint only: Ultralytics' set-up reads 151 values;
        # counted again at each, its set-up's waits spent most of the hint budget, and its
        # third frame had 67 ms of it left for a search that took 161)
        wait, self._search_wait_s = self._search_wait_s, 0.0
        if wait and not self._search_over.is_set():
            self._search_until = max(self._search_until, time.monotonic() + wait)
        if getattr(self._tls, "tail_bytes", 0):  # something kept, or over the bound
            self._tls.tail, self._tls.tail_bytes = [], 0

    def inference_started(self) -> None:
        """The thread's outermost module call. If it read nothing since the previous one (an
        app that looks only at the sizes it was answered, or at nothing), the calls kept for a
        join start afresh here: nothing else shows where its inference under way began, and a
        join maps that inference's calls, not those of the ones before."""
        if not getattr(self._tls, "read_since_begin", False):
            self._tls.tail, self._tls.tail_bytes = [], 0
        else:
            # The app read an inference's outputs and began another: its model and libraries
            # are loaded. The first such start settles (~180 ms for torchvision's resnet50
            # app; later ones return at once), not the first definition, which then waited
            # for it while this inference ran forwarded: its replay began an inference later.
            gcfreeze.settle()
        self._tls.read_since_begin = False
        self._tls.left = False
        self._tls.resumable = None  # (a cut inference's loop is resumed within it only)
        if self._give_up and self.session.lost is None:
            # (a thread with no sequence left never replays a call to say it then)
            try:
                self._tell_given_up()
            except HostLost:
                pass  # (lost since: the robot records afresh on the way back)

    def _join(self, fresh: list[Sequence], args: tuple, kwargs: dict, info: OpInfo,
              grad_mode: int) -> tuple[Active, list[Any] | tuple[()]] | None:
        """A sequence that reached this thread during an inference it already began forwarding:
        if the calls forwarded since the last download are the sequence's first ``m`` calls
        (same operators, arguments and dataflow) and this call is its call ``m``, replay the
        rest of the inference from here (``ReplayStart.position``), telling the host which of
        the values it already holds are the sequence's (``joined``). Back to back, an app then
        replays from its third inference, not its fourth. The calls matched here only name
        those values: every later call is still matched as the app makes it, so a wrong guess
        costs a mismatch, never a wrong result."""
        tail = getattr(self._tls, "tail", None)
        if not tail or len(tail) >= MAX_TAIL:
            return None  # nothing kept (or too much: see ``forwarded``)
        for seq in fresh:
            starts = [j for j, (call, _) in enumerate(tail) if call.op == seq.steps[0].op]
            for j in starts[:JOIN_TRIES]:
                m = len(tail) - j
                if m >= len(seq.steps) or seq.steps[m].op != info.name:
                    continue
                act = Active(seq, REPLAY_BASE + next(self._inference) * SPAN, joined={})
                if not all(self._took(act, k, *tail[j + k]) for k in range(m)):
                    continue
                act.position = m
                frames = self._match(act, args, kwargs, info, grad_mode)
                if frames is not None:
                    self.counters["joined"] += 1
                    return act, frames
        return None

    def _took(self, act: Active, k: int, call: ops_pb2.OpCall,
              outs: list[tuple[int, tuple[int, ...]] | None] | None) -> bool:
        """Whether forwarded ``call`` was step ``k`` of ``act``'s sequence; if so, its output
        ids go into ``act.joined`` (and their sizes, where symbolic integers use them)."""
        step = act.seq.steps[k]
        if call.op != step.op or call.grad_mode != step.grad_mode:
            return False
        refs: list[_Placeholder] = []
        try:
            decoded = [codec.decode_value(v, _Placeholder, torch.device) for v in call.args]
            kw = {n: codec.decode_value(call.kwargs[n], _Placeholder, torch.device)
                  for n in sorted(call.kwargs)}
        except (codec.CodecError, RuntimeError, ValueError, TypeError):
            return False
        wanted = _wanted(step, act)
        if wanted is None:
            return False
        want_args, want_kwargs = wanted
        if (_strip(decoded, refs) != want_args
                or {n: _strip(v, refs) for n, v in kw.items()} != want_kwargs
                or len(refs) != len(step.checks)):
            return False
        joined = act.joined if act.joined is not None else {}
        sources = act.seq.definition.sources
        for (slot, kind, aux), ph in zip(step.checks, refs, strict=True):
            ref = ph.ref
            if kind == _PRODUCED:
                if ref.WhichOneof("ref") != "id" or joined.get(aux) != ref.id:
                    return False
            elif kind not in (_INPUT, _PERSISTENT) and (
                    ref.WhichOneof("ref") != "id" or ref.id != sources[slot].id):
                return False  # CONSTANT: the very tensor recorded
        if outs is None:  # the shim named the outputs itself
            outs = [(oid, tuple(m.shape)) for oid, m in zip(call.out_ids, call.out_meta,
                                                           strict=True)] \
                if len(call.out_ids) == len(call.out_meta) else None
        if outs is None or len(outs) != len(step.out_local):
            return False
        for i, out in zip(step.out_local, outs, strict=True):
            if i is None:
                continue
            if out is None:
                return False
            joined[i] = out[0]
            if i in act.seq.sized:
                act.sizes[i] = out[1]
        return True

    def _upload(self, seq: Sequence, slot: int, t: torch.Tensor) -> Any:
        """INPUT ``slot``'s frame (``codec.replay_upload``: palette-coded where it fits and
        ``seq`` still tries, ``Sequence.codes``), its bytes counted."""
        code = self._palette and seq.codes(slot)
        frame = codec.replay_upload(slot, t, self._upload_meta, code)
        _, _, data, palette, _ = frame.upload
        if code:
            seq.coded(slot, bool(palette))
        self.session.counters["bytes_up"] += len(data) + len(palette)
        return frame

    def _advance(self, act: Active, result: Any) -> Any:
        act.position += 1
        self.counters["replayed_ops"] += 1
        # What the app dropped goes to the host while it still computes, a frame per
        # RELEASE_STREAM_AT values: the host frees each after its last use, and its next
        # outputs reuse that memory, still in cache, as the app's own forward would; held until
        # the app's wait, a replay slower than the app (a CPU host, a loaded one) touched a
        # whole inference's worth of fresh memory (yolo-pose: 6 200 page faults an inference
        # against none for the forward; ``python -m bench.hostloop``).
        self.session.release_now(RELEASE_STREAM_AT)
        if act.position == len(act.seq.steps):
            self.ended(act)
        return result

    def ended(self, act: Active) -> None:
        """``act`` passed its sequence's last step: go on into its loop, or end it; or, where
        its unrolling was cut (``Sequence.cut``), leave it: the app's next call is forwarded."""
        while act.position == len(act.seq.steps):
            if act.seq.folded is not None:
                if self._unroll(act):
                    continue  # (an empty loop may end the inference, or reach the next loop)
                break
            if act.seq.cut:
                self.counters["cut"] += 1
                self._mismatch(act)
                break
            self._set_active(None)
            if act.timing is not None:
                self._profiled(act)
            root = act.seq.root or act.seq
            root.mismatches = 0
            root.stale = False
            break

    def _unroll(self, act: Active) -> bool:
        """The head of a sequence with a loop is done: go on with the loop unrolled for this
        inference's count (a size the app's tensors have now; the host unrolls the same from
        its own tensor). The calls so far keep their local indices. Without the size, or if
        the loop cannot be unrolled, a mismatch here (False): the next call is forwarded."""
        i, dim = act.seq.counted  # type: ignore[misc]
        shape = act.sizes.get(i)
        folded = act.seq.folded
        assert folded is not None
        try:
            if shape is None or dim >= len(shape):
                raise ValueError("the loop's count is not known")
            choices = None
            if folded.loops[0].variants:  # up to an iteration no variant has (``Sequence.cut``)
                choices = loops.choose_known(folded.loops[0],
                                             self._guards(act, act.seq, shape[dim]))
            act.seq = _unrolled(act.seq, shape[dim], choices)
        except ValueError:
            self._mismatch(act)
            return False
        with self._lock:
            self._bases[act.base] = act.seq
        return True

    def _guards(self, act: Active, seq: Sequence, count: int,
                first: int = 0) -> Iterator[tuple[float, ...]]:
        """Per iteration of ``seq``'s loop from ``first`` on, the values of its guards, as the
        host pushes them once it has run every iteration's body (waited for here: the app reads
        them next anyway), each iteration's when asked for (``loops.choose_known`` asks up to
        the first no variant has: the host pushes none after it). ValueError if one never comes
        (the host failed, or is gone) or is not one number. A body call that failed on the host
        (``broken``; the host cut its unrolling there, ``HostReplayer._cut_at_failure``, and
        pushed the guards before it first) ends them where the guards end, as values no
        variant has would: the app leaves the inference at that call at the latest
        (``_check_broken``), and may resume after its iteration (``_resume_point``)."""
        for indices in _guard_indices(seq, count)[first:]:
            row = []
            for i in indices:
                data = self._peek(act, act.base + i)
                if data is None and act.base in self._broken and self.session.lost is None \
                        and not act.seq.host_failed:
                    return
                v = scalar_of(data) if data is not None else None
                if not isinstance(v, (bool, int, float)):
                    raise ValueError(f"no value for guard {i}")
                row.append(float(v))
            yield tuple(row)

    def _peek(self, act: Active, oid: int) -> ops_pb2.TensorData | None:
        """The pushed value ``oid``, left for the app's own read; waits for it. None if the
        host failed this inference or is gone, or the inference's deadline passed."""
        while True:
            with self._lock:
                data = self._pushed.get(oid)
                if data is not None:
                    return data
                if (self.session.lost is not None or act.seq.host_failed
                        or act.base in self._broken):
                    return None
                event = self._waiting.setdefault(oid, threading.Event())
            self.session.release_now(RELEASE_EARLY_AT)
            if not event.wait(self.session.wait_slice(0.5)) and self.session.past_deadline():
                return None

    @staticmethod
    def _note_sizes(act: Active, step: Step, result: Any) -> None:
        """Keep the sizes of this step's outputs that symbolic integers of later steps use."""
        outs: list[Any] = []
        sizing_flatten(result, outs)
        for i, t in zip(step.out_local, outs, strict=False):
            if i is not None and i in act.seq.sized:
                act.sizes[i] = tuple(t.shape)

    def _answer(self, act: Active, args: tuple, kwargs: dict) -> Any:
        """The host's reply to the current step (``ReplayAnswer``), as forwarding would have
        returned it: proxies with the sizes the host found, or a value. Waits for it if the
        app got here first. MISS if it never comes (the host failed, or is gone)."""
        key = (act.base, act.position)
        waited = False
        with self._lock:
            reply = self._answers.pop(key, None)
            if reply is None and self.session.lost is not None:
                return MISS
            if reply is None:
                event = self._waiting.setdefault(key, threading.Event())
        if reply is None:
            waited = True
            self.counters["answer_waits"] += 1
            self.session.release_now(RELEASE_EARLY_AT)
            while not event.wait(self.session.wait_slice(0.5)):
                if (self.session.lost is not None or act.seq.host_failed or act.base in self._broken
                        or self.session.past_deadline()):
                    break
            with self._lock:
                self._waiting.pop(key, None)
                reply = self._answers.pop(key, None)
            if reply is None:
                return MISS
        with self._lock:
            self._replied_base(act.base, waited)
        result = decode_answer(reply, self.session, self.session.app_device(args, kwargs))
        if result is MISS:
            return MISS
        step = act.seq.steps[act.position]
        if step.dense is None and type(result) is RemoteTensor and len(step.out_local) == 1:
            _answered_dense(act, step, result)
        if act.seq.sized:
            self._note_sizes(act, step, result)
        if act.seq.valued and isinstance(result, (bool, int, float)) and len(step.checks) == 1:
            _slot, kind, i = step.checks[0]  # ``item()`` answered: a value the app read
            n = int_of(result)
            if kind == _PRODUCED and i in act.seq.valued and n is not None:
                act.values[i] = n
        return result

    def _match(self, act: Active, args: tuple, kwargs: dict, info: OpInfo,
               grad_mode: int) -> list[Any] | tuple[()] | None:
        """The frames this call needs (inputs, rebinds), or None when it does not match."""
        step = act.seq.steps[act.position]
        if step.op != info.name or step.grad_mode != grad_mode:
            return None
        found: list[Any]
        flat = step.flat
        if flat is not None and not kwargs:  # the common case, without rebuilding structures
            count, tensors, rest = flat
            if len(args) != count:
                return None
            for i, v, vt, item_types in rest:
                a = args[i]
                # Exactly the recorded types (items too: a tensor in a list must never meet
                # ``==``, whose result would be an operator) make ``!=`` safe and exact.
                if type(a) is vt and (item_types is None or tuple(map(type, a)) == item_types):
                    if a != v:
                        return None
                elif not _same_plain(a, v):
                    return None
            found = [args[i] for i in tensors]
        else:
            wanted = _wanted(step, act)
            if wanted is None:
                return None
            want_args, want_kwargs = wanted
            found = []
            if _strip(list(args), found) != want_args:
                return None
            if kwargs or want_kwargs:
                if {k: _strip(kwargs[k], found) for k in sorted(kwargs)} != want_kwargs:
                    return None
            if len(found) != len(step.slots):
                return None
        frames: list[Any] | None = None  # messages, or wire.EncodedFrame for uploads
        bind: dict[int, Handle] | None = None  # committed only if the whole call matches
        sent: list[tuple[int, tuple[Any, ...], memoryview]] | None = None  # likewise
        bindings, canon = act.seq.bindings, act.seq.canon
        for (slot, kind, aux), t in zip(step.checks, found, strict=True):
            if isinstance(t, RemoteTensor):
                h = t._rrto_handle
            elif isinstance(t, torch.Tensor):
                h = None
            else:
                return None
            if kind == _PRODUCED:
                if h is None or h.id != act.base + aux and (
                        act.joined is None or act.joined.get(aux) != h.id):
                    return None
                continue
            if kind == _PERSISTENT and step.robot:
                # Run here on the app's own copy: nothing to bind on the host (but for a split
                # call the host makes rows of too: bound there as for a host call, below).
                if h is None or not self.session.local_is_current(h) or (h is not bindings.get(
                        canon[slot] if canon is not None else slot) and h.hash != aux):
                    return None
                if step.band is None or step.band[2] >= step.out_meta[0][1][rows.ROW]:
                    continue
            if kind == _PERSISTENT:
                # The host waits for each weight slot to be named once per session: the weight
                # may be used for the first time right here, and must be bound before use.
                if h is None or (self.session.diverged and h.id in self.session.diverged):
                    return None  # (written here: the host's copy is older; forwarded)
                bound = bindings.get(canon[slot] if canon is not None else slot)
                if bound is h:
                    continue  # its hash was checked when it was bound
                if h.hash != aux:
                    return None
                if bound is not None and act.position > 0:
                    # Another tensor of the same content where the host holds a binding (a
                    # twin model, a reloaded one): the host runs ahead on its bindings, so
                    # it may have used the old one already. Only a replay's first call can
                    # rebind (before any input of it is sent); later, it is a mismatch.
                    return None
                if bind is None:
                    bind = {}
                bind[slot] = h
                continue
            src = act.seq.definition.sources[slot]
            if kind == _INPUT and slot in step.fixed:
                # The recorded bytes, which the host already uses: only exactly those match.
                data, strides = step.fixed[slot]
                if (h is not None or _input_key(t) != step.input_keys.get(slot)
                        or tuple(codec.wire_layout(t) or ()) != strides):
                    return None  # another call (the first step's operator met elsewhere)
                if codec.raw_bytes(t if t.device.type == "cpu" else t.cpu()) != data:
                    # Recorded while it happened not to change (a warm-up on one dummy input):
                    # this sequence cannot serve the app's real inputs; record again at once.
                    (act.seq.root or act.seq).stale = True
                    return None
                continue
            if kind == _INPUT and step.robot and slot not in step.bands:
                # The app's own data, used here: checked, not sent.
                if h is not None or _input_key(t) != step.input_keys.get(slot):
                    return None
                continue
            if kind == _INPUT and h is not None and h.split:
                # A split region's value, which the host puts together (``rrtod.lop``): the
                # robot's first rows go up.
                if slot not in step.bands or h.local is None \
                        or _input_key(t) != step.input_keys.get(slot):
                    return None
                lo, hi = step.bands[slot]
                band = h.local.narrow(rows.ROW, lo, hi - lo).contiguous()
                if frames is None:
                    frames = []
                frames.append(self._upload(act.seq, slot, band))
                continue
            if kind == _INPUT and h is not None and h.hash is None and h.local is not None:
                # A value the robot made (``_on_robot``): its data is here, and goes up.
                t, h = downloads.shape_like(h.local, t), None
            if kind == _INPUT:
                key = _input_key(t)
                want = step.input_keys.get(slot)
                if key != want and not (
                        slot in step.any_shape and want is not None
                        and key[0] == want[0] and len(key[1]) == len(want[1])):
                    # (a tensor of the session too: the steps after this one were planned
                    # for the input's recorded sizes, and the host would run them on these)
                    return None
                if h is not None:
                    ref = ops_pb2.TensorRef(id=h.id)
                    if h.session is not self.session or not h.bound:
                        return None
                    frame: Any = ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=slot, tensor=ref))
                else:
                    if slot in step.bands:  # the host's band of an app input (``lop``)
                        lo, hi = step.bands[slot]
                        t = t.narrow(rows.ROW, lo, hi - lo).contiguous()
                    raw = codec.raw_bytes(t if t.device.type == "cpu" else t.cpu())
                    if sent is None:
                        sent = []
                    sent.append((slot, key, raw))
                    same = act.seq.repeat_of(slot, key, raw)
                    if same is not None:
                        frame = ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=slot, same_as=same))
                    else:
                        frame = self._upload(act.seq, slot, t)
                if frames is None:
                    frames = []
                frames.append(frame)
            elif h is None or h.id != src.id:  # CONSTANT: only the very tensor recorded
                # Another tensor in its place is a mismatch, never a rebind: the host runs
                # ahead of the app's matching, so it may have used (or found freed) the
                # recorded constant before a rebind could reach it.
                return None
        if sent is not None:  # the host keeps each as the slot's latest data too
            for slot, key, raw in sent:
                act.seq.sent[slot] = (key, bytes(raw))
                act.seq.recent[key] = slot
        if bind is not None:
            # Bindings go before this call's inputs: the host runs a call as soon as its
            # inputs are there, with the weights bound at that moment.
            binds: list[Any] = []
            for slot, h in bind.items():
                if not h.bound:  # a weight's first use since the app (re)started
                    self.session.bind(h)
                bindings[canon[slot] if canon is not None else slot] = h
                binds.append(ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(
                    slot=slot, tensor=ops_pb2.TensorRef(id=h.id))))
            frames = binds + (frames or [])
        return frames if frames is not None else ()

    @staticmethod
    def _describe(seq: Sequence, p: int, step: Step, func: Any, info: OpInfo) -> None:
        """Give the step its hot path description (``hotpath.py``) at its first answer."""
        if not seq.fast:
            seq.fast = [None] * len(seq.steps)
        if seq.fast[p] is None:
            seq.fast[p] = hotpath.describe(seq, step, func, info) or False

    def _dense(self, act: Active, step: Step) -> RemoteTensor | None:
        """A variable step's one new dense output made from the sizes the host pushed
        (``ReplaySizes``): no working out from the arguments. None where they are not here
        yet or do not fit the step (its rank; a joined value): the step is planned."""
        known = self._sizes.get(act.base)
        dims = known.get(act.position) if known is not None else None
        i, dtype, device, rank = step.dense  # type: ignore[misc]
        if dims is None or len(dims) != rank or (act.joined is not None and i in act.joined):
            return None
        try:
            proxy = new_proxy(Handle(self.session, act.base + i), dims,
                              codec.contiguous_strides(dims), 0, dtype, device)
        except (RuntimeError, OverflowError, ValueError, TypeError):  # sizes no tensor has
            return None  # (TypeError: strides past int64, which torch cannot unpack)
        self.counters["sized"] += 1
        return proxy

    def _outputs(self, act: Active, built: StepPlan, args: tuple, kwargs: dict,
                 info: OpInfo) -> Any:
        """The result of a step whose outputs are not one new tensor (tuples, in-place)."""
        session, base = self.session, act.base
        handles = [None if i is None else Handle(session, base + i) for i in built.plan]
        return materialize(built.template, handles, info, args, kwargs, built.device)

    def _plan(self, step: Step, func: Any, args: tuple, kwargs: dict,
              info: OpInfo) -> StepPlan:
        """Worked out at the step's first replay and kept: the result's template, and per
        output the local index of its new id (None: the result is the matched argument)."""
        built = self.session.output_template(func, args, kwargs)
        if built is None or len(built[1]) != len(step.out_local):
            raise _Unreplayable  # shapes depend on data, or not the recorded outputs
        tmpl, outs = built
        # The host lays each output out as recorded: the proxies must say the same layout.
        if step.out_meta and not step.variable and [
                (o.dtype, tuple(o.shape), tuple(o.stride), o.offset) for o in outs] != step.out_meta:
            raise _Unreplayable
        plan: list[int | None] = []
        for k, i in enumerate(step.out_local):
            alias = (info.ret_alias[k] if k < len(info.ret_alias)
                     and len(outs) == len(info.ret_alias) else None)
            if alias is not None:
                plan.append(None)  # the result is the (matched) argument itself
            elif i is not None:
                plan.append(i)
            else:
                raise _Unreplayable  # an existing value returned as new: forward instead
        single = multi = None
        if None not in plan:
            made: tuple[NewOutput, ...] = tuple(
                (i, o.shape, o.stride, o.offset, o.dtype) for i, o in zip(plan, outs, strict=True))
            if len(outs) == 1 and tmpl is outs[0]:
                single = made[0]
            elif type(tmpl) is tuple and len(tmpl) == len(outs) and all(
                    a is b for a, b in zip(tmpl, outs, strict=True)):
                multi = made
        return StepPlan(tmpl, outs, plan, self.session.app_device(args, kwargs), single, multi)

    def _give_up_sequence(self, seq: Sequence) -> None:
        if self._remove(seq.id):
            self.counters["dropped"] += 1
            self.session.send_frames([ops_pb2.SessionUp(define=ops_pb2.SequenceDef(id=seq.id))])

    def _tell_given_up(self) -> None:
        with self._lock:
            ids, self._give_up = self._give_up, []
        self.session.send_frames([ops_pb2.SessionUp(define=ops_pb2.SequenceDef(id=i))
                                  for i in ids])

    def _mismatch(self, act: Active) -> None:
        seq = act.seq.root or act.seq
        self.session.send_frames([ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(
            position=act.position))])
        self._aborted[act.base] = act.position
        self._set_active(None)
        self._tls.resumable = _resume_point(act)
        self._tls.left = True
        self.counters["mismatches"] += 1
        seq.mismatches += 1
        if seq.mismatches >= GIVE_UP_AFTER or seq.stale:
            self._give_up_sequence(seq)  # control flow that keeps changing: record again

    # ----- downloads -----
    def is_replayed(self, oid: int) -> bool:
        return REPLAY_BASE <= oid < HOST_ID_BASE

    def take(self, oid: int) -> ops_pb2.TensorData | None:
        """The pushed value of a replayed output, waiting for it; None when it is not pushed
        (not an output of the sequence, or the app reads it before its final write: then the
        replay is aborted here and the caller fetches it the usual way)."""
        act = self.active
        i = -1
        if act is not None and act.base <= oid < act.base + SPAN:
            i = oid - act.base
            if i not in act.seq.outputs or act.seq.last_writer.get(i, 0) >= act.position:
                self._mismatch(act)
                return None
        with self._lock:
            data = self._pushed.pop(oid, None)
            if data is not None and not self._expects(oid):
                # Pushed by a host that ran ahead past where the app went another way: later
                # calls wrote it (a view of it) after that. The host's tensor is fetched.
                data = None
            if data is not None:
                self._replied(oid, waited=False)
                if i in act_robot_reads(act):  # a robot step reads it too
                    act.taken[oid] = data  # type: ignore[union-attr]
                if act is not None and i in act.seq.valued:
                    self._note_value(act, i, data)
                return data
            # (a loss set ``lost`` before waking the waits: ``wake``)
            expected = self._expects(oid) and self.session.lost is None
            if expected:
                event = self._waiting.setdefault(oid, threading.Event())
        if not expected:
            self._made_nowhere(oid)
            return None
        self.session.release_now(RELEASE_EARLY_AT)  # the host is still computing: help it
        while not event.wait(self.session.wait_slice(0.5)):
            if self.session.lost is not None or self.session.past_deadline():
                return None
        with self._lock:
            data = self._pushed.pop(oid, None)
            if data is not None:
                self._replied(oid, waited=True)
                if i in act_robot_reads(act):
                    act.taken[oid] = data  # type: ignore[union-attr]
                if act is not None and i in act.seq.valued:
                    self._note_value(act, i, data)
        if data is None:
            self._made_nowhere(oid)
        return data

    def _made_nowhere(self, oid: int) -> None:
        """A read of ``oid`` with nothing pushed: if its inference's sequence failed on the
        host without saying where (``failed``), the host may never have made it, and the
        inference is finished here (``session.finish_here``): the read is then served from
        the journal's values (``downloads.read_value``)."""
        seq = self._bases.get(REPLAY_BASE + ((oid - REPLAY_BASE) // SPAN) * SPAN)
        if seq is not None and seq.host_failed:
            self.session.finish_here("replay")

    @staticmethod
    def _note_value(act: Active, i: int, data: ops_pb2.TensorData) -> None:
        """Keep a value the app read that later steps take as an integer argument
        (``SymbolicInt.value``): those steps match only the integer the app computes from it."""
        n = int_of(scalar_of(data))
        if n is not None:
            act.values[i] = n

    def _replied(self, oid: int, waited: bool) -> None:
        """A pushed output was read (under the lock). The first one read of an inference is
        the reply to its start frame (``replay_replies``): one round trip the app's inference
        depended on, whether or not it arrived before the app read it; ``push_waits`` counts
        those the app had to wait for. (``round_trips`` stays the replies to requests.)"""
        self._replied_base(REPLAY_BASE + ((oid - REPLAY_BASE) // SPAN) * SPAN, waited)

    def _replied_base(self, base: int, waited: bool) -> None:
        if base in self._replied_bases:
            return
        self._replied_bases.add(base)
        counters = self.session.counters
        counters["replay_replies"] += 1
        if waited:
            counters["push_waits"] += 1

    def rewritten(self, oid: int) -> None:
        """A forwarded call writes ``oid`` in place: if a replay made it, the value its host
        pushed (or will push) is not its value any more, and a read fetches it. The app left
        that replay before the write (its calls are forwarded), so no definition says the
        write comes: a loop cut at a branch no variant has (``Sequence.cut``), or an app that
        went another way and writes a value it has not read yet."""
        if self.is_replayed(oid):
            with self._lock:
                self._pushed.pop(oid, None)
                self._rewritten.add(oid)

    def _expects(self, oid: int) -> bool:
        """Whether the host will push ``oid``: an output of the sequence, finalised before
        any mismatch of its inference, and before any call the host failed in it, and not
        written by a call forwarded since (``rewritten``)."""
        base = REPLAY_BASE + ((oid - REPLAY_BASE) // SPAN) * SPAN
        seq = self._bases.get(base)
        if seq is None or seq.host_failed or oid in self._rewritten:
            return False
        cut = self._aborted.get(base)
        if base in self._broken:
            cut = min(cut if cut is not None else SPAN, self._broken[base][0])
        i = oid - base
        return i in seq.outputs and (cut is None or seq.last_writer.get(i, 0) < cut)

    def _forget_before(self, base: int) -> None:
        """Pushed values of old inferences the app never read (it dropped the proxies)."""
        with self._lock:
            for oid in [o for o in self._pushed if o < base]:
                del self._pushed[oid]
            self._rewritten = {o for o in self._rewritten if o >= base}
            for b in [b for b in self._aborted if b < base]:
                del self._aborted[b]
            for b in [b for b in self._bases if b < base]:
                del self._bases[b]
            for key in [k for k in self._answers if k[0] < base]:
                del self._answers[key]
            for b in [b for b in self._sizes if b < base]:
                del self._sizes[b]
            for b in [b for b in self._broken if b < base]:
                del self._broken[b]
            self._replied_bases = {b for b in self._replied_bases if b >= base}
