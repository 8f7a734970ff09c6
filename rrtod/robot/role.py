"""The ``robot`` role: app sessions from the unix socket, relayed to GPU daemons.

An app's connection becomes a session after ``AppHello``: the host balancer picks an up host,
a Session stream is opened there, and from then on frames flow both ways in order. The relay
is the single place every op call passes, which is where the recorder and replay coordination
plug in (record/replay issue). A lost host ends the session with a ``HOST_LOST`` error frame:
the app raises or falls back to local execution, it never gets a wrong answer.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import grpc
import structlog

from rrto.v1 import local_pb2, ops_pb2
from rrtod import framing
from rrtod.config import Config
from rrtod.framing import (
    JOIN_BYTES,
    ByteBudget,
    FrameError,
    FrameReader,
    encode,
)
from rrtod.grpc_options import BATCH_BYTES
from rrtod.plugins import Registry
from rrtod.robot.host_link import HostLink
from rrtod.robot.recorder import Recorder
from rrtod.wire import session_prefix

log = structlog.get_logger("rrtod.robot")


class AppSession:
    """Robot-side view of one app process's session."""

    def __init__(self, sid: str, hello: local_pb2.AppHello, cred: tuple[int, int, int], host: HostLink):
        self.id = sid
        self.app = hello.app
        self.pid, self.uid, self.gid = cred
        self.argv = list(hello.argv)
        self.host = host
        self.host_session: str | None = None
        self.opened = time.time()
        self.calls = 0
        self.frames_up = self.frames_down = 0
        self.bytes_up = self.bytes_down = 0
        self.inferences = 0
        self.state = "opening"
        self.recorder: Recorder | None = None
        self.call: grpc.aio.StreamStreamCall | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.write_lock = asyncio.Lock()  # the relay and sequence pushes share the host stream

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id, "app": self.app, "pid": self.pid, "uid": self.uid,
            "host": self.host.name, "host_session": self.host_session, "state": self.state,
            "opened": self.opened, "ops_forwarded": self.calls, "frames_up": self.frames_up,
            "frames_down": self.frames_down, "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down, "inferences": self.inferences,
            "record": self.recorder.describe() if self.recorder else None,
        }


