"""Splitting a sequence between robot and host (``rrtod.partition``): which calls must stay
together, what crosses the cut and how, and what both replay ends make of a split definition
(the host skips the robot's calls and takes their values as inputs)."""

from __future__ import annotations

import statistics
import struct

import pytest

from rrto.v1 import ops_pb2
from rrtod import partition
from rrtod.gpu.replay import HostReplayer, compile_sequence
from rrtod.robot.scheduling import Scheduling
from testkit.numbers import NumberExecutor, num

MS = 1_000_000

SRC = ops_pb2.SeqSource
META = ops_pb2.TensorMeta(dtype="float64", shape=[], stride=[])


def written(c: ops_pb2.OpCall) -> list[int] | None:
    if c.op == "opaque":
        return None
    return [c.args[1].tensor.id] if c.op == "bump" else []


def viewed(c: ops_pb2.OpCall) -> list[int] | None:
    if c.op == "opaque":
        return None
    if c.op in ("view", "relu_"):
        return [c.args[0].tensor.id]
    return [0] * len(c.out_ids)


def call(op: str, out: int, *refs: ops_pb2.TensorRef, meta: ops_pb2.TensorMeta = META
         ) -> ops_pb2.OpCall:
    c = ops_pb2.OpCall(op=op, out_ids=[out], out_meta=[meta])
    for r in refs:
        c.args.add().tensor.CopyFrom(r)
    return c


def ref(i: int) -> ops_pb2.TensorRef:
    return ops_pb2.TensorRef(id=i)


def upload() -> ops_pb2.TensorRef:
    return ops_pb2.TensorRef(upload=ops_pb2.TensorData(meta=META))


def weight(i: int) -> ops_pb2.TensorRef:
    return ops_pb2.TensorRef(id=i)


def chain() -> ops_pb2.SequenceDef:
    """a = x + w;  b = a * a;  relu_(b);  c = b + w;  d = c * c.   out: d. Ids 1..4, w is 50."""
    d = ops_pb2.SequenceDef(id=3, local_ids=[1, 2, 3, 4], outputs=[4])
    d.calls.extend([call("add", 1, upload(), weight(50)), call("mul", 2, ref(1), ref(1)),
                    call("relu_", 2, ref(2)), call("add", 3, ref(2), weight(50)),
                    call("mul", 4, ref(3), ref(3))])
    for kind, i in [(SRC.INPUT, 0), (SRC.PERSISTENT, 50), (SRC.PRODUCED, 1), (SRC.PRODUCED, 1),
                    (SRC.PRODUCED, 2), (SRC.PRODUCED, 2), (SRC.PERSISTENT, 50),
                    (SRC.PRODUCED, 3), (SRC.PRODUCED, 3)]:
        d.sources.add(kind=kind, id=i, hash=b"w" if kind == SRC.PERSISTENT else b"")
    return d


def test_a_value_and_the_calls_that_write_it_in_place_form_one_group():
    v = partition.view(chain(), written, viewed)
    groups = [c.group for c in v.calls]
    assert groups[1] == groups[2]  # b and relu_(b)
    assert len({groups[0], groups[1], groups[3], groups[4]}) == 4
    assert [c.reads for c in v.calls] == [(), (0,), (1,), (1,), (3,)]
    assert all(c.movable for c in v.calls) and v.downloads == (4,)
    assert v.calls[0].input_bytes == 8 and v.calls[1].out_bytes == 8


def test_calls_that_keep_state_read_constants_or_are_unknown_stay_on_the_host():
    d = chain()
    d.calls[3].op = "opaque"  # the backend does not know its aliasing
    d.calls[0].args[1].tensor.id = 60
    d.sources[1].CopyFrom(SRC(kind=SRC.CONSTANT, id=60))  # a constant of an earlier inference
    v = partition.view(d, written, viewed)
    assert [c.movable for c in v.calls] == [False, True, True, False, True]
    with pytest.raises(ValueError, match="must run on the host"):
        partition.split(d, ["host", "host", "host", "robot", "host"], written, viewed)


def test_a_placement_that_splits_a_group_is_refused():
    with pytest.raises(ValueError, match="apart from the values"):
        partition.split(chain(), ["host", "robot", "host", "host", "host"], written, viewed)


