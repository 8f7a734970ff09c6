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

With ``switch_plans`` (opt-in), placements are kept per bandwidth *band*
(``BAND_EDGES_MBIT``): each band has its own placement, and each inference runs the plan of
the band the link is in now (plan switching, ``SessionPlacer.observe``). The app's latencies
are measured in the band a sequence was first placed in; in the others the scheduler places by
its model (``measured_ns`` None). The link's throughput is read from each replay that moved
enough bytes (the host times the app's data as it lands: ``ReplayTiming``,
``SessionPlacer.uploaded``), else probed after it. Switching to a plan both ends already hold
costs a local message to the shim, nothing on the link. Off, there is one band (None) and all
of this is the single placement above.

A scheduler that never places a call on the robot says so (``splits = False``, as
``remote-all`` does): then nothing is analysed or timed for it, and the interception backend's
aliasing (for torch, an import of torch into the daemon) is never loaded.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, replace
from typing import Any

import structlog

from rrto.v1 import ops_pb2
from rrtod import lop, partition
from rrtod.config import Config
from rrtod.plugins import Registry

log = structlog.get_logger("rrtod.robot")

# A plan's first inferences are timed call by call (``SequenceProfile``: 3 of them, on both
# ends; a plan with every call on the robot runs through the shim for those, then unseen): its
# latency is measured on the next ones, as it runs from then on.
SKIPPED = 3
MEASURED = 3  # inferences whose median latency stands for the plan's
# Bandwidth bands (Mbit/s): their edges fall between the usual link rates (10, 20, 50, 100,
# 200, 500), so that a steady link's estimates stay in one band; a throughput must be past an
# edge by ``HYSTERESIS`` to change band (no flapping on an estimate near an edge).
BAND_EDGES_MBIT = (1.5, 3.5, 7.0, 14.0, 28.0, 70.0, 140.0, 280.0, 700.0)
HYSTERESIS = 1.15
# An inference that moved fewer bytes than this tells too little of the link (its round trip
# and compute noise dominate): the link is probed instead.
MIN_CROSSING_BYTES = 32 << 10
# A transfer shorter than this is timing noise (a thread's wake-up, a round trip's jitter):
# it only says the link is fast, which counts where even that bound is in the top band.
MIN_TRANSFER_S = 0.005


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
        self.switch_plans = config.switch_plans
        self.follows_link = self.splits and config.switch_plans  # plans per bandwidth band
        self._backend = registry.get("interception", config.intercept.backend)
        self._made: dict[str, Any] = {}  # what the backend's factories made (``aliasing``, ``rows``)
        # it splits calls by rows (Hybrid-Parallel): it is given each sequence's ``lop.Space``
        self.parallel = bool(getattr(self.scheduler, "parallel", False))
        self.placed = 0  # sequences defined with calls on the robot
        self.replaced = 0  # placements changed by what profiles showed
        self.refused = 0  # placements refused (or failed): the sequence ran as it was
        self.timed = 0  # placements whose latency the app measured
        self.switched = 0  # plans changed because the link's throughput changed band

    def session(self, link: Any = None) -> SessionPlacer:
        """The placer of one app session's sequences, on ``link`` (its host's ``HostLink``)."""
        return SessionPlacer(self, link)

    def aliasing(self) -> tuple[partition.Written, partition.Viewed] | None:
        return self._from_backend("aliasing")

    def rows(self) -> lop.RuleOf | None:
        """The backend's rule for local operators (``InterceptionBackend.rows``), if any."""
        return self._from_backend("rows")

    def _from_backend(self, name: str) -> Any:
        """What the backend's optional ``name`` factory makes (made once), None without one."""
        if name not in self._made:
            factory = getattr(self._backend, name, None)
            if factory is None:
                return None
            self._made[name] = factory()
        return self._made[name]

    def describe(self) -> dict[str, Any]:
        return {"scheduler": self.name, "placed": self.placed, "replaced": self.replaced,
                "refused": self.refused, "timed": self.timed, "switched": self.switched}


