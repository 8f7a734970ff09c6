"""The plugin contract (pluggy project ``rrto``): what a plugin author implements, in one place.

A plugin is a module or object registered through the ``rrto`` entry-point group. It implements
any of the hooks of ``Specs`` with ``@hookimpl``; each hook returns a list of records, and the
daemon picks records by the names its configuration gives. pluggy hooks are synchronous and run
at every discovery, so records only *describe*: each carries a ``factory`` that the daemon calls
when the configuration selects the record, and the object it builds does the work.

Per family, this module declares the factory (a Protocol whose ``__call__`` is the call the
daemon makes) and the object it builds (a Protocol with its methods). Optional capabilities are
declared, never probed: a power meter states ``blocking``/``follows_state``/``read_ns`` (derive
from ``MeterBase`` for the documented defaults); a host balancer has ``place``/``observe``/
``close`` (``BalancerBase`` gives defaults); a host executor states ``replay`` and
``reply_memory`` (see ``rrtod.executor``). ``problems(obj, protocol)`` lists what keeps an object
from conforming, for a plugin's own tests. Every example below runs (``tests/test_hookspecs.py``).

Built-in plugins under ``plugins/`` use exactly this contract; ``examples/rrto-example-plugin``
is a third-party one. The guide is ``docs/plugins.md``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import pluggy
from pydantic import BaseModel, ConfigDict, model_validator

from rrtod.executor import (
    BlobStoreLike,
    Executor,
    ExecutorContext,
    HostMemoryExceeded,
    HostMemoryLike,
    ReplayExtension,
    ReplyMemory,
)
from rrtod.shim.channel import Channel, OnDown, OnLost  # noqa: F401 - part of the contract

if TYPE_CHECKING:
    import grpc

    from rrtod.config import PowerConfig, TLSConfig
    from rrtod.robot.oplog import LoggedCall

__all__ = [
    "PROJECT", "hookspec", "hookimpl", "Specs", "FAMILIES", "FACTORIES", "BUILDS",
    "PluginRecord", "InterceptionBackend", "PowerMeterRecord", "problems",
    # interception
    "Channel", "Interceptor", "InterceptorFactory", "ExecutorFactory", "OperatorInfo",
    "Executor", "ExecutorContext", "ReplayExtension", "ReplyMemory", "BlobStoreLike",
    "HostMemoryLike", "HostMemoryExceeded",
    # search, transport, scheduler, balancer, power
    "Candidate", "SequenceSearch", "SearchFactory", "TransportFactory", "Scheduler",
    "SchedulerFactory", "HostView", "Job", "HostBalancer", "BalancerBase", "BalancerOptions",
    "BalancerFactory", "POWER_STATES",
    "PowerMeter", "MeterBase", "PowerMeterFactory",
]

PROJECT = "rrto"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# ================================================================================================
# interception: the shim's interceptor (in the app) and the host's executor (in the GPU daemon)

# ``Channel`` (how an interceptor's frames reach the robot daemon) is the shim's: rrtod/shim/channel.py.


@runtime_checkable
class Interceptor(Protocol):
    """What the factory returns, installed: the app's operators now go through ``channel``."""

    def uninstall(self) -> None:
        """Restore plain local execution."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters for benchmarks and diagnostics (read by ``rrtod.shim.activate.interceptor()``)."""
        ...


class InterceptorFactory(Protocol):
    """``InterceptionBackend.factory``, called in the app process once the framework is
    imported, with the shim's settings (``intercept.mode``/``fallback``/``replay``/
    ``deadline_ms``)."""

    def __call__(self, channel: Channel, *, mode: str, fallback: str,
                 replay: bool, deadline_ms: float | None) -> Interceptor: ...


class ExecutorFactory(Protocol):
    """``InterceptionBackend.executor``, called by the GPU daemon once per app session."""

    def __call__(self, ctx: ExecutorContext, /) -> Executor: ...


class OperatorInfo(Protocol):
    """One operator an executor admits by default (``rrtoctl ops``)."""

    name: str  # ns::op.overload
    reason: str
    modes: str
    seen_in: str


