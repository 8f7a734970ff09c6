"""The replay plumbing's pieces in isolation: frames read in bursts, frames relayed to the host
in one message, replies coalesced by the GPU host. No daemons, no torch."""

from __future__ import annotations

import asyncio
import threading
import types

import pytest

from rrto.v1 import local_pb2, ops_pb2, peer_pb2, peer_pb2_grpc
from rrtod import framing, wire
from rrtod.framing import FrameError, FrameReader, encode
from rrtod.gpu.service import HostSession, Outbox, _unsized, add_peer
from rrtod.grpc_options import BATCH_BYTES
from rrtod.robot.relay import AppRelay, AppSession


def fetch(seq: int) -> local_pb2.LocalRequest:
    return local_pb2.LocalRequest(session=ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=seq, id=seq)))


def reader_of(*chunks: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=1 << 16)
    for chunk in chunks:
        reader.feed_data(chunk)
    if eof:
        reader.feed_eof()
    return reader


def test_frame_reader_returns_what_arrived_together() -> None:
    async def main() -> None:
        data = b"".join(encode(fetch(i)) for i in range(1, 4))
        r = FrameReader(reader_of(data, encode(fetch(4))[:3], eof=False), local_pb2.LocalRequest)
        frames = await r.read()
        assert [f.session.fetch.seq for f in frames] == [1, 2, 3]
        assert r.sizes == [f.ByteSize() for f in frames]  # each one's bytes, from the wire
        r.reader.feed_data(encode(fetch(4))[3:])  # the rest of a frame split across writes
        r.reader.feed_eof()
        assert [f.session.fetch.seq for f in await r.read()] == [4]
        assert r.sizes == [fetch(4).ByteSize()]
        assert await r.read() is None

    asyncio.run(main())


def test_frame_reader_large_frame_and_errors() -> None:
    async def main() -> None:
        big = local_pb2.LocalRequest(session=ops_pb2.SessionUp(
            blob=ops_pb2.BlobPut(hash=b"w" * (3 * framing.READ_CHUNK))))
        r = FrameReader(reader_of(encode(big), encode(fetch(7))), local_pb2.LocalRequest)
        got, sizes = [], []
        while (frames := await r.read()) is not None:
            got += frames
            sizes += r.sizes
        assert got == [big, fetch(7)] and sizes == [big.ByteSize(), fetch(7).ByteSize()]
        # Good frames before a malformed one are returned first; the next read raises.
        bad = wire.HEADER.pack(3) + b"\xff\xff\xff"
        r = FrameReader(reader_of(encode(fetch(1)) + bad), local_pb2.LocalRequest)
        assert [f.session.fetch.seq for f in await r.read()] == [1]
        with pytest.raises(FrameError):
            await r.read()
        r = FrameReader(reader_of(encode(fetch(1))[:-1]), local_pb2.LocalRequest)
        with pytest.raises(FrameError, match="inside a frame"):
            await r.read()
        r = FrameReader(reader_of(wire.HEADER.pack(wire.MAX_FRAME + 1)),
                        local_pb2.LocalRequest)
        with pytest.raises(FrameError, match="exceeds"):
            await r.read()

    asyncio.run(main())


class FakeCall:
    def __init__(self) -> None:
        self.written: list[ops_pb2.SessionUp] = []

    async def write(self, message: ops_pb2.SessionUp) -> None:
        self.written.append(message)


def app_relay() -> tuple[AppRelay, FakeCall]:
    """The relay of one session with no recorder or energy meter, its host stream a fake."""
    host = types.SimpleNamespace(name="h1", address="unix:h1")
    session = AppSession("s1", local_pb2.AppHello(app="app.py"), (1, 1000, 1000), host)
    call = FakeCall()
    return AppRelay(session, call, frames=None, writer=None), call


def relay(requests: list[local_pb2.LocalRequest]) -> tuple[list[ops_pb2.SessionUp], AppSession]:
    up, call = app_relay()
    asyncio.run(up.up(requests))
    return call.written, up.session


