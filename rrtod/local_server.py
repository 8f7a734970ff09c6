"""The daemon's unix socket: apps' shims and rrtoctl speak framed protobuf here.

The caller's pid/uid/gid come from the kernel (SO_PEERCRED), never from what the caller says.
Access control is the socket's file mode (0660 by default: owner and the ``rrto`` group).

Those who may connect still must not be able to exhaust the daemon (``socket_limits``): a
frame before the hello is at most ``max_control_frame`` bytes, a connection that says nothing
for ``hello_timeout`` seconds before its hello is closed, large app frames are read only within
a byte budget shared by all connections, and at most ``max_connections`` are served at once.
When that many are open, a new connection displaces the oldest one idling before its hello,
and app sessions never take the last ``ctl_reserve`` slots: ``rrtoctl`` always gets in.
Every refusal is logged with the peer's uid and pid, once a minute per kind and uid.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from rrto.v1 import local_pb2, ops_pb2
from rrtod.config import SocketLimitsConfig
from rrtod.framing import ByteBudget, FrameError, encode, read_frame

log = structlog.get_logger("rrtod.socket")
# Bytes a connection buffers before the daemon stops reading it (asyncio's default is 64 KiB):
# an app's input tensors of a few MB arrive in a few reads instead of stop-and-go 64 KiB steps.
STREAM_LIMIT = 4 << 20
# Before the hello a connection gets a read-ahead of this (asyncio stops reading a connection at
# twice its limit): 1,024 silent or junk-sending clients then hold at most 128 MiB between them.
CONTROL_STREAM_LIMIT = 64 << 10
# Descriptors the daemon needs besides app connections: gRPC channels, state files, metrics.
FD_HEADROOM = 256
REFUSAL_LOG_INTERVAL = 60.0  # seconds between two log lines of one kind of refusal per uid

Cred = tuple[int, int, int]
CtlHandler = Callable[[local_pb2.CtlRequest, Cred], Awaitable[local_pb2.CtlReply]]
AppHandler = Callable[
    [local_pb2.AppHello, Cred, asyncio.StreamReader, asyncio.StreamWriter, ByteBudget],
    Awaitable[None],
]


def peer_credentials(sock: socket.socket) -> Cred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def _in_use(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


class RefusalLog:
    """Logs refusals without letting a flood of them flood the journal: the first of each kind
    per uid, then at most one line a minute carrying how many were not logged."""

    def __init__(self, interval: float = REFUSAL_LOG_INTERVAL):
        self.interval = interval
        self.last: dict[tuple[str, int], float] = {}
        self.suppressed: dict[tuple[str, int], int] = {}
        self.counts: dict[str, int] = {}

    def refuse(self, reason: str, cred: Cred, **fields: object) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        key = (reason, cred[1])
        now = time.monotonic()
        if now - self.last.get(key, -self.interval) < self.interval:
            self.suppressed[key] = self.suppressed.get(key, 0) + 1
            return
        self.last[key] = now
        log.warning("connection refused", reason=reason, uid=cred[1], pid=cred[0],
                    not_logged_since_last=self.suppressed.pop(key, 0), **fields)


@dataclass(eq=False)
class Connection:
    """One client of the socket, as the limits see it."""

    task: asyncio.Task[None]
    cred: Cred
    opened: float = field(default_factory=time.monotonic)
    app: bool = False  # said hello: an app session
    idle: bool = True  # waiting for a frame before its hello: may be displaced


def usable_connections(wanted: int, per_connection: int = 1) -> int:
    """``wanted`` or fewer, so that connections (``per_connection`` descriptors each: an app's
    shared upload region is one more) plus ``FD_HEADROOM`` fit the descriptor limit; raises
    the soft limit towards the hard one first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted * per_connection + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < need:
        usable = max(2, (soft - FD_HEADROOM) // per_connection)
        log.warning("descriptor limit below socket_limits.max_connections + headroom; serving "
                    "fewer connections", max_connections=wanted, serving=usable, nofile=soft)
        return usable
    return wanted


class LocalServer:
    def __init__(self, path: str, mode: int, on_ctl: CtlHandler, on_app: AppHandler | None,
                 limits: SocketLimitsConfig | None = None):
        self.path = Path(path)
        self.mode = mode
        self.on_ctl = on_ctl
        self.on_app = on_app
        self.limits = limits or SocketLimitsConfig()
        self.max_connections = self.limits.max_connections
        self.budget = ByteBudget(self.limits.max_buffered)
        self.refusals = RefusalLog()
        self.server: asyncio.base_events.Server | None = None
        self.connections: dict[asyncio.Task[None], Connection] = {}

    @property
    def ctl_reserve(self) -> int:
        """Slots app sessions never take, so rrtoctl reaches a daemon full of apps."""
        return max(1, self.max_connections // 16)

    async def start(self) -> None:
        self.max_connections = usable_connections(self.limits.max_connections,
                                                  2 if self.limits.shared_bytes else 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            if _in_use(self.path):
                raise OSError(f"another rrtod is already serving {self.path}")
            self.path.unlink()  # stale socket from a crashed daemon
        old_umask = os.umask(0o777 & ~self.mode)  # never world-accessible, even for an instant
        try:
            self.server = await asyncio.start_unix_server(self._client, path=str(self.path),
                                                          limit=CONTROL_STREAM_LIMIT)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, self.mode)
        log.info("listening", socket=str(self.path), mode=oct(self.mode),
                 max_connections=self.max_connections)

    def stop_accepting(self) -> None:
        if self.server is not None:
            self.server.close()

    async def close(self) -> None:
        self.stop_accepting()
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def describe(self) -> dict[str, object]:
        """For status: connections, the receive budget and refusals by kind."""
        return {"connections": len(self.connections),
                "app_connections": sum(c.app for c in self.connections.values()),
                "max_connections": self.max_connections,
                "buffered": self.budget.used, "max_buffered": self.budget.limit,
                "refused": dict(self.refusals.counts)}

    def _admit(self, conn: Connection) -> bool:
        """Room for ``conn``: a free slot, or the slot of the oldest connection idling before
        its hello (closed here)."""
        if len(self.connections) < self.max_connections:
            return True
        idle = [c for c in self.connections.values() if c.idle and not c.app]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.opened)
        self.refusals.refuse("displaced: idle before hello while the connection limit was "
                             "reached", oldest.cred, max_connections=self.max_connections)
        oldest.idle = False
        oldest.task.cancel()
        self.connections.pop(oldest.task, None)
        return True

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            cred = peer_credentials(writer.get_extra_info("socket"))
        except OSError:
            writer.close()
            return
        conn = Connection(task, cred)
        if not self._admit(conn):
            self.refusals.refuse("connection limit reached", cred,
                                 max_connections=self.max_connections)
            writer.close()
            return
        self.connections[task] = conn
        try:
            await self._serve(reader, writer, conn)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception:  # a bug in one connection must not take the daemon down
            log.exception("connection handler failed")
        finally:
            self.connections.pop(task, None)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     conn: Connection) -> None:
        cred = conn.cred

        async def send_error(code: str, message: str) -> None:
            writer.write(encode(local_pb2.LocalReply(error=ops_pb2.Error(code=code, message=message))))
            await writer.drain()

        limits = self.limits
        while True:
            conn.idle = True
            try:
                async with asyncio.timeout(limits.hello_timeout):
                    request = await read_frame(reader, local_pb2.LocalRequest,
                                               limits.max_control_frame)
            except TimeoutError:
                self.refusals.refuse("no request before hello_timeout", cred,
                                     hello_timeout=limits.hello_timeout)
                await send_error("TIMEOUT", f"no request within {limits.hello_timeout} s")
                return
            except FrameError as exc:
                self.refusals.refuse("bad frame before hello", cred, error=str(exc))
                await send_error(exc.code, str(exc))
                return
            finally:
                conn.idle = False
            if request is None:
                return
            kind = request.WhichOneof("msg")
            if kind == "ctl":
                reply = await self.on_ctl(request.ctl, cred)
                writer.write(encode(local_pb2.LocalReply(ctl=reply)))
                try:  # a client that does not read its replies must not hold its slot forever
                    async with asyncio.timeout(limits.hello_timeout):
                        await writer.drain()
                except TimeoutError:
                    self.refusals.refuse("replies not read within hello_timeout", cred)
                    return
            elif kind == "app_hello":
                if self.on_app is None:
                    await send_error("NO_ROBOT_ROLE", "this rrtod does not hold the robot role")
                    return
                apps = sum(c.app for c in self.connections.values())
                if apps >= self.max_connections - self.ctl_reserve:
                    self.refusals.refuse("app session limit reached", cred, app_sessions=apps)
                    await send_error("TOO_MANY_SESSIONS",
                                     f"{apps} app sessions are open on this robot, the most "
                                     "socket_limits.max_connections allows")
                    return
                conn.app = True
                # An app session's read-ahead: its input tensors arrive in a few large reads.
                # (StreamReader has no public setter for it; _limit is what it reads.)
                reader._limit = STREAM_LIMIT  # type: ignore[attr-defined]
                await self.on_app(request.app_hello, cred, reader, writer, self.budget)
                return
            else:
                await send_error("BAD_FRAME", f"unexpected {kind or 'empty'} frame before app_hello")
                return
