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

Three modules, one job each: ``rrtod.robot.meters`` chooses the meter, ``rrtod.robot.energy_ledger``
splits the joules, ``rrtod.robot.energy_metrics`` exports them; this one reads the meter and
feeds the ledger, under one lock (the Prometheus exporter reads from its own thread).

Sampling is off the hot path: ``run()`` reads the meter ``sample_hz`` times a second (in a worker
thread for meters that declare ``blocking``, e.g. NVML; sysfs reads take microseconds) and
keeps a bounded series of (time, cumulative joules). ``set_state`` and ``inference`` only record
a timestamped event; the arithmetic happens when a sample arrives.

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
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from rrtod.hookspecs import PowerMeter
from rrtod.robot.energy_ledger import (
    FUTURE_SLACK_NS,
    HISTORY_S,
    KEEP_CLOSED,
    STATES,
    Ledger,
    machine_state,
)
from rrtod.robot.energy_metrics import EnergyCollector
from rrtod.robot.meters import MeterError, SumMeter, select_meter

__all__ = ["STATES", "KEEP_CLOSED", "EnergyAccountant", "MeterError", "SumMeter",
           "machine_state", "select_meter"]

log = structlog.get_logger("rrtod.energy")


class EnergyAccountant:
    """Energy per session, per state and per inference from one meter. Thread-safe."""

    def __init__(
        self,
        meter_name: str,
        meter: PowerMeter,
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
        self._ledger = Ledger(int(history_s * sample_hz))
        self._read_errors = 0
        # An estimating meter's power only changes when the state does: a sample at each change
        # makes the split by state exact (and costs no I/O). Measuring meters are split pro rata
        # within a sample interval instead: reading sysfs on the daemon's hot path is not worth it.
        self._sample_on_change = meter.follows_state and not meter.blocking

    # ---- events from the daemon -------------------------------------------------------------

    def _feed_meter(self) -> None:
        if not self.meter.follows_state:
            return
        try:
            self.meter.set_state(machine_state(self._ledger.open_states()))
            if self._sample_on_change:
                self.sample()
        except Exception as exc:  # never let accounting fail the daemon's session code
            log.warning("power meter update failed", meter=self.meter_name, error=repr(exc))

    def set_state(self, session: str, state: str) -> None:
        """Session ``session`` is now doing ``state`` ("inference" | "communication" |
        "standby"). Opens the session if it is new; feeds a meter that follows the state."""
        if state not in STATES:
            raise ValueError(f"unknown state {state!r} (expected {', '.join(STATES)})")
        with self._lock:
            # Unchanged (the common case when called per relayed frame): nothing to record.
            if self._ledger.set_state(session, state, self._clock()):
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
            self._ledger.inference(session, index, start_ns, end_ns, now)

    def close_session(self, session: str) -> None:
        """The session ended. Its figures stay readable (the last KEEP_CLOSED closed sessions)."""
        with self._lock:
            sess = self._ledger.close(session, self._clock())
            if sess is None:
                return
            if sess.pid is not None:
                self.meter.untrack(sess.pid)
            self._feed_meter()

    def track_process(self, session: str, pid: int) -> None:
        """Optional: the app process behind ``session`` (its SO_PEERCRED pid), so the model
        meter counts its CPU time as robot work (until ``close_session``). Opens the session if
        it is new. Measuring meters ignore it: they see all CPU work anyway."""
        with self._lock:
            sess = self._ledger.sessions.get(session) or self._ledger.session(session,
                                                                                self._clock())
            if sess.pid is not None or sess.closed_ns is not None:
                return
            sess.pid = pid
            self.meter.track(pid)

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
        at = self.meter.read_ns
        if at is not None and before <= at <= after:
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
            if not self.meter.blocking:
                try:
                    self.sample()  # close the books at shutdown
                except Exception:
                    pass
            raise

    async def _sample_once(self) -> None:
        try:
            if self.meter.blocking:
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
            self._ledger.ingest(t_ns, joules, self.meter_name)

    # ---- reading --------------------------------------------------------------------------------

    @property
    def total_j(self) -> float:
        with self._lock:
            return self._ledger.total_j

    def power_w(self) -> float | None:
        """Mean power over the last second of samples (at least one interval)."""
        with self._lock:
            return self._ledger.power_w()

    def describe(self) -> dict[str, Any]:
        """JSON-able state for ``rrtoctl status`` and the benchmark harness."""
        with self._lock:
            ledger = self._ledger
            return {
                "meter": self.meter_name,
                "meter_info": self.meter.describe(),
                "sample_hz": self.sample_hz,
                "samples": ledger.samples,
                "power_w": ledger.power_w(),
                "total_j": ledger.total_j,
                "unattributed_j": ledger.unattributed_j,
                "read_errors": self._read_errors,
                "sessions": {name: s.summary() for name, s in ledger.sessions.items()},
            }

    def register_metrics(self, registry: Any) -> None:
        """Export to a prometheus_client ``CollectorRegistry`` (``rrtod.robot.energy_metrics``)."""
        registry.register(EnergyCollector(self.describe))

    def collect(self) -> Iterator[Any]:
        """The same metric families, for a daemon-wide collector that yields from ours."""
        return EnergyCollector(self.describe).collect()