def test_a_value_read_before_its_last_write_stays_with_its_writer():
    """b is read by call 2 before relu_ writes it at call 3: reading a copy of it elsewhere
    would see the old value for call 2 but never the write."""
    d = chain()
    d.calls[2].CopyFrom(call("add", 5, ref(2), weight(50)))  # reads b
    d.calls[3].CopyFrom(call("relu_", 2, ref(2)))  # then b is written
    d.calls[4].CopyFrom(call("mul", 4, ref(5), ref(2)))
    d.local_ids[:] = [1, 2, 5, 4]
    del d.sources[:]
    for kind, i in [(SRC.INPUT, 0), (SRC.PERSISTENT, 50), (SRC.PRODUCED, 1), (SRC.PRODUCED, 1),
                    (SRC.PRODUCED, 2), (SRC.PERSISTENT, 50), (SRC.PRODUCED, 2),
                    (SRC.PRODUCED, 5), (SRC.PRODUCED, 2)]:
        d.sources.add(kind=kind, id=i, hash=b"w" if kind == SRC.PERSISTENT else b"")
    groups = [c.group for c in partition.view(d, written, viewed).calls]
    assert groups[1] == groups[2] == groups[3]


def test_a_view_with_an_offset_does_not_cross_the_cut():
    d = chain()
    for k in (1, 2):  # b, as made and as relu_ leaves it
        d.calls[k].out_meta[0].CopyFrom(ops_pb2.TensorMeta(dtype="float64", shape=[2],
                                                           stride=[2], storage_offset=1))
    groups = [c.group for c in partition.view(d, written, viewed).calls]
    assert groups[1] == groups[2] == groups[3]  # b is read by call 3: with it


ROBOT_ENDS = ["robot", "host", "host", "host", "robot"]


def placed_chain() -> ops_pb2.SequenceDef:
    return partition.with_plan(chain(), partition.split(chain(), ROBOT_ENDS, written, viewed))


def test_a_placement_is_a_plan_of_the_definition_and_plans_are_only_appended():
    d = placed_chain()
    assert [list(p.robot_calls) for p in d.plans] == [[0, 4]] and d.plan == 1
    assert partition.plan_calls(d, 1) == {0, 4} and partition.plan_calls(d, 0) == set()
    again = partition.with_plan(d, frozenset({0, 4}))
    assert again == d  # the same placement: the same plan
    other = partition.with_plan(d, frozenset({0}))
    assert [list(p.robot_calls) for p in other.plans] == [[0, 4], [0]] and other.plan == 2
    home = partition.with_plan(other, frozenset())
    assert len(home.plans) == 2 and home.plan == 0
    assert partition.split(chain(), ["host"] * 5, written, viewed) == frozenset()
    with pytest.raises(ValueError, match="no plan 3"):
        partition.plan_calls(other, 3)


def test_rewrite_is_what_crosses_the_cut():
    """Robot: a = x + w and d = c * c; host: b, relu_(b), c. The host reads a as an input,
    the robot reads c as a pushed output; d, made on the robot, is no longer an output."""
    rewritten = partition.rewrite(placed_chain(), frozenset({0, 4}))
    assert not rewritten.plans and rewritten.plan == 0
    assert rewritten.sources[2].kind == SRC.INPUT and rewritten.sources[3].kind == SRC.INPUT
    first = rewritten.calls[1].args[0].tensor
    assert first.WhichOneof("ref") == "upload" and first.upload.meta == META
    assert list(rewritten.outputs) == [3]
    assert list(chain().outputs) == [4]  # the definition itself is untouched


def test_dynamic_sequences_are_never_split():
    d = chain()
    d.varies_from = 2
    assert partition.why_not_split(d) == "its shapes vary"
    with pytest.raises(ValueError, match="whole"):
        partition.split(d, ["robot"] + ["host"] * 4, written, viewed)


