"""Which power meter the robot daemon reads: ``power.meter`` resolved to a built meter.

- ``auto``: the available meter with the highest ``priority`` (ties by name), logging why each
  better one was skipped. The built-in ``model`` meter is always available, so auto only fails
  when plugins were disabled.
- a name: that meter; MeterError (a PluginError) when it is not installed, its probe gives a
  reason, or its factory fails. An explicit choice never falls back silently: the operator asked
  for that sensor, and numbers from another would be mislabelled.
- ``a+b``: each named meter, summed (``SumMeter``).

Every meter built here satisfies ``rrtod.hookspecs.PowerMeter``: one that does not is refused
with what it lacks, so the accountant never has to probe for a member.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog

from rrtod.hookspecs import PowerMeter, PowerMeterRecord, problems
from rrtod.plugins import PluginError

if TYPE_CHECKING:
    from rrtod.config import PowerConfig
    from rrtod.plugins import Registry

log = structlog.get_logger("rrtod.energy")


class MeterError(PluginError):
    """The configured power meter cannot be used: unknown, unavailable here, or failed to start."""


def _probe(record: PowerMeterRecord) -> str | None:
    try:
        return record.probe()
    except Exception as exc:  # a third-party probe that raises is a reason, not a crash
        return f"probe failed: {exc!r}"


def _build(record: PowerMeterRecord, power_config: PowerConfig) -> PowerMeter:
    reason = _probe(record)
    if reason:
        raise MeterError(f"power meter {record.name!r} is unavailable here: {reason}")
    try:
        meter = record.factory(power_config)
    except Exception as exc:
        raise MeterError(f"power meter {record.name!r} failed to start: {exc}") from exc
    if not isinstance(meter, PowerMeter):
        raise MeterError(f"power meter {record.name!r} built {type(meter).__name__}, which is not "
                         f"an rrtod.hookspecs.PowerMeter ({', '.join(problems(meter, PowerMeter))}"
                         "; derive from rrtod.hookspecs.MeterBase for the optional members)")
    return meter


class SumMeter:
    """Several meters read as one (``power.meter: rapl+nvml`` on an x86 robot with a discrete
    GPU: CPU package and DRAM plus the GPU board, which do not overlap). Its capabilities are
    its parts': blocking if any part is, following the state if any part does."""

    read_ns: int | None = None  # parts are read one after the other: no single moment

    def __init__(self, meters: dict[str, PowerMeter]):
        self.meters = meters
        self.blocking = any(m.blocking for m in meters.values())
        self.follows_state = any(m.follows_state for m in meters.values())

    def read(self) -> float:
        return sum(m.read() for m in self.meters.values())

    def set_state(self, state: str) -> None:
        for m in self.meters.values():
            m.set_state(state)

    def track(self, pid: int) -> None:
        for m in self.meters.values():
            m.track(pid)

    def untrack(self, pid: int) -> None:
        for m in self.meters.values():
            m.untrack(pid)

    def describe(self) -> dict[str, Any]:
        return {"kind": "sum", "meters": {n: m.describe() for n, m in self.meters.items()}}


def select_meter(registry: Registry, power_config: PowerConfig) -> tuple[str, PowerMeter]:
    """Build the meter ``power_config.meter`` names (see the module docstring); returns
    ``(name, meter)``. ``registry``: ``records``/``get`` of family ``power``; each record's
    ``factory`` is called with ``power_config``."""
    wanted = str(power_config.meter).strip()
    if wanted != "auto":
        names = [n.strip() for n in wanted.split("+")]
        if not all(names):
            raise MeterError(f"power.meter: malformed meter name {wanted!r}")
        meters = {}
        for name in names:
            try:
                record = registry.get("power", name)
            except PluginError as exc:
                raise MeterError(f"power.meter: {exc}") from None
            meters[name] = _build(record, power_config)  # type: ignore[arg-type]
        if len(meters) == 1:
            return names[0], meters[names[0]]
        return "+".join(names), SumMeter(meters)

    skipped: list[str] = []
    records: list[PowerMeterRecord] = registry.records("power")  # type: ignore[assignment]
    for record in sorted(records, key=lambda r: (-r.priority, r.name)):
        try:
            meter = _build(record, power_config)
        except MeterError as exc:
            skipped.append(str(exc))
            continue
        log.info("power meter selected", meter=record.name, skipped=skipped)
        return record.name, meter
    reasons = "; ".join(skipped) or "none installed"
    raise MeterError(f"power: auto found no usable meter: {reasons}")