# ================================================================================================
# sequence search (robot daemon): propose where one inference sits in an op log


@dataclass(frozen=True)
class Candidate:
    """A proposal: the block ``log[start:start+period]`` is one inference, repeated from
    ``start`` at least twice. Never trusted: ``rrtod.robot.search.verify`` decides."""

    start: int
    period: int


@runtime_checkable
class SequenceSearch(Protocol):
    def candidates(self, log: Sequence[LoggedCall]) -> Iterable[Candidate]:
        """Candidates, best first; may be a generator (the search stops at the first one that
        verifies, or when its time budget runs out). Runs in a worker thread."""
        ...


class SearchFactory(Protocol):
    def __call__(self) -> SequenceSearch: ...


# ================================================================================================
# transport (robot daemon): a channel to one GPU daemon


class TransportFactory(Protocol):
    """Called once per configured host (``hosts[].transport``) and again when it changes."""

    def __call__(self, address: str, tls: TLSConfig,
                 options: dict[str, Any] | None = None) -> grpc.aio.Channel: ...


# ================================================================================================
# scheduler: operator placement. The robot daemon asks the configured scheduler where each call
# of a verified sequence runs before defining it (``rrtod.partition``): the robot runs its share
# on the app's own tensors, the host the rest, and only values that cross the cut travel.


@runtime_checkable
class Scheduler(Protocol):
    def place(self, sequence: Sequence[Any], link: Any = None) -> list[str]:
        """Per call of ``sequence``, where it runs: ``"host"`` or ``"robot"``. The daemon passes
        a ``rrtod.partition.SequenceView`` (its ``calls``: operator, the calls each reads,
        bytes made, the group that must stay together, whether it may run on the robot; and
        per call the times measured so far on each side, ``host_ns`` and ``robot_ns``, and per
        placement tried the app's median latency, ``measured_ns``) and the link
        (``rrtod.robot.scheduling.LinkEstimate``: ``rtt_ms``, ``mbit_s``, measured). It asks
        again as measured times come in, and for each bandwidth band the link enters (its
        ``mbit_s`` then in that band; ``measured_ns`` None outside the sequence's first band);
        a changed answer becomes a new plan of the sequence, switched to per band.
        A placement that could change a result (``rrtod.partition.split``) is refused: the
        sequence then runs as it did. A scheduler with ``parallel = True`` may also answer
        ``"split"`` for the calls of a split region (robot and host each compute a band of
        their rows, Hybrid-Parallel: ``rrtod.lop``; its view's ``space`` names the regions)
        by returning a ``rrtod.partition.Hybrid``, which carries the robot's share."""
        ...


class SchedulerFactory(Protocol):
    def __call__(self) -> Scheduler: ...


# ================================================================================================
# host balancer (robot daemon): which GPU daemon a new app session goes to, and which one each
# replayed inference is placed on


class HostView(Protocol):
    """A host as a balancer sees it (the robot daemon's ``HostLink``). Read-only for balancers."""

    name: str  # unique among the robot daemon's hosts; stable across reloads and reconnects
    up: bool
    rtt_ms: float | None  # median measured round trip; None before the first ping
    sessions: int  # app sessions open on it from this robot
    inflight: int  # replayed inferences this robot daemon has in flight on it now


@dataclass(frozen=True)
class Job:
    """One replayed inference to place."""

    key: str  # what it runs: "<app>/<sequence id>"; latency estimates are per key


@runtime_checkable
class HostBalancer(Protocol):
    """Built by the family's factory at start and when a reload changes ``balancer`` or its
    ``balancers`` block. Every method runs on the daemon's event loop: it must not block, and
    should cost O(len(hosts)). Derive from ``BalancerBase`` to get ``place``/``observe``/
    ``close`` (and options handling) for free."""

    def choose(self, hosts: Sequence[HostView]) -> HostView | None:
        """The host of a new app session: one of ``hosts`` (every host, configuration order)
        that is up, or None when none is."""
        ...

    def place(self, hosts: Sequence[HostView], job: Job) -> HostView | None:
        """The host of one replayed inference: one of ``hosts`` (the up hosts holding its
        sequence, primary first; never empty)."""
        ...

    def observe(self, host: HostView, job: Job, seconds: float | None) -> None:
        """The outcome of a ``place``: its latency (start sent -> last output back), or None
        when it failed (error, host lost, deadline missed). May come for a job this object did
        not place (one placed before a reload): tolerate it."""
        ...

    def close(self) -> None:
        """Persist what was learned (under the factory's ``state_dir``); called when a reload
        replaces the balancer, and at stop. The object may still be called afterwards (late
        outcomes)."""
        ...


