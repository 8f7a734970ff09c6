"""Large replayed inputs through the robot daemon's shared region (``rrtod.shared_uploads``):
the region's descriptor crosses a real unix socket with the welcome, the shim's frame stands
for exactly the session frame the socket would have carried, the region is written again only
once acknowledged, and nothing the app does to it or says about it can make the daemon read
outside it."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import types

import pytest
import torch

from rrto.v1 import local_pb2, ops_pb2
from rrto_plugins.torch import codec
from rrtod import shared_uploads
from rrtod.framing import FramedSocket, FrameError, encode
from rrtod.robot.relay import AppRelay, AppSession
from rrtod.shared_uploads import SHARED_MIN, Region, Writer
from rrtod.shim.channel import SocketChannel
from rrtod.wire import HEADER, upload_frame

pytestmark = pytest.mark.skipif(not shared_uploads.supported(), reason="no sealable memfd here")
SIZE = 1 << 20
META = ops_pb2.TensorMeta(dtype="float32", shape=[1, 3, 128, 128]).SerializeToString()


def data(n: int = 3 * 128 * 128 * 4, seed: int = 0) -> memoryview:
    g = torch.Generator().manual_seed(seed)
    return memoryview(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy())


def sent_welcome(tmp_path, region: Region) -> tuple[local_pb2.LocalReply, list[int]]:
    """What the app's end of a real unix socket reads when the daemon's end sends the welcome
    with the region's descriptor, as ``AppRelay`` does."""
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(1)
        app = FramedSocket(path, timeout=5)
        conn, _ = server.accept()
        with conn:
            welcome = encode(local_pb2.LocalReply(welcome=local_pb2.AppWelcome(
                session="s1", shared_bytes=region.size)))
            assert region.send_welcome(conn, welcome) == len(welcome)
        reply, fds = app.recv_with_fds(local_pb2.LocalReply)
        app.close()
    assert region.fd is not None  # the daemon keeps its own, to read the region with
    return reply, fds


def connected(tmp_path, region: Region) -> Writer:
    """The shim's writer of the region the welcome brought."""
    reply, fds = sent_welcome(tmp_path, region)
    assert len(fds) == 1 and reply.welcome.shared_bytes == SIZE
    return Writer(fds[0], reply.welcome.shared_bytes)


def request(framed: bytes) -> local_pb2.LocalRequest:
    (n,) = HEADER.unpack_from(framed)
    assert len(framed) == HEADER.size + n
    return local_pb2.LocalRequest.FromString(framed[HEADER.size:])


def test_an_upload_through_the_region_is_the_frame_the_socket_would_carry(tmp_path) -> None:
    region = Region(SIZE)
    writer = connected(tmp_path, region)
    raw = data()
    framed = writer.put(7, META, raw)
    assert framed is not None and len(framed) < 100  # the bytes are in the region, not here
    frame, n = region.frame(request(framed).shared_upload)
    inline = upload_frame(7, META, raw)
    assert frame == ops_pb2.SessionUp.FromString(inline.SerializeToString())
    assert n == inline.size  # counted as the socket would have carried it
    assert frame.arg.tensor.upload.data == bytes(raw)
    region.close()


