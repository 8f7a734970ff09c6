"""Host balancers: what each built-in chooses and places, that the learning ones learn from a
deterministic simulated fleet (seeded; nothing here measures time), that q-learning's table
survives a restart and a corrupt file, and that a balancer's options are checked where the
configuration is (start, reload, ``rrtod --check-config``), errors naming ``balancers.NAME.KEY``.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml

from rrto_plugins.balancers import (
    FirstUp,
    LeastConnections,
    LeastLoaded,
    LeastModelTime,
    QLearning,
    RoundRobin,
)
from rrto_plugins.balancers.q_learning import FILE
from rrtod import config as config_mod
from rrtod.config import ConfigError, HealthConfig, HostConfig, TLSConfig, from_mapping
from rrtod.daemon import Daemon, check_plugins
from rrtod.hookspecs import HostBalancer, HostView, Job, problems
from rrtod.plugins import discover
from rrtod.robot.balancing import build_balancer, state_dir

NAMES = ["first-up", "least-loaded", "least-connections", "round-robin", "least-model-time",
         "q-learning"]


@dataclass(eq=False)
class SimHost:
    """A host as balancers see it (``HostView``), with a simulated latency: ``base_s`` plus
    ``per_inflight_s`` for each inference already in flight on it when one is placed."""

    name: str
    base_s: float = 0.01
    per_inflight_s: float = 0.0
    up: bool = True
    rtt_ms: float | None = 1.0
    sessions: int = 0
    inflight: int = 0

    def latency(self) -> float:
        return self.base_s + self.per_inflight_s * self.inflight


def simulate(balancer: HostBalancer, hosts: list[SimHost], n: int, interval: float,
             key: str = "app/s1") -> list[str]:
    """``n`` inferences arriving every ``interval`` simulated seconds: each placed, its latency
    fixed by the host's load then, its outcome observed when it completes (in completion order,
    before the next placement). Returns the names of the hosts picked, in order."""
    job = Job(key)
    done: list[tuple[float, int, SimHost, float]] = []
    picks = []
    for i in range(n):
        now = i * interval
        while done and done[0][0] <= now:
            _, _, host, seconds = heapq.heappop(done)
            host.inflight -= 1
            balancer.observe(host, job, seconds)
        host = balancer.place(hosts, job)
        assert any(host is h for h in hosts)
        seconds = host.latency()
        host.inflight += 1
        heapq.heappush(done, (now + seconds, i, host, seconds))
        picks.append(host.name)
    return picks


@pytest.fixture(scope="module")
def registry() -> Any:
    return discover()


def build(registry: Any, name: str, options: dict[str, Any] | None = None,
          state: Path | None = None) -> HostBalancer:
    return registry.get("balancer", name).factory(options or {}, state or Path("/nonexistent"))


# --- every balancer ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_returns_only_given_hosts_and_none_when_none_is_up(registry: Any, name: str) -> None:
    balancer = build(registry, name, {"seed": 1} if name in NAMES[4:] else {})
    assert isinstance(balancer, HostBalancer) and problems(balancer, HostBalancer) == []
    hosts = [SimHost("a", up=False), SimHost("b"), SimHost("c", up=False), SimHost("d")]
    for i in range(50):
        chosen = balancer.choose(hosts)
        assert chosen is not None and chosen.up and any(chosen is h for h in hosts)
        given = hosts[1::2] if i % 2 else [hosts[3]]
        placed = balancer.place(given, Job(f"app/s{i % 3}"))
        assert any(placed is h for h in given)
        balancer.observe(placed, Job(f"app/s{i % 3}"), None if i % 7 == 0 else 0.01)
    assert balancer.choose([SimHost("a", up=False)]) is None
    assert balancer.choose([]) is None
    balancer.close()


def test_host_link_is_a_host_view_with_inflight() -> None:
    import grpc

    from rrtod.robot.host_link import HostLink

    async def check() -> None:
        link = HostLink(HostConfig(name="a", address="unix:/nonexistent.sock"), TLSConfig(),
                        HealthConfig(), lambda address, tls: grpc.aio.insecure_channel(address),
                        "robot")
        assert problems(link, HostView) == []
        assert link.inflight == 0 and link.describe()["inflight"] == 0
        await link.close()

    asyncio.run(check())


# --- the ones that learn nothing -----------------------------------------------------------------


def test_first_up() -> None:
    b = FirstUp({}, None)
    hosts = [SimHost("a", up=False), SimHost("b"), SimHost("c")]
    assert b.choose(hosts) is hosts[1]
    assert b.place(hosts[1:], Job("x/1")) is hosts[1]  # the primary, whatever its load
    hosts[1].inflight = 9
    assert b.place(hosts[1:], Job("x/1")) is hosts[1]


@pytest.mark.parametrize("cls", [LeastLoaded, LeastConnections])
def test_least_loaded_and_least_connections(cls: type) -> None:
    b = cls({}, None)
    a, c, d = SimHost("a", rtt_ms=5.0), SimHost("c", rtt_ms=None), SimHost("d", rtt_ms=2.0)
    a.sessions, c.sessions, d.sessions = 1, 0, 0
    assert b.choose([a, c, d]) is d  # fewest sessions; then the measured (lower) RTT
    d.up = False
    assert b.choose([a, c, d]) is c
    a.inflight, c.inflight, d.inflight = 0, 2, 0
    assert b.place([c, a, d], Job("x/1")) is d  # fewest in flight, then lower RTT
    d.rtt_ms = 5.0
    assert b.place([c, a, d], Job("x/1")) is a  # equal RTT too: the earlier one
    a.inflight = 3
    assert b.place([c, a], Job("x/1")) is c


def test_round_robin_rotates_sessions_over_up_hosts() -> None:
    b = RoundRobin({}, None)
    hosts = [SimHost("a"), SimHost("b"), SimHost("c")]
    assert [b.choose(hosts).name for _ in range(4)] == ["a", "b", "c", "a"]
    hosts[1].up = False
    assert [b.choose(hosts).name for _ in range(3)] == ["c", "a", "c"]  # b skipped
    hosts[1].up = True
    assert b.choose(hosts).name == "a" and b.choose(hosts).name == "b"


def test_round_robin_places_per_job_key() -> None:
    b = RoundRobin({}, None)
    hosts = [SimHost("a"), SimHost("b"), SimHost("c")]
    one, two = Job("cam/s1"), Job("cam/s2")
    assert [b.place(hosts, one).name for _ in range(2)] == ["a", "b"]
    assert b.place(hosts, two).name == "a"  # its own rotation
    assert b.place(hosts, one).name == "c"
    # The hosts holding a sequence change: the rotation goes on after the last one, by name.
    assert b.place([hosts[2], hosts[1]], one).name == "b"
    assert b.place([hosts[0], hosts[1]], one).name == "a"


def test_simple_balancers_take_no_options() -> None:
    from pydantic import ValidationError

    for cls in (FirstUp, LeastLoaded, LeastConnections, RoundRobin):
        with pytest.raises(ValidationError):
            cls({"alpha": 0.3}, None)


# --- least-model-time ----------------------------------------------------------------------------


def test_least_model_time_tries_unmeasured_hosts_first_then_the_fastest() -> None:
    b = LeastModelTime({"explore": 0, "seed": 1}, None)
    slow, fast = SimHost("slow", 0.05), SimHost("fast", 0.01)
    job = Job("cam/s1")
    assert b.place([slow, fast], job) is slow  # nothing measured: the primary
    assert b.place([slow, fast], job) is fast  # slow is being measured: fast next
    b.observe(slow, job, 0.05)
    b.observe(fast, job, 0.01)
    assert all(b.place([slow, fast], job) is fast for _ in range(20))
    assert b.estimates("cam/s1") == {"slow": 0.05, "fast": 0.01}
    assert b.place([slow], job) is slow  # only the hosts given
    # Per job key: another sequence starts from scratch.
    assert b.place([slow, fast], Job("cam/s2")) is slow


def test_least_model_time_converges_to_the_faster_host_and_still_explores() -> None:
    b = LeastModelTime({"seed": 7}, None)
    hosts = [SimHost("slow", 0.040), SimHost("fast", 0.008)]
    picks = simulate(b, hosts, 1200, 0.02)
    assert picks[10:60].count("fast") >= 40  # within a few observations of each host
    late = picks[200:]
    assert late.count("fast") / len(late) >= 0.9
    assert 0 < late.count("slow") < 0.1 * len(late)  # exploration (5 %) keeps measuring it
    est = b.estimates("app/s1")
    assert est["fast"] < est["slow"]


def test_least_model_time_avoids_a_failing_host_but_retries_it() -> None:
    b = LeastModelTime({"seed": 3, "explore": 0.1, "failure_penalty_s": 2.0}, None)
    flaky, steady = SimHost("flaky", 0.005), SimHost("steady", 0.02)
    job = Job("cam/s1")
    picks = []
    for _ in range(400):
        host = b.place([flaky, steady], job)
        picks.append(host.name)
        b.observe(host, job, None if host is flaky else 0.02)  # flaky always fails
    assert b.estimates("cam/s1")["flaky"] > 1.0
    assert picks[50:].count("steady") / 350 >= 0.9
    assert picks[50:].count("flaky") > 0  # exploration still tries it


def test_least_model_time_is_deterministic_with_a_seed() -> None:
    def run() -> list[str]:
        return simulate(LeastModelTime({"seed": 11, "explore": 0.3}, None),
                        [SimHost("a", 0.01), SimHost("b", 0.02)], 300, 0.01)

    assert run() == run()


# --- q-learning ----------------------------------------------------------------------------------


def _fleet2() -> list[SimHost]:
    return [SimHost("slow", 0.030, 0.002), SimHost("fast", 0.005, 0.002)]


def _fleet3() -> list[SimHost]:
    return [SimHost("slow", 0.030, 0.002), SimHost("mid", 0.015, 0.003),
            SimHost("fast", 0.005, 0.002)]


@pytest.mark.parametrize("fleet", [_fleet2, _fleet3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q_learning_learns_to_prefer_the_faster_host(fleet: Any, seed: int) -> None:
    b = QLearning({"seed": seed}, None)
    picks = simulate(b, fleet(), 2000, 0.01)
    assert picks[-200:].count("fast") / 200 >= 0.7
    # It learned it: in the states it meets most, "fast" has the highest value.
    table = b.values("app/s1")
    assert table and all(all(q <= 0 for q in row.values()) for row in table.values())
    busiest = max(table.values(), key=len)
    assert max(busiest, key=busiest.__getitem__) == "fast"


def test_q_learning_follows_a_host_that_becomes_slow() -> None:
    b = QLearning({"seed": 4}, None)
    hosts = _fleet2()
    simulate(b, hosts, 1000, 0.01)
    hosts[0].base_s, hosts[1].base_s = 0.005, 0.030  # "slow" is now the fast one
    picks = simulate(b, hosts, 1000, 0.01)
    assert picks[-200:].count("slow") / 200 >= 0.7


def test_q_learning_is_deterministic_with_a_seed() -> None:
    def run() -> list[str]:
        return simulate(QLearning({"seed": 5, "epsilon": 0.3}, None), _fleet3(), 500, 0.01)

    assert run() == run()


def test_q_learning_outcome_of_an_unknown_placement_is_tolerated() -> None:
    b = QLearning({"seed": 1}, None)
    host = SimHost("a")
    b.observe(host, Job("app/s1"), 0.01)  # placed before a reload, by another object
    b.observe(host, Job("app/s1"), None)
    assert b.values("app/s1") == {} and b.latencies("app/s1")["a"] > 0.01
    assert b.place([host], Job("app/s1")) is host


def test_q_learning_table_persists_and_reloads(tmp_path: Path) -> None:
    first = QLearning({"seed": 2, "save_every": 10_000}, tmp_path)
    simulate(first, _fleet2(), 600, 0.01)
    learned = first.values("app/s1")
    assert learned and not (tmp_path / FILE).exists()  # fewer outcomes than save_every
    first.close()
    saved = json.loads((tmp_path / FILE).read_text())
    assert saved["format"] == "rrtod q-learning" and "app/s1" in saved["agents"]
    assert [p.name for p in tmp_path.iterdir()] == [FILE]  # no temporary file left
    second = QLearning({"seed": 2}, tmp_path)
    assert second.values("app/s1") == learned
    assert second.latencies("app/s1") == first.latencies("app/s1")
    # It goes on from there: the faster host from the start.
    picks = simulate(second, _fleet2(), 200, 0.01)
    assert picks.count("fast") / 200 >= 0.8


def test_q_learning_writes_only_what_changed_and_creates_its_directory(tmp_path: Path) -> None:
    state = tmp_path / "balancers"
    b = QLearning({}, state)
    b.close()
    assert not state.exists()  # nothing learned: nothing written, no directory
    simulate(b, _fleet2(), 10, 0.01)
    b.close()
    assert (state / FILE).exists()


def test_q_learning_saves_every_n_outcomes(tmp_path: Path) -> None:
    b = QLearning({"save_every": 20, "seed": 1}, tmp_path)
    simulate(b, _fleet2(), 15, 0.01)
    assert not (tmp_path / FILE).exists()
    simulate(b, _fleet2(), 30, 0.01)
    assert (tmp_path / FILE).exists()  # no event loop here: written at once


def test_q_learning_periodic_save_leaves_the_event_loop(tmp_path: Path) -> None:
    async def run() -> None:
        b = QLearning({"save_every": 5, "seed": 1}, tmp_path)
        simulate(b, _fleet2(), 30, 0.01)
        assert b._writing is not None  # handed to a worker thread
        await b._writing
        assert (tmp_path / FILE).exists()
        b.close()

    asyncio.run(run())
    assert QLearning({}, tmp_path).values("app/s1")


@pytest.mark.parametrize("content", [
    "{not json", "[]", '{"format": "rrtod q-learning"}', "",
    '{"format": "rrtod q-learning", "version": 1, "inflight_edges": [1, 2, 4, 8], '
    '"latency_edges": [1.25, 2.0, 4.0], "agents": {"k": {"latency": {"a": "fast"}, "q": {}}}}',
])
def test_q_learning_survives_a_corrupt_table(tmp_path: Path, content: str) -> None:
    (tmp_path / FILE).write_text(content)
    with structlog.testing.capture_logs() as logs:
        b = QLearning({"seed": 1}, tmp_path)
    assert b.values("k") == {}
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert "starting fresh" in warning["event"] and warning["path"] == str(tmp_path / FILE)
    simulate(b, _fleet2(), 50, 0.01)
    b.close()  # replaced by a valid table
    assert QLearning({"seed": 1}, tmp_path).values("app/s1")


def test_q_learning_ignores_a_table_with_other_buckets(tmp_path: Path) -> None:
    b = QLearning({"seed": 1}, tmp_path)
    simulate(b, _fleet2(), 100, 0.01)
    b.close()
    with structlog.testing.capture_logs() as logs:
        other = QLearning({"inflight_edges": [1, 3]}, tmp_path)
    assert other.values("app/s1") == {}
    assert any("bucket edges" in e.get("why", "") for e in logs)
    assert QLearning({}, tmp_path).values("app/s1")  # the file itself is left alone


def test_q_learning_unreadable_state_dir_is_not_fatal(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    b = QLearning({"seed": 1}, blocker / "balancers")  # cannot be created: a file is in the way
    simulate(b, _fleet2(), 30, 0.01)
    with structlog.testing.capture_logs() as logs:
        b.close()
    assert any(e["event"] == "q-learning table not saved" for e in logs)


def test_q_learning_quadratic_reward_is_rilaas() -> None:
    b = QLearning({"reward": "quadratic", "gamma": 0, "seed": 1, "epsilon": 0}, None)
    host = SimHost("a")
    job = Job("app/s1")
    b.place([host], job)
    b.observe(host, job, 0.5)
    ((row),) = b.values("app/s1").values()
    assert row["a"] == pytest.approx(-(1.5 ** 2))


# --- options and configuration -------------------------------------------------------------------


def _loaded(tmp_path: Path, main: dict[str, Any], drop_in: dict[str, Any] | None = None
            ) -> config_mod.LoadedConfig:
    base = {"roles": ["robot"], "state_dir": str(tmp_path / "state"),
            "hosts": [{"name": "a", "address": "unix:/nonexistent.sock"}]}
    (tmp_path / "rrtod.yaml").write_text(yaml.safe_dump({**base, **main}))
    if drop_in is not None:
        (tmp_path / "rrtod.d").mkdir(exist_ok=True)
        (tmp_path / "rrtod.d" / "10-balancer.yaml").write_text(yaml.safe_dump(drop_in))
    return config_mod.load(tmp_path / "rrtod.yaml")


@pytest.mark.parametrize(("options", "key", "reason"), [
    ({"alpha": 2}, "balancers.q-learning.alpha", "less than or equal to 1"),
    ({"alpha": True}, "balancers.q-learning.alpha", "expected a number, got True"),
    ({"epsilon": "lots"}, "balancers.q-learning.epsilon", "valid number"),
    ({"alpah": 0.2}, "balancers.q-learning.alpah", "unknown key"),
    ({"reward": "cubic"}, "balancers.q-learning.reward", "'linear' or 'quadratic', got 'cubic'"),
    ({"inflight_edges": [4, 2]}, "balancers.q-learning.inflight_edges", "strictly increasing"),
    ({"save_every": 0}, "balancers.q-learning.save_every", "greater than or equal to 1"),
])
def test_bad_option_names_file_key_and_reason(registry: Any, tmp_path: Path,
                                              options: dict[str, Any], key: str,
                                              reason: str) -> None:
    loaded = _loaded(tmp_path, {"balancer": "q-learning", "balancers": {"q-learning": options}})
    with pytest.raises(ConfigError) as err:
        check_plugins(loaded, registry)
    assert (err.value.file, err.value.key) == (str(tmp_path / "rrtod.yaml"), key)
    assert reason in err.value.reason, err.value.reason
    assert not (tmp_path / "state").exists()  # checking writes nothing


def test_option_error_names_the_drop_in_that_set_it(registry: Any, tmp_path: Path) -> None:
    loaded = _loaded(tmp_path, {"balancer": "least-model-time"},
                     {"balancers": {"least-model-time": {"explore": 1.5}}})
    with pytest.raises(ConfigError) as err:
        check_plugins(loaded, registry)
    assert err.value.file == str(tmp_path / "rrtod.d" / "10-balancer.yaml")
    assert err.value.key == "balancers.least-model-time.explore"


def test_options_of_a_balancer_without_options_are_refused(registry: Any, tmp_path: Path) -> None:
    loaded = _loaded(tmp_path, {"balancer": "first-up", "balancers": {"first-up": {"seed": 1}}})
    with pytest.raises(ConfigError, match=r"balancers\.first-up\.seed: unknown key"):
        check_plugins(loaded, registry)


def test_a_block_for_no_installed_balancer_is_refused(registry: Any, tmp_path: Path) -> None:
    loaded = _loaded(tmp_path, {"balancer": "q-learning",
                                "balancers": {"q-lerning": {"alpha": 0.2}}})
    with pytest.raises(ConfigError) as err:
        check_plugins(loaded, registry)
    assert err.value.key == "balancers.q-lerning"
    assert "no balancer plugin named 'q-lerning'" in err.value.reason
    assert "q-learning" in err.value.reason  # what is installed


def test_blocks_must_be_mappings() -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping({"balancers": {"q-learning": [1]}})
    assert (err.value.key, err.value.reason) == ("balancers.q-learning",
                                                 "expected a mapping, got list")


def test_good_options_reach_the_factory(registry: Any, tmp_path: Path) -> None:
    loaded = _loaded(tmp_path, {"balancer": "q-learning", "balancers": {
        "q-learning": {"alpha": 0.2, "gamma": 0, "seed": 3, "inflight_edges": [1, 3]},
        "least-model-time": {"explore": 0.2}}})
    check_plugins(loaded, registry)
    built = build_balancer(registry, loaded.config)
    assert isinstance(built, QLearning)
    assert (built.options.alpha, built.options.gamma, built.options.inflight_edges) == (
        0.2, 0.0, [1, 3])
    assert built.path == state_dir(loaded.config) / FILE == tmp_path / "state" / "balancers" / FILE


def test_a_factory_of_the_old_shape_is_refused_with_what_it_lacks(tmp_path: Path) -> None:
    from rrtod.hookspecs import PluginRecord, hookimpl

    class Old:  # choose() only, built with factory(): the contract before place/observe
        def choose(self, hosts: Any) -> Any:
            return None

    class Plugin:
        @hookimpl
        def rrto_host_balancers(self) -> list[PluginRecord[Any]]:
            return [PluginRecord("old", Old), PluginRecord("old-built", lambda o, s: Old())]

    registry = discover(extra={"old": Plugin()})
    with pytest.raises(ConfigError, match=r"balancer: balancer plugin 'old': its factory "
                                          r"__call__ cannot be called as \(options, state_dir\)"):
        build_balancer(registry, from_mapping({"balancer": "old"}))
    with pytest.raises(ConfigError, match=r"built Old, which is not an rrtod.hookspecs."
                                          r"HostBalancer \(no place, no observe, no close\)"):
        build_balancer(registry, from_mapping({"balancer": "old-built"}))


def test_check_config_reports_a_bad_option(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path, {"balancer": "least-model-time",
                                "balancers": {"least-model-time": {"alpha": 0}}})
    out = subprocess.run([sys.executable, "-m", "rrtod", "--config", str(loaded.path),
                          "--check-config"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 78, out.stderr
    assert f"{loaded.path}: balancers.least-model-time.alpha: Input should be greater than 0" \
        in out.stderr
    assert "Traceback" not in out.stderr


def test_reload_with_a_bad_option_keeps_the_running_config(registry: Any, tmp_path: Path) -> None:
    loaded = _loaded(tmp_path, {"balancer": "q-learning"})

    async def run() -> None:
        daemon = Daemon(loaded, registry)
        _loaded(tmp_path, {"balancer": "q-learning", "balancers": {"q-learning": {"gamma": 1}}})
        with structlog.testing.capture_logs() as logs:
            assert await daemon.reload() is False
        assert daemon.loaded is loaded
        assert any("balancers.q-learning.gamma" in e.get("error", "") for e in logs)

    asyncio.run(run())


def test_robot_role_builds_keeps_and_closes_the_balancer(registry: Any, tmp_path: Path) -> None:
    from rrtod.robot.role import RobotRole

    config = _loaded(tmp_path, {"balancer": "q-learning",
                                "balancers": {"q-learning": {"seed": 1}}}).config
    table = tmp_path / "state" / "balancers" / FILE

    async def run() -> None:
        role = RobotRole(config, registry)
        first = role.balancer
        assert isinstance(first, QLearning) and first.options.seed == 1
        simulate(first, _fleet2(), 100, 0.01)
        # A reload that changes neither `balancer` nor its block keeps it and what it learned.
        await role.reload(config.model_copy(update={"drain_timeout": 3.0}))
        assert role.balancer is first and not table.exists()
        # One that changes its options closes it (the table is written), then builds the new
        # one, which loads the table.
        changed = config.model_copy(update={"balancers": {"q-learning": {"seed": 2}}})
        await role.reload(changed)
        assert role.balancer is not first and table.exists()
        assert role.balancer.values("app/s1") == first.values("app/s1")
        simulate(role.balancer, _fleet2(), 50, 0.01)
        before = table.stat().st_mtime_ns, table.read_text()
        await role.stop()  # closes it: the table is written again
        assert table.read_text() != before[1]

    asyncio.run(run())
