"""The benchmark's own machinery: link emulator accuracy, traces, statistics, refusal, NTO, the
checks that keep its figures honest (every inference's outputs against local's, round trips and
energy over the measured window, the limit's rate), and end-to-end quick runs. Application
timings are never asserted; the emulator's delay and rate are (they are what the emulator is
for), within the benchmark's own tolerance (a cell this far off is refused), values printed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import stats
from bench.harness import (
    STANDBY_W,
    _energy_figures,
    _host_replay,
    _replays,
    check_outputs,
    finish_cells,
    parse_shim_stats,
    placement_moved,
    shim_window,
)
from bench.link import LINKS, TOLERANCE, LinkProcess, LinkSpec, MeasureServer, Trace, check, measure
from bench.models import MODELS, output_digest, outputs_of
from bench.nto import Server, run_client
from bench.report import README_BEGIN, README_END, markdown, summary, update_readme
from bench.traces import generate
from rrtod.grpc_options import POLLING_EXPERIMENTS

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def measure_server():
    server = MeasureServer()
    yield server
    server.close()


def test_emulated_delay_and_rate_on_loopback(measure_server: MeasureServer) -> None:
    spec = LinkSpec("test", rtt_ms=2.6, mbps=200.0)
    with LinkProcess(spec, [measure_server.address]) as link:
        link.calibrate(link.address(0))
        m = measure(link.address(0), spec, link, pings=20, bulk_s=0.2)
    print(f"emulator: RTT {m.rtt_ms:.3f} ms (target 2.6), up {m.up_mbps:.1f} / down "
          f"{m.down_mbps:.1f} Mbit/s (target 200), problems {m.problems}")
    assert m.rtt_ms == pytest.approx(2.6, rel=TOLERANCE)
    assert m.up_mbps == pytest.approx(200.0, rel=TOLERANCE)
    assert m.down_mbps == pytest.approx(200.0, rel=TOLERANCE)


def test_trace_link_follows_its_trace(measure_server: MeasureServer) -> None:
    spec = LINKS["outdoor"]
    with LinkProcess(spec, [measure_server.address]) as link:
        m = measure(link.address(0), spec, link, pings=5, bulk_s=0.2)
    print(f"outdoor: up {m.up_mbps:.1f} vs trace {m.target_up_mbps:.1f} Mbit/s")
    assert m.up_mbps == pytest.approx(m.target_up_mbps, rel=TOLERANCE)


def test_trace_arithmetic() -> None:
    t = Trace([0.0, 0.1], [8.0, 16.0])  # 1 MB/s then 2 MB/s, period 0.2 s
    assert t.finish(0.0, 8e5) == pytest.approx(0.1)  # 100 kB at 1 MB/s
    assert t.finish(0.0, 8e5 + 1.6e6) == pytest.approx(0.2)  # then 200 kB at 2 MB/s
    assert t.finish(0.2, 8e5) == pytest.approx(0.3)  # looped
    assert t.mean_mbps(0.0, 0.2) == pytest.approx(12.0)
    assert t.overall_mean_mbps() == pytest.approx(12.0)


def test_traces_are_deterministic_and_hit_their_statistics() -> None:
    assert generate.indoor() == generate.indoor()
    assert generate.outdoor() == generate.outdoor()
    indoor, outdoor = generate.indoor(), generate.outdoor()
    assert sum(indoor) / len(indoor) == pytest.approx(93.0, rel=0.01)
    assert sum(outdoor) / len(outdoor) == pytest.approx(73.0, rel=0.01)
    assert min(outdoor) < 1.0  # drops near 0
    assert min(indoor) > 10.0 and max(indoor) > 1.5 * min(indoor)  # fluctuating, no outage
    for name, values in (("indoor.csv", indoor), ("outdoor.csv", outdoor)):
        committed = Trace.load(name)
        assert len(committed.bps) == len(values)
        assert committed.overall_mean_mbps() == pytest.approx(sum(values) / len(values), rel=1e-3)


def test_statistics_and_ratios_on_synthetic_samples() -> None:
    s = stats.summarize([float(i) for i in range(1, 101)])
    assert s["median"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert math.isnan(stats.summarize([])["median"])
    comp = stats.comparisons({"local": 5.0, "nto": 10.0, "per-op": 110.0, "rrto": 10.4}, True, 4.0)
    assert comp["rrto_over_nto"] == pytest.approx(1.04)
    assert comp["per_op_over_rrto"] == pytest.approx(110 / 10.4)
    assert comp["penalty_removed"] == pytest.approx(0.996)
    assert all(comp["targets"].values())
    comp = stats.comparisons({"nto": 10.0, "per-op": 110.0, "rrto": 15.0}, True)
    assert comp["targets"]["rrto/nto<=1.05"] is False
    assert comp["targets"]["penalty_removed>=0.98"] is False
    assert comp["targets"]["shim_us_per_op<=10"] is None
    assert stats.penalty_removed(10.0, 9.0, 10.0) is None  # per-op not slower: undefined
    assert stats.physical_limit_ms(2.0, 8.0, 8.0, 1e6, 0.0, 3.0) == pytest.approx(1005.0)


def test_a_link_that_misses_its_target_by_more_than_10_percent_is_refused() -> None:
    assert check(2.6, 2.6, "rtt") == []
    assert check(2.8, 2.6, "rtt") == []  # 7.7%
    assert check(2.9, 2.6, "rtt")  # 11.5%
    assert check(None, 2.6, "rtt")  # not measured is not valid
    assert check(1.0, None, "rtt") == []  # no target (loopback)
    # A proxy whose delay is far off the spec the measurement is judged against.
    server = MeasureServer()
    try:
        with LinkProcess(LinkSpec("slow", rtt_ms=6.0), [server.address]) as link:
            m = measure(link.address(0), LinkSpec("slow", rtt_ms=2.6), None, pings=5, bulk_s=0.05)
    finally:
        server.close()
    assert not m.valid and any("rtt_ms" in p for p in m.problems)
    doc = _doc_with_cells([{"link": "wifi6-edge", "model": "mlp", "system": "nto", "status": "refused",
                            "error": m.problems[0], "latency": stats.summarize([1.0])}])
    table = markdown(doc)
    assert "| wifi6-edge | mlp | nto | refused |" in table
    assert "| wifi6-edge | mlp | nto | 1 " not in table


def _doc_with_cells(cells: list[dict]) -> dict:
    return {"started": "t", "duration_s": 1.0, "plan": {"quick": True, "iters": 1, "warmup": 0,
                                                          "budget_s": 1.0},
            "machine": {"platform": "p", "cpu_count": 2, "versions": {"torch": "t", "grpcio": "g",
                                                                      "rrtod": "r"}},
            "links": {"wifi6-edge": {"measured_at_start": {}}}, "cells": cells, "comparisons": []}


def test_shim_stats_line_is_parsed() -> None:
    err = 'noise\nrrto-stats {"ops": 100, "shim_s": 0.0005, "round_trips": 10, "inferences": 10}\n'
    got = parse_shim_stats(err)
    assert got is not None and got["shim_us_per_op"] == pytest.approx(5.0)
    err += 'rrto-stats {"ops": 100, "shim_s": 1.0, "replayed_ops": 50, "replay_shim_s": 0.0002}\n'
    got = parse_shim_stats(err)
    assert got is not None and got["shim_us_per_op"] == pytest.approx(4.0)
    assert got["shim_us_per_op_basis"] == "replayed_ops"
    # A shim that timed a sample of its replayed calls: the mean is over those it timed.
    err += ('rrto-stats {"ops": 100, "shim_s": 1.0, "replayed_ops": 80, "replay_timed": 10, '
            '"replay_shim_s": 0.0001}\n')
    got = parse_shim_stats(err)
    assert got is not None and got["shim_us_per_op"] == pytest.approx(10.0)
    assert got["shim_us_per_op_basis"] == "replay_timed"
    assert parse_shim_stats("rrto: warning: no daemon") is None


def test_nto_round_trip_returns_the_local_output() -> None:
    server = Server()
    try:
        result = run_client("dethead", f"127.0.0.1:{server.port}", iters=2, warmup=1)
    finally:
        server.stop()
    spec = MODELS["dethead"]
    model = spec.make()
    with torch.inference_mode():
        want = [output_digest([o.numpy().tobytes() for o in outputs_of(model(x))])
                for x in spec.inputs(3)]
    assert result["digests"] == want  # every inference, the warm-up's too
    assert result["bytes_up_per_inference"] == 3 * 160 * 160 * 4


WARMUP, ITERS = 5, 4


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One bench run of every system on the mlp over loopback (one start-up for the tests
    below): its output folder and JSON document."""
    out_dir = tmp_path_factory.mktemp("bench")
    out = subprocess.run([sys.executable, "-m", "bench", "--models", "mlp", "--links", "loopback",
                          "--systems", "local,nto,per-op,rrto", "--iters", str(ITERS),
                          "--warmup", str(WARMUP), "--budget-s", "20", "--out", str(out_dir)],
                         cwd=REPO, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    (doc_path,) = out_dir.glob("*.json")
    return out_dir, json.loads(doc_path.read_text())


def test_bench_end_to_end_report_and_readme(mlp_run: tuple[Path, dict], tmp_path: Path) -> None:
    out_dir, doc = mlp_run
    assert {c["system"] for c in doc["cells"] if c["status"] == "ok"} == {
        "local", "nto", "per-op", "rrto"}
    (nto,) = [c for c in doc["cells"] if c["system"] == "nto"]
    assert nto["outputs_match_local"] and nto["outputs_compared"] == WARMUP + nto["iters"]
    # one gRPC engine for every process of the run, NTO's included, and recorded
    assert doc["process_env"]["GRPC_EXPERIMENTS"] == POLLING_EXPERIMENTS
    assert doc["process_env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    # NTO's energy, over the same span as the daemon systems', by the robot's meter
    assert nto["power_meter"] and nto["per_inference"]["energy_j"] > 0
    assert not nto["per_inference"].get("power_below_standby"), nto["per_inference"]
    assert doc["machine"]["cpu_count"] and doc["machine"]["versions"]["torch"]
    assert "| loopback | mlp | nto |" in (out_dir / "latest.md").read_text()
    if importlib.util.find_spec("matplotlib"):
        assert (out_dir / "latest.png").exists()
    # The README's block shows a full run's medians and ratios; text around it is kept.
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_BEGIN}\nold\n{README_END}\noutro\n")
    assert update_readme(readme, doc)
    text = readme.read_text()
    assert text.startswith(f"intro\n{README_BEGIN}\n") and text.endswith(f"{README_END}\noutro\n")
    assert "old" not in text and "latest.png" in text
    assert not update_readme(out_dir / "latest.md", doc)  # no markers: left alone


def test_a_hung_app_is_killed_and_reported() -> None:
    from bench.harness import CellError, measured_deadline_s, run_app

    assert measured_deadline_s(60.0, [100.0, 2000.0]) == pytest.approx(60 + 6 + 30)
    hang = ("import json, time; print(json.dumps({'phase': 'warm', 'warmup_ms': [1]}), flush=True); "
            "input(); time.sleep(60)")
    seen = []
    with pytest.raises(CellError, match="killed"):
        run_app([sys.executable, "-c", hang], {}, timeout=1.5, phases={"warm": seen.append})
    assert seen  # the warm-up hook ran before the kill


def _cell(system: str, digests: list[str], link: str | None = "loopback", median: float = 1.0,
          **extra: object) -> dict:
    return {"link": None if system == "local" else link, "model": "mlp", "system": system,
            "status": "ok", "error": None, "warmup": 2, "iters": len(digests) - 2,
            "digests": digests, "latency": stats.summarize([median]), **extra}


def test_every_inference_is_compared_with_local_and_one_difference_fails_the_cell(
        tmp_path: Path) -> None:
    """Stale outputs from the 5th inference on (the 3rd measured) fail the cell: in the JSON,
    in the table, in the README block and in the plot, and it counts in no ratio."""
    good = [f"d{i}" for i in range(6)]
    stale = good[:4] + ["d3", "d3"]
    cells = [_cell("local", good), _cell("nto", good), _cell("rrto", stale),
             _cell("per-op", good[:5])]  # budget cut it short: compared on what it ran
    check_outputs(cells)
    local, nto, rrto, per_op = cells
    assert "outputs_match_local" not in local
    assert nto["status"] == "ok" and nto["outputs_match_local"] and nto["outputs_compared"] == 6
    assert per_op["status"] == "ok" and per_op["outputs_compared"] == 5
    assert rrto["status"] == "failed" and rrto["output_mismatches"] == [4, 5]
    assert "first at inference 4 (measured 2)" in rrto["error"]
    doc = {**_doc_with_cells(cells), "links": {"loopback": {"measured_at_start": {}}}}
    doc["comparisons"] = finish_cells(cells, doc["links"])
    assert doc["comparisons"][0]["medians_ms"].keys() == {"local", "nto", "per-op"}
    table = markdown(doc)
    assert "| loopback | mlp | rrto **FAILED** |" in table and "**NO: 2 of 6 differ**" in table
    assert "| loopback | mlp | nto | 1 |" in table and "yes (6)" in table
    assert "| loopback | mlp | rrto | failed | outputs differ" in table  # and listed below
    assert "**FAILED (outputs ≠ local)**" in summary(doc)
    if importlib.util.find_spec("matplotlib"):
        from bench.report import plot

        assert plot(doc, tmp_path / "p.png") is not None


def test_a_scheduled_cell_whose_placement_moved_in_its_window_is_refused() -> None:
    """A min-cut cell measures one placement, or it is refused with what moved: a warm-up
    too short for the scheduler's own measuring leaves a mix of placements in the window.
    Plans that move by design (``+switch``), and systems with no scheduler, are not judged."""
    def session(**plans: int) -> dict:
        return {"scheduling": {"band": None, "switches": 0, "plans": plans}}

    assert placement_moved(session(s7=2), session(s7=2), "rrto:min-cut") is None
    why = placement_moved(session(s7=1, s9=3), session(s7=2, s9=3), "rrto:min-cut")
    assert why is not None and "s7: plan 1 -> 2" in why and "s9" not in why
    assert placement_moved(session(s7=1), session(s7=2), "rrto:min-cut+switch") is None
    assert placement_moved(session(s7=1), session(s7=2), "rrto") is None
    # a sequence placed for the first time in the window is not a move; no placer, no judge
    assert placement_moved(session(), session(s7=1), "rrto:hybrid-parallel") is None
    assert placement_moved({}, None, "rrto:robot-all") is None


def test_round_trips_are_taken_over_the_measured_inferences_only() -> None:
    shim = {"by_inference": {"index": [1, 2, 3, 4, 5], "round_trips": [9, 3, 1, 1, 2],
                             "push_waits": [0, 0, 1, 1, 1], "replays": [0, 0, 1, 1, 1]}}
    assert shim_window(shim, warmup=2, iters=3) == {
        "round_trips": [1, 1, 2], "push_waits": [1, 1, 1], "replays": [1, 1, 1]}
    assert shim_window(shim, warmup=3, iters=3) is None  # the shim missed one: no figure
    assert shim_window({}, warmup=0, iters=1) is None
    # A library's own module calls before the app's first (Ultralytics' set-up): the app's
    # measured inferences are the last ``iters`` the shim numbered
    shim["inferences"] = 5
    assert shim_window(shim, warmup=1, iters=3) == {
        "round_trips": [1, 1, 2], "push_waits": [1, 1, 1], "replays": [1, 1, 1]}


def test_limit_uses_the_measured_windows_rate_and_is_flagged_above_the_median() -> None:
    """Outdoor trace: the rate the cell's window saw, not a bulk transfer's at cell start; a
    limit above the cell's median is no bound, and says so."""
    m = {"rtt_ms": 2.0, "up_mbps": 80.0, "down_mbps": 80.0}
    fast = _cell("rrto", ["x"] * 3, link="outdoor", median=50.0, link_measurement=m,
                 window_mbps=8.0, per_inference={"link_bytes_up": 1e5, "link_bytes_down": 0.0})
    slow = {**fast, "latency": stats.summarize([200.0]), "system": "nto", "host_compute_ms": 3.0}
    finish_cells([fast, slow], {"outdoor": {}})
    assert fast["limit_rates_mbps"] == [8.0, 8.0]
    assert fast["limit_ms"] == pytest.approx(2.0 + 3.0 + 1e5 * 8 / 8e6 * 1e3)  # 105 ms
    assert fast["limit_above_median"] and not slow["limit_above_median"]
    assert "105 !" in markdown({**_doc_with_cells([fast]), "links": {"outdoor": {}}})


def test_energy_below_the_models_standby_power_is_flagged() -> None:
    """The RRTO paper's robot never draws less than standby: a lower figure means the span
    missed part of the inference (as it did when the mark ended with forward())."""
    ok = _energy_figures("model", 0.0050, 0.0009, 0.001)
    assert ok["robot_power_w"] == pytest.approx(5.0) and not ok["power_below_standby"]
    # 1.2 W over the app's inference: the marks (0.3 ms) covered a fraction of it
    low = _energy_figures("model", 0.3 * STANDBY_W * 0.001, 0.0003, 0.001)
    assert low["power_below_standby"]
    assert "power_below_standby" not in _energy_figures("rapl", 0.0001, 0.001, 0.001)  # measured
    assert _energy_figures("model", None, None, 0.001) == {"energy_j": None, "energy_span_s": None}


def test_bench_offloads_every_inference_correctly(mlp_run: tuple[Path, dict]) -> None:
    """local, per-op and rrto on the mlp over loopback: every inference (warm-up included)
    equals local's; after the warm-up every rrto inference is replayed, and each one costs the
    app at least one round trip (its pushed outputs) and the robot at least standby power."""
    _, doc = mlp_run
    cells = {c["system"]: c for c in doc["cells"]}
    assert {s: c["status"] for s, c in cells.items()} == dict.fromkeys(cells, "ok"), [
        c.get("error") for c in cells.values()]
    for system in ("per-op", "rrto"):
        c = cells[system]
        assert c["outputs_match_local"] and c["outputs_compared"] == WARMUP + ITERS, c
        window = c["shim_by_inference"]
        assert len(window["round_trips"]) == ITERS
        assert min(window["round_trips"]) >= 1, window
        assert not c["per_inference"].get("power_below_standby"), c["per_inference"]
    rrto = cells["rrto"]
    assert rrto["shim_by_inference"]["replays"] == [1] * ITERS, rrto["shim_by_inference"]
    assert rrto["per_inference"]["replayed"] == 1.0
    assert rrto["per_inference"]["daemon_replies"] >= 1  # the daemon's count, beside


def test_split_cpus_gives_each_side_its_own_cpus_and_the_launcher_pins_what_it_runs() -> None:
    from bench.cpus import Split, pinned, split
    from bench.harness import Plan, _command

    assert split({0, 1}) == Split((0,), (1,))
    assert split({5, 1, 3, 7}) == Split((1, 3), (5, 7))
    with pytest.raises(ValueError, match="at least 2 CPUs"):
        split({3})
    assert pinned(["x", "y"], None) == ["x", "y"]
    cpu = min(os.sched_getaffinity(0))
    show = [sys.executable, "-c",
            "import os, threading; t = threading.Thread(target=lambda: print(sorted("
            "os.sched_getaffinity(0)))); t.start(); t.join()"]
    out = subprocess.run(pinned(show, (cpu,)), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[{cpu}]"  # a thread the command starts inherits the pin
    bad = subprocess.run(pinned(["true"], (10_000,)), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "cannot pin" in bad.stderr
    # every system's app runs on the robot side
    plan = Plan(models=["mlp"], links=[], systems=["local"], cpus=Split((0,), (1,)))
    cmd, _ = _command(None, "mlp", "local", plan)
    assert cmd[1:5] == [str(REPO / "bench" / "cpus.py"), "0", "--", sys.executable]
    # and the report says where each side ran
    from bench.report import _cpus_line

    assert "pinned to CPU 0" in _cpus_line(plan.to_dict(), {"cpu_count": 2})
    assert "same 2-CPU machine" in _cpus_line({"cpus": None}, {"cpu_count": 2})


def test_the_robot_side_joins_its_cgroup_before_it_runs_anything(tmp_path: Path) -> None:
    """``--robot-cpu``: the launcher writes its own PID into the group's ``cgroup.procs`` and
    then becomes the command (same PID), so the command is throttled from its start. (A
    plain directory stands in for the cgroup here: making a real one needs root.)"""
    from bench.cpus import pinned
    from bench.harness import Plan, _command, scheduler_of, switches_plans

    group = tmp_path / "robot"
    group.mkdir()
    out = subprocess.run(pinned([sys.executable, "-c", "import os; print(os.getpid())"], None,
                                str(group)), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (group / "cgroup.procs").read_text() == out.stdout.strip()
    plan = Plan(models=["mlp"], links=[], systems=["local"], robot_cgroup=str(group))
    cmd, _ = _command(None, "mlp", "local", plan)
    assert cmd[1:6] == [str(REPO / "bench" / "cpus.py"), "all", "--cgroup", str(group), "--"]
    assert [scheduler_of(s) for s in ("rrto", "rrto:min-cut", "rrto:min-cut+switch",
                                      "per-op")] == ["remote-all", "min-cut", "min-cut",
                                                     "remote-all"]
    assert [switches_plans(s) for s in ("rrto:min-cut", "rrto:min-cut+switch")] == [False, True]


def test_the_switching_table_compares_plan_switching_with_the_best_fixed_plan() -> None:
    from bench.report import switching

    def cell(system: str, link: str | None, mean: float, median: float, **extra) -> dict:
        return {"system": system, "link": link, "model": "unet", "status": "ok", "iters": 100,
                "latency": {"mean": mean, "median": median}, **extra}

    doc = {"cells": [cell("local", None, 140.0, 139.0),
                     cell("rrto", "outdoor", 80.0, 75.0, window_mbps=73.0),
                     cell("rrto:min-cut+switch", "outdoor", 84.0, 75.0, window_mbps=73.0,
                          per_inference={"plan_switches": 0.14})]}
    table = "\n".join(switching(doc))
    assert "| outdoor | unet | 73 | 84 | 80 | 1.05 | 75 | 75 | 1 | 14 / 100 |" in table
    assert switching({"cells": [cell("rrto", "rate-10", 1.0, 1.0)]}) == []


def test_the_scheduling_table_compares_each_placement_with_the_best_fixed_one() -> None:
    from bench.report import scheduling

    def cell(system: str, link: str | None, median: float, **extra: float) -> dict:
        return {"system": system, "link": link, "model": "resnet", "status": "ok",
                "latency": {"median": median}, **extra}

    doc = {"links": {"rate-10": {}, "rate-500": {}}, "cells": [
        cell("local", None, 400.0),
        cell("nto", "rate-10", 150.0, host_compute_ms=100.0), cell("rrto", "rate-10", 600.0),
        cell("rrto:min-cut", "rate-10", 360.0), cell("nto", "rate-500", 110.0,
                                                     host_compute_ms=100.0),
        cell("rrto", "rate-500", 120.0), cell("rrto:min-cut", "rate-500", 126.0),
        cell("rrto:hybrid-parallel", "rate-10", 288.0)]}
    table = "\n".join(scheduling(doc))
    # slowdown 400 / 100; best of local (400) and rrto (600) at 10 Mbit/s: local; 360 / 400;
    # hybrid-parallel against the best of local, rrto and min-cut: 288 / 360
    assert "| rate-10 | resnet | 4 | 400 | 150 | 600 | – | 360 | 288 | 400 | 0.9 | 0.8 |" \
        in table
    assert "| rate-500 | resnet | 4 | 400 | 110 | 120 | – | 126 | – | 120 | 1.05 | – |" in table
    assert scheduling({"links": {}, "cells": [cell("rrto", "x", 1.0)]}) == []


def test_rounds_take_each_ratio_from_cells_run_back_to_back() -> None:
    """``--rounds``: a (link, model)'s systems measured several times, back to back. Each
    ratio is the median of the rounds' own ratios, not a ratio of medians from cells minutes
    apart: a machine 30 % slower in the second round moves both of its cells, not the ratio.
    Tables show each round's cell ("#k") and the ratio's range."""
    def cell(system: str, r: int, median: float) -> dict:
        return _cell(system, ["d"] * 3, median=median, round=r, link_measurement={})

    cells = [_cell("local", ["d"] * 3, median=30.0),
             cell("nto", 0, 10.0), cell("rrto", 0, 11.0),
             cell("rrto", 1, 14.3), cell("nto", 1, 13.0),  # the order reversed: ABBA
             cell("nto", 2, 10.2), cell("rrto", 2, 11.5)]
    (comp,) = finish_cells(cells, {"loopback": {}})
    assert comp["rrto_over_nto_rounds"] == pytest.approx([1.1, 1.1, 11.5 / 10.2])
    assert comp["rrto_over_nto"] == pytest.approx(1.1)
    assert comp["medians_ms"] == pytest.approx({"local": 30.0, "nto": 10.2, "rrto": 11.5})
    assert comp["rrto_over_local"] == pytest.approx(11.5 / 30.0)
    assert comp["targets"]["rrto/nto<=1.25"] is True
    doc = {**_doc_with_cells(cells), "links": {"loopback": {}}, "comparisons": [comp]}
    table = markdown(doc)
    assert "| loopback | mlp | rrto #2 | 14.3 |" in table
    assert "| loopback | mlp | 1.1 (1.1–1.13, 3 rounds) |" in table
    assert "| loopback | mlp | 30 | – | 10.2 | 11.5 | 1.1 |" in summary(doc)
    # one round: as without rounds
    (one,) = finish_cells([cells[0], *(dict(c) for c in cells[1:3])], {"loopback": {}})
    assert one["rrto_over_nto"] == pytest.approx(1.1) and "rrto_over_nto_rounds" not in one


def test_the_host_replay_figures_are_per_replayed_inference_of_the_window() -> None:
    warm = {"replays_completed": 5, "replay_cpu_s": 1.0, "replay_wall_s": 2.0,
            "replay_minor_faults": 100}
    done = {"replays_completed": 9, "replay_cpu_s": 1.4, "replay_wall_s": 2.8,
            "replay_minor_faults": 900}
    assert _host_replay(warm, done) == pytest.approx(
        {"host_replay_cpu_ms": 100.0, "host_replay_ms": 200.0, "host_replay_faults": 200.0})
    assert "host_replay_faults" not in _host_replay({"replays_completed": 0},
                                                    {"replays_completed": 1})  # an older host
    assert _host_replay(warm, warm) == {}


def test_replays_are_the_sessions_count_where_the_daemon_reports_one() -> None:
    """A sequence replaced by another takes its listed replays with it: the session's own
    count is what the replayed share reads; an older daemon's listed sum otherwise."""
    listed = {"sequences": [{"replays": 9}]}
    assert _replays({"record": listed}) == 9
    assert _replays({"record": {**listed, "replays": 14}}) == 14
    assert _replays(None) == 0
