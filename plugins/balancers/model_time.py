"""``least-model-time`` (RILaaS): each inference to the host with the lowest running estimate
of its latency for that job key, with a small probability of a uniformly random host instead,
so that a host that was slow (or failing) once is measured again."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from rrto_plugins.balancers._common import Recent, least, up
from rrtod.hookspecs import BalancerBase, BalancerOptions, HostView, Job

MAX_KEYS = 1024  # job keys whose estimates are kept (least recently used forgotten)


class ModelTimeOptions(BalancerOptions):
    # weight of a new measurement in the running estimate (EWMA): higher follows changes faster
    alpha: float = Field(default=0.3, gt=0, le=1)
    # probability that an inference goes to a uniformly random host instead of the best one
    explore: float = Field(default=0.05, ge=0, le=1)
    # seconds a failed inference (error, host lost, deadline missed) counts as
    failure_penalty_s: float = Field(default=5.0, gt=0)
    seed: int | None = None  # of the exploration's random numbers; None: from the OS


class _KeyStats:
    __slots__ = ("estimate", "trying")

    def __init__(self) -> None:
        self.estimate: dict[str, float] = {}  # host name -> EWMA of seconds
        self.trying: dict[str, int] = {}  # host name -> placements not yet observed


class LeastModelTime(BalancerBase):
    """Per job key, an EWMA of each host's measured latency (a failure counts as
    ``failure_penalty_s``). ``place``: with probability ``explore`` a uniformly random host;
    else a host with no estimate yet and no inference on the way to get one (the first such,
    primary first); else the lowest estimate (ties: the earlier host); else, when every host
    without an estimate is already being tried, the one with the fewest inferences in flight.
    ``choose`` (a new session) is ``least-loaded``'s rule: fewest sessions, then lowest RTT."""

    Options = ModelTimeOptions

    def __init__(self, options: Mapping[str, Any] | None = None, state_dir: Path | None = None,
                 /) -> None:
        super().__init__(options, state_dir)
        self.random = random.Random(self.options.seed)
        self.stats: Recent[_KeyStats] = Recent(MAX_KEYS, _KeyStats)

    def choose(self, hosts: Sequence[HostView]) -> HostView | None:
        return least(up(hosts), lambda h: h.sessions)

    def place(self, hosts: Sequence[HostView], job: Job) -> HostView | None:
        if not hosts:
            return None
        stats = self.stats(job.key)
        if self.random.random() < self.options.explore:
            host = hosts[self.random.randrange(len(hosts))]
        else:
            host = self._best(hosts, stats)
        stats.trying[host.name] = stats.trying.get(host.name, 0) + 1
        return host

    @staticmethod
    def _best(hosts: Sequence[HostView], stats: _KeyStats) -> HostView:
        best: HostView | None = None
        for host in hosts:
            seconds = stats.estimate.get(host.name)
            if seconds is None:
                if not stats.trying.get(host.name):
                    return host  # never measured, and nothing on the way to measure it
            elif best is None or seconds < stats.estimate[best.name]:
                best = host
        if best is None:  # every host is being tried for the first time: spread them
            best = least(hosts, lambda h: h.inflight)
        assert best is not None
        return best

    def observe(self, host: HostView, job: Job, seconds: float | None) -> None:
        stats = self.stats(job.key)
        if stats.trying.get(host.name):
            stats.trying[host.name] -= 1
        sample = self.options.failure_penalty_s if seconds is None else max(0.0, seconds)
        old = stats.estimate.get(host.name)
        stats.estimate[host.name] = (
            sample if old is None else old + self.options.alpha * (sample - old))

    def estimates(self, key: str) -> dict[str, float]:
        """Host name -> estimated seconds for ``key`` (diagnostics, tests)."""
        stats = self.stats.get(key)
        return dict(stats.estimate) if stats is not None else {}
