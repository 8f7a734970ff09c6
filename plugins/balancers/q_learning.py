"""``q-learning``: RILaaS's adaptive load balancing, a tabular Q-learning agent per job key.

RILaaS (section V) assigns one agent per model; its state is, per server, the requests of that
model and of all models on it, its action the server a request goes to, its reward the negative
round-trip latency, learned online with epsilon-greedy exploration. Here, per job key
(``<app>/<sequence id>``):

- **state**: per host given to ``place`` (in name order, so a sequence whose primary differs
  still meets the same states), the bucket of ``inflight`` (the inferences this robot daemon
  has in flight on it: ``inflight_edges``) and the bucket of its recent latency for this key
  relative to the best host's (``latency_edges``, ratios >= 1; ``-`` before the first
  measurement). The recent latency is an EWMA (``latency_alpha``) of measurements, a failure
  counting as ``failure_penalty_s``.
- **action**: the host, by *name* (hosts come and go; an index would change meaning).
- **reward**: ``-latency`` in seconds (``reward: quadratic``: RILaaS's ``-(1 + latency)^2``),
  ``failure_penalty_s`` for a failure.
- **learning**: ``Q(s,a) += alpha * (r + gamma * max_a' Q(s',a') - Q(s,a))`` in ``observe``,
  where ``s`` is the state remembered when the inference was placed (pending placements are
  keyed by (job key, host name), first in first out) and ``s'`` the state of the hosts of the
  key's last placement, now. The first outcome of a (state, host) sets its value; a host never
  tried in a state counts as 0, above every learned (negative) value, so each host is tried
  once per state before the table is trusted. Then epsilon-greedy: a uniformly random host with
  probability ``epsilon``, else the highest Q (ties: the earlier host, primary first).

The table is kept in ``<state_dir>/balancers/q-learning.json``: loaded when built; written
atomically (temporary file, fsync, ``os.replace``) at ``close()`` and every ``save_every``
outcomes (then from a worker thread when an event loop runs, so the loop never waits for the
disk). A missing file starts fresh; an unreadable, corrupt or incompatible one (other format
version or bucket edges) is logged and replaced by a fresh table, never fatal. ``choose`` (a
new session) uses ``least-loaded``'s rule: fewest sessions, then lowest RTT.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import os
import random
import threading
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rrto_plugins.balancers._common import Recent, least, up
from rrtod.hookspecs import BalancerBase, BalancerOptions, HostView, Job

log = structlog.get_logger("rrtod.balancer")

FILE = "q-learning.json"
FORMAT = "rrtod q-learning"
VERSION = 1
MAX_PENDING = 1024  # remembered placements per (job key, host) whose outcome has not come


class QLearningOptions(BalancerOptions):
    alpha: float = Field(default=0.1, gt=0, le=1)  # learning rate
    gamma: float = Field(default=0.5, ge=0, lt=1)  # discount of the next state's value
    epsilon: float = Field(default=0.05, ge=0, le=1)  # probability of a uniformly random host
    seed: int | None = None  # of the exploration's random numbers; None: from the OS
    failure_penalty_s: float = Field(default=5.0, gt=0)  # seconds a failed inference counts as
    reward: Literal["linear", "quadratic"] = "linear"  # -latency, or RILaaS's -(1 + latency)^2
    # inflight buckets: [0, 1), [1, 2), [2, 4), [4, 8), [8, ...)
    inflight_edges: list[int] = Field(default_factory=lambda: [1, 2, 4, 8])
    # latency / best host's latency buckets: [1, 1.25), [1.25, 2), [2, 4), [4, ...)
    latency_edges: list[float] = Field(default_factory=lambda: [1.25, 2.0, 4.0])
    latency_alpha: float = Field(default=0.3, gt=0, le=1)  # EWMA weight of a new latency
    save_every: int = Field(default=200, ge=1)  # outcomes between writes of the table
    max_states: int = Field(default=4096, ge=1)  # states kept per job key (least recent dropped)
    max_keys: int = Field(default=256, ge=1)  # job keys kept (least recently used dropped)

    @field_validator("inflight_edges", "latency_edges")
    @classmethod
    def _increasing(cls, v: list[float], info: Any) -> list[float]:
        low = 1 if info.field_name == "inflight_edges" else 1.0
        if not v:
            raise ValueError("expected at least one edge")
        if v[0] < low or any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError(f"expected strictly increasing edges, the first at least {low}, "
                             f"got {v}")
        return v


class _AgentFile(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    latency: dict[str, float]
    q: dict[str, dict[str, float]]


class _TableFile(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    format: Literal["rrtod q-learning"]
    version: int
    inflight_edges: list[int]
    latency_edges: list[float]
    agents: dict[str, _AgentFile]


class _Agent:
    """One job key's table and recent latencies."""

    __slots__ = ("q", "latency", "hosts")

    def __init__(self) -> None:
        self.q: OrderedDict[str, dict[str, float]] = OrderedDict()  # state -> host -> value
        self.latency: dict[str, float] = {}  # host name -> EWMA of seconds
        self.hosts: tuple[HostView, ...] = ()  # given to the last place, for the next state