class BalancerOptions(BaseModel):
    """Base of a balancer's options model: unknown options are errors, values are immutable,
    and a YAML boolean is not taken for a number (``alpha: yes``). The daemon reports a
    ``ValidationError`` raised from a factory as ``FILE: balancers.NAME.OPTION: reason``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: Any) -> Any:
        """pydantic takes ``True`` for 1 (YAML ``yes``): refused where a number is expected."""
        if not isinstance(data, Mapping):
            return data
        for key, value in data.items():
            field_info = cls.model_fields.get(key) if isinstance(key, str) else None
            kind = str(field_info.annotation) if field_info is not None else "bool"
            if "bool" in kind or not ("int" in kind or "float" in kind):
                continue
            values = value if isinstance(value, list | tuple) else [value]
            if any(isinstance(v, bool) for v in values):
                raise ValueError(f"{key}: expected a number, got {value!r}")
        return data


class BalancerBase:
    """The defaults of ``HostBalancer``, so a balancer need only write ``choose``: ``place``
    chooses among the given hosts, ``observe`` and ``close`` do nothing. The class itself is a
    ``BalancerFactory``: set ``Options`` to a ``BalancerOptions`` subclass and read
    ``self.options``; ``self.state_dir`` is where to keep state (create it when first
    writing)."""

    Options: ClassVar[type[BalancerOptions]] = BalancerOptions  # no options

    def __init__(self, options: Mapping[str, Any] | None = None, state_dir: Path | None = None,
                 /) -> None:
        self.options: Any = self.Options.model_validate(dict(options or {}))
        self.state_dir = state_dir

    def choose(self, hosts: Sequence[HostView]) -> HostView | None:
        raise NotImplementedError(f"{type(self).__name__}.choose()")

    def place(self, hosts: Sequence[HostView], job: Job) -> HostView | None:
        return self.choose(hosts)

    def observe(self, host: HostView, job: Job, seconds: float | None) -> None:
        """Ignored: a balancer that does not learn."""

    def close(self) -> None:
        """Nothing to persist."""


class BalancerFactory(Protocol):
    """Called with the balancer's block of ``balancers`` (``{}`` when there is none) and
    ``state_dir/balancers`` (not created: create it when writing), at start, at reload, and
    to validate the options (``rrtod --check-config``: that object is dropped, never closed).
    Raise ``pydantic.ValidationError`` (``BalancerOptions.model_validate``) or ``ValueError``
    for bad options."""

    def __call__(self, options: Mapping[str, Any], state_dir: Path, /) -> HostBalancer: ...


# ================================================================================================
# power meter (robot daemon): the robot's energy, for energy per inference

POWER_STATES: tuple[str, ...] = ("inference", "communication", "standby")
"""What the machine can be doing (``PowerMeter.set_state``), in rank order."""


@runtime_checkable
class PowerMeter(Protocol):
    """A source of cumulative joules. Capabilities are attributes, so the accountant reads them
    instead of probing; ``MeterBase`` gives the defaults."""

    blocking: bool  # read() may take more than microseconds: it is called in a worker thread
    follows_state: bool  # an estimator whose power follows set_state: sampled at each change
    read_ns: int | None  # CLOCK_MONOTONIC ns the last read() is for, if the meter knows

    def read(self) -> float:
        """Joules since the meter was built; never decreasing (counter wraps and resets are
        the meter's business, it alone knows the counter's range)."""
        ...

    def set_state(self, state: str) -> None:
        """The machine's state (one of POWER_STATES) changed now."""
        ...

    def track(self, pid: int) -> None:
        """An app process whose CPU time is robot work, until ``untrack``."""
        ...

    def untrack(self, pid: int) -> None: ...

    def describe(self) -> dict[str, Any]:
        """What the meter reads, for ``rrtoctl status`` and logs."""
        ...


