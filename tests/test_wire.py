"""The wire contract (rrtod/wire.py): what both ends of each boundary must agree on byte for byte.
The hand-built encodings are checked against protobuf's own; no torch, no sockets."""

from __future__ import annotations

import random
import struct

import blake3
import pytest

from rrto.v1 import local_pb2, ops_pb2
from rrtod import wire
from rrtod.framing import encode

EDGES = sorted({0, 1, 2, 255, 256, 300, (1 << 32) - 1, 1 << 32, 1 << 52, (1 << 52) + 1,
                1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1}
               | {(1 << (7 * k)) + d for k in range(1, 10) for d in (-1, 0)})


def protobuf_varint(n: int) -> bytes:
    """protobuf's encoding of ``n``: a one-element packed uint64 field is key, length, varint."""
    body = ops_pb2.Release(ids=[n]).SerializeToString()
    assert body[0] == 0x0A and body[1] == len(body) - 2
    return body[2:]


@pytest.mark.parametrize("n", EDGES)
def test_varint_is_protobufs_at_the_edges(n: int) -> None:
    assert wire.varint(n) == protobuf_varint(n)


def test_varint_is_protobufs_over_a_range_and_at_random() -> None:
    rng = random.Random(11)
    for n in [*range(5000), *(rng.getrandbits(rng.randint(1, 64)) for _ in range(2000))]:
        assert wire.varint(n) == protobuf_varint(n), n


def test_varint_refuses_negative_numbers() -> None:
    for n in (-1, -128, -(1 << 40)):
        with pytest.raises(ValueError):
            wire.varint(n)


def test_field_keys_are_protobufs() -> None:
    fetch = ops_pb2.Fetch(id=5).SerializeToString()  # uint64 id: a varint key
    assert fetch.startswith(wire.int_key(ops_pb2.Fetch, "id"))
    release = ops_pb2.Release(gaps=[5]).SerializeToString()  # packed: length-delimited
    assert release.startswith(wire.len_key(ops_pb2.Release, "gaps"))
    # One session prefix wraps frames both ways: the envelopes agree on the field's key.
    assert wire.len_key(local_pb2.LocalRequest, "session") == \
        wire.len_key(local_pb2.LocalReply, "session")


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, 70000])
def test_session_prefix_is_the_envelope_both_ways(size: int) -> None:
    up = ops_pb2.SessionUp(blob=ops_pb2.BlobPut(hash=b"x" * size)) if size else ops_pb2.SessionUp()
    body = up.SerializeToString()
    framed = wire.session_prefix(len(body)) + body
    assert framed == encode(local_pb2.LocalRequest(session=up))
    (length,) = wire.HEADER.unpack_from(framed)
    assert length == len(framed) - wire.HEADER.size
    assert local_pb2.LocalRequest.FromString(framed[wire.HEADER.size:]).session == up
    assert wire.session_size(length) == up.ByteSize()  # the frame's size, from the wire's
    down = ops_pb2.SessionDown(error=ops_pb2.Error(code="X", message="y" * size))
    body = down.SerializeToString()
    reply = local_pb2.LocalReply.FromString((wire.session_prefix(len(body)) + body)[4:])
    assert reply.WhichOneof("msg") == "session" and reply.session == down


def test_session_size_inverts_the_envelope_at_every_varint_edge() -> None:
    """Every frame size, from the envelope's length alone (``FrameReader.sizes``); an envelope
    with more than its frame counts as more, never less."""
    for n in [*range(300), *(e for e in EDGES if e < 1 << 31)]:
        assert wire.session_size(len(wire.session_prefix(n)) - wire.HEADER.size + n) == n, n
    up = ops_pb2.SessionUp(blob=ops_pb2.BlobPut(hash=b"x" * 10))
    extra = local_pb2.LocalRequest(session=up).SerializeToString() + b"\x98\x06\x01"
    assert local_pb2.LocalRequest.FromString(extra).session == up  # the unknown field kept
    assert wire.session_size(len(extra)) == up.ByteSize() + 3