def test_relay_sends_a_burst_as_one_message() -> None:
    mark = local_pb2.LocalRequest(mark=local_pb2.InferenceMark(index=1, start_ns=1, end_ns=2))
    written, session = relay([fetch(1), fetch(2), mark, fetch(3)])
    assert len(written) == 1 and written[0].WhichOneof("msg") == "batch"
    assert [f.fetch.seq for f in written[0].batch.frames] == [1, 2, 3]
    assert session.frames_up == 3 and session.inferences == 1
    written, _ = relay([fetch(1)])
    assert written == [fetch(1).session]  # a single frame travels as itself


def test_relay_splits_at_large_frames_and_queries() -> None:
    big = local_pb2.LocalRequest(session=ops_pb2.SessionUp(
        blob=ops_pb2.BlobPut(hash=b"w" * BATCH_BYTES)))
    query = local_pb2.LocalRequest(session=ops_pb2.SessionUp(query=ops_pb2.BlobQuery()))
    written, _ = relay([fetch(1), big, fetch(2), query, fetch(3)])
    kinds = [w.WhichOneof("msg") for w in written]
    assert kinds == ["fetch", "blob", "batch", "fetch"]
    assert [f.WhichOneof("msg") for f in written[2].batch.frames] == ["fetch", "query"]


def test_relay_passes_frames_before_a_bad_one() -> None:
    bad = local_pb2.LocalRequest(ctl=local_pb2.CtlRequest(command="status"))
    up, call = app_relay()
    with pytest.raises(FrameError, match="unexpected ctl"):
        asyncio.run(up.up([fetch(1), bad, fetch(2)]))
    assert [w.fetch.seq for w in call.written] == [1]


def test_outbox_coalesces_until_flush_and_ends() -> None:
    async def main() -> None:
        box = Outbox(asyncio.get_running_loop())
        box.HOLD_S = 60.0

        def worker() -> None:
            box.put(ops_pb2.SessionDown(fetched=ops_pb2.Fetched(id=1)))
            box.put(ops_pb2.SessionDown(fetched=ops_pb2.Fetched(id=2)))
            box.flush()  # the end of a frame batch
            box.put(None)

        threading.Thread(target=worker).start()
        got: list = []
        while not got or got[-1][0] is not None:
            got += await asyncio.wait_for(box.get(), 10)
        assert [g.fetched.id for g, _ in got[:-1]] == [1, 2]

    asyncio.run(main())


def test_outbox_sends_a_reply_held_too_long() -> None:
    async def main() -> None:
        box = Outbox(asyncio.get_running_loop())
        box.HOLD_S = box.GAP_S = 0.0  # every reply goes at once
        threading.Thread(target=box.put, args=(ops_pb2.SessionDown(
            fetched=ops_pb2.Fetched(id=5)),)).start()
        got = await asyncio.wait_for(box.get(), 10)
        assert [g.fetched.id for g, _ in got] == [5]

    asyncio.run(main())


def test_outbox_spaces_messages_of_a_busy_worker() -> None:
    """A reply goes at once when none went recently; the next, within ``GAP_S`` of that,
    waits for the worker's next flush (the end of its frames), however often it ticks."""
    async def main() -> None:
        box = Outbox(asyncio.get_running_loop())
        box.HOLD_S, box.GAP_S = 0.0, 60.0
        first = threading.Thread(target=box.put, args=(ops_pb2.SessionDown(
            fetched=ops_pb2.Fetched(id=1)),))
        first.start()
        first.join()
        got = await asyncio.wait_for(box.get(), 10)
        assert [g.fetched.id for g, _ in got] == [1]

        def held() -> None:
            box.put(ops_pb2.SessionDown(fetched=ops_pb2.Fetched(id=2)))
            box.tick()

        second = threading.Thread(target=held)
        second.start()
        second.join()
        assert not box.armed and [g.fetched.id for g, _ in box.items] == [2]
        box.flush()
        got = await asyncio.wait_for(box.get(), 10)
        assert [g.fetched.id for g, _ in got] == [2]

    asyncio.run(main())


