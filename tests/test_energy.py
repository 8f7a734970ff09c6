"""The energy accountant and meter selection, with an injected clock and scripted meters."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from rrto_plugins.power.model import ModelMeter
from rrtod.config import PowerConfig
from rrtod.hookspecs import MeterBase, PowerMeterRecord
from rrtod.plugins import PluginError, discover
from rrtod.robot import energy
from rrtod.robot.energy import EnergyAccountant, MeterError, SumMeter, machine_state, select_meter

S = 1_000_000_000  # ns per second


class Clock:
    def __init__(self, t_ns: int = 100 * S):
        self.t = t_ns

    def __call__(self) -> int:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += round(seconds * S)


class FakeMeter(MeterBase):
    """Cumulative joules set by the test."""

    def __init__(self, joules: float = 0.0):
        self.joules = joules
        self.reads = 0

    def read(self) -> float:
        self.reads += 1
        return self.joules


def at(acct: EnergyAccountant, clock: Clock, meter: FakeMeter, t_s: float, joules: float) -> None:
    """Sample at second ``t_s`` after the clock's start, the meter reading ``joules``."""
    clock.t = 100 * S + round(t_s * S)
    meter.joules = joules
    acct.sample()


@pytest.fixture
def rig() -> tuple[EnergyAccountant, Clock, FakeMeter]:
    clock, meter = Clock(), FakeMeter()
    return EnergyAccountant("fake", meter, 10.0, clock=clock), clock, meter


# ---- selection ----------------------------------------------------------------------------------


@dataclass
class FakeRegistry:
    records_: list[PowerMeterRecord]

    def records(self, family: str) -> list[PowerMeterRecord]:
        assert family == "power"
        return self.records_

    def get(self, family: str, name: str) -> PowerMeterRecord:
        for r in self.records_:
            if r.name == name:
                return r
        raise PluginError(f"no {family} plugin named {name!r}")


def record(name: str, priority: int, reason: str | None = None, joules: float = 1.0):
    meter = FakeMeter(joules)
    return PowerMeterRecord(name=name, factory=lambda config: meter, probe=lambda: reason,
                            priority=priority)


def test_auto_picks_highest_priority_available() -> None:
    reg = FakeRegistry([
        record("model", 0),
        record("rapl", 30, reason="permission denied reading energy_uj"),
        record("jetson", 40, reason="no INA3221 power monitor"),
        record("nvml", 20),
    ])
    name, meter = select_meter(reg, PowerConfig(meter="auto"))
    assert name == "nvml"
    reg.records_[3] = record("nvml", 20, reason="not installed")
    assert select_meter(reg, PowerConfig())[0] == "model"


def test_auto_skips_meter_whose_probe_or_factory_raises() -> None:
    def boom() -> str | None:
        raise RuntimeError("sensor on fire")

    def bad_factory(config: object) -> object:
        raise OSError("vanished between probe and start")

    reg = FakeRegistry([
        PowerMeterRecord(name="flaky", factory=lambda c: FakeMeter(), probe=boom, priority=50),
        PowerMeterRecord(name="racy", factory=bad_factory, priority=45),
        record("model", 0),
    ])
    assert select_meter(reg, PowerConfig())[0] == "model"
    with pytest.raises(MeterError, match="sensor on fire"):
        select_meter(reg, PowerConfig(meter="flaky"))
    with pytest.raises(MeterError, match="failed to start: vanished"):
        select_meter(reg, PowerConfig(meter="racy"))


def test_explicit_name_never_falls_back() -> None:
    reg = FakeRegistry([record("model", 0), record("rapl", 30, reason="permission denied")])
    with pytest.raises(MeterError, match="'rapl' is unavailable here: permission denied"):
        select_meter(reg, PowerConfig(meter="rapl"))
    with pytest.raises(MeterError, match="no power plugin named 'ina'"):
        select_meter(reg, PowerConfig(meter="ina"))
    assert isinstance(MeterError("x"), PluginError)  # the daemon's plugin-error path handles it


def test_auto_with_nothing_usable_says_why() -> None:
    reg = FakeRegistry([record("rapl", 30, reason="no powercap sysfs")])
    with pytest.raises(MeterError, match="no powercap sysfs"):
        select_meter(reg, PowerConfig())