class MeterBase:
    """The defaults of ``PowerMeter``: a measuring meter whose ``read()`` is cheap and which
    needs no state or processes. Override what differs; ``read`` is required."""

    blocking: bool = False
    follows_state: bool = False
    read_ns: int | None = None

    def read(self) -> float:
        raise NotImplementedError(f"{type(self).__name__}.read()")

    def set_state(self, state: str) -> None:
        """Ignored: a measuring meter sees what the machine does."""

    def track(self, pid: int) -> None:
        """Ignored: a measuring meter sees every process's work."""

    def untrack(self, pid: int) -> None:
        """Ignored, as ``track``."""

    def describe(self) -> dict[str, Any]:
        return {"kind": type(self).__name__}


class PowerMeterFactory(Protocol):
    """Called with the ``power`` config section (``rrtod.config.PowerConfig``) when
    ``power.meter`` selects the record (or ``auto`` does, after ``probe()``)."""

    def __call__(self, config: PowerConfig | None, /) -> PowerMeter: ...


# ================================================================================================
# records

F = TypeVar("F")


@dataclass(frozen=True)
class PluginRecord(Generic[F]):
    """A named, configurable implementation in one family. ``factory`` is the family's factory
    Protocol (``SearchFactory``, ``TransportFactory``, ...); the daemon calls it as declared."""

    name: str
    factory: F
    description: str = ""


@dataclass(frozen=True)
class InterceptionBackend(PluginRecord[InterceptorFactory]):
    """Client side (``factory``: the shim's interceptor, built in the app process) and host side
    (``executor``: runs forwarded operators on the GPU daemon; None: client only)."""

    executor: ExecutorFactory | None = None
    # The operators its executor admits by default (``rrtoctl ops``); None: it does not say.
    operators: Callable[[], list[OperatorInfo]] | None = None
    # The versions of what it intercepts, as this process runs them (e.g. {"torch":
    # "2.13.0+cpu"}): the shim sends the app's in its hello, the host reports its own, so a
    # session whose two ends run different versions is visible (``rrtoctl status``).
    versions: Callable[[], dict[str, str]] | None = None
    # What a recorded call writes in place and what its outputs view (``rrtod.partition``'s
    # ``Written`` and ``Viewed``, None for an operator it does not know): the robot daemon
    # splits sequences by storage with them. None: its sequences are never split.
    aliasing: Callable[[], tuple[Any, Any]] | None = None
    # Which recorded calls are local operators, whose output rows each read a band of their
    # input rows (``rrtod.lop.RuleOf``): the robot daemon splits such calls between robot and
    # host by rows with it (Hybrid-Parallel). None: no call is ever split so.
    rows: Callable[[], Any] | None = None


@dataclass(frozen=True)
class PowerMeterRecord(PluginRecord[PowerMeterFactory]):
    """``probe()`` returns None when the meter can run here, else the reason it cannot (for an
    operator; no lasting side effects). ``priority``: ``power: auto`` picks the available meter
    with the highest value (built-ins: jetson 40, rapl 30, nvml 20, model 0)."""

    probe: Callable[[], str | None] = field(default=lambda: None)
    priority: int = 0


# ================================================================================================
# hooks


