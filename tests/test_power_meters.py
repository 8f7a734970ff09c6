"""Power meter plugins against fake sysfs trees, fake NVML bindings and a scripted clock.

Permission errors are simulated with an injected reader, not chmod: the tests run as root here,
and root reads a mode-000 file anyway.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from rrto_plugins import power
from rrto_plugins.power._sysfs import read_text
from rrto_plugins.power.base import MeterUnavailable
from rrto_plugins.power.jetson import JetsonMeter
from rrto_plugins.power.model import (
    DEFAULT_WATTS,
    ModelMeter,
    ProcessCpu,
    cgroup_cpu_limit,
    check_watts,
    usable_cpus,
)
from rrto_plugins.power.nvml import NvmlMeter, load_api
from rrto_plugins.power.rapl import RaplMeter
from rrtod.config import PowerConfig


class Clock:
    """A CLOCK_MONOTONIC stand-in moved by the test, in nanoseconds."""

    def __init__(self, t_ns: int = 1_000_000_000):
        self.t = t_ns

    def __call__(self) -> int:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += round(seconds * 1e9)


def write(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{value}\n")


def denying(*names: str):
    """A reader that fails like a root-only sysfs file for paths ending in any of ``names``."""

    def reader(path: Path) -> str:
        if path.name in names:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return read_text(path)

    return reader


# ---- RAPL ---------------------------------------------------------------------------------------


def rapl_zone(root: Path, zone: str, name: str, energy_uj: int, max_uj: int = 262_143_328_850):
    write(root / zone / "name", name)
    write(root / zone / "energy_uj", energy_uj)
    write(root / zone / "max_energy_range_uj", max_uj)


@pytest.fixture
def rapl_tree(tmp_path: Path) -> Path:
    """A client Intel CPU: package with core/uncore/dram subzones, plus psys."""
    root = tmp_path / "powercap"
    rapl_zone(root, "intel-rapl:0", "package-0", 1_000_000)
    rapl_zone(root, "intel-rapl:0:0", "core", 500_000)
    rapl_zone(root, "intel-rapl:0:1", "uncore", 100_000)
    rapl_zone(root, "intel-rapl:0:2", "dram", 2_000_000)
    rapl_zone(root, "intel-rapl:1", "psys", 9_000_000)
    rapl_zone(root, "intel-rapl-mmio:0", "package-0", 1_000_000)
    return root


def test_rapl_sums_package_and_dram_only(rapl_tree: Path) -> None:
    meter = RaplMeter(rapl_tree)
    assert sorted(meter.describe()["zones"].values()) == ["dram", "package-0"]
    assert meter.read() == 0.0
    write(rapl_tree / "intel-rapl:0" / "energy_uj", 1_000_000 + 3_000_000)  # +3 J package
    write(rapl_tree / "intel-rapl:0:2" / "energy_uj", 2_000_000 + 500_000)  # +0.5 J dram
    write(rapl_tree / "intel-rapl:0:0" / "energy_uj", 9_999_999)  # core: inside package, ignored
    write(rapl_tree / "intel-rapl:1" / "energy_uj", 99_000_000)  # psys: overlaps, ignored
    assert meter.read() == pytest.approx(3.5)


def test_rapl_counter_wrap_is_corrected(tmp_path: Path) -> None:
    root = tmp_path / "powercap"
    rapl_zone(root, "intel-rapl:0", "package-0", 900_000, max_uj=999_999)  # wraps after 1 J
    meter = RaplMeter(root)
    write(root / "intel-rapl:0" / "energy_uj", 100_000)  # 0.1 J to the wrap, 0.1 J after
    assert meter.read() == pytest.approx(0.2)
    write(root / "intel-rapl:0" / "energy_uj", 50_000)  # wrapped again: 0.95 J more
    assert meter.read() == pytest.approx(1.15)
    write(root / "intel-rapl:0" / "energy_uj", 50_000)  # no change, no energy
    assert meter.read() == pytest.approx(1.15)


def test_rapl_permission_denied_names_file_and_fix(rapl_tree: Path) -> None:
    reason = RaplMeter.probe(rapl_tree, reader=denying("energy_uj"))
    assert reason is not None
    assert "permission denied" in reason
    assert "intel-rapl:0/energy_uj" in reason
    assert "root-only since Linux 5.10" in reason
    assert RaplMeter.probe(rapl_tree) is None


def test_rapl_probe_reasons(tmp_path: Path) -> None:
    assert "no powercap sysfs" in str(RaplMeter.probe(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    assert "no RAPL zones" in str(RaplMeter.probe(tmp_path / "empty"))
    rapl_zone(tmp_path / "coreonly", "intel-rapl:0:0", "core", 1)
    reason = str(RaplMeter.probe(tmp_path / "coreonly"))
    assert "no package, dram or psys" in reason and "core" in reason


def test_rapl_uses_psys_when_no_package(tmp_path: Path) -> None:
    root = tmp_path / "powercap"
    rapl_zone(root, "intel-rapl:1", "psys", 0)
    meter = RaplMeter(root)
    write(root / "intel-rapl:1" / "energy_uj", 7_000_000)
    assert meter.read() == pytest.approx(7.0)


def test_rapl_failed_read_changes_nothing(rapl_tree: Path) -> None:
    fail = {"on": False}

    def reader(path: Path) -> str:
        if fail["on"] and path.parent.name == "intel-rapl:0:2":
            raise OSError(errno.EIO, "I/O error", str(path))
        return read_text(path)

    meter = RaplMeter(rapl_tree, reader=reader)
    write(rapl_tree / "intel-rapl:0" / "energy_uj", 2_000_000)
    fail["on"] = True
    with pytest.raises(OSError):
        meter.read()
    fail["on"] = False
    assert meter.read() == pytest.approx(1.0)  # the package's joule is counted once, now


# ---- Jetson -------------------------------------------------------------------------------------


def hwmon_channel(dev: Path, k: int, label: str, mv: int, ma: int) -> None:
    write(dev / f"in{k}_label", label)
    write(dev / f"in{k}_input", mv)
    write(dev / f"curr{k}_input", ma)
    write(dev / f"in{k}_enable", 1)


@pytest.fixture
def orin_tree(tmp_path: Path) -> Path:
    """L4T r35 (Orin Nano) layout: mainline ina3221 hwmon, VDD_IN is the module input."""
    root = tmp_path / "drivers"
    dev = root / "ina3221" / "1-0040" / "hwmon" / "hwmon3"
    hwmon_channel(dev, 1, "VDD_IN", 5000, 2000)  # 10 W
    hwmon_channel(dev, 2, "VDD_CPU_GPU_CV", 5000, 800)  # branches of VDD_IN
    hwmon_channel(dev, 3, "VDD_SOC", 5000, 400)
    write(dev / "in7_label", "sum of shunt voltages")
    return root


def test_jetson_hwmon_uses_input_rail_and_integrates(orin_tree: Path) -> None:
    clock = Clock()
    meter = JetsonMeter(orin_tree, clock=clock)
    assert meter.describe()["rails"] == ["VDD_IN"]
    assert meter.power_w() == pytest.approx(10.0)
    clock.advance(2.0)
    write(orin_tree / "ina3221" / "1-0040" / "hwmon" / "hwmon3" / "curr1_input", 2400)  # 12 W
    assert meter.read() == pytest.approx((10 + 12) / 2 * 2.0)  # trapezoid: 22 J
    clock.advance(1.0)
    assert meter.read() == pytest.approx(22 + 12)


def test_jetson_iio_layout_old_l4t(tmp_path: Path) -> None:
    """L4T r32 (Nano): ina3221x iio device, power in mW, POM_5V_IN is the input."""
    root = tmp_path / "drivers"
    dev = root / "ina3221x" / "6-0040" / "iio:device0"
    for k, (name, mw) in enumerate([("POM_5V_IN", 4000), ("POM_5V_GPU", 900), ("POM_5V_CPU", 700)]):
        write(dev / f"rail_name_{k}", name)
        write(dev / f"in_power{k}_input", mw)
    clock = Clock()
    meter = JetsonMeter(root, clock=clock)
    assert meter.describe()["rails"] == ["POM_5V_IN"]
    clock.advance(0.5)
    assert meter.read() == pytest.approx(4.0 * 0.5)


def test_jetson_without_input_rail_sums_all_connected(tmp_path: Path) -> None:
    """AGX Xavier: two monitors, no module-input rail: the separate supplies add up."""
    root = tmp_path / "drivers"
    rails = {"1-0040": [("GPU", 1000), ("CPU", 2000), ("SOC", 3000)],
             "1-0041": [("CV", 500), ("NC", 99_000), ("SYS5V", 1500)]}
    for n, (addr, chans) in enumerate(rails.items()):
        dev = root / "ina3221x" / addr / f"iio:device{n}"
        for k, (name, mw) in enumerate(chans):
            write(dev / f"rail_name_{k}", name)
            write(dev / f"in_power{k}_input", mw)
    meter = JetsonMeter(root, clock=Clock())
    assert sorted(meter.describe()["rails"]) == ["CPU", "CV", "GPU", "SOC", "SYS5V"]
    assert meter.power_w() == pytest.approx(8.0)  # the NC channel is not counted


def test_jetson_iio_without_power_file_uses_volts_times_amps(tmp_path: Path) -> None:
    dev = tmp_path / "ina3221x" / "0-0041" / "iio_device"
    write(dev / "rail_name_0", "VDD_IN")
    write(dev / "in_voltage0_input", 19_000)
    write(dev / "in_current0_input", 500)
    assert JetsonMeter(tmp_path, clock=Clock()).power_w() == pytest.approx(9.5)


def test_jetson_explicit_rails_and_disabled_channels(orin_tree: Path) -> None:
    dev = orin_tree / "ina3221" / "1-0040" / "hwmon" / "hwmon3"
    meter = JetsonMeter(orin_tree, rails=["vdd_soc", "VDD_CPU_GPU_CV"], clock=Clock())
    assert meter.power_w() == pytest.approx(5 * 0.8 + 5 * 0.4)
    write(dev / "in3_enable", 0)
    with pytest.raises(MeterUnavailable, match="VDD_SOC not found"):
        JetsonMeter(orin_tree, rails=["VDD_SOC"], clock=Clock())


def test_jetson_probe_reasons(tmp_path: Path, orin_tree: Path) -> None:
    assert "no INA3221 power monitor" in str(JetsonMeter.probe(tmp_path / "nothing"))
    reason = str(JetsonMeter.probe(orin_tree, reader=denying("curr1_input")))
    assert "permission denied" in reason and "curr1_input" in reason
    assert JetsonMeter.probe(orin_tree) is None


# ---- NVML ---------------------------------------------------------------------------------------


class NVMLError_LibraryNotFound(Exception):  # noqa: N801 - pynvml's own spelling
    value = 12


class NVMLError_NotSupported(Exception):  # noqa: N801
    value = 3


class FakeNvml:
    name = "fake"

    def __init__(self, energy_mj: list[int], init_error: Exception | None = None,
                 energy_error: Exception | None = None):
        self.energy = energy_mj
        self.init_error = init_error
        self.energy_error = energy_error

    def init(self) -> None:
        if self.init_error:
            raise self.init_error

    def count(self) -> int:
        return len(self.energy)

    def handle(self, index: int) -> int:
        return index

    def energy_mj(self, handle: int) -> int:
        if self.energy_error:
            raise self.energy_error
        return self.energy[handle]


def test_nvml_sums_gpus_and_survives_driver_reload() -> None:
    api = FakeNvml([5_000_000, 7_000_000])
    meter = NvmlMeter(api)
    assert meter.blocking is True  # a driver call: the accountant reads it in a thread
    api.energy = [5_001_500, 7_000_500]
    assert meter.read() == pytest.approx(2.0)
    api.energy = [300, 7_001_000]  # GPU 0's counter restarted (driver reload)
    assert meter.read() == pytest.approx(2.0 + 0.3 + 0.5)


def test_nvml_probe_reasons() -> None:
    assert "no NVIDIA driver" in str(
        NvmlMeter.probe(FakeNvml([], init_error=NVMLError_LibraryNotFound("lib")))
    )
    assert "no NVIDIA GPU" in str(NvmlMeter.probe(FakeNvml([])))
    reason = str(NvmlMeter.probe(FakeNvml([1], energy_error=NVMLError_NotSupported("no"))))
    assert "Volta" in reason and "GPU 0" in reason
    assert NvmlMeter.probe(FakeNvml([1])) is None


def test_nvml_bindings_are_optional_and_prefer_cuda_python() -> None:
    def nothing(name: str) -> object:
        raise ImportError(name)

    with pytest.raises(MeterUnavailable, match="not installed"):
        load_api(nothing)
    imported: list[str] = []

    def both(name: str) -> object:
        imported.append(name)
        return object()

    assert load_api(both).name == "cuda.bindings.nvml"
    assert imported == ["cuda.bindings.nvml"]

    def only_pynvml(name: str) -> object:
        if name != "pynvml":
            raise ImportError(name)
        return object()

    assert load_api(only_pynvml).name == "pynvml"


# ---- model --------------------------------------------------------------------------------------


def test_model_integrates_scripted_states() -> None:
    clock = Clock()
    meter = ModelMeter(clock=clock, cpu=lambda: 0.0)
    clock.advance(2.0)  # standby
    meter.set_state("inference")
    clock.advance(3.0)
    meter.set_state("communication")
    clock.advance(1.5)
    meter.set_state("standby")
    clock.advance(0.5)
    expected = 2.0 * 4.04 + 3.0 * 13.35 + 1.5 * 4.25 + 0.5 * 4.04
    assert meter.read() == pytest.approx(expected)
    assert meter.read() == pytest.approx(expected)  # no time passed: nothing added


def test_model_cpu_use_moves_power_toward_inference() -> None:
    clock = Clock()
    busy = iter([0.5, 1.0])
    meter = ModelMeter(clock=clock, cpu=lambda: next(busy))
    clock.advance(1.0)
    assert meter.read() == pytest.approx(4.04 + (13.35 - 4.04) * 0.5)
    meter.state = "inference"
    clock.advance(1.0)
    assert meter.read() == pytest.approx(4.04 + (13.35 - 4.04) * 0.5 + 13.35)  # capped at W_inf


def test_model_watts_come_from_power_model_config() -> None:
    record = {r.name: r for r in power.rrto_power_meters()}["model"]
    meter = record.factory(PowerConfig(model={"inference": 10, "communication": 2,
                                              "standby": 1}))
    assert meter.watts == {"inference": 10.0, "communication": 2.0, "standby": 1.0}
    assert record.factory(PowerConfig()).watts == DEFAULT_WATTS
    assert record.probe() is None


def test_model_rejects_bad_tables() -> None:
    with pytest.raises(ValueError, match="unknown state"):
        check_watts({**DEFAULT_WATTS, "dancing": 3.0})
    with pytest.raises(ValueError, match="missing watts for standby"):
        check_watts({"inference": 1.0, "communication": 1.0})
    with pytest.raises(ValueError, match="power.model.standby"):
        check_watts({**DEFAULT_WATTS, "standby": -1.0})
    with pytest.raises(ValueError, match="unknown state"):
        ModelMeter(cpu=lambda: 0.0).set_state("sleeping")


def test_process_cpu_counts_only_tracked_processes() -> None:
    clock = Clock()
    cpu = ProcessCpu(clock, cores=2)
    x = 0
    for i in range(300_000):  # some CPU time in this process, untracked
        x += i
    clock.advance(1.0)
    assert cpu() == 0.0
    cpu.add(os.getpid())
    cpu.add(2**22 + 12345)  # no such process: ignored, not an error
    burnt = os.times()
    while os.times().user + os.times().system - burnt.user - burnt.system < 0.05:
        x += 1
    clock.advance(1.0)
    assert 0.0 < cpu() <= 1.0
    cpu.remove(os.getpid())
    clock.advance(1.0)
    assert cpu() == 0.0


def test_process_cpu_drops_a_process_that_exited() -> None:
    import subprocess
    import sys

    clock = Clock()
    cpu = ProcessCpu(clock, cores=2)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    cpu.add(child.pid)
    child.wait()  # reaped: its pid may now be reused, the open stat file must not follow it
    clock.advance(1.0)
    assert cpu() == 0.0
    assert child.pid not in cpu._procs
    cpu.remove(child.pid)  # the daemon still untracks it at session end: no error


def test_cgroup_cpu_limit_is_the_smallest_quota_up_to_the_root_v1(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu"
    write(cpu / "cpu.cfs_quota_us", -1)  # the root: no quota
    write(cpu / "cpu.cfs_period_us", 100000)
    write(cpu / "robots" / "cpu.cfs_quota_us", 150000)  # 1.5 CPUs for all robots
    write(cpu / "robots" / "cpu.cfs_period_us", 100000)
    write(cpu / "robots" / "arm" / "cpu.cfs_quota_us", 25000)  # this one: a quarter
    write(cpu / "robots" / "arm" / "cpu.cfs_period_us", 100000)
    membership = "4:memory:/x\n3:cpu:/robots/arm\n0::/\n"
    assert cgroup_cpu_limit(membership, tmp_path) == pytest.approx(0.25)
    assert cgroup_cpu_limit("3:cpu:/robots\n", tmp_path) == pytest.approx(1.5)
    assert cgroup_cpu_limit("3:cpu:/\n", tmp_path) == float("inf")
    # Controllers mounted together (cpu,cpuacct) are found under their joint directory.
    write(tmp_path / "cpu,cpuacct" / "g" / "cpu.cfs_quota_us", 50000)
    write(tmp_path / "cpu,cpuacct" / "g" / "cpu.cfs_period_us", 100000)
    assert cgroup_cpu_limit("2:cpu,cpuacct:/g\n", tmp_path) == pytest.approx(0.5)


def test_cgroup_cpu_limit_reads_cpu_max_of_cgroup_v2(tmp_path: Path) -> None:
    write(tmp_path / "cpu.max", "max 100000")
    write(tmp_path / "app.slice" / "cpu.max", "200000 100000")
    write(tmp_path / "app.slice" / "robot" / "cpu.max", "max 100000")
    assert cgroup_cpu_limit("0::/app.slice/robot\n", tmp_path) == pytest.approx(2.0)
    assert cgroup_cpu_limit("0::/\n", tmp_path) == float("inf")
    assert cgroup_cpu_limit("0::/gone\n", tmp_path) == float("inf")  # unreadable: no limit


def test_usable_cpus_of_this_process_is_its_affinity_without_a_quota() -> None:
    assert 0 < usable_cpus() <= len(os.sched_getaffinity(0))
    assert usable_cpus(os.getpid()) == usable_cpus()


def test_process_cpu_counts_busy_against_the_cores_it_was_given() -> None:
    clock = Clock()
    cpu = ProcessCpu(clock, cores=0.25)  # a robot with a quarter of a CPU
    cpu.add(os.getpid())
    burnt = os.times()
    x = 0
    while os.times().user + os.times().system - burnt.user - burnt.system < 0.05:
        x += 1
    clock.advance(1.0)  # >= 0.05 s of CPU in 1 s against 0.25 CPU: at least 0.2 busy
    assert cpu() >= 0.15


def test_a_meter_outside_the_robot_counts_busy_against_the_robots_cpus() -> None:
    """The benchmark meters an app in the robot's cgroup from its own process: busy is the
    app's CPU over the robot's quota, not over the harness's CPUs."""
    clock = Clock()
    meter = ModelMeter(clock=clock, cores=2)
    meter.count_against(0.25)
    meter._procs.add(os.getpid())  # type: ignore[union-attr]
    burnt = os.times()
    x = 0
    while os.times().user + os.times().system - burnt.user - burnt.system < 0.05:
        x += 1
    clock.advance(1.0)
    assert meter._cpu() >= 0.15  # against 2 CPUs: about 0.025


# ---- records ------------------------------------------------------------------------------------


def test_records_rank_whole_board_first_and_model_last() -> None:
    records = sorted(power.rrto_power_meters(), key=lambda r: -r.priority)
    assert [r.name for r in records] == ["jetson", "rapl", "nvml", "model"]
    assert all(r.description for r in records)