def test_outbox_says_when_its_held_replies_must_go() -> None:
    """``due``: none held, 0.0; else ``HOLD_S`` after the oldest held reply, and no sooner
    than ``GAP_S`` after the last message (what a native run asks between its calls)."""
    async def main() -> None:
        box = Outbox(asyncio.get_running_loop())
        box.HOLD_S, box.GAP_S = 0.25, 60.0
        assert box.due() == 0.0
        box.put(ops_pb2.SessionDown(fetched=ops_pb2.Fetched(id=1)))  # held: HOLD_S
        assert box.since is not None and box.due() == box.since + 0.25
        box.flush()
        assert box.due() == 0.0
        box.put(ops_pb2.SessionDown(fetched=ops_pb2.Fetched(id=2)))
        assert box.due() == box.flushed + 60.0
        box.tick()  # not yet: still held
        assert [g.fetched.id for g, _ in box.items] == [1, 2]

    asyncio.run(main())


def test_outbox_counts_queued_replies_and_overflows_once() -> None:
    """Replies count from ``put`` until the stream sent them (the next ``get``); one that
    the session has no room for is dropped, as is every later one, and the stream is told
    once (it disconnects the client)."""
    async def main() -> None:
        held: list[int] = []
        room = 300

        def charge(n: int) -> str | None:
            if sum(held) + n > room:
                return f"no room for {n}"
            held.append(n)
            return None

        def refund(n: int) -> None:
            while n > 0:
                n -= held.pop()

        box = Outbox(asyncio.get_running_loop(), charge, refund)
        box.HOLD_S = box.GAP_S = 0.0
        told: list[str] = []
        box.on_overflow = told.append
        big = ops_pb2.SessionDown(fetched=ops_pb2.Fetched(
            id=1, tensor=ops_pb2.TensorData(data=bytes(100))))
        n = big.ByteSize()
        box.put(big)
        got = await asyncio.wait_for(box.get(), 10)
        assert got == [(big, n)] and held == [n]
        box.put(big)  # the first is still being sent: both count
        assert held == [n, n]
        for _ in range(3):
            threading.Thread(target=box.put, args=(big,)).start()
        await asyncio.sleep(0.2)
        assert told == [f"no room for {n}"] and box.overflow == told[0]
        got = await asyncio.wait_for(box.get(), 10)  # the first was sent: refunded
        assert len(got) == 1 and held == [n]
        box.put(big)
        box.put(None)  # the end still goes through
        got = await asyncio.wait_for(box.get(), 10)
        assert [r for r, _ in got] == [None] and held == []

    asyncio.run(main())


def test_read_ahead_waits_for_the_worker_beyond_its_cap(monkeypatch) -> None:
    """Frames queued for the worker are capped in bytes: beyond the cap the stream is not
    read until the worker has executed some of them (gRPC flow control then holds the robot
    back), instead of queueing without bound."""
    import rrtod.gpu.service as gpu

    monkeypatch.setattr(gpu, "READ_AHEAD_BYTES", 100)

    async def main() -> None:
        gate = threading.Event()
        ex = EchoExecutor()
        session = HostSession("h2", ops_pb2.SessionOpen(), "peer", ex)
        session.queue(gate.wait)  # the worker is busy
        frames = [fetch(1).session]
        for _ in range(3):  # 3 x 60 bytes: the third waits
            await asyncio.wait_for(session.read_ahead(frames, 60), 10)
            if session.backlog > 100:
                break
        assert session.backlog == 120
        third = asyncio.get_running_loop().create_task(session.read_ahead(frames, 60))
        await asyncio.sleep(0.2)
        assert not third.done()
        gate.set()
        await asyncio.wait_for(third, 10)
        await session.close()
        assert ex.handled == ["fetch"] * 3

    asyncio.run(main())


