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
from rrtod.partition import HOST, ROBOT, SequenceView


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


def _unmeasured(measured: Mapping[frozenset[int], float] | None, placement: list[str]) -> bool:
    """Whether ``placement``'s latency is still to be measured (never, if it cannot be)."""
    return measured is not None and frozenset(
        k for k, p in enumerate(placement) if p == ROBOT) not in measured


@hookimpl
def rrto_schedulers() -> list[PluginRecord[SchedulerFactory]]:
    return [PluginRecord("remote-all", RemoteAll, "every operator on the GPU host"),
            PluginRecord("robot-all", RobotAll, "every operator that can run on the robot there"),
            PluginRecord("min-cut", MinCutScheduler,
                         "the minimum-latency robot/host cut from measured times and link")]
