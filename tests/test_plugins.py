"""Plugin discovery as a third party meets it: real distributions built with pip and found
through their ``rrto`` entry points, in a fresh interpreter (entry points are read from
``sys.path`` at discovery, so each scenario gets its own ``PYTHONPATH``).

Building uses ``pip install --no-deps --no-build-isolation --target``: no network, nothing
installed into the venv, and the example's source tree is copied first so the build leaves no
``build/`` or ``egg-info`` behind in the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rrtod import plugins
from rrtod.hookspecs import PluginRecord, PowerMeterRecord, hookimpl
from rrtod.plugins import PluginError, discover

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "rrto-example-plugin"


def _pip_install(source: Path, target: Path) -> Path:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return target


def _make_dist(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]
               ) -> Path:
    """A minimal distribution source tree: one top-level module per ``modules`` item."""
    src = root / f"src-{dist}"
    src.mkdir(parents=True)
    eps = "\n".join(f'{name} = "{value}"' for name, value in entry_points.items())
    mods = ", ".join(f'"{m}"' for m in modules)
    (src / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "2.5.0"

        [project.entry-points.rrto]
        """) + eps + f"\n\n[tool.setuptools]\npy-modules = [{mods}]\n")
    for name, code in modules.items():
        (src / f"{name}.py").write_text(textwrap.dedent(code))
    return src


def _discover_in_subprocess(pythonpath: list[Path], disable: str | None = None,
                            extra_code: str = "") -> dict[str, Any]:
    """Run ``discover()`` in a fresh interpreter; return its description (or the error)."""
    code = textwrap.dedent("""\
        import json, sys
        from rrtod import plugins
        try:
            reg = plugins.discover()
        except plugins.PluginError as exc:
            print(json.dumps({"error": str(exc)}))
            raise SystemExit(0)
        out = reg.describe()
        out["imported_example"] = "rrto_example_plugin" in sys.modules
        out["power_priority"] = {r.name: r.priority for r in reg.records("power")}
        """) + textwrap.dedent(extra_code) + "print(json.dumps(out))\n"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", plugins.DISABLE_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    if disable is not None:
        env[plugins.DISABLE_ENV] = disable
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120, cwd=pythonpath[0] if pythonpath else None)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def _by_name(desc: dict[str, Any], family: str) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in desc["families"][family]}


