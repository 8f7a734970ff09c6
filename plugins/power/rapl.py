"""``rapl``: x86 package and DRAM energy from the kernel's powercap RAPL counters.

What it reads: ``/sys/class/powercap/intel-rapl:*`` (the same ``intel-rapl`` zones on Intel and on
AMD Zen CPUs). Each zone has ``name`` (``package-N``, ``core``, ``uncore``, ``dram``, ``psys``),
``energy_uj`` (a counter in microjoules) and ``max_energy_range_uj`` (where it wraps to 0).

Which zones: every ``package-N`` plus every ``dram`` zone. ``core`` and ``uncore`` are inside the
package and ``psys`` (the whole platform, where present) overlaps the package, so adding any of
them would count the same joules twice. A machine without package zones but with ``psys`` uses
``psys`` alone. The ``intel-rapl-mmio`` zones repeat the package counter and are never read.

Wrap: a counter reaching ``max_energy_range_uj`` restarts at 0; a read that sees a smaller value
than the last one adds the distance through the wrap. That is exact as long as reads come more
often than one wrap period (minutes to hours at the highest power; the accountant samples
several times a second).

Permissions: since Linux 5.10 ``energy_uj`` is readable by root only (it leaked secrets through
power side channels). A non-root daemon gets a probe reason saying so and how to grant access.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rrto_plugins.power._sysfs import Reader, explain, read_int, read_text
from rrto_plugins.power.base import MeterBase, MeterUnavailable

DEFAULT_ROOT = Path("/sys/class/powercap")
PERMISSION_HINT = (
    "RAPL energy counters are root-only since Linux 5.10: run rrtod as root, or grant its user "
    "read access to energy_uj, e.g. with a tmpfiles.d or udev rule"
)


@dataclass
class _Zone:
    path: Path
    name: str
    modulus: int  # max_energy_range_uj + 1: the counter takes values 0..max_energy_range_uj
    last: int


class RaplMeter(MeterBase):
    """Sum of the selected RAPL zones, wrap-corrected, in joules since construction.

    ``root`` and ``reader`` are injectable so tests run against a fake tree and a reader that
    raises PermissionError.
    """

    blocking = False

    def __init__(self, root: Path | str = DEFAULT_ROOT, reader: Reader = read_text):
        self.root = Path(root)
        self._reader = reader
        self._zones = self._discover()
        self._total_uj = 0

    def _discover(self) -> list[_Zone]:
        if not self.root.is_dir():
            raise MeterUnavailable(f"no powercap sysfs at {self.root} (not Linux, or no powercap)")
        named: list[tuple[Path, str]] = []
        for path in sorted(self.root.glob("intel-rapl:*")):
            try:
                named.append((path, self._reader(path / "name").strip()))
            except OSError:
                continue  # a zone without a readable name cannot be classified; skip it
        if not named:
            raise MeterUnavailable(
                f"no RAPL zones under {self.root} (CPU without RAPL, or the intel_rapl_msr "
                "driver is not loaded)"
            )
        chosen = [(p, n) for p, n in named if n.startswith("package-") or n == "dram"]
        if not chosen:
            chosen = [(p, n) for p, n in named if n == "psys"]
        if not chosen:
            names = ", ".join(sorted({n for _, n in named}))
            raise MeterUnavailable(
                f"no package, dram or psys RAPL zone under {self.root} (found: {names})"
            )
        zones = []
        for path, name in chosen:
            for attr in ("max_energy_range_uj", "energy_uj"):
                try:
                    read_int(self._reader, path / attr)
                except (OSError, ValueError) as exc:
                    raise MeterUnavailable(explain(exc, path / attr, PERMISSION_HINT)) from None
            modulus = read_int(self._reader, path / "max_energy_range_uj") + 1
            if modulus <= 1:
                raise MeterUnavailable(f"{path / 'max_energy_range_uj'}: range is 0")
            zones.append(_Zone(path, name, modulus, read_int(self._reader, path / "energy_uj")))
        return zones

    @staticmethod
    def probe(root: Path | str = DEFAULT_ROOT, reader: Reader = read_text) -> str | None:
        """None when the counters can be read here, else why not."""
        try:
            RaplMeter(root, reader)
        except MeterUnavailable as exc:
            return str(exc)
        return None

    def read(self) -> float:
        """Joules since construction. Reads every zone before updating any, so a failed read
        (OSError, ValueError) leaves the meter as it was and the next read catches up."""
        raws = [read_int(self._reader, zone.path / "energy_uj") for zone in self._zones]
        for zone, raw in zip(self._zones, raws, strict=True):
            self._total_uj += (raw - zone.last) % zone.modulus
            zone.last = raw
        return self._total_uj / 1e6

    def describe(self) -> dict[str, Any]:
        return {"kind": "rapl", "zones": {z.path.name: z.name for z in self._zones}}
