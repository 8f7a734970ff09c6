"""Balancers that learn nothing: ``first-up``, ``least-loaded``, ``least-connections`` and
``round-robin`` (RILaaS's baselines). None takes options."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rrto_plugins.balancers._common import Recent, least, up
from rrtod.hookspecs import BalancerBase, HostView, Job

# Job keys remembered by round-robin's per-key rotation (least recently used forgotten).
MAX_KEYS = 4096


class FirstUp(BalancerBase):
    """The first host in configuration order that is up: a primary with ordered fallbacks.
    An inference goes to its sequence's primary host (the first given)."""

    def choose(self, hosts: Sequence[HostView]) -> HostView | None:
        return next((h for h in hosts if h.up), None)

    def place(self, hosts: Sequence[HostView], job: Job) -> HostView | None:
        return hosts[0] if hosts else None


class LeastLoaded(BalancerBase):
    """The up host with the fewest sessions; an inference to the host with the fewest
    inferences in flight. Ties go to the lower measured RTT, then to the earlier host, so
    several robots spread over equal hosts and prefer the nearer one."""

    def choose(self, hosts: Sequence[HostView]) -> HostView | None:
        return least(up(hosts), lambda h: h.sessions)

    def place(self, hosts: Sequence[HostView], job: Job) -> HostView | None:
        return least(hosts, lambda h: h.inflight)


class LeastConnections(LeastLoaded):
    """RILaaS's "least connections": the next request to the server with the fewest active
    ones. A session's connection is its session, an inference's is its in-flight request:
    fewest sessions (choose), fewest inferences in flight (place); ties by RTT, then order.
    The same rule as ``least-loaded``, under the name the RILaaS comparison uses."""


class RoundRobin(BalancerBase):
    """New sessions rotate over the hosts that are up; inferences rotate over the hosts given,
    per job key (each sequence cycles over the hosts holding it).

    The position is remembered by host *name*, not by index: hosts going down and coming back
    (or a reload that edits the list) then neither skip a host nor pick the same one twice in a
    row, which an index modulo the number of hosts would do.
    """

    def __init__(self, options: Mapping[str, Any] | None = None, state_dir: Path | None = None,
                 /) -> None:
        super().__init__(options, state_dir)
        self._last_session: str | None = None
        self._last_job: Recent[list[str | None]] = Recent(MAX_KEYS, lambda: [None])

    @staticmethod
    def _after(hosts: Sequence[HostView], last: str | None, need_up: bool) -> HostView | None:
        names = [h.name for h in hosts]
        start = names.index(last) + 1 if last in names else 0
        for offset in range(len(hosts)):
            host = hosts[(start + offset) % len(hosts)]
            if host.up or not need_up:
                return host
        return None

    def choose(self, hosts: Sequence[HostView]) -> HostView | None:
        host = self._after(hosts, self._last_session, need_up=True)
        if host is not None:
            self._last_session = host.name
        return host

    def place(self, hosts: Sequence[HostView], job: Job) -> HostView | None:
        last = self._last_job(job.key)
        host = self._after(hosts, last[0], need_up=False)
        if host is not None:
            last[0] = host.name
        return host
