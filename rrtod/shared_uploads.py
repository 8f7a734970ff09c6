"""A replayed inference's large input through shared memory instead of the app's socket.

The shim writes each replayed inference's input to the robot daemon's unix socket: for a
640x640 camera frame (4.9 MB) the app spends ~0.7 ms of CPU in the write and the daemon
2.5-4 ms reading it in chunks, on the inference's critical path, and a robot's ARM cores take
several times that. DESIGN.md's wire lets large tensors go through shared memory instead.

One region per app session, made by the robot daemon (``Region``): a memfd sealed against
shrinking and growing, so that the app can never make the daemon's reads fault, sent with the
welcome as SCM_RIGHTS ancillary data on a hello that asked for one (``AppHello.shared_uploads``).
The shim (``Writer``) copies an upload of at least ``SHARED_MIN`` bytes into it and sends a
small ``SharedUpload`` frame in its place, in order with its other frames; the daemon copies
the bytes out when it relays that frame and acknowledges its ``seq`` with its next write to
the app (``LocalReply.shared_done``). The shim writes the region again only once every upload
it put there is acknowledged: otherwise (a daemon with nothing to say yet) the upload goes on
the socket as before. The acknowledgement travels on the socket, so the daemon's reads of the
region happen before the app's next write to it on any CPU, ARM's included.

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
    """The robot daemon's side: the region it made for one app session, read only."""

    def __init__(self, size: int, name: str = "rrto-upload"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            # Sealed before the app can see it: its size is fixed for good, so a read inside
            # it never faults whatever the app does with its descriptor.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd  # until ``send_welcome`` has passed it on
        self.size = size
        self.view = memoryview(self._map)
        self.copied = 0  # the last seq copied out
        self.acked = 0  # the last seq told to the app
        self.uploads = 0
        self.bytes = 0

    def send_welcome(self, sock: Any, data: bytes) -> int:
        """Write ``data`` (the encoded welcome) with the region's descriptor attached, on the
        app's socket (an asyncio transport's: nothing else has been written to it yet, so the
        welcome's bytes are the stream's first). Returns how many bytes went; the caller
        writes the rest the usual way. The daemon's own descriptor is closed: the mapping
        stays."""
        dup = socket.socket(fileno=os.dup(sock.fileno()))
        try:
            return socket.send_fds(dup, [data], [self.fd])
        finally:
            dup.close()
            self.close_fd()

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def frame(self, up: local_pb2.SharedUpload) -> tuple[ops_pb2.SessionUp, int]:
        """The session frame ``up`` stands for, its bytes copied out of the region, and its
        size as the socket would have carried it. Raises FrameError for a range outside the
        region or a malformed meta."""
        end = up.offset + up.length
        if end > self.size or up.offset > self.size:
            raise FrameError(f"shared upload [{up.offset}, {end}) lies outside the "
                             f"{self.size}-byte region")
        wire = upload_frame(up.slot, up.meta, self.view[up.offset:end])
        frame = ops_pb2.SessionUp()
        try:  # the meta is parsed with the frame
            frame.ParseFromString(b"".join(wire.parts))  # the one copy out of the region
        except Exception as exc:  # noqa: BLE001 - DecodeError, by any backend's name
            raise FrameError(f"malformed shared upload: {exc}") from None
        self.copied = max(self.copied, up.seq)
        self.uploads += 1
        self.bytes += up.length
        return frame, wire.size

    def ack(self) -> bytes:
        """The acknowledgement to send with the daemon's next write to the app, if one is
        due (encoded), else b''."""
        if self.copied <= self.acked:
            return b""
        self.acked = self.copied
        return encode(local_pb2.LocalReply(shared_done=self.copied))

    def close(self) -> None:
        self.close_fd()
        self.view.release()
        try:
            self._map.close()
        except BufferError:  # a slice still referenced: unmapped when it is collected
            pass


class Writer:
    """The shim's side: the region the daemon sent, written by whichever app thread sends
    (under the channel's write lock), acknowledged from its reader thread."""

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
        self.uploads = 0  # how many went through the region
        self._lock = threading.Lock()

    def acknowledged(self, seq: int) -> None:
        with self._lock:
            self.done = max(self.done, seq)

    def put(self, slot: int, meta: bytes, data: Any) -> bytes | None:
        """The encoded ``SharedUpload`` frame for this upload, its bytes copied into the
        region; None (send it on the socket) when it is small, does not fit, or the
        daemon has not acknowledged the region's last upload yet."""
        n = len(data)
        if n < SHARED_MIN or n > self.size:
            return None
        with self._lock:
            if self.done < self.sent:
                return None
            self.sent += 1
            seq = self.sent
        self._map[:n] = data
        self.uploads += 1
        return encode(local_pb2.LocalRequest(shared_upload=local_pb2.SharedUpload(
            seq=seq, slot=slot, meta=meta, offset=0, length=n)))

    def close(self) -> None:
        self._map.close()
