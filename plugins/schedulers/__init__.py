"""Operator placement (``rrtod.hookspecs.Scheduler``): where each call of a replayed sequence
runs, asked by the robot daemon before it defines the sequence (``rrtod.robot.scheduling``).

``remote-all`` runs every call on the GPU host: the right choice whenever the link is fast
enough that shipping inputs and outputs beats local compute, and the baseline partitioning
schedulers are compared against. ``robot-all`` runs every call that may run on the robot there
(``rrtod.partition``: calls that keep state or read a constant of the host stay on the host):
the other end of the range, for a robot whose own compute beats its link."""

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


@hookimpl
def rrto_schedulers() -> list[PluginRecord[SchedulerFactory]]:
    return [PluginRecord("remote-all", RemoteAll, "every operator on the GPU host"),
            PluginRecord("robot-all", RobotAll, "every operator that can run on the robot there")]
