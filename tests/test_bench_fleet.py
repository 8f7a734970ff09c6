"""bench/fleet.py: its load profiles and figures on synthetic data, and one quick run end to end
with real processes (3 GPU daemons behind emulated links, 4 robot daemons, 4 apps) that checks
the report's structure and that no app erred and no frame differed from local; no timing is
asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import fleet


def test_arrivals_follow_each_profile() -> None:
    d = 30.0
    uniform = fleet.arrivals("uniform", d)
    assert len(uniform) == 240 and uniform[0] == 0.0
    gaps = [b - a for a, b in zip(uniform, uniform[1:], strict=False)]
    assert all(g == pytest.approx(0.125, abs=0.0015) for g in gaps)  # 1 ms integration steps
    # Robots are staggered: the same rate, shifted by a fraction of a gap.
    assert fleet.arrivals("uniform", d, phase=0.5)[0] == pytest.approx(0.0625, abs=0.002)
    step = fleet.arrivals("step", d)
    quarters = [sum(1 for t in step if q * d / 4 <= t < (q + 1) * d / 4) for q in range(4)]
    assert quarters == pytest.approx([15, 30, 45, 60], abs=1)
    spike = fleet.arrivals("spike", d)
    inside = sum(1 for t in spike if abs(t - d / 2) < 1.0)
    assert inside == pytest.approx(30, abs=1) and len(spike) == pytest.approx(60 + 26, abs=1)
    sine = fleet.arrivals("sinusoidal", 20.0)  # one whole period at 0.05 Hz: the mean rate
    assert len(sine) == pytest.approx(120, abs=1)
    first_half = sum(1 for t in sine if t < 10.0)
    assert first_half > 80  # sin > 0 over the first half period
    p1 = fleet.arrivals("poisson", d, seed="a")
    assert p1 == fleet.arrivals("poisson", d, seed="a") != fleet.arrivals("poisson", d, seed="b")
    assert 180 < len(p1) < 300 and p1 == sorted(p1) and p1[-1] < d
    assert len(fleet.arrivals("uniform", d, scale=0.5)) == 120
    with pytest.raises(ValueError):
        fleet.rate_at("nope", 0.0, d)


def test_robot_config_overrides() -> None:
    o = fleet.parse_overrides(["placement=inference", "balancers.q-learning.epsilon=0.1",
                               "balancers.q-learning.persist=true", "health.down_after=4"])
    assert o == {"placement": "inference", "health": {"down_after": 4},
                 "balancers": {"q-learning": {"epsilon": 0.1, "persist": True}}}
    base = {"balancer": "x", "health": {"interval": 0.5, "down_after": 3}}
    assert fleet.merged(base, o)["health"] == {"interval": 0.5, "down_after": 4}
    assert base["health"]["down_after"] == 3  # not modified
    with pytest.raises(ValueError):
        fleet.parse_overrides(["no-equals-sign"])


def test_placements_from_sessions_and_from_per_inference_counts() -> None:
    before = {"robot0/s1": {"host": "gpu0", "inferences": 5},
              "robot1/s1": {"host": "gpu1", "inferences": 4, "placements": {"gpu1": 4},
                            "failovers": 1}}
    after = {"robot0/s1": {"host": "gpu0", "inferences": 25},
             "robot0/s2": {"host": "gpu2", "inferences": 3},  # a session opened meanwhile
             "robot1/s1": {"host": "gpu1", "inferences": 24, "failovers": 3,
                           "placements": {"gpu1": 14, "gpu0": 10}}}
    hosts, counters = fleet.placements(before, after)
    assert hosts == {"gpu0": 30, "gpu2": 3, "gpu1": 10}
    assert counters == {"failovers": 2}  # only what some session reports
    # The robot daemon's shape: a ``placement`` block (None when placement is per session).
    before = {"r/s1": {"host": "gpu0", "inferences": 8, "placement": {
        "placements": {"gpu0": 2}, "replicas": [], "moved": 0, "failovers": 0, "late": 0,
        "pulled": 0}}, "r/s2": {"host": "gpu1", "inferences": 8, "placement": None}}
    after = {"r/s1": {"host": "gpu0", "inferences": 40, "placement": {
        "placements": {"gpu0": 12, "gpu1": 10, "gpu2": 10}, "replicas": ["gpu1", "gpu2"],
        "moved": 1, "failovers": 2, "late": 0, "pulled": 0}},
        "r/s2": {"host": "gpu1", "inferences": 18, "placement": None}}
    hosts, counters = fleet.placements(before, after)
    assert hosts == {"gpu0": 10, "gpu1": 20, "gpu2": 10}
    assert counters == {"moved": 1, "failovers": 2, "late": 0, "pulled": 0}


def test_latency_figures_and_differing() -> None:
    sched = [0.0, 1.0, 2.0]
    times = [(0.0, 0.010), (1.5, 0.010), (2.0, 0.020)]  # the 2nd started late: queueing counts
    f = fleet.latency_figures([(sched, times)], 3.0)
    assert f["offered"] == 3 and f["done"] == 3 and f["offered_per_s"] == 1.0
    assert f["p50_ms"] == 20.0 and f["max_ms"] == 510.0 and f["model_call_p50_ms"] == 10.0
    assert fleet.differing(["a", "b", "c"], ["a", "x", "c"]) == 1
    assert fleet.differing(["a", "b"], ["a"]) == 1


@pytest.mark.timeout(240)
def test_quick_fleet_run(tmp_path: Path) -> None:
    rc = fleet.main(["--quick", "--profiles", "uniform", "--balancers", "least-loaded,no-such-balancer",
                     "--duration-s", "2", "--warmup", "2", "--calibrate-runs", "4", "--robots", "3",
                     "--robot-config", "health.down_after=4", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "fleet.json").read_text())
    md = (tmp_path / "fleet.md").read_text()
    assert rc == 0, doc["problems"]
    assert doc["problems"] == []
    assert doc["balancers_skipped"] == {"no-such-balancer": "not installed in this checkout"}
    assert doc["robot_daemon_config"]["health"]["down_after"] == 4
    hosts = [h["name"] for h in doc["hosts"]]
    assert hosts == ["gpu0", "gpu1", "gpu2"]
    for m in doc["links"]:  # measured through each host's own link
        assert m["rtt_ms"] > 0 and m["up_mbps"] > 0 and m["down_mbps"] > 0
    for name in ["unthrottled", *hosts]:
        assert doc["model_time"][name]["p50_ms"] > 0
    assert [(c["balancer"], c["profile"]) for c in doc["cells"]] == [("least-loaded", "uniform")]
    for c in doc["cells"]:
        assert "failed" not in c
        assert c["app_errors"] == 0 and c["wrong_results"] == 0
        assert all(a["inferences"] == a["expected"] for a in c["apps"])
        lat = c["latency"]
        assert lat["done"] == lat["offered"] > 0
        assert 0 < lat["p50_ms"] <= lat["p99_ms"] <= lat["max_ms"]
        assert set(c["placements"]) == set(hosts)
        assert sum(c["placements"].values()) == lat["done"]
        assert c["replayed_share"] is not None
        for key in ("failovers", "local_fallbacks"):
            assert isinstance(c[key]["value"], int) and c[key]["source"]
        assert isinstance(c["deadline_misses"], int)
    assert "| least-loaded | uniform |" in md
    assert "## Hosts, measured" in md and "no-such-balancer" in md
