"""The configured scheduler (``scheduler:``), applied to the sequences the robot defines.

Before a verified sequence goes to the host (``AppRelay.push_sequence``) the scheduler places
its calls (``rrtod.partition``); the placement becomes a plan of the definition that both ends
replay (``SequenceDef.plans``, ``ReplayStart.plan``). Then both ends time the calls they run
in a plan's first replays and report it (``SequenceProfile``: the host its calls, the shim the
robot's); with each profile the scheduler is asked again, with the times known so far and the
link as measured now, and a placement it changes is sent as a new plan of the same sequence
(``SessionPlacer.profiled``). The app's own latency of each inference (its ``InferenceMark``)
is kept per placement too: once a plan has run ``MEASURED`` inferences past its profiled ones,
their median goes to the scheduler (``SequenceView.measured_ns``), which is asked again
(``SessionPlacer.timed``, ``again``): a model's prediction proposes a placement, the app's clock
decides whether it is kept. A placement that could change a result, or one the scheduler fails
to make, is logged and the sequence keeps running as it did: placing is an optimisation, never
a reason to lose replay.

A scheduler that never places a call on the robot says so (``splits = False``, as
``remote-all`` does): then nothing is analysed or timed for it, and the interception backend's
aliasing (for torch, an import of torch into the daemon) is never loaded.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

import structlog

from rrto.v1 import ops_pb2
from rrtod import partition
from rrtod.config import Config
from rrtod.plugins import Registry

log = structlog.get_logger("rrtod.robot")

# A plan's first inferences are timed call by call (``SequenceProfile``: 3 of them, on both
# ends; a plan with every call on the robot runs through the shim for those, then unseen): its
# latency is measured on the next ones, as it runs from then on.
SKIPPED = 3
MEASURED = 3  # inferences whose median latency stands for the plan's


@dataclass(frozen=True)
class LinkEstimate:
    """The host's link as a scheduler sees it: its round trip (the least of the recent pings:
    the link's own latency, not queueing behind data) and throughput, measured by the robot
    daemon (None: not measured yet)."""

    name: str
    rtt_ms: float | None
    mbit_s: float | None


class Scheduling:
    """The scheduler and the backend's aliasing it places with; rebuilt by ``RobotRole`` when
    a reload changes ``scheduler``."""

    def __init__(self, registry: Registry, config: Config):
        self.name = config.scheduler
        self.scheduler = registry.get("scheduler", config.scheduler).factory()
        self.splits = bool(getattr(self.scheduler, "splits", True))
        self._backend = registry.get("interception", config.intercept.backend)
        self._aliasing: tuple[partition.Written, partition.Viewed] | None = None
        self.placed = 0  # sequences defined with calls on the robot
        self.replaced = 0  # placements changed by what profiles showed
        self.refused = 0  # placements refused (or failed): the sequence ran as it was
        self.timed = 0  # placements whose latency the app measured

    def session(self, link: Any = None) -> SessionPlacer:
        """The placer of one app session's sequences, on ``link`` (its host's ``HostLink``)."""
        return SessionPlacer(self, link)

    def aliasing(self) -> tuple[partition.Written, partition.Viewed] | None:
        if self._aliasing is None:
            factory = getattr(self._backend, "aliasing", None)
            if factory is None:
                return None
            self._aliasing = factory()
        return self._aliasing

    def describe(self) -> dict[str, Any]:
        return {"scheduler": self.name, "placed": self.placed, "replaced": self.replaced,
                "refused": self.refused, "timed": self.timed}


class SessionPlacer:
    """Places one app session's sequences, and places them anew as profiles come in."""

    def __init__(self, scheduling: Scheduling, link: Any = None):
        self.scheduling = scheduling
        self.link = link
        self.defined: dict[int, ops_pb2.SequenceDef] = {}  # by id, as last sent (with plans)
        # per sequence, per call: its time on the host and on the robot (ns), as measured
        self.host_ns: dict[int, list[float | None]] = {}
        self.robot_ns: dict[int, list[float | None]] = {}
        # (sequence, plan, from the robot) of the profiles taken: one each, a repeat is
        # ignored (each costs the scheduler a placement)
        self.taken: set[tuple[int, int, bool]] = set()
        # per sequence, per placement (its robot calls): the app's latencies of its inferences
        # (ns) until ``SKIPPED + MEASURED`` are in, then their median
        self.latencies: dict[int, dict[frozenset[int], list[float]]] = {}
        self.measured_ns: dict[int, dict[frozenset[int], float]] = {}
        self.untimed: set[int] = set()  # sequences that replay with others in one inference

    def place(self, d: ops_pb2.SequenceDef) -> ops_pb2.SequenceDef:
        """``d`` (a sequence about to be defined) with the scheduler's plan."""
        if not self.scheduling.splits or not d.calls:
            return d
        if d.plans or d.plan or d.profile:  # plans are this placer's alone: placed afresh
            d = partition.unplaced(d)
        known = self.defined.get(d.id)
        if known is not None and partition.without_plans(known) == partition.without_plans(d):
            return known  # sent again (restored, re-offered): as placed before
        self.forget(d.id)
        placed = self._placed(d, self._link())
        if placed is not None:
            self.defined[d.id] = placed
            if placed.plan:
                self.scheduling.placed += 1
        return placed if placed is not None else d

    def profiled(self, profile: ops_pb2.SequenceProfile, robot_side: bool,
                 mbit_s: float | None = None) -> ops_pb2.SequenceDef | None:
        """A profile of sequence ``profile.sequence`` came in (from the shim: ``robot_side``):
        the definition to send again if the scheduler now places it otherwise, else None."""
        d = self.defined.get(profile.sequence)
        key = (profile.sequence, profile.plan, robot_side)
        if d is None or profile.plan > len(d.plans) or len(profile.call_ns) != len(d.calls) \
                or key in self.taken:
            return None
        self.taken.add(key)
        robot = partition.plan_calls(d, profile.plan)
        n = len(d.calls)
        host = self.host_ns.setdefault(d.id, [None] * n)
        mine = self.robot_ns.setdefault(d.id, [None] * n)
        for k, ns in enumerate(profile.call_ns):
            if robot_side and k in robot:
                mine[k] = float(ns)
            elif not robot_side and k not in robot:
                host[k] = float(ns)
        return self._again(d, self._link(mbit_s), "robot" if robot_side else "host")

    def timed(self, replays: list[tuple[int, int] | None], latency_ns: float) -> list[int]:
        """The app timed an inference (its ``InferenceMark``) that started ``replays``
        ((sequence, plan); None: a join of a variant). The sequences to place ``again``: one
        whose plan's measurement that completes, or one found in an inference with other
        replays, whose latency is then never its own (it is placed from the model alone)."""
        if len(replays) == 1 and replays[0] is not None:
            seq_id, plan = replays[0]
            d = self.defined.get(seq_id)
            if d is None or plan != d.plan or not d.profile or seq_id in self.untimed:
                return []  # (an inference started before the sequence was placed anew)
            key = partition.plan_calls(d, plan)
            if key in self.measured_ns.get(seq_id, {}):
                return []
            runs = self.latencies.setdefault(seq_id, {}).setdefault(key, [])
            runs.append(latency_ns)
            if len(runs) < SKIPPED + MEASURED:
                return []
            self.measured_ns.setdefault(seq_id, {})[key] = statistics.median(runs[SKIPPED:])
            self.scheduling.timed += 1
            return [seq_id]
        shared = {r[0] for r in replays if r is not None and r[0] in self.defined} - self.untimed
        self.untimed |= shared
        return sorted(shared)

    def again(self, seq_id: int, mbit_s: float | None = None) -> ops_pb2.SequenceDef | None:
        """Sequence ``seq_id`` placed anew after ``timed``: the definition to send again if
        the placement changes, else None."""
        d = self.defined.get(seq_id)
        return None if d is None else self._again(d, self._link(mbit_s), "timed")

    def _again(self, d: ops_pb2.SequenceDef, link: LinkEstimate,
               why: str) -> ops_pb2.SequenceDef | None:
        """``d`` placed anew with what is known now: None if the placement stays."""
        placed = self._placed(d, link)
        if placed is None:
            return None
        changed = placed.plan != d.plan
        host, mine = self.host_ns.get(d.id, []), self.robot_ns.get(d.id, [])
        log.info("sequence placed anew" if changed else "sequence placement kept",
                 scheduler=self.scheduling.name, sequence=d.id, plan=placed.plan,
                 robot_calls=len(placed.plans[placed.plan - 1].robot_calls) if placed.plan else 0,
                 calls=len(d.calls), mbit_s=link.mbit_s, rtt_ms=link.rtt_ms,
                 host_ms=_total_ms(host), robot_ms=_total_ms(mine), after=why,
                 measured_ms={len(k): round(v / 1e6, 2)
                              for k, v in self.measured_ns.get(d.id, {}).items()})
        if not changed:
            return None
        self.defined[d.id] = placed
        self.scheduling.replaced += 1
        return placed

    def forget(self, seq_id: int) -> None:
        self.taken = {k for k in self.taken if k[0] != seq_id}
        self.defined.pop(seq_id, None)
        self.host_ns.pop(seq_id, None)
        self.robot_ns.pop(seq_id, None)
        self.latencies.pop(seq_id, None)
        self.measured_ns.pop(seq_id, None)
        self.untimed.discard(seq_id)

    def _placed(self, d: ops_pb2.SequenceDef, link: LinkEstimate) -> ops_pb2.SequenceDef | None:
        """``d`` with the scheduler's placement as its current plan; None if it cannot be
        split, or the placement was refused (logged)."""
        if partition.why_not_split(d) is not None:
            return None
        aliasing = self.scheduling.aliasing()
        if aliasing is None:
            return None
        written, viewed = aliasing
        try:
            view = partition.view(d, written, viewed)
            n = len(d.calls)
            view = replace(view, host_ns=tuple(self.host_ns.get(d.id, [None] * n)),
                           robot_ns=tuple(self.robot_ns.get(d.id, [None] * n)),
                           measured_ns=None if d.id in self.untimed
                           else dict(self.measured_ns.get(d.id, {})))
            placement = list(self.scheduling.scheduler.place(view, link))
            robot = partition.split(d, placement, written, viewed)
        except Exception as exc:  # noqa: BLE001 - a plugin's failure must not cost replay
            self.scheduling.refused += 1
            log.warning("placement refused: the sequence runs as it did",
                        scheduler=self.scheduling.name, sequence=d.id, reason=str(exc))
            return None
        placed = partition.with_plan(d, robot)
        placed.profile = True  # the scheduler places again with what replays measure
        return placed

    def _link(self, mbit_s: float | None = None) -> LinkEstimate:
        link = self.link
        return LinkEstimate(name=getattr(link, "name", ""),
                            rtt_ms=getattr(link, "rtt_min_ms", None)
                            or getattr(link, "rtt_ms", None),
                            mbit_s=mbit_s if mbit_s is not None
                            else getattr(link, "mbit_s", None))


def _total_ms(times: list[float | None]) -> float | None:
    """The measured times' sum in ms (None if any is missing), for the log."""
    return None if any(t is None for t in times) else round(sum(times) / 1e6, 3)  # type: ignore[arg-type]
