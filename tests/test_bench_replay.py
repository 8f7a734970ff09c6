"""bench/replay.py: its figures are pure functions of counters, checked on synthetic numbers
(no timing is asserted); and its in-app driver on one short local run of a test app."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import replay
from testkit.apps import compare_outputs


def _rec(i: int, ms: float, replays: int, **shim: float) -> dict:
    return {"i": i, "ms": ms, "in_bytes": 100, "out_bytes": 40,
            "shim": {"replays": replays, **shim}}


def test_diff_and_median() -> None:
    assert replay.diff({"a": 1, "b": 2}, {"a": 4}, ("a", "b", "c")) == {"a": 3, "b": -2, "c": 0}
    assert replay.diff(None, {"a": 1}, ("a",)) is None
    assert replay.median([]) is None
    assert replay.median([3.0, 1.0, 2.0]) == 2.0
    assert replay.median([4.0, 1.0, 2.0, 3.0]) == 2.5


def test_first_replayed() -> None:
    recs = [_rec(0, 1, 0), _rec(1, 1, 0), _rec(2, 1, 1), _rec(3, 1, 2)]
    assert replay.first_replayed(recs) == 3
    assert replay.first_replayed(recs[:2]) is None
    assert replay.first_replayed([{"i": 0, "ms": 1.0}]) is None  # local: no shim counters


def test_window_figures_divide_counter_differences() -> None:
    recs = [_rec(0, 9.0, 0, round_trips=5, replayed_ops=0, replay_shim_s=0.0),
            _rec(1, 8.0, 1, round_trips=6, replayed_ops=10, replay_shim_s=0.001),
            _rec(2, 2.0, 2, round_trips=6, replayed_ops=20, replay_shim_s=0.002),
            _rec(3, 4.0, 3, round_trips=6, replayed_ops=30, replay_shim_s=0.003)]
    warm = {"frames_up": 10, "bytes_up": 1000, "bytes_down": 500}
    end = {"frames_up": 16, "bytes_up": 1300, "bytes_down": 600}
    w = replay.window_figures(recs, 2, warm, end)
    assert w["n"] == 2 and w["latency_ms"] == 3.0
    assert w["shim"]["round_trips"] == 0 and w["shim"]["replays"] == 1
    assert w["all_replayed"] is True
    assert abs(w["shim_us_per_replayed_op"] - 100.0) < 1e-6
    assert w["daemon"]["frames_up"] == 3 and w["wire_bytes"] == 200
    assert w["io_bytes"] == 140
    # A window with a forwarded inference is not all replayed; no daemon snapshot: no wire.
    w = replay.window_figures(recs, 1, None, None)
    assert w["all_replayed"] is True and "wire_bytes" not in w
    # The shim timed a sample of its calls: the mean is over the timed ones.
    recs[2]["shim"]["replay_timed"], recs[3]["shim"]["replay_timed"] = 4, 6
    w = replay.window_figures(recs, 3, None, None)
    assert abs(w["shim_us_per_replayed_op"] - 500.0) < 1e-6
    del recs[2]["shim"]["replay_timed"], recs[3]["shim"]["replay_timed"]
    recs[3]["shim"]["replays"] = 2
    assert replay.window_figures(recs, 1, None, None)["all_replayed"] is False


def test_wire_check() -> None:
    assert replay.wire_check(None, 10) == {"ok": None, "limit": None}
    ok = replay.wire_check(1000 * 1.02 + 2048, 1000)
    assert ok["ok"] is True and ok["limit"] == 1000 * 1.02 + 2048
    assert replay.wire_check(1000 * 1.02 + 2049, 1000)["ok"] is False


def test_compare_outputs() -> None:
    a = "0:0 float32 [1, 4] 0123456789abcdef [0.1, 0.2, 0.3]\n"
    b = "0:0 float32 [1, 4] fedcba9876543210 [0.1, 0.2, 0.300001]\n"
    assert compare_outputs(a, a) is None
    assert "line 1" in compare_outputs(b, a)
    assert "lines" in compare_outputs(a + a, a)
    vals = {"0:0": [0.1, 0.2, 0.3, 0.4]}
    near = {"0:0": [0.1, 0.2, 0.300001, 0.4]}
    assert compare_outputs(b, a, 1e-5, near, vals) is None
    assert "differ" in compare_outputs(b, a, 1e-7, near, vals)
    other_shape = a.replace("[1, 4]", "[4, 1]")
    assert "shapes" in compare_outputs(b, other_shape, 1e-5, near, vals)
    assert compare_outputs(b, a, 1e-5, None, vals) == "output values missing"


def _run(mode: str, window: dict, **extra: object) -> dict:
    return {"mode": mode, "status": "ok", "error": None, "output": "x\n", "window": window,
            **extra}


def test_summary_and_table_flag_anomalies() -> None:
    shim = {"calls": 0, "round_trips": 0.5, "bytes_up": 100, "bytes_down": 40}
    runs = {
        "local": _run("local", {"latency_ms": 1.0, "io_bytes": 140}),
        "sync": _run("sync", {"latency_ms": 9.0, "shim": {"round_trips": 12}}),
        "stream": _run("stream", {"latency_ms": 5.0, "io_bytes": 140,
                                  "shim": {"calls": 10, "round_trips": 2},
                                  "daemon": {"frames_up": 18}, "wire_bytes": 900}),
        "replay": _run("replay", {"latency_ms": 2.0, "shim": shim, "all_replayed": True,
                                  "daemon": {"frames_up": 3, "frames_down": 2},
                                  "wire_bytes": 9000, "shim_us_per_replayed_op": 20.0},
                       first_replayed=4, output="y\n",
                       sequences=[{"found_at": 2, "search_s": 0.001, "operators": 10}],
                       shim_stats={"mismatches": 0, "failed": 0}),
        "restart": _run("restart", {"latency_ms": 2.0}, first_replayed=1,
                        shim_stats={"round_trips": 1}),
    }
    row = replay.summarize_model("mlp_policy", runs)
    assert row["found_at"] == [2] and row["search_ms"] == [1.0]
    assert row["first_replayed"] == 4 and row["restart_first_replayed"] == 1
    assert row["check"]["ok"] is False
    text = " ".join(row["problems"])
    assert "OUTPUTS DIFFER" in text and "wire" in text and "round trips" in text
    doc = {"plan": {"runs": 20, "warm": 8}, "link": None, "command": "c", "started": "s",
           "machine": "m", "loadavg": {"start": [1.0], "end": [1.0]}, "rows": [row]}
    md = replay.render(doc)
    assert "| mlp_policy | 10 | 12 | 4 | 2 |" in md and "**FAIL**" in md and "**NO**" in md


def test_driver_times_a_local_app_run(tmp_path: Path) -> None:
    """The in-app driver (appkit wrapped, the script unchanged) on 3 local inferences."""
    args = argparse.Namespace(runs=3, warm=1, timeout=120.0)
    bench = replay.Bench(args, tmp_path)
    run = bench.run_app("mlp_policy", "local")
    assert run["status"] == "ok", run
    assert run["inferences"] == 3 and run["offloaded"] is False
    assert len(run["output"].splitlines()) == 3  # mlp_policy: one output per inference
    w = run["window"]
    assert w["n"] == 2 and w["latency_ms"] > 0
    assert w["io_bytes"] == (48 + 12) * 4  # a [1, 48] input, a [1, 12] output, float32
