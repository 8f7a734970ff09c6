"""Hybrid-Parallel end to end (``rrtod.lop``, ``plugins/torch/rows.py``): unmodified torch apps
under ``rrto-run`` against a real daemon whose scheduler splits a region of local operators by
rows (``test-split``: the largest region, 40 % of the rows on the robot). Robot and host each
compute their band of every value of the region; the host's band of the app's input goes up,
and at the region's edge the two bands are put together where the next call runs: on the host
(small_cnn's classifier, the UNet's bilinear upsampling) or on the robot (the app downloads the
value). The outputs equal local execution within float32 rounding: a band of a convolution is
computed with the library's algorithm for the band's shape, whose sums may round otherwise
than the whole's (docs/scheduling.md, "Hybrid-Parallel")."""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest
import yaml

from testkit.apps import DAEMON_ENV, HOST, compare_outputs, run_app, start_local
from testkit.daemons import TEST_DEFAULTS, Launcher

RUNS = 6
TOLERANCE = 1e-4  # float32 sums of a band against the whole's: ~1e-5 on these models


@pytest.fixture(scope="module")
def daemon():
    with Launcher(extra_env=DAEMON_ENV) as launcher:
        d = launcher.start("rrtod", **{**TEST_DEFAULTS, **HOST, "scheduler": "test-split"})
        yield d


def split_run(daemon: Any, name: str, tmp, runs: int = RUNS) -> dict:
    """Run app ``name`` split, and locally; the outputs agree within ``TOLERANCE``."""
    flags = ("--runs", str(runs))
    local = start_local(name, *flags, dump=tmp / f"{name}-local.json", background=True)
    got, stats = run_app(name, daemon, *flags, tmp=tmp, tag="split")
    want = local()
    values = [json.loads((tmp / f"{name}-{t}.json").read_text()) for t in ("split", "local")]
    why = compare_outputs(got, want, TOLERANCE, *values)
    assert why is None, f"{name}: {why}"
    return stats


@pytest.mark.parametrize("name", ["small_cnn", "unet", "resnet", "split_switch"])
def test_a_split_region_replays_with_both_sides_computing_rows(daemon, tmp_path, name):
    """Every inference after the first few replays the split plan: the robot runs the region's
    calls on its bands (``robot_ops``), the host the rest, with no mismatch."""
    daemon.ask("flush", all="1")
    stats = split_run(daemon, name, tmp_path)
    assert stats["replays"] >= RUNS - 2 and stats["mismatches"] == 0, stats
    assert 0 < stats["robot_ops"] < stats["replayed_ops"], stats
    assert stats["here"] == 0, stats  # a split plan never runs unseen: the host has rows to make
    scheduling = daemon.ctl("status")["scheduling"]
    assert scheduling["refused"] == 0, scheduling


def test_a_mismatch_in_the_middle_of_a_split_region_loses_nothing(daemon, tmp_path):
    """split_switch's seventh inference takes another branch inside the region: the robot
    holds only the first rows of the values made so far, so each is put together from the
    host's band before it is forwarded; the inference completes by forwarding, equal to
    local, and the next ones replay the split again (the map the app downloads is put
    together on the robot)."""
    daemon.ask("flush", all="1")
    stats = split_run(daemon, "split_switch", tmp_path, runs=10)
    assert stats["mismatches"] == 1 and stats["replays"] >= 7, stats
    assert stats["by_inference"]["replays"][-3:] == [1, 1, 1], stats
    assert stats["robot_ops"] > 0, stats


def test_the_split_follows_a_reload(daemon, tmp_path):
    """``remote-all`` after ``test-split`` (a reload): nothing runs on the robot any more."""
    daemon.config_path.write_text(yaml.safe_dump(dict(daemon.config, scheduler="remote-all")))
    daemon.proc.send_signal(signal.SIGHUP)
    daemon.wait_notify("RELOADING=1")
    daemon.wait_notify("READY=1")
    daemon.ask("flush", all="1")
    stats = split_run(daemon, "small_cnn", tmp_path)
    assert stats["robot_ops"] == 0 and stats["replays"] >= RUNS - 2, stats
