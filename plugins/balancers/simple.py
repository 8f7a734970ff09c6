"""Balancers that learn nothing: ``first-up`` and ``least-loaded``. Neither takes options."""

from __future__ import annotations

from collections.abc import Sequence

from rrto_plugins.balancers._common import least, up
from rrtod.hookspecs import BalancerBase, HostView, Job


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