def test_the_host_skips_robot_calls_and_takes_their_values_as_inputs():
    """The robot computed a = 3 (x = 1, w = 2): the host gets it as call 1's input, runs b, c
    and pushes c; it never runs the robot's calls. The same sequence defined again with
    another plan keeps the weight the app bound; a start may name either plan."""
    placed = placed_chain()
    ex = NumberExecutor()
    ex.store[50] = 2.0
    ex.handle = _with_relu(ex.handle)
    r = HostReplayer(ex)
    out: list[ops_pb2.SessionDown] = []
    r.process(ops_pb2.SessionUp(define=placed), out.append)
    assert out[0].defined.accepted, out[0].defined.reason
    base = 1 << 20
    frames = [ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=3, base_id=base, plan=1)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=6, tensor=ref(50))),
              *(ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=s, tensor=ops_pb2.TensorRef(
                  upload=num(3.0)))) for s in (2, 3))]
    out.clear()
    for f in frames:
        r.process(f, out.append)
    pushed = [(d.fetched.id, struct.unpack("<d", d.fetched.tensor.data)[0]) for d in out]
    assert pushed == [(base + 2, 9.0 + 2.0)]  # c = relu(3 * 3) + 2
    assert ex.calls == ["mul", "add_", "add"]  # (relu_ runs as add_ of 0 here)
    profile = [d.profile for d in out if d.WhichOneof("msg") == "profile"]
    assert not profile  # (after ``PROFILED`` replays of a plan)
    again = partition.with_plan(placed, frozenset({0}))  # now only a = x + w on the robot
    out.clear()
    r.process(ops_pb2.SessionUp(define=again), out.append)
    assert out[0].defined.accepted, out[0].defined.reason
    out.clear()
    for f in [ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=3, base_id=2 * base, plan=2)),
              *frames[2:]]:  # no rebind of the weight: it is still bound
        r.process(f, out.append)
    pushed = [(d.fetched.id, struct.unpack("<d", d.fetched.tensor.data)[0]) for d in out
              if d.WhichOneof("msg") == "fetched"]
    assert pushed == [(2 * base + 3, 11.0 * 11.0)]  # d = c * c, on the host now
    out.clear()
    r.process(ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=3, base_id=3 * base,
                                                          plan=3)), out.append)
    assert out[0].error.code == "BAD_START"


def _with_relu(handle):
    def wrapped(frame):
        if frame.WhichOneof("msg") == "call" and frame.call.op == "relu_":
            frame.call.op = "add_"  # x + 0: relu of a positive number
            frame.call.args.add().tensor.CopyFrom(ops_pb2.TensorRef(upload=num(0.0)))
            result = list(handle(frame))
            return iter(result)
        return handle(frame)
    return wrapped


def test_the_host_refuses_a_split_that_reads_what_only_the_robot_has():
    robot = frozenset({0, 4})
    rewritten = partition.rewrite(chain(), robot)
    rewritten.sources[2].CopyFrom(SRC(kind=SRC.PRODUCED, id=1))  # a, as if the host had it
    with pytest.raises(ValueError, match="only the robot makes"):
        compile_sequence(rewritten, robot=robot)
    rewritten = partition.rewrite(chain(), robot)
    rewritten.outputs.append(4)
    with pytest.raises(ValueError, match="made by the robot"):
        compile_sequence(rewritten, robot=robot)
    bad = placed_chain()
    bad.plans[0].robot_calls[:] = [4, 0]
    r, out = HostReplayer(NumberExecutor()), []
    r.process(ops_pb2.SessionUp(define=bad), out.append)
    assert not out[0].defined.accepted and "ascend" in out[0].defined.reason


class _Registry:
    def __init__(self, scheduler, aliasing=None):
        self.scheduler, self.aliasing = scheduler, aliasing

    def get(self, family, name):
        if family == "scheduler":
            return type("R", (), {"factory": self.scheduler})
        return type("R", (), {"aliasing": self.aliasing})


class _Config:
    scheduler = "test"
    intercept = type("I", (), {"backend": "numbers"})
    switch_plans = False


class _Switching(_Config):
    switch_plans = True


def test_a_scheduler_that_fails_or_cuts_badly_costs_the_split_not_the_sequence():
    class Broken:
        def place(self, sequence, link=None):
            raise RuntimeError("no")

    class SplitsGroups:
        def place(self, sequence, link=None):
            return ["host", "robot", "host", "host", "host"]

    for scheduler in (Broken, SplitsGroups):
        s = Scheduling(_Registry(scheduler, lambda: (written, viewed)), _Config())
        assert s.session().place(chain()) == chain() and s.refused == 1