@pytest.fixture(scope="module")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """rrto-example-plugin, built and installed into a private directory."""
    base = tmp_path_factory.mktemp("example")
    src = base / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    return _pip_install(src, base / "site")


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A distribution whose plugin modules fail at import time in two ways."""
    base = tmp_path_factory.mktemp("broken")
    src = _make_dist(
        base, "rrto-broken-plugin",
        {"broken": "rrto_broken_raises", "exits": "rrto_broken_exits"},
        {"rrto_broken_raises": 'raise RuntimeError("cannot find libvendor.so")\n',
         "rrto_broken_exits": "import sys\nsys.exit(3)\n"},
    )
    return _pip_install(src, base / "site")


# --- the example plugin -------------------------------------------------------------------------


def test_example_is_listed_with_its_distribution(example_site: Path) -> None:
    desc = _discover_in_subprocess([example_site])
    balancer = _by_name(desc, "balancer")["weighted"]
    assert (balancer["distribution"], balancer["version"], balancer["entry_point"]) == (
        "rrto-example-plugin", "0.1.0", "example")
    power = _by_name(desc, "power")["constant"]
    assert power["distribution"] == "rrto-example-plugin"
    assert desc["failed"] == []
    # Never chosen by `power: auto` over the built-in estimate (priority 0).
    assert desc["power_priority"]["constant"] < desc["power_priority"].get("model", 0)
    # Built-ins still there: the example adds to them.
    assert "least-loaded" in _by_name(desc, "balancer")


def test_example_balancer_works_through_the_registry(example_site: Path) -> None:
    desc = _discover_in_subprocess([example_site], extra_code="""\
        from types import SimpleNamespace as H
        hosts = [H(name=n, up=u, rtt_ms=None, sessions=0)
                 for n, u in (("a", True), ("b", False), ("c", True))]
        from pathlib import Path
        bal = reg.get("balancer", "weighted").factory({"weights": {"c": 2}}, Path("unused"))
        out["picks"] = [bal.choose(hosts).name for _ in range(6)]
        out["none_up"] = bal.choose([H(name="a", up=False, rtt_ms=1.0, sessions=0)])
        meter = reg.get("power", "constant").factory(None)
        out["probe"] = reg.get("power", "constant").probe()
        out["joules_ok"] = meter.read() >= 0
        """)
    assert desc["picks"] == ["c", "a", "c", "c", "a", "c"]
    assert desc["none_up"] is None
    assert desc["probe"] is None and desc["joules_ok"] is True


@pytest.fixture
def example_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import rrto_example_plugin

    return rrto_example_plugin


def _hosts(*spec: tuple[str, bool]) -> list[SimpleNamespace]:
    return [SimpleNamespace(name=n, up=u, rtt_ms=None, sessions=0) for n, u in spec]


def test_weighted_spreads_sessions_by_weight(example_module: Any) -> None:
    w = example_module.Weighted({"weights": {"a": 3}}, None)
    hosts = _hosts(("a", True), ("b", True))
    picks = [w.choose(hosts).name for _ in range(8)]
    assert picks == ["a", "a", "b", "a", "a", "a", "b", "a"]  # 3:1, interleaved
    assert w.choose([]) is None


def test_weighted_follows_hosts_going_down_and_up(example_module: Any) -> None:
    w = example_module.Weighted({}, None)
    hosts = _hosts(("a", True), ("b", True), ("c", True))
    assert w.choose(hosts).name == "a"
    hosts[1].up = False
    picks = [w.choose(hosts).name for _ in range(20)]
    assert "b" not in picks and abs(picks.count("a") - picks.count("c")) <= 2
    hosts[1].up = True
    picks = [w.choose(hosts).name for _ in range(30)]
    assert "b" in picks[:3] and all(picks.count(n) == 10 for n in "abc")
    for h in hosts:
        h.up = False
    assert w.choose(hosts) is None


def test_weighted_returns_the_objects_it_was_given(example_module: Any) -> None:
    hosts = _hosts(("a", True))
    assert example_module.Weighted({}, None).choose(hosts) is hosts[0]


def test_weighted_options_are_validated(example_module: Any) -> None:
    from pydantic import ValidationError

    for bad in ({"weights": {"a": 0}}, {"weights": {"a": True}}, {"default_weight": -1},
                {"weight": {"a": 1}}):
        with pytest.raises(ValidationError):
            example_module.Weighted(bad, None)


def test_constant_meter_integrates_fixed_watts(example_module: Any) -> None:
    now = [100.0]
    meter = example_module.ConstantMeter(watts=12.5, clock=lambda: now[0])
    assert meter.read() == 0.0
    now[0] = 104.0
    assert meter.read() == pytest.approx(50.0)
    assert meter.blocking is False and meter.describe()["watts"] == 12.5
    with pytest.raises(ValueError):
        example_module.ConstantMeter(watts=-1)


def test_example_records_have_the_right_types(example_module: Any) -> None:
    (bal,) = example_module.rrto_host_balancers()
    (meter,) = example_module.rrto_power_meters()
    assert type(bal) is PluginRecord and bal.name == "weighted"
    assert isinstance(meter, PowerMeterRecord) and meter.name == "constant"
    assert meter.probe() is None and meter.priority < 0
    assert meter.factory(None).read() >= 0


# --- conflicts, failures, disabling -------------------------------------------------------------


def test_duplicate_names_across_distributions_name_both(
    tmp_path: Path, example_site: Path
) -> None:
    """The second distribution even reuses the entry point name "example": entry point names
    only need to be unique within a distribution, and the clash must surface as the duplicate
    record it is, naming both distributions."""
    src = _make_dist(tmp_path, "rrto-dup-plugin", {"example": "rrto_dup_plugin"}, {
        "rrto_dup_plugin": """\
            from rrtod.hookspecs import PluginRecord, hookimpl

            @hookimpl
            def rrto_host_balancers():
                return [PluginRecord("weighted", object, "a different weighted balancer")]
            """,
    })
    site = _pip_install(src, tmp_path / "site")
    desc = _discover_in_subprocess([example_site, site])
    assert "error" in desc, desc
    message = desc["error"]
    assert "weighted" in message and "balancer" in message
    assert "rrto-example-plugin" in message and "rrto-dup-plugin" in message


def test_same_entry_point_name_in_two_distributions_both_load(
    tmp_path: Path, example_site: Path
) -> None:
    src = _make_dist(tmp_path, "rrto-other-plugin", {"example": "rrto_other_plugin"}, {
        "rrto_other_plugin": """\
            from rrtod.hookspecs import PluginRecord, hookimpl

            @hookimpl
            def rrto_host_balancers():
                return [PluginRecord("other", object, "another balancer")]
            """,
    })
    site = _pip_install(src, tmp_path / "site")
    desc = _discover_in_subprocess([example_site, site])
    balancers = _by_name(desc, "balancer")
    assert balancers["other"]["distribution"] == "rrto-other-plugin"
    assert balancers["weighted"]["distribution"] == "rrto-example-plugin"
    assert desc["failed"] == []


def test_disabling_one_side_settles_a_duplicate(tmp_path: Path, example_site: Path) -> None:
    src = _make_dist(tmp_path, "rrto-dup2-plugin", {"dup": "rrto_dup2_plugin"}, {
        "rrto_dup2_plugin": """\
            from rrtod.hookspecs import PluginRecord, hookimpl

            @hookimpl
            def rrto_host_balancers():
                return [PluginRecord("weighted", object, "dup")]
            """,
    })
    site = _pip_install(src, tmp_path / "site")
    desc = _discover_in_subprocess([example_site, site], disable="dup")
    assert _by_name(desc, "balancer")["weighted"]["distribution"] == "rrto-example-plugin"
    assert desc["blocked"] == ["dup"]


def test_plugin_failing_on_import_is_skipped_and_listed(
    broken_site: Path, example_site: Path
) -> None:
    desc = _discover_in_subprocess([broken_site, example_site])
    failed = {f["entry_point"]: f for f in desc["failed"]}
    assert set(failed) == {"broken", "exits"}
    assert failed["broken"]["distribution"] == "rrto-broken-plugin"
    assert "RuntimeError" in failed["broken"]["error"] and "libvendor" in failed["broken"]["error"]
    assert "SystemExit" in failed["exits"]["error"]
    # Everything else still loads.
    assert "weighted" in _by_name(desc, "balancer")


def test_disable_by_entry_point_name_prevents_the_import(example_site: Path) -> None:
    desc = _discover_in_subprocess([example_site], disable="example")
    assert "weighted" not in _by_name(desc, "balancer")
    assert "constant" not in _by_name(desc, "power")
    assert desc["imported_example"] is False
    assert desc["blocked"] == ["example"]


def test_disable_by_record_name_keeps_the_rest_of_the_plugin(example_site: Path) -> None:
    desc = _discover_in_subprocess([example_site], disable=" constant , nonexistent")
    assert "constant" not in _by_name(desc, "power")
    assert "weighted" in _by_name(desc, "balancer")
    assert desc["blocked"] == ["constant", "nonexistent"]


def test_disabling_a_broken_plugin_silences_it(broken_site: Path) -> None:
    desc = _discover_in_subprocess([broken_site], disable="broken,exits")
    assert desc["failed"] == []


# --- hooks misbehaving (in process, through ``extra``) ------------------------------------------


class _RaisingHook:
    @hookimpl
    def rrto_host_balancers(self) -> list[PluginRecord]:
        raise RuntimeError("hook exploded")

    @hookimpl
    def rrto_schedulers(self) -> list[PluginRecord]:
        return [PluginRecord("survivor", object, "from a plugin with one bad hook")]


class _WrongReturns:
    @hookimpl
    def rrto_host_balancers(self) -> list[Any]:
        return ["round-robin", PluginRecord("good-one", object), PluginRecord("", object)]

    @hookimpl
    def rrto_sequence_searches(self) -> Any:
        return PluginRecord("single", object)  # a record, not a list of them

    @hookimpl
    def rrto_power_meters(self) -> list[PluginRecord]:
        return [PluginRecord("no-probe", object)]  # power needs PowerMeterRecord


@pytest.fixture(autouse=True)
def _no_disable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugins.DISABLE_ENV, raising=False)


def test_raising_hook_is_skipped_other_hooks_count() -> None:
    reg = discover(extra={"raiser": _RaisingHook()})
    (failure,) = [f for f in reg.failed if f["entry_point"] == "raiser"]
    assert "rrto_host_balancers" in failure["error"] and "hook exploded" in failure["error"]
    assert failure["distribution"] == "<embedded>"
    assert "survivor" in reg.names("scheduler")


def test_non_records_are_reported_good_records_kept() -> None:
    reg = discover(extra={"wrong": _WrongReturns()})
    errors = [f["error"] for f in reg.failed if f["entry_point"] == "wrong"]
    assert any("returned str, not a PluginRecord" in e for e in errors), errors
    assert any("rrto_sequence_searches returned PluginRecord, not a list" in e for e in errors)
    assert any("without a name" in e for e in errors), errors
    assert any("not a PowerMeterRecord" in e for e in errors), errors
    assert "good-one" in reg.names("balancer")
    assert "single" not in reg.names("search") and "no-probe" not in reg.names("power")


def test_duplicate_between_embedded_plugins_is_an_error() -> None:
    class One:
        @hookimpl
        def rrto_schedulers(self) -> list[PluginRecord]:
            return [PluginRecord("twin", object)]

    with pytest.raises(PluginError, match=r"duplicate scheduler plugin 'twin'.*\(one\).*\(two\)"):
        discover(extra={"one": One(), "two": One()})


def test_disable_env_applies_to_embedded_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins.DISABLE_ENV, "raiser")
    reg = discover(extra={"raiser": _RaisingHook()})
    assert reg.failed == [] or all(f["entry_point"] != "raiser" for f in reg.failed)
    assert "survivor" not in reg.names("scheduler")
    assert "raiser" in reg.blocked


def test_unknown_name_lists_what_is_installed() -> None:
    reg = discover(extra={"raiser": _RaisingHook()})
    with pytest.raises(PluginError, match=r"no scheduler plugin named 'nope' \(installed: .*"
                                          r"survivor"):
        reg.get("scheduler", "nope")
