"""Energy per inference for a cell without a robot daemon (NTO, local), measured like the daemon
does.

The robot daemon's accountant (``rrtod.robot.energy``) attributes the robot's energy to each inference
from the app's marks. The hand-written NTO client has no daemon, so the harness runs the same
accountant with the meter the robot daemon would pick (``power.meter: auto`` with the default
``power`` section: the ``model`` meter on machines without a sensor), tracks the client process
(the model meter counts its CPU time as robot work) and puts it in the ``communication`` state
while it runs, as the robot daemon does for a session whose frames are on the link. The client's
own per-inference spans (from the call to the last output read, CLOCK_MONOTONIC) become the
marks, so NTO's figure covers the same span as per-op's and rrto's. Local execution is metered
the same way, so that its figure compares with a placement that runs calls on the robot (whose
CPU time the daemon's meter counts as robot work in the same state).
"""

from __future__ import annotations

import threading
from typing import Any

from rrto_plugins.power.model import usable_cpus
from rrtod.config import PowerConfig
from rrtod.robot.energy import EnergyAccountant, select_meter

SESSION = "nto"


class RobotMeter:
    """The robot's meter around one app process, sampled in a thread at ``sample_hz``."""

    def __init__(self, pid: int, power: PowerConfig | None = None):
        from rrtod.plugins import discover

        self.power = power or PowerConfig()
        self.name, meter = select_meter(discover(), self.power)
        if hasattr(meter, "count_against"):  # the app's CPUs (the robot's cgroup), not ours
            meter.count_against(usable_cpus(pid))
        self.acct = EnergyAccountant(self.name, meter, self.power.sample_hz)
        self.acct.track_process(SESSION, pid)
        self.acct.set_state(SESSION, "communication")
        self.acct.sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nto-meter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0 / self.power.sample_hz):
            self.acct.sample()

    def stop(self) -> None:
        """Last sample (call while the app process is still alive: its CPU time counts).
        Once only: later calls do nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.acct.sample()

    def per_inference(self, spans_ns: list[tuple[int, int]]) -> dict[str, Any]:
        """The accountant's session figures for these inference spans (after ``stop``)."""
        for i, (start, end) in enumerate(spans_ns):
            self.acct.inference(SESSION, i, start, end)
        self.acct.close_session(SESSION)
        self.acct.sample()
        return self.acct.describe()["sessions"][SESSION]