def test_a_scheduler_that_never_splits_loads_no_aliasing():
    class Never:
        splits = False

        def place(self, sequence, link=None):
            raise AssertionError("not asked")

    def aliasing():
        raise AssertionError("not loaded")

    s = Scheduling(_Registry(Never, aliasing), _Config())
    assert s.session().place(chain()) == chain()


def test_profiles_reach_the_scheduler_and_a_changed_placement_is_a_new_plan():
    """The scheduler sees the times measured so far: none at first (every call on the host),
    the host's after its profile (every call on the robot, to measure them there), both after
    the robot's (the robot's ends only). Each change is a new plan of the same sequence."""
    seen = []

    class Measuring:
        def place(self, v, link=None):
            seen.append((v.host_ns, v.robot_ns, link.mbit_s))
            if not v.host_ns or None in v.host_ns:
                return ["host"] * 5
            if None in v.robot_ns:
                return ["robot"] * 5
            return ROBOT_ENDS

    s = Scheduling(_Registry(Measuring, lambda: (written, viewed)), _Config())
    placer = s.session()
    d = placer.place(chain())
    assert d.plan == 0 and not d.plans and seen == [((None,) * 5, (None,) * 5, None)]
    host = ops_pb2.SequenceProfile(sequence=3, plan=0, call_ns=[10, 20, 30, 40, 50])
    d = placer.profiled(host, robot_side=False, mbit_s=100.0)
    assert d is not None and d.plan == 1 and list(d.plans[0].robot_calls) == [0, 1, 2, 3, 4]
    assert seen[-1] == ((10.0, 20.0, 30.0, 40.0, 50.0), (None,) * 5, 100.0)
    robot = ops_pb2.SequenceProfile(sequence=3, plan=1, call_ns=[1, 2, 3, 4, 5])
    d = placer.profiled(robot, robot_side=True)
    assert d is not None and d.plan == 2 and list(d.plans[1].robot_calls) == [0, 4]
    assert seen[-1][1] == (1.0, 2.0, 3.0, 4.0, 5.0)
    assert placer.profiled(robot, robot_side=True) is None  # nothing changed
    assert s.replaced == 2
    assert placer.place(chain()) == d  # the same sequence offered again: as placed


def test_plans_are_the_placers_alone():
    """A definition offered with plans of its own (fuzzing found one naming calls it does not
    have) is placed afresh: the plans sent are the ones the placer made."""
    offered = chain()
    offered.plans.add().robot_calls[:] = [7, 3]
    offered.plan, offered.profile = 1, True
    s = Scheduling(_Registry(lambda: type("P", (), {"place": lambda self, v, link=None:
                                                     ROBOT_ENDS})(),
                             lambda: (written, viewed)), _Config())
    d = s.session().place(offered)
    assert [list(p.robot_calls) for p in d.plans] == [[0, 4]] and d.plan == 1
    assert partition.plan_calls(d, d.plan) == {0, 4}


def test_the_apps_latency_per_placement_reaches_the_scheduler():
    """Each placement's latency as the app timed it (inference marks) goes to the scheduler
    once ``SKIPPED + MEASURED`` of its inferences ran alone: the median of the measured ones,
    by the calls it puts on the robot. A sequence seen replaying with another in one inference
    is never timed: the scheduler is told so (None) at once, and places it by its model."""
    from rrtod.robot.scheduling import MEASURED, SKIPPED

    seen = []

    class Timed:
        def place(self, v, link=None):
            seen.append(v.measured_ns)
            return ROBOT_ENDS if v.measured_ns and frozenset() in v.measured_ns else ["host"] * 5

    s = Scheduling(_Registry(Timed, lambda: (written, viewed)), _Config())
    placer = s.session()
    d = placer.place(chain())
    assert d.plan == 0 and seen == [{}]
    for n in range(SKIPPED + MEASURED - 1):
        assert placer.timed([(3, 0)], (100 + n) * MS) == []
    assert placer.timed([(3, 1)], MS) == []  # a plan it does not run now: not its latency
    assert placer.timed([(3, 0)], 7 * MS) == [3]  # the last one: placed again
    d = placer.again(3)
    assert d is not None and d.plan == 1 and list(d.plans[0].robot_calls) == [0, 4]
    assert seen[-1] == {frozenset(): statistics.median(
        [(100 + n) * MS for n in range(SKIPPED, SKIPPED + MEASURED - 1)] + [7 * MS])}
    assert placer.timed([(3, 0)], MS) == []  # measured already
    assert placer.timed([(3, 1), None], MS) == [3]  # with a join: never timed again
    placer.again(3)
    assert seen[-1] is None
    assert placer.timed([(3, 1)], MS) == [] and placer.timed([(3, 1), (4, 0)], MS) == []


