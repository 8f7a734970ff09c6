"""A power meter that reports a fixed power: energy = watts x time since it was built.

Useful to test energy accounting end to end on a machine without sensors, and as the smallest
complete meter (``rrtod.hookspecs.PowerMeter``): ``read()`` returns cumulative joules and never
decreases, ``describe()`` feeds ``rrtoctl status``. The optional capabilities come from
``MeterBase`` with their defaults, restated here where this meter relies on them: ``blocking``
False (``read()`` is arithmetic, called on the daemon's event loop) and ``follows_state`` False
(a fixed figure does not change with the robot's activity, so ``set_state`` is ignored).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rrtod.hookspecs import MeterBase


class ConstantMeter(MeterBase):
    DEFAULT_WATTS = 10.0
    blocking = False
    follows_state = False

    def __init__(self, watts: float = DEFAULT_WATTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not watts >= 0:
            raise ValueError(f"watts must be >= 0, got {watts!r}")
        self.watts = float(watts)
        self._clock = clock
        self._start = clock()

    @classmethod
    def from_config(cls, config: Any = None) -> ConstantMeter:
        """The record's factory. rrtod passes its ``power`` config section; this meter has no
        options there, so it is ignored (a real meter would read its settings from it)."""
        return cls()

    @staticmethod
    def probe() -> str | None:
        """None: this meter can run anywhere. A hardware meter returns the reason it cannot
        (missing device, permission), phrased for the operator, and must not keep anything
        open."""
        return None

    def read(self) -> float:
        """Joules since construction; monotonic because the clock is."""
        return self.watts * (self._clock() - self._start)

    def describe(self) -> dict[str, Any]:
        return {"meter": "constant", "watts": self.watts, "estimate": True}
