"""The plugin contract holds: every example in ``rrtod/hookspecs.py`` runs, and every built-in
plugin, the example third-party plugin and the test kit's backend satisfy their family's
Protocols, records, factories (called as the daemon calls them) and the objects they build.
Capabilities are declared: an object that does not declare them is refused where it enters,
with what it lacks."""

from __future__ import annotations

import asyncio
import doctest
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from rrtod import hookspecs
from rrtod.config import PowerConfig, TLSConfig
from rrtod.executor import ExecutorContext
from rrtod.gpu.blobstore import BlobStore
from rrtod.hookspecs import (
    BUILDS,
    FACTORIES,
    FAMILIES,
    Channel,
    Executor,
    ExecutorFactory,
    InterceptionBackend,
    MeterBase,
    OperatorInfo,
    PluginRecord,
    PowerMeter,
    PowerMeterRecord,
    ReplayExtension,
    ReplyMemory,
    problems,
)
from rrtod.plugins import discover
from rrtod.robot.meters import MeterError, select_meter

ROOT = Path(__file__).resolve().parent.parent
RECORD_TYPE = {"interception": InterceptionBackend, "power": PowerMeterRecord}


def test_every_hookspec_example_runs() -> None:
    for name in FAMILIES.values():
        assert ">>>" in inspect.getdoc(getattr(hookspecs.Specs, name)), f"{name} has no example"
    result = doctest.testmod(hookspecs, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted >= 40  # the examples above, not an empty run


@pytest.fixture(scope="module")
def builtins() -> dict[str, dict[str, PluginRecord[Any]]]:
    registry = discover()
    loaded = {fam: {n: registry.get(fam, n) for n in registry.names(fam)} for fam in FAMILIES}
    ours = {fam: {n: r for n, r in recs.items()
                  if registry.families[fam][n].distribution == "rrtod"}
            for fam, recs in loaded.items()}
    assert all(ours.values()), ours  # every family has a built-in
    return ours


def _conforms(records: dict[str, PluginRecord[Any]], family: str) -> None:
    for name, record in records.items():
        assert isinstance(record, RECORD_TYPE.get(family, PluginRecord)), name
        assert problems(record.factory, FACTORIES[family]) == [], (family, name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_builtin_records_and_factories_conform(builtins, family: str) -> None:
    _conforms(builtins[family], family)


@pytest.mark.parametrize("family", ["search", "scheduler", "balancer"])
def test_builtin_objects_conform(builtins, family: str, tmp_path: Path) -> None:
    for name, record in builtins[family].items():
        # A balancer is built with its options block and its state directory.
        built = record.factory({}, tmp_path) if family == "balancer" else record.factory()
        assert isinstance(built, BUILDS[family]), name
        assert problems(built, BUILDS[family]) == [], name


def test_builtin_balancers_are_the_six_documented(builtins) -> None:
    assert set(builtins["balancer"]) == {"first-up", "least-loaded", "least-connections",
                                         "round-robin", "least-model-time", "q-learning"}


def test_balancer_base_needs_only_choose(tmp_path: Path) -> None:
    """A third-party balancer that writes only ``choose``: the class is a factory, ``place``
    chooses among the given hosts, ``observe``/``close`` do nothing, and options it does not
    declare are refused."""
    from pydantic import ValidationError

    class Last(hookspecs.BalancerBase):
        def choose(self, hosts):
            up = [h for h in hosts if h.up]
            return up[-1] if up else None

    assert problems(Last, FACTORIES["balancer"]) == []
    balancer = Last({}, tmp_path)
    assert isinstance(balancer, hookspecs.HostBalancer)
    assert problems(balancer, hookspecs.HostBalancer) == []
    hosts = [SimpleNamespace(name=n, up=True, rtt_ms=None, sessions=0, inflight=0) for n in "ab"]
    job = hookspecs.Job("app/s1")
    assert balancer.place(hosts, job) is hosts[1]
    assert balancer.observe(hosts[1], job, 0.01) is None and balancer.close() is None
    assert list(tmp_path.iterdir()) == []  # nothing written
    with pytest.raises(ValidationError):
        Last({"unknown": 1}, tmp_path)
    with pytest.raises(NotImplementedError):
        hookspecs.BalancerBase({}, tmp_path).choose(hosts)


def test_builtin_transport_builds_a_channel(builtins, tmp_path: Path) -> None:
    async def build() -> None:
        for record in builtins["transport"].values():
            channel = record.factory(f"unix:{tmp_path}/peer.sock", TLSConfig())
            assert isinstance(channel, grpc.aio.Channel)
            await channel.close()

    asyncio.run(build())


def test_builtin_power_meters_conform_without_hardware(builtins) -> None:
    """Every built-in meter class declares the whole PowerMeter (instances made without their
    hardware); those available here are built through their record as the daemon would."""
    from rrto_plugins.power import jetson, model, nvml, rapl

    for cls in (jetson.JetsonMeter, model.ModelMeter, nvml.NvmlMeter, rapl.RaplMeter):
        assert issubclass(cls, MeterBase)
        assert problems(object.__new__(cls), PowerMeter) == [], cls
    assert model.ModelMeter.follows_state and nvml.NvmlMeter.blocking
    available = [r for r in builtins["power"].values() if r.probe() is None]
    assert "model" in {r.name for r in available}
    for record in available:
        meter = record.factory(PowerConfig())
        assert isinstance(meter, PowerMeter) and problems(meter, PowerMeter) == [], record.name


def test_torch_backend_conforms(builtins, tmp_path: Path) -> None:
    from rrtod.shim.channel import LoopbackChannel

    record = builtins["interception"]["torch"]
    assert problems(record.executor, ExecutorFactory) == []
    ctx = ExecutorContext(device="cpu", memory_quota=1 << 26, allow_extra=(), deny=(),
                          blobs=BlobStore(tmp_path / "blobs", 1 << 26), state_dir=tmp_path)
    executor = record.executor(ctx)
    assert isinstance(executor, Executor) and problems(executor, Executor) == []
    assert isinstance(executor.replay, ReplayExtension)
    assert problems(executor.replay, ReplayExtension) == []
    assert isinstance(executor.reply_memory, ReplyMemory)
    assert problems(executor.reply_memory, ReplyMemory) == []
    channel = LoopbackChannel(executor)
    assert problems(channel, Channel) == []
    interceptor = record.factory(channel, mode="stream", fallback="local", replay=True)
    try:
        assert isinstance(interceptor, hookspecs.Interceptor)
        assert problems(interceptor, hookspecs.Interceptor) == []
    finally:
        interceptor.uninstall()
    operators = record.operators()
    assert operators and all(problems(op, OperatorInfo) == [] for op in operators)


def test_testkit_echo_executor_conforms(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "testkit" / "echo_plugin"))
    import rrto_testkit

    (record,) = rrto_testkit.rrto_interception_backends()
    ctx = ExecutorContext("cpu", 1, (), (), blobs=None, state_dir=tmp_path)  # type: ignore[arg-type]
    executor = record.executor(ctx)
    assert isinstance(executor, Executor) and executor.replay is None
    assert problems(executor, Executor) == []


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "rrto-example-plugin"))
    import rrto_example_plugin

    return rrto_example_plugin


