"""Operator placement (``rrtod.hookspecs.Scheduler``): where each call of a replayed sequence
runs, asked by the robot daemon before it defines the sequence (``rrtod.robot.scheduling``).

``remote-all`` runs every call on the GPU host: the right choice whenever the link is fast
enough that shipping inputs and outputs beats local compute, and the baseline partitioning
schedulers are compared against. ``robot-all`` runs every call that may run on the robot there
(``rrtod.partition``: calls that keep state or read a constant of the host stay on the host):
the other end of the range, for a robot whose own compute beats its link. ``min-cut`` places
each sequence at the minimum-latency cut between them (``mincut``: DADS/MCOP) from the times
its replays measured and the link the robot daemon measured."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rrtod.hookspecs import PluginRecord, SchedulerFactory, hookimpl
from rrtod.partition import HOST, ROBOT, SPLIT, Hybrid, SequenceView


class RemoteAll:
    splits = False  # never places a call on the robot: the daemon skips the analysis

    def place(self, sequence: Any, link: Any = None) -> list[str]:
        calls = getattr(sequence, "calls", sequence)
        return ["host"] * len(calls)


class RobotAll:
    def place(self, sequence: SequenceView, link: Any = None) -> list[str]:
        return [ROBOT if c.movable else HOST for c in sequence.calls]


class MinCutScheduler:
    """``min-cut``: the minimum-latency cut for the link as measured now (``mincut``), from
    each call's measured times, kept only if the app's clock agrees. Its first replays measure:
    every call on the host until the host's times and that placement's latency are in, then
    every call that may on the robot until the robot's times and its latency are in; then the
    cut, and once the cut's latency is in too, whichever of the three the app measured
    fastest. A model of the link and of the calls' times predicts; what it leaves out (the
    shim's cost per call, queueing, a misread link) the measured latency does not. A sequence
    whose latency cannot be measured alone (``measured_ns`` None) runs at the cut."""

    def place(self, sequence: SequenceView, link: Any = None) -> list[str]:
        calls = sequence.calls
        host, robot = sequence.host_ns, sequence.robot_ns
        measured = sequence.measured_ns
        everywhere = [HOST] * len(calls)
        if not host or any(h is None for h in host) or _unmeasured(measured, everywhere):
            return everywhere
        movable = [ROBOT if c.movable else HOST for c in calls]
        if not robot or any(robot[k] is None for k, c in enumerate(calls) if c.movable) \
                or _unmeasured(measured, movable):
            return movable
        mbit_s, rtt_ms = getattr(link, "mbit_s", None), getattr(link, "rtt_ms", None)
        if not mbit_s or rtt_ms is None:
            return everywhere  # the link is not measured: as remote-all
        from .mincut import Link, min_cut  # networkx: loaded only when it is used

        cut = min_cut(sequence, [h or 0.0 for h in host], [r or 0.0 for r in robot],
                      Link.of(mbit_s, rtt_ms)).placement
        if not measured or _unmeasured(measured, cut):
            return cut
        best = min(measured, key=lambda k: measured[k])
        return [ROBOT if k in best else HOST for k in range(len(calls))]


class HybridParallel:
    """``hybrid-parallel``: the Hybrid-Parallel paper's local operator parallelism (LOP,
    ``rrtod.lop``: robot and host each compute a band of the rows of a region of local
    operators, the robot while the rest of the input crosses the link) with its scheduling
    strategy (LOSS, ``hybrid.solve``: differential evolution over the region and the robot's
    share of its rows). It measures as ``min-cut`` does (every call on the host, every call
    that may on the robot, the cut), then proposes the split LOSS predicts fastest for the link
    as measured now, and once the app has measured that too keeps whichever placement the app
    measured fastest. Where latencies cannot be measured (``measured_ns`` None) the model
    decides between the split and the cut. Without a split region it is ``min-cut``: as the
    paper says, LOSS then degrades to layer partitioning."""

    parallel = True  # given each sequence's ``lop.Space``

    def __init__(self) -> None:
        self._cut = MinCutScheduler()
        # per sequence, the split being measured: kept until the app has measured it (the
        # profiles that come in meanwhile would move the model's optimum, and each new split
        # would start measuring again)
        self._measuring: dict[int, tuple[frozenset[Any], Hybrid]] = {}

    def place(self, sequence: SequenceView, link: Any = None) -> list[str]:
        cut = self._cut.place(sequence, link)
        calls, measured = sequence.calls, sequence.measured_ns
        host, robot = sequence.host_ns, sequence.robot_ns
        if not host or any(h is None for h in host) or not robot \
                or any(robot[k] is None for k, c in enumerate(calls) if c.movable) \
                or _unmeasured(measured, cut):
            return cut  # min-cut's measurements first
        mbit_s, rtt_ms = getattr(link, "mbit_s", None), getattr(link, "rtt_ms", None)
        if not mbit_s or rtt_ms is None or sequence.space is None:
            return cut
        from .hybrid import solve  # scipy: loaded only when it is used
        from .mincut import Link, predicted_ns

        host_ns = [h or 0.0 for h in host]
        robot_ns = [r or 0.0 for r in robot]
        plan = solve(sequence, host_ns, robot_ns, Link.of(mbit_s, rtt_ms))
        if plan is None:
            return cut
        inside = set(plan.region.calls)
        split = Hybrid([SPLIT if k in inside else HOST for k in range(len(calls))], plan.at)
        if measured is None:  # the model decides
            by_cut = predicted_ns(sequence, cut, host_ns, robot_ns, Link.of(mbit_s, rtt_ms))
            return split if plan.predicted_ns < by_cut else cut
        pending = self._measuring.get(sequence.id)
        if pending is not None and pending[0] not in measured:
            return pending[1]
        if not any(_split_of(key) for key in measured):
            key = frozenset({(SPLIT, plan.region.calls, plan.at)})
            if len(self._measuring) >= 1024:  # sequences long gone: the oldest go first
                del self._measuring[next(iter(self._measuring))]
            self._measuring[sequence.id] = (key, split)
            return split  # measured next
        self._measuring.pop(sequence.id, None)
        return _placement(min(measured, key=lambda k: measured[k]), len(calls))


def _split_of(key: frozenset[Any]) -> tuple[Any, ...] | None:
    return next((m for m in key if isinstance(m, tuple) and m and m[0] == SPLIT), None)


def _placement(key: frozenset[Any], n: int) -> list[str]:
    """The placement a measured key names (``partition.key_of``)."""
    split = _split_of(key)
    if split is None:
        return [ROBOT if k in key else HOST for k in range(n)]
    _, region, at = split
    return Hybrid([SPLIT if k in region else ROBOT if k in key else HOST for k in range(n)], at)


def _unmeasured(measured: Mapping[frozenset[Any], float] | None, placement: list[str]) -> bool:
    """Whether ``placement``'s latency is still to be measured (never, if it cannot be)."""
    return measured is not None and frozenset(
        k for k, p in enumerate(placement) if p == ROBOT) not in measured


@hookimpl
def rrto_schedulers() -> list[PluginRecord[SchedulerFactory]]:
    return [PluginRecord("remote-all", RemoteAll, "every operator on the GPU host"),
            PluginRecord("robot-all", RobotAll, "every operator that can run on the robot there"),
            PluginRecord("min-cut", MinCutScheduler,
                         "the minimum-latency robot/host cut from measured times and link"),
            PluginRecord("hybrid-parallel", HybridParallel,
                         "rows of local operators split between robot and host (LOP + LOSS)")]