def test_a_palette_coded_upload_through_the_region_is_the_frame_the_socket_would_carry(
        tmp_path) -> None:
    """A camera frame scaled from 8-bit pixels, palette-coded by the shim
    (``codec.replay_upload``): its byte-an-element data goes through the region, its palette
    with the small frame, and the host decodes the frame the socket would have carried to
    the app's exact tensor."""
    region = Region(SIZE)
    writer = connected(tmp_path, region)
    pixels = torch.randint(0, 256, (1, 3, 256, 256), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    image = pixels.float() / 255
    inline = codec.replay_upload(7, image, {})
    slot, meta, coded, palette, block = inline.upload
    assert palette and len(coded) == image.numel() >= SHARED_MIN
    framed = writer.put(*inline.upload)
    assert framed is not None and len(framed) < len(palette) + 100  # its data in the region
    frame, n = region.frame(request(framed).shared_upload)
    assert frame == ops_pb2.SessionUp.FromString(inline.SerializeToString())
    assert n == inline.size
    assert torch.equal(codec.from_tensor_data(frame.arg.tensor.upload).view(torch.int32),
                       image.view(torch.int32))
    region.close()


def test_the_region_is_written_again_only_once_the_daemon_acknowledged_it(tmp_path) -> None:
    region = Region(SIZE)
    writer = connected(tmp_path, region)
    assert region.ack() == b""  # nothing copied out yet
    first = writer.put(0, META, data(seed=1))
    assert first is not None
    # Not acknowledged: the next upload goes on the socket, the region keeps the first's bytes.
    assert writer.put(0, META, data(seed=2)) is None
    frame, _ = region.frame(request(first).shared_upload)
    assert frame.arg.tensor.upload.data == bytes(data(seed=1))
    ack = region.ack()
    (n,) = HEADER.unpack_from(ack)
    assert local_pb2.LocalReply.FromString(ack[HEADER.size:]).shared_done == 1
    assert region.ack() == b""  # told once
    writer.acknowledged(1)
    second = writer.put(0, META, data(seed=3))
    assert second is not None and request(second).shared_upload.seq == 2
    assert region.frame(request(second).shared_upload)[0].arg.tensor.upload.data == bytes(
        data(seed=3))
    region.close()


def test_small_and_oversized_uploads_stay_on_the_socket(tmp_path) -> None:
    region = Region(SIZE)
    writer = connected(tmp_path, region)
    assert writer.put(0, META, data(SHARED_MIN - 1)) is None
    assert writer.put(0, META, data(SIZE + 1)) is None
    assert writer.put(0, META, data(SIZE)) is not None  # exactly the region
    region.close()


def test_the_app_cannot_resize_the_region_under_the_daemon(tmp_path) -> None:
    """Sealed before it is sent: its size stays what the welcome said, which the daemon
    checks every range against."""
    region = Region(SIZE)
    _, (fd,) = sent_welcome(tmp_path, region)
    try:
        for size in (0, SIZE // 2, SIZE * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
    finally:
        os.close(fd)
    region.close()


@pytest.mark.parametrize("offset,length", [(0, SIZE + 1), (SIZE, 1), (SIZE + 1, 0),
                                           (1 << 63, 1 << 63), (SIZE - 4, 8)])
def test_a_shared_upload_outside_the_region_is_a_bad_frame(offset, length) -> None:
    region = Region(SIZE)
    with pytest.raises(FrameError, match="outside"):
        region.frame(local_pb2.SharedUpload(seq=1, meta=META, offset=offset, length=length))
    assert region.copied == 0 and region.ack() == b""
    region.close()


def test_a_shared_upload_with_a_malformed_meta_is_a_bad_frame() -> None:
    region = Region(SIZE)
    with pytest.raises(FrameError, match="malformed"):
        region.frame(local_pb2.SharedUpload(seq=1, meta=b"\xff\xff\xff", length=16))
    region.close()


def relay_with_region() -> tuple[AppRelay, list[ops_pb2.SessionUp], list[bytes]]:
    """A session's relay whose host stream and app writer are fakes, with a region."""
    host = types.SimpleNamespace(name="h1", address="unix:h1")
    session = AppSession("s1", local_pb2.AppHello(app="app.py"), (1, 1000, 1000), host)
    written: list[ops_pb2.SessionUp] = []
    to_app: list[bytes] = []

    class Call:
        async def write(self, message: ops_pb2.SessionUp) -> None:
            written.append(message)

        def cancel(self) -> None:
            pass

    class AppWriter:
        def write(self, b: bytes) -> None:
            to_app.append(b)

        async def drain(self) -> None:
            pass

    relay = AppRelay(session, Call(), frames=None, writer=AppWriter())
    relay.shared = Region(SIZE)
    return relay, written, to_app


def test_the_relay_sends_the_session_frame_and_acknowledges_with_its_next_write() -> None:
    relay, written, to_app = relay_with_region()
    raw = data()
    # the app's write, through the descriptor the welcome would have sent
    assert relay.shared.fd is not None
    os.pwrite(relay.shared.fd, bytes(raw), 0)
    up = local_pb2.LocalRequest(shared_upload=local_pb2.SharedUpload(
        seq=1, slot=3, meta=META, offset=0, length=len(raw)))
    fetch = local_pb2.LocalRequest(session=ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=9)))
    asyncio.run(relay.up([fetch, up]))
    (batch,) = written
    fetched, arg = batch.batch.frames
    assert fetched.fetch.seq == 9 and arg == ops_pb2.SessionUp.FromString(
        upload_frame(3, META, raw).SerializeToString())
    assert relay.session.shared_uploads == 1
    assert relay.session.bytes_up == fetch.session.ByteSize() + upload_frame(3, META, raw).size
    asyncio.run(relay._write_app(b"next"))
    ack, rest = to_app[0][:-4], to_app[0][-4:]
    assert rest == b"next"
    assert local_pb2.LocalReply.FromString(ack[HEADER.size:]).shared_done == 1
    asyncio.run(relay._write_app(b"again"))
    assert to_app[1] == b"again"  # acknowledged once
    relay.close()


