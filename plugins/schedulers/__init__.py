"""Operator placement (``rrtod.hookspecs.Scheduler``; declared, not yet used by the daemon: issue
15 makes the robot daemon place operators). ``remote-all`` runs every operator of a sequence on
the GPU host: the right choice whenever the link is fast enough that shipping inputs and outputs
beats local compute, and the baseline that partitioning schedulers are compared against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rrtod.hookspecs import PluginRecord, SchedulerFactory, hookimpl


class RemoteAll:
    def place(self, sequence: Sequence[Any], link: Any = None) -> list[str]:
        return ["host"] * len(sequence)


@hookimpl
def rrto_schedulers() -> list[PluginRecord[SchedulerFactory]]:
    return [PluginRecord("remote-all", RemoteAll, "every operator on the GPU host")]
