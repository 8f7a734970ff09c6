"""The energy accountant's Prometheus families, computed at scrape time from ``describe()``, so
closed sessions drop out as they are pruned and a scrape sees what ``rrtoctl status`` shows:

- ``rrto_power_watts{meter}``: power over the last second of samples
- ``rrto_meter_energy_joules_total{meter}``: the machine's energy since start
- ``rrto_energy_joules_total{session}``: a session's share (see ``rrtod.robot.energy``)
- ``rrto_energy_state_joules_total{session,state}``: the same, by state
- ``rrto_energy_inferences_total{session}``: inferences attributed
- ``rrto_energy_per_inference_joules{session}``: mean energy per inference
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


class EnergyCollector:
    """A prometheus_client collector over ``describe``, an ``EnergyAccountant.describe``."""

    def __init__(self, describe: Callable[[], dict[str, Any]]):
        self._describe = describe

    def describe(self) -> Iterator[Any]:
        return iter(_families())

    def collect(self) -> Iterator[Any]:
        families = _families()
        power, meter_total, energy, by_state, count, per_inf = families
        snap = self._describe()
        name = snap["meter"]
        if snap["power_w"] is not None:
            power.add_metric([name], snap["power_w"])
        meter_total.add_metric([name], snap["total_j"])
        for sid, s in snap["sessions"].items():
            energy.add_metric([sid], s["energy_j"])
            for state, joules in s["energy_by_state_j"].items():
                by_state.add_metric([sid, state], joules)
            count.add_metric([sid], s["inferences"])
            if s["energy_per_inference_j"] is not None:
                per_inf.add_metric([sid], s["energy_per_inference_j"])
        return iter(families)


def _families() -> list[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    return [
        GaugeMetricFamily("rrto_power_watts", "Power over the last sample interval",
                          labels=["meter"]),
        CounterMetricFamily("rrto_meter_energy_joules", "Energy measured since daemon start",
                            labels=["meter"]),
        CounterMetricFamily("rrto_energy_joules", "Energy attributed to a session",
                            labels=["session"]),
        CounterMetricFamily("rrto_energy_state_joules", "Energy attributed to a session, by state",
                            labels=["session", "state"]),
        CounterMetricFamily("rrto_energy_inferences", "Inferences with attributed energy",
                            labels=["session"]),
        GaugeMetricFamily("rrto_energy_per_inference_joules",
                          "Mean machine energy per inference", labels=["session"]),
    ]
