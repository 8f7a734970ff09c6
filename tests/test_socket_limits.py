"""The robot's unix socket under abuse by a local client (issue 10, finding 5): frame size caps
before and after the hello, the shared receive budget, the hello timeout and the connection
limit. Each test uses a real daemon; the echo backend keeps them free of torch."""

from __future__ import annotations

import json
import os
import socket
import time

import psutil
import pytest

from rrto.v1 import local_pb2
from rrtod.framing import FramedSocket
from rrtod.shim.channel import SocketChannel
from rrtod.wire import HEADER
from testkit.daemons import ECHO
from testkit.peer import open_app


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def closed_by_daemon(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # it closed with our unread bytes in its queue
        return True


def refusals(d) -> list[dict]:
    out = []
    for line in d.logs().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "connection refused":
            out.append(entry)
    return out


def test_frame_caps_and_receive_budget(rrtod_daemon):
    """Two connections declaring 900 MiB frames before their hello: the daemon answers from
    the header and closes, instead of buffering what they send (it grew by 1.8 GB before).
    After the hello, frames are capped by max_frame and large ones share one budget."""
    d = rrtod_daemon(socket_limits={"max_frame": "1MiB", "max_buffered": "1536KiB"}, **ECHO)
    before = rss(d.proc.pid)
    conns = []
    for _ in range(2):
        raw = FramedSocket(d.socket, timeout=5)
        raw.sock.sendall(HEADER.pack(900 << 20) + b"\0" * 4096)
        reply = raw.recv(local_pb2.LocalReply)
        assert reply.error.code == "BAD_FRAME" and "65536-byte limit" in reply.error.message
        assert closed_by_daemon(raw.sock)  # nothing more is read from it
        conns.append(raw)
    assert rss(d.proc.pid) - before < 8 << 20
    for raw in conns:
        raw.close()
    (refused,) = [r for r in refusals(d) if r["reason"] == "bad frame before hello"]
    assert refused["uid"] == os.getuid() and refused["pid"] == os.getpid()
    assert d.ctl("status")["connections"]["refused"]["bad frame before hello"] == 2
    # After the hello, over max_frame: refused from the header.
    app, welcome = open_app(d.socket)
    assert welcome.WhichOneof("msg") == "welcome"
    app.sock.sendall(HEADER.pack(2 << 20) + b"\0" * 1024)
    reply = app.recv(local_pb2.LocalReply)
    assert reply.error.code == "BAD_FRAME" and "1048576-byte limit" in reply.error.message
    app.close()
    # Two large frames in flight at once do not fit the budget: the second is refused.
    first, _ = open_app(d.socket)
    first.sock.sendall(HEADER.pack(1 << 20) + b"\x12" + b"\0" * 1000)  # incomplete
    time.sleep(0.3)
    assert d.ctl("status")["connections"]["buffered"] > 0
    second, _ = open_app(d.socket)
    second.sock.sendall(HEADER.pack(1 << 20) + b"\x12" + b"\0" * 1000)
    reply = second.recv(local_pb2.LocalReply)
    assert reply.error.code == "BUSY" and "receive buffer" in reply.error.message
    second.close()
    first.close()  # gives its share back
    d.wait_for(lambda s: s["connections"]["buffered"] == 0, what="budget given back")
    third, welcome = open_app(d.socket)
    assert welcome.WhichOneof("msg") == "welcome"
    third.close()


def test_connection_idle_before_hello_is_closed(rrtod_daemon):
    d = rrtod_daemon(socket_limits={"hello_timeout": 0.5}, **ECHO)
    raw = FramedSocket(d.socket, timeout=10)
    start = time.monotonic()
    reply = raw.recv(local_pb2.LocalReply)
    assert reply.error.code == "TIMEOUT"
    assert closed_by_daemon(raw.sock)
    assert time.monotonic() - start < 5
    raw.close()
    # An app that said hello is not subject to it, and a long command line does not push
    # its hello over the control frame limit.
    app = SocketChannel(d.socket, "test-app", os.getpid(), ["x" * 50000] * 4, executor="echo")
    time.sleep(1.0)
    (session,) = d.ctl("status")["sessions"]
    assert session["app"] == "test-app"
    app.close()


def test_connection_limit_keeps_rrtoctl_working(rrtod_daemon):
    """App sessions never take the last slot, and more idle connections than the limit (20,200
    used up the descriptors before) do not lock out rrtoctl or a new app: a new connection
    displaces the oldest one idling before its hello. Refusals are logged once, not each."""
    d = rrtod_daemon(socket_limits={"max_connections": 8, "hello_timeout": 60}, **ECHO)
    apps = [open_app(d.socket) for _ in range(8)]
    codes = [w.WhichOneof("msg") if w.WhichOneof("msg") == "welcome" else w.error.code
             for _, w in apps]
    assert codes == ["welcome"] * 7 + ["TOO_MANY_SESSIONS"]
    apps.pop()[0].close()
    idle = []
    for _ in range(40):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(d.socket)
        idle.append(s)
    status = d.ctl("status")
    assert status["connections"]["connections"] <= 8
    assert len(status["sessions"]) == 7
    apps.pop()[0].close()  # a slot for an app again: taken from an idle connection
    d.wait_for(lambda s: len(s["sessions"]) == 6, what="app session closed")
    app, welcome = open_app(d.socket)
    assert welcome.WhichOneof("msg") == "welcome"
    app.close()
    logged = refusals(d)
    assert {r["reason"].split(":")[0] for r in logged} == {"app session limit reached",
                                                          "displaced"}
    assert len(logged) == 2  # once per kind of refusal and uid
    assert all(r["uid"] == os.getuid() and r["pid"] == os.getpid() for r in logged)
    for s in idle:
        s.close()
    for conn, _ in apps:
        conn.close()


def test_frame_reader_takes_large_frames_from_the_budget_and_gives_them_back():
    """Unit level: a large frame is read only within the shared budget, whatever happens."""
    import asyncio

    from rrtod.framing import ByteBudget, FrameBusy, FrameError, FrameReader, encode

    frame = encode(local_pb2.LocalRequest(ctl=local_pb2.CtlRequest(command="x" * (600 << 10))))

    async def read(data: bytes, budget: ByteBudget, eof: bool = True) -> list:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        return await FrameReader(reader, local_pb2.LocalRequest, 1 << 20, budget).read()

    budget = ByteBudget(1 << 20)
    (got,) = asyncio.run(read(frame, budget))
    assert len(got.ctl.command) == 600 << 10 and budget.used == 0
    budget.used = 900 << 10  # another connection's frame in flight
    with pytest.raises(FrameBusy) as busy:
        asyncio.run(read(frame, budget))
    assert busy.value.code == "BUSY" and budget.used == 900 << 10
    budget.used = 0
    with pytest.raises(FrameError, match="inside a frame"):
        asyncio.run(read(frame[: 300 << 10], budget))  # the peer leaves mid-frame
    assert budget.used == 0


def test_connections_fit_the_descriptor_limit_with_a_region_each(monkeypatch):
    """An app session with a shared upload region holds two descriptors (its socket and the
    region's memfd): under a limit that cannot be raised, the daemon serves half as many
    connections when regions are on, and says so, rather than failing to accept."""
    import resource

    from rrtod import local_server

    monkeypatch.setattr(resource, "getrlimit", lambda _what: (1024, 1024))
    monkeypatch.setattr(resource, "setrlimit", lambda *_a: None)
    head = local_server.FD_HEADROOM
    assert local_server.usable_connections(1024) == 1024 - head
    assert local_server.usable_connections(1024, per_connection=2) == (1024 - head) // 2
    assert local_server.usable_connections(256, per_connection=2) == 256  # fits as asked
