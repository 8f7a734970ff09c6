"""One app's session relayed to its GPU host: the per-frame hot path of every offloaded inference.

``AppRelay`` has four steps. ``open`` sends ``SessionOpen`` on the host's Session stream, waits
for ``ready`` and welcomes the app. ``run`` then moves frames both ways until either side ends:
``up`` relays each burst of frames the app wrote together (app -> host, in as few gRPC messages
as their size allows) and hands each frame to the session's recorder; ``down`` is a task that
relays the host's messages (host -> app, one socket write per message) and turns the host's
answers to sequence definitions into definitions for the shim. ``close`` ends the host stream
and the recorder. A lost host ends the session with a ``HOST_LOST`` error frame, a host that
refuses the session at open (its session limit, its access rules) with ``HOST_REFUSED`` in place
of the welcome, a malformed app frame with that frame's error code: the app raises or falls back
to local execution, it never gets a wrong answer. A host is lost when its stream breaks or ends,
or when its link's ping loop declares it down (``lose_host``, called by the robot role): a host
that stalls with its connection open leaves the stream waiting, so the ping loop's bound is what
the app waits.

``run`` awaits the app's frames directly, not a wait on both directions per burst; the host
stream's end interrupts it (a cancel), and so does ``lose_host``. ``phase`` names who ended
first, so that cancel is told apart from the daemon stopping.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import structlog

from rrto.v1 import local_pb2, ops_pb2
from rrtod import framing, shared_uploads
from rrtod.framing import JOIN_BYTES, FrameError, FrameReader, encode
from rrtod.grpc_options import BATCH_BYTES
from rrtod.robot.host_link import SWITCH_PROBE_BYTES, HostLink
from rrtod.robot.oplog import NUMBERS
from rrtod.robot.placement import Lane, NeedPull, Placement, Unplaceable
from rrtod.robot.recorder import Recorder
from rrtod.robot.scheduling import SessionPlacer, throughput
from rrtod.wire import Parts, cut, session_prefix, session_size

log = structlog.get_logger("rrtod.robot")

PROBE_EVERY_S = 0.25  # the least time between probes of the link for plan switching
PROBE_MAX_S = 1.0  # and the most, while the link stays in its band
REPLICA_WRITE_S = 1.0  # a replica's stream that takes no frames this long: the replica is lost

# How a GPU host that is up says no to a new session (``rrtod/gpu/service.py``): its session
# limit (``executor.max_sessions``, an access rule's ``max_sessions``), its access rules, a
# backend it lacks. The app is told ``HOST_REFUSED`` before any welcome: its shim then runs
# locally or fails with the reason (``intercept.fallback``), as when no host is up.
REFUSALS = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED,
                      grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
                      grpc.StatusCode.INVALID_ARGUMENT})


class AppSession:
    """Robot-side view of one app process's session: who it is and what it has cost (what
    ``rrtoctl status`` shows). Its ``AppRelay`` keeps the counters current."""

    def __init__(self, sid: str, hello: local_pb2.AppHello, cred: tuple[int, int, int],
                 host: HostLink, recorder: Recorder | None = None):
        self.id = sid
        self.app = hello.app
        self.pid, self.uid, self.gid = cred
        self.argv = list(hello.argv)
        self.versions = dict(hello.versions)  # what the app runs, as its shim says
        self.host_versions: dict[str, str] = {}  # what the host's executor runs (its ready)
        self.host = host
        self.host_session: str | None = None
        self.opened = time.time()
        self.calls = 0
        self.frames_up = self.frames_down = 0
        self.bytes_up = self.bytes_down = 0
        self.inferences = 0
        self.shared_uploads = 0  # uploads that came through the shared region
        self.state = "opening"  # then "active"; "host-lost" when the host stream broke,
        # "refused" when the host refused to open it
        self.recorder = recorder
        self.placement: Placement | None = None  # per-inference placement, when on
        self.placer: SessionPlacer | None = None  # the scheduler's, when one splits

    def describe(self) -> dict[str, Any]:
        placement = self.placement.describe() if self.placement is not None else None
        return {
            "placement": placement, **{
            "id": self.id, "app": self.app, "pid": self.pid, "uid": self.uid,
            "host": self.host.name, "host_session": self.host_session, "state": self.state,
            "opened": self.opened, "ops_forwarded": self.calls, "frames_up": self.frames_up,
            "frames_down": self.frames_down, "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down, "inferences": self.inferences,
            "shared_uploads": self.shared_uploads,
            "record": self.recorder.describe() if self.recorder else None,
            "scheduling": self.placer.describe() if self.placer is not None else None,
            "versions": self.versions, "host_versions": self.host_versions,
        }}


class Phase(enum.Enum):
    """Where a relay is: ``OPENING`` until ``run``; ``RELAYING`` while frames flow both ways;
    then ``HOST_ENDED`` if the host stream ended first or the host's link went down (``run`` is
    being interrupted), or ``UP_ENDED`` if ``run`` ended first (app closed, bad frame, daemon
    stopping: ``down`` is cancelled by the relay, its end is not the host's); ``CLOSED`` after
    ``close``."""

    OPENING = "opening"
    RELAYING = "relaying"
    HOST_ENDED = "host-ended"
    UP_ENDED = "up-ended"
    CLOSED = "closed"


class _Batched:
    """An app burst's frames for the session's one host, in messages of at most
    ``BATCH_BYTES`` (a large tensor alone)."""

    def __init__(self, relay: AppRelay):
        self.relay = relay
        self.batch: list[ops_pb2.SessionUp] = []
        self.size = 0

    async def add(self, frame: ops_pb2.SessionUp, n: int) -> None:
        if self.batch and self.size + n > BATCH_BYTES:
            await self.flush()
        self.batch.append(frame)
        self.size += n

    async def flush(self) -> None:
        batch, self.batch, self.size = self.batch, [], 0
        await self.relay._send_up(batch)


class _Routed:
    """An app burst's frames, each to the host ``Placement.route`` says; values a frame names on
    another host are copied first (``NeedPull``). The recorder sees the app's frames as sent."""

    def __init__(self, relay: AppRelay):
        assert relay.placement is not None
        self.relay = relay
        self.placement = relay.placement
        self.routed: list[tuple[Lane, ops_pb2.SessionUp]] = []
        self.seen: list[ops_pb2.SessionUp] = []
        self.sizes: dict[int, int] = {}  # id of an app frame routed as it is -> its bytes

    async def add(self, frame: ops_pb2.SessionUp, n: int) -> None:
        try:
            self.routed += self.placement.route(frame)
        except NeedPull as need:
            await self.flush()  # what came before goes first
            values = await self.placement.pull(need.ids)
            self.routed += self.placement.route(self.placement.rewrite(frame, values))
        self.seen.append(frame)
        self.sizes[id(frame)] = n

    async def flush(self) -> None:
        routed, seen, sizes = self.routed, self.seen, self.sizes
        self.routed, self.seen, self.sizes = [], [], {}
        await self.relay._send_lanes(routed, sizes)
        await self.relay._observe_up(seen)


async def _write(call: grpc.aio.StreamStreamCall, frames: list[ops_pb2.SessionUp],
                 link: Any = None, size: int | None = None) -> None:
    """``frames`` as one gRPC message (a ``SessionUpBatch`` when several); ``link``'s data
    moved once the host's flow control took it. On a link measured slow, a message longer
    than its ``part_bytes`` goes in parts (``wire.cut``): the host says it has each
    (``PartsReceived``, read in ``down``), a sign that the link moves for a ping queued
    behind it, where a completed write is none once buffers took it. ``size``: the frames'
    bytes, if known (else counted only where the link is slow)."""
    if not frames:
        return
    message = frames[0] if len(frames) == 1 else ops_pb2.SessionUp(
        batch=ops_pb2.SessionUpBatch(frames=frames))
    part = getattr(link, "part_bytes", None)
    if part is not None and (size if size is not None else message.ByteSize()) > part:
        for piece in cut(message, part):
            await call.write(piece)
            _moved(link)
        return
    await call.write(message)
    _moved(link)


def _moved(link: Any) -> None:
    """Session data moved on ``link`` (``HostLink.note_progress``: a ping queued behind it is
    not a lost one); a stand-in link in a test may lack it."""
    note = getattr(link, "note_progress", None)
    if note is not None:
        note()


_SEARCH_OVER = ops_pb2.SessionDown(search=ops_pb2.SearchHint(running=False))


def _framed(session: AppSession, frame: ops_pb2.SessionDown) -> tuple[bytes, bytes]:
    """``frame`` as the app's socket carries it (prefix, body), counted as sent to the app."""
    body = frame.SerializeToString()
    head = session_prefix(len(body))
    session.frames_down += 1
    session.bytes_down += len(head) + len(body)
    return head, body


def error_reply(code: str, message: str) -> local_pb2.LocalReply:
    return local_pb2.LocalReply(error=ops_pb2.Error(code=code, message=message))


class AppRelay:
    """Relays one app session between the app's unix socket and its host's Session stream."""

    def __init__(self, session: AppSession, call: grpc.aio.StreamStreamCall,
                 frames: FrameReader, writer: asyncio.StreamWriter, energy: Any = None,
                 placement: Placement | None = None, placer: SessionPlacer | None = None,
                 shared_bytes: int = 0):
        self.session = session
        # The app's shared region for large uploads, made at the welcome (``open``) when
        # ``shared_bytes`` is not 0; None: everything comes on the socket.
        self.shared_bytes = shared_bytes
        self.shared: shared_uploads.Region | None = None
        # The scheduler's placement of a sequence's calls (``rrtod.robot.scheduling``), applied
        # to each definition on its way to the host and renewed as profiles come in; None:
        # every call runs there.
        self.placer = session.placer = placer
        self._placing: set[asyncio.Task[None]] = set()  # placements being renewed
        # The replays the app started since its last inference mark: (sequence, plan), or
        # None for a join (an inference switched to a variant); timed by the next mark.
        self._started: list[tuple[int, int] | None] = []
        self._probing = False  # a probe of the link's throughput is under way
        self._probed_at = 0.0  # when the last one started (time.monotonic)
        self._probe_every = PROBE_EVERY_S
        self._saw_link = False  # a replay since the last mark measured the link (ReplayTiming)
        self._host_plans: dict[int, int] = {}  # per sequence, how many plans the host holds
        self.recorder = session.recorder
        self.call = call
        self.frames = frames  # the app's frames, within the socket's limits
        self.writer = writer
        self.energy = energy  # the EnergyAccountant, or None
        # Per-inference placement (placement.py), or None: then every frame goes to ``call``.
        self.placement = session.placement = placement
        self.lane = placement.primary if placement is not None else Lane(session.host, call, True)
        self.write_lock = self.lane.lock  # frames and sequence pushes share the host stream
        if placement is not None:
            placement.to_app = self._to_app
            placement.resend = self._send_lanes
        self.phase = Phase.OPENING
        self.lost: str | None = None  # why the host's link went down (``lose_host``)
        self._hinted = False  # the app was told a search is running (``SearchHint``)
        self._stated_part = 0  # the part size the host cuts its replies at, as stated to it
        self._inference_s = 0.0  # how long the app's last inference took (its mark)
        self._task: asyncio.Task[Any] | None = None  # the one running ``serve``
        self.log = log.bind(session=session.id, app=session.app, pid=session.pid,
                            host=session.host.name)

    async def serve(self, request: ops_pb2.SessionOpen) -> None:
        """The whole session: open, relay until either side ends, close. A lost host or a
        malformed app frame is answered to the app with an error frame, not raised."""
        task = self._task = asyncio.current_task()
        assert task is not None
        try:
            await self.open(request)
            await self.run()
        except grpc.aio.AioRpcError as exc:
            host = self.session.host
            if self.phase is Phase.OPENING and exc.code() in REFUSALS:
                # The host answered, and said no (a session limit, its access rules): the app
                # gets no session, as when no host is up, and the host serves on.
                self.log.warning("host refused session", code=exc.code().name,
                                 details=exc.details())
                self.session.state = "refused"
                await self.fail("HOST_REFUSED", f"GPU host {host.name} ({host.address}) "
                                                f"refused the session: {exc.code().name} "
                                                f"{exc.details()}")
                return
            self.log.warning("host lost", code=exc.code().name, details=exc.details())
            await self._host_lost(f"{exc.code().name} {exc.details()}")
        except asyncio.CancelledError:
            if self.lost is None or task.uncancel() > 0:
                raise  # the daemon is stopping
            self.log.warning("host lost", reason=self.lost)
            await self._host_lost(self.lost)
        except FrameError as exc:
            self.log.warning("bad frame from app", uid=self.session.uid, code=exc.code,
                             error=str(exc))
            await self.fail(exc.code, str(exc))
        except Unplaceable as exc:  # a value the app needs was on a replica that is gone
            self.log.warning("host lost", reason=str(exc))
            await self._host_lost(str(exc))
        finally:
            self.close()
            if self.placement is not None:
                await self.placement.close()

    async def _host_lost(self, why: str) -> None:
        self.session.state = "host-lost"
        host = self.session.host
        await self.fail("HOST_LOST", f"GPU host {host.name} ({host.address}) lost: {why}")

    def lose_host(self, why: str) -> None:
        """The host's link went down (its ping loop gave up): end the session now, as
        ``HOST_LOST`` with ``why``, its stream cancelled, whatever the relay waits for (the
        host's ``ready``, an app frame, room on the host stream). Nothing to do once the host
        stream or the app has ended the relay, or before ``serve``."""
        if (self.lost is not None or self._task is None or self._task.done()
                or self.phase not in (Phase.OPENING, Phase.RELAYING)
                or self.session.state == "host-lost"):  # already telling the app
            return
        self.lost = why
        if self.phase is Phase.RELAYING:
            self.phase = Phase.HOST_ENDED  # the down task's end is not a second interruption
        self.call.cancel()
        self._task.cancel()

    async def open(self, request: ops_pb2.SessionOpen) -> None:
        """Open the host's session and welcome the app."""
        session = self.session
        self._stated_part = request.part_bytes
        await self.call.write(ops_pb2.SessionUp(open=request))
        first = await self.call.read()
        if first is grpc.aio.EOF or first.WhichOneof("msg") != "ready":
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNKNOWN, None, None, "no ready frame")
        session.host_session = first.ready.session
        session.host_versions = dict(first.ready.versions)
        session.state = "active"
        welcome = local_pb2.AppWelcome(session=session.id, host=session.host.name,
                                       device=first.ready.device)
        self._welcome(welcome)
        await self.writer.drain()
        self.log.info("app session opened", host_session=session.host_session)
        if self.energy is not None:
            self.energy.track_process(session.id, session.pid)  # the app's CPU, for the model meter
            self.energy.set_state(session.id, "standby")

    def _welcome(self, welcome: local_pb2.AppWelcome) -> None:
        """Write the welcome, with the shared upload region's descriptor where the app asked
        for one and this daemon can make it (else the app uploads on the socket)."""
        region = None
        sock = self.writer.get_extra_info("socket") if self.shared_bytes else None
        if sock is not None:
            try:
                region = shared_uploads.Region(self.shared_bytes, f"rrto-upload-{self.session.id}")
            except OSError as exc:  # no memfd here, or no memory for its mapping
                self.log.warning("no shared upload region", error=str(exc))
        if region is None:
            self.writer.write(encode(local_pb2.LocalReply(welcome=welcome)))
            return
        welcome.shared_bytes = region.size
        data = encode(local_pb2.LocalReply(welcome=welcome))
        try:  # nothing was written to the app before: its first bytes carry the descriptor
            sent = region.send_welcome(sock, data)
        except OSError as exc:
            region.close()
            self.log.warning("no shared upload region", error=str(exc))
            welcome.shared_bytes = 0
            self.writer.write(encode(local_pb2.LocalReply(welcome=welcome)))
            return
        self.shared = region
        if sent < len(data):
            self.writer.write(data[sent:])

    def _acked(self) -> bytes:
        """The shared region's acknowledgement, due with the next write to the app."""
        return self.shared.ack() if self.shared is not None else b""

    async def run(self) -> None:
        """Relay until the app closes (returns), the host ends the stream (``AioRpcError``),
        or an app frame is malformed (``FrameError``)."""
        relay = asyncio.current_task()
        assert relay is not None

        def host_ended(task: asyncio.Task[None]) -> None:
            if self.phase is Phase.RELAYING and not task.cancelled():
                self.phase = Phase.HOST_ENDED
                relay.cancel()

        self.phase = Phase.RELAYING
        down = asyncio.get_running_loop().create_task(self.down())
        down.add_done_callback(host_ended)
        try:
            while (requests := await self.frames.read()) is not None:  # None: app closed
                if framing.TRACING:
                    framing.hop("robot.up.read")
                await self.up(requests, self.frames.sizes)
                if framing.TRACING:
                    framing.hop("robot.up.relayed")
        except asyncio.CancelledError:
            if self.phase is not Phase.HOST_ENDED or self.lost is not None:
                raise  # the daemon is stopping, or the link went down (``serve`` says so)
            relay.uncancel()
            down.result()  # raises if the host stream broke
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None,
                                       "host closed the session") from None
        finally:
            if self.phase is Phase.RELAYING:
                self.phase = Phase.UP_ENDED
            down.cancel()
            await asyncio.gather(down, return_exceptions=True)

    async def up(self, requests: list[local_pb2.LocalRequest],
                 sizes: list[int] | None = None) -> None:
        """Relay frames the app wrote together. Its session frames go to the host in as few
        gRPC messages as their size allows (a ``SessionUpBatch``): each message on the stream
        costs handoffs between threads and processes worth far more than a small frame; with
        per-inference placement, to the hosts ``Placement.route`` says (``_Routed``). Energy
        bookkeeping (~0.1 ms a state change with the model meter) is done once the frames are
        on their way, not before. Frames before a malformed one are relayed, then
        ``FrameError`` is raised. ``sizes``: each request's bytes on the app's socket, where
        the reader has them (else counted by serializing each frame again)."""
        session, rec = self.session, self.recorder
        out = (_Routed(self) if self.placement is not None and self.placement.seqs
               else _Batched(self))
        energy: list[local_pb2.InferenceMark | None] = []  # None: communication starts
        bad: FrameError | None = None
        for k, request in enumerate(requests):
            kind = request.WhichOneof("msg")
            if kind == "session":
                frame = request.session
                n = session_size(sizes[k]) if sizes is not None else frame.ByteSize()
                session.frames_up += 1
                session.bytes_up += n
                fkind = frame.WhichOneof("msg")
                if fkind == "start":
                    st = frame.start
                    if self.placer is not None:  # timed by the next mark
                        self._started.append(None if st.position else (st.sequence, st.plan))
                    if st.here:  # run by the app whole: the host has no call to run for it
                        if rec is not None:  # logged as any start, after the frames before it
                            await out.flush()
                            await self._observe_up([frame])
                        continue
                if fkind == "call":
                    session.calls += 1
                if not energy or energy[-1] is not None:
                    energy.append(None)
                if fkind == "define" and rec is not None:  # the shim gave one up
                    rec.drop(frame.define.id, forget=True)
                if fkind in ("part", "part_bytes"):  # the robot daemon's own, towards its host
                    bad = FrameError(f"a {fkind} frame from an app: the robot daemon's only")
                    break
                if fkind == "profile":  # the robot's times: for this daemon's scheduler
                    self._profile_later(frame.profile, robot_side=True)
                    continue
                await out.add(frame, n)
                if fkind == "query":  # restored definitions follow the query on the stream
                    await out.flush()
            elif kind == "shared_upload" and self.shared is not None:
                try:  # copied out of the region: acknowledged with the next write to the app
                    frame, n = self.shared.frame(request.shared_upload)
                except FrameError as exc:
                    bad = exc
                    break
                session.frames_up += 1
                session.bytes_up += n
                session.shared_uploads += 1
                if not energy or energy[-1] is not None:
                    energy.append(None)
                await out.add(frame, n)
            elif kind == "mark":
                session.inferences += 1
                energy.append(request.mark)
                self._inference_s = max(0, request.mark.end_ns - request.mark.start_ns) / 1e9
                if self.placer is not None:
                    self._timed(request.mark)
                if rec is not None:
                    rec.app_waited(request.mark.search_wait_us / 1e6)
                    if rec.searching:  # the search sees the inference whole: the frames
                        await out.flush()  # before the mark are logged first
                    wait = rec.hint_wait()  # asked before the inference counts, as at a download
                    due = rec.inference_ended(request.mark.thread)
                    if wait is None or not due:  # a variant of a sequence in use, searched?
                        wait = rec.variant_wait(request.mark.thread, due)
                    if wait is not None and not self._hinted:
                        await self._hint(wait)  # the app's calls wait at the next one
                    if due:
                        rec.request_search(self._push_found, self._search_ended)
                if request.mark.left_replay and not self._hinted:
                    await self._tell_app(_SEARCH_OVER)  # no search for it: the app goes on
            else:
                bad = FrameError(f"unexpected {kind or 'empty'} frame inside an app session")
                break
        await out.flush()  # before a bad frame too
        if self.energy is not None:
            self._account(energy)
        if bad is not None:
            raise bad

    async def _send_lanes(self, routed: list[tuple[Lane, ops_pb2.SessionUp]],
                          sizes: dict[int, int] | None = None) -> None:
        """Each lane's frames (after those queued for it by a failover), in order, in messages
        of at most ``BATCH_BYTES`` (a large tensor alone). ``sizes``: the bytes of the app's
        frames among them, by ``id`` (the others are counted by serializing them)."""
        placement = self.placement
        lanes: dict[int, tuple[Lane, list[ops_pb2.SessionUp]]] = {}
        for lane, _ in placement.pending if placement is not None else ():
            lanes.setdefault(id(lane), (lane, []))
        for lane, frame in routed:
            lanes.setdefault(id(lane), (lane, []))[1].append(frame)
        if len(lanes) > 1:  # a stalled host's stream must not hold up the others
            await asyncio.gather(*(self._send_lane(lane, frames, sizes)
                                   for lane, frames in lanes.values()))
        elif lanes:
            await self._send_lane(*next(iter(lanes.values())), sizes)

    async def _send_lane(self, lane: Lane, frames: list[ops_pb2.SessionUp],
                         sizes: dict[int, int] | None = None) -> None:
        """A replica that does not take its frames within ``REPLICA_WRITE_S`` (stalled, its
        stream full) is lost: its inferences go to the primary, the app is not held up."""
        if not lane.alive:
            return
        if lane.primary:
            await self._write_lane(lane, frames, sizes)
            return
        try:
            await asyncio.wait_for(self._write_lane(lane, frames, sizes), REPLICA_WRITE_S)
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            if self.placement is not None:
                self.placement.lose(lane.link, f"frames not taken: {exc!r}", lane)

    async def _write_lane(self, lane: Lane, frames: list[ops_pb2.SessionUp],
                          sizes: dict[int, int] | None = None) -> None:
        placement = self.placement
        async with lane.lock:
            todo = (placement.take(lane) if placement is not None else []) + frames
            batch: list[ops_pb2.SessionUp] = []
            size = 0
            for f in todo:
                n = sizes.get(id(f)) if sizes else None
                if n is None:
                    n = f.ByteSize()
                if batch and size + n > BATCH_BYTES:
                    await _write(lane.call, batch, lane.link, size)
                    batch, size = [], 0
                batch.append(f)
                size += n
            await _write(lane.call, batch, lane.link, size)

    async def _to_app(self, frame: ops_pb2.SessionDown) -> None:
        """A replica's frame for the app (``Placement``): logged as the primary's would be."""
        rec = self.recorder
        what = frame.WhichOneof("msg")
        if rec is not None:
            if what == "answer":
                rec.observe_answer(frame.answer)
            elif what == "fetched":
                rec.observe_fetched(frame.fetched)
            elif what == "replayed":
                rec.observe_replayed(frame.replayed)
                return
        self.writer.write(self._acked() + b"".join(_framed(self.session, frame)))
        await self.writer.drain()

    def _account(self, events: list[local_pb2.InferenceMark | None]) -> None:
        """Energy states and inference marks, in the order the app sent them."""
        sid = self.session.id
        for m in events:
            if m is None:
                self.energy.set_state(sid, "communication")
            else:
                self.energy.inference(sid, m.index, m.start_ns, m.end_ns)
                self.energy.set_state(sid, "standby")  # the inference has ended

    async def _send_up(self, frames: list[ops_pb2.SessionUp]) -> None:
        """One gRPC message for ``frames``; then the recorder sees each, in order."""
        if not frames:
            return
        rec = self.recorder
        hinted = (not self._hinted and rec is not None
                  and await self._hint_search(rec, frames))
        link = self.session.host
        async with self.write_lock:
            part = getattr(link, "part_bytes", None) or 0
            if part != self._stated_part:  # the link was measured again: the host cuts so too
                self._stated_part = part
                await self.call.write(ops_pb2.SessionUp(part_bytes=part))
            await _write(self.call, frames, link)
        if framing.TRACING:
            framing.hop("robot.up.written")
        await self._observe_up(frames)
        if hinted:
            await self._search_ended()  # over at once if no search was started after all

    async def _observe_up(self, frames: list[ops_pb2.SessionUp]) -> None:
        """The recorder sees each app frame, in order; a query brings back saved sequences."""
        rec = self.recorder
        if rec is None:
            return
        for frame in frames:
            if rec.observe(frame):
                rec.request_search(self._push_found, self._search_ended)
            if frame.WhichOneof("msg") == "query":
                for d in rec.restorable():
                    await self.push_sequence(d)

    async def down(self) -> None:
        """Relay the host's messages to the app until the host ends the stream. A host's
        answer to a definition (``defined``) is for this daemon: the recorder turns an
        accepted one into the definition the shim gets."""
        session, rec, writer = self.session, self.recorder, self.writer
        placement, lane = self.placement, self.lane
        joiner = Parts(ops_pb2.SessionDown)  # a message the host cut (``wire.cut``), joined
        while (message := await self.call.read()) is not grpc.aio.EOF:
            _moved(session.host)
            try:
                whole = joiner.take(message)
            except ValueError as exc:
                raise grpc.aio.AioRpcError(grpc.StatusCode.DATA_LOSS, None, None,
                                           f"bad parts from the host: {exc}") from None
            if whole is None:
                continue
            message = whole[0]
            if framing.TRACING:
                framing.hop("robot.down.read")
            frames = (message.batch.frames if message.WhichOneof("msg") == "batch"
                      else (message,))
            parts: list[bytes] = []
            if ack := self._acked():  # the shared region's, with the first write
                parts.append(ack)
            for frame in frames:
                what = frame.WhichOneof("msg")
                if what == "parts":  # the host has our parts so far: the link moves (above)
                    continue
                if placement is not None and what != "defined" and not placement.from_host(
                        lane, frame):
                    continue
                if rec is not None and what == "result" and (
                        frame.result.outs or frame.result.value.WhichOneof("kind") in NUMBERS):
                    rec.observe_result(frame.result)  # (a number: an ``item()`` answered)
                elif what == "answer" and rec is not None:
                    rec.observe_answer(frame.answer)
                elif what == "fetched" and rec is not None:
                    rec.observe_fetched(frame.fetched)  # a reply, or a replay's push
                elif what == "replayed":  # for this daemon's op log only
                    if rec is not None:
                        rec.observe_replayed(frame.replayed)
                    continue
                elif what == "profile":  # for this daemon's scheduler only
                    self._profile_later(frame.profile, robot_side=False)
                    continue
                elif what == "timing":  # the link as a replay saw it: for the scheduler only
                    self._link_timed(frame.timing)
                    continue
                if what == "defined":
                    d = rec.acknowledged(frame.defined) if rec is not None else None
                    if d is not None and self.placer is not None:
                        d = self.placer.current(d)  # a plan chosen since it was sent
                    if d is not None:
                        if placement is not None:
                            placement.accepted(d, frame.defined)
                        parts += _framed(session, ops_pb2.SessionDown(sequence=d))
                    if rec is not None:
                        parts += self._over(rec)  # after the definition, if any
                    continue
                parts += _framed(session, frame)
            if parts:  # one write (and wake-up of the app's reader) per message
                if sum(map(len, parts)) <= JOIN_BYTES:
                    writer.write(b"".join(parts))
                else:  # large: no copy into a fresh buffer
                    for part in parts:
                        writer.write(part)
                await writer.drain()
                if framing.TRACING:
                    framing.hop("robot.down.written")
            for gone in rec.superseded() if rec is not None else ():
                await self.push_sequence(gone)  # after what replaces it, on both ends

    def _profile_later(self, profile: ops_pb2.SequenceProfile, robot_side: bool) -> None:
        """A profile of a replayed sequence (``SequenceProfile``): the scheduler places it
        again with what is now known, and a placement it changes goes out as a new plan."""
        placer = self.placer
        if placer is not None and profile.sequence in placer.defined:
            self._place_later(lambda mbit_s: placer.profiled(profile, robot_side, mbit_s))

    def _timed(self, mark: local_pb2.InferenceMark) -> None:
        """An inference's latency as the app measured it (its mark), for the placement of
        the replays it started."""
        started, self._started = self._started, []
        placer = self.placer
        if placer is None or not started or not placer.defined:
            return  # (nothing placed: ``remote-all``, or no sequence yet)
        latency = mark.end_ns - mark.start_ns
        for seq in placer.timed(started, latency):
            self._place_later(lambda mbit_s, seq=seq: placer.again(seq, mbit_s))
        if not placer.scheduling.follows_link:
            return  # (``switch_plans`` off: the link is not followed per inference)
        if self._saw_link:
            self._saw_link = False
        elif not self._probing:  # the inference told nothing of the link: probe it
            self._probing = True
            self._later(self._probed())

    def _link_timed(self, timing: ops_pb2.ReplayTiming) -> None:
        placer = self.placer
        if placer is None or not placer.scheduling.follows_link:
            return  # (``switch_plans`` off: nothing to read it for)
        mbit_s = placer.uploaded(timing)
        if mbit_s is not None:
            self._saw_link = True
            self._switch(placer.observe(mbit_s))

    async def _probed(self) -> None:
        """The link's throughput now (a small probe), for the plan of the next inferences.
        Probes are ``PROBE_EVERY_S`` apart while the link changes band, twice as far apart
        after each that leaves it in its band, up to ``PROBE_MAX_S`` (on a steady link they
        cost the robot's CPU and the link nearly nothing)."""
        probe = getattr(self.session.host, "time_upload", None)
        try:
            wait = self._probed_at + self._probe_every - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._probed_at = time.monotonic()
            took = await probe(SWITCH_PROBE_BYTES) if probe is not None else None
            placer = self.placer
            if took is not None and placer is not None and self.phase is Phase.RELAYING:
                band = placer.band
                self._switch(placer.observe(throughput(SWITCH_PROBE_BYTES, took)))
                self._probe_every = (PROBE_EVERY_S if placer.band != band
                                     else min(self._probe_every * 2, PROBE_MAX_S))
        finally:
            self._probing = False

    def _switch(self, defs: list[ops_pb2.SequenceDef]) -> None:
        """Plans switched with the link's band: a definition whose plans the host holds goes
        to the shim alone (a local message), one with a new plan to the host first."""
        for d in defs:
            if self._host_plans.get(d.id, -1) >= len(d.plans):
                self.writer.write(b"".join(_framed(self.session,
                                                   ops_pb2.SessionDown(sequence=d))))
            else:
                self._later(self._send_placed(d))

    def _place_later(self, place: Callable[[float | None], ops_pb2.SequenceDef | None]) -> None:
        """``place`` (the scheduler asked again) off the relay's path, with the link's
        throughput measured first; a definition it returns goes to the host and the shim."""
        self._later(self._placed_anew(place))

    def _later(self, work: Coroutine[Any, Any, None]) -> None:
        """Placement work off the relay's path (kept until done, cancelled with the relay)."""
        task = asyncio.get_running_loop().create_task(work)
        self._placing.add(task)
        task.add_done_callback(self._placing.discard)

    async def _placed_anew(self, place: Callable[[float | None], ops_pb2.SequenceDef | None]
                           ) -> None:
        mbit_s = None
        probe = getattr(self.session.host, "probe_throughput", None)
        try:
            if probe is not None:
                mbit_s = await probe()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, ConnectionError, OSError):
            return  # the session is ending (its host stream or its app gone)
        placed = place(mbit_s)
        if placed is not None:
            await self._send_placed(placed)

    async def _send_placed(self, d: ops_pb2.SequenceDef) -> None:
        try:
            if self.phase is Phase.RELAYING:
                await self.push_sequence(d, placed=True)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, ConnectionError, OSError):
            pass  # the session is ending (its host stream or its app gone)

    async def _hint_search(self, rec: Recorder, frames: list[ops_pb2.SessionUp]) -> bool:
        """If ``frames`` download a value and the search that will start on it is one the
        app's next inference start should wait for, tell the app now (``SearchHint``): before
        the download reaches the host, so before its reply reaches the app."""
        if not any(f.WhichOneof("msg") == "fetch" and rec.searches_at(f.fetch) for f in frames):
            return False  # (a value read inside a forward starts no search: Mask R-CNN's
            # second frame reads ~600, and each was hinted and ended, 1 200 frames to the app)
        wait = rec.hint_wait()
        if wait is None:
            return False
        await self._hint(wait)
        return True

    async def _hint(self, wait: float) -> None:
        """Tell the app a search is running that its next call should wait for, at most
        ``wait`` seconds (``SearchHint``). What it waits is charged to the hint budget when
        its shim says so (``InferenceMark.search_wait_us``)."""
        self._hinted = True
        await self._tell_app(ops_pb2.SessionDown(search=ops_pb2.SearchHint(
            running=True, wait_us=int(wait * 1e6))))

    def _over(self, rec: Recorder) -> tuple[bytes, bytes] | tuple[()]:
        """The frame that tells the app the search it was told of is over, once nothing is on
        its way to the host any more (else nothing yet)."""
        if not self._hinted or rec.awaiting_host():
            return ()
        self._hinted = False
        return _framed(self.session, _SEARCH_OVER)

    async def _search_ended(self) -> None:
        """The recorder's search is over: if the app was told one was running and nothing is
        on its way to the host, tell it that it is over (a definition found is followed by
        this in ``down``, once the host has answered)."""
        rec = self.recorder
        if rec is not None and self.phase is Phase.RELAYING and (over := self._over(rec)):
            await self._write_app(b"".join(over))

    async def _tell_app(self, frame: ops_pb2.SessionDown) -> None:
        """A frame of this daemon's own for the app (not the host's)."""
        await self._write_app(b"".join(_framed(self.session, frame)))

    async def _write_app(self, data: bytes) -> None:
        try:
            self.writer.write(self._acked() + data)
            await self.writer.drain()
        except (ConnectionError, OSError):
            pass  # the app is gone: its session ends on the up side

    async def _push_found(self, d: ops_pb2.SequenceDef) -> None:
        """A search found ``d``. If the app was told that search is running, its wait now
        covers the host's definition too (``SearchHint`` again): the search's own bound
        (``search_wait``) was set before the search, and a search and a definition together
        may take longer (YOLO ``predict()``: 65 ms of search, then the host's definition; the
        third frame stopped waiting at 100 ms and was forwarded). Waiting pays while it is
        shorter than the inference it saves, which would be forwarded: bounded by the app's
        last inference's duration, never below ``search_wait`` (the shim caps it at 10 s)."""
        rec = self.recorder
        if self._hinted and rec is not None:
            await self._hint(max(self._inference_s, rec.budget.search_wait))
        await self.push_sequence(d)

    async def push_sequence(self, d: ops_pb2.SequenceDef, placed: bool = False) -> None:
        """Host first; the shim gets a definition once the host has accepted it (``defined``,
        handled in ``down``), so the shim never asks for a replay the host cannot run. A drop
        (no calls) goes to both at once. ``placed``: ``d`` carries the scheduler's plans
        already (a placement renewed), else the scheduler places it now."""
        if self.placer is not None:
            if not d.calls:
                self.placer.forget(d.id)
            elif not placed:
                d = self.placer.place(d)
        if d.calls and self.recorder is not None:
            self.recorder.offered(d)
        async with self.write_lock:
            await self.call.write(ops_pb2.SessionUp(define=d))
        _moved(self.session.host)
        self._host_plans[d.id] = len(d.plans)
        if not d.calls:
            if self.placement is not None:
                await self._send_lanes(self.placement.dropped(d.id))
            self.writer.write(encode(local_pb2.LocalReply(
                session=ops_pb2.SessionDown(sequence=d))))
            await self.writer.drain()

    async def flush(self) -> int:
        """Drop the sequences in use: host and shim forget them, recording resumes. Returns
        how many were dropped."""
        if self.recorder is None or self.phase is Phase.CLOSED:
            return 0
        dropped = 0
        for seq_id in list(self.recorder.sequences):
            d = self.recorder.drop(seq_id)
            if d is not None:
                try:
                    await self.push_sequence(d)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError, ConnectionError,
                        OSError):
                    pass  # the session is ending (its host stream or its app gone): dropped
                dropped += 1
        return dropped

    async def fail(self, code: str, message: str) -> None:
        """Tell the app why its session ends (if it still listens)."""
        try:
            self.writer.write(encode(error_reply(code, message)))
            await self.writer.drain()
        except (ConnectionError, OSError):
            pass

    def close(self) -> None:
        """End the host stream and the recorder (its running search; counts to the saved
        sequences). Idempotent."""
        if self.phase is Phase.CLOSED:
            return
        self.phase = Phase.CLOSED
        for task in self._placing:
            task.cancel()
        self.call.cancel()
        if self.recorder is not None:
            self.recorder.close()
        if self.shared is not None:
            self.shared.close()