def test_example_plugin_conforms(example: Any) -> None:
    balancers = {r.name: r for r in example.rrto_host_balancers()}
    meters = {r.name: r for r in example.rrto_power_meters()}
    _conforms(balancers, "balancer")
    _conforms(meters, "power")
    balancer = balancers["weighted"].factory({"weights": {"a": 2}}, ROOT / "unused")
    assert isinstance(balancer, hookspecs.HostBalancer)
    assert problems(balancer, hookspecs.HostBalancer) == []
    meter = meters["constant"].factory(PowerConfig())
    assert isinstance(meter, PowerMeter) and problems(meter, PowerMeter) == []


# ---- non-conforming objects are named, and refused where they enter ------------------------------


def test_problems_names_missing_members_and_wrong_signatures() -> None:
    class Wrong:
        blocking = False

        def read(self, channel: int) -> float:  # the daemon calls read()
            return 0.0

    found = problems(Wrong(), PowerMeter)
    assert "no follows_state" in found and "no read_ns" in found and "no set_state" in found
    assert any(p.startswith("read cannot be called as ()") for p in found), found
    assert problems(lambda channel: None, hookspecs.InterceptorFactory) == [
        "__call__ cannot be called as (channel, mode=, fallback=, replay=, deadline_ms=): got an "
        "unexpected keyword argument 'mode'"]


def test_a_meter_that_declares_nothing_is_refused_with_what_it_lacks() -> None:
    class Bare:  # read() alone: the contract before capabilities were declared
        def read(self) -> float:
            return 0.0

    registry = SimpleNamespace(
        get=lambda family, name: PowerMeterRecord("bare", lambda config: Bare()),
        records=lambda family: [])
    with pytest.raises(MeterError, match=r"'bare' built Bare, which is not an "
                                         r"rrtod.hookspecs.PowerMeter \(no blocking.*MeterBase"):
        select_meter(registry, PowerConfig(meter="bare"))


def test_gpu_service_refuses_an_executor_that_declares_nothing(tmp_path: Path) -> None:
    from rrtod.config import Config
    from rrtod.gpu.access import Grant
    from rrtod.gpu.service import GpuRole
    from rrtod.plugins import PluginError, Registry

    class Undeclared:  # no replay / reply_memory attributes
        def __init__(self, ctx: ExecutorContext) -> None: ...
        def open(self, request: Any) -> Any: ...
        def handle(self, frame: Any) -> Any: ...
        def stats(self) -> dict[str, Any]: return {}
        def close(self) -> None: ...

    class Plugin:
        @hookspecs.hookimpl
        def rrto_interception_backends(self) -> list[InterceptionBackend]:
            return [InterceptionBackend("undeclared", lambda channel, **kw: None,
                                        executor=Undeclared)]

    registry: Registry = discover(extra={"undeclared": Plugin()})
    role = GpuRole(Config(state_dir=str(tmp_path)), registry)
    grant = role.access.grant("local")
    assert isinstance(grant, Grant)
    with pytest.raises(PluginError, match=r"built Undeclared, which is not an "
                                          r"rrtod.executor.Executor \(no replay, no reply_memory"):
        role._new_executor(SimpleNamespace(executor="undeclared"), grant)


def test_hookspecs_imports_no_robot_or_gpu_module() -> None:
    """The contract is shared: importing it must not pull in either role's code."""
    code = ("import sys, rrtod.hookspecs; "
            "print([m for m in sys.modules if m.startswith(('rrtod.robot', 'rrtod.gpu'))])")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