class QLearning(BalancerBase):
    Options = QLearningOptions

    def __init__(self, options: Mapping[str, Any] | None = None, state_dir: Path | None = None,
                 /) -> None:
        super().__init__(options, state_dir)
        opts: QLearningOptions = self.options
        self.random = random.Random(opts.seed)
        self.path = state_dir / FILE if state_dir is not None else None
        self.agents: Recent[_Agent] = Recent(opts.max_keys, _Agent)
        self.pending: dict[tuple[str, str], deque[str]] = {}
        self._unsaved = 0  # outcomes learned since the last write was started
        self._generation = 0  # of snapshots: a write never replaces a newer one
        self._written = 0
        self._write_lock = threading.Lock()
        self._writing: asyncio.Future[None] | None = None
        self._load()

    # ----- decisions -----
    def choose(self, hosts: Sequence[HostView]) -> HostView | None:
        return least(up(hosts), lambda h: h.sessions)

    def place(self, hosts: Sequence[HostView], job: Job) -> HostView | None:
        if not hosts:
            return None
        agent = self.agents(job.key)
        agent.hosts = tuple(hosts)
        state = self._state(agent, hosts)
        if self.random.random() < self.options.epsilon:
            host = hosts[self.random.randrange(len(hosts))]
        else:
            row = agent.q.get(state)
            if row is None:
                host = hosts[0]  # nothing learned in this state: every host is worth 0
            else:
                agent.q.move_to_end(state)
                host = max(hosts, key=lambda h: row.get(h.name, 0.0))  # ties: the earlier
        queue = self.pending.setdefault((job.key, host.name), deque(maxlen=MAX_PENDING))
        queue.append(state)
        return host

    def _state(self, agent: _Agent, hosts: Sequence[HostView]) -> str:
        opts: QLearningOptions = self.options
        known = [agent.latency[h.name] for h in hosts if h.name in agent.latency]
        best = max(min(known), 1e-9) if known else 1.0
        parts = []
        for host in sorted(hosts, key=lambda h: h.name):
            load = bisect.bisect_right(opts.inflight_edges, host.inflight)
            seconds = agent.latency.get(host.name)
            slow = "-" if seconds is None else bisect.bisect_right(opts.latency_edges,
                                                                   seconds / best)
            parts.append(f"{host.name}={load}.{slow}")
        return "|".join(parts)

    # ----- learning -----
    def observe(self, host: HostView, job: Job, seconds: float | None) -> None:
        opts: QLearningOptions = self.options
        agent = self.agents(job.key)
        latency = opts.failure_penalty_s if seconds is None else max(0.0, seconds)
        old = agent.latency.get(host.name)
        agent.latency[host.name] = (
            latency if old is None else old + opts.latency_alpha * (latency - old))
        queue = self.pending.get((job.key, host.name))
        if not queue:
            return  # not placed by this object (before a reload): nothing to learn from
        state = queue.popleft()
        if not queue:
            del self.pending[(job.key, host.name)]
        reward = -latency if opts.reward == "linear" else -((1.0 + latency) ** 2)
        now = [h for h in agent.hosts if h.up]
        following = 0.0
        if now:
            row = agent.q.get(self._state(agent, now))
            values = [row[h.name] for h in now if h.name in row] if row else []
            following = max(values) if values else 0.0
        target = reward + opts.gamma * following
        row = agent.q.get(state)
        if row is None:
            row = agent.q[state] = {}
            if len(agent.q) > opts.max_states:
                agent.q.popitem(last=False)
        else:
            agent.q.move_to_end(state)
        value = row.get(host.name)
        row[host.name] = target if value is None else value + opts.alpha * (target - value)
        self._unsaved += 1
        if self._unsaved >= opts.save_every:
            self._save_soon()

    def values(self, key: str) -> dict[str, dict[str, float]]:
        """The table of ``key``: state -> host name -> Q (diagnostics, tests)."""
        agent = self.agents.get(key)
        return {state: dict(row) for state, row in agent.q.items()} if agent else {}

    def latencies(self, key: str) -> dict[str, float]:
        agent = self.agents.get(key)
        return dict(agent.latency) if agent else {}

    # ----- persistence -----
    def close(self) -> None:
        """Write the table now (on the calling thread) if anything was learned since the last
        write; a periodic write still running is waited for, and never replaces this one."""
        if self._unsaved or self._generation > self._written:
            self._write(*self._snapshot())

    def _snapshot(self) -> tuple[str, int]:
        opts: QLearningOptions = self.options
        table = {
            "format": FORMAT, "version": VERSION,
            "inflight_edges": list(opts.inflight_edges),
            "latency_edges": list(opts.latency_edges),
            "agents": {key: {"latency": dict(agent.latency),
                             "q": {state: dict(row) for state, row in agent.q.items()}}
                       for key, agent in self.agents.items.items()},
        }
        self._unsaved = 0
        self._generation += 1
        return json.dumps(table, allow_nan=False, separators=(",", ":")), self._generation

    def _save_soon(self) -> None:
        """A periodic write: from a worker thread when an event loop runs here (skipped while
        the previous one still runs: the next outcome tries again), else at once."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write(*self._snapshot())
            return
        if self._writing is not None and not self._writing.done():
            return
        self._writing = loop.run_in_executor(None, self._write, *self._snapshot())

    def _write(self, text: str, generation: int) -> None:
        if self.path is None:
            self._written = max(self._written, generation)
            return
        with self._write_lock:
            if generation <= self._written:
                return  # a newer snapshot is already on disk
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(tmp, "w", encoding="utf-8") as out:
                    out.write(text)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, self.path)
                self._written = generation
            except OSError as exc:
                log.warning("q-learning table not saved", path=str(self.path), error=str(exc))
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)

    def _load(self) -> None:
        if self.path is None:
            return
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as exc:
            self._fresh(f"cannot read: {exc}")
            return
        try:
            table = _TableFile.model_validate_json(text)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            self._fresh(f"not a q-learning table ({where}: {err['msg']})".replace("(: ", "("))
            return
        opts: QLearningOptions = self.options
        if table.version != VERSION:
            self._fresh(f"format version {table.version}, this rrtod reads {VERSION}")
            return
        if (table.inflight_edges != list(opts.inflight_edges)
                or table.latency_edges != list(opts.latency_edges)):
            self._fresh(f"made with other bucket edges (inflight {table.inflight_edges}, "
                        f"latency {table.latency_edges}): its states mean something else")
            return
        for key, saved in list(table.agents.items())[-opts.max_keys:]:
            agent = self.agents(key)
            agent.latency = dict(saved.latency)
            agent.q = OrderedDict(list(saved.q.items())[-opts.max_states:])

    def _fresh(self, why: str) -> None:
        log.warning("q-learning table ignored, starting fresh", path=str(self.path), why=why)