class RobotRole:
    def __init__(self, config: Config, registry: Registry, energy: Any = None):
        self.config = config
        self.registry = registry
        self.energy = energy
        self.hosts: dict[str, HostLink] = {}
        self.sessions: dict[str, AppSession] = {}
        self.balancer = registry.get("balancer", config.balancer).factory()
        self.search_factory = registry.get("search", config.search).factory
        self.draining = False
        self._ids = itertools.count(1)
        # Counters of sessions that have ended, so demos and benchmarks can read what a
        # finished app cost after its session is gone.
        self.finished = {"sessions": 0, "ops_forwarded": 0, "frames_up": 0, "frames_down": 0,
                         "bytes_up": 0, "bytes_down": 0, "inferences": 0}

    async def start(self) -> None:
        self._connect(self.config)

    def _connect(self, config: Config) -> None:
        for host in config.peer_hosts():
            if host.name in self.hosts:
                continue
            open_channel = self.registry.get("transport", host.transport).factory
            link = HostLink(host, config.tls, config.health, open_channel, config.node)
            self.hosts[host.name] = link
            link.start()

    async def reload(self, config: Config) -> None:
        """New hosts are connected, removed ones closed once idle; changed ones reconnect."""
        wanted = {h.name: h for h in config.peer_hosts()}
        for name, link in list(self.hosts.items()):
            if name not in wanted or wanted[name] != link.config or config.tls != self.config.tls:
                del self.hosts[name]
                await link.close()
        self.config = config
        self.balancer = self.registry.get("balancer", config.balancer).factory()
        self.search_factory = self.registry.get("search", config.search).factory
        self._connect(config)

    async def stop(self) -> None:
        for link in self.hosts.values():
            await link.close()
        self.hosts.clear()

    # ----- one app connection -----
    async def serve_app(self, hello: local_pb2.AppHello, cred: tuple[int, int, int],
                        reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        budget: ByteBudget | None = None) -> None:
        """Relay one app's session. Its frames are read within ``socket_limits.max_frame`` and
        the socket's shared receive ``budget``."""
        async def reply(msg: local_pb2.LocalReply) -> None:
            writer.write(encode(msg))
            await writer.drain()

        def error(code: str, message: str) -> local_pb2.LocalReply:
            return local_pb2.LocalReply(error=ops_pb2.Error(code=code, message=message))

        if self.draining:
            await reply(error("DRAINING", "rrtod is shutting down"))
            return
        link = await self._choose_host()
        if link is None:
            states = ", ".join(f"{h.name}={h.state}" for h in self.hosts.values()) or "none configured"
            await reply(error("NO_HOST", f"no GPU host is up ({states})"))
            return
        sid = f"s{next(self._ids)}"
        session = AppSession(sid, hello, cred, link)
        session.recorder = Recorder(hello.app, sid, self.search_factory(),
                                    Path(self.config.state_dir) / "sequences")
        bound = log.bind(session=sid, app=hello.app, pid=cred[0], host=link.name)
        call = link.open_session()
        session.call, session.writer = call, writer
        link.sessions += 1
        self.sessions[sid] = session
        try:
            await call.write(ops_pb2.SessionUp(open=ops_pb2.SessionOpen(
                app=hello.app, pid=cred[0], uid=cred[1], robot=self.config.node,
                executor=hello.executor or self.config.intercept.backend)))
            first = await call.read()
            if first is grpc.aio.EOF or first.WhichOneof("msg") != "ready":
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNKNOWN, None, None, "no ready frame")
            session.host_session = first.ready.session
            session.state = "active"
            await reply(local_pb2.LocalReply(welcome=local_pb2.AppWelcome(
                session=sid, host=link.name, device=first.ready.device)))
            bound.info("app session opened", host_session=session.host_session)
            if self.energy is not None:
                self.energy.track_process(sid, cred[0])  # the app's own CPU use, for the model meter
                self.energy.set_state(sid, "standby")

            async def downstream() -> None:
                while (message := await call.read()) is not grpc.aio.EOF:
                    if framing.TRACING:
                        framing.hop("robot.down.read")
                    frames = (message.batch.frames if message.WhichOneof("msg") == "batch"
                              else (message,))
                    parts: list[bytes] = []
                    for frame in frames:
                        if frame.WhichOneof("msg") == "defined":  # for this daemon, not the app
                            rec = session.recorder
                            d = rec.acknowledged(frame.defined) if rec is not None else None
                            if d is None:
                                continue
                            frame = ops_pb2.SessionDown(sequence=d)
                        body = frame.SerializeToString()
                        head = session_prefix(len(body))
                        session.frames_down += 1
                        session.bytes_down += len(head) + len(body)
                        parts += (head, body)
                    if parts:  # one write (and wake-up of the app's reader) per message
                        if sum(map(len, parts)) <= JOIN_BYTES:
                            writer.write(b"".join(parts))
                        else:  # large: no copy into a fresh buffer
                            for part in parts:
                                writer.write(part)
                        await writer.drain()
                        if framing.TRACING:
                            framing.hop("robot.down.written")

            # The relay awaits the app's frames directly; the host stream ending interrupts it
            # (a cancel) instead of a wait on both per burst of frames.
            relay = asyncio.current_task()
            assert relay is not None
            ended = {"host": False, "relay": False}

            def host_ended(task: asyncio.Task[None]) -> None:
                if not ended["relay"] and not task.cancelled():
                    ended["host"] = True
                    relay.cancel()

            down = asyncio.get_running_loop().create_task(downstream())
            down.add_done_callback(host_ended)
            app_frames = FrameReader(reader, local_pb2.LocalRequest,
                                     self.config.socket_limits.max_frame, budget)
            try:
                while (requests := await app_frames.read()) is not None:  # None: app closed
                    if framing.TRACING:
                        framing.hop("robot.up.read")
                    await self._relay(session, requests, call, writer)
                    if framing.TRACING:
                        framing.hop("robot.up.relayed")
            except asyncio.CancelledError:
                if not ended["host"]:
                    raise  # the daemon is stopping
                relay.uncancel()
                down.result()  # raises if the host stream broke
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None,
                                           "host closed the session") from None
            finally:
                ended["relay"] = True
                down.cancel()
                await asyncio.gather(down, return_exceptions=True)
        except grpc.aio.AioRpcError as exc:
            bound.warning("host lost", code=exc.code().name, details=exc.details())
            session.state = "host-lost"
            try:
                await reply(error("HOST_LOST", f"GPU host {link.name} ({link.address}) lost: "
                                               f"{exc.code().name} {exc.details()}"))
            except (ConnectionError, OSError):
                pass
        except FrameError as exc:
            bound.warning("bad frame from app", uid=cred[1], code=exc.code, error=str(exc))
            try:
                await reply(error(exc.code, str(exc)))
            except (ConnectionError, OSError):
                pass
        finally:
            call.cancel()
            if session.recorder is not None:
                if session.recorder.searching is not None:
                    session.recorder.searching.cancel()
                session.recorder.save_stats()
            link.sessions -= 1
            self.sessions.pop(sid, None)
            done = session.describe()
            self.finished["sessions"] += 1
            for key in ("ops_forwarded", "frames_up", "frames_down", "bytes_up", "bytes_down",
                        "inferences"):
                self.finished[key] += done[key]
            if self.energy is not None:
                self.energy.close_session(sid)
            bound.info("app session closed", ops=session.calls, frames_up=session.frames_up)

    async def _choose_host(self) -> HostLink | None:
        """The balancer's pick. Right after start (or a reload) hosts are still 'connecting':
        an app that arrives then waits for their first answer instead of a spurious NO_HOST."""
        deadline = time.monotonic() + self.config.health.timeout + self.config.health.interval
        while True:
            link = self.balancer.choose(list(self.hosts.values()))
            connecting = any(h.state == "connecting" for h in self.hosts.values())
            if link is not None or not connecting or time.monotonic() > deadline:
                return link
            await asyncio.sleep(0.02)

    async def _relay(self, session: AppSession, requests: list[local_pb2.LocalRequest],
                     call: grpc.aio.StreamStreamCall, writer: asyncio.StreamWriter) -> None:
        """Relay frames the app wrote together. Its session frames go to the host in as few
        gRPC messages as their size allows (a ``SessionUpBatch``): each message on the stream
        costs handoffs between threads and processes worth far more than a small frame.
        Energy bookkeeping (~0.1 ms a state change with the model meter) is done once the
        frames are on their way, not before."""
        batch: list[ops_pb2.SessionUp] = []
        size = 0
        energy: list[local_pb2.InferenceMark | None] = []  # None: communication starts
        bad = None
        for request in requests:
            kind = request.WhichOneof("msg")
            if kind == "session":
                frame = request.session
                n = frame.ByteSize()
                session.frames_up += 1
                session.bytes_up += n
                fkind = frame.WhichOneof("msg")
                if fkind == "call":
                    session.calls += 1
                if not energy or energy[-1] is not None:
                    energy.append(None)
                if fkind == "define" and session.recorder is not None:  # the shim gave one up
                    session.recorder.drop(frame.define.id, forget=True)
                if batch and size + n > BATCH_BYTES:  # a large tensor goes in its own message
                    await self._send_up(session, batch, call, writer)
                    batch, size = [], 0
                batch.append(frame)
                size += n
                if fkind == "query":  # restored definitions follow the query on the stream
                    await self._send_up(session, batch, call, writer)
                    batch, size = [], 0
            elif kind == "mark":
                session.inferences += 1
                energy.append(request.mark)
            else:
                bad = kind or "empty"
                break
        await self._send_up(session, batch, call, writer)  # before a bad frame too
        if self.energy is not None:
            self._account(session.id, energy)
        if bad is not None:
            raise FrameError(f"unexpected {bad} frame inside an app session")

    def _account(self, sid: str, events: list[local_pb2.InferenceMark | None]) -> None:
        """Energy states and inference marks, in the order the app sent them."""
        for m in events:
            if m is None:
                self.energy.set_state(sid, "communication")
            else:
                self.energy.inference(sid, m.index, m.start_ns, m.end_ns)
                self.energy.set_state(sid, "standby")  # the inference has ended

    async def _send_up(self, session: AppSession, frames: list[ops_pb2.SessionUp],
                       call: grpc.aio.StreamStreamCall, writer: asyncio.StreamWriter) -> None:
        """One gRPC message for ``frames``; then the recorder sees each, in order."""
        if not frames:
            return
        message = frames[0] if len(frames) == 1 else ops_pb2.SessionUp(
            batch=ops_pb2.SessionUpBatch(frames=frames))
        async with session.write_lock:
            await call.write(message)
        if framing.TRACING:
            framing.hop("robot.up.written")
        rec = session.recorder
        if rec is None:
            return
        for frame in frames:
            due = rec.observe(frame)
            if frame.WhichOneof("msg") == "query":
                for d in rec.restorable():
                    await self._push_sequence(session, d, call, writer)
            if due:
                rec.searching = asyncio.get_running_loop().create_task(
                    self._search(session, call, writer))

    async def _search(self, session: AppSession, call: grpc.aio.StreamStreamCall,
                      writer: asyncio.StreamWriter) -> None:
        """Off the relay's path: the search runs in a worker thread while frames flow."""
        rec = session.recorder
        assert rec is not None
        try:
            while True:
                rec.rerun = False
                d = await asyncio.to_thread(rec.search_now)
                if d is not None:
                    await self._push_sequence(session, d, call, writer)
                if d is not None or not rec.rerun:
                    break
        except Exception:  # a search bug costs replay, never the session
            log.exception("sequence search failed", session=session.id)
        finally:
            rec.searching = None

    async def _push_sequence(self, session: AppSession, d: ops_pb2.SequenceDef,
                             call: grpc.aio.StreamStreamCall, writer: asyncio.StreamWriter) -> None:
        """Host first; the shim gets a definition once the host has accepted it (``defined``,
        handled in the downstream relay), so the shim never asks for a replay the host cannot
        run. A drop (no calls) goes to both at once."""
        if d.calls and session.recorder is not None:
            session.recorder.pending[d.id] = d
        async with session.write_lock:
            await call.write(ops_pb2.SessionUp(define=d))
        if not d.calls:
            writer.write(encode(local_pb2.LocalReply(session=ops_pb2.SessionDown(sequence=d))))
            await writer.drain()

    async def flush(self, app: str | None) -> int:
        """Drop live sequences (of ``app``, or all): host and shim forget them, recording
        resumes. Returns how many were dropped."""
        dropped = 0
        for session in list(self.sessions.values()):
            rec = session.recorder
            if rec is None or (app is not None and session.app != app):
                continue
            for seq_id in list(rec.sequences):
                d = rec.drop(seq_id)
                if d is None or session.call is None or session.writer is None:
                    continue
                await self._push_sequence(session, d, session.call, session.writer)
                dropped += 1
        return dropped

    def describe(self) -> dict[str, Any]:
        return {
            "hosts": [h.describe() for h in self.hosts.values()],
            "sessions": [s.describe() for s in self.sessions.values()],
            "finished": dict(self.finished),
        }