def test_the_host_times_the_calls_it_runs_in_a_plans_first_replays():
    """A definition the scheduler places by measured times (``profile``): after ``PROFILED``
    replays of a plan the host reports per call what it took, 0 for the robot's calls."""
    from rrtod.gpu.replay import PROFILED

    placed = placed_chain()
    placed.profile = True
    ex = NumberExecutor()
    ex.store[50] = 2.0
    ex.handle = _with_relu(ex.handle)
    r, out = HostReplayer(ex), []
    r.process(ops_pb2.SessionUp(define=placed), out.append)
    for n in range(1, PROFILED + 1):
        for f in [ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=3, base_id=n << 20,
                                                              plan=1)),
                  ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=6, tensor=ref(50))),
                  *(ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=s, tensor=ops_pb2.TensorRef(
                      upload=num(3.0)))) for s in (2, 3))]:
            r.process(f, out.append)
    r.process(ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=3, base_id=9 << 20)),
              out.append)  # the last replay ends when the next one starts
    (profile,) = [d.profile for d in out if d.WhichOneof("msg") == "profile"]
    assert profile.sequence == 3 and profile.plan == 1 and profile.replays == PROFILED
    assert profile.call_ns[0] == profile.call_ns[4] == 0  # the robot's
    assert all(ns > 0 for ns in profile.call_ns[1:4])
    # each replay that ran to its end says how its uploaded data arrived (plan switching)
    timings = [d.timing for d in out if d.WhichOneof("msg") == "timing"]
    assert len(timings) == PROFILED
    assert all(t.sequence == 3 and t.plan == 1 and t.upload_bytes == 2 * len(num(3.0).data)
               and t.upload_ns > 0 for t in timings)


class _ByLink:
    """Both ends on the robot below 15 Mbit/s, all on the host above; what it saw, kept."""

    seen: list = []

    def place(self, v, link=None):
        self.seen.append((link.mbit_s, v.measured_ns))
        return ROBOT_ENDS if link.mbit_s is not None and link.mbit_s < 15 else ["host"] * 5


def _banded():
    _ByLink.seen = []
    s = Scheduling(_Registry(_ByLink, lambda: (written, viewed)), _Switching())
    placer = s.session()
    d = placer.place(chain())
    assert d.plan == 0 and placer.band is None
    assert placer.observe(50.0) == []  # the first throughput: the band of what was placed
    return s, placer


def test_each_band_of_the_link_has_its_plan_and_a_known_plan_is_switched_to_at_once():
    """The link's throughput moving to another band runs that band's plan: placed when the
    band is new to the sequence (a new plan), taken from before when it is not (no new plan,
    the scheduler not asked). Within ``HYSTERESIS`` of its band the link stays in it."""
    from rrtod.robot.scheduling import HYSTERESIS, band_of

    s, placer = _banded()
    (d,) = placer.observe(8.0)
    assert d.plan == 1 and list(d.plans[0].robot_calls) == [0, 4] and s.switched == 1
    assert _ByLink.seen[-1][0] == pytest.approx((7 * 14) ** 0.5)  # for the band's middle
    asked = len(_ByLink.seen)
    (d,) = placer.observe(60.0)
    assert d.plan == 0 and len(d.plans) == 1  # back: the plan both ends hold, unchanged
    (d,) = placer.observe(9.0)
    assert d.plan == 1 and len(d.plans) == 1 and len(_ByLink.seen) == asked
    assert placer.observe(11.0) == []  # the same band
    edge = 14.0  # band [7, 14): 15 is within its hysteresis; 21 is in [14, 28), on the host
    assert band_of(edge * 1.07) != placer.band and edge * 1.07 < edge * HYSTERESIS
    assert placer.observe(edge * 1.07) == [] and placer.band == band_of(9.0)
    (d,) = placer.observe(edge * 1.5)
    assert d.plan == 0 and placer.band == band_of(edge * 1.5)
    assert placer.describe()["switches"] == s.switched == 4


