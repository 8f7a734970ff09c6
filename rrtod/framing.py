"""Stream I/O of length-prefixed protobuf frames on a SOCK_STREAM unix socket: readers,
writers, receive budgets, hop tracing. What a frame is (``HEADER``, ``MAX_FRAME``, the session
envelope) is declared in ``rrtod.wire``; this module moves frames.

Each frame is a 4-byte little-endian length, then that many bytes of one serialized message.
A framed socket costs ~0.05 ms a round trip here against ~0.5 ms for gRPC (measured here), which
is why the app <-> robot daemon hop is not gRPC. Both ends refuse frames over ``MAX_FRAME`` so
that a corrupt length cannot make the daemon allocate gigabytes; the daemon passes a smaller
limit for frames before a connection's hello and a ``ByteBudget`` shared by all connections, so
that peers who declare large frames cannot together hold more than a set amount of its memory.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import socket
import time

from google.protobuf.message import DecodeError, Message

from rrtod.wire import HEADER, MAX_FRAME

READ_CHUNK = 1 << 18  # what a relay reads at once: a burst of small frames, or a large one's head
JOIN_BYTES = 64 << 10  # writes up to this size are joined into one buffer, larger ones not


# Hop timestamps for bench/plumbing.py: with RRTO_HOP_TRACE=DIR every process that moves frames
# (shim, robot daemon, GPU daemon) records (event, CLOCK_MONOTONIC ns) at each hop and writes
# them to DIR/<pid>.json at exit. One clock for all processes on a machine, so a frame's path
# can be followed across them. Off (the default), a hop costs one global test.
_HOP_DIR = os.environ.get("RRTO_HOP_TRACE")
TRACING = bool(_HOP_DIR)
_hops: list[tuple[str, int]] = []


def hop(event: str) -> None:
    """Record ``event`` now; call sites test ``TRACING`` first."""
    _hops.append((event, time.monotonic_ns()))


def _dump_hops() -> None:
    if _hops and _HOP_DIR:
        with open(os.path.join(_HOP_DIR, f"{os.getpid()}.json"), "w") as f:
            json.dump(_hops, f)


if TRACING:
    atexit.register(_dump_hops)


class FrameError(Exception):
    """The peer sent something that is not a valid frame; the connection must be dropped.
    ``code`` is the error code the daemon replies with before it closes the connection."""

    code = "BAD_FRAME"


class FrameBusy(FrameError):
    """A frame that is valid but does not fit in the daemon's receive budget right now."""

    code = "BUSY"


class ByteBudget:
    """Bytes of large incoming frames all connections may buffer at once. One event loop
    serves every connection, so taking and giving back needs no lock."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


def encode(message: Message) -> bytes:
    payload = message.SerializeToString()
    return HEADER.pack(len(payload)) + payload


def decode(kind: type[Message], payload: bytes | memoryview) -> Message:
    message = kind()
    try:
        message.ParseFromString(payload)
    except DecodeError as exc:
        raise FrameError(f"malformed {kind.__name__} frame: {exc}") from None
    return message


def _peek(buf: bytearray) -> int:
    """The length in the frame header at the start of ``buf`` (which holds one)."""
    (length,) = HEADER.unpack_from(buf, 0)
    _check_length(length)
    return length


def _check_length(length: int, limit: int = MAX_FRAME) -> None:
    if length > limit:
        raise FrameError(f"frame of {length} bytes exceeds the {limit}-byte limit")


async def read_frame(reader: asyncio.StreamReader, kind: type[Message],
                     max_frame: int = MAX_FRAME) -> Message | None:
    """The next message, or None at a clean end of stream. A header that declares more than
    ``max_frame`` bytes raises before any of them is read."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise FrameError("connection closed inside a frame header") from None
        return None
    (length,) = HEADER.unpack(header)
    _check_length(length, max_frame)
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise FrameError("connection closed inside a frame") from None
    return decode(kind, payload)


