"""A host balancer (``rrtod.hookspecs.HostBalancer``): which GPU host a new app session goes to.

The robot daemon builds one balancer (``factory()``) per configuration and calls
``choose(hosts)`` for every new session, on its event loop, with the configured hosts in
configuration order. Each host object has ``name: str``, ``up: bool``, ``rtt_ms: float | None``
(median measured round trip, None before the first ping) and ``sessions: int`` (open sessions).
``choose`` must return one of the objects it was given, or None when no host is up (the app
then falls back as ``intercept.fallback`` says). It must not block: it runs on the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from rrtod.hookspecs import HostView


class RoundRobin:
    """Each new session goes to the next host after the previous choice that is up.

    The position is remembered by host *name*, not by index: hosts going down and coming back
    (or a reload that edits the list) then neither skip a host nor send two sessions in a row to
    the same one, which an index modulo the number of up hosts would do.
    """

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, hosts: Sequence[HostView]) -> HostView | None:
        if not hosts:
            return None
        names = [h.name for h in hosts]
        start = names.index(self._last) + 1 if self._last in names else 0
        for offset in range(len(hosts)):
            host = hosts[(start + offset) % len(hosts)]
            if host.up:
                self._last = host.name
                return host
        return None