class SessionPlacer:
    """Places one app session's sequences, and places them anew as profiles come in and as
    the link's throughput moves from band to band."""

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
        # per (sequence, band), per placement (its robot calls): the app's latencies of its
        # inferences (ns) until ``SKIPPED + MEASURED`` are in, then their median
        self.latencies: dict[tuple[int, int | None], dict[frozenset[int], list[float]]] = {}
        self.measured_ns: dict[tuple[int, int | None], dict[frozenset[int], float]] = {}
        self.untimed: set[int] = set()  # sequences that replay with others in one inference
        # The band the link is in (None: its throughput is not known yet), the throughput that
        # put it there, and per (sequence, band) the plan placed for that band.
        self.band: int | None = None
        self.mbit_s: float | None = None
        self.chosen: dict[tuple[int, int | None], int] = {}
        # Per sequence, the band it was first placed in: the app's latencies are measured there
        # (profiles come from there too); in other bands the scheduler places by its model
        # alone (``measured_ns`` None), so a new band never costs a round of measurements,
        # some of which the link would make very slow (all on the host in an outage).
        self.home: dict[int, int | None] = {}
        self.switches = 0

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
        link = self._link()
        self.home[d.id] = self.band
        placed = self._placed(d, link)
        if placed is not None:
            self._keep(placed)
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
        split = partition.plan_split(d, profile.plan)
        banded = set(split.calls) if split is not None else set()  # a band's time, not a call's
        n = len(d.calls)
        host = self.host_ns.setdefault(d.id, [None] * n)
        mine = self.robot_ns.setdefault(d.id, [None] * n)
        for k, ns in enumerate(profile.call_ns):
            if k in banded:
                continue
            if robot_side and k in robot:
                mine[k] = float(ns)
            elif not robot_side and k not in robot:
                host[k] = float(ns)
        return self._again(d, self._link(mbit_s), "robot" if robot_side else "host")

    def timed(self, replays: list[tuple[int, int] | None], latency_ns: float) -> list[int]:
        """The app timed an inference (its ``InferenceMark``) that started ``replays``
        ((sequence, plan); None: a join of a variant), in the band the link is in now. The
        sequences to place ``again``: one whose plan's measurement that completes, or one
        found in an inference with other replays, whose latency is then never its own (it is
        placed from the model alone)."""
        if len(replays) == 1 and replays[0] is not None:
            seq_id, plan = replays[0]
            d = self.defined.get(seq_id)
            if d is None or plan != d.plan or not d.profile or seq_id in self.untimed \
                    or self.home.get(seq_id) != self.band:
                return []  # (an inference started before the sequence was placed anew)
            key = partition.plan_key(d, plan)
            measured = self.measured_ns.setdefault((seq_id, self.band), {})
            if key in measured:
                return []
            runs = self.latencies.setdefault((seq_id, self.band), {}).setdefault(key, [])
            runs.append(latency_ns)
            if len(runs) < SKIPPED + MEASURED:
                return []
            measured[key] = statistics.median(runs[SKIPPED:])
            self.scheduling.timed += 1
            return [seq_id]
        shared = {r[0] for r in replays if r is not None and r[0] in self.defined} - self.untimed
        self.untimed |= shared
        return sorted(shared)

    def uploaded(self, timing: ops_pb2.ReplayTiming) -> float | None:
        """The link's throughput (Mbit/s) as a replay saw it (``ReplayTiming``, from the host):
        the bytes uploaded for it over the time they took to arrive after its start frame,
        less the robot's profiled compute of the plan's robot calls before its last host call
        (a robot value goes up once computed). None where that tells too little: under
        ``MIN_CROSSING_BYTES``, a robot call not profiled yet, or compute that would explain
        most of the time (its noise would be read as the link's)."""
        d = self.defined.get(timing.sequence)
        if timing.upload_bytes < MIN_CROSSING_BYTES or d is None or timing.plan > len(d.plans) \
                or partition.plan_split(d, timing.plan) is not None:
            return None  # (a split's uploads wait for the robot's bands: not the link's pace)
        robot = partition.plan_calls(d, timing.plan)
        ahead = 0.0
        if robot:
            mine = self.robot_ns.get(d.id) or [None] * len(d.calls)
            last = max((k for k in range(len(d.calls)) if k not in robot), default=-1)
            before = [mine[k] for k in robot if k < last]
            if any(t is None for t in before):
                return None
            ahead = sum(before)  # type: ignore[arg-type]
        took = timing.upload_ns - ahead
        if took < timing.upload_ns / 4:
            return None
        return throughput(timing.upload_bytes, took / 1e9)

    def observe(self, mbit_s: float | None) -> list[ops_pb2.SequenceDef]:
        """The link's throughput now (``uploaded``, or a probe): if it moved the link to
        another band, each sequence runs that band's plan, placed now if the band is new to
        it. The definitions to send again (their plan changed)."""
        if not mbit_s or not self.scheduling.follows_link:
            return []
        self.mbit_s = mbit_s
        band = self._band_for(mbit_s)
        if self.band is None:  # the first throughput: the band of what was placed so far
            self._settle(band)
            return []
        if band == self.band:
            return []
        self.band = band
        out = []
        for seq_id, d in list(self.defined.items()):
            plan = self.chosen.get((seq_id, band))
            if plan is None:
                placed = self._placed(d, self._link())
                if placed is None:
                    continue
            else:
                placed = partition.with_plan(d, partition.plan_calls(d, plan),
                                             partition.plan_split(d, plan))
                placed.profile = d.profile
            self._keep(placed)
            if placed.plan != d.plan or len(placed.plans) != len(d.plans):
                out.append(placed)
        if out:
            self.switches += 1
            self.scheduling.switched += 1
            log.info("link changed band: plans switched", scheduler=self.scheduling.name,
                     mbit_s=round(mbit_s, 1), band=band,
                     plans={d.id: d.plan for d in out})
        return out

    def again(self, seq_id: int, mbit_s: float | None = None) -> ops_pb2.SequenceDef | None:
        """Sequence ``seq_id`` placed anew after ``timed``: the definition to send again if
        the placement changes, else None."""
        d = self.defined.get(seq_id)
        return None if d is None else self._again(d, self._link(mbit_s), "timed")

    def current(self, d: ops_pb2.SequenceDef) -> ops_pb2.SequenceDef:
        """``d`` (a definition the host accepted, for the shim) with the plan chosen for its
        sequence since it was sent, if ``d`` has that plan (plans are only appended: plan
        ``k`` is the same in both)."""
        now = self.defined.get(d.id)
        if now is None or now.plan == d.plan or now.plan > len(d.plans):
            return d
        out = ops_pb2.SequenceDef()
        out.CopyFrom(d)
        out.plan = now.plan
        return out

    def describe(self) -> dict[str, Any]:
        return {"band": self.band, "mbit_s": None if self.mbit_s is None else round(self.mbit_s, 1),
                "switches": self.switches,
                "plans": {seq_id: d.plan for seq_id, d in self.defined.items()}}

    def _settle(self, band: int) -> None:
        """The link's first band: what was placed, timed and measured before it was known
        was in it."""
        self.band = band
        for by_band in (self.latencies, self.measured_ns, self.chosen):
            for seq_id, b in [k for k in by_band if k[1] is None]:
                by_band[(seq_id, band)] = by_band.pop((seq_id, b))  # type: ignore[index]
        self.home = {k: band if v is None else v for k, v in self.home.items()}

    def _keep(self, placed: ops_pb2.SequenceDef) -> None:
        self.defined[placed.id] = placed
        self.chosen[(placed.id, self.band)] = placed.plan

    def _band_for(self, mbit_s: float) -> int:
        """The band of ``mbit_s``; the current one while it is within ``HYSTERESIS`` of it."""
        band, now = band_of(mbit_s), self.band
        if now is None or band == now:
            return band
        low = BAND_EDGES_MBIT[now - 1] if now > 0 else 0.0
        high = BAND_EDGES_MBIT[now] if now < len(BAND_EDGES_MBIT) else float("inf")
        return now if low / HYSTERESIS <= mbit_s <= high * HYSTERESIS else band

    def _again(self, d: ops_pb2.SequenceDef, link: LinkEstimate,
               why: str) -> ops_pb2.SequenceDef | None:
        """``d`` placed anew with what is known now: None if the placement stays. The other
        bands' placements were made with less: each is made again when the link is back in
        its band (a band first entered before the robot's times were in ran everything on
        the robot there for good: unet on the outdoor trace)."""
        for key in [k for k in self.chosen if k[0] == d.id and k[1] != self.band]:
            del self.chosen[key]
        placed = self._placed(d, link)
        if placed is None:
            return None
        changed = placed.plan != d.plan
        host, mine = self.host_ns.get(d.id, []), self.robot_ns.get(d.id, [])
        log.info("sequence placed anew" if changed else "sequence placement kept",
                 scheduler=self.scheduling.name, sequence=d.id, plan=placed.plan,
                 robot_calls=len(placed.plans[placed.plan - 1].robot_calls) if placed.plan else 0,
                 split_calls=len(placed.plans[placed.plan - 1].split_calls) if placed.plan else 0,
                 split_at=round(placed.plans[placed.plan - 1].split_at, 3) if placed.plan else 0,
                 calls=len(d.calls), mbit_s=link.mbit_s, rtt_ms=link.rtt_ms, band=self.band,
                 measured_in=self.home.get(d.id), untimed=d.id in self.untimed,
                 host_ms=_total_ms(host), robot_ms=_total_ms(mine), after=why,
                 measured_ms={len(k): round(v / 1e6, 2) for k, v in
                              self.measured_ns.get((d.id, self.band), {}).items()})
        if not changed:
            return None
        self._keep(placed)
        self.scheduling.replaced += 1
        return placed

    def forget(self, seq_id: int) -> None:
        self.taken = {k for k in self.taken if k[0] != seq_id}
        self.defined.pop(seq_id, None)
        self.host_ns.pop(seq_id, None)
        self.robot_ns.pop(seq_id, None)
        self.home.pop(seq_id, None)
        for by_band in (self.latencies, self.measured_ns, self.chosen):
            for key in [k for k in by_band if k[0] == seq_id]:
                del by_band[key]
        self.untimed.discard(seq_id)

    def _placed(self, d: ops_pb2.SequenceDef, link: LinkEstimate) -> ops_pb2.SequenceDef | None:
        """``d`` with the scheduler's placement for the current band as its current plan;
        None if it cannot be split, or the placement was refused (logged)."""
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
                           or self.home.get(d.id) != self.band
                           else dict(self.measured_ns.get((d.id, self.band), {})))
            rule_of = self.scheduling.rows() if self.scheduling.parallel else None
            if rule_of is not None:
                view = replace(view, space=lop.Space(d, rule_of, [c.movable for c in view.calls]))
            placement = self.scheduling.scheduler.place(view, link)
            at = getattr(placement, "split_at", None)
            sides = list(placement)
            region = [k for k, p in enumerate(sides) if p == partition.SPLIT]
            robot = partition.split(d, [partition.HOST if p == partition.SPLIT else p
                                        for p in sides], written, viewed)
            split = None
            if region:
                if view.space is None or at is None:
                    raise ValueError("a split placement without a split region's space/share")
                partition.check_region(d, region, written, viewed, view.space)
                split = partition.Split(tuple(region), float(at))
        except Exception as exc:  # noqa: BLE001 - a plugin's failure must not cost replay
            self.scheduling.refused += 1
            log.warning("placement refused: the sequence runs as it did",
                        scheduler=self.scheduling.name, sequence=d.id, reason=str(exc))
            return None
        placed = partition.with_plan(d, robot, split)
        placed.profile = True  # the scheduler places again with what replays measure
        return placed

    def _link(self, mbit_s: float | None = None) -> LinkEstimate:
        """The link as the scheduler sees it: its round trip, and the throughput measured
        (``mbit_s``, else the host link's) if it is in the current band, else the band's
        middle (the probes' windowed best is not the link now; the estimate that moved the
        link into the band is at its edge, and the placement holds for all of it)."""
        link = self.link
        if mbit_s is None:
            mbit_s = getattr(link, "mbit_s", None)
        if self.band is not None and (mbit_s is None or band_of(mbit_s) != self.band):
            mbit_s = band_middle(self.band)
        return LinkEstimate(name=getattr(link, "name", ""),
                            rtt_ms=getattr(link, "rtt_min_ms", None)
                            or getattr(link, "rtt_ms", None),
                            mbit_s=mbit_s)


