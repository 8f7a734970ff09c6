"""The robot daemon's energy accountant: samples a power meter, attributes joules to sessions and
inferences.

How the daemon uses it::

    name, meter = select_meter(registry, config.power)      # at start and on reload
    acct = EnergyAccountant(name, meter, config.power.sample_hz)
    acct.register_metrics(prometheus_registry)
    task = asyncio.create_task(acct.run())                   # cancel it at shutdown
    acct.track_process(sid, pid)                             # optional: app pid (SO_PEERCRED)
    acct.set_state(sid, "communication")                     # as a session's activity changes
    acct.inference(sid, mark.index, mark.start_ns, mark.end_ns)   # each InferenceMark
    acct.close_session(sid)                                  # when the app disconnects
    acct.describe()                                          # rrtoctl status / bench

Sampling is off the hot path: ``run()`` reads the meter ``sample_hz`` times a second (in a worker
thread only for meters that declare ``blocking``, e.g. NVML; sysfs reads take microseconds) and
keeps a bounded series of (time, cumulative joules). ``set_state`` and ``inference`` only record
a timestamped event under a lock; the arithmetic happens when a sample arrives.

What the numbers mean, because several sessions may share one machine:

- ``total_j``: what the meter measured since the accountant started; the machine's energy.
- a session's ``energy_by_state_j``: its share of the machine's energy while it was open, split
  by the state it was in. Energy in an interval is shared equally among the sessions that were
  busy (inference or communication); when every open session stood by, among all of them. So
  the sessions' energies add up to the machine's energy while any session was open, never more.
- a session's ``mean_power_w``: the machine's mean power while the session was open.
- ``energy_per_inference_j``: the machine's energy between an inference's start and end (the
  RRTO paper's measure), interpolated on the cumulative-energy series, averaged over the
  session's inferences. Inferences of different sessions that overlap each see the whole
  machine's energy: the figure answers "what did the robot spend while this inference ran".

Times are CLOCK_MONOTONIC nanoseconds, the clock the shim stamps ``InferenceMark`` with, so marks
from the app process and samples in the daemon are comparable without conversion.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import structlog

from rrtod.plugins import PluginError

log = structlog.get_logger("rrtod.energy")

STATES: tuple[str, ...] = ("inference", "communication", "standby")
"""What a session can be doing, in rank order: a machine whose sessions differ is in the
highest-ranked state any of them is in."""

HISTORY_S = 600.0  # seconds of samples kept: marks older than this are extrapolated
KEEP_CLOSED = 64  # closed sessions kept for describe()/metrics, so a finished run can be read
MAX_PENDING = 4096  # inference marks waiting for a sample past their end
FUTURE_SLACK_NS = 10 * 10**9  # a mark ending further ahead than this is from another clock


def machine_state(states: Iterable[str]) -> str:
    """The machine's state given its sessions' states: the highest-ranked, else standby."""
    present = set(states)
    return next((s for s in STATES if s in present), "standby")


class MeterError(PluginError):
    """The configured power meter cannot be used: unknown, unavailable here, or failed to start."""


# --------------------------------------------------------------------------------------------
# Meter selection


def _probe(record: Any) -> str | None:
    try:
        return record.probe()
    except Exception as exc:  # a third-party probe that raises is a reason, not a crash
        return f"probe failed: {exc!r}"


def _build(record: Any, power_config: Any) -> Any:
    reason = _probe(record)
    if reason:
        raise MeterError(f"power meter {record.name!r} is unavailable here: {reason}")
    try:
        meter = record.factory(power_config)
    except Exception as exc:
        raise MeterError(f"power meter {record.name!r} failed to start: {exc}") from exc
    if not callable(getattr(meter, "read", None)):
        raise MeterError(f"power meter {record.name!r} built {type(meter).__name__}, "
                         "which has no read()")
    return meter


class SumMeter:
    """Several meters read as one (``power.meter: rapl+nvml`` on an x86 robot with a discrete
    GPU: CPU package and DRAM plus the GPU board, which do not overlap)."""

    def __init__(self, meters: dict[str, Any]):
        self.meters = meters
        self.blocking = any(getattr(m, "blocking", False) for m in meters.values())

    def read(self) -> float:
        return sum(m.read() for m in self.meters.values())

    def _each(self, method: str, *args: Any) -> None:
        for m in self.meters.values():
            if callable(getattr(m, method, None)):
                getattr(m, method)(*args)

    def set_state(self, state: str) -> None:
        self._each("set_state", state)

    def track(self, pid: int) -> None:
        self._each("track", pid)

    def untrack(self, pid: int) -> None:
        self._each("untrack", pid)

    def describe(self) -> dict[str, Any]:
        return {"kind": "sum", "meters": {n: _meter_info(m) for n, m in self.meters.items()}}


def _meter_info(meter: Any) -> dict[str, Any]:
    describe = getattr(meter, "describe", None)
    return describe() if callable(describe) else {"kind": type(meter).__name__}


def select_meter(registry: Any, power_config: Any) -> tuple[str, Any]:
    """Build the meter ``power_config.meter`` names; returns ``(name, meter)``.

    - ``auto``: the available meter with the highest ``priority`` (ties by name), logging why
      each better one was skipped. The built-in ``model`` meter is always available, so auto
      only fails when plugins were disabled.
    - a name: that meter; MeterError (a PluginError) when it is not installed, its probe gives a
      reason, or its factory fails. An explicit choice never falls back silently: the operator
      asked for that sensor, and numbers from another would be mislabelled.
    - ``a+b``: each named meter, summed (see SumMeter).

    ``registry`` is an ``rrtod.plugins.Registry`` (``records``/``get`` by family ``power``);
    each record's ``factory`` is called with ``power_config``.
    """
    wanted = str(power_config.meter).strip()
    if wanted != "auto":
        names = [n.strip() for n in wanted.split("+")]
        if not all(names):
            raise MeterError(f"power.meter: malformed meter name {wanted!r}")
        meters = {}
        for name in names:
            try:
                record = registry.get("power", name)
            except PluginError as exc:
                raise MeterError(f"power.meter: {exc}") from None
            meters[name] = _build(record, power_config)
        if len(meters) == 1:
            return names[0], meters[names[0]]
        return "+".join(names), SumMeter(meters)

    skipped: list[str] = []
    for record in sorted(registry.records("power"), key=lambda r: (-r.priority, r.name)):
        try:
            meter = _build(record, power_config)
        except MeterError as exc:
            skipped.append(str(exc))
            continue
        log.info("power meter selected", meter=record.name, skipped=skipped)
        return record.name, meter
    reasons = "; ".join(skipped) or "none installed"
    raise MeterError(f"power: auto found no usable meter: {reasons}")


# --------------------------------------------------------------------------------------------
# Accounting


@dataclass(eq=False)  # identity hashing: the object is the key while its session is open
class _Session:
    name: str
    opened_ns: int
    state: str = "standby"  # as last set (events may not be applied yet)
    closed_ns: int | None = None
    energy_by_state: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATES, 0.0))
    time_by_state_ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATES, 0))
    machine_j: float = 0.0  # the machine's energy while this session was open
    inferences: int = 0
    inference_j: float = 0.0
    inference_ns: int = 0
    last_inference_j: float | None = None
    pending: int = 0
    pid: int | None = None  # the app process, when the daemon told us (model meter CPU use)

    def summary(self) -> dict[str, Any]:
        open_ns = sum(self.time_by_state_ns.values())
        n = self.inferences
        return {
            "open": self.closed_ns is None,
            "state": self.state,
            "pid": self.pid,
            "inferences": self.inferences,
            "pending_inferences": self.pending,
            "energy_j": sum(self.energy_by_state.values()),
            "mean_power_w": self.machine_j / (open_ns / 1e9) if open_ns else None,
            "energy_per_inference_j": self.inference_j / n if n else None,
            "last_inference_j": self.last_inference_j,
            "mean_inference_s": self.inference_ns / 1e9 / n if n else None,
            "energy_by_state_j": dict(self.energy_by_state),
            "time_by_state_s": {s: ns / 1e9 for s, ns in self.time_by_state_ns.items()},
        }


@dataclass(frozen=True)
class _Mark:
    session: _Session
    index: int
    start_ns: int
    end_ns: int


class EnergyAccountant:
    """Energy per session, per state and per inference from one meter. Thread-safe: the
    Prometheus exporter reads it from its own thread."""

    def __init__(
        self,
        meter_name: str,
        meter: Any,
        sample_hz: float,
        clock: Callable[[], int] = time.monotonic_ns,
        history_s: float = HISTORY_S,
    ):
        if sample_hz <= 0:
            raise ValueError("sample_hz must be > 0")
        self.meter_name = meter_name
        self.meter = meter
        self.sample_hz = float(sample_hz)
        self._clock = clock
        self._lock = threading.RLock()
        self._samples: deque[tuple[int, float]] = deque(maxlen=max(2, int(history_s * sample_hz)))
        self._events: deque[tuple[int, _Session, str | None]] = deque()  # not yet applied
        self._active: dict[_Session, str] = {}  # state in effect at the last sample
        self._sessions: dict[str, _Session] = {}
        self._pending: list[_Mark] = []
        self._first_j: float | None = None
        self._offset = 0.0  # keeps the series monotonic if a meter ever goes backwards
        self._unattributed_j = 0.0
        self._read_errors = 0
        # An estimating meter's power only changes when the state does: a sample at each change
        # makes the split by state exact (and costs no I/O). Measuring meters are split pro rata
        # within a sample interval instead: reading sysfs on the daemon's hot path is not worth it.
        self._sample_on_change = callable(getattr(meter, "set_state", None)) and not getattr(
            meter, "blocking", False
        )

    # ---- events from the daemon -------------------------------------------------------------

    def _session(self, name: str, now: int) -> _Session:
        sess = self._sessions.get(name)
        if sess is None or sess.closed_ns is not None:
            # New, or an id used again after close: a fresh record (the old one is replaced).
            sess = _Session(name, now)
            self._sessions[name] = sess
            self._events.append((now, sess, "standby"))
        return sess

    def _feed_meter(self) -> None:
        set_state = getattr(self.meter, "set_state", None)
        if not callable(set_state):
            return
        open_states = (s.state for s in self._sessions.values() if s.closed_ns is None)
        try:
            set_state(machine_state(open_states))
            if self._sample_on_change:
                self.sample()
        except Exception as exc:  # never let accounting fail the daemon's session code
            log.warning("power meter update failed", meter=self.meter_name, error=repr(exc))

    def set_state(self, session: str, state: str) -> None:
        """Session ``session`` is now doing ``state`` ("inference" | "communication" |
        "standby"). Opens the session if it is new; feeds the model meter."""
        if state not in STATES:
            raise ValueError(f"unknown state {state!r} (expected {', '.join(STATES)})")
        with self._lock:
            now = self._clock()
            sess = self._session(session, now)
            if sess.state == state:
                return  # the common case when called per relayed frame: nothing to record
            sess.state = state
            self._events.append((now, sess, state))
            self._feed_meter()

    def inference(self, session: str, index: int, start_ns: int, end_ns: int) -> None:
        """One inference of ``session`` ran from ``start_ns`` to ``end_ns`` (CLOCK_MONOTONIC).
        Its energy is computed once a sample at or after ``end_ns`` exists."""
        if end_ns < start_ns:
            log.warning("inference mark ends before it starts, ignored",
                        session=session, index=index)
            return
        with self._lock:
            now = self._clock()
            if end_ns > now + FUTURE_SLACK_NS:
                log.warning("inference mark from the future (clock mismatch?), ignored",
                            session=session, index=index, end_ns=end_ns, now_ns=now)
                return
            # A mark that arrives after close_session still belongs to the closed session.
            sess = self._sessions.get(session) or self._session(session, now)
            if len(self._pending) >= MAX_PENDING:
                dropped = self._pending.pop(0)
                dropped.session.pending -= 1
                log.warning("too many inference marks waiting for samples; oldest dropped",
                            session=dropped.session.name, index=dropped.index)
            self._pending.append(_Mark(sess, index, start_ns, end_ns))
            sess.pending += 1
            self._resolve()

    def close_session(self, session: str) -> None:
        """The session ended. Its figures stay readable (the last KEEP_CLOSED closed sessions)."""
        with self._lock:
            sess = self._sessions.get(session)
            if sess is None or sess.closed_ns is not None:
                return
            now = self._clock()
            sess.closed_ns = now
            self._events.append((now, sess, None))
            untrack = getattr(self.meter, "untrack", None)
            if sess.pid is not None and callable(untrack):
                untrack(sess.pid)
            self._feed_meter()

    def track_process(self, session: str, pid: int) -> None:
        """Optional: the app process behind ``session`` (its SO_PEERCRED pid), so the model
        meter counts its CPU time as robot work (until ``close_session``). Opens the session if
        it is new. No-op for measuring meters, which see all CPU work anyway."""
        with self._lock:
            sess = self._sessions.get(session) or self._session(session, self._clock())
            if sess.pid is not None or sess.closed_ns is not None:
                return
            sess.pid = pid
            track = getattr(self.meter, "track", None)
            if callable(track):
                track(pid)

    # ---- sampling -----------------------------------------------------------------------------

    def sample(self) -> None:
        """Read the meter once, here (blocking meters included) and account. ``run()`` calls this
        machinery periodically; tests call it directly with an injected clock."""
        before = self._clock()
        joules = self.meter.read()
        self.ingest(self._stamp(before), joules)

    def _stamp(self, before: int) -> int:
        """When a reading that began at ``before`` was taken: the meter's own time if it says
        (``read_ns``: an estimator integrates up to the moment it reads its clock), else midway
        through the read. A stamp taken after the read misplaced the series by however long
        this thread was preempted meanwhile: up to a millisecond on a loaded machine, 10% of a
        3 ms inference's energy."""
        after = self._clock()
        at = getattr(self.meter, "read_ns", None)
        if isinstance(at, int) and before <= at <= after:
            return at
        return (before + after) // 2

    async def run(self) -> None:
        """Sample at ``sample_hz`` until cancelled. A failing read is logged and skipped: a
        flaky sensor must not take the daemon down."""
        loop = asyncio.get_running_loop()
        period = 1.0 / self.sample_hz
        deadline = loop.time()
        try:
            while True:
                await self._sample_once()
                deadline += period
                delay = deadline - loop.time()
                if delay < 0:  # fell behind (a slow read): skip the missed ticks
                    deadline, delay = loop.time(), 0.0
                await asyncio.sleep(delay)
        except asyncio.CancelledError:
            if not getattr(self.meter, "blocking", False):
                try:
                    self.sample()  # close the books at shutdown
                except Exception:
                    pass
            raise

    async def _sample_once(self) -> None:
        try:
            if getattr(self.meter, "blocking", False):
                before = self._clock()
                joules = await asyncio.to_thread(self.meter.read)
                stamp = (before + self._clock()) // 2
            else:
                before = self._clock()
                joules = self.meter.read()
                stamp = self._stamp(before)
        except Exception as exc:
            self._read_errors += 1
            if self._read_errors == 1 or self._read_errors % 100 == 0:
                log.warning("power meter read failed", meter=self.meter_name,
                            error=repr(exc), failures=self._read_errors)
            return
        try:
            self.ingest(stamp, joules)
        except Exception:  # a bug here must not end sampling for the daemon's lifetime
            log.exception("energy accounting failed", meter=self.meter_name)

    def ingest(self, t_ns: int, joules: float) -> None:
        """Add one sample (the meter's cumulative joules at ``t_ns``) and account for the interval
        since the previous one."""
        with self._lock:
            if self._samples and t_ns <= self._samples[-1][0]:
                return
            value = joules + self._offset
            if self._samples and value < self._samples[-1][1]:
                log.warning("power meter went backwards; rebased", meter=self.meter_name)
                self._offset += self._samples[-1][1] - value
                value = self._samples[-1][1]
            if not self._samples:
                self._first_j = value
                self._apply_events(t_ns)
            else:
                t0, j0 = self._samples[-1]
                self._account(t0, t_ns, value - j0)
            self._samples.append((t_ns, value))
            self._resolve()
            self._prune()

    def _apply(self, sess: _Session, state: str | None) -> None:
        if state is None:
            self._active.pop(sess, None)
        else:
            self._active[sess] = state

    def _apply_events(self, until_ns: int) -> None:
        while self._events and self._events[0][0] <= until_ns:
            _, sess, state = self._events.popleft()
            self._apply(sess, state)

    def _account(self, t0: int, t1: int, energy: float) -> None:
        """Split the interval at each state change inside it; charge each piece pro rata."""
        span = t1 - t0
        cursor = t0
        while self._events and self._events[0][0] <= t1:
            at, sess, state = self._events.popleft()
            at = max(at, cursor)
            if at > cursor:
                self._charge(at - cursor, energy * (at - cursor) / span)
                cursor = at
            self._apply(sess, state)
        if t1 > cursor:
            self._charge(t1 - cursor, energy * (t1 - cursor) / span)

    def _charge(self, duration_ns: int, energy: float) -> None:
        if not self._active:
            self._unattributed_j += energy
            return
        busy = [s for s, state in self._active.items() if state != "standby"]
        payers = busy or list(self._active)
        share = energy / len(payers)
        for sess, state in self._active.items():
            sess.machine_j += energy
            sess.time_by_state_ns[state] += duration_ns
        for sess in payers:
            sess.energy_by_state[self._active[sess]] += share

    def _energy_at(self, t_ns: int) -> float:
        """Cumulative joules at ``t_ns``, linear between samples, extrapolated at the ends with
        the nearest interval's power."""
        s = self._samples
        i = bisect.bisect_left(s, t_ns, key=itemgetter(0))
        i = min(max(i, 1), len(s) - 1)
        (ta, ja), (tb, jb) = s[i - 1], s[i]
        return ja + (jb - ja) * (t_ns - ta) / (tb - ta)

    def _resolve(self) -> None:
        if len(self._samples) < 2:
            return
        latest = self._samples[-1][0]
        waiting = []
        for mark in self._pending:
            if mark.end_ns > latest:
                waiting.append(mark)
                continue
            joules = max(0.0, self._energy_at(mark.end_ns) - self._energy_at(mark.start_ns))
            sess = mark.session
            sess.pending -= 1
            sess.inferences += 1
            sess.inference_j += joules
            sess.inference_ns += mark.end_ns - mark.start_ns
            sess.last_inference_j = joules
        self._pending = waiting

    def _prune(self) -> None:
        closed = [s for s in self._sessions.values()
                  if s.closed_ns is not None and s not in self._active and not s.pending]
        closed.sort(key=lambda s: s.closed_ns or 0)
        for sess in closed[: max(0, len(closed) - KEEP_CLOSED)]:
            if self._sessions.get(sess.name) is sess:
                del self._sessions[sess.name]

    # ---- reading --------------------------------------------------------------------------------

    @property
    def total_j(self) -> float:
        with self._lock:
            if not self._samples or self._first_j is None:
                return 0.0
            return self._samples[-1][1] - self._first_j

    def power_w(self) -> float | None:
        """Mean power over the last second of samples (at least one interval): single intervals
        can be microseconds long (samples at state changes) and so noisy."""
        with self._lock:
            if len(self._samples) < 2:
                return None
            t1, j1 = self._samples[-1]
            i = bisect.bisect_right(self._samples, t1 - 10**9, key=itemgetter(0))
            t0, j0 = self._samples[min(max(i - 1, 0), len(self._samples) - 2)]
            return (j1 - j0) / ((t1 - t0) / 1e9)

    def describe(self) -> dict[str, Any]:
        """JSON-able state for ``rrtoctl status`` and the benchmark harness."""
        with self._lock:
            return {
                "meter": self.meter_name,
                "meter_info": _meter_info(self.meter),
                "sample_hz": self.sample_hz,
                "samples": len(self._samples),
                "power_w": self.power_w(),
                "total_j": self.total_j,
                "unattributed_j": self._unattributed_j,
                "read_errors": self._read_errors,
                "sessions": {name: s.summary() for name, s in self._sessions.items()},
            }

    def register_metrics(self, registry: Any) -> None:
        """Export to a prometheus_client ``CollectorRegistry`` (values computed at scrape time,
        so closed sessions drop out as they are pruned):

        - ``rrto_power_watts{meter}``: power over the last sample interval
        - ``rrto_meter_energy_joules_total{meter}``: the machine's energy since start
        - ``rrto_energy_joules_total{session}``: a session's share (see the module docstring)
        - ``rrto_energy_state_joules_total{session,state}``: the same, by state
        - ``rrto_energy_inferences_total{session}``: inferences attributed
        - ``rrto_energy_per_inference_joules{session}``: mean energy per inference
        """
        registry.register(_Collector(self))

    def collect(self) -> Iterator[Any]:
        """The same metric families, for a daemon-wide collector that yields from ours."""
        return _Collector(self).collect()


