"""The ``gpu`` role: the gRPC peer service that executes app sessions for robot daemons.

Each session gets an executor from its interception backend and one worker thread. Frames are
read ahead while the worker executes, so a streamed call never waits on the network, and the
replies go back in frame order. A session ends when the robot closes its stream or the stream
breaks; either way its executor is closed and its memory freed.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
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
from rrtod import __version__, framing
from rrtod.config import Config
from rrtod.executor import Executor, ExecutorContext, HostMemory
from rrtod.grpc_options import BATCH_BYTES, SERVER_OPTIONS
from rrtod.plugins import PluginError, Registry
from rrtod.replay_host import HostReplayer
from rrtod.tls import server_credentials

log = structlog.get_logger("rrtod.gpu")

SERVICE_NAME = "rrto.v1.Peer"
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
    given, or at most ``HOLD_S`` (checked at every executor call), whichever comes first.

    Replies waiting here, and the message gRPC is sending, count against the session's memory
    (``charge``/``refund``: the executor's ``charge_reply``/``refund_reply``). A reply that
    does not fit means the client is not reading: the outbox drops it and every later one,
    and ``on_overflow`` (set by the stream) disconnects the client instead of buffering.
    """

    HOLD_S = 0.0005

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 charge: Callable[[int], str | None] | None = None,
                 refund: Callable[[int], None] | None = None):
        self.loop = loop
        self.items: collections.deque[tuple[ops_pb2.SessionDown | None, int]] = \
            collections.deque()
        self.ready = asyncio.Event()
        self.armed = False  # a wake-up of the loop is on its way (the loop clears it first)
        self.since: float | None = None  # worker only: when the oldest held reply came
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
        if reply is None or now - self.since >= self.HOLD_S:
            self.flush()

    def tick(self) -> None:
        if self.since is not None and time.monotonic() - self.since >= self.HOLD_S:
            self.flush()

    def flush(self) -> None:
        self.since = None
        if not self.armed and self.items:
            self.armed = True
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


class _Executor:
    """The session's executor as the replayer sees it: every call first lets the outbox send
    replies held too long, and is traced under ``RRTO_HOP_TRACE``."""

    def __init__(self, executor: Executor, outbox: Outbox):
        self._executor = executor
        self._outbox = outbox

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)

    def handle(self, frame: ops_pb2.SessionUp) -> Any:
        return self._run(self._executor.handle, frame)

    def run_prepared(self, *args: Any) -> Any:
        return self._run(self._executor.run_prepared, *args)

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._outbox.tick()
        if not framing.TRACING:
            return fn(*args)
        framing.hop("gpu.exec.begin")
        try:
            return list(fn(*args))
        finally:
            framing.hop("gpu.exec.end")


def _down(replies: list[ops_pb2.SessionDown]) -> ops_pb2.SessionDown:
    """One message for replies that are ready together (``SessionDownBatch``)."""
    if len(replies) == 1:
        return replies[0]
    return ops_pb2.SessionDown(batch=ops_pb2.SessionDownBatch(frames=replies))


class HostSession:
    """One app session on this host: an executor driven by one dedicated thread."""

    def __init__(self, sid: str, request: ops_pb2.SessionOpen, peer: str, executor: Executor):
        self.id = sid
        self.app = request.app
        self.pid = request.pid
        self.robot = request.robot
        self.peer = peer
        self.opened = time.time()
        self.frames = 0
        self.executor = executor
        self.outbox = Outbox(asyncio.get_running_loop(), getattr(executor, "charge_reply", None),
                             getattr(executor, "refund_reply", None))
        self.replayer = HostReplayer(_Executor(executor, self.outbox))
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
            try:
                if frame.WhichOneof("msg") in REPLAY_FRAMES:
                    self.replayer.process(frame, emit)
                else:
                    self.replayer.forwarded(frame, emit)
            except Exception as exc:  # noqa: BLE001 - reported to the app, logged here
                log.exception("executor failed", session=self.id)
                emit(ops_pb2.SessionDown(error=ops_pb2.Error(code="INTERNAL", message=repr(exc))))
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
                "peer": self.peer, "opened": self.opened, "frames": self.frames,
                "sequences": len(self.replayer.sequences), "replays": self.replayer.replays,
                "aborts": self.replayer.aborts, **stats}