class Specs:
    """Hook specifications: one per plugin family, each returning a list of records."""

    @hookspec
    def rrto_interception_backends(self) -> list[InterceptionBackend]:
        """Operator interception for an app framework, picked by ``intercept.backend`` (shim)
        and ``executor.backend`` (GPU daemon). ``factory(channel, mode=, fallback=, replay=, deadline_ms=)``
        -> ``Interceptor``; ``executor(ctx)`` -> ``Executor``.

        Example, a backend whose host executor only counts calls::

            >>> from pathlib import Path
            >>> from rrto.v1 import ops_pb2
            >>> from rrtod.hookspecs import (Executor, ExecutorContext, ExecutorFactory,
            ...     InterceptionBackend, InterceptorFactory, hookimpl, problems)
            >>> class CountingInterceptor:
            ...     def __init__(self, channel):
            ...         self.channel = channel  # a real one installs framework hooks here
            ...     def uninstall(self):
            ...         self.channel.close()
            ...     def stats(self):
            ...         return {}
            >>> def make_interceptor(channel, *, mode, fallback, replay, deadline_ms):
            ...     return CountingInterceptor(channel)
            >>> class CountingExecutor:
            ...     replay = None        # no ReplayExtension: sequences replay through handle
            ...     reply_memory = None  # queued replies are not counted against memory
            ...     def __init__(self, ctx):
            ...         self.ops = 0
            ...     def open(self, request):
            ...         return ops_pb2.SessionReady(device="none")
            ...     def handle(self, frame):
            ...         self.ops += frame.WhichOneof("msg") == "call"
            ...         return ()
            ...     def stats(self):
            ...         return {"ops": self.ops, "bytes_live": 0}
            ...     def close(self):
            ...         pass
            >>> @hookimpl
            ... def rrto_interception_backends():
            ...     return [InterceptionBackend("counting", make_interceptor,
            ...                                 "counts calls", executor=CountingExecutor)]
            >>> (record,) = rrto_interception_backends()
            >>> problems(record.factory, InterceptorFactory), problems(record.executor, ExecutorFactory)
            ([], [])
            >>> ctx = ExecutorContext("cpu", 1 << 20, (), (), blobs=None, state_dir=Path("."))
            >>> executor = record.executor(ctx)
            >>> list(executor.handle(ops_pb2.SessionUp(call=ops_pb2.OpCall(op="aten::relu"))))
            []
            >>> isinstance(executor, Executor), executor.stats()["ops"]
            (True, 1)
        """

    @hookspec
    def rrto_sequence_searches(self) -> list[PluginRecord[SearchFactory]]:
        """Sequence search over an op log, picked by ``search``. ``factory()`` ->
        ``SequenceSearch``, built for each app session.

        Example, propose the log's last block that repeats::

            >>> from types import SimpleNamespace as Call
            >>> from rrtod.hookspecs import Candidate, PluginRecord, SequenceSearch, hookimpl
            >>> class LastRepeat:
            ...     def candidates(self, log):
            ...         keys = [call.key for call in log]
            ...         for period in range(1, len(keys) // 2 + 1):
            ...             if keys[-period:] == keys[-2 * period:-period]:
            ...                 yield Candidate(start=len(keys) - 2 * period, period=period)
            >>> @hookimpl
            ... def rrto_sequence_searches():
            ...     return [PluginRecord("last-repeat", LastRepeat, "the last repeated block")]
            >>> search = rrto_sequence_searches()[0].factory()
            >>> isinstance(search, SequenceSearch)
            True
            >>> list(search.candidates([Call(key=k) for k in (7, 1, 2, 3, 1, 2, 3)]))
            [Candidate(start=1, period=3)]
        """

    @hookspec
    def rrto_transports(self) -> list[PluginRecord[TransportFactory]]:
        """Peer links, picked by ``hosts[].transport``. ``factory(address, tls, options=None)``
        -> ``grpc.aio.Channel`` to a GPU daemon (lazy: it connects on first use).

        Example, plaintext to GPU daemons on this machine only::

            >>> import grpc
            >>> from rrtod.hookspecs import PluginRecord, TransportFactory, hookimpl, problems
            >>> def open_local(address, tls, options=None):
            ...     if not address.startswith("unix:"):
            ...         raise ValueError(f"{address}: the local transport takes unix: addresses")
            ...     return grpc.aio.insecure_channel(address, options=list((options or {}).items()))
            >>> @hookimpl
            ... def rrto_transports():
            ...     return [PluginRecord("local", open_local, "GPU daemons on this machine")]
            >>> problems(rrto_transports()[0].factory, TransportFactory)
            []
        """

    @hookspec
    def rrto_schedulers(self) -> list[PluginRecord[SchedulerFactory]]:
        """Operator placement, picked by ``scheduler``. ``factory()`` -> ``Scheduler``: the
        robot daemon builds one at start and on a reload that changes ``scheduler``.

        Example::

            >>> from rrtod.hookspecs import PluginRecord, Scheduler, hookimpl
            >>> class FirstOnRobot:
            ...     def place(self, sequence, link=None):
            ...         return ["robot"] + ["host"] * (len(sequence) - 1) if sequence else []
            >>> @hookimpl
            ... def rrto_schedulers():
            ...     return [PluginRecord("first-on-robot", FirstOnRobot, "pre-processing stays")]
            >>> scheduler = rrto_schedulers()[0].factory()
            >>> isinstance(scheduler, Scheduler), scheduler.place(["conv", "relu", "linear"])
            (True, ['robot', 'host', 'host'])
        """

    @hookspec
    def rrto_host_balancers(self) -> list[PluginRecord[BalancerFactory]]:
        """Host choice for a new session (``choose``) and placement of each replayed inference
        (``place``, then ``observe`` of its latency), picked by ``balancer``; its options are
        ``balancers.<name>``. ``factory(options, state_dir)`` -> ``HostBalancer``, built at start
        and when a reload changes ``balancer`` or its block (the old one is closed first).

        Example, the nearest host that is up, with one option (``BalancerBase`` gives the class
        a factory's signature, options validation, and a ``place`` that calls ``choose``)::

            >>> from pathlib import Path
            >>> from types import SimpleNamespace as Host
            >>> from rrtod.hookspecs import (BalancerBase, BalancerFactory, BalancerOptions,
            ...     HostBalancer, Job, PluginRecord, hookimpl, problems)
            >>> class Nearest(BalancerBase):
            ...     class Options(BalancerOptions):
            ...         max_rtt_ms: float = 50.0  # farther hosts only when no other is up
            ...     def choose(self, hosts):
            ...         up = [h for h in hosts if h.up]
            ...         near = [h for h in up if (h.rtt_ms or 0.0) <= self.options.max_rtt_ms]
            ...         return min(near or up, key=lambda h: h.rtt_ms or float("inf"), default=None)
            >>> @hookimpl
            ... def rrto_host_balancers():
            ...     return [PluginRecord("nearest", Nearest, "lowest RTT that is up")]
            >>> (record,) = rrto_host_balancers()
            >>> problems(record.factory, BalancerFactory)
            []
            >>> balancer = record.factory({"max_rtt_ms": 10}, Path("/var/lib/rrto/balancers"))
            >>> hosts = [Host(name="a", up=True, rtt_ms=4.0, sessions=0, inflight=2),
            ...          Host(name="b", up=True, rtt_ms=1.5, sessions=3, inflight=0),
            ...          Host(name="c", up=False, rtt_ms=0.5, sessions=0, inflight=0)]
            >>> isinstance(balancer, HostBalancer), balancer.choose(hosts).name
            (True, 'b')
            >>> job = Job("camera/s1")
            >>> balancer.place(hosts[:2], job).name, balancer.observe(hosts[1], job, 0.004)
            ('b', None)
            >>> from pydantic import ValidationError
            >>> try:
            ...     record.factory({"max_rtt": 10}, Path("."))
            ... except ValidationError as exc:  # rrtod: "balancers.nearest.max_rtt: unknown key"
            ...     print(exc.errors()[0]["type"], exc.errors()[0]["loc"])
            extra_forbidden ('max_rtt',)
        """

    @hookspec
    def rrto_power_meters(self) -> list[PowerMeterRecord]:
        """Energy sources, picked by ``power.meter`` (a name, ``a+b``, or ``auto``).
        ``factory(power_config)`` -> ``PowerMeter``.

        Example, a fixed power (derive from ``MeterBase`` for the optional members)::

            >>> import time
            >>> from rrtod.hookspecs import MeterBase, PowerMeter, PowerMeterRecord, hookimpl
            >>> class Constant(MeterBase):
            ...     def __init__(self, watts):
            ...         self.watts, self.start = watts, time.monotonic()
            ...     def read(self):
            ...         return self.watts * (time.monotonic() - self.start)
            >>> @hookimpl
            ... def rrto_power_meters():
            ...     return [PowerMeterRecord("constant", lambda config: Constant(10.0),
            ...                              "fixed 10 W", probe=lambda: None, priority=-10)]
            >>> meter = rrto_power_meters()[0].factory(None)
            >>> isinstance(meter, PowerMeter), meter.blocking, meter.read() >= 0
            (True, False, True)
        """


