"""bench/capacity.py: its figures on synthetic records, and one small real run (3 sessions, a
short window) that checks the report's fields and the refusal of the 4th app; no timing is
asserted."""

from __future__ import annotations

import json
from pathlib import Path

from bench import capacity


def test_percentile() -> None:
    assert capacity.percentile([], 99) is None
    assert capacity.percentile([5.0], 99) == 5.0
    xs = [float(x) for x in range(1, 101)]  # 1..100
    assert capacity.percentile(xs, 50) == 50.5
    assert abs(capacity.percentile(xs, 99) - 99.01) < 1e-9
    assert capacity.percentile(xs, 100) == 100.0


def test_window_figures_take_every_session_inside_the_window() -> None:
    a = [[0.5, 100.0, 0], [1.0, 2.0, 1], [2.0, 4.0, 1], [3.5, 50.0, 1]]
    b = [[1.5, 6.0, 1], [2.5, 8.0, 0]]
    silent = [[9.0, 1.0, 1]]
    w = capacity.window_figures([a, b, silent], 1.0, 3.0)
    assert w["inferences"] == 4 and w["seconds"] == 2.0 and w["per_second"] == 2.0
    assert w["replay_share"] == 0.75
    assert w["latency_ms"]["p50"] == 5.0 and w["latency_ms"]["max"] == 8.0
    assert w["sessions_without_inference"] == 1
    assert w["session_p99_ms"]["max"] == capacity.percentile([6.0, 8.0], 99)
    empty = capacity.window_figures([], 0.0, 1.0)
    assert empty["inferences"] == 0 and empty["replay_share"] is None
    assert empty["latency_ms"]["p99"] is None


def test_memory_figures() -> None:
    m = capacity.memory_figures(100, [300, 500, 400], 350, 3)
    assert m == {"idle": 100, "loaded_median": 400, "loaded_max": 500, "after": 350,
                 "per_session": 100}
    assert capacity.memory_figures(None, [], None, 3)["per_session"] is None


def test_small_capacity_run_reports_sane_fields(tmp_path: Path) -> None:
    rc = capacity.main(["--sessions", "3", "--window-s", "3", "--pace-ms", "50", "--batch", "3",
                        "--timeout-s", "240", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "capacity.json").read_text())
    md = (tmp_path / "capacity.md").read_text()
    assert rc == 0, doc["problems"]
    assert doc["problems"] == []
    assert doc["plan"]["sessions"] == 3 and doc["plan"]["limit"] == 3
    assert doc["gpu_sessions_open"] == 3 and doc["gpu_max_sessions"] == 3
    w = doc["window"]
    assert w["inferences"] > 0 and w["replay_share"] == 1.0
    assert w["sessions_without_inference"] == 0
    lat = w["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    rss = doc["gpu_rss"]
    assert rss["idle"] > 0 and rss["loaded_median"] > 0 and rss["after"] > 0
    assert rss["per_session"] is not None
    assert doc["apps_rss"]["per_app"] > 0
    assert doc["cpu_percent"]["capacity"] >= 100
    # The 4th app is refused by the configured limit: it fails under fallback error and
    # runs locally under fallback local; the three go on replaying after it.
    error, local = doc["extra_app"]
    assert error["refused"] and error["returncode"] != 0
    assert "3 sessions open, limit 3" in error["message"]
    assert local["refused"] and local["returncode"] == 0 and local["inferences"] == 3
    assert not local["offloaded"]
    assert doc["extra_app_refused_by_daemon"]["executor.max_sessions"] == 2
    assert doc["after_extra_app"]["sessions_without_inference"] == 0
    assert "| replay share | 100.00% |" in md and "HOST_REFUSED" in md
