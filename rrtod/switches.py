"""Every environment switch rrtod reads, each parsed in exactly one place.

A switch that means the same thing must read the same way wherever it is looked at: before this
module ``RRTO_OFFLOAD=false`` disabled the shim but ``rrto-run`` still offloaded, because each
reader had its own idea of "false". Standard library only: the shim's boot hook imports this in
every Python process that has ``RRTO_OFFLOAD`` set.

``SWITCHES`` is the table the README shows; a test keeps the two in agreement.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})

# name -> what it does (the README's table of switches)
SWITCHES: dict[str, str] = {
    "RRTO_OFFLOAD": "1/true/yes/on: offload this process (what `rrto-run` sets); "
                    "0/false/no/off: run locally, also under `rrto-run`",
    "RRTO_CONFIG": "configuration file of the daemon, `rrtoctl` and the shim "
                   "(default /etc/rrto/rrtod.yaml)",
    "RRTO_SOCKET": "the shim's daemon socket, instead of the config's `socket` key",
    "RRTO_MODE": "`stream` or `sync`: overrides `intercept.mode` for this app",
    "RRTO_FALLBACK": "`local` or `error`: overrides `intercept.fallback` for this app",
    "RRTO_REPLAY": "0/false/no/off: forwarding only for this app (overrides `intercept.replay`)",
    "RRTO_DEADLINE_MS": "milliseconds after which an inference stops waiting for the host and "
                        "is finished in the app; 0: none (overrides `intercept.deadline_ms`)",
    "RRTO_DISABLE_PLUGINS": "comma-separated plugin names that neither the daemon nor the shim "
                            "loads",
    "RRTO_HOST_FACTORIES": "0/false/no/off: tensors a model creates inside its forward "
                           "(`torch.zeros`, `arange`, ...) stay in the app instead of being "
                           "made on the GPU host",
    "RRTO_STATS": "1/true/yes/on: the shim prints its counters (whole run and per inference) "
                  "as JSON on stderr at exit",
    "RRTO_EVENT_LOOP": "`asyncio`: the daemon runs the standard event loop instead of uvloop",
    "RRTO_SHARED_UPLOADS": "0/false/no/off: this app's replayed inputs go on the socket, not "
                           "through the shared memory region the robot daemon offers",
    "RRTO_PALETTE": "0/false/no/off: this app's replayed inputs travel raw, never "
                    "palette-coded (a frame made from 8-bit pixels otherwise travels at a byte "
                    "an element: docs/record-replay.md)",
    "RRTO_HOP_TRACE": "a directory: daemons and shim write per-hop timestamps there "
                      "(bench.plumbing)",
}


class SwitchError(ValueError):
    """A switch whose value is neither true nor false."""


def flag(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """The boolean switch ``name``; ``default`` when unset. An unrecognised value is an error
    naming the switch, never silently one or the other."""
    raw = (os.environ if env is None else env).get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SwitchError(f"{name}={raw!r}: expected one of 1, true, yes, on, 0, false, no, off")


def milliseconds(name: str, default: float | None,
                 env: Mapping[str, str] | None = None) -> float | None:
    """A duration switch in ms; ``default`` when unset, None for 0 (none). Anything but a
    number is an error naming the switch."""
    raw = (os.environ if env is None else env).get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SwitchError(f"{name}={raw!r}: expected a number of milliseconds") from None
    if value != value or value < 0:  # NaN, negative
        raise SwitchError(f"{name}={raw!r}: expected a number of milliseconds")
    return value or None


def names(name: str, env: Mapping[str, str] | None = None) -> frozenset[str]:
    """A comma-separated list switch as a set of names (empty entries dropped)."""
    raw = (os.environ if env is None else env).get(name, "")
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


def disabled_plugins(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """Plugin names blocked by ``RRTO_DISABLE_PLUGINS``, for the daemon and the shim alike."""
    return names("RRTO_DISABLE_PLUGINS", env)