class _Collector:
    def __init__(self, accountant: EnergyAccountant):
        self._acct = accountant

    def describe(self) -> Iterator[Any]:
        return iter(self._families())

    def collect(self) -> Iterator[Any]:
        families = self._families()
        power, meter_total, energy, by_state, count, per_inf = families
        snap = self._acct.describe()
        name = snap["meter"]
        if snap["power_w"] is not None:
            power.add_metric([name], snap["power_w"])
        meter_total.add_metric([name], snap["total_j"])
        for sid, s in snap["sessions"].items():
            energy.add_metric([sid], s["energy_j"])
            for state, joules in s["energy_by_state_j"].items():
                by_state.add_metric([sid, state], joules)
            count.add_metric([sid], s["inferences"])
            if s["energy_per_inference_j"] is not None:
                per_inf.add_metric([sid], s["energy_per_inference_j"])
        return iter(families)

    @staticmethod
    def _families() -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        return [
            GaugeMetricFamily("rrto_power_watts", "Power over the last sample interval",
                              labels=["meter"]),
            CounterMetricFamily("rrto_meter_energy_joules", "Energy measured since daemon start",
                                labels=["meter"]),
            CounterMetricFamily("rrto_energy_joules", "Energy attributed to a session",
                                labels=["session"]),
            CounterMetricFamily("rrto_energy_state_joules",
                                "Energy attributed to a session, by state",
                                labels=["session", "state"]),
            CounterMetricFamily("rrto_energy_inferences", "Inferences with attributed energy",
                                labels=["session"]),
            GaugeMetricFamily("rrto_energy_per_inference_joules",
                              "Mean machine energy per inference", labels=["session"]),
        ]
