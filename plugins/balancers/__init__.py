"""Host balancers (``rrtod.hookspecs.HostBalancer``): which GPU daemon a new app session goes to.

The daemon passes the hosts as ``HostView``s (``name``, ``up``, ``rtt_ms``, ``sessions``);
``choose`` returns one that is up, or None when none is.
"""

from __future__ import annotations

from collections.abc import Sequence

from rrtod.hookspecs import BalancerFactory, HostView, PluginRecord, hookimpl


class FirstUp:
    """The first host in configuration order that is up: a primary with ordered fallbacks."""

    def choose(self, hosts: Sequence[HostView]) -> HostView | None:
        return next((h for h in hosts if h.up), None)


class LeastLoaded:
    """The up host with the fewest sessions; ties go to the lower measured RTT, so several
    robots spread over equal hosts and prefer the nearer one."""

    def choose(self, hosts: Sequence[HostView]) -> HostView | None:
        up = [h for h in hosts if h.up]
        if not up:
            return None
        return min(up, key=lambda h: (h.sessions, h.rtt_ms if h.rtt_ms is not None else float("inf")))


@hookimpl
def rrto_host_balancers() -> list[PluginRecord[BalancerFactory]]:
    return [
        PluginRecord("first-up", FirstUp, "first reachable host in configuration order"),
        PluginRecord("least-loaded", LeastLoaded, "fewest sessions, then lowest RTT"),
    ]
