"""The benchmark's own machinery: link emulator accuracy, traces, statistics, refusal, NTO, and an
end-to-end quick run. Application timings are never asserted; the emulator's delay and rate are
(they are what the emulator is for), with generous tolerances and the measured values printed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import stats
from bench.harness import parse_shim_stats
from bench.link import LINKS, LinkProcess, LinkSpec, MeasureServer, Trace, check, measure
from bench.models import MODELS, outputs_of
from bench.nto import Server, run_client
from bench.report import README_BEGIN, README_END, markdown, update_readme
from bench.traces import generate

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
    assert m.rtt_ms == pytest.approx(2.6, rel=0.25)
    assert m.up_mbps == pytest.approx(200.0, rel=0.25)
    assert m.down_mbps == pytest.approx(200.0, rel=0.25)


def test_trace_link_follows_its_trace(measure_server: MeasureServer) -> None:
    spec = LINKS["outdoor"]
    with LinkProcess(spec, [measure_server.address]) as link:
        m = measure(link.address(0), spec, link, pings=5, bulk_s=0.2)
    print(f"outdoor: up {m.up_mbps:.1f} vs trace {m.target_up_mbps:.1f} Mbit/s")
    assert m.up_mbps == pytest.approx(m.target_up_mbps, rel=0.25)


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
    assert parse_shim_stats("rrto: warning: no daemon") is None


def test_nto_round_trip_returns_the_local_output() -> None:
    server = Server()
    try:
        result = run_client("dethead", f"127.0.0.1:{server.port}", iters=2, warmup=1)
    finally:
        server.stop()
    spec = MODELS["dethead"]
    model = spec.make()
    digest = hashlib.sha256()
    with torch.inference_mode():
        for x in spec.inputs(2):
            for o in outputs_of(model(x)):
                digest.update(o.numpy().tobytes())
    assert result["checksum"] == digest.hexdigest()[:16]
    assert result["bytes_up_per_inference"] == 3 * 160 * 160 * 4


def test_quick_bench_end_to_end(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "bench", "--quick", "--models", "mlp", "--links",
                          "loopback", "--systems", "local,nto", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (doc_path,) = tmp_path.glob("*.json")
    doc = json.loads(doc_path.read_text())
    assert {(c["system"], c["status"]) for c in doc["cells"]} == {("local", "ok"), ("nto", "ok")}
    assert all(c["outputs_match_local"] for c in doc["cells"])
    assert doc["machine"]["cpu_count"] and doc["machine"]["versions"]["torch"]
    assert "| loopback | mlp | nto |" in (tmp_path / "latest.md").read_text()
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "latest.png").exists()
    # The README's block shows a full run's medians and ratios; text around it is kept.
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_BEGIN}\nold\n{README_END}\noutro\n")
    assert update_readme(readme, doc)
    text = readme.read_text()
    assert text.startswith(f"intro\n{README_BEGIN}\n") and text.endswith(f"{README_END}\noutro\n")
    assert "old" not in text and "latest.png" in text
    assert not update_readme(tmp_path / "latest.md", doc)  # no markers: left alone


def test_a_hung_app_is_killed_and_reported() -> None:
    from bench.harness import CellError, measured_deadline_s, run_app

    assert measured_deadline_s(60.0, [100.0, 2000.0]) == pytest.approx(60 + 6 + 30)
    hang = ("import json, time; print(json.dumps({'phase': 'warm', 'warmup_ms': [1]}), flush=True); "
            "input(); time.sleep(60)")
    seen = []
    with pytest.raises(CellError, match="killed"):
        run_app([sys.executable, "-c", hang], {}, timeout=1.5, phases={"warm": seen.append})
    assert seen  # the warm-up hook ran before the kill
