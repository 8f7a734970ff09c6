"""Built-in power meters (entry point ``power`` in the ``rrto`` group).

Each record's ``factory(power_config)`` takes the ``power`` config section (``PowerConfig``) and
returns a meter whose ``read()`` gives cumulative joules since it was built (see
``rrto_plugins.power.base``). ``probe()`` says, without side effects that last, whether the meter
can run here and, if not, why.

``power: auto`` picks the available meter with the highest priority:

1. ``jetson`` (40): the INA3221 module input rail is the whole board, i.e. what the robot's
   battery actually pays, CPU, GPU, memory and regulators together. Nothing else measures that.
2. ``rapl`` (30): CPU package and DRAM of an x86 robot (a NUC). Misses the rest of the board
   and any discrete GPU, but it is what the CPU that runs the shim and daemon spends.
3. ``nvml`` (20): a discrete NVIDIA GPU's board energy. Precise, but the GPU only; on a robot it
   would leave out the CPU doing the offloading. Name ``rapl+nvml`` to get both.
4. ``model`` (0): the RRTO paper's state-based estimate; always available, so a daemon always
   has energy figures, labelled by meter name so nobody mistakes an estimate for a measurement.

``power.rails`` (jetson: rail labels to sum) and ``power.gpus`` (nvml: NVML indices) are read
when the config section has them; without them the defaults above apply.
"""

from __future__ import annotations

from typing import Any

from rrto_plugins.power.jetson import JetsonMeter
from rrto_plugins.power.model import ModelMeter
from rrto_plugins.power.nvml import NvmlMeter
from rrto_plugins.power.rapl import RaplMeter
from rrtod.hookspecs import PowerMeterRecord, hookimpl

PRIORITY = {"jetson": 40, "rapl": 30, "nvml": 20, "model": 0}


def _model(config: Any = None) -> ModelMeter:
    return ModelMeter(getattr(config, "model", None))


@hookimpl
def rrto_power_meters() -> list[PowerMeterRecord]:
    return [
        PowerMeterRecord(
            name="jetson",
            factory=lambda config=None: JetsonMeter(rails=getattr(config, "rails", None)),
            description="Jetson board power from INA3221 rails in sysfs, integrated to energy",
            probe=JetsonMeter.probe,
            priority=PRIORITY["jetson"],
        ),
        PowerMeterRecord(
            name="rapl",
            factory=lambda config=None: RaplMeter(),
            description="x86 CPU package + DRAM energy counters (powercap RAPL)",
            probe=RaplMeter.probe,
            priority=PRIORITY["rapl"],
        ),
        PowerMeterRecord(
            name="nvml",
            factory=lambda config=None: NvmlMeter(devices=getattr(config, "gpus", None)),
            description="NVIDIA GPU board energy counter (NVML)",
            probe=NvmlMeter.probe,
            priority=PRIORITY["nvml"],
        ),
        PowerMeterRecord(
            name="model",
            factory=_model,
            description="state-based estimate (power.model watts per state); no sensor needed",
            probe=ModelMeter.probe,
            priority=PRIORITY["model"],
        ),
    ]
