"""The ``scheduler`` key end to end: unmodified torch apps (tests/apps) under ``rrto-run``
against real daemons whose only difference is the scheduler. What runs where changes (the shim
counts the calls it ran on the robot), the outputs never do: every run equals local execution
bit for bit, with values crossing the cut both ways, in-place writes, views and a recurrent
state (``rrtod.partition``)."""

from __future__ import annotations

from typing import Any

import pytest

from testkit.apps import DAEMON_ENV, HOST, same_as_local
from testkit.daemons import TEST_DEFAULTS, Launcher

RUNS = 5


@pytest.fixture(scope="module")
def daemons():
    """One robot+gpu daemon per scheduler: the built-in ``remote-all`` (the default) and
    ``robot-all``, and the test plugin's ``test-alternate`` (every other group of calls on the
    robot: the most crossings a placement can have; testkit/echo_plugin)."""
    with Launcher(extra_env=DAEMON_ENV) as launcher:
        yield {name: launcher.start(f"rrtod-{name}", **{**TEST_DEFAULTS, **HOST,
                                                          "scheduler": name})
               for name in ("remote-all", "robot-all", "test-alternate", "min-cut")}


def replayed(daemon: Any, name: str, tmp, runs: int = RUNS) -> dict:
    daemon.ask("flush", all="1")
    stats = same_as_local(name, daemon, "--runs", str(runs), tmp=tmp)
    assert stats["replays"] >= runs - 2 and stats["mismatches"] == 0, stats
    return stats


def test_the_scheduler_key_changes_what_runs_where(daemons, tmp_path):
    """small_cnn: every call on the host, every call on the robot, or some of each; the
    robot daemon says how it placed the sequence."""
    host = replayed(daemons["remote-all"], "small_cnn", tmp_path)
    assert host["robot_ops"] == 0 and host["replayed_ops"] > 0, host
    robot = replayed(daemons["robot-all"], "small_cnn", tmp_path)
    assert robot["robot_ops"] == robot["replayed_ops"] > 0, robot
    split = replayed(daemons["test-alternate"], "small_cnn", tmp_path)
    assert 0 < split["robot_ops"] < split["replayed_ops"], split
    # the robot ran everything: only the inputs' first uploads and the weights' query travel
    assert robot["bytes_down"] < host["bytes_down"], (robot, host)
    for name, placed in (("remote-all", 0), ("robot-all", 1), ("test-alternate", 1)):
        scheduling = daemons[name].ask("status")["scheduling"]
        assert scheduling["scheduler"] == name and scheduling["placed"] == placed, scheduling
        assert scheduling["refused"] == 0, scheduling


def test_a_split_inference_equals_local(daemons, tmp_path):
    """The gru app cut as often as possible: a recurrent state read across the cut,
    ``transpose_`` changing a value's layout in place, views of a stacked output, ``unbind``
    and ``unsafe_split`` outputs read on the other side."""
    stats = replayed(daemons["test-alternate"], "gru", tmp_path)
    assert 0 < stats["robot_ops"] < stats["replayed_ops"], stats


def test_min_cut_measures_then_places_again(daemons, tmp_path):
    """``min-cut`` starts with every call on the host, whose first replays time its calls;
    then runs every call on the robot for a few inferences to time them there; then places
    the sequence at the cut for the measured link (here, with robot and host the same CPU, on
    the robot: every transfer costs more than it saves). Each change is a new plan of the
    same sequence, taken without a mismatch, and every inference equals local execution."""
    daemon = daemons["min-cut"]
    stats = replayed(daemon, "small_cnn", tmp_path, runs=14)
    assert stats["robot_ops"] > 0, stats
    status = daemon.ask("status")
    assert status["scheduling"]["replaced"] >= 1, status["scheduling"]
    (host,) = status["hosts"]
    assert host["mbit_s"] and host["mbit_s"] > 0, host  # the link's throughput, measured
