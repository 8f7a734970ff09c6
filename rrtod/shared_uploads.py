"""A replayed inference's large input through shared memory instead of the app's socket.

The shim writes each replayed inference's input to the robot daemon's unix socket: for a
640x640 camera frame (4.9 MB) the app spends ~0.7 ms of CPU in the write and the daemon
2.5-4 ms reading it in chunks, on the inference's critical path, and a robot's ARM cores take
several times that. DESIGN.md's wire lets large tensors go through shared memory instead.

One region per app session, made by the robot daemon (``Region``): a memfd sealed against
shrinking and growing, read by the daemon with ``pread`` (nothing the app does to it can make
that fault or grow the daemon's memory), sent with the welcome as SCM_RIGHTS ancillary data on
a hello that asked for one (``AppHello.shared_uploads``). The shim (``Writer``) copies an
upload of at least ``SHARED_MIN`` bytes into it and sends a small ``SharedUpload`` frame in its
place, in order with its other frames; the daemon copies the bytes out when it relays that
frame and acknowledges its ``seq`` with its next write to the app (``LocalReply.shared_done``).
The shim writes the region again only once every upload it put there is acknowledged: otherwise
(a daemon with nothing to say yet) the upload goes on the socket as before. The acknowledgement
travels on the socket, so the daemon's reads of the region happen before the app's next write
to it on any CPU, ARM's included.

Everything here degrades to the socket: no memfd (not Linux), a region not sent or not
mappable, an upload larger than the region, an unacknowledged one.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import threading
from typing import Any

from rrto.v1 import local_pb2, ops_pb2
from rrtod.framing import FrameError, encode
from rrtod.wire import upload_frame

# Smaller uploads go on the socket: one write of a few KB costs less than the region's copy
# and acknowledgement bookkeeping.
SHARED_MIN = 64 << 10
_SEALS = (getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
          | getattr(fcntl, "F_SEAL_SEAL", 0))


def supported() -> bool:
    """Whether this platform has sealable memfds (Linux)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and bool(_SEALS)


class Region:
    """The robot daemon's side: the region it made for one app session. It reads the region
    with ``pread`` rather than through a mapping: a range the app never wrote then reads as
    zeros without the daemon's own memory growing (a read fault on a shared mapping would make
    the page, charged to the daemon), and no read can fault at all."""

    def __init__(self, size: int, name: str = "rrto-upload"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            # Sealed before the app can see it: its size is fixed for good.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        self.size = size
        self.copied = 0  # the last seq copied out
        self.acked = 0  # the last seq told to the app

    def send_welcome(self, sock: Any, data: bytes) -> int:
        """Write ``data`` (the encoded welcome) with the region's descriptor attached, on the
        app's socket (an asyncio transport's: nothing else has been written to it yet, so the
        welcome's bytes are the stream's first). Returns how many bytes went; the caller
        writes the rest the usual way."""
        dup = socket.socket(fileno=os.dup(sock.fileno()))
        try:
            return socket.send_fds(dup, [data], [self.fd])
        finally:
            dup.close()

    def frame(self, up: local_pb2.SharedUpload) -> tuple[ops_pb2.SessionUp, int]:
        """The session frame ``up`` stands for, its bytes copied out of the region, and its
        size as the socket would have carried it. Raises FrameError for a range outside the
        region or a malformed meta."""
        end = up.offset + up.length
        if end > self.size or self.fd is None:
            raise FrameError(f"shared upload [{up.offset}, {end}) lies outside the "
                             f"{self.size}-byte region")
        frame = ops_pb2.SessionUp()
        frame.arg.slot = up.slot
        upload = frame.arg.tensor.upload
        try:
            upload.meta.ParseFromString(up.meta)
        except Exception as exc:  # noqa: BLE001 - DecodeError, by any backend's name
            raise FrameError(f"malformed shared upload meta: {exc}") from None
        data = os.pread(self.fd, up.length, up.offset)
        if len(data) != up.length:  # cannot happen to a sealed region: said, not assumed
            raise FrameError(f"shared upload [{up.offset}, {end}) read {len(data)} bytes")
        upload.data = data  # the one copy out of the region
        if up.palette:  # (checked where it is decoded, as on the socket)
            upload.palette, upload.palette_block = up.palette, up.palette_block
        self.copied = max(self.copied, up.seq)
        return frame, upload_frame(up.slot, up.meta, data, up.palette, up.palette_block).size

    def ack(self) -> bytes:
        """The acknowledgement to send with the daemon's next write to the app, if one is
        due (encoded), else b''."""
        if self.copied <= self.acked:
            return b""
        self.acked = self.copied
        return encode(local_pb2.LocalReply(shared_done=self.copied))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Writer:
    """The shim's side: the region the daemon sent, written by whichever app thread sends,
    acknowledged from its reader thread. Never unmapped while the process runs: a send after
    the channel closed fails on the socket, not on the region."""

    def __init__(self, fd: int, size: int):
        try:
            if os.fstat(fd).st_size < size:
                raise OSError(f"the shared upload region is smaller than {size} bytes")
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.size = size
        self.sent = 0  # the last seq written
        self.done = 0  # the last seq the daemon acknowledged
        self._lock = threading.Lock()

    def acknowledged(self, seq: int) -> None:
        with self._lock:
            self.done = max(self.done, seq)

    def put(self, slot: int, meta: bytes, data: Any, palette: bytes = b"",
            block: int = 0) -> bytes | None:
        """The encoded ``SharedUpload`` frame for this upload (``data``, palette-coded with
        ``palette``), its bytes copied into the region; None (send it on the socket) when it
        is small, does not fit, or the daemon has not acknowledged the region's last upload
        yet."""
        n = len(data)
        if n < SHARED_MIN or n > self.size:
            return None
        with self._lock:
            if self.done < self.sent:
                return None
            self.sent += 1
            seq = self.sent
        self._map[:n] = data
        return encode(local_pb2.LocalRequest(shared_upload=local_pb2.SharedUpload(
            seq=seq, slot=slot, meta=meta, offset=0, length=n, palette=palette,
            palette_block=block)))