@pytest.mark.parametrize("slot", [0, 1, 300])
@pytest.mark.parametrize("nbytes", [0, 4, 200, 70000])
def test_upload_frame_is_the_message_it_stands_for(slot: int, nbytes: int) -> None:
    meta = ops_pb2.TensorMeta(dtype="uint8", shape=[nbytes], device="cpu")
    data = memoryview(bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256))
    frame = wire.upload_frame(slot, meta.SerializeToString(), data)
    body = frame.SerializeToString()
    assert frame.size == len(body) and frame.WhichOneof("msg") == "arg"
    assert ops_pb2.SessionUp.FromString(body) == ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(
        slot=slot, tensor=ops_pb2.TensorRef(upload=ops_pb2.TensorData(meta=meta, data=bytes(data)))))


def test_id_spaces_are_disjoint_and_cover_the_store() -> None:
    """Client [1, REPLAY_BASE), replay [REPLAY_BASE, HOST_ID_BASE) in whole SPANs, host
    [HOST_ID_BASE, 2^64): ordered, non-empty, and every replayed inference's span ends before
    the host's range begins."""
    client = range(1, wire.REPLAY_BASE)
    replay = range(wire.REPLAY_BASE, wire.HOST_ID_BASE)
    host = range(wire.HOST_ID_BASE, 1 << 64)
    spaces = [client, replay, host]
    for a, b in zip(spaces, spaces[1:], strict=False):
        assert len(a) and a.stop == b.start  # adjacent, so disjoint and without a gap
    assert 0 not in client and 0 not in replay and 0 not in host
    assert wire.REPLAY_BASE % wire.SPAN == 0 and len(replay) % wire.SPAN == 0
    last = wire.REPLAY_BASE + (len(replay) // wire.SPAN - 1) * wire.SPAN  # last inference's base
    assert last + wire.SPAN - 1 in replay and last + wire.SPAN in host


def test_release_round_trips_random_id_sets() -> None:
    rng = random.Random(7)
    spaces = [(1, 1 << 20), (wire.REPLAY_BASE, wire.REPLAY_BASE + 4 * wire.SPAN),
              (wire.HOST_ID_BASE, wire.HOST_ID_BASE + 1000), (1, (1 << 64) - 1)]
    for _ in range(200):
        lo, hi = rng.choice(spaces)
        ids = {rng.randrange(lo, hi) for _ in range(rng.randint(0, 300))}
        msg = wire.release_of(ids)
        assert not msg.ids
        back = ops_pb2.Release.FromString(msg.SerializeToString())
        assert sorted(wire.released_ids(back)) == sorted(ids)


def test_release_is_gap_encoded_and_reads_both_encodings() -> None:
    base = wire.REPLAY_BASE  # a replayed inference's ids
    ids = [base + 7, base + 3, base + 4, 12, base + 200]
    msg = wire.release_of(ids)
    assert not msg.ids and sorted(wire.released_ids(msg)) == sorted(ids)
    # One byte per id close to the one before, against eight each as plain ids.
    many = [base + 2 * i for i in range(100)]
    assert len(wire.release_of(many).SerializeToString()) < 120
    assert len(ops_pb2.Release(ids=many).SerializeToString()) > 700
    assert wire.released_ids(ops_pb2.Release(ids=[5, 9])) == [5, 9]  # the plain list too
    assert wire.released_ids(wire.release_of([])) == []


def test_tensor_refs_come_positional_then_keywords_by_name_depth_first() -> None:
    def ref(i: int) -> ops_pb2.Value:
        return ops_pb2.Value(tensor=ops_pb2.TensorRef(id=i))

    nested = ops_pb2.Value(list=ops_pb2.ValueList(items=[
        ref(2), ops_pb2.Value(i=3), ops_pb2.Value(tuple=ops_pb2.ValueList(items=[ref(3)]))]))
    call = ops_pb2.OpCall(op="aten::x", args=[ref(1), nested, ops_pb2.Value(none=True)],
                          kwargs={"z": ref(6), "a": ref(4), "m": ops_pb2.Value(list=ops_pb2.ValueList(
                              items=[ref(5)]))})
    assert [r.id for r in wire.iter_tensor_refs(call)] == [1, 2, 3, 4, 5, 6]
    assert list(wire.iter_tensor_refs(ops_pb2.OpCall(op="aten::y"))) == []


def test_content_hash_is_blake3_256_of_dtype_shape_and_bytes() -> None:
    data = b"\0" * 8
    assert wire.content_hash("float32", [2], data) == \
        blake3.blake3(b"float32:2;" + data).digest()
    assert len(wire.content_hash("float32", [2], data)) == wire.HASH_BYTES == 32
    # Names are stable across versions (weight caches on hosts keep them on disk): pinned.
    assert wire.content_hash("float32", (2, 1), b"\1" * 8).hex() == \
        "73dfec8a49287f7cc035a26f53e8d3daac90c972ba530a40ff6b69f566ee6804"


def test_content_hash_tells_apart_what_differs() -> None:
    data = bytes(range(24))
    base = wire.content_hash("float32", [2, 3], data)
    assert wire.content_hash("float32", (2, 3), memoryview(data)) == base  # any buffer, any seq
    others = [wire.content_hash("int32", [2, 3], data),  # same bytes, another dtype
              wire.content_hash("float32", [3, 2], data),  # another shape
              wire.content_hash("float32", [6], data),
              wire.content_hash("float32", [2, 3], data[:-1] + b"\xff")]  # another byte
    assert len({base, *others}) == 5


def test_hash_of_names_a_tensor_value_as_it_travels() -> None:
    value = ops_pb2.TensorData(meta=ops_pb2.TensorMeta(dtype="float16", shape=[4]), data=b"ab" * 4)
    assert wire.hash_of(value) == wire.content_hash("float16", [4], b"ab" * 4)


@pytest.mark.parametrize(("dtype", "fmt", "value"), [
    ("float32", "<f", 51.0), ("float64", "<d", -2.5), ("float16", "<e", 3.0),
    ("int64", "<q", -7), ("int32", "<i", 1 << 30), ("uint8", "<B", 255), ("bool", "<?", True)])
def test_a_one_element_tensor_reads_as_the_app_reads_it(dtype, fmt, value) -> None:
    t = ops_pb2.TensorData(meta=ops_pb2.TensorMeta(dtype=dtype, shape=[1, 1]),
                           data=struct.pack(fmt, value))
    assert wire.scalar_of(t) == value


def test_bfloat16_is_the_high_half_of_a_float32() -> None:
    t = ops_pb2.TensorData(meta=ops_pb2.TensorMeta(dtype="bfloat16"),
                           data=struct.pack("<f", 5.0)[2:])
    assert wire.scalar_of(t) == 5.0


@pytest.mark.parametrize("data", [b"", b"\0\0\0", b"\0" * 8])
def test_bytes_that_are_no_one_element_of_the_dtype_read_as_nothing(data) -> None:
    assert wire.scalar_of(ops_pb2.TensorData(meta=ops_pb2.TensorMeta(dtype="float32"),
                                             data=data)) is None
    assert wire.scalar_of(ops_pb2.TensorData(meta=ops_pb2.TensorMeta(dtype="float32",
                                                                     shape=[2]),
                                             data=b"\0" * 8)) is None
    assert wire.scalar_of(ops_pb2.TensorData(meta=ops_pb2.TensorMeta(dtype="complex64"),
                                             data=b"\0" * 8)) is None


def _seq_of(*calls: tuple[str, list[int], list[int]]) -> ops_pb2.SequenceDef:
    """Calls as (op, argument ids, output ids); every id is a local one."""
    d = ops_pb2.SequenceDef()
    ids: list[int] = []
    for op, args, outs in calls:
        c = d.calls.add(op=op, out_ids=outs)
        for a in args:
            c.args.add().tensor.id = a
        ids += [i for i in outs if i not in ids]
    d.local_ids.extend(ids)
    return d


def test_an_output_is_final_after_the_last_write_of_its_storage() -> None:
    """``buf = zeros()``; ``row = select(buf)``; ``copy_(row, v)``; ``t = permute(buf)``: the
    buffer is written through its view at call 3, so it is final there, not where it was made;
    so is the view; the permute made after it is final where it is made. Without views known,
    only the returned in-place write counts."""
    d = _seq_of(("zeros", [], [1]), ("select", [1], [2]), ("v", [], [3]),
                ("copy_", [2, 3], [2]), ("permute", [1], [4]))
    viewed = {"select": lambda c: [c.args[0].tensor.id], "permute": lambda c: [c.args[0].tensor.id],
              "copy_": lambda c: [c.args[0].tensor.id]}

    def views(call: ops_pb2.OpCall) -> list[int]:
        return viewed[call.op](call) if call.op in viewed else [0] * len(call.out_ids)

    def written(call: ops_pb2.OpCall) -> list[int]:
        return [call.args[0].tensor.id] if call.op == "copy_" else []

    # local indices: 1 -> 0, 2 -> 1, 3 -> 2, 4 -> 3
    assert wire.final_writes(d, written, views) == {0: 3, 1: 3, 2: 2, 3: 4}
    assert wire.final_writes(d, None, None) == {0: 0, 1: 3, 2: 2, 3: 4}


def test_a_host_cuts_its_replies_at_no_less_than_64_kib() -> None:
    """``reply_part``: the size a robot states is a network value; 0 is whole."""
    from rrtod.wire import MIN_PART, reply_part

    assert MIN_PART == 64 << 10
    assert [reply_part(n) for n in (0, 1, MIN_PART - 1, MIN_PART, 10 << 20)] == [
        0, MIN_PART, MIN_PART, MIN_PART, 10 << 20]


def test_a_message_cut_into_parts_joins_back_into_itself() -> None:
    """``cut`` and ``Parts`` (robot daemon to GPU host, and back): any part size, the last part
    marked; the host gets the message and its bytes once the last has come."""
    from rrtod.wire import Parts, cut

    data = ops_pb2.TensorData(data=bytes(range(256)) * 40)
    for message in (ops_pb2.SessionUp(blob=ops_pb2.BlobPut(hash=b"h" * 16, tensor=data)),
                    ops_pb2.SessionDown(fetched=ops_pb2.Fetched(seq=3, tensor=data))):
        size = message.ByteSize()
        for part in (1000, size - 1, size, size + 1, 1 << 20):
            parts = cut(message, part)
            assert len(parts) == -(-size // part) and all(type(p) is type(message) for p in parts)
            assert [p.part.last for p in parts] == [False] * (len(parts) - 1) + [True]
            assert all(0 < len(p.part.data) <= part for p in parts)
            joiner = Parts(type(message))
            assert [joiner.add(p.part) for p in parts[:-1]] == [None] * (len(parts) - 1)
            assert joiner.pending == (len(parts) > 1)
            assert joiner.add(parts[-1].part) == (message, size) and not joiner.pending
    (empty,) = cut(ops_pb2.SessionUp(), 10)  # nothing to cut: one empty last part
    assert Parts(ops_pb2.SessionUp).add(empty.part) == (ops_pb2.SessionUp(), 0)


def test_parts_that_join_into_no_message_or_past_the_limit_are_refused() -> None:
    from rrtod.wire import Parts, cut

    with pytest.raises(ValueError, match="exceeds 100 bytes"):
        joiner = Parts(ops_pb2.SessionUp, limit=100)
        joiner.add(ops_pb2.MessagePart(data=b"x" * 60))
        joiner.add(ops_pb2.MessagePart(data=b"x" * 60))  # refused before it is kept
    with pytest.raises(ValueError, match="no SessionUp"):
        Parts(ops_pb2.SessionUp).add(ops_pb2.MessagePart(data=b"\xff\xff\xff", last=True))
    joiner = Parts(ops_pb2.SessionUp)  # read off the stream: a frame, then a message's parts
    close = ops_pb2.SessionUp(close=ops_pb2.Close())
    assert joiner.take(close) == (close, None) and joiner.take(cut(close, 1)[0]) is None
    with pytest.raises(ValueError, match="a close frame inside parts"):
        joiner.take(close)
    inner = cut(ops_pb2.SessionUp(close=ops_pb2.Close()), 1)[0]
    with pytest.raises(ValueError, match="part inside a part"):
        Parts(ops_pb2.SessionUp).add(ops_pb2.MessagePart(data=inner.SerializeToString(), last=True))