class GpuRole(peer_pb2_grpc.PeerServicer):
    def __init__(self, config: Config, registry: Registry):
        self.config = config
        self.registry = registry
        self.sessions: dict[str, HostSession] = {}
        self.draining = False
        self._ids = itertools.count(1)
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else None
        self.blobs: Any = None
        self.port: int | None = None
        self.device = config.executor.device
        # executor.memory_limit: what all sessions hold together (executor.HostMemory)
        self.host_memory = HostMemory(config.executor.memory_limit)

    # ----- lifecycle -----
    async def start(self) -> None:
        from rrtod.blobstore import BlobStore  # the torch backend's weight cache, framework-neutral

        if self.device == "auto":  # importing torch takes seconds: not on the event loop
            self.device = await asyncio.to_thread(_probe_device)
        state = Path(self.config.state_dir)
        self.blobs = BlobStore(state / "blobs", self.config.weight_cache.max_bytes)
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        peer_pb2_grpc.add_PeerServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        creds = server_credentials(self.config.tls)
        if creds is None:
            log.warning("peer link is plaintext (tls.mode: insecure): use only on a trusted "
                        "network or loopback", listen=self.config.listen)
            self.port = self.server.add_insecure_port(self.config.listen)
        else:
            self.port = self.server.add_secure_port(self.config.listen, creds)
        if not self.port:
            raise OSError(f"cannot listen on {self.config.listen}")
        await self.server.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("gpu role serving", listen=self.config.listen, tls=self.config.tls.mode)

    async def drain(self) -> None:
        self.draining = True
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float) -> None:
        if self.server is not None:
            await self.server.stop(grace)
        for session in list(self.sessions.values()):
            await session.close()
        self.sessions.clear()

    def reload(self, config: Config) -> None:
        """Hot-reloadable settings (quota, allowlist) apply to sessions opened from now on;
        a new memory limit applies at once (None: the default from the device memory)."""
        self.config = config
        self.host_memory.configure(config.executor.memory_limit)

    # ----- sessions -----
    def _executor_context(self) -> ExecutorContext:
        ex = self.config.executor
        return ExecutorContext(device=ex.device, memory_quota=ex.memory_quota,
                               allow_extra=ex.allow_extra, deny=ex.deny, blobs=self.blobs,
                               state_dir=Path(self.config.state_dir),
                               host_memory=self.host_memory)

    def _new_executor(self, request: ops_pb2.SessionOpen) -> Executor:
        name = request.executor or self.config.executor.backend
        record = self.registry.get("interception", name)
        factory = getattr(record, "executor", None)
        if factory is None:
            raise PluginError(f"interception backend {name!r} has no host executor")
        return factory(self._executor_context())

    async def Session(
        self, request_iterator: AsyncIterator[ops_pb2.SessionUp], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ops_pb2.SessionDown]:
        frames = request_iterator.__aiter__()
        first = await anext(frames, None)
        if first is None or first.WhichOneof("msg") != "open":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first frame must be 'open'")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "gpu daemon is shutting down")
        try:
            executor = self._new_executor(first.open)
        except PluginError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        sid = f"{self.config.node}-{next(self._ids)}"
        session = HostSession(sid, first.open, context.peer(), executor)
        self.sessions[sid] = session
        bound = log.bind(session=sid, app=first.open.app, pid=first.open.pid, robot=first.open.robot)
        bound.info("session opened")
        loop = asyncio.get_running_loop()
        handler = asyncio.current_task()

        def disconnect(reason: str) -> None:
            """The client does not read its replies: end the stream rather than buffer them."""
            bound.warning("client does not read its replies: session aborted", reason=reason)
            abort = loop.create_task(context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"replies are not being read and exceed the session's memory: {reason}"))
            abort.add_done_callback(lambda t: t.cancelled() or t.exception())
            if handler is not None:
                handler.cancel()  # the stream may be stuck in a send that never completes

        session.outbox.on_overflow = disconnect

        async def read_ahead() -> None:
            try:
                async for frame in frames:
                    if framing.TRACING:
                        framing.hop("gpu.up.read")
                    kind = frame.WhichOneof("msg")
                    batch = list(frame.batch.frames) if kind == "batch" else [frame]
                    end = next((i for i, f in enumerate(batch) if f.WhichOneof("msg") == "close"),
                               None)
                    if end is not None:  # the robot ends the session
                        batch = batch[:end]
                    if batch:
                        session.frames += len(batch)
                        for f in batch:  # releases the replay in progress may act on early
                            session.replayer.read(f)
                        await session.read_ahead(batch, frame.ByteSize())
                    if end is not None:
                        break
            finally:
                session.queue(session.outbox.put, None)  # after every frame queued before it

        reader: asyncio.Task[None] | None = None
        try:
            ready = await session.submit(executor.open, first.open)
            if not ready.session:
                ready.session = sid
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
                        yield _down(out)
                        out, size = [], 0
                    out.append(reply)
                    size += n
                if out:
                    if framing.TRACING:
                        framing.hop("gpu.down.yield")
                    yield _down(out)
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
        return peer_pb2.PeerWelcome(
            version=__version__, node=self.config.node, device=self.device_name(),
            executors=self.registry.names("interception"),
        )

    async def Ping(self, request: peer_pb2.PingRequest, context: Any) -> peer_pb2.PingReply:
        return peer_pb2.PingReply(sent_ns=request.sent_ns)

    async def QueryBlobs(self, request: ops_pb2.BlobQuery, context: Any) -> ops_pb2.BlobQueryReply:
        return ops_pb2.BlobQueryReply(missing=[h for h in request.hashes if not self.blobs.has(h)])

    async def Stats(self, request: peer_pb2.StatsRequest, context: Any) -> peer_pb2.StatsReply:
        return peer_pb2.StatsReply(json=json.dumps(self.describe()))

    def device_name(self) -> str:
        return self.device

    def describe(self) -> dict[str, Any]:
        return {
            "listen": self.config.listen,
            "port": self.port,
            "tls": self.config.tls.mode,
            "device": self.device_name(),
            "draining": self.draining,
            "sessions": [s.describe() for s in self.sessions.values()],
        }