class FrameReader:
    """Reads frames in bursts: ``read`` returns the next frame and every complete frame that
    arrived with it, so a relay can pass on what its peer wrote in one go in one message.

    Memory: a frame over ``max_frame`` is refused from its header; a large frame (over
    ``READ_CHUNK``) is read only once its length is taken from ``budget`` (``FrameBusy`` when
    the budget cannot hold it), and given back once it has arrived (it is parsed next)."""

    def __init__(self, reader: asyncio.StreamReader, kind: type[Message],
                 max_frame: int = MAX_FRAME, budget: ByteBudget | None = None):
        self.reader = reader
        self.kind = kind
        self.max_frame = max_frame
        self.budget = budget
        self.buf = bytearray()
        # Per message the last ``read`` returned, its bytes on the wire (the frame's length):
        # ``ByteSize`` would serialize the message again to count them (0.4 ms for a 4.9 MB
        # upload with protobuf's upb backend).
        self.sizes: list[int] = []

    def _split(self) -> list[Message]:
        out, pos, buf = [], 0, self.buf
        sizes = self.sizes = []
        with memoryview(buf) as view:  # parsed in place: no copy of a large frame's bytes
            while len(buf) - pos >= HEADER.size:
                (length,) = HEADER.unpack_from(buf, pos)
                end = pos + HEADER.size + length
                try:
                    _check_length(length, self.max_frame)
                    if len(buf) < end:
                        break
                    out.append(decode(self.kind, view[pos + HEADER.size:end]))
                    sizes.append(length)
                except FrameError:
                    if out:
                        break  # the frames before it go first; the next read raises
                    raise
                pos = end
        if pos:
            del buf[:pos]
        return out

    def _missing(self) -> int:
        """Bytes still missing from the frame at the head of the buffer (at least 1)."""
        if len(self.buf) < HEADER.size:
            return HEADER.size - len(self.buf)
        (length,) = HEADER.unpack_from(self.buf, 0)
        return max(HEADER.size + length - len(self.buf), 1)

    async def read(self) -> list[Message] | None:
        """One or more messages; None at a clean end of stream."""
        while True:
            frames = self._split()
            if frames:
                return frames
            missing = self._missing()
            if missing > READ_CHUNK and len(self.buf) >= HEADER.size:
                await self._read_large(missing)
            else:
                data = await self.reader.read(READ_CHUNK)
                if not data:
                    if self.buf:
                        raise FrameError("connection closed inside a frame")
                    return None
                self.buf += data

    async def _read_large(self, missing: int) -> None:
        """The rest of a large frame in one wait, not chunk by chunk, within the budget."""
        if self.budget is not None and not self.budget.take(missing):
            raise FrameBusy(f"a frame of {missing} more bytes does not fit in the daemon's "
                            f"receive buffer now ({self.budget.used} of {self.budget.limit} "
                            "bytes in use by other connections); retry later")
        try:
            self.buf += await self.reader.readexactly(missing)
        except asyncio.IncompleteReadError:
            raise FrameError("connection closed inside a frame") from None
        finally:
            if self.budget is not None:
                self.budget.give(missing)


def send_parts(sock: socket.socket, parts: list[bytes]) -> None:
    """``sendall`` of the parts' concatenation; large ones are not copied into one buffer
    first (a fresh buffer of a few MB costs more than the syscalls)."""
    if sum(map(len, parts)) <= JOIN_BYTES:
        sock.sendall(b"".join(parts))
        return
    views = [memoryview(p) for p in parts if p]
    while views:
        sent = sock.sendmsg(views[:64])
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


class FramedSocket:
    """Blocking client side (shim, rrtoctl): no event loop in the app's process."""

    def __init__(self, path: str, timeout: float | None = None):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self._buf = bytearray()

    def send(self, message: Message) -> None:
        self.sock.sendall(encode(message))

    def _recv_exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self.sock.recv(max(n - len(self._buf), 1 << 16))
            if not chunk:
                raise ConnectionError(f"rrtod closed the connection on {self.path}")
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def recv(self, kind: type[Message]) -> Message:
        (length,) = HEADER.unpack(self._recv_exact(HEADER.size))
        _check_length(length)
        return decode(kind, self._recv_exact(length))

    def recv_with_fds(self, kind: type[Message], maxfds: int = 1) -> tuple[Message, list[int]]:
        """The next frame and the descriptors that came with its bytes (SCM_RIGHTS), read
        with ``recvmsg``: a plain read would drop them. The caller owns (closes) them."""
        fds: list[int] = []
        try:
            while len(self._buf) < HEADER.size or len(self._buf) < HEADER.size + _peek(self._buf):
                chunk, got, _flags, _addr = socket.recv_fds(self.sock, 1 << 16, maxfds)
                fds += got
                if not chunk:
                    raise ConnectionError(f"rrtod closed the connection on {self.path}")
                self._buf += chunk
            return self.recv(kind), fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> FramedSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
