"""A GPU daemon killed under a running, unmodified app (tests/apps under ``rrto-run``, real
robot and GPU daemons): the app sees no error, prints exactly what local execution prints, and
offloads again when a host takes it (the same one restarted, or another one). See
tests/test_failover.py for the shim's parts in process."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from testkit.apps import APPS, DAEMON_ENV, app_env, shim_stats
from testkit.apps import run_local as local_output
from testkit.daemons import BIN, TEST_DEFAULTS, Launcher, free_port

APP = "small_cnn"
LOOP = ("--runs", "30", "--pace", "20", "--until-stdin")  # a paced loop the test stops
# Daemons start and stop several times per test, and the app's frames are run again locally.
pytestmark = pytest.mark.timeout(300)


def run_local(runs: int) -> str:
    return local_output(APP, "--runs", str(runs), timeout=300)


def start_app(robot: Any, **extra: str) -> subprocess.Popen[str]:
    env = app_env(OMP_WAIT_POLICY="PASSIVE", RRTO_STATS="1", RRTO_FALLBACK="local", **extra)
    env.update(robot.env)
    return subprocess.Popen([str(BIN / "rrto-run"), "--", sys.executable,
                             str(APPS / f"{APP}.py"), *LOOP], env=env, cwd=APPS,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def gpu_daemon(launcher: Launcher, name: str, port: int, wait: bool = True) -> Any:
    return launcher.start(name, roles=["gpu"], listen=f"127.0.0.1:{port}", wait=wait,
                          **TEST_DEFAULTS)


def offloading(robot: Any, host: str, inferences: int, app: subprocess.Popen[str]) -> None:
    """Wait until the app's session on ``host`` has run ``inferences`` (replayed by then)."""
    robot.wait_for(lambda s: app.poll() is not None or any(
        x["host"] == host and x["inferences"] >= inferences for x in s["sessions"]),
        timeout=120, what=f"{inferences} inferences offloaded to {host}")
    assert app.poll() is None, app.communicate()[1][-3000:]


def kill(gpu: Any) -> None:
    gpu.proc.send_signal(signal.SIGKILL)
    gpu.proc.wait(10)


def finish(app: subprocess.Popen[str]) -> tuple[str, dict]:
    """Stop the loop; the app's output must be what local execution prints."""
    out, err = app.communicate("stop\n", timeout=300)
    assert app.returncode == 0, err[-3000:]
    stats = shim_stats(err)
    assert stats, err[-3000:]
    runs = stats["inferences"]
    assert out == run_local(runs), f"{runs} inferences differ from local"
    return out, stats


def test_a_killed_host_that_restarts_takes_the_app_back_with_no_error():
    port = free_port()
    with Launcher(extra_env=DAEMON_ENV) as launcher:
        gpu = gpu_daemon(launcher, "gpu", port)
        robot = launcher.start("robot", roles=["robot"],
                               hosts=[{"name": "gpu", "address": f"127.0.0.1:{port}"}],
                               **TEST_DEFAULTS)
        app = start_app(robot)
        offloading(robot, "gpu", 10, app)
        kill(gpu)
        lost_at = time.monotonic()
        gpu_daemon(launcher, "gpu-again", port)  # the same address: the host comes back
        robot.wait_for(lambda s: s["hosts"][0]["state"] == "up", timeout=30, what="host up")
        offloading(robot, "gpu", 1, app)
        took = time.monotonic() - lost_at
        offloading(robot, "gpu", 10, app)  # and it replays there again
        _, stats = finish(app)
        assert stats["hosts_lost"] == 1 and stats.get("reconnects") == 1, stats
        done = robot.wait_for(lambda s: not s["sessions"], what="sessions closed")["finished"]
        assert done["sessions"] >= 2 and done["inferences"] >= 20  # (+ tries on a dead host)
        print(f"offloading again {took:.2f} s after the kill (restart included), the shim "
              f"offline {stats['offline_s']:.2f} s")


def test_a_killed_host_fails_the_app_over_to_another_host():
    ports = free_port(), free_port()
    with Launcher(extra_env=DAEMON_ENV) as launcher:
        gpus = [gpu_daemon(launcher, f"gpu{k}", p, wait=False) for k, p in enumerate(ports)]
        launcher.wait_ready(gpus)  # started together, ready before the robot starts
        robot = launcher.start(
            "robot", roles=["robot"], balancer="first-up",
            hosts=[{"name": f"gpu{k}", "address": f"127.0.0.1:{p}"} for k, p in enumerate(ports)],
            **TEST_DEFAULTS)
        robot.wait_for(lambda s: all(h["state"] == "up" for h in s["hosts"]), what="hosts up")
        app = start_app(robot)
        first = robot.wait_for(lambda s: bool(s["sessions"]), timeout=120,
                               what="a session")["sessions"]
        k = int(first[0]["host"].removeprefix("gpu"))  # the one first-up gave (gpu0 mostly)
        offloading(robot, f"gpu{k}", 10, app)
        kill(gpus[k])
        lost_at = time.monotonic()
        offloading(robot, f"gpu{1 - k}", 1, app)
        took = time.monotonic() - lost_at
        offloading(robot, f"gpu{1 - k}", 10, app)
        _, stats = finish(app)
        assert stats["hosts_lost"] == 1 and stats.get("reconnects") == 1, stats
        print(f"offloading on the other host {took:.2f} s after the kill, the shim offline "
              f"{stats['offline_s']:.2f} s")


def test_a_stalled_host_costs_an_inference_no_more_than_its_deadline():
    """``SIGSTOP`` of the GPU daemon: with ``RRTO_DEADLINE_MS`` the app stops waiting at the
    deadline and finishes the inference here; outputs stay equal to local, and whatever the
    robot daemon then decides about the host (lost, or back after ``SIGCONT``), the app goes
    on offloading."""
    port = free_port()
    with Launcher(extra_env=DAEMON_ENV) as launcher:
        gpu = gpu_daemon(launcher, "gpu", port)
        robot = launcher.start("robot", roles=["robot"],
                               hosts=[{"name": "gpu", "address": f"127.0.0.1:{port}"}],
                               **TEST_DEFAULTS)
        app = start_app(robot, RRTO_DEADLINE_MS="1000")
        offloading(robot, "gpu", 10, app)
        gpu.proc.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        gpu.proc.send_signal(signal.SIGCONT)
        robot.wait_for(lambda s: s["hosts"][0]["state"] == "up", timeout=30, what="host up")
        deadline = time.monotonic() + 60  # offloading again: a session with new inferences
        before = robot.status()["sessions"]
        seen = {x["id"]: x["inferences"] for x in before}
        while time.monotonic() < deadline:
            now = robot.status()["sessions"]
            if any(x["inferences"] >= seen.get(x["id"], 0) + 5 for x in now):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"not offloading again: {before} -> {now}")
        _, stats = finish(app)
        assert stats.get("deadline_misses", 0) + stats.get("hosts_lost", 0) >= 1, stats
        print(f"deadline misses {stats.get('deadline_misses', 0)}, hosts lost "
              f"{stats.get('hosts_lost', 0)}")
