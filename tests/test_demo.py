"""``make demo``, the README's main job: the unmodified camera loop run on an emulated robot and
offloaded through a robot and a GPU daemon over the emulated Wi-Fi link gives identical outputs
on every frame, is replayed (one request per frame) once its sequence is found, and the table
reports what the robot gains. As root the robots are cgroups (``demo/machines.py``), which must
be gone afterwards; without root the demo says so and runs on the whole machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from demo.machines import CGROUP, Machines, unavailable
from rrto_plugins.power.model import usable_cpus

REPO = Path(__file__).resolve().parent.parent
ROOT_ONLY = pytest.mark.skipif(unavailable() is not None, reason=f"cgroups: {unavailable()}")


def _leftover_groups() -> list[str]:
    cpu = CGROUP / "cpu"
    return sorted(p.name for p in cpu.glob("rrto-demo-*")) if cpu.is_dir() else []


def test_demo_offloads_the_camera_loop_with_identical_outputs() -> None:
    before = _leftover_groups()
    # A shorter run than `make demo`, on a faster robot: what is checked is the same.
    out = subprocess.run([sys.executable, "-m", "demo", "--frames", "5", "--robot-cpu", "0.5"],
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "outputs identical: yes" in text
    assert re.search(r"outputs identical to local\s+5 of 5 frames", text), text
    replayed = re.search(r"frames replayed, 1 request each\s+-\s+(\d+) of 5", text)
    assert replayed and int(replayed.group(1)) >= 1, text
    for row in (r"frame latency, median / p90\s+[\d.]+ / [\d.]+ ms\s+[\d.]+ / [\d.]+ ms",
                r"frames per second \(loop\)\s+[\d.]+\s+[\d.]+",
                r"robot energy / frame\s+[\d.]+ J\s+[\d.]+ J",
                r"bytes / frame, up / down\s+-\s+[\d.]+ [kM]B / [\d.]+ [kM]B",
                r"frame input \+ output size\s+921\.6 kB \+ 2\.8 kB"):
        assert re.search(row, text), (row, text)
    assert re.search(r"link: wifi6-edge \(emulated\), measured RTT [\d.]+ ms", text), text
    assert "power meter 'model', modelled (RRTO paper's robot" in text
    assert re.search(r"GPU daemon on this machine computes on device '(cpu|cuda[:\d]*)'", text), text
    if unavailable() is None:
        assert re.search(r"measured [\d.]+x slower than the GPU host", text), text
        assert _leftover_groups() == before
    else:
        assert f"({unavailable()}: no CPU-quota cgroup" in text


@ROOT_ONLY
def test_robot_groups_cap_the_cpu_and_are_removed_with_their_members_moved_out() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with Machines(0.25) as machines:
            robot = machines.robots[0]
            robot.join(child.pid)
            assert robot.members() == [child.pid]
            assert usable_cpus(child.pid) == pytest.approx(0.25)
            paths = [g.path for g in machines.groups]
            with pytest.raises(ValueError, match="outside"):
                robot.join(os.getpid())  # the demo itself keeps the host's CPU
        assert not any(p.exists() for p in paths)
        assert usable_cpus(child.pid) == len(os.sched_getaffinity(child.pid))
        assert child.poll() is None  # moved out, not killed
    finally:
        child.kill()
        child.wait()


@ROOT_ONLY
def test_robot_groups_are_removed_when_the_block_raises() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(KeyboardInterrupt), Machines(0.25) as machines:
            machines.robots[1].join(child.pid)
            paths = [g.path for g in machines.groups]
            raise KeyboardInterrupt
        assert not any(p.exists() for p in paths)
    finally:
        child.kill()
        child.wait()


@ROOT_ONLY
def test_calibration_measures_the_robot_slower_than_the_host() -> None:
    # The figure depends on the machine's load; what must hold is that the quota throttles.
    with Machines(0.1) as machines:
        started = time.monotonic()
        assert machines.calibrate(seconds=0.1) > 1.5
        assert time.monotonic() - started < 30


def test_machines_refuse_a_share_they_cannot_emulate() -> None:
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        Machines(1.5)


def test_without_a_cpu_controller_the_demo_says_why(tmp_path: Path) -> None:
    reason = unavailable(tmp_path)
    assert reason in ("not running as root", f"no cgroup v1 cpu controller at {tmp_path / 'cpu'}")
