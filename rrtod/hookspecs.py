"""The plugin contract (pluggy project ``rrto``): one hook per family, each returning records.

A plugin is a module or object registered through the ``rrto`` entry-point group. It implements
any of the hooks below with ``@hookimpl`` and returns a list of records; the daemon picks records
by the names its configuration gives. pluggy hooks are synchronous, so records carry factories:
what a factory builds may be asynchronous. Built-in plugins under ``plugins/`` use exactly this
contract; ``examples/rrto-example-plugin`` is a third-party one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

PROJECT = "rrto"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class PluginRecord:
    """A named, configurable implementation in one family.

    ``factory`` is called by the daemon with family-specific keyword arguments (documented on each
    hook) and returns the working object.
    """

    name: str
    factory: Callable[..., Any]
    description: str = ""


@dataclass(frozen=True)
class InterceptionBackend(PluginRecord):
    """Client side (``factory``: the shim's interceptor, built in the app process) and host side
    (``executor``: runs forwarded operators on the GPU daemon)."""

    executor: Callable[..., Any] | None = None
    # The operators its executor admits by default, as records with ``name``, ``reason``,
    # ``modes`` and ``seen_in`` (``rrtoctl ops``); None: the backend does not say.
    operators: Callable[[], list[Any]] | None = None


@dataclass(frozen=True)
class PowerMeterRecord(PluginRecord):
    """``probe()`` returns None when the meter can run here, else the reason it cannot.
    ``priority``: ``power: auto`` picks the available meter with the highest value."""

    probe: Callable[[], str | None] = field(default=lambda: None)
    priority: int = 0


class Specs:
    """Hook specifications: one per plugin family."""

    @hookspec
    def rrto_interception_backends(self) -> list[InterceptionBackend]:
        """Operator interception for an app framework (e.g. ``torch``).
        ``factory(client)`` -> shim interceptor; ``executor(config, store)`` -> host executor."""

    @hookspec
    def rrto_sequence_searches(self) -> list[PluginRecord]:
        """Sequence search over an op log. ``factory(**options)`` -> object with
        ``search(log) -> list[sequence]``."""

    @hookspec
    def rrto_transports(self) -> list[PluginRecord]:
        """Peer links. ``factory(address, tls, options)`` -> ``grpc.aio.Channel`` to a GPU daemon."""

    @hookspec
    def rrto_schedulers(self) -> list[PluginRecord]:
        """Operator placement. ``factory(**options)`` -> object with
        ``place(sequence, link) -> list[placement]``."""

    @hookspec
    def rrto_host_balancers(self) -> list[PluginRecord]:
        """Host choice for a new session. ``factory()`` -> object with ``choose(hosts)``."""

    @hookspec
    def rrto_power_meters(self) -> list[PowerMeterRecord]:
        """Energy sources. ``factory(power_config)`` -> meter, see ``rrto_plugins.power.base``."""


# Family name (as shown by ``rrtoctl plugins`` and used in errors) -> hook name.
FAMILIES: dict[str, str] = {
    "interception": "rrto_interception_backends",
    "search": "rrto_sequence_searches",
    "transport": "rrto_transports",
    "scheduler": "rrto_schedulers",
    "balancer": "rrto_host_balancers",
    "power": "rrto_power_meters",
}
