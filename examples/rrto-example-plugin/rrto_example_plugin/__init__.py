"""rrto-example-plugin: the hooks rrtod calls. Keep this module cheap to import.

rrtod imports every plugin module at start and on reload, before it has decided which records
it will use, so heavy imports (torch, vendor SDKs) belong inside factories, not here.
"""

from __future__ import annotations

from rrto_example_plugin.balancer import Weighted
from rrto_example_plugin.power import ConstantMeter
from rrtod.hookspecs import BalancerFactory, PluginRecord, PowerMeterRecord, hookimpl

__all__ = ["Weighted", "ConstantMeter", "rrto_host_balancers", "rrto_power_meters"]


@hookimpl
def rrto_host_balancers() -> list[PluginRecord[BalancerFactory]]:
    """Selected with ``balancer: weighted`` in rrtod.yaml; its options are the
    ``balancers: {weighted: {...}}`` block. The class is the factory: ``BalancerBase`` gives it
    the ``(options, state_dir)`` signature the daemon calls."""
    return [
        PluginRecord(
            name="weighted",
            factory=Weighted,
            description="spread new sessions over the up hosts by configured weights "
                        "(example plugin)",
        )
    ]


@hookimpl
def rrto_power_meters() -> list[PowerMeterRecord]:
    """Selected with ``power: {meter: constant}``. The priority is below the built-in model
    meter (0), so ``meter: auto`` never picks a fixed figure over an estimate or a sensor."""
    return [
        PowerMeterRecord(
            name="constant",
            factory=ConstantMeter.from_config,
            description=f"fixed {ConstantMeter.DEFAULT_WATTS:g} W, for tests (example plugin)",
            probe=ConstantMeter.probe,
            priority=-10,
        )
    ]