def test_without_switch_plans_the_link_is_not_followed():
    """``switch_plans`` off (the default): what the link reads changes no plan, and there is
    one band (None) in which everything is placed and measured."""
    s = Scheduling(_Registry(_ByLink, lambda: (written, viewed)), _Config())
    placer = s.session()
    placer.place(chain())
    assert placer.observe(8.0) == [] and placer.observe(50.0) == [] and placer.band is None
    assert not s.follows_link and s.switched == 0


def test_a_band_placed_before_a_profile_is_placed_again_when_the_link_is_back_in_it():
    """A profile (or a measurement) the scheduler places with in one band makes every other
    band's placement stale: each is made again at its next visit, with what is known then."""
    s, placer = _banded()
    placer.observe(8.0)  # band [7, 14): the robot's ends
    placer.observe(50.0)
    asked = len(_ByLink.seen)
    placer.profiled(ops_pb2.SequenceProfile(sequence=3, plan=0, call_ns=[1, 2, 3, 4, 5]),
                    robot_side=False)
    (d,) = placer.observe(9.0)
    assert d.plan == 1 and len(_ByLink.seen) == asked + 2  # the profile's, and band 3 again


def test_the_apps_latencies_are_measured_in_the_sequences_first_band_only():
    """Measuring a placement takes inferences in one band: in the band a sequence was first
    placed in the scheduler gets what the app measured; in any other it places by its model
    (``measured_ns`` None), and inferences there time nothing."""
    from rrtod.robot.scheduling import MEASURED, SKIPPED

    s, placer = _banded()
    for _ in range(SKIPPED + MEASURED - 1):
        assert placer.timed([(3, 0)], 5 * MS) == []
    placer.observe(8.0)
    assert _ByLink.seen[-1][1] is None
    assert placer.timed([(3, 1)], 5 * MS) == []  # timed nothing: another band
    placer.observe(50.0)
    assert placer.timed([(3, 0)], 5 * MS) == [3]  # the first band's sixth inference
    placer.again(3)
    assert _ByLink.seen[-1][1] == {frozenset(): 5 * MS}


def test_a_replays_upload_timing_reads_the_links_throughput():
    """The host's ``ReplayTiming``: bytes over the time they took to land after the start; for
    a plan with robot calls ahead of the host's, less what those took (profiled); nothing
    read from too few bytes, or before the robot's calls are profiled."""
    from rrtod.robot.scheduling import MIN_CROSSING_BYTES

    s, placer = _banded()
    timing = ops_pb2.ReplayTiming(sequence=3, plan=0, upload_bytes=625_000, upload_ns=100 * MS)
    assert placer.uploaded(timing) == pytest.approx(50.0)
    timing.upload_bytes = MIN_CROSSING_BYTES - 1
    assert placer.uploaded(timing) is None
    (d,) = placer.observe(8.0)  # plan 1: calls 0 and 4 on the robot
    cut = ops_pb2.ReplayTiming(sequence=3, plan=1, upload_bytes=625_000, upload_ns=120 * MS)
    assert placer.uploaded(cut) is None  # call 0's time on the robot not known yet
    placer.profiled(ops_pb2.SequenceProfile(sequence=3, plan=1, call_ns=[20 * MS, 0, 0, 0,
                                                                         9 * MS]),
                    robot_side=True)
    assert placer.uploaded(cut) == pytest.approx(50.0)  # call 0 ran ahead; call 4 after
    cut.upload_ns = 24 * MS
    assert placer.uploaded(cut) is None  # the robot's compute would be most of it


def test_a_definition_the_host_accepted_reaches_the_shim_with_the_plan_chosen_since():
    s, placer = _banded()
    (sent,) = placer.observe(8.0)  # a new plan: to the host first
    placer.observe(50.0)  # and back, before the host answered
    assert placer.current(sent).plan == 0 and placer.current(sent).plans == sent.plans
    placer.observe(8.0)
    assert placer.current(sent) == sent