# Family name (as shown by ``rrtoctl plugins`` and used in errors) -> hook name.
FAMILIES: dict[str, str] = {
    "interception": "rrto_interception_backends",
    "search": "rrto_sequence_searches",
    "transport": "rrto_transports",
    "scheduler": "rrto_schedulers",
    "balancer": "rrto_host_balancers",
    "power": "rrto_power_meters",
}

# Family -> the Protocol of its records' ``factory``, and of what that builds (a transport
# builds a ``grpc.aio.Channel``; an interception backend's ``executor`` builds an ``Executor``).
FACTORIES: dict[str, type] = {
    "interception": InterceptorFactory,
    "search": SearchFactory,
    "transport": TransportFactory,
    "scheduler": SchedulerFactory,
    "balancer": BalancerFactory,
    "power": PowerMeterFactory,
}
BUILDS: dict[str, type] = {
    "interception": Interceptor,
    "search": SequenceSearch,
    "scheduler": Scheduler,
    "balancer": HostBalancer,
    "power": PowerMeter,
}


# ================================================================================================
# conformance


def _members(protocol: type) -> dict[str, Any]:
    """A Protocol's members: attribute name -> None, method name -> its function."""
    out: dict[str, Any] = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object, Generic) or klass.__module__ == "typing":
            continue
        out.update(dict.fromkeys(klass.__dict__.get("__annotations__", {})))
        out.update({name: value for name, value in klass.__dict__.items()
                    if inspect.isfunction(value) and (name == "__call__" or name[0] != "_")})
    return out