class EchoExecutor:
    """Answers every fetch with its id; counts the calls it sees. Declares neither optional
    capability (rrtod.executor)."""

    replay = None
    reply_memory = None

    def __init__(self) -> None:
        self.handled: list[str] = []

    def handle(self, frame: ops_pb2.SessionUp):
        self.handled.append(frame.WhichOneof("msg"))
        if frame.WhichOneof("msg") == "fetch":
            yield ops_pb2.SessionDown(fetched=ops_pb2.Fetched(seq=frame.fetch.seq))

    def close(self) -> None:
        pass


def test_host_session_processes_a_batch_in_order() -> None:
    async def main() -> None:
        ex = EchoExecutor()
        session = HostSession("h1", ops_pb2.SessionOpen(), "peer", ex)
        session.outbox.HOLD_S = 60.0
        frames = [fetch(i).session for i in (1, 2, 3)]
        session.queue(session.process, frames)
        got = await asyncio.wait_for(session.outbox.get(), 10)
        assert [g.fetched.seq for g, _ in got] == [1, 2, 3]  # one wake-up for the batch
        assert ex.handled == ["fetch"] * 3
        await session.close()

    asyncio.run(main())


def test_send_parts_large_and_small() -> None:
    import socket

    def receive(sock: socket.socket, n: int, out: bytearray) -> None:
        while len(out) < n:
            out += sock.recv(1 << 20)

    a, b = socket.socketpair()
    try:
        for parts in ([b"ab", b"cd"], [b"x" * 100, b"", b"y" * (3 << 20), b"z"]):
            want = b"".join(parts)
            got = bytearray()
            reader = threading.Thread(target=receive, args=(b, len(want), got))
            reader.start()
            framing.send_parts(a, parts)
            reader.join(10)
            assert bytes(got) == want
    finally:
        a.close()
        b.close()


def test_prefer_polling_engine_respects_the_operator_and_import_order(monkeypatch) -> None:
    import sys

    from rrtod.grpc_options import POLLING_EXPERIMENTS, prefer_polling_engine

    monkeypatch.delitem(sys.modules, "grpc", raising=False)
    env: dict[str, str] = {}
    assert prefer_polling_engine(env) and env == {"GRPC_EXPERIMENTS": POLLING_EXPERIMENTS}
    env = {"GRPC_EXPERIMENTS": ""}  # the operator's choice, even empty, wins
    assert not prefer_polling_engine(env) and env == {"GRPC_EXPERIMENTS": ""}
    monkeypatch.setitem(sys.modules, "grpc", types.ModuleType("grpc"))
    env = {}
    assert not prefer_polling_engine(env) and env == {}  # too late: gRPC read it at import


def test_the_gpu_daemon_gets_each_session_message_with_its_size_from_the_wire() -> None:
    """``gpu.service.add_peer``: the Session stream deserializes to (message, its bytes on the
    wire), so the read-ahead never serializes a frame again to count it; the other methods
    are gRPC's generated handlers as they are."""
    class Server:
        def __init__(self) -> None:
            self.generic: list = []
            self.named: dict = {}

        def add_generic_rpc_handlers(self, handlers) -> None:
            self.generic.extend(handlers)

        def add_registered_method_handlers(self, name, handlers) -> None:
            self.named[name] = handlers

    server = Server()
    add_peer(peer_pb2_grpc.PeerServicer(), server)
    handlers = server.named["rrto.v1.Peer"]
    up = ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=3, tensor=ops_pb2.TensorRef(
        upload=ops_pb2.TensorData(data=b"x" * 70000))))
    wire_bytes = up.SerializeToString()
    message, size = handlers["Session"].request_deserializer(wire_bytes)
    assert message == up and size == len(wire_bytes) == up.ByteSize()
    assert set(handlers) == {"Hello", "Ping", "Session"} and len(server.generic) == 1
    hello = peer_pb2.PeerHello(node="r")
    assert handlers["Hello"].request_deserializer(hello.SerializeToString()) == hello
    assert _unsized(up) == (up, up.ByteSize())  # from older generated code
