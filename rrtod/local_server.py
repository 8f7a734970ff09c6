"""The daemon's unix socket: apps' shims and rrtoctl speak framed protobuf here.

The caller's pid/uid/gid come from the kernel (SO_PEERCRED), never from what the caller says.
Access control is the socket's file mode (0660 by default: owner and the ``rrto`` group).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from rrto.v1 import local_pb2, ops_pb2
from rrtod.framing import FrameError, encode, read_frame

log = structlog.get_logger("rrtod.socket")
# Bytes a connection buffers before the daemon stops reading it (asyncio's default is 64 KiB):
# an app's input tensors of a few MB arrive in a few reads instead of stop-and-go 64 KiB steps.
STREAM_LIMIT = 4 << 20

Cred = tuple[int, int, int]
CtlHandler = Callable[[local_pb2.CtlRequest, Cred], Awaitable[local_pb2.CtlReply]]
AppHandler = Callable[
    [local_pb2.AppHello, Cred, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]
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


class LocalServer:
    def __init__(self, path: str, mode: int, on_ctl: CtlHandler, on_app: AppHandler | None):
        self.path = Path(path)
        self.mode = mode
        self.on_ctl = on_ctl
        self.on_app = on_app
        self.server: asyncio.base_events.Server | None = None
        self.connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            if _in_use(self.path):
                raise OSError(f"another rrtod is already serving {self.path}")
            self.path.unlink()  # stale socket from a crashed daemon
        old_umask = os.umask(0o777 & ~self.mode)  # never world-accessible, even for an instant
        try:
            self.server = await asyncio.start_unix_server(self._client, path=str(self.path),
                                                          limit=STREAM_LIMIT)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, self.mode)
        log.info("listening", socket=str(self.path), mode=oct(self.mode))

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

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        try:
            cred = peer_credentials(writer.get_extra_info("socket"))
            await self._serve(reader, writer, cred)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception:  # a bug in one connection must not take the daemon down
            log.exception("connection handler failed")
        finally:
            self.connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     cred: Cred) -> None:
        async def send_error(code: str, message: str) -> None:
            writer.write(encode(local_pb2.LocalReply(error=ops_pb2.Error(code=code, message=message))))
            await writer.drain()

        while True:
            try:
                request = await read_frame(reader, local_pb2.LocalRequest)
            except FrameError as exc:
                log.warning("bad frame", pid=cred[0], error=str(exc))
                await send_error("BAD_FRAME", str(exc))
                return
            if request is None:
                return
            kind = request.WhichOneof("msg")
            if kind == "ctl":
                reply = await self.on_ctl(request.ctl, cred)
                writer.write(encode(local_pb2.LocalReply(ctl=reply)))
                await writer.drain()
            elif kind == "app_hello":
                if self.on_app is None:
                    await send_error("NO_ROBOT_ROLE", "this rrtod does not hold the robot role")
                    return
                await self.on_app(request.app_hello, cred, reader, writer)
                return
            else:
                await send_error("BAD_FRAME", f"unexpected {kind or 'empty'} frame before app_hello")
                return
