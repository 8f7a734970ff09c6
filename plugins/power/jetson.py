"""``jetson``: NVIDIA Jetson board power from its INA3221 rail monitors, read in sysfs.

Jetson modules carry one or two TI INA3221 three-channel monitors on I2C; L4T exposes them in one
of two layouts, both read directly (no jetson-stats, which is AGPL):

- L4T r34 and later (JetPack 5/6, Orin; mainline ``ina3221`` hwmon driver):
  ``/sys/bus/i2c/drivers/ina3221/<bus>-<addr>/hwmon/hwmon<N>/`` with ``in<k>_label``,
  ``in<k>_input`` (bus voltage, mV), ``curr<k>_input`` (mA) and ``in<k>_enable`` for k = 1..3;
  power is voltage x current.
- L4T r32 and earlier (JetPack 4: Nano, TX1/TX2, Xavier; NVIDIA's ``ina3221x`` iio driver):
  ``/sys/bus/i2c/drivers/ina3221x/<bus>-<addr>/iio:device<N>/`` (``iio_device`` on some older
  releases) with ``rail_name_<k>``, ``in_power<k>_input`` (mW), ``in_current<k>_input`` (mA)
  and ``in_voltage<k>_input`` (mV) for k = 0..2.

Which rails: the module's input rail (``VDD_IN``; ``POM_5V_IN`` on Nano; ``5V_IN`` in some
device trees) when there is one, because it is what the robot's battery pays for the whole
module and the other rails are branches of it (adding them would count twice). Boards without an
input rail (AGX Xavier, AGX Orin) get the sum of all their rails, which are separate supplies.
An explicit ``rails`` list overrides both. Unconnected channels (label ``NC``) are skipped.

The sensor gives power, not energy: ``read()`` integrates power over time (trapezoids between
reads), so its accuracy follows the sampling rate (``power.sample_hz``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rrto_plugins.power._sysfs import Reader, explain, read_int, read_text
from rrto_plugins.power.base import MeterBase, MeterUnavailable

DEFAULT_ROOT = Path("/sys/bus/i2c/drivers")
INPUT_RAILS = frozenset({"VDD_IN", "POM_5V_IN", "5V_IN"})
PERMISSION_HINT = "run rrtod as root or grant its user read access to the INA3221 sysfs files"


@dataclass(frozen=True)
class Rail:
    """One monitored supply. ``power`` is a file in mW (iio layout); otherwise ``volts`` (mV)
    times ``amps`` (mA) gives microwatts."""

    label: str
    power: Path | None = None
    volts: Path | None = None
    amps: Path | None = None

    def watts(self, reader: Reader) -> float:
        if self.power is not None:
            return read_int(reader, self.power) / 1e3
        assert self.volts is not None and self.amps is not None
        return read_int(reader, self.volts) * read_int(reader, self.amps) / 1e6

    def files(self) -> list[Path]:
        return [p for p in (self.power, self.volts, self.amps) if p is not None]


def _label(reader: Reader, path: Path) -> str | None:
    try:
        return reader(path).strip()
    except OSError:
        return None


def _usable(label: str | None) -> bool:
    return bool(label) and label.upper() != "NC"


def find_rails(root: Path, reader: Reader = read_text) -> list[Rail]:
    """Every connected INA3221 channel under ``root`` (a ``/sys/bus/i2c/drivers``), both layouts."""
    rails: list[Rail] = []
    for dev in sorted(root.glob("ina3221*/*/hwmon/hwmon*")):
        for k in (1, 2, 3):
            label = _label(reader, dev / f"in{k}_label")
            if not _usable(label) or _label(reader, dev / f"in{k}_enable") == "0":
                continue
            rails.append(Rail(str(label), volts=dev / f"in{k}_input", amps=dev / f"curr{k}_input"))
    for dev in sorted(root.glob("ina3221*/*/iio*device*")):
        for k in (0, 1, 2):
            label = _label(reader, dev / f"rail_name_{k}")
            if not _usable(label):
                continue
            power = dev / f"in_power{k}_input"
            if power.exists():
                rails.append(Rail(str(label), power=power))
            else:
                rails.append(Rail(str(label), volts=dev / f"in_voltage{k}_input",
                                  amps=dev / f"in_current{k}_input"))
    return rails


def choose_rails(rails: list[Rail], wanted: Iterable[str] | None = None) -> list[Rail]:
    """The rails whose sum is the board's power (see the module docstring)."""
    if wanted is not None:
        names = {w.upper() for w in wanted}
        chosen = [r for r in rails if r.label.upper() in names]
        missing = names - {r.label.upper() for r in chosen}
        if missing:
            have = ", ".join(r.label for r in rails) or "none"
            raise MeterUnavailable(f"INA3221 rail(s) {', '.join(sorted(missing))} not found "
                                   f"(have: {have})")
        return chosen
    inputs = [r for r in rails if r.label.upper() in INPUT_RAILS]
    return inputs or rails


class JetsonMeter(MeterBase):
    """Board energy integrated from INA3221 rail power, in joules since construction."""

    # Each of these sysfs reads is an I2C transaction (the value registers are not cached):
    # a fraction of a millisecond each, too long to stall the daemon's event loop for.
    blocking = True

    def __init__(
        self,
        root: Path | str = DEFAULT_ROOT,
        reader: Reader = read_text,
        rails: Iterable[str] | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ):
        self.root = Path(root)
        self._reader = reader
        self._clock = clock
        found = find_rails(self.root, reader)
        if not found:
            raise MeterUnavailable(
                f"no INA3221 power monitor under {self.root} (not a Jetson, or a board without "
                "one such as the Jetson Nano 2GB)"
            )
        self.rails = choose_rails(found, rails)
        try:
            self._last_w = self._power()
        except (OSError, ValueError) as exc:
            raise MeterUnavailable(explain(exc, None, PERMISSION_HINT)) from None
        self._last_t = clock()
        self._joules = 0.0

    def _power(self) -> float:
        return sum(rail.watts(self._reader) for rail in self.rails)

    @staticmethod
    def probe(root: Path | str = DEFAULT_ROOT, reader: Reader = read_text) -> str | None:
        """None when the board's rails can be read here, else why not."""
        try:
            JetsonMeter(root, reader)
        except MeterUnavailable as exc:
            return str(exc)
        return None

    def power_w(self) -> float:
        """The board's power at the last read, in watts."""
        return self._last_w

    def read(self) -> float:
        watts = self._power()
        now = self._clock()
        self._joules += (watts + self._last_w) / 2 * max(0, now - self._last_t) / 1e9
        self._last_w, self._last_t = watts, now
        return self._joules

    def describe(self) -> dict[str, Any]:
        return {"kind": "jetson", "rails": [r.label for r in self.rails]}
