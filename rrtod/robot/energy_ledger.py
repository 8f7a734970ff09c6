"""Who pays for each joule: the robot's energy split over sessions, states and inferences.

Pure arithmetic over two inputs, both timestamped in CLOCK_MONOTONIC nanoseconds: samples of the
meter's cumulative joules (``ingest``) and what the sessions do (``set_state``, ``inference``,
``close``). It reads no meter and takes no lock: ``rrtod.robot.energy.EnergyAccountant`` feeds it
under its own lock. The rules (see that module for what the figures mean):

- energy in a sample interval is split at each state change inside it, pro rata in time;
- each piece is shared equally among the sessions that were busy (inference or communication),
  or among all open sessions when every one stood by; with none open it is unattributed;
- an inference's energy is the machine's between its start and end, interpolated on the
  cumulative series, once a sample at or after its end exists.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import structlog

from rrtod.hookspecs import POWER_STATES

log = structlog.get_logger("rrtod.energy")

STATES = POWER_STATES
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


class Ledger:
    """Sessions, their state changes and inference marks, and the cumulative-energy series.
    Not thread-safe: its owner serialises calls."""

    def __init__(self, max_samples: int):
        self._samples: deque[tuple[int, float]] = deque(maxlen=max(2, max_samples))
        self._events: deque[tuple[int, _Session, str | None]] = deque()  # not yet applied
        self._active: dict[_Session, str] = {}  # state in effect at the last sample
        self.sessions: dict[str, _Session] = {}
        self._pending: list[_Mark] = []
        self._first_j: float | None = None
        self._offset = 0.0  # keeps the series monotonic if a meter ever goes backwards
        self.unattributed_j = 0.0

    # ---- what the sessions do ------------------------------------------------------------------

    def session(self, name: str, now: int) -> _Session:
        """The open session ``name``; a new one if there is none (or it was closed)."""
        sess = self.sessions.get(name)
        if sess is None or sess.closed_ns is not None:
            # New, or an id used again after close: a fresh record (the old one is replaced).
            sess = _Session(name, now)
            self.sessions[name] = sess
            self._events.append((now, sess, "standby"))
        return sess

    def open_states(self) -> list[str]:
        return [s.state for s in self.sessions.values() if s.closed_ns is None]

    def set_state(self, name: str, state: str, now: int) -> bool:
        """True when the session's state changed (opening it if new)."""
        sess = self.session(name, now)
        if sess.state == state:
            return False
        sess.state = state
        self._events.append((now, sess, state))
        return True

    def inference(self, name: str, index: int, start_ns: int, end_ns: int, now: int) -> None:
        # A mark that arrives after close still belongs to the closed session.
        sess = self.sessions.get(name) or self.session(name, now)
        if len(self._pending) >= MAX_PENDING:
            dropped = self._pending.pop(0)
            dropped.session.pending -= 1
            log.warning("too many inference marks waiting for samples; oldest dropped",
                        session=dropped.session.name, index=dropped.index)
        self._pending.append(_Mark(sess, index, start_ns, end_ns))
        sess.pending += 1
        self._resolve()

    def close(self, name: str, now: int) -> _Session | None:
        """Close the session; the closed record, or None when there was no open one."""
        sess = self.sessions.get(name)
        if sess is None or sess.closed_ns is not None:
            return None
        sess.closed_ns = now
        self._events.append((now, sess, None))
        return sess

    # ---- samples -------------------------------------------------------------------------------

    def ingest(self, t_ns: int, joules: float, meter: str) -> None:
        """Add one sample (cumulative joules at ``t_ns``) and account for the interval since the
        previous one. ``meter`` names it in warnings."""
        if self._samples and t_ns <= self._samples[-1][0]:
            return
        value = joules + self._offset
        if self._samples and value < self._samples[-1][1]:
            log.warning("power meter went backwards; rebased", meter=meter)
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
            self.unattributed_j += energy
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
        closed = [s for s in self.sessions.values()
                  if s.closed_ns is not None and s not in self._active and not s.pending]
        closed.sort(key=lambda s: s.closed_ns or 0)
        for sess in closed[: max(0, len(closed) - KEEP_CLOSED)]:
            if self.sessions.get(sess.name) is sess:
                del self.sessions[sess.name]

    # ---- reading -------------------------------------------------------------------------------

    @property
    def samples(self) -> int:
        return len(self._samples)

    @property
    def total_j(self) -> float:
        if not self._samples or self._first_j is None:
            return 0.0
        return self._samples[-1][1] - self._first_j

    def power_w(self) -> float | None:
        """Mean power over the last second of samples (at least one interval): single intervals
        can be microseconds long (samples at state changes) and so noisy."""
        if len(self._samples) < 2:
            return None
        t1, j1 = self._samples[-1]
        i = bisect.bisect_right(self._samples, t1 - 10**9, key=itemgetter(0))
        t0, j0 = self._samples[min(max(i - 1, 0), len(self._samples) - 2)]
        return (j1 - j0) / ((t1 - t0) / 1e9)
