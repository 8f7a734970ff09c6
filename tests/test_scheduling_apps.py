"""The ``scheduler`` key end to end: unmodified torch apps (tests/apps) under ``rrto-run``
against a real daemon whose scheduler is changed by a reload between runs. What runs where
changes (the shim counts the calls it ran on the robot), the outputs never do: every run equals
local execution bit for bit, with values crossing the cut both ways, in-place writes, views and
a recurrent state (``rrtod.partition``)."""

from __future__ import annotations

import signal
from typing import Any

import pytest
import yaml

from testkit.apps import DAEMON_ENV, HOST, same_as_local
from testkit.daemons import TEST_DEFAULTS, Launcher

RUNS = 5


@pytest.fixture(scope="module")
def daemon():
    with Launcher(extra_env=DAEMON_ENV) as launcher:
        yield launcher.start("rrtod", **{**TEST_DEFAULTS, **HOST})


def use(daemon: Any, scheduler: str) -> None:
    """Reload ``daemon`` with ``scheduler`` (it applies to sequences defined from then on) and
    forget the saved sequences, so that the next run's sequence is placed by it."""
    daemon.config_path.write_text(yaml.safe_dump(dict(daemon.config, scheduler=scheduler)))
    daemon.proc.send_signal(signal.SIGHUP)
    daemon.wait_notify("RELOADING=1")
    daemon.wait_notify("READY=1")
    assert daemon.ctl("status")["scheduling"]["scheduler"] == scheduler
    daemon.ask("flush", all="1")


def replayed(daemon: Any, name: str, tmp, runs: int = RUNS) -> dict:
    stats = same_as_local(name, daemon, "--runs", str(runs), tmp=tmp)
    assert stats["replays"] >= runs - 2 and stats["mismatches"] == 0, stats
    return stats


def test_the_scheduler_key_changes_what_runs_where(daemon, tmp_path):
    """small_cnn with every call on the host (``remote-all``, the default), then on the robot
    (``robot-all``: through the shim while it times them, then run on the app's own tensors);
    then the gru app under the test plugin's ``test-alternate``, which puts
    every other group of calls on the robot (testkit/echo_plugin): the most crossings a
    placement can have, with a recurrent state read across the cut, ``transpose_`` changing a
    value's layout in place, views of a stacked output, ``unbind`` and ``unsafe_split`` outputs
    read on the other side."""
    use(daemon, "remote-all")
    host = replayed(daemon, "small_cnn", tmp_path)
    assert host["robot_ops"] == 0 and host["replayed_ops"] > 0, host
    use(daemon, "robot-all")
    robot = replayed(daemon, "small_cnn", tmp_path, runs=9)
    assert robot["robot_ops"] == robot["replayed_ops"] > 0, robot
    # once the robot's times are measured (3 inferences through the shim), the app's forward
    # runs on its own tensors, nothing intercepted (plugins/torch/here.py)
    assert robot["here"] >= 2 and robot["mismatches"] == 0, robot
    # the robot ran everything: only the inputs' first uploads and the weights' query travel
    assert robot["bytes_down"] < host["bytes_down"], (robot, host)
    scheduling = daemon.ctl("status")["scheduling"]
    assert scheduling["placed"] == 1 and scheduling["refused"] == 0, scheduling
    use(daemon, "test-alternate")
    split = replayed(daemon, "gru", tmp_path)
    assert 0 < split["robot_ops"] < split["replayed_ops"], split


def test_min_cut_measures_then_places_again(daemon, tmp_path):
    """``min-cut`` starts with every call on the host, whose first replays time its calls
    and then the app's latency; then runs every call on the robot to time them there; then
    places the sequence at the cut for the measured link, and keeps the fastest the app
    measured. Each change is a plan of the same sequence, taken without a mismatch, and every
    inference equals local execution."""
    use(daemon, "min-cut")
    stats = replayed(daemon, "small_cnn", tmp_path, runs=26)
    assert stats["robot_ops"] > 0, stats
    status = daemon.ctl("status")
    scheduling = status["scheduling"]
    assert scheduling["replaced"] >= 1 and scheduling["timed"] >= 2, scheduling
    (host,) = status["hosts"]
    assert host["mbit_s"] and host["mbit_s"] > 0, host  # the link's throughput, measured
