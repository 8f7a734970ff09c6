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
    each call's measured times. Until the host's times are in, every call runs on the host
    (whose first replays measure them); then, until the robot's are in, every call that may
    runs on the robot for its first replays (which measure them); then the cut."""

    def place(self, sequence: SequenceView, link: Any = None) -> list[str]:
        calls = sequence.calls
        host, robot = sequence.host_ns, sequence.robot_ns
        if not host or any(h is None for h in host):
            return [HOST] * len(calls)
        if not robot or any(robot[k] is None for k, c in enumerate(calls) if c.movable):
            return [ROBOT if c.movable else HOST for c in calls]
        mbit_s, rtt_ms = getattr(link, "mbit_s", None), getattr(link, "rtt_ms", None)
        if not mbit_s or rtt_ms is None:
            return [HOST] * len(calls)  # the link is not measured: as remote-all
        from .mincut import Link, min_cut  # networkx: loaded only when it is used

        return min_cut(sequence, [h or 0.0 for h in host], [r or 0.0 for r in robot],
                       Link.of(mbit_s, rtt_ms)).placement


@hookimpl
def rrto_schedulers() -> list[PluginRecord[SchedulerFactory]]:
    return [PluginRecord("remote-all", RemoteAll, "every operator on the GPU host"),
            PluginRecord("robot-all", RobotAll, "every operator that can run on the robot there"),
            PluginRecord("min-cut", MinCutScheduler,
                         "the minimum-latency robot/host cut from measured times and link")]
