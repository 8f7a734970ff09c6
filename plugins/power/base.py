"""What every power meter shares: the meter protocol, the states, the "cannot run here" error.

A meter is any object with ``read() -> float``: cumulative joules since the meter was built,
never decreasing (hardware counter wraps and resets are corrected inside the meter, because only
the meter knows its counter's range). Optional members the energy accountant uses when present:

- ``blocking: bool`` -- True when ``read()`` may take more than microseconds (an NVML driver call,
  INA3221 attributes that are I2C transactions); the accountant then reads in a worker thread so
  the daemon's event loop never stalls. RAPL's counters are plain register reads: False.
- ``set_state(state: str) -> None`` -- the machine's activity changed; only estimating meters
  (``model``) need it, measuring meters ignore it.
- ``describe() -> dict`` -- what the meter reads, for ``rrtoctl status`` and logs.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rrtod.robot.energy import STATES, machine_state

__all__ = ["STATES", "Meter", "MeterUnavailable", "machine_state"]


class MeterUnavailable(RuntimeError):
    """The meter cannot run on this machine; the message is the reason, phrased for an operator
    (what is missing and, where there is one, how to fix it)."""


@runtime_checkable
class Meter(Protocol):
    def read(self) -> float:
        """Cumulative joules since the meter was built; monotonic."""
        ...
