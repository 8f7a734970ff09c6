"""What every built-in power meter shares: the contract (``rrtod.hookspecs.PowerMeter``, with its
defaults in ``MeterBase``), the states, and the "cannot run here" error.

A meter's ``read()`` gives cumulative joules since the meter was built, never decreasing
(hardware counter wraps and resets are corrected inside the meter, because only the meter knows
its counter's range). Its capabilities are declared, not probed (defaults from ``MeterBase``):

- ``blocking`` -- True when ``read()`` may take more than microseconds (an NVML driver call,
  INA3221 attributes that are I2C transactions); the accountant then reads in a worker thread so
  the daemon's event loop never stalls. RAPL's counters are plain register reads: False.
- ``follows_state`` with ``set_state(state)`` -- an estimating meter (``model``) whose power
  follows the machine's activity; measuring meters keep the default False and the no-op.
- ``track(pid)``/``untrack(pid)`` -- app processes whose CPU time is robot work (``model``).
- ``read_ns`` -- the moment the last reading is for, when the meter knows it (``model``).
- ``describe() -> dict`` -- what the meter reads, for ``rrtoctl status`` and logs.
"""

from __future__ import annotations

from rrtod.hookspecs import POWER_STATES, MeterBase, PowerMeter
from rrtod.robot.energy_ledger import machine_state

STATES = POWER_STATES
Meter = PowerMeter  # the name this module gave the protocol before it moved to rrtod.hookspecs

__all__ = ["STATES", "Meter", "MeterBase", "MeterUnavailable", "PowerMeter", "machine_state"]


class MeterUnavailable(RuntimeError):
    """The meter cannot run on this machine; the message is the reason, phrased for an operator
    (what is missing and, where there is one, how to fix it)."""