def _callable_as(fn: Any, spec: Callable[..., Any]) -> str | None:
    """Why ``fn`` cannot be called as ``spec`` (a Protocol method, ``self`` first) is called:
    with every parameter, and with only those without a default. None: it can."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # no signature to read (a builtin): cannot tell, so no complaint
    params = list(inspect.signature(spec).parameters.values())[1:]
    for subset in (params, [p for p in params if p.default is inspect.Parameter.empty]):
        args = [p.name for p in subset if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        kwargs = {p.name: p.name for p in subset if p.kind is inspect.Parameter.KEYWORD_ONLY}
        try:
            sig.bind(*args, **kwargs)
        except TypeError as exc:
            called = ", ".join([*args, *(f"{k}=" for k in kwargs)])
            return f"cannot be called as ({called}): {exc}"
    return None


def problems(obj: object, protocol: type) -> list[str]:
    """What keeps ``obj`` from satisfying ``protocol`` (one of this module's Protocols): members
    it lacks, and methods (``__call__`` for a factory) that cannot be called the way the daemon
    calls them. Empty when it conforms. For plugin tests; the daemon does not call it.

        >>> problems(lambda: None, SearchFactory)
        []
        >>> problems(lambda config: None, SearchFactory)
        ["__call__ cannot be called as (): missing a required argument: 'config'"]
    """
    found = []
    for name, spec in _members(protocol).items():
        if name == "__call__":
            target: Any = obj if callable(obj) else None
        else:
            target = getattr(obj, name, _MISSING)
        if target is _MISSING or (name == "__call__" and target is None):
            found.append(f"no {name}")
            continue
        if spec is not None:
            if not callable(target):
                found.append(f"{name} is not callable")
                continue
            why = _callable_as(target, spec)
            if why is not None:
                found.append(f"{name} {why}")
    return found


_MISSING = object()
