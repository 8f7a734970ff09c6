"""Per-inference placement: each replayed inference of a stateless sequence runs on the host
the balancer picks, and a host lost under it costs the app nothing.

An app session has one *primary* host (the balancer's ``choose`` at open): every forwarded
call, upload and download goes there, and every sequence is defined there first. A sequence
the primary accepts without ``pinned`` (``SequenceAck``: no call writes a value that outlives
the inference, no output only the host can name) that reads nothing but the inference's own
inputs and the weights is a pure function of its inputs. Such a sequence is also defined on
*replicas*: a session of the same app on each other host that is up, opened in the background,
the weights offered by content hash and the missing ones copied there from the primary (never
on an inference's critical path). From then on each ``ReplayStart`` of it is a *job* the
balancer places (``HostBalancer.place``) among the hosts that hold it; the start and its
arguments go there, the outputs and answers come back from there, and the time from the start
to the last output is the job's latency (``HostBalancer.observe``).

What keeps this exact:

- Inputs. A host keeps, per sequence, each input slot's latest data, which the shim repeats by
  ``same_as`` instead of sending again; the shim does not know which host got which data. So
  this module keeps the latest data of each slot and what each host holds: a ``same_as`` a host
  cannot resolve goes to it as the data itself.
- Weights. A replica binds each weight id the sequence names (``BIND_OP``, by content hash)
  before its first inference there, and is told the sequence's weight slots, as the shim told
  the primary.
- Values. A replayed inference's ids (``base + i``) live on the host that ran it. Releases and
  downloads of them go there. A frame bound for another host that names one (an input passed
  on by reference, a forwarded call on an output) gets it as data, copied from its host first
  (``pull``), and its sequence is pinned from then on: its outputs are used on the host.
- Mismatches. A placed inference the app leaves (``ReplayAbort``), or one whose input is a value
  only the primary has, is *moved* to the primary: its start and arguments (kept until the app
  has moved on and every output is back) are sent there, the replica aborts its copy, and
  answers and outputs the app already got are not passed on twice. The forwarding that follows
  then finds the prefix's values on the primary, as without placement.
- Loss. A replica lost (stream ended, link down) moves its inferences in flight to the primary,
  the same way: the app sees the outputs, later, never an error. A value of a finished
  inference that only the lost replica held and that a later frame needs ends the session as
  ``HOST_LOST``: the shim rebuilds it from its journal (``fallback: local``).

The primary itself lost ends the session as before (``HOST_LOST``; the shim rebuilds and
reconnects). Placement is off (``placement: session``) or idle (one host) at no cost per frame.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from rrto.v1 import ops_pb2
from rrtod import loops
from rrtod.hookspecs import Job
from rrtod.robot.host_link import HostLink
from rrtod.wire import (
    BIND_OP,
    HOST_ID_BASE,
    REPLAY_BASE,
    SPAN,
    Parts,
    iter_tensor_refs,
    release_of,
    released_ids,
)

log = structlog.get_logger("rrtod.robot")

SRC = ops_pb2.SeqSource
# Frames this daemon sends on its own (weight copies, binds) carry sequence numbers and ids far
# above any the shim uses (it counts from 1), so that their replies are told apart.
# Its ids are in the upper half of the replayed inferences' range, which no app reaches
# (2^41 inferences): its binds' outputs in the first inference's worth, then its warm-ups.
OWN_SEQ = 1 << 62
OWN_IDS = REPLAY_BASE + (1 << 41) * SPAN
WARM_WAIT_S = 10.0  # for the app's first inputs of a sequence, to warm a new replica with
# A placed inference not back from its replica after LATE_FACTOR times its sequence's median
# time (of the last LATE_WINDOW, at least LATE_MIN_S; not before LATE_SAMPLES of them) is sent
# to the primary as well: a stalled or overloaded replica costs that, not the seconds its link
# takes to be declared down.
LATE_FACTOR = 4.0
LATE_MIN_S = 0.05
LATE_WINDOW = 32
LATE_SAMPLES = 8
LOCATED = 4096  # replica-run inferences whose ids are remembered (the app releases them soon)
REOPEN_S = 2.0  # between attempts to open a replica on a host


def down_base(kind: str | None, down: ops_pb2.SessionDown) -> int | None:
    """The inference base a host's frame is about (an answer, a failure, a prefix, sizes, a
    pushed output); None for other frames."""
    if kind == "answer":
        return down.answer.base_id
    if kind == "error":
        return down.error.base_id
    if kind == "replayed":
        return down.replayed.base_id
    if kind == "sizes":
        return down.sizes.base_id
    if kind == "fetched" and not down.fetched.seq:
        return base_of(down.fetched.id)
    return None


def base_of(tid: int) -> int | None:
    """The inference base a replayed value's id belongs to; None for other ids."""
    if REPLAY_BASE <= tid < HOST_ID_BASE:
        return REPLAY_BASE + ((tid - REPLAY_BASE) // SPAN) * SPAN
    return None


class NeedPull(Exception):  # noqa: N818 - a request to the caller, not an error
    """A frame names values that live on another host: ``Placement.pull`` them, then route it
    again."""

    def __init__(self, ids: list[int]):
        super().__init__(ids)
        self.ids = ids


class Unplaceable(Exception):
    """A value a frame needs was on a host that is gone: the session cannot go on exactly."""


@dataclass(eq=False)
class Lane:
    """One host session of the app: the primary's (the relay's own stream) or a replica's."""

    link: HostLink
    call: Any  # grpc.aio.StreamStreamCall
    primary: bool
    alive: bool = True
    defined: set[int] = field(default_factory=set)  # sequences it holds
    defining: set[int] = field(default_factory=set)  # sequences on their way there
    armed: set[int] = field(default_factory=set)  # sequences whose weight slots it was told
    bound: set[int] = field(default_factory=set)  # weight ids bound in its store
    latest: dict[tuple[int, int], int] = field(default_factory=dict)  # (seq, slot) -> data version
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    task: asyncio.Task[None] | None = None
    placed: int = 0  # inferences it ran
    warm: bool = False  # ran an inference: the next one does not pay the host's first-use costs
    late: bool = False  # an inference there was late (``_late``): no more until one comes back
    warming: asyncio.Lock = field(default_factory=asyncio.Lock)  # one warm-up at a time
    opened: asyncio.Future[None] | None = None

    @property
    def name(self) -> str:
        return self.link.name

    async def write(self, frames: list[ops_pb2.SessionUp]) -> None:
        if not frames:
            return
        message = frames[0] if len(frames) == 1 else ops_pb2.SessionUp(
            batch=ops_pb2.SessionUpBatch(frames=frames))
        async with self.lock:
            await self.call.write(message)


@dataclass(eq=False)
class Inference:
    """One replayed inference of a placeable sequence, from its start until the app has moved on
    and its outputs are back."""

    base: int
    seq: int
    lane: Lane
    job: Job
    outputs: set[int]
    started: float
    frames: list[ops_pb2.SessionUp] = field(default_factory=list)  # start + resolved arguments
    delivered: set[int] = field(default_factory=set)  # outputs the app got
    answered: set[int] = field(default_factory=set)  # positions whose answer the app got
    done: bool = False  # every output back
    left: bool = False  # the app moved on (a new start, a forwarded call)
    moved: int = 0


@dataclass
class SeqInfo:
    """What placement knows of one sequence of the session."""

    d: ops_pb2.SequenceDef
    pinned: str | None  # why its inferences stay on the primary; None: placeable
    persistent: dict[int, tuple[int, bytes]]  # weight slot -> (id, content hash)
    outputs: list[int]  # local indices of the outputs
    times: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=LATE_WINDOW))  # seconds, start -> back

    def late_after(self) -> float | None:
        """Seconds after which an inference of this sequence is late; None: not known yet."""
        if len(self.times) < LATE_SAMPLES:
            return None
        return max(LATE_MIN_S, LATE_FACTOR * sorted(self.times)[len(self.times) // 2])


def placeable_reason(d: ops_pb2.SequenceDef, ack: ops_pb2.SequenceAck) -> str | None:
    """Why ``d`` must stay on its primary host, from its definition and the host's answer; None
    when any host holding it and its weights computes the same."""
    if ack.pinned:
        return ack.pinned
    if d.HasField("varies_from") or d.symbols or d.loops:
        return "its sizes follow the data (answered calls): kept where it was verified"
    for s in d.sources:
        if s.kind == SRC.CONSTANT:
            return "reads a tensor the app made before the inference (a constant)"
        if s.kind == SRC.INPUT and s.fixed:
            return "reads recorded input data"
    return None


class Placement:
    """The placement of one app session's replayed inferences over its hosts."""

    def __init__(self, primary: Lane, hosts: Callable[[], list[HostLink]],
                 balancer: Callable[[], Any], open_request: ops_pb2.SessionOpen):
        self.primary = primary
        self.hosts = hosts  # the robot daemon's host links, now
        self.balancer = balancer  # the robot daemon's balancer, now
        self.open_request = open_request
        self.app = open_request.app
        self.enabled = True
        self.closed = False
        # The relay's: frames from replicas to the app, and to its op log.
        self.to_app: Callable[[ops_pb2.SessionDown], Awaitable[None]] | None = None
        self.replicas: dict[str, Lane] = {}
        self.tried: dict[str, float] = {}  # host -> when a replica was last tried there
        self.seqs: dict[int, SeqInfo] = {}
        self.current: Inference | None = None  # the inference the app's arguments belong to
        self.inflight: dict[int, Inference] = {}  # by base: tracked until done and left
        self.located: collections.OrderedDict[int, Lane] = collections.OrderedDict()  # base -> replica
        self.weights: dict[int, bytes] = {}  # weight id -> content hash (from the shim's binds)
        self.data: dict[tuple[int, int], tuple[int, ops_pb2.TensorRef]] = {}  # latest per slot
        self._versions = itertools.count(1)
        self._spread_at = 0.0  # when the hosts were last offered the sequence in use
        self._seq = itertools.count(OWN_SEQ)
        self._ids = itertools.count(OWN_IDS)
        self._bases = itertools.count(OWN_IDS + SPAN, SPAN)
        self._warming: dict[int, tuple[asyncio.Future[None], set[int]]] = {}  # base -> outputs
        self._replies: dict[int, tuple[Lane, asyncio.Future[Any]]] = {}  # own seq -> reply
        self.copied: set[int] = set()  # replica values pulled to the primary (on both now)
        # (base, lane) of inferences moved off a lane: its late frames for them are dropped
        self.left_behind: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        # Frames of inferences failed over by a loss, to be written before anything else on
        # their lane (``take``), and the relay's sender that writes them when the app is idle.
        self.pending: list[tuple[Lane, ops_pb2.SessionUp]] = []
        self.resend: Callable[[list[tuple[Lane, ops_pb2.SessionUp]]], Awaitable[None]] | None = None
        self._acks: dict[tuple[str, int], asyncio.Future[ops_pb2.SequenceAck]] = {}
        self._queries: dict[str, collections.deque[asyncio.Future[Any]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.counters: collections.Counter[str] = collections.Counter()

    # ----- what the robot daemon shows ------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        placed = {self.primary.name: self.primary.placed}
        placed.update((name, lane.placed) for name, lane in self.replicas.items())
        return {"placements": placed,
                "replicas": [name for name, lane in self.replicas.items() if lane.alive],
                **{k: self.counters[k] for k in ("moved", "failovers", "late", "pulled")}}

    def sequence_placement(self, seq_id: int) -> dict[str, Any] | None:
        info = self.seqs.get(seq_id)
        if info is None:
            return None
        hosts = [self.primary.name] if info.pinned is not None else [
            self.primary.name, *(n for n, lane in self.replicas.items()
                                 if lane.alive and seq_id in lane.defined)]
        return {"pinned": info.pinned, "hosts": hosts}

    # ----- definitions ----------------------------------------------------------------------
    def accepted(self, d: ops_pb2.SequenceDef, ack: ops_pb2.SequenceAck) -> None:
        """The primary accepted ``d``: if it is placeable, define it on the other hosts."""
        persistent: dict[int, tuple[int, bytes]] = {}
        for slot, s in enumerate(d.sources):
            if s.kind == SRC.PERSISTENT:
                persistent[slot] = (s.id, bytes(s.hash))
        # An inference is done once its outputs are delivered; with a loop, only those the
        # head makes have the same ids whatever the count (``rrtod.loops``).
        local = {rid: i for i, rid in enumerate(loops.head(d).local_ids)}
        info = SeqInfo(d, placeable_reason(d, ack), persistent,
                       [local[o] for o in d.outputs if o in local])
        self.seqs[d.id] = info
        self.primary.defined.add(d.id)
        if info.pinned is None and self.enabled:
            self._spread(info)

    def dropped(self, seq_id: int) -> list[tuple[Lane, ops_pb2.SessionUp]]:
        """The app or the robot dropped a sequence: the replicas drop it too."""
        self.seqs.pop(seq_id, None)
        drop = ops_pb2.SessionUp(define=ops_pb2.SequenceDef(id=seq_id))
        out = []
        for lane in self.replicas.values():
            if seq_id in lane.defined and lane.alive:
                lane.defined.discard(seq_id)
                lane.armed.discard(seq_id)
                out.append((lane, drop))
        return out

    def _spread(self, info: SeqInfo) -> None:
        """Define ``info``'s sequence on every other host that is up (in the background)."""
        now = time.monotonic()
        for link in self.hosts():
            if link is self.primary.link or not link.up:
                continue
            lane = self.replicas.get(link.name)
            if lane is not None and lane.link is not link:  # the host was reconfigured
                lane = None
            if lane is None or not lane.alive:
                if now - self.tried.get(link.name, 0.0) < REOPEN_S:
                    continue
                self.tried[link.name] = now
                lane = self._open(link)
            if info.d.id not in lane.defined and info.d.id not in lane.defining:
                lane.defining.add(info.d.id)
                self._spawn(self._define(lane, info))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _open(self, link: HostLink) -> Lane:
        loop = asyncio.get_running_loop()
        lane = Lane(link, link.open_session(), primary=False)
        lane.opened = loop.create_future()
        self.replicas[link.name] = lane
        link.sessions += 1
        lane.task = loop.create_task(self._down(lane), name=f"replica:{link.name}")
        return lane

    async def _define(self, lane: Lane, info: SeqInfo) -> None:
        """Open the replica's session if need be, copy the weights it lacks from the primary,
        define the sequence; any failure leaves the sequence off that host."""
        d = info.d
        try:
            if lane.opened is not None:
                await asyncio.wait_for(asyncio.shield(lane.opened), 30)
            hashes = sorted({h for _, h in info.persistent.values()})
            missing = set(await self._query(lane, hashes)) if hashes else set()
            for _slot, (wid, h) in info.persistent.items():
                if h in missing:
                    data = await self._ask(self.primary, ops_pb2.SessionUp(
                        fetch=ops_pb2.Fetch(id=wid)))
                    await lane.write([ops_pb2.SessionUp(blob=ops_pb2.BlobPut(hash=h, tensor=data))])
                    missing.discard(h)
                    self.counters["weights_copied"] += 1
            if d.id not in self.seqs:
                return  # dropped meanwhile
            fut = asyncio.get_running_loop().create_future()
            self._acks[(lane.name, d.id)] = fut
            await lane.write([ops_pb2.SessionUp(define=d)])
            ack = await asyncio.wait_for(fut, 60)
            if ack.accepted and d.id in self.seqs and lane.alive:
                async with lane.warming:
                    if not lane.warm:
                        await self._warm(lane, info)
                lane.defined.add(d.id)
            elif not ack.accepted:
                log.warning("replica refused sequence", host=lane.name, sequence=d.id,
                            reason=ack.reason)
        except (grpc.aio.AioRpcError, TimeoutError, ConnectionError, RuntimeError) as exc:
            log.warning("could not define sequence on replica", host=lane.name, sequence=d.id,
                        error=str(exc) or type(exc).__name__)
        finally:
            self._acks.pop((lane.name, d.id), None)
            lane.defining.discard(d.id)

    async def _warm(self, lane: Lane, info: SeqInfo) -> None:
        """A new replica's first inference, with the app's latest inputs, its outputs dropped:
        a host's first operators cost seconds (libraries loaded, kernels built), which no
        inference of the app should pay. Runs before any app inference is placed there."""
        d = info.d
        inputs = [slot for slot, s in enumerate(d.sources) if s.kind == SRC.INPUT]
        waited = time.monotonic() + WARM_WAIT_S
        while any((d.id, slot) not in self.data for slot in inputs):
            if time.monotonic() > waited or d.id not in self.seqs or not lane.alive:
                lane.warm = True  # no inputs to warm it with: the first inference pays
                return
            await asyncio.sleep(0.05)
        base = next(self._bases)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._warming[base] = (done, {base + i for i in info.outputs})
        frames = [ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=d.id, base_id=base))]
        frames += [f for _, f in self._arm(lane, info)]
        for slot in inputs:
            version, ref = self.data[(d.id, slot)]
            frames.append(ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=slot, tensor=ref)))
            lane.latest[(d.id, slot)] = version
        started = time.monotonic()
        try:
            await lane.write(frames)
            if info.outputs:
                await asyncio.wait_for(done, 60)
            log.info("replica warmed", host=lane.name, sequence=d.id,
                     seconds=round(time.monotonic() - started, 3))
        finally:
            self._warming.pop(base, None)
            await lane.write([ops_pb2.SessionUp(release=release_of(
                range(base, base + len(d.local_ids))))])
        lane.warm = True

    async def _query(self, lane: Lane, hashes: list[bytes]) -> list[bytes]:
        fut = asyncio.get_running_loop().create_future()
        self._queries.setdefault(lane.name, collections.deque()).append(fut)
        await lane.write([ops_pb2.SessionUp(query=ops_pb2.BlobQuery(hashes=hashes))])
        reply = await asyncio.wait_for(fut, 60)
        return [bytes(h) for h in reply.missing]

    async def _ask(self, lane: Lane, frame: ops_pb2.SessionUp) -> ops_pb2.TensorData:
        """A fetch of this daemon's own on ``lane``: the tensor's data."""
        seq = next(self._seq)
        frame.fetch.seq = seq
        fut = asyncio.get_running_loop().create_future()
        self._replies[seq] = (lane, fut)
        try:
            await lane.write([frame])
            return await asyncio.wait_for(fut, 60)
        finally:
            self._replies.pop(seq, None)

    # ----- app -> hosts ---------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """Nothing to route: every frame goes to the primary as it is."""
        return not self.inflight and not self.located and not self.seqs

    def route(self, frame: ops_pb2.SessionUp) -> list[tuple[Lane, ops_pb2.SessionUp]]:
        """Where ``frame`` goes, and what goes with it (binds, moved inferences). Raises
        ``NeedPull`` when it names values on another host."""
        kind = frame.WhichOneof("msg")
        primary = self.primary
        if kind == "start":
            return self._start(frame)
        if kind == "arg":
            return self._arg(frame)
        if kind == "abort":
            inf = self.current
            if inf is not None and not inf.lane.primary:
                out = self._move(inf, primary)
                inf.frames.append(frame)
                return [*out, (primary, frame)]
            if inf is not None:
                inf.frames.append(frame)
            return [(primary, frame)]
        if kind == "call":
            self._left()
            call = frame.call
            if call.op == BIND_OP:
                for ref in iter_tensor_refs(call):
                    if ref.WhichOneof("ref") == "persistent" and ref.bind_id:
                        self.weights[ref.bind_id] = bytes(ref.persistent)
            if self.located:
                far = [r.id for r in iter_tensor_refs(call)
                       if r.WhichOneof("ref") == "id" and self._lane_of(r.id) is not None]
                if far:
                    raise NeedPull(far)
            return [(primary, frame)]
        if kind == "fetch":
            lane = self._lane_of(frame.fetch.id)
            return [(lane if lane is not None and lane.alive else primary, frame)]
        if kind == "release":
            return self._release(frame)
        if kind == "define":
            return [(primary, frame), *self.dropped(frame.define.id)]
        return [(primary, frame)]

    def _lane_of(self, tid: int) -> Lane | None:
        """The replica holding value ``tid``; None: the primary."""
        base = base_of(tid)
        if base is None or tid in self.copied:
            return None
        lane = self.located.get(base)
        if lane is not None:
            return lane
        inf = self.inflight.get(base)
        return inf.lane if inf is not None and not inf.lane.primary else None

    def _left(self) -> None:
        inf, self.current = self.current, None
        if inf is not None:
            inf.left = True
            self._settle(inf)

    def _settle(self, inf: Inference) -> None:
        if inf.done and inf.left:
            self.inflight.pop(inf.base, None)
            inf.frames = []

    def _start(self, frame: ops_pb2.SessionUp) -> list[tuple[Lane, ops_pb2.SessionUp]]:
        self._left()
        start = frame.start
        info = self.seqs.get(start.sequence)
        primary = self.primary
        if info is None:
            return [(primary, frame)]
        lane = primary
        if info.pinned is None and self.enabled and not start.position and not start.joined:
            lanes = [primary, *(r for r in self.replicas.values() if r.alive and r.warm
                                and not r.late and start.sequence in r.defined and r.link.up)]
            now = time.monotonic()
            if now - self._spread_at >= REOPEN_S:  # a host back up, or new: offer it the sequence
                self._spread_at = now
                self._spread(info)
            if len(lanes) > 1:
                job = Job(f"{self.app}/{start.sequence}")
                balancer = self.balancer()
                place = getattr(balancer, "place", None)  # optional for a balancer (hookspecs)
                links = [x.link for x in lanes]
                pick = place(links, job) if place is not None else balancer.choose(links)
                lane = next((x for x in lanes if x.link is pick), primary)
        inf = Inference(start.base_id, start.sequence, lane, Job(f"{self.app}/{start.sequence}"),
                        {start.base_id + i for i in info.outputs}, time.monotonic())
        inf.frames.append(frame)
        self.current = inf
        self.inflight[inf.base] = inf
        inf.done = not inf.outputs  # nothing to wait for
        if not inf.done:
            lane.link.inflight += 1
        lane.placed += 1
        out: list[tuple[Lane, ops_pb2.SessionUp]] = [(lane, frame)]
        if not lane.primary:
            self.located[inf.base] = lane
            self.located.move_to_end(inf.base)
            while len(self.located) > LOCATED:
                self.located.popitem(last=False)
            out += self._arm(lane, info)
            after = info.late_after()
            if after is not None:
                asyncio.get_running_loop().call_later(after, self._late, inf, lane)
        return out

    def _late(self, inf: Inference, lane: Lane) -> None:
        """``inf`` is not back from replica ``lane`` in time: the primary runs it too (moved,
        so that the replica's answers, if they come, are dropped)."""
        if (self.closed or inf.done or inf.lane is not lane
                or self.inflight.get(inf.base) is not inf):
            return
        log.info("placed inference late, moved to the primary", host=lane.name, base=inf.base)
        self.counters["late"] += 1
        lane.late = True
        self._queue(self._move(inf, self.primary))

    def _arm(self, lane: Lane, info: SeqInfo) -> list[tuple[Lane, ops_pb2.SessionUp]]:
        """A replica's first inference of ``info``: its weight ids bound, its weight slots named
        (after the start, as the shim names them to the primary)."""
        if info.d.id in lane.armed:
            return []
        lane.armed.add(info.d.id)
        out = []
        for slot, (wid, h) in info.persistent.items():
            out += self._bind(lane, wid, h)
            out.append((lane, ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(
                slot=slot, tensor=ops_pb2.TensorRef(id=wid)))))
        return out

    def _bind(self, lane: Lane, wid: int, h: bytes) -> list[tuple[Lane, ops_pb2.SessionUp]]:
        if wid in lane.bound:
            return []
        lane.bound.add(wid)
        own = next(self._ids)
        call = ops_pb2.OpCall(seq=next(self._seq), op=BIND_OP, out_ids=[own], args=[
            ops_pb2.Value(tensor=ops_pb2.TensorRef(persistent=h, bind_id=wid))])
        return [(lane, ops_pb2.SessionUp(call=call)),
                (lane, ops_pb2.SessionUp(release=release_of([own])))]

    def _arg(self, frame: ops_pb2.SessionUp) -> list[tuple[Lane, ops_pb2.SessionUp]]:
        inf = self.current
        arg = frame.arg
        lane = inf.lane if inf is not None else self.primary
        info = self.seqs.get(inf.seq) if inf is not None else None
        if inf is None or info is None:
            return [(lane, frame)]
        key = (inf.seq, arg.slot)
        which = arg.WhichOneof("value")
        if which == "same_as":
            held = self.data.get((inf.seq, arg.same_as))
            if held is None:  # the host's own business (an error, as without placement)
                return [(lane, frame)]
            version, ref = held
            self.data[key] = held
            resolved = ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=arg.slot, tensor=ref))
            inf.frames.append(resolved)
            if lane.latest.get((inf.seq, arg.same_as)) == version:
                lane.latest[key] = version
                return [(lane, frame)]
            lane.latest[key] = version
            return [(lane, resolved)]
        ref = arg.tensor
        rkind = ref.WhichOneof("ref")
        if rkind == "upload" and arg.slot not in info.persistent:
            version = next(self._versions)
            self.data[key] = (version, ref)
            lane.latest[key] = version
        elif rkind == "id":
            where = self._lane_of(ref.id)
            if arg.slot in info.persistent:
                h = self.weights.get(ref.id)
                if not lane.primary and ref.id not in lane.bound:
                    if h is None:  # a weight this daemon never saw bound: only the primary has it
                        return self._pin_and_move(inf, info, frame, "rebinds its weights")
                    out = self._bind(lane, ref.id, h)
                    inf.frames.append(frame)
                    return [*out, (lane, frame)]
            elif where is not lane and not (where is None and lane.primary):
                if lane.primary:
                    raise NeedPull([ref.id])
                return self._pin_and_move(inf, info, frame, "takes an input that is already "
                                          "on the host (a value of an earlier call)")
        inf.frames.append(frame)
        return [(lane, frame)]

    def _pin_and_move(self, inf: Inference, info: SeqInfo, frame: ops_pb2.SessionUp,
                      why: str) -> list[tuple[Lane, ops_pb2.SessionUp]]:
        info.pinned = why
        log.info("sequence pinned to its primary host", app=self.app, sequence=inf.seq, why=why)
        out = self._move(inf, self.primary)
        inf.frames.append(frame)
        return [*out, (self.primary, frame)]

    def _move(self, inf: Inference, to: Lane) -> list[tuple[Lane, ops_pb2.SessionUp]]:
        """Run ``inf`` on ``to`` instead: its start and arguments so far sent there (weights and
        data as ``to`` needs them), its old host told to drop it."""
        old = inf.lane
        out: list[tuple[Lane, ops_pb2.SessionUp]] = []
        if old.alive and not old.primary:
            out.append((old, ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=0))))
        self.left_behind[(inf.base, id(old))] = None
        while len(self.left_behind) > LOCATED:
            self.left_behind.popitem(last=False)
        if not inf.done:
            old.link.inflight -= 1
        inf.lane = to
        if not inf.done:
            to.link.inflight += 1
        to.placed += 1
        inf.moved += 1
        self.located.pop(inf.base, None)
        if not to.primary:
            self.located[inf.base] = to
        info = self.seqs.get(inf.seq)
        for k, f in enumerate(inf.frames):
            out.append((to, f))
            if k == 0 and info is not None and not to.primary:
                out += self._arm(to, info)
            if f.WhichOneof("msg") == "arg" and f.arg.tensor.WhichOneof("ref") == "upload":
                held = self.data.get((inf.seq, f.arg.slot))
                if held is not None and held[1] is f.arg.tensor:
                    to.latest[(inf.seq, f.arg.slot)] = held[0]
        self.counters["moved"] += 1
        return out

    def _release(self, frame: ops_pb2.SessionUp) -> list[tuple[Lane, ops_pb2.SessionUp]]:
        """Each released id to the host that holds it (a pulled one: both)."""
        if not self.located and not self.copied:
            return [(self.primary, frame)]
        far: dict[int, tuple[Lane, list[int]]] = {}
        here: list[int] = []
        for tid in released_ids(frame.release):
            if tid in self.copied:
                self.copied.discard(tid)
                here.append(tid)
            lane = self._lane_of(tid)
            if lane is None:
                if not here or here[-1] != tid:
                    here.append(tid)
            elif lane.alive:
                far.setdefault(id(lane), (lane, []))[1].append(tid)
        if not far:
            return [(self.primary, frame)]
        out = [(lane, ops_pb2.SessionUp(release=release_of(ids))) for lane, ids in far.values()]
        if here:
            out.append((self.primary, ops_pb2.SessionUp(release=release_of(here))))
        if frame.release.HasField("progress"):  # each host checks whether the replay is its own
            for _lane, f in out:
                f.release.progress.CopyFrom(frame.release.progress)
        return out

    async def pull(self, ids: list[int]) -> dict[int, ops_pb2.TensorData]:
        """The values of ``ids`` from the replicas that hold them; the sequences that made them
        are pinned (their outputs are used on the host). Raises ``Unplaceable`` when a holder
        is gone."""
        values = {}
        for tid in dict.fromkeys(ids):
            lane = self._lane_of(tid)
            if lane is None:
                continue
            inf = self.inflight.get(base_of(tid) or 0)
            if inf is not None and (info := self.seqs.get(inf.seq)) is not None:
                info.pinned = info.pinned or "its outputs are used by later calls on the host"
            if not lane.alive:
                raise Unplaceable(f"value {tid} was computed on GPU host {lane.name}, which is "
                                  "lost")
            try:
                values[tid] = await self._ask(lane, ops_pb2.SessionUp(fetch=ops_pb2.Fetch(id=tid)))
            except (grpc.aio.AioRpcError, TimeoutError, RuntimeError) as exc:
                raise Unplaceable(f"value {tid} could not be copied from GPU host {lane.name}: "
                                  f"{exc}") from None
            self.counters["pulled"] += 1
        return values

    def rewrite(self, frame: ops_pb2.SessionUp, values: dict[int, ops_pb2.TensorData]) -> ops_pb2.SessionUp:
        """``frame`` with each ref to a pulled value replaced by its data (bound to the same id,
        so that later frames find it on this host)."""
        frame = ops_pb2.SessionUp.FromString(frame.SerializeToString())
        refs = (iter_tensor_refs(frame.call) if frame.WhichOneof("msg") == "call"
                else [frame.arg.tensor])
        for ref in refs:
            if ref.WhichOneof("ref") == "id" and ref.id in values:
                tid = ref.id
                ref.upload.CopyFrom(values[tid])
                ref.bind_id = tid
                if frame.WhichOneof("msg") == "call":  # bound there: later frames find it
                    self.copied.add(tid)
        return frame

    # ----- hosts -> app ---------------------------------------------------------------------
    def from_host(self, lane: Lane, down: ops_pb2.SessionDown) -> bool:
        """Whether ``lane``'s frame goes on to the app; bookkeeping of the inferences."""
        kind = down.WhichOneof("msg")
        if lane.late and kind in ("fetched", "answer"):
            lane.late = False  # it answers again: it may get inferences again
        if self._warming and not lane.primary and self._warm_frame(kind, down):
            return False
        if self.left_behind and not lane.primary:
            base = down_base(kind, down)
            if base and (base, id(lane)) in self.left_behind:
                return False
        if kind == "fetched":
            f = down.fetched
            if f.seq >= OWN_SEQ:
                waiter = self._replies.get(f.seq)
                if waiter is not None and not waiter[1].done():
                    waiter[1].set_result(f.tensor)
                return False
            if f.seq == 0:
                return self._output(lane, f.id)
            return True
        if kind == "answer":
            inf = self.inflight.get(down.answer.base_id)
            if inf is None:
                return True
            if inf.lane is not lane or down.answer.position in inf.answered:
                return False
            inf.answered.add(down.answer.position)
            return True
        if kind == "error":
            err = down.error
            if err.seq >= OWN_SEQ:
                waiter = self._replies.get(err.seq)
                if waiter is not None and not waiter[1].done():
                    waiter[1].set_exception(RuntimeError(f"{err.code}: {err.message}"))
                elif waiter is None:
                    log.warning("replica refused a bind", host=lane.name, code=err.code,
                                error=err.message)
                return False
            if err.base_id:
                inf = self.inflight.get(err.base_id)
                return inf is None or inf.lane is lane
            return True
        if kind == "result":
            return down.result.seq < OWN_SEQ
        if kind in ("replayed", "sizes"):
            inf = self.inflight.get(down_base(kind, down))  # type: ignore[arg-type]
            return inf is None or inf.lane is lane
        return True

    def _warm_frame(self, kind: str, down: ops_pb2.SessionDown) -> bool:
        """Whether ``down`` is of a warm-up (``_warm``): its outputs and answers are this
        daemon's, its failure ends the warm-up."""
        base = down_base(kind, down)
        warming = self._warming.get(base) if base else None
        if warming is None:
            return False
        done, outputs = warming
        if kind == "fetched":
            outputs.discard(down.fetched.id)
        if (kind == "error" or not outputs) and not done.done():
            done.set_result(None)
        return True

    def _output(self, lane: Lane, tid: int) -> bool:
        base = base_of(tid)
        inf = self.inflight.get(base) if base is not None else None
        if inf is None:
            return True
        if inf.lane is not lane or tid in inf.delivered:
            return False  # from the host it left, or already delivered before it moved
        inf.delivered.add(tid)
        if not inf.done and inf.outputs <= inf.delivered:
            inf.done = True
            lane.link.inflight -= 1
            info = self.seqs.get(inf.seq)
            if info is not None and not inf.moved:
                info.times.append(time.monotonic() - inf.started)
            observe = getattr(self.balancer(), "observe", None)
            try:
                if observe is not None:
                    observe(lane.link, inf.job, time.monotonic() - inf.started)
            except Exception:  # a balancer's bug must not cost the app its output
                log.exception("balancer observe failed", balancer=type(self.balancer()).__name__)
            self._settle(inf)
        return True

    async def _down(self, lane: Lane) -> None:
        """A replica's messages: its answers to this daemon, and the app's outputs."""
        why = "stream ended"
        try:
            opened = ops_pb2.SessionOpen()
            opened.CopyFrom(self.open_request)
            opened.part_bytes = lane.link.part_bytes or 0  # (its own link's)
            await lane.write([ops_pb2.SessionUp(open=opened)])
            parts = Parts(ops_pb2.SessionDown)
            note = getattr(lane.link, "note_progress", None)  # (a test's stand-in may lack it)
            while (message := await lane.call.read()) is not grpc.aio.EOF:
                if note is not None:
                    note()  # the link moves: a ping queued behind this is not lost
                try:
                    whole = parts.take(message)  # (``wire.cut``)
                except ValueError as exc:
                    why = f"bad parts: {exc}"
                    break
                if whole is None:
                    continue
                message = whole[0]
                frames = (message.batch.frames if message.WhichOneof("msg") == "batch"
                          else (message,))
                for down in frames:
                    kind = down.WhichOneof("msg")
                    if kind == "ready":
                        if lane.opened is not None and not lane.opened.done():
                            lane.opened.set_result(None)
                        continue
                    if kind == "defined":
                        fut = self._acks.get((lane.name, down.defined.id))
                        if fut is not None and not fut.done():
                            fut.set_result(down.defined)
                        continue
                    if kind == "query":
                        waiting = self._queries.get(lane.name)
                        if waiting:
                            fut = waiting.popleft()
                            if not fut.done():
                                fut.set_result(down.query)
                        continue
                    if not self.from_host(lane, down):
                        continue
                    if kind == "error" and not down.error.base_id and not down.error.seq:
                        self._refused(lane, down.error)
                        continue
                    if self.to_app is not None:
                        await self.to_app(down)
        except grpc.aio.AioRpcError as exc:
            why = f"{exc.code().name} {exc.details()}"
        except asyncio.CancelledError:
            if lane.alive:
                why = "closed"
                self._lost(lane, why)
            raise
        self._lost(lane, why)

    def _refused(self, lane: Lane, err: ops_pb2.Error) -> None:
        """A replica could not replay a sequence (it lost or refused it, a frame broke it): its
        inferences of that sequence in flight go to the primary, which will serve the next."""
        log.warning("replica failed a sequence", host=lane.name, code=err.code, error=err.message,
                    sequence=err.sequence)
        if not err.sequence:
            return
        lane.defined.discard(err.sequence)
        lane.armed.discard(err.sequence)
        out: list[tuple[Lane, ops_pb2.SessionUp]] = []
        for inf in list(self.inflight.values()):
            if inf.lane is lane and inf.seq == err.sequence and not inf.done:
                out += self._move(inf, self.primary)
                self.counters["failovers"] += 1
        self._queue(out)

    def _queue(self, out: list[tuple[Lane, ops_pb2.SessionUp]]) -> None:
        """Frames to send outside the app's flow: before the next frames of their lanes."""
        if out and not self.closed:
            self.pending += out
            if self.resend is not None:
                self._spawn(self.resend([]))

    def take(self, lane: Lane) -> list[ops_pb2.SessionUp]:
        """The queued frames for ``lane`` (called under its lock, before other frames)."""
        if not self.pending:
            return []
        mine = [f for x, f in self.pending if x is lane]
        self.pending = [(x, f) for x, f in self.pending if x is not lane]
        return mine

    def lose(self, link: HostLink, why: str, lane: Lane | None = None) -> None:
        """``link`` went down (its ping loop gave up), or its replica ``lane`` stopped taking
        frames: the replica is lost (``_lost``)."""
        lane = lane or self.replicas.get(link.name)
        if lane is None or lane.link is not link or not lane.alive or lane.primary:
            return
        self._lost(lane, why)
        lane.call.cancel()

    def _lost(self, lane: Lane, why: str) -> None:
        """A replica gone: its inferences in flight move to the primary (``resend``)."""
        if not lane.alive:
            return
        lane.alive = False
        lane.link.sessions -= 1
        if lane.opened is not None and not lane.opened.done():
            lane.opened.set_exception(RuntimeError(f"replica lost: {why}"))
            lane.opened.exception()  # retrieved: nobody may be waiting
        waiting = [f for w, f in self._replies.values() if w is lane]
        for fut in [*waiting, *self._queries.pop(lane.name, ())]:
            if not fut.done():
                fut.set_exception(RuntimeError(f"GPU host {lane.name} lost: {why}"))
        out: list[tuple[Lane, ops_pb2.SessionUp]] = []
        for inf in list(self.inflight.values()):
            if inf.lane is lane and not inf.done:
                log.warning("failing over a placed inference", host=lane.name, why=why,
                            base=inf.base, to=self.primary.name)
                out += self._move(inf, self.primary)
                self.counters["failovers"] += 1
        self._queue(out)

    async def close(self) -> None:
        self.closed = True
        for task in list(self._tasks):
            task.cancel()
        for lane in self.replicas.values():
            if lane.alive:
                lane.alive = False
                lane.link.sessions -= 1
            lane.call.cancel()
            if lane.task is not None:
                lane.task.cancel()
        await asyncio.gather(*self._tasks, *(x.task for x in self.replicas.values() if x.task),
                             return_exceptions=True)