def test_frames_before_a_bad_shared_upload_are_relayed_then_it_raises() -> None:
    relay, written, _ = relay_with_region()
    fetch = local_pb2.LocalRequest(session=ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=1)))
    bad = local_pb2.LocalRequest(shared_upload=local_pb2.SharedUpload(
        seq=1, meta=META, offset=SIZE, length=1))
    with pytest.raises(FrameError, match="outside"):
        asyncio.run(relay.up([fetch, bad, fetch]))
    assert [w.fetch.seq for w in written] == [1]
    relay.close()


def test_a_shared_upload_without_a_region_is_an_unexpected_frame() -> None:
    relay, written, _ = relay_with_region()
    relay.shared.close()
    relay.shared = None
    up = local_pb2.LocalRequest(shared_upload=local_pb2.SharedUpload(seq=1, meta=META,
                                                                     length=16))
    with pytest.raises(FrameError, match="unexpected shared_upload"):
        asyncio.run(relay.up([up]))
    assert written == []


def test_the_shims_channel_puts_a_large_upload_in_the_region_in_order(tmp_path) -> None:
    """``SocketChannel.send``: the upload's place among the frames holds its SharedUpload; a
    second one before the acknowledgement goes on the socket; once acknowledged (as the
    reader thread hears it), the region again."""
    region = Region(SIZE)
    writer = connected(tmp_path, region)
    a, b = socket.socketpair()
    channel = SocketChannel.__new__(SocketChannel)  # the hello is tested above
    channel.sock, channel._wlock, channel.shared = FramedSocket.__new__(FramedSocket), \
        threading.Lock(), writer
    channel.sock.path, channel.sock.sock, channel.sock._buf = "", a, bytearray()
    reader = FramedSocket.__new__(FramedSocket)
    reader.path, reader.sock, reader._buf = "", b, bytearray()
    t = torch.randn(1, 3, 128, 128)
    start = ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=5, base_id=7, inference=7))

    def sent() -> list[str]:
        return [reader.recv(local_pb2.LocalRequest).WhichOneof("msg") for _ in range(3)]

    channel.send([start, codec.replay_upload(2, t, {}), start])
    assert sent() == ["session", "shared_upload", "session"]
    channel.send([start, codec.replay_upload(2, t, {}), start])
    assert sent() == ["session", "session", "session"]  # not acknowledged yet
    channel.shared.acknowledged(1)
    channel.send([start, codec.replay_upload(2, t + 1, {}), start])
    got = [reader.recv(local_pb2.LocalRequest) for _ in range(3)]
    frame, _ = region.frame(got[1].shared_upload)
    assert torch.equal(codec.from_tensor_data(frame.arg.tensor.upload), t + 1)
    a.close()
    b.close()
    region.close()


def test_rrto_shared_uploads_switches_the_request_off_and_a_bad_value_is_ignored(monkeypatch):
    """The shim asks for a region unless ``RRTO_SHARED_UPLOADS`` says no; a value that is
    neither is ignored with a note (the app still offloads), never an error at import."""
    from rrtod.shim.activate import settings

    monkeypatch.delenv("RRTO_SHARED_UPLOADS", raising=False)
    assert settings().shared_uploads
    monkeypatch.setenv("RRTO_SHARED_UPLOADS", "0")
    assert not settings().shared_uploads
    monkeypatch.setenv("RRTO_SHARED_UPLOADS", "maybe")
    s = settings()
    assert s.shared_uploads and "RRTO_SHARED_UPLOADS='maybe'" in s.config_note


def test_reading_a_range_the_app_never_wrote_allocates_nothing() -> None:
    """An app naming the whole region without writing it must not make the daemon allocate
    it: ``pread`` reads a hole as zeros (a read through a shared mapping would make each page,
    charged to the daemon, up to the region's size per session)."""
    region = Region(SIZE)
    frame, _ = region.frame(local_pb2.SharedUpload(seq=1, meta=META, offset=0, length=SIZE))
    assert frame.arg.tensor.upload.data == bytes(SIZE)
    assert os.fstat(region.fd).st_blocks == 0
    os.pwrite(region.fd, b"x" * 4096, 0)  # what the app writes is what is there
    assert os.fstat(region.fd).st_blocks > 0
    region.close()
