"""The ``gpu`` role: the gRPC peer service that executes app sessions for robot daemons.

Each session gets an executor from its interception backend and one worker thread. Frames are
read ahead while the worker executes, so a streamed call never waits on the network, and the
replies go back in frame order. A session ends when the robot closes its stream or the stream
breaks; either way its executor is closed and its memory freed.

The service listens on a unix socket beside the app socket (``peer.sock``, with the app socket's
file mode) and, only when ``listen`` names one, on a TCP port secured by ``tls``. Every peer
method except the standard health service (left open for load balancers and probes: it tells
only whether the daemon serves) first establishes who calls (``rrtod.tls.peer_identity``) and
whether the access rules admit them (``rrtod.gpu.access``), and refuses the call otherwise.
Probes that cannot present a certificate (Kubernetes' grpc probe) get ``health_listen``: a
plaintext port of a second server that has the health service alone.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rrto.v1 import ops_pb2, peer_pb2, peer_pb2_grpc
from rrtod import __version__, framing, gcfreeze
from rrtod.config import Config
from rrtod.executor import Executor, ExecutorContext, ReplayExtension
from rrtod.gpu.access import AccessPolicy, Grant
from rrtod.gpu.memory import HostMemory
from rrtod.gpu.replay import HostReplayer
from rrtod.grpc_options import BATCH_BYTES, SERVER_OPTIONS
from rrtod.hookspecs import InterceptionBackend, problems
from rrtod.local_server import _in_use
from rrtod.plugins import PluginError, Registry
from rrtod.tls import LOCAL, peer_identity, server_credentials
from rrtod.wire import Parts, cut, reply_part

log = structlog.get_logger("rrtod.gpu")

SERVICE_NAME = "rrto.v1.Peer"
# A refused caller (a robot retries its pings every second) is logged once per this many seconds.
REFUSAL_LOG_INTERVAL_S = 60.0
REPLAY_FRAMES = frozenset({"define", "start", "arg", "abort"})
# Frames read from a session's stream and not yet executed, per session: beyond this the
# stream is not read until the worker catches up (gRPC's flow control then holds the robot).
READ_AHEAD_BYTES = 64 << 20


def _probe_device() -> str:
    """What ``executor.device: auto`` resolves to here (the executor makes the same choice)."""
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


class Outbox:
    """Replies from a session's worker thread to its stream.

    Each message on the stream costs ~0.2 ms of CPU at both ends (gRPC's completion-queue
    thread and the event loop), on top of the wake-up of the loop, which competes with the
    worker for the CPU. So replies that come close together share one message
    (``SessionDownBatch``): a reply waits until the worker has finished the frames it was
    given, or at most ``HOLD_S``, whichever comes first. While the worker stays busy,
    messages also go at most one per ``GAP_S``: a detector's replay answers ~190 calls an
    inference (its per-class NMS loop), one every ~0.25 ms of the host's work, and a message
    per ``HOLD_S`` cost its GPU daemon ~11 ms of CPU an inference on the I/O threads, on the
    core the replay computes on (measured, alternate replays in one daemon: Faster R-CNN
    191.7 -> 187.1 ms a frame, RetinaNet 197.7 -> 188.8, Keypoint R-CNN and yolov8n
    unchanged; docs/benchmark.md). An answer alone still goes within ``HOLD_S``. The time is
    checked at every executor call and, inside a native run, between its calls once it came
    (``due``): a held reply waits at most for the call under way.

    Replies waiting here, and the message gRPC is sending, count against the session's memory
    (``charge``/``refund``: its ``reply_memory``'s ``charge_reply``/``refund_reply``). A reply that
    does not fit means the client is not reading: the outbox drops it and every later one,
    and ``on_overflow`` (set by the stream) disconnects the client instead of buffering.
    """

    HOLD_S = 0.0005
    GAP_S = 0.002

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 charge: Callable[[int], str | None] | None = None,
                 refund: Callable[[int], None] | None = None):
        self.loop = loop
        self.items: collections.deque[tuple[ops_pb2.SessionDown | None, int]] = \
            collections.deque()
        self.ready = asyncio.Event()
        self.armed = False  # a wake-up of the loop is on its way (the loop clears it first)
        self.since: float | None = None  # worker only: when the oldest held reply came
        self.flushed = float("-inf")  # worker only: when replies last went to the stream
        self.charge = charge
        self.refund = refund
        self.sending = 0  # loop only: bytes handed to the stream by the last ``get``
        self.overflow: str | None = None  # why replies are dropped (the client does not read)
        self.on_overflow: Callable[[str], None] | None = None  # called on the loop, once

    # -- worker thread --
    def put(self, reply: ops_pb2.SessionDown | None) -> None:
        """``None`` ends the stream."""
        if framing.TRACING:
            framing.hop("gpu.emit")
        n = 0
        if reply is not None:
            if self.overflow is not None:
                return
            n = reply.ByteSize()
            if self.charge is not None:
                why = self.charge(n)
                if why is not None:
                    self.overflow = why
                    self.loop.call_soon_threadsafe(self._overflowed)
                    return
        self.items.append((reply, n))
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if reply is None or now >= self.due():
            self.flush()

    def tick(self) -> None:
        due = self.due()
        if due and time.monotonic() >= due:
            self.flush()

    def due(self) -> float:
        """When the replies held now must go (``time.monotonic``), 0.0 if none is held. A
        native run asks between its calls once that time came (``tick``): a reply held to
        share a message does not wait behind the rest of a long run."""
        if self.since is None:
            return 0.0
        return max(self.since + self.HOLD_S, self.flushed + self.GAP_S)

    def flush(self) -> None:
        self.since = None
        if not self.armed and self.items:
            self.armed = True
            self.flushed = time.monotonic()
            self.loop.call_soon_threadsafe(self.ready.set)

    # -- event loop --
    def _overflowed(self) -> None:
        if self.on_overflow is not None and self.overflow is not None:
            callback, self.on_overflow = self.on_overflow, None
            callback(self.overflow)

    def sent(self) -> None:
        """The stream sent everything the last ``get`` returned: its bytes no longer count."""
        if self.sending and self.refund is not None:
            self.refund(self.sending)
        self.sending = 0

    async def get(self) -> list[tuple[ops_pb2.SessionDown | None, int]]:
        """Everything sent so far as (reply, its size), at least one (the last may be the
        ending ``None``). Calling it again says that those were sent."""
        self.sent()
        while True:
            await self.ready.wait()
            self.ready.clear()
            self.armed = False  # before draining: a reply put after the drain wakes us again
            out = []
            while self.items:
                out.append(self.items.popleft())
            if out:
                self.sending = sum(n for _, n in out)
                return out


class _Paced:
    """The session's executor as the replayer drives it: ``handle`` and, when the executor
    declares one, its ``ReplayExtension``. Each operator run (``handle``, ``run_prepared``)
    first lets the outbox send replies held too long, and is traced under ``RRTO_HOP_TRACE``;
    the rest of the extension is the executor's own bound methods, with no wrapper."""

    def __init__(self, executor: Executor, outbox: Outbox):
        self._outbox = outbox
        self._handle = executor.handle
        ext = executor.replay
        self.replay: ReplayExtension | None = None
        if ext is not None:
            self.replay = _PacedReplay(ext, self._run)

    def handle(self, frame: ops_pb2.SessionUp) -> Any:
        return self._run(self._handle, frame)

    def held(self) -> float:
        """When the replies the outbox holds must go (``Outbox.due``; 0.0: none held)."""
        return self._outbox.due()

    def tick(self) -> None:
        """Send the replies held past their time (``Outbox.tick``)."""
        self._outbox.tick()

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._outbox.tick()
        if not framing.TRACING:
            return fn(*args)
        framing.hop("gpu.exec.begin")
        try:
            result = fn(*args)
            return result if isinstance(result, int) else list(result)  # run_batch: a count
        finally:
            framing.hop("gpu.exec.end")


class _PacedReplay:
    """A ``ReplayExtension`` whose ``run_prepared`` is paced like ``_Paced.handle``."""

    def __init__(self, ext: ReplayExtension, run: Callable[..., Any]):
        self.prepare = ext.prepare
        self.written_ids = ext.written_ids
        self.viewed_ids = ext.viewed_ids
        self.snapshot = ext.snapshot
        self.restore = ext.restore
        self.missing = ext.missing
        self.release = getattr(ext, "release", None)  # optional (rrtod.executor)
        self.shape = ext.shape
        self.scalar = ext.scalar
        self.dense_sizes = getattr(ext, "dense_sizes", None)  # optional (rrtod.executor)
        self._run_prepared = ext.run_prepared
        self._run = run
        # optional (rrtod.executor): calls split by rows (Hybrid-Parallel, ``rrtod.lop``)
        self.rows = getattr(ext, "rows", None)
        self._run_rows = getattr(ext, "run_rows", None)
        # optional: the device's queue waited for (a profiled replay times each call's work)
        self.synchronize = getattr(ext, "synchronize", None)
        # optional, together: runs of calls replayed by one native call (``Run``)
        if getattr(ext, "run_batch", None) is not None:
            self.batchable = ext.batchable  # type: ignore[attr-defined]
            self.batch = ext.batch  # type: ignore[attr-defined]
            self._run_batch = ext.run_batch  # type: ignore[attr-defined]
            self.fixed_upload = getattr(ext, "fixed_upload", None)  # optional with them

    def run_prepared(self, prepared: Any, refs: list[Any], out_ids: list[int],
                     ints: list[tuple[list[Any], int]] | None = None,
                     want_meta: bool = False) -> Any:
        return self._run(self._run_prepared, prepared, refs, out_ids, ints, want_meta)

    def run_batch(self, batch: Any, externals: list[Any], out_ids: list[int],
                  drops: list[tuple[int, int]], **hooks: Any) -> int:
        return self._run(functools.partial(self._run_batch, **hooks), batch, externals,
                         out_ids, drops)

    def run_rows(self, prepared: Any, refs: list[Any], out_ids: list[int], how: Any,
                 starts: list[int | None], lo: int, hi: int) -> Any:
        return self._run(self._run_rows, prepared, refs, out_ids, how, starts, lo, hi)


def _sized_session_up(data: bytes) -> tuple[ops_pb2.SessionUp, int]:
    """A Session stream message and its bytes on the wire, which the read-ahead counts:
    ``ByteSize`` would serialize the message again to find them (protobuf's upb backend: 0.38
    ms for a 4.9 MB upload, between the robot's frame arriving and the replay using it)."""
    return ops_pb2.SessionUp.FromString(data), len(data)


def _unsized(item: Any) -> tuple[ops_pb2.SessionUp, int]:
    """(message, bytes) from the Session stream, whichever deserializer served it."""
    return item if type(item) is tuple else (item, item.ByteSize())


class _Registrations:
    """Stands in for the server while gRPC's generated ``add_PeerServicer_to_server`` names
    its handlers, so that ``add_peer`` can give the Session stream ``_sized_session_up``."""

    def __init__(self) -> None:
        self.generic: list[Any] = []
        self.named: dict[str, dict[str, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.named[service] = dict(handlers)


def add_peer(servicer: peer_pb2_grpc.PeerServicer, server: Any) -> None:
    """``add_PeerServicer_to_server``, with the Session stream's messages deserialized with
    their size (``_sized_session_up``). Generated code that names no handlers (older
    grpcio-tools) is registered as it is: the sizes are then counted (``_unsized``)."""
    found = _Registrations()
    peer_pb2_grpc.add_PeerServicer_to_server(servicer, found)
    if not found.named:
        server.add_generic_rpc_handlers(tuple(found.generic))
        return
    for service, handlers in found.named.items():
        if "Session" in handlers:
            handlers["Session"] = handlers["Session"]._replace(
                request_deserializer=_sized_session_up)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        server.add_registered_method_handlers(service, handlers)


def _down(replies: list[ops_pb2.SessionDown], size: int,
          part: int) -> list[ops_pb2.SessionDown]:
    """The messages for replies that are ready together (``size`` bytes): one
    (``SessionDownBatch``), or its parts (``wire.cut``) where it is longer than ``part``, the
    robot's ``SessionOpen.part_bytes`` (its link slow: each part it reads shows the link
    moving to a ping queued behind the rest)."""
    message = replies[0] if len(replies) == 1 else ops_pb2.SessionDown(
        batch=ops_pb2.SessionDownBatch(frames=replies))
    return cut(message, part) if part and size > part else [message]


class HostSession:
    """One app session on this host: an executor driven by one dedicated thread."""

    def __init__(self, sid: str, request: ops_pb2.SessionOpen, peer: str, executor: Executor,
                 grant: Grant | None = None):
        self.id = sid
        self.app = request.app
        self.pid = request.pid
        self.robot = request.robot  # what the robot calls itself: informational only
        # What each end runs (the app's as its shim says; the host's from its executor's
        # SessionReady, set once open): a torch version skew is visible in ``rrtoctl status``.
        self.app_versions = dict(request.versions)
        self.host_versions: dict[str, str] = {"rrtod": __version__}
        # Who it is: from the transport (certificate); no grant: a local caller (tests).
        self.identity = grant.identity if grant is not None else LOCAL
        self.grant = grant
        self.peer = peer
        self.opened = time.time()
        self.frames = 0
        self.executor = executor
        memory = executor.reply_memory
        self.outbox = Outbox(asyncio.get_running_loop(),
                             memory.charge_reply if memory is not None else None,
                             memory.refund_reply if memory is not None else None)
        self.replayer = HostReplayer(_Paced(executor, self.outbox))
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rrto-{sid}")
        # Read-ahead: bytes of frames queued for the worker (READ_AHEAD_BYTES at most).
        self.backlog = 0
        self._backlog_lock = threading.Lock()
        self._reader_waits = False
        self._drained = asyncio.Event()

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run ``fn`` on the worker and await its result."""
        return asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def queue(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn`` on the worker, in order with everything queued before; nobody awaits it,
        so unlike ``submit`` its end costs the event loop no wake-up."""
        self._worker.submit(fn, *args)

    async def read_ahead(self, frames: list[ops_pb2.SessionUp], nbytes: int) -> None:
        """Queue ``frames`` (``nbytes`` on the wire) for the worker; first wait, while more
        than READ_AHEAD_BYTES are queued, for the worker to catch up."""
        while self.backlog > READ_AHEAD_BYTES:
            self._drained.clear()
            self._reader_waits = True
            if self.backlog <= READ_AHEAD_BYTES:  # the worker caught up meanwhile
                break
            await self._drained.wait()
        self._reader_waits = False
        with self._backlog_lock:
            self.backlog += nbytes
        self.queue(self.process, frames, nbytes)

    def process(self, frames: list[ops_pb2.SessionUp], nbytes: int = 0) -> None:
        """Runs in the worker thread. Replies go out as they come (see ``Outbox``), so a
        replayed inference streams its outputs back while later calls still compute. An
        executor bug answers its frame with an error instead of killing the stream."""
        try:
            self._process(frames)
        finally:
            if nbytes:
                with self._backlog_lock:
                    self.backlog -= nbytes
                if self._reader_waits:
                    self.outbox.loop.call_soon_threadsafe(self._drained.set)

    def _process(self, frames: list[ops_pb2.SessionUp]) -> None:
        emit = self.outbox.put
        for frame in frames:
            if self.outbox.overflow is not None:
                return  # the client is being disconnected: nothing it sent still matters
            if framing.TRACING:
                framing.hop("gpu.work.begin")
            replayed = frame.WhichOneof("msg") in REPLAY_FRAMES
            try:
                if replayed:
                    self.replayer.process(frame, emit)
                else:
                    self.replayer.forwarded(frame, emit)
            except Exception as exc:  # noqa: BLE001 - reported to the app, logged here
                log.exception("executor failed", session=self.id)
                sequence = self.replayer.crashed()
                emit(ops_pb2.SessionDown(error=ops_pb2.Error(
                    code="INTERNAL", message=repr(exc), sequence=sequence,
                    in_replay=replayed and sequence != 0)))
            if framing.TRACING:
                framing.hop("gpu.work.end")
        self.outbox.flush()

    async def close(self) -> None:
        try:
            await self.submit(self.executor.close)
        finally:
            self._worker.shutdown(wait=False)

    def describe(self) -> dict[str, Any]:
        try:
            stats = dict(self.executor.stats())
        except Exception as exc:  # noqa: BLE001 - status must not fail on one session
            stats = {"error": repr(exc)}
        return {"id": self.id, "app": self.app, "pid": self.pid, "robot": self.robot,
                "identity": self.identity, "peer": self.peer, "opened": self.opened,
                "app_versions": self.app_versions, "host_versions": self.host_versions,
                "frames": self.frames, "sequences": len(self.replayer.sequences),
                "replays": self.replayer.replays, "aborts": self.replayer.aborts,
                **self.replayer.timings(), **stats}


class GpuRole(peer_pb2_grpc.PeerServicer):
    def __init__(self, config: Config, registry: Registry):
        self.config = config
        self.registry = registry
        self.sessions: dict[str, HostSession] = {}
        self.draining = False
        self._ids = itertools.count(1)
        self.server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None  # health_listen's: health alone
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else None
        self.blobs: Any = None
        self.port: int | None = None
        self.device = config.executor.device
        self.access = AccessPolicy(config)
        self._refusals: dict[tuple[str, str], float] = {}  # (identity, reason) -> last logged
        # executor.memory_limit: what all sessions hold together (rrtod.gpu.memory)
        self.host_memory = HostMemory(config.executor.memory_limit)
        # Sessions refused at open by a session limit, by the key that set it.
        self.refused = {"executor.max_sessions": 0, "access.max_sessions": 0}

    # ----- lifecycle -----
    async def start(self) -> None:
        from rrtod.gpu.blobstore import BlobStore  # the torch backend's weight cache, framework-neutral

        if self.device == "auto":  # importing torch takes seconds: not on the event loop
            self.device = await asyncio.to_thread(_probe_device)
        state = Path(self.config.state_dir)
        self.blobs = BlobStore(state / "blobs", self.config.weight_cache.max_bytes,
                               shared=self.config.weight_cache.shared)
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        add_peer(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._bind_unix()
        listen = self.config.listen
        if listen is not None:
            creds = server_credentials(self.config.tls)
            if creds is None:
                self.port = self.server.add_insecure_port(listen)
            else:
                self.port = self.server.add_secure_port(listen, creds)
            if not self.port:
                raise OSError(f"cannot listen on {listen}")
            if creds is None:
                log.warning(f"peer link on TCP port {self.port} is plaintext and unauthenticated "
                            "(tls.mode: insecure): anyone who reaches it may run operators here",
                            listen=listen, port=self.port)
        await self.server.start()
        if self.config.health_listen is not None:
            await self._serve_health(self.config.health_listen)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("gpu role serving", peer_socket=self.config.peer_socket, listen=listen,
                 tls=self.config.tls.mode if listen else None, access=sorted(self.config.access))

    async def _serve_health(self, listen: str) -> None:
        """A plaintext port that answers the health service and nothing else (the same
        servicer as the peer port, so draining shows on both): what it tells is only whether
        this daemon serves, the same as the health service on ``listen``."""
        self.health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        if not self.health_server.add_insecure_port(listen):
            raise OSError(f"cannot listen on {listen} (health_listen)")
        await self.health_server.start()

    def _bind_unix(self) -> None:
        """The unix peer socket, created with the app socket's mode (never wider, not even
        before the chmod) after making sure no other daemon serves it."""
        path = Path(self.config.peer_socket)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            if _in_use(path):
                raise OSError(f"another rrtod is already serving {path}")
            path.unlink()  # stale socket from a crashed daemon
        mode = self.config.socket_mode
        old_umask = os.umask(0o777 & ~mode)
        try:
            bound = self.server.add_insecure_port(f"unix:{path}")
        finally:
            os.umask(old_umask)
        if not bound:
            raise OSError(f"cannot listen on unix:{path}")
        os.chmod(path, mode)

    async def drain(self) -> None:
        self.draining = True
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float) -> None:
        if self.server is not None:
            await self.server.stop(grace)
            Path(self.config.peer_socket).unlink(missing_ok=True)
        if self.health_server is not None:
            await self.health_server.stop(None)
        for session in list(self.sessions.values()):
            await session.close()
        self.sessions.clear()

    def reload(self, config: Config) -> None:
        """Hot-reloadable settings (quota, allowlist, access rules, session limit) apply to
        calls and sessions from now on; sessions already open keep the grant they opened with
        (a lower ``executor.max_sessions`` closes none: it refuses new ones until enough end). A
        new memory limit applies at once (None: the default, the default from the device
        memory)."""
        self.config = config
        self.access = AccessPolicy(config)
        self.host_memory.configure(config.executor.memory_limit)

    # ----- identity -----
    async def _admit(self, context: Any, method: str) -> Grant:
        """The caller's grant, or the call ends here: UNAUTHENTICATED for a certificate that
        identifies nobody, PERMISSION_DENIED for an identity no access rule admits."""
        who = peer_identity(context)
        if who.error is not None:
            self._refused(who.name, who.peer, method, who.error)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, who.error)
        grant = self.access.grant(who.name)
        if grant is None:
            reason = f"identity {who.name!r} is not admitted by this host's access rules"
            self._refused(who.name, who.peer, method, reason)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
        return grant

    def _refused(self, identity: str, peer: str, method: str, reason: str) -> None:
        now = time.monotonic()
        key = (identity, reason)
        if now - self._refusals.get(key, -REFUSAL_LOG_INTERVAL_S) >= REFUSAL_LOG_INTERVAL_S:
            self._refusals[key] = now
            log.warning("peer call refused", identity=identity, peer=peer, method=method,
                        reason=reason)

    # ----- sessions -----
    def _executor_context(self, grant: Grant) -> ExecutorContext:
        ex = self.config.executor
        return ExecutorContext(device=ex.device, memory_quota=grant.memory_quota,
                               allow_extra=grant.allow_extra, deny=ex.deny, blobs=self.blobs,
                               state_dir=Path(self.config.state_dir), identity=grant.identity,
                               host_memory=self.host_memory)

    def _new_executor(self, request: ops_pb2.SessionOpen, grant: Grant) -> Executor:
        name = request.executor or self.config.executor.backend
        record = self.registry.get("interception", name)
        if not isinstance(record, InterceptionBackend) or record.executor is None:
            raise PluginError(f"interception backend {name!r} has no host executor")
        executor = record.executor(self._executor_context(grant))
        # What the daemon keeps from now on (for the first app, the backend's imports: torch)
        # out of the garbage collector's full collections (``rrtod.gcfreeze``): settled here,
        # as the app begins, not at its first definition, whose answer waited ~190 ms for it
        # (the app's third inference then ran forwarded)
        gcfreeze.settle(again=True, once="host executor")
        if not isinstance(executor, Executor):  # once per session: the contract, not a probe
            missing = ", ".join(problems(executor, Executor))
            raise PluginError(f"interception backend {name!r} built {type(executor).__name__}, "
                              f"which is not an rrtod.executor.Executor ({missing})")
        return executor

    async def Session(
        self, request_iterator: AsyncIterator[tuple[ops_pb2.SessionUp, int] | ops_pb2.SessionUp],
        context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ops_pb2.SessionDown]:
        grant = await self._admit(context, "Session")
        frames = request_iterator.__aiter__()  # (message, its bytes): ``add_peer``
        item = await anext(frames, None)
        first = None if item is None else _unsized(item)[0]
        if first is None or first.WhichOneof("msg") != "open":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first frame must be 'open'")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "gpu daemon is shutting down")
        # From these checks to the session's registration nothing awaits: no race past a limit.
        limit = self.config.executor.max_sessions
        if limit is not None and len(self.sessions) >= limit:
            n = len(self.sessions)
            reason = (f"{n} session{'s' if n != 1 else ''} open, limit {limit} "
                      f"(executor.max_sessions of gpu daemon {self.config.node!r})")
            self.refused["executor.max_sessions"] += 1
            self._refused(grant.identity, context.peer(), "Session", reason)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
        if grant.max_sessions is not None:
            held = sum(s.identity == grant.identity for s in self.sessions.values())
            if held >= grant.max_sessions:
                reason = (f"identity {grant.identity!r} already holds {held} sessions "
                          f"(max_sessions {grant.max_sessions}, access rule {grant.rule!r})")
                self.refused["access.max_sessions"] += 1
                self._refused(grant.identity, context.peer(), "Session", reason)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
        try:
            executor = self._new_executor(first.open, grant)
        except PluginError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        sid = f"{self.config.node}-{next(self._ids)}"
        session = HostSession(sid, first.open, context.peer(), executor, grant)
        self.sessions[sid] = session
        bound = log.bind(session=sid, identity=grant.identity, app=first.open.app,
                         pid=first.open.pid, robot=first.open.robot)
        bound.info("session opened", peer=session.peer, memory_quota=grant.memory_quota,
                   app_versions=session.app_versions)
        loop = asyncio.get_running_loop()
        handler = asyncio.current_task()

        def end_stream(code: grpc.StatusCode, details: str) -> None:
            """End the stream with ``code`` from outside its handler (which is cancelled)."""
            abort = loop.create_task(context.abort(code, details))
            abort.add_done_callback(lambda t: t.cancelled() or t.exception())
            if handler is not None:
                handler.cancel()  # the stream may be stuck in a send that never completes

        def disconnect(reason: str) -> None:
            """The client does not read its replies: end the stream rather than buffer them."""
            bound.warning("client does not read its replies: session aborted", reason=reason)
            end_stream(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"replies are not being read and exceed the session's memory: {reason}")

        session.outbox.on_overflow = disconnect

        # the size the robot's link takes a message in (``_down``; 0: whole), as it states it
        part = reply_part(first.open.part_bytes)

        async def read_ahead() -> None:
            nonlocal part
            parts = Parts(ops_pb2.SessionUp)  # a message the robot cut (``wire.cut``), joined
            try:
                async for item in frames:
                    frame, nbytes = _unsized(item)
                    if framing.TRACING:
                        framing.hop("gpu.up.read")
                    try:
                        whole = parts.take(frame)
                    except ValueError as exc:
                        bound.warning("bad parts: session aborted", error=str(exc))
                        end_stream(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                        return
                    if whole is None:  # the robot sees its link move (``PartsReceived``)
                        session.queue(session.outbox.put, ops_pb2.SessionDown(
                            parts=ops_pb2.PartsReceived(bytes=parts.received)))
                        continue
                    frame, nbytes = whole[0], whole[1] or nbytes
                    kind = frame.WhichOneof("msg")
                    if kind == "part_bytes":  # the robot measured its link again
                        part = reply_part(frame.part_bytes)
                        continue
                    batch = list(frame.batch.frames) if kind == "batch" else [frame]
                    end = next((i for i, f in enumerate(batch) if f.WhichOneof("msg") == "close"),
                               None)
                    if end is not None:  # the robot ends the session
                        batch = batch[:end]
                    if batch:
                        session.frames += len(batch)
                        for f in batch:  # releases the replay in progress may act on early
                            session.replayer.read(f)
                        await session.read_ahead(batch, nbytes)
                    if end is not None:
                        break
            finally:
                session.queue(session.outbox.put, None)  # after every frame queued before it

        reader: asyncio.Task[None] | None = None
        try:
            ready = await session.submit(executor.open, first.open)
            if not ready.session:
                ready.session = sid
            session.host_versions.update(ready.versions)
            skew = {k: (v, session.host_versions[k]) for k, v in session.app_versions.items()
                    if session.host_versions.get(k, v) != v}
            if skew:  # operators whose schemas differ are refused one by one (SCHEMA_MISMATCH)
                bound.warning("app and host run different versions",
                              **{k: f"app {a}, host {h}" for k, (a, h) in skew.items()})
            yield ops_pb2.SessionDown(ready=ready)
            reader = loop.create_task(read_ahead())
            done = False
            while not done:
                out: list[ops_pb2.SessionDown] = []
                size = 0
                for reply, n in await session.outbox.get():
                    if reply is None:
                        done = True
                        break
                    if out and size + n > BATCH_BYTES:  # large values go on in their own message
                        for message in _down(out, size, part):
                            yield message
                        out, size = [], 0
                    out.append(reply)
                    size += n
                if out:
                    if framing.TRACING:
                        framing.hop("gpu.down.yield")
                    for message in _down(out, size, part):
                        yield message
            await reader
        finally:
            if reader is not None:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            self.sessions.pop(sid, None)
            await session.close()
            bound.info("session closed", frames=session.frames)

    # ----- unary calls -----
    async def Hello(self, request: peer_pb2.PeerHello, context: Any) -> peer_pb2.PeerWelcome:
        await self._admit(context, "Hello")
        return peer_pb2.PeerWelcome(
            version=__version__, node=self.config.node, device=self.device_name(),
            executors=self.registry.names("interception"),
        )

    async def Ping(self, request: peer_pb2.PingRequest, context: Any) -> peer_pb2.PingReply:
        await self._admit(context, "Ping")
        return peer_pb2.PingReply(sent_ns=request.sent_ns)

    def device_name(self) -> str:
        return self.device

    def describe(self) -> dict[str, Any]:
        """Host state, for ``rrtoctl status`` (the local socket only)."""
        return {
            "listen": self.config.listen,
            "health_listen": self.config.health_listen,
            "peer_socket": self.config.peer_socket,
            "port": self.port,
            "tls": self.config.tls.mode if self.config.listen else None,
            "device": self.device_name(),
            "draining": self.draining,
            "max_sessions": self.config.executor.max_sessions,  # null: no limit
            "refused_sessions": dict(self.refused),
            "sessions": [s.describe() for s in self.sessions.values()],
        }
