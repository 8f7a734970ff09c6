"""Split a replayed sequence between the robot and the GPU host (a scheduler's placement).

A scheduler (``rrtod.hookspecs.Scheduler``) says, per call of a verified sequence, where it
runs. ``view`` describes the sequence as schedulers see it; ``split`` checks a placement,
``with_plan`` adds it to the definition as a plan (``SequenceDef.plans``: a replay names the
one it runs), and ``rewrite`` is what both ends replay for a plan:

- the host skips the robot's calls; a host call that reads a value the robot makes reads it as
  an INPUT, which the shim uploads when the app reaches that call;
- each value the host makes that a robot call reads is an output, pushed to the robot as soon
  as it is final; values the robot makes are no longer outputs (the app has them).

What may be split is decided on the values' storage, so that a placement cannot change a
result: a value, its views, the calls that write it in place and the calls that read it
before its last write form one *group*, which runs on one side (else one side would read a
stale copy). A call that writes state outliving the inference (a weight, a buffer), reads a
constant of an earlier inference, or whose operator's aliasing is unknown stays on the host.
Only sequences without loops, symbolic integers, varying shapes or answered calls are split
(their calls' outputs are known before they run); others run on the host whole.

Framework-neutral: the interception backend says what a call writes and views
(``InterceptionBackend.aliasing``), as it does for both replay ends (``wire.final_writes``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rrto.v1 import ops_pb2
from rrtod.wire import final_writes, iter_tensor_refs

SRC = ops_pb2.SeqSource
ROBOT, HOST = "robot", "host"
SPLIT = "split"  # a call both sides run, each on a band of rows (Hybrid-Parallel: ``Hybrid``)
# Per call: the ids of arguments it writes in place; per output, the id it views (0: new
# storage). None from either: the operator is unknown to the backend (the call stays home).
Written = Callable[[ops_pb2.OpCall], "list[int] | None"]
Viewed = Callable[[ops_pb2.OpCall], "list[int] | None"]

ITEMSIZE = {"float64": 8, "int64": 8, "complex64": 8, "float32": 4, "int32": 4,
             "float16": 2, "bfloat16": 2, "int16": 2, "bool": 1, "uint8": 1, "int8": 1}


@dataclass(frozen=True)
class CallView:
    """One call of a sequence as a scheduler sees it."""

    op: str  # qualified operator name
    reads: tuple[int, ...]  # the earlier calls whose values it reads
    out_bytes: int  # bytes of the values it makes
    input_bytes: int  # bytes of the app's inputs it reads
    group: int  # calls of one group run on the same side (see the module's docstring)
    movable: bool  # it may run on the robot


@dataclass(frozen=True)
class SequenceView:
    """A verified sequence as a scheduler places it: ``calls`` in the app's order, the calls
    whose values the app downloads (``downloads``: they end on the robot), and what its calls
    took where, once measured."""

    id: int
    calls: tuple[CallView, ...]
    downloads: tuple[int, ...]
    # Per call, its time on the host and on the robot in ns, as the replays measured them so
    # far (``SequenceProfile``); None where not measured yet, empty before any profile.
    host_ns: tuple[float | None, ...] = ()
    robot_ns: tuple[float | None, ...] = ()
    # The app's latency of one inference (ns, a median) under each placement measured so far,
    # by the calls it put on the robot (an empty set: every call on the host). None: it cannot
    # be measured (the sequence replays with others in one inference): place by the model.
    measured_ns: Mapping[frozenset[Any], float] | None = field(default_factory=dict)
    # Where calls may be split by rows between robot and host (``rrtod.lop.Space``), given to
    # schedulers that split so (``parallel = True``); None otherwise.
    space: Any = None


class Hybrid(list):  # type: ignore[type-arg]
    """A placement that splits calls: per call ``ROBOT``, ``HOST`` or ``SPLIT`` (a split
    region's, ``rrtod.lop``), and ``split_at``, the robot's share of the rows at the region's
    edge. A plain list of sides is a placement without a split."""

    def __init__(self, sides: Iterable[str], split_at: float):
        super().__init__(sides)
        self.split_at = split_at


def key_of(robot: Iterable[int], split: Split | None = None) -> frozenset[Any]:
    """What names a placement among the measured ones (``SequenceView.measured_ns``): its
    robot calls, and its split's region and share if it has one."""
    key: frozenset[Any] = frozenset(robot)
    if split is not None:
        key = key | {(SPLIT, split.calls, split.at)}
    return key


def plan_key(d: ops_pb2.SequenceDef, plan: int) -> frozenset[Any]:
    return key_of(plan_calls(d, plan), plan_split(d, plan))


def check_region(d: ops_pb2.SequenceDef, calls: Iterable[int], written: Written,
                 viewed: Viewed, space: Any) -> None:
    """ValueError unless ``calls`` may be split by rows (``space``: the definition's
    ``lop.Space``): they form a region, each may run on the robot, and no call outside them
    writes a value they make (its two bands would go stale)."""
    calls = sorted(set(calls))
    why = why_not_split(d)
    if why is not None:
        raise ValueError(f"sequence {d.id} runs on the host whole: {why}")
    f = _facts(d, written, viewed)
    if any(not f.movable[k] for k in calls):
        raise ValueError(f"sequence {d.id}: a split call must run on the host")
    if space.region(calls) is None:
        raise ValueError(f"sequence {d.id}: the split calls are not a region (rrtod.lop)")
    inside = set(calls)
    made = {rid for k in inside for rid in d.calls[k].out_ids}
    for k, call in enumerate(d.calls):
        if k not in inside and set(written(call) or ()) & made:
            raise ValueError(f"call {k} ({call.op}) writes a value of the split region")


def why_not_split(d: ops_pb2.SequenceDef) -> str | None:
    """Why ``d`` runs on the host whole whatever the scheduler says; None if it may be split."""
    if d.loops:
        return "it has loops"
    if d.symbols:
        return "it has symbolic integers"
    if d.HasField("varies_from"):
        return "its shapes vary"
    if any(call.want_meta for call in d.calls):
        return "the host answers some of its calls"
    return None


def _bytes(m: ops_pb2.TensorMeta) -> int:
    n = ITEMSIZE.get(m.dtype, 4)
    for s in m.shape:
        n *= s
    return n


def _dense(m: ops_pb2.TensorMeta | None) -> bool:
    """Whether a value with metadata ``m`` fills its storage exactly (C-contiguous or another
    order of its dimensions, no offset): then a transfer keeps its layout bit for bit."""
    if m is None or m.storage_offset:
        return False
    dims = sorted((st, sh) for st, sh in zip(m.stride, m.shape, strict=False) if sh != 1)
    expect = 1
    for st, sh in dims:
        if st != expect:
            return False
        expect *= sh
    return len(m.stride) == len(m.shape)


class _Groups:
    """Union-find over call positions."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, k: int) -> int:
        while self.parent[k] != k:
            self.parent[k] = self.parent[self.parent[k]]
            k = self.parent[k]
        return k

    def union(self, a: int, b: int) -> None:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[max(a, b)] = min(a, b)


@dataclass
class _Facts:
    local: dict[int, int]  # recorded id -> local index
    maker: dict[int, int]  # local index -> the call that makes it (an output or a bound upload)
    output_of: dict[int, bool]  # local index -> made as a call's output (not an upload)
    meta: dict[int, ops_pb2.TensorMeta]  # local index -> its metadata after its last write
    reads: list[list[tuple[int, int]]]  # per call: (slot, local index) of PRODUCED sources
    groups: _Groups
    movable: list[bool]


def _facts(d: ops_pb2.SequenceDef, written: Written, viewed: Viewed) -> _Facts:
    local = {rid: i for i, rid in enumerate(d.local_ids)}
    n = len(d.calls)
    maker: dict[int, int] = {}
    output_of: dict[int, bool] = {}
    meta: dict[int, ops_pb2.TensorMeta] = {}
    reads: list[list[tuple[int, int]]] = []
    movable = [True] * n
    root: dict[int, int] = {}  # local index -> the local index whose storage it is
    members: dict[int, list[int]] = {}  # storage root -> calls that make, view or write it
    state: set[int] = set()  # ids outside the inference that its calls write (buffers)
    for call in d.calls:
        state.update(r for r in call.out_ids if r not in local)
        state.update(r for r in (written(call) or ()) if r not in local)
    slot = 0
    for k, call in enumerate(d.calls):
        wrote = written(call)
        views = viewed(call)
        if wrote is None or views is None:
            movable[k], wrote, views = False, [], []
        mine: list[tuple[int, int]] = []
        for ref in iter_tensor_refs(call):
            src = d.sources[slot]
            if src.kind == SRC.PRODUCED and src.id in local:
                mine.append((slot, local[src.id]))
            elif src.kind == SRC.CONSTANT or (src.kind == SRC.PERSISTENT and src.id in state):
                # its value lives on the host: made by an earlier inference, or a buffer the
                # inference updates there (the app's own copy is stale)
                movable[k] = False
            if ref.WhichOneof("ref") == "upload" and ref.bind_id in local:
                i = local[ref.bind_id]
                maker.setdefault(i, k)
                meta.setdefault(i, ref.upload.meta)
            slot += 1
        reads.append(mine)
        for j, rid in enumerate(call.out_ids):
            i = local.get(rid)
            if i is None:
                movable[k] = False  # writes a value that outlives the inference
                continue
            if i in maker:  # written in place and returned (its metadata may change:
                members.setdefault(root.get(i, i), []).append(k)  # ``transpose_``)
                if j < len(call.out_meta):
                    meta[i] = call.out_meta[j]
                continue
            maker[i], output_of[i] = k, True
            if j < len(call.out_meta):
                meta[i] = call.out_meta[j]
            src = local.get(views[j]) if j < len(views) and views[j] else None
            if src is not None:
                root[i] = root.get(src, src)
            members.setdefault(root.get(i, i), []).append(k)
        for rid in wrote:
            i = local.get(rid)
            if i is None:
                movable[k] = False  # a weight or buffer updated in place
                continue
            members.setdefault(root.get(i, i), []).append(k)
    final = final_writes(d, lambda c: written(c) or [], lambda c: viewed(c) or [])
    groups = _Groups(n)
    for calls in members.values():
        for k in calls[1:]:
            groups.union(calls[0], k)
    for k, mine in enumerate(reads):
        for _slot, i in mine:
            if i not in maker:
                continue
            if not output_of.get(i) or final.get(i, maker[i]) > k or not _dense(meta.get(i)):
                # an upload only its binder's side has, a value read before its last write, or
                # one whose layout a transfer would not keep (a view with gaps or an offset:
                # an operator on a copy of it may sum in another order)
                groups.union(k, maker[i])
                r = root.get(i, i)
                for w in members.get(r, ()):
                    groups.union(k, w)
    return _Facts(local, maker, output_of, meta, reads, groups, movable)


def view(d: ops_pb2.SequenceDef, written: Written, viewed: Viewed) -> SequenceView:
    """``d`` as a scheduler sees it. A group with a call that must stay home is not movable."""
    f = _facts(d, written, viewed)
    home = {f.groups.find(k) for k, m in enumerate(f.movable) if not m}
    calls = []
    slot = 0
    for k, call in enumerate(d.calls):
        inputs = 0
        for ref in iter_tensor_refs(call):
            if d.sources[slot].kind == SRC.INPUT and ref.WhichOneof("ref") == "upload":
                inputs += _bytes(ref.upload.meta)
            slot += 1
        g = f.groups.find(k)
        calls.append(CallView(
            op=call.op, reads=tuple(sorted({f.maker[i] for _s, i in f.reads[k] if i in f.maker})),
            out_bytes=sum(_bytes(m) for m in call.out_meta), input_bytes=inputs, group=g,
            movable=g not in home))
    downloads = tuple(sorted({f.maker[f.local[o]] for o in d.outputs
                              if o in f.local and f.local[o] in f.maker}))
    return SequenceView(d.id, tuple(calls), downloads)


def split(d: ops_pb2.SequenceDef, placement: list[str], written: Written,
          viewed: Viewed) -> frozenset[int]:
    """The calls ``placement`` (per call, ``ROBOT`` or ``HOST``) puts on the robot, checked.
    ValueError if the placement could change a result (a group split across sides, a call
    that must stay home placed on the robot) or ``d`` cannot be split at all."""
    if len(placement) != len(d.calls) or any(p not in (ROBOT, HOST) for p in placement):
        raise ValueError(f"a placement names {ROBOT!r} or {HOST!r} for each of the "
                         f"{len(d.calls)} calls")
    robot = frozenset(k for k, p in enumerate(placement) if p == ROBOT)
    if not robot:
        return robot
    why = why_not_split(d)
    if why is not None:
        raise ValueError(f"sequence {d.id} runs on the host whole: {why}")
    f = _facts(d, written, viewed)
    side: dict[int, str] = {}
    for k, p in enumerate(placement):
        if p == ROBOT and not f.movable[k]:
            raise ValueError(f"call {k} ({d.calls[k].op}) must run on the host")
        g = f.groups.find(k)
        if side.setdefault(g, p) != p:
            raise ValueError(f"call {k} ({d.calls[k].op}) is placed apart from the values it "
                             "shares storage with")
    return robot


def with_plan(d: ops_pb2.SequenceDef, robot: frozenset[int],
              split: Split | None = None) -> ops_pb2.SequenceDef:
    """``d`` with the plan that puts ``robot`` on the robot (and splits ``split``'s calls
    between both) as its current one: an existing plan with those calls, else a new one
    appended (plans are only ever appended)."""
    out = ops_pb2.SequenceDef()
    out.CopyFrom(d)
    if not robot and split is None:
        out.plan = 0
        return out
    calls = sorted(robot)
    both = list(split.calls) if split is not None else []
    at = split.at if split is not None else 0.0
    for k, plan in enumerate(out.plans):
        if list(plan.robot_calls) == calls and list(plan.split_calls) == both \
                and plan.split_at == at:
            out.plan = k + 1
            return out
    new = out.plans.add()
    new.robot_calls[:] = calls
    new.split_calls[:] = both
    new.split_at = at
    out.plan = len(out.plans)
    return out


@dataclass(frozen=True)
class Split:
    """A Hybrid-Parallel split: ``calls`` (a region, ``rrtod.lop``) run on both sides, the
    robot making the first ``at`` of the rows at the region's edge."""

    calls: tuple[int, ...]
    at: float


def plan_split(d: ops_pb2.SequenceDef, plan: int) -> Split | None:
    """The split of plan ``plan`` of ``d`` (None: it splits no call)."""
    if plan == 0 or plan > len(d.plans) or not d.plans[plan - 1].split_calls:
        return None
    p = d.plans[plan - 1]
    calls = tuple(p.split_calls)
    if list(calls) != sorted(set(calls)) or calls[-1] >= len(d.calls) \
            or set(calls) & set(p.robot_calls) or not 0.0 <= p.split_at <= 1.0:
        raise ValueError(f"sequence {d.id}: plan {plan}'s split calls must ascend, name its "
                         "calls, none of the robot's, and split at a share of the rows")
    why = why_not_split(d)
    if why is not None:
        raise ValueError(f"sequence {d.id} cannot be split: {why}")
    return Split(calls, p.split_at)


def plan_calls(d: ops_pb2.SequenceDef, plan: int) -> frozenset[int]:
    """The calls plan ``plan`` of ``d`` runs on the robot (0: none). ValueError if there is no
    such plan, its calls do not ascend or name no call of ``d``, or ``d`` cannot be split."""
    if plan == 0:
        return frozenset()
    if plan > len(d.plans):
        raise ValueError(f"sequence {d.id} has no plan {plan}")
    calls = list(d.plans[plan - 1].robot_calls)
    if calls != sorted(set(calls)) or (calls and calls[-1] >= len(d.calls)):
        raise ValueError(f"sequence {d.id}: plan {plan}'s calls must ascend and name its calls")
    why = why_not_split(d)
    if calls and why is not None:
        raise ValueError(f"sequence {d.id} cannot be split: {why}")
    return frozenset(calls)


def rewrite(d: ops_pb2.SequenceDef, robot: frozenset[int],
            split: frozenset[int] = frozenset()) -> ops_pb2.SequenceDef:
    """``d`` as both ends replay it with ``robot`` on the robot (its plans cleared): a host
    call that reads a value the robot makes reads it as an INPUT (an upload with the value's
    metadata), each host value a robot call reads is an output, and values the robot makes
    are outputs no more. The calls of a Hybrid-Parallel ``split`` region run on both sides,
    each making a band of their values' rows (``rrtod.lop``): a host call outside the region
    that reads one of them reads it as an INPUT too (the shim uploads the robot's band, the
    host puts the value together), and one the robot reads outside it is an output (the host
    pushes its band). Pure: the same on both ends, from the definition alone."""
    out = ops_pb2.SequenceDef()
    out.CopyFrom(d)
    del out.plans[:]
    out.plan = 0
    if not robot and not split:
        return out
    f = _facts(d, _writes_nothing, _views_nothing)
    pulled: set[int] = set()  # host values robot calls read
    slot = 0
    for k, call in enumerate(out.calls):
        for ref in iter_tensor_refs(call):
            src = out.sources[slot]
            if src.kind == SRC.PRODUCED and src.id in f.local:
                i = f.local[src.id]
                made_on_robot = f.maker.get(i) in robot
                made_split = f.maker.get(i) in split and k not in split
                if k in robot and not made_on_robot:
                    pulled.add(i)
                elif (k not in robot and made_on_robot) or (made_split and k not in robot):
                    # the robot's value, uploaded by the shim when the app reaches this call
                    src.Clear()
                    src.kind = SRC.INPUT
                    ref.Clear()
                    ref.upload.meta.CopyFrom(f.meta[i])
            slot += 1
    outputs = [o for o in d.outputs if f.maker.get(f.local.get(o, -1)) not in robot]
    known = set(outputs)
    outputs += [d.local_ids[i] for i in sorted(pulled) if d.local_ids[i] not in known]
    out.outputs[:] = outputs
    return out


def unplaced(d: ops_pb2.SequenceDef) -> ops_pb2.SequenceDef:
    """A copy of ``d`` without its plans (``plans``, ``plan``, ``profile``)."""
    base = ops_pb2.SequenceDef()
    base.CopyFrom(d)
    del base.plans[:]
    base.plan = 0
    base.profile = False
    return base


def without_plans(d: ops_pb2.SequenceDef) -> bytes:
    """``d`` serialized without its plans: two definitions of one sequence that a scheduler
    placed differently compare equal so, on both replay ends and in the robot daemon."""
    return unplaced(d).SerializeToString(deterministic=True)


def _writes_nothing(call: ops_pb2.OpCall) -> list[int]:
    return []


def _views_nothing(call: ops_pb2.OpCall) -> list[int]:
    return [0] * len(call.out_ids)


def placed(view_: SequenceView, robot: Iterable[int]) -> list[str]:
    """A placement with ``robot`` on the robot and everything else on the host."""
    on = set(robot)
    return [ROBOT if k in on else HOST for k in range(len(view_.calls))]

