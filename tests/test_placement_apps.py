"""Per-inference placement with real daemons (rrtod/robot/placement.py): an unmodified app
(tests/apps under ``rrto-run``) whose replayed inferences one robot daemon spreads over several
GPU daemons prints exactly what local execution prints; a replica killed under it costs the
app nothing. The routing rules themselves are in tests/test_placement.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

import pytest

from rrtod.ctl import request
from testkit.apps import APPS, DAEMON_ENV, app_env, shim_stats
from testkit.daemons import BIN, TEST_DEFAULTS, Launcher, free_port
from testkit.held import run_local

APP = "small_cnn"
pytestmark = pytest.mark.timeout(300)


def start_app(robot: Any, *loop: str) -> subprocess.Popen[str]:
    env = app_env(OMP_WAIT_POLICY="PASSIVE", RRTO_STATS="1", RRTO_FALLBACK="local")
    env.update(robot.env)
    return subprocess.Popen([str(BIN / "rrto-run"), "--", sys.executable,
                             str(APPS / f"{APP}.py"), *loop], env=env, cwd=APPS,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def fleet(launcher: Launcher, n: int, **robot: Any) -> tuple[list[Any], Any]:
    ports = [free_port() for _ in range(n)]
    gpus = [launcher.start(f"gpu{i}", roles=["gpu"], listen=f"127.0.0.1:{p}", wait=False,
                           **TEST_DEFAULTS) for i, p in enumerate(ports)]
    launcher.wait_ready(gpus)  # started together, ready before the robot starts
    hosts = [{"name": f"gpu{i}", "address": f"127.0.0.1:{p}"} for i, p in enumerate(ports)]
    merged = {**TEST_DEFAULTS, **robot}
    return gpus, launcher.start("robot", roles=["robot"], hosts=hosts, **merged)


def placed(status: dict) -> dict:
    """The placement block of the (one) app session in a robot's status."""
    return next(((x.get("placement") or {}) for x in status["sessions"]), {})


def finish(app: subprocess.Popen[str], stdin: str | None = None) -> dict:
    out, err = app.communicate(stdin, timeout=300)
    assert app.returncode == 0, err[-3000:]
    stats = shim_stats(err)
    assert stats, err[-3000:]
    want = run_local(APP, "--runs", str(stats["inferences"]))
    assert out == want, "outputs differ from local execution"
    return stats


def test_round_robin_spreads_replayed_inferences_over_three_hosts():
    with Launcher(extra_env=DAEMON_ENV) as launcher:
        _gpus, robot = fleet(launcher, 3, balancer="round-robin")
        app = start_app(robot, "--runs", "60", "--pace", "5", "--until-stdin")
        robot.wait_for(lambda s: app.poll() is not None or any(
            len([n for n in (x.get("placement") or {}).get("placements", {}).values() if n >= 5])
            == 3 for x in s["sessions"]), timeout=120, what="inferences on all three hosts")
        status = request(robot.socket, "status", timeout=10)
        stats = finish(app, "stop\n")
        placed = status["sessions"][0]["placement"]["placements"]
        assert sorted(placed) == ["gpu0", "gpu1", "gpu2"] and min(placed.values()) >= 5, placed
        assert stats["replays"] >= 15, stats


def test_a_replica_killed_under_the_app_costs_it_nothing():
    """Each inference goes to a host in turn; the replicas are killed one after the other while
    the app runs: their inferences in flight are run again on the primary, which serves on."""
    with Launcher(extra_env=DAEMON_ENV) as launcher:
        gpus, robot = fleet(launcher, 3, balancer="round-robin")
        app = start_app(robot, "--runs", "80", "--pace", "5", "--until-stdin")

        robot.wait_for(lambda s: app.poll() is not None or min(
            placed(s).get("placements", {"x": 0}).values()) >= 5 and len(
            placed(s).get("placements", {})) == 3, timeout=120, what="all three hosts in use")
        status = request(robot.socket, "status", timeout=10)
        primary = status["sessions"][0]["host"]
        replicas = [g for g in gpus if g.config["node"] != primary]
        for gpu in replicas:
            gpu.proc.send_signal(signal.SIGKILL)
            gpu.proc.wait(10)
            before = placed(request(robot.socket, "status", timeout=10))["placements"][primary]
            robot.wait_for(lambda s, b=before: app.poll() is not None
                           or placed(s)["placements"][primary] >= b + 5,
                           timeout=120, what="inferences on the primary after a kill")
        stats = finish(app, "stop\n")
        end = request(robot.socket, "status", timeout=10)
        assert stats.get("hosts_lost", 0) == 0, stats  # the app's session never broke
        assert stats["replays"] >= 20, stats
        assert end["finished"]["sessions"] == 1


def test_a_stalled_replica_costs_the_app_at_most_a_late_inference():
    """A replica stopped (``SIGSTOP``) under the app: its inference in flight is late and runs
    on the primary; no more go to it until it answers again (``SIGCONT``)."""
    with Launcher(extra_env=DAEMON_ENV) as launcher:
        gpus, robot = fleet(launcher, 2, balancer="round-robin")
        app = start_app(robot, "--runs", "60", "--pace", "5", "--until-stdin")

        robot.wait_for(lambda s: app.poll() is not None or len(
            placed(s).get("placements", {})) == 2 and min(
            placed(s)["placements"].values()) >= 10, timeout=120, what="both hosts in use")
        primary = request(robot.socket, "status", timeout=10)["sessions"][0]["host"]
        replica = next(g for g in gpus if g.config["node"] != primary)
        replica.proc.send_signal(signal.SIGSTOP)
        try:
            before = placed(request(robot.socket, "status", timeout=10))["placements"][primary]
            robot.wait_for(lambda s: app.poll() is not None
                           or placed(s)["placements"][primary] >= before + 20,
                           timeout=120, what="inferences on the primary during the stall")
            during = placed(request(robot.socket, "status", timeout=10))
        finally:
            replica.proc.send_signal(signal.SIGCONT)
        # the inference in flight there was late (or the replica was found down first)
        assert during["late"] + during["failovers"] >= 1, during
        stats = finish(app, "stop\n")
        assert stats.get("hosts_lost", 0) == 0, stats
        end = request(robot.socket, "status", timeout=10)
        assert end["finished"]["sessions"] == 1