def throughput(nbytes: int, seconds: float) -> float | None:
    """``nbytes`` moved in ``seconds``, in Mbit/s; None for a transfer too short to time
    (``MIN_TRANSFER_S``) unless even the bound it gives is in the top band."""
    mbit = nbytes * 8 / 1e6
    if seconds >= MIN_TRANSFER_S:
        return mbit / seconds
    bound = mbit / MIN_TRANSFER_S
    return bound if bound >= BAND_EDGES_MBIT[-1] * HYSTERESIS else None


def band_middle(band: int) -> float:
    """A throughput that stands for ``band``: the geometric middle of its edges (the outer
    bands' inner edge, halved or doubled)."""
    edges = BAND_EDGES_MBIT
    if band <= 0:
        return edges[0] / 2
    if band >= len(edges):
        return edges[-1] * 2
    return (edges[band - 1] * edges[band]) ** 0.5


def band_of(mbit_s: float) -> int:
    """The bandwidth band ``mbit_s`` is in (an index into the gaps of ``BAND_EDGES_MBIT``)."""
    return bisect.bisect(BAND_EDGES_MBIT, mbit_s)


def _total_ms(times: list[float | None]) -> float | None:
    """The measured times' sum in ms (None if any is missing), for the log."""
    return None if any(t is None for t in times) else round(sum(times) / 1e6, 3)  # type: ignore[arg-type]
