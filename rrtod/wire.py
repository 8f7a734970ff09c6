"""What crosses each process boundary, declared once: the messages, how they are framed, the
ids they carry, and the few encodings both ends must agree on byte for byte.

Boundaries (the messages are in proto/rrto/v1/*.proto):

=============================  ================================================================
app (shim) -> robot daemon     unix socket (``SOCK_STREAM``), frames: ``HEADER`` (4-byte
                               little-endian length) + one serialized ``local.LocalRequest``:
                               ``app_hello`` first (with the app's versions: rrtod, torch),
                               then ``session`` (an ``ops.SessionUp``:
                               call, fetch, release, blob, query, close, replay start/arg/abort)
                               and ``mark`` (``InferenceMark``); ``rrtoctl`` sends ``ctl``
                               instead. The shim wraps a SessionUp's bytes in the ``session``
                               envelope with ``session_prefix`` instead of building the envelope.
robot daemon -> app (shim)     same socket, ``HEADER`` + ``local.LocalReply``: ``welcome`` or
                               ``error`` to the hello, then ``session`` (an ``ops.SessionDown``:
                               results, fetched data and pushed replay outputs, a replayed
                               call's ``answer`` (``ReplayAnswer``: output metadata or a value
                               the app needs), errors, ``sequence``: a verified sequence
                               to replay, and ``search``: a search running or over, which
                               the next inference start waits for) and ``error``
                               (``HOST_LOST`` ends the session); ``ctl`` to ``rrtoctl``.
robot daemon -> GPU daemon     gRPC ``peer.Peer.Session`` request stream of ``ops.SessionUp``:
                               ``open`` first (the app's versions from its hello; the
                               robot's ``part_bytes`` on a slow link), then the
                               app's frames (what the app wrote in one
                               go as one ``batch``) and ``define`` (a sequence found in the op
                               log); a message longer than a quarter second of a link the robot
                               measured slow is cut into ``part``s (``cut``, ``Parts``).
                               Unary: ``Hello``, ``Ping``; and the standard gRPC health service.
                               gRPC frames the messages (HTTP/2; limits in grpc_options).
GPU daemon -> robot daemon     response stream of ``ops.SessionDown``: ``ready`` (with the
                               host's versions), then replies, pushed replay outputs and
                               answers (those ready together as one ``batch``, which the robot
                               daemon unpacks for the app), ``defined`` (``SequenceAck``) and,
                               after a ``ReplayAbort``, ``replayed`` (``ReplayedPrefix``: the
                               sizes of what the aborted replay ran; kept by the robot daemon,
                               never passed on), and ``parts`` (``PartsReceived``: each part of
                               the robot's message cut into parts but the last has come; never
                               passed on); a message longer than ``SessionOpen.part_bytes``
                               comes in ``part``s, which the robot daemon joins (``Parts``).
                               The robot daemon logs ``result`` replies with
                               ``outs`` (the outputs of a ``want_meta`` call), ``answer``s and
                               ``replayed`` for the op log, and the replies to fetches of
                               one element (values the app read, ``scalar_of``). An ``error``
                               with ``base_id`` is a replayed call that failed while the host
                               ran ahead of the app (the shim decides whether it is the app's).
=============================  ================================================================

The robot daemon relays and records ``SessionUp``/``SessionDown``; the GPU daemon hands them to
an executor and replays sequences. What the core reads of an ``ops`` message, and what both the
app's client and the host must compute alike, is here: the tensor refs of a call
(``iter_tensor_refs``), the ids a release names (``released_ids``), the weights' content names
(``content_hash``), the reserved bind operator and the id spaces. The values inside (tensors,
arguments) are the interception backend's business (for torch: plugins/torch/codec.py).

Id spaces. A session's tensor store is keyed by uint64 ids that three parties allocate, each in
its own range, so that no id is ever chosen twice without anyone coordinating:

=======================  ============================  ========================================
range                    allocated by                  for
=======================  ============================  ========================================
0                        nobody                        protobuf's default: an unset id field
1 .. REPLAY_BASE-1       the app's client, counting    outputs of forwarded calls, uploads,
                         up from 1                     bound weights (2^52 of them: ~140
                                                       years at a million calls a second)
REPLAY_BASE ..           the app's replay client:      the calls of replayed inference k: ids
HOST_ID_BASE-1           inference k gets              base + local index in its sequence
                         ``REPLAY_BASE + k * SPAN``    (a sequence must name fewer than SPAN);
                                                       the host derives them from the same base
HOST_ID_BASE ..          the host's executor           outputs the client could not name
                                                       (data-dependent output counts)
=======================  ============================  ========================================

A definition's loop, unrolled (``rrtod.loops``), names its iterations' values with local ids
from 2^63 up: labels inside the definition only, never store ids (a replayed value's store id is
still its inference's base + its local index).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable
from itertools import accumulate
from typing import Any, Generic, TypeVar

import blake3
from google.protobuf.message import DecodeError

from rrto.v1 import local_pb2, ops_pb2

# ----- frames on the unix socket -------------------------------------------------------------

HEADER = struct.Struct("<I")  # each frame: this length, then that many bytes of one message
MAX_FRAME = 1 << 30  # 1 GiB: larger than any single tensor we ship in one frame

# Single-byte varints, prebuilt: lengths and ids below 128 are most of what is encoded.
_SMALL = [bytes((i,)) for i in range(0x80)]


def varint(n: int) -> bytes:
    """``n`` as a protobuf base-128 varint (what a uint64 field holds; a negative ``n`` raises
    ValueError, one of 2^64 or more is the caller's mistake: protobuf would not read it back)."""
    if 0 <= n < 0x80:
        return _SMALL[n]
    if 0x80 <= n < 0x4000:  # two bytes: most frame lengths
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def len_key(message: Any, field: str) -> bytes:
    """The key of a length-delimited field (wire type 2) of ``message``, by its schema number."""
    return varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


def int_key(message: Any, field: str) -> bytes:
    """The key of a varint field (wire type 0) of ``message``, by its schema number."""
    return varint(message.DESCRIPTOR.fields_by_name[field].number << 3)


# A LocalRequest's and a LocalReply's ``session`` have the same key (tests/test_wire.py), so one
# prefix serves both.
_SESSION_KEY = len_key(local_pb2.LocalRequest, "session")


def session_prefix(length: int) -> bytes:
    """Header and field key of a ``LocalRequest``/``LocalReply`` whose ``session`` holds
    ``length`` bytes of a serialized frame: lets the shim and the robot daemon wrap a frame's
    bytes without copying the message into the envelope first."""
    tag = _SESSION_KEY + varint(length)
    return HEADER.pack(len(tag) + length) + tag


def session_size(length: int) -> int:
    """The inverse of ``session_prefix``: the bytes of the frame in a ``LocalRequest`` of
    ``length`` bytes that holds only its ``session`` (more, if the envelope carried fields it
    does not know: an upper bound, never less)."""
    for n in range(max(0, length - len(_SESSION_KEY) - 10), length + 1):
        if len(_SESSION_KEY) + len(varint(n)) + n == length:
            return n
    return length


class EncodedFrame:
    """A ``SessionUp`` already in wire form, as parts: the bytes of a large upload stay in the
    tensor's own memory until the socket copies them (building the message instead copies
    them once per nesting level, then to serialize: ~47 us for a 48 KiB input here, ~9 us
    this way). Channels that take messages get it back through ``SerializeToString``."""

    __slots__ = ("parts", "size", "kind", "upload")

    def __init__(self, parts: list[Any], kind: str,
                 upload: tuple[int, bytes, Any, bytes, int] | None = None):
        self.parts = parts
        self.size = sum(len(p) for p in parts)
        self.kind = kind
        # A replayed inference's upload as (slot, serialized meta, data, palette, palette
        # block): a channel may send it another way (``rrtod.shared_uploads``).
        self.upload = upload

    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf message method
        return b"".join(self.parts)

    def WhichOneof(self, name: str) -> str:  # noqa: N802
        return self.kind


_ARG_KEY = len_key(ops_pb2.SessionUp, "arg")
_SLOT_KEY = int_key(ops_pb2.ReplayArg, "slot")
_TENSOR_KEY = len_key(ops_pb2.ReplayArg, "tensor")
_UPLOAD_KEY = len_key(ops_pb2.TensorRef, "upload")
_META_KEY = len_key(ops_pb2.TensorData, "meta")
_DATA_KEY = len_key(ops_pb2.TensorData, "data")
_PALETTE_KEY = len_key(ops_pb2.TensorData, "palette")
_BLOCK_KEY = int_key(ops_pb2.TensorData, "palette_block")


def upload_frame(slot: int, meta: bytes, data: Any, palette: bytes = b"",
                 block: int = 0) -> EncodedFrame:
    """``SessionUp(arg=ReplayArg(slot, tensor=TensorRef(upload=TensorData(meta, data))))`` in
    wire form, where ``meta`` is a serialized ``TensorMeta`` and ``data`` the tensor's raw bytes
    (any buffer; not copied), or with ``palette`` its palette-coded bytes
    (``TensorData.palette``, ``palette_block``)."""
    tensor_data = _META_KEY + varint(len(meta)) + meta + _DATA_KEY + varint(len(data))
    tail = _PALETTE_KEY + varint(len(palette)) + palette + _BLOCK_KEY + varint(block) \
        if palette else b""
    size = len(tensor_data) + len(data) + len(tail)
    ref = _UPLOAD_KEY + varint(size)
    size += len(ref)
    arg = _SLOT_KEY + varint(slot) + _TENSOR_KEY + varint(size)
    size += len(arg)
    head = _ARG_KEY + varint(size) + arg + ref + tensor_data
    parts = [head, data] if len(data) else [head]
    if tail:
        parts.append(tail)
    return EncodedFrame(parts, "arg", (slot, meta, data, palette, block))


# ----- ids ---------------------------------------------------------------------------------

REPLAY_BASE = 1 << 52  # replayed inference k's ids: REPLAY_BASE + k * SPAN + local index
SPAN = 1 << 20
HOST_ID_BASE = 1 << 62  # ids the host's executor assigns
# Dropped sequences the host still runs (and the robot still knows) per session: a start the
# app sent before it heard of the drop may name one (rrtod/gpu/replay.py).
RETIRED_KEPT = 8
# The client binds a persistent tensor (a cached weight) to an id with this operator on a
# ``TensorRef(persistent=hash, bind_id=id)``; hosts count it as a bind, not as a call.
BIND_OP = "aten::alias.default"


# ----- a peer stream's message cut into parts (``MessagePart``) -------------------------------

PeerMessage = TypeVar("PeerMessage", ops_pb2.SessionUp, ops_pb2.SessionDown)


# The smallest part a GPU host cuts its replies into, whatever part size the robot states
MIN_PART = 64 << 10


def reply_part(stated: int) -> int:
    """The part size a host cuts its replies at for a robot that stated ``stated``
    (``SessionOpen.part_bytes``, ``SessionUp.part_bytes``; 0: whole): at least ``MIN_PART``. A
    robot that stated 1 would have a 100 MB reply cut into 100 million messages."""
    return max(stated, MIN_PART) if stated else 0


def cut(message: PeerMessage, part: int) -> list[PeerMessage]:
    """``message`` serialized and cut into ``MessagePart``s of at most ``part`` bytes, each
    as a message of its kind."""
    kind = type(message)
    data = message.SerializeToString()
    view = memoryview(data)
    ends = range(part, max(len(data), 1) + part, part)
    return [kind(part=ops_pb2.MessagePart(data=bytes(view[end - part:end]),
                                          last=end >= len(data))) for end in ends]


class Parts(Generic[PeerMessage]):
    """The far end of ``cut``: joins a stream's parts, in order, into the message of ``kind``
    they were cut from. A part that would make the whole longer than ``limit``, joined bytes
    that are no such message, and a part inside a part are ``ValueError``s (the stream ends:
    the host's with ``INVALID_ARGUMENT``, the robot's as a broken host stream)."""

    def __init__(self, kind: type[PeerMessage], limit: int = MAX_FRAME):
        self.kind = kind
        self.limit = limit
        self._parts: list[bytes] = []
        self._size = 0

    @property
    def pending(self) -> bool:
        """Parts of a message have come and its last has not."""
        return bool(self._parts)

    @property
    def received(self) -> int:
        """Bytes of the message under way joined so far (``PartsReceived``)."""
        return self._size

    def take(self, message: PeerMessage) -> tuple[PeerMessage, int | None] | None:
        """``message`` as read off the stream: itself (its size unknown: None) unless it is a
        part; None while a message's parts are coming; the joined message and its bytes when
        ``message`` was its last part. Another frame in the middle of a message's parts is a
        ``ValueError``, as ``add``'s are."""
        kind = message.WhichOneof("msg")
        if kind != "part":
            if self.pending:
                raise ValueError(f"a {kind or 'empty'} frame inside parts")
            return message, None
        return self.add(message.part)

    def add(self, part: ops_pb2.MessagePart) -> tuple[PeerMessage, int] | None:
        """The message and its bytes once ``part`` was its last, else None."""
        self._size += len(part.data)
        if self._size > self.limit:
            raise ValueError(f"a message cut into parts exceeds {self.limit} bytes")
        self._parts.append(part.data)
        if not part.last:
            return None
        data, self._parts, self._size = b"".join(self._parts), [], 0
        try:
            message = self.kind.FromString(data)
        except DecodeError as exc:
            raise ValueError(f"parts joined into no {self.kind.__name__}: {exc}") from None
        if message.WhichOneof("msg") == "part":
            raise ValueError("a part inside a part")
        return message, len(data)


def release_of(ids: Iterable[int]) -> ops_pb2.Release:
    """A ``Release`` of ``ids``, as gaps between the sorted ids: a replayed inference drops
    hundreds of ids near 2^52, which cost a byte each this way instead of eight."""
    gaps, last = [], 0
    for i in sorted(ids):
        gaps.append(i - last)
        last = i
    return ops_pb2.Release(gaps=gaps)


def released_ids(msg: ops_pb2.Release) -> list[int]:
    """The ids a ``Release`` names, in either encoding (plain, or gaps between sorted ids)."""
    return [*msg.ids, *accumulate(msg.gaps)]


def iter_tensor_refs(call: ops_pb2.OpCall) -> list[ops_pb2.TensorRef]:
    """Every TensorRef of a call: positional arguments, then keyword arguments by name, each
    depth first. Recorder, sequences and both replay ends number a call's tensors this way.
    A list, built without generators: the host walks every call of an unrolled inference
    (a nested generator per argument was half the time it took to compile one)."""
    out: list[ops_pb2.TensorRef] = []
    for v in call.args:
        _collect_refs(v, out)
    if call.kwargs:
        for k in sorted(call.kwargs):
            _collect_refs(call.kwargs[k], out)
    return out


def _collect_refs(v: ops_pb2.Value, out: list[ops_pb2.TensorRef]) -> None:
    kind = v.WhichOneof("kind")
    if kind == "tensor":
        out.append(v.tensor)
    elif kind == "list":
        for item in v.list.items:
            _collect_refs(item, out)
    elif kind == "tuple":
        for item in v.tuple.items:
            _collect_refs(item, out)


# ----- content names of weights ------------------------------------------------------------

HASH_BYTES = 32


def content_hash(dtype: str, shape: list[int] | tuple[int, ...], data: bytes | memoryview) -> bytes:
    """BLAKE3-256 over the dtype, the shape and the raw C-contiguous bytes: the name of a
    persistent tensor, chosen by the app's client and checked by the host's weight cache.

    BLAKE3 because a robot must not be able to make another robot's weights resolve to its own
    bytes (the name has to be collision-resistant), and it is the fastest such hash here
    (``python -m bench.hashes``). dtype and shape are part of the name because the same bytes
    reinterpreted are another tensor.
    """
    h = blake3.blake3()
    h.update(f"{dtype}:{','.join(str(int(s)) for s in shape)};".encode())
    h.update(data)
    return h.digest(HASH_BYTES)


def hash_of(tensor: ops_pb2.TensorData) -> bytes:
    """``content_hash`` of a tensor value as it travels."""
    return content_hash(tensor.meta.dtype, list(tensor.meta.shape), tensor.data)


# ``SymbolicInt.value`` in the compiled forms of a sequence (host, shim, search), where a size
# symbol keeps its first dimension: the integer is ``int()`` of the tensor's one element.
READ_VALUE = -1

# One element of each dtype, as ``struct`` reads it (little-endian); bfloat16 is the high half
# of a float32.
_SCALAR_FORMATS = {"float64": "<d", "float32": "<f", "float16": "<e", "int64": "<q",
                   "int32": "<i", "int16": "<h", "int8": "<b", "uint8": "<B", "bool": "<?"}


def scalar_of(tensor: ops_pb2.TensorData) -> int | float | None:
    """The value of a one-element tensor (what the app read with ``item()``), None for any
    other tensor or bytes that do not fit its dtype. Read by the robot daemon, which has no
    torch: values the app passes on as integer arguments (``SymbolicInt.value``)."""
    meta = tensor.meta
    if math.prod(meta.shape) != 1:
        return None
    data = tensor.data
    if meta.dtype == "bfloat16":
        fmt, data = "<f", b"\0\0" + data if len(data) == 2 else b""
    else:
        fmt = _SCALAR_FORMATS.get(meta.dtype, "")
    if not fmt or len(data) != struct.calcsize(fmt):
        return None
    value = struct.unpack(fmt, data)[0]
    return int(value) if isinstance(value, bool) else value


def int_of(value: int | float | None) -> int | None:
    """``int()`` of a value the app read, as the app computes it (truncation); None for none,
    or one that is not finite. The search, the host and the shim all derive a
    ``SymbolicInt.value`` with this, so they agree."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return int(value)


def final_writes(d: ops_pb2.SequenceDef,
                 written: Callable[[ops_pb2.OpCall], list[int]] | None,
                 viewed: Callable[[ops_pb2.OpCall], list[int]] | None) -> dict[int, int]:
    """Per local index of ``d`` (its position in ``local_ids``): the last call that writes its
    storage. That is the call that makes it, unless a later one writes it in place (returning
    it, or as an argument ``written`` names), writes a view of it, or writes what it is a view
    of (``viewed``: per output, the id of the argument whose storage it shares, 0 for new
    storage). The host pushes an output after this call and the shim takes the push only
    after it: both ends compute it here, from the same definition and the operators' schemas
    (``rrto_plugins.torch.aliasing``). Without ``viewed``, storage is never shared."""
    return final_writes_of(d, [written(c) for c in d.calls] if written is not None else None,
                           [viewed(c) for c in d.calls] if viewed is not None else None)


def final_writes_of(d: ops_pb2.SequenceDef, written_of: list[list[int]] | None,
                    viewed_of: list[list[int]] | None) -> dict[int, int]:
    """``final_writes`` from what ``written`` and ``viewed`` give per call, in order (the
    host keeps them per compiled call)."""
    local = {rid: i for i, rid in enumerate(d.local_ids)}
    root: dict[int, int] = {}  # local index -> the local index whose storage it is
    wrote: dict[int, int] = {}  # storage (root) -> the last call that wrote it
    made: dict[int, int] = {}
    for k, call in enumerate(d.calls):
        sources = viewed_of[k] if viewed_of is not None else []
        for j, rid in enumerate(call.out_ids):
            i = local.get(rid)
            if i is None:
                continue
            src = local.get(sources[j]) if j < len(sources) and sources[j] else None
            if i in made:  # an earlier value returned again: written in place
                wrote[root.get(i, i)] = k
            elif src is not None:
                root[i] = root.get(src, src)
            made.setdefault(i, k)
        for rid in (written_of[k] if written_of is not None else ()):
            i = local.get(rid)
            if i is not None:
                wrote[root.get(i, i)] = k
    return {i: max(k, wrote.get(root.get(i, i), k)) for i, k in made.items()}


def int_arg(call: ops_pb2.OpCall, sym: ops_pb2.SymbolicInt) -> ops_pb2.Value:
    """The integer argument a symbol names in ``call`` (the host checks a definition with
    this; the robot sets an aborted replay's integers through it); ValueError if none."""
    if sym.kwarg:
        if sym.kwarg not in call.kwargs:
            raise ValueError(f"call {sym.call} has no keyword argument {sym.kwarg!r}")
        v = call.kwargs[sym.kwarg]
    elif sym.arg < len(call.args):
        v = call.args[sym.arg]
    else:
        raise ValueError(f"call {sym.call} has no argument {sym.arg}")
    for j in sym.items:
        kind = v.WhichOneof("kind")
        if kind not in ("list", "tuple") or j >= len(getattr(v, kind).items):
            raise ValueError(f"call {sym.call}: no item {j} in argument {sym.arg}")
        v = getattr(v, kind).items[j]
    if v.WhichOneof("kind") != "i":
        raise ValueError(f"call {sym.call}: the symbolic argument is not an integer")
    return v
