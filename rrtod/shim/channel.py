"""How an interception backend's frames reach an executor: the robot daemon's unix socket, or
in-process. Part of the shim, not of a backend: any backend's client sends ``ops`` frames the
same way, and ``activate`` opens the socket for whichever backend is configured.

A channel only moves frames (their layout is ``rrtod.wire``'s). ``send`` writes a batch in
order without waiting; replies arrive on ``on_down`` (from a reader thread for the socket,
inline for the loopback) and a lost connection on ``on_lost``. Keeping this tiny lets the same
client run against real daemons and, in unit tests, straight against an executor in process.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

from rrto.v1 import local_pb2, ops_pb2
from rrtod import framing
from rrtod import shared_uploads as _shared
from rrtod.framing import FramedSocket, encode, send_parts
from rrtod.wire import EncodedFrame, session_prefix

OnDown = Callable[[ops_pb2.SessionDown], None]
OnLost = Callable[[str], None]


class Channel(Protocol):
    """How an interceptor's frames reach the robot daemon (the shim builds it, connected, before
    calling the interceptor factory; ``rrtod.hookspecs`` names it in the interception contract).
    It only moves frames: ``send`` writes a batch in order without waiting; replies arrive on
    ``on_down`` and a lost connection on ``on_lost``."""

    session: str  # the session id the daemon gave
    host: str  # the GPU host it chose
    device: str  # the host's device
    # a robot daemon answers a mark with ``left_replay`` (``SearchHint``); a loopback does not
    # (a channel that does not declare it, a wrapper's, is taken not to, and gets no such mark)
    answers_marks: bool

    def start(self, on_down: OnDown, on_lost: OnLost) -> None: ...
    # frames: messages, or wire.EncodedFrame (a message in wire form, which also answers
    # SerializeToString and WhichOneof)
    def send(self, frames: list[ops_pb2.SessionUp]) -> None: ...
    def mark(self, index: int, start_ns: int, end_ns: int, thread: int = 0,
             search_wait_us: int = 0, left_replay: bool = False) -> None:
        """Report one inference's span (CLOCK_MONOTONIC ns) for energy accounting, where app
        thread ``thread``'s next inference starts (the robot's search), and how long the app
        waited for searches since its previous mark (the robot's hint budget).
        ``left_replay``: the inference left a replay and forwarded after it; sent at once,
        answered with a ``SearchHint``."""
        ...
    def flush_marks(self) -> None: ...
    def close(self) -> None: ...
    def reopen(self) -> Channel:
        """A new connection like this one, not started (after the host was lost: the
        daemon picks a host that is up). Raises ``OSError`` (``NoHost``) if there is none."""
        ...


class NoHost(ConnectionError):
    """The robot daemon answered the hello with an error (no GPU host, unknown executor)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


# The daemon reads at most socket_limits.max_control_frame (64 KiB by default) before the hello:
# the hello's free text is cut to fit well within it. argv is for status display only.
HELLO_TEXT = 16 << 10


def hello_argv(argv: list[str]) -> list[str]:
    """``argv`` cut to ``HELLO_TEXT`` characters in all."""
    out, left = [], HELLO_TEXT
    for arg in argv:
        if left <= 0:
            out.append("...")
            break
        out.append(arg[:left])
        left -= len(arg)
    return out


class SocketChannel:
    """The robot daemon's unix socket: ``AppHello`` -> ``AppWelcome``, then session frames."""

    _marks: list[bytes] | tuple[()] = ()  # queued inference marks (a list once connected)
    answers_marks = True  # the robot daemon answers a mark with ``left_replay``
    # the region for large replayed inputs (``rrtod.shared_uploads``), if the daemon sent one
    shared: _shared.Writer | None = None

    def __init__(self, path: str, app: str, pid: int, argv: list[str], executor: str = "torch",
                 timeout: float = 10.0, versions: dict[str, str] | None = None,
                 shared_uploads: bool = True):
        self._hello = (path, app, pid, argv, executor, timeout, versions, shared_uploads)
        self.sock = FramedSocket(path, timeout=timeout)
        shared = shared_uploads and _shared.supported()
        try:
            self.sock.send(local_pb2.LocalRequest(app_hello=local_pb2.AppHello(
                app=app[:HELLO_TEXT], pid=pid, argv=hello_argv(argv), executor=executor,
                versions={k[:64]: v[:256] for k, v in (versions or {}).items()},
                shared_uploads=shared)))
            reply, fds = self.sock.recv_with_fds(local_pb2.LocalReply)
        except BaseException:
            self.sock.close()
            raise
        if fds and reply.WhichOneof("msg") == "welcome" and reply.welcome.shared_bytes:
            try:
                self.shared = _shared.Writer(fds.pop(0), reply.welcome.shared_bytes)
            except (OSError, ValueError):
                pass  # not mappable here: every upload goes on the socket
        for fd in fds:
            os.close(fd)
        kind = reply.WhichOneof("msg")
        if kind == "error":
            self.sock.close()
            raise NoHost(reply.error.code or "NO_HOST", reply.error.message)
        if kind != "welcome":
            self.sock.close()
            raise NoHost("BAD_REPLY", f"rrtod answered the hello with {kind!r}")
        self.session = reply.welcome.session
        self.host = reply.welcome.host
        self.device = reply.welcome.device
        self.sock.sock.settimeout(None)
        self._wlock = threading.Lock()
        self._closed = False
        self._marks: list[bytes] = []  # encoded, not sent yet (under _wlock)

    def start(self, on_down: OnDown, on_lost: OnLost) -> None:
        self._on_down, self._on_lost = on_down, on_lost
        threading.Thread(target=self._reader, name="rrto-reader", daemon=True).start()

    def _reader(self) -> None:
        reason = "the robot daemon closed the connection"
        try:
            while True:
                reply = self.sock.recv(local_pb2.LocalReply)
                if framing.TRACING:
                    framing.hop("shim.recv")
                kind = reply.WhichOneof("msg")
                if kind == "session":
                    self._on_down(reply.session)
                elif kind == "shared_done" and self.shared is not None:
                    self.shared.acknowledged(reply.shared_done)
                elif kind == "error":
                    reason = f"{reply.error.code}: {reply.error.message}"
                    if reply.error.code == "HOST_LOST":
                        break
                    self._on_down(ops_pb2.SessionDown(error=reply.error))
        except Exception as exc:  # connection reset, malformed frame
            if not self._closed:
                reason = f"connection to rrtod lost: {exc}"
        self._on_lost(reason)

    def send(self, frames: list[ops_pb2.SessionUp]) -> None:
        # A LocalRequest holding SessionUp bytes is field 2, length-delimited: wrap the bytes
        # directly instead of copying each message into a LocalRequest. One write for all:
        # the robot daemon relays what arrives together to the host as one message.
        if framing.TRACING:
            framing.hop("shim.send")
        parts: list[Any] = []
        shared = self.shared
        for up in frames:
            if type(up) is EncodedFrame:  # an upload's bytes straight from the tensor
                # through the shared region where it takes it (one upload there at a time:
                # another thread's finds it busy and goes on the socket)
                framed = (shared.put(*up.upload)
                          if shared is not None and up.upload is not None else None)
                if framed is not None:
                    parts.append(framed)
                else:
                    parts += (session_prefix(up.size), *up.parts)
                continue
            body = up.SerializeToString()
            parts += (session_prefix(len(body)), body)
        with self._wlock:
            if self._marks:  # queued inference marks go first, in the same write
                parts[:0] = self._marks
                self._marks = []
            send_parts(self.sock.sock, parts)

    def mark(self, index: int, start_ns: int, end_ns: int, thread: int = 0,
             search_wait_us: int = 0, left_replay: bool = False) -> None:
        """Queue an inference mark for the app's next write. A mark ends with the app's last
        read of an inference's outputs, just before its next inference starts. Written at once,
        it woke the robot daemon for its energy bookkeeping right when that start arrived, on
        the replayed inference's critical path (+0.3-0.6 ms per mlp inference here); a helper
        thread that wrote it a little later cost more still (its wake-ups take the GIL from the
        app thread: up to +8 ms on this loaded 2-core machine). With the next frames, it costs
        nothing and is accounted after they are relayed. So the daemon learns of an inference
        when the app sends its next one (or exits: ``flush_marks``). Except the mark of an
        inference that left its replay (``left_replay``), written at once: the robot may
        search for the way it went, and the app's next inference waits for its answer."""
        wire = encode(local_pb2.LocalRequest(mark=local_pb2.InferenceMark(
            index=index, start_ns=start_ns, end_ns=end_ns, thread=thread,
            search_wait_us=search_wait_us, left_replay=left_replay)))
        with self._wlock:
            self._marks.append(wire)
            if left_replay:
                parts, self._marks = self._marks, []
                send_parts(self.sock.sock, parts)

    def flush_marks(self) -> None:
        """Write queued marks now (the app exits)."""
        with self._wlock:
            if self._marks:
                parts, self._marks = self._marks, []
                send_parts(self.sock.sock, parts)

    def close(self) -> None:
        self._closed = True
        self.sock.close()

    def reopen(self) -> SocketChannel:
        return SocketChannel(*self._hello)


class LoopbackChannel:
    """Feeds frames straight into an executor in this process (unit tests, benchmarks)."""

    answers_marks = False  # no robot daemon: no search, no answer to a mark

    def __init__(self, executor, app: str = "loopback",
                 versions: dict[str, str] | None = None, reopen: Any = None) -> None:
        self.executor = executor
        self._reopen = reopen  # () -> a new executor: the host that takes over after a loss
        self._hello = (app, versions)
        ready = executor.open(ops_pb2.SessionOpen(app=app, executor="torch", versions=versions))
        self.session, self.device, self.host = ready.session, ready.device, "loopback"
        self.marks: list[tuple[int, int, int]] = []
        self._lock = threading.Lock()
        self.lost = False

    def start(self, on_down: OnDown, on_lost: OnLost) -> None:
        self._on_down, self._on_lost = on_down, on_lost

    def send(self, frames: list[ops_pb2.SessionUp]) -> None:
        if self.lost:
            raise ConnectionError("loopback host lost")
        with self._lock:
            for up in frames:
                if up.WhichOneof("msg") == "define":
                    continue  # a sequence the shim gave up: the robot daemon's, and none here
                # Round-trip through bytes so tests exercise the real encoding.
                wire = ops_pb2.SessionUp.FromString(up.SerializeToString())
                for down in self.executor.handle(wire):
                    self._on_down(ops_pb2.SessionDown.FromString(down.SerializeToString()))

    def mark(self, index: int, start_ns: int, end_ns: int, thread: int = 0,
             search_wait_us: int = 0, left_replay: bool = False) -> None:
        self.marks.append((index, start_ns, end_ns))

    def flush_marks(self) -> None:
        pass

    def lose(self, reason: str = "host vanished") -> None:
        """Simulate a host that disappears."""
        self.lost = True
        self.executor.close()
        self._on_lost(reason)

    def close(self) -> None:
        self.executor.close()

    def reopen(self) -> LoopbackChannel:
        if self._reopen is None:
            raise ConnectionError("no host to take over")
        return LoopbackChannel(self._reopen(), *self._hello, reopen=self._reopen)