def test_plus_sums_meters() -> None:
    reg = FakeRegistry([record("rapl", 30, joules=2.0), record("nvml", 20, joules=5.0)])
    name, meter = select_meter(reg, PowerConfig(meter="rapl+nvml"))
    assert name == "rapl+nvml" and isinstance(meter, SumMeter)
    assert meter.read() == 7.0
    with pytest.raises(MeterError, match="malformed"):
        select_meter(reg, PowerConfig(meter="rapl+"))


def test_installed_plugins_resolve_model_by_name() -> None:
    name, meter = select_meter(discover(), PowerConfig(meter="model"))
    assert name == "model" and isinstance(meter, ModelMeter)


# ---- accounting ---------------------------------------------------------------------------------


def test_inference_energy_is_interpolated_on_the_series(rig) -> None:
    acct, clock, meter = rig
    acct.set_state("s", "communication")
    at(acct, clock, meter, 0.0, 0.0)
    at(acct, clock, meter, 1.0, 10.0)  # 10 W
    at(acct, clock, meter, 2.0, 30.0)  # 20 W
    acct.inference("s", 0, 100 * S + S // 2, 100 * S + 3 * S // 2)  # 0.5 s .. 1.5 s
    s = acct.describe()["sessions"]["s"]
    assert s["inferences"] == 1
    assert s["energy_per_inference_j"] == pytest.approx(0.5 * 10 + 0.5 * 20)
    assert s["mean_inference_s"] == pytest.approx(1.0)


def test_inference_waits_for_a_sample_past_its_end(rig) -> None:
    acct, clock, meter = rig
    at(acct, clock, meter, 0.0, 0.0)
    at(acct, clock, meter, 1.0, 4.0)
    acct.inference("s", 7, 100 * S + S // 2, 100 * S + 2 * S)  # ends after the last sample
    s = acct.describe()["sessions"]["s"]
    assert (s["inferences"], s["pending_inferences"]) == (0, 1)
    at(acct, clock, meter, 2.0, 12.0)  # 4 W then 8 W
    s = acct.describe()["sessions"]["s"]
    assert (s["inferences"], s["pending_inferences"]) == (1, 0)
    assert s["last_inference_j"] == pytest.approx(0.5 * 4 + 1.0 * 8)


def test_energy_split_by_state_at_change_times(rig) -> None:
    acct, clock, meter = rig
    at(acct, clock, meter, 0.0, 0.0)
    acct.set_state("s", "inference")  # opens the session at t=0 (after the sample)
    clock.t = 100 * S + round(0.25 * S)
    acct.set_state("s", "communication")
    at(acct, clock, meter, 1.0, 8.0)  # 8 W over the whole second
    s = acct.describe()["sessions"]["s"]
    assert s["energy_by_state_j"] == pytest.approx(
        {"inference": 2.0, "communication": 6.0, "standby": 0.0})
    assert s["time_by_state_s"]["inference"] == pytest.approx(0.25)
    assert s["mean_power_w"] == pytest.approx(8.0)


def test_busy_sessions_pay_and_idle_time_is_shared(rig) -> None:
    acct, clock, meter = rig
    acct.set_state("a", "inference")
    acct.set_state("b", "standby")
    at(acct, clock, meter, 0.0, 0.0)
    at(acct, clock, meter, 1.0, 10.0)  # a busy, b standing by: a pays all 10 J
    acct.set_state("a", "standby")
    at(acct, clock, meter, 2.0, 14.0)  # both idle: 4 J shared
    d = acct.describe()
    a, b = d["sessions"]["a"], d["sessions"]["b"]
    assert a["energy_j"] == pytest.approx(12.0) and b["energy_j"] == pytest.approx(2.0)
    assert a["energy_by_state_j"]["inference"] == pytest.approx(10.0)
    assert a["energy_j"] + b["energy_j"] == pytest.approx(d["total_j"])  # nothing counted twice
    assert b["mean_power_w"] == pytest.approx(7.0)  # the machine's mean while b was open


def test_closed_session_stops_accruing_and_stays_readable(rig) -> None:
    acct, clock, meter = rig
    acct.set_state("s", "communication")
    at(acct, clock, meter, 0.0, 0.0)
    at(acct, clock, meter, 1.0, 5.0)
    acct.close_session("s")
    at(acct, clock, meter, 3.0, 9.0)
    d = acct.describe()
    s = d["sessions"]["s"]
    assert s["open"] is False and s["energy_j"] == pytest.approx(5.0)
    assert d["unattributed_j"] == pytest.approx(4.0)  # nobody open: the machine's own
    assert d["total_j"] == pytest.approx(9.0)
    acct.close_session("s")  # twice is harmless
    acct.close_session("never-seen")
    acct.inference("s", 9, 100 * S, 100 * S + S)  # a late mark: counted, session stays closed
    s = acct.describe()["sessions"]["s"]
    assert s["open"] is False and s["inferences"] == 1
    assert s["last_inference_j"] == pytest.approx(5.0)


def test_only_recent_closed_sessions_are_kept(rig) -> None:
    acct, clock, meter = rig
    at(acct, clock, meter, 0.0, 0.0)
    for i in range(energy.KEEP_CLOSED + 6):
        acct.set_state(f"s{i}", "communication")
        acct.close_session(f"s{i}")
        at(acct, clock, meter, 1.0 + i, float(i))
    acct.set_state("live", "standby")
    at(acct, clock, meter, 200.0, 500.0)
    sessions = acct.describe()["sessions"]
    assert len(sessions) == energy.KEEP_CLOSED + 1
    assert "live" in sessions and "s0" not in sessions and f"s{energy.KEEP_CLOSED + 5}" in sessions


def test_model_meter_gives_exact_energy_by_state() -> None:
    """With the model meter the accountant samples at each state change, so the split is exact."""
    clock = Clock()
    meter = ModelMeter(clock=clock, cpu=lambda: 0.0)
    acct = EnergyAccountant("model", meter, 10.0, clock=clock)
    acct.sample()
    acct.set_state("s", "communication")
    clock.advance(0.03)
    acct.set_state("s", "inference")
    clock.advance(0.05)
    acct.set_state("s", "communication")
    clock.advance(0.02)
    acct.set_state("s", "standby")
    clock.advance(0.1)
    acct.sample()
    s = acct.describe()["sessions"]["s"]
    assert s["energy_by_state_j"] == pytest.approx(
        {"communication": 0.05 * 4.25, "inference": 0.05 * 13.35, "standby": 0.1 * 4.04})
    assert meter.state == "standby"


def test_model_meter_follows_the_busiest_session() -> None:
    clock = Clock()
    meter = ModelMeter(clock=clock, cpu=lambda: 0.0)
    acct = EnergyAccountant("model", meter, 10.0, clock=clock)
    acct.set_state("a", "communication")
    acct.set_state("b", "inference")
    assert meter.state == "inference"
    acct.close_session("b")
    assert meter.state == "communication"
    acct.close_session("a")
    assert meter.state == "standby"
    assert machine_state([]) == "standby"


class StatefulMeter(FakeMeter):
    """Records what the accountant tells an estimating meter."""

    follows_state = True

    def __init__(self) -> None:
        super().__init__()
        self.states: list[str] = []
        self.tracked: list[int] = []

    def set_state(self, state: str) -> None:
        self.states.append(state)

    def track(self, pid: int) -> None:
        self.tracked.append(pid)

    def untrack(self, pid: int) -> None:
        self.tracked.remove(pid)


def test_app_process_is_tracked_until_close_and_repeats_are_free() -> None:
    clock, meter = Clock(), StatefulMeter()
    acct = EnergyAccountant("stateful", meter, 10.0, clock=clock)
    acct.track_process("s", 4242)
    acct.track_process("s", 4242)  # once per session
    assert meter.tracked == [4242]
    assert acct.describe()["sessions"]["s"]["pid"] == 4242
    acct.set_state("s", "communication")
    reads = meter.reads
    for _ in range(5):  # a relay may call this per frame: unchanged state costs nothing
        acct.set_state("s", "communication")
    assert meter.states == ["communication"] and meter.reads == reads
    acct.close_session("s")
    assert meter.tracked == [] and meter.states[-1] == "standby"


def test_meter_going_backwards_keeps_series_monotonic(rig) -> None:
    acct, clock, meter = rig
    acct.set_state("s", "communication")
    at(acct, clock, meter, 0.0, 100.0)
    at(acct, clock, meter, 1.0, 110.0)
    at(acct, clock, meter, 2.0, 3.0)  # a meter reset: 0 J for this interval, then onwards
    at(acct, clock, meter, 3.0, 8.0)
    assert acct.describe()["total_j"] == pytest.approx(15.0)
    assert acct.describe()["sessions"]["s"]["energy_j"] == pytest.approx(15.0)


def test_bad_input_is_rejected_or_ignored(rig) -> None:
    acct, clock, meter = rig
    with pytest.raises(ValueError, match="unknown state"):
        acct.set_state("s", "napping")
    acct.inference("s", 1, 100 * S + 5, 100 * S)  # ends before it starts
    acct.inference("s", 2, 100 * S, 100 * S + 3600 * S)  # an hour in the future: wrong clock
    assert "s" not in acct.describe()["sessions"]
    with pytest.raises(ValueError):
        EnergyAccountant("fake", meter, 0.0)


def test_metrics_match_describe(rig) -> None:
    acct, clock, meter = rig
    registry = CollectorRegistry()
    acct.register_metrics(registry)
    acct.set_state("s", "inference")
    at(acct, clock, meter, 0.0, 0.0)
    at(acct, clock, meter, 1.0, 6.0)
    acct.inference("s", 0, 100 * S, 100 * S + S // 2)
    get = registry.get_sample_value
    assert get("rrto_energy_joules_total", {"session": "s"}) == pytest.approx(6.0)
    assert get("rrto_energy_state_joules_total", {"session": "s", "state": "inference"}) == 6.0
    assert get("rrto_energy_per_inference_joules", {"session": "s"}) == pytest.approx(3.0)
    assert get("rrto_energy_inferences_total", {"session": "s"}) == 1.0
    assert get("rrto_power_watts", {"meter": "fake"}) == pytest.approx(6.0)
    assert get("rrto_meter_energy_joules_total", {"meter": "fake"}) == pytest.approx(6.0)


# ---- the sampling task --------------------------------------------------------------------------


class CountingMeter(MeterBase):
    """Counts up; optionally blocking or failing; signals at the read after ``want`` reads
    (the run reads one at a time: by then the ``want``-th was accounted, whereas a blocking
    read's result is still in its thread when it signals, and a cancel then loses it)."""

    def __init__(self, want: int, blocking: bool = False, fail_first: int = 0):
        self.blocking = blocking
        self.want = want
        self.fail_first = fail_first
        self.calls = 0
        self.threads: set[int] = set()
        self.done = asyncio.Event()
        self.loop = asyncio.get_running_loop()

    def read(self) -> float:
        self.calls += 1
        self.threads.add(threading.get_ident())
        if self.calls > self.want:
            self.loop.call_soon_threadsafe(self.done.set)
        if self.calls <= self.fail_first:
            raise OSError("sensor hiccup")
        return float(self.calls)


async def _run_until_done(meter: CountingMeter) -> EnergyAccountant:
    acct = EnergyAccountant("counting", meter, 200.0)
    task = asyncio.create_task(acct.run())
    await asyncio.wait_for(meter.done.wait(), timeout=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return acct


def test_run_samples_until_cancelled_and_survives_read_errors() -> None:
    async def main() -> None:
        meter = CountingMeter(want=5, fail_first=2)
        acct = await _run_until_done(meter)
        d = acct.describe()
        assert d["read_errors"] == 2
        assert d["samples"] >= 3  # reads 3.. succeeded (plus the final one at cancel)
        assert meter.threads == {threading.get_ident()}  # sysfs-style: read on the loop

    asyncio.run(main())


def test_run_reads_blocking_meters_in_a_thread() -> None:
    async def main() -> None:
        meter = CountingMeter(want=3, blocking=True)
        acct = await _run_until_done(meter)
        assert threading.get_ident() not in meter.threads
        assert acct.describe()["samples"] >= 3

    asyncio.run(main())
