"""Fuzz targets: every decoder of bytes that arrive on a daemon's sockets, each driven as the
daemon drives it, asserting that it returns or fails with its own documented error.

A target takes one input (bytes). It raises (a crash, for the fuzzer) when the code under test
raises anything but the errors it documents, logs an error or an exception (a bug the daemon
would only have logged: see ``runner.fail_on_error_logs``), or leaves bytes in a receive
budget. Memory is bounded by the runner (libFuzzer's ``-rss_limit_mb``).

=================  =====================================================  ====================
target             decoder (as reached from the socket)                    documented errors
=================  =====================================================  ====================
frames             framing.FrameReader / read_frame on the unix socket    FrameError
local_socket       LocalServer before the hello (AppHello, CtlRequest),   none escape: error
                   then the robot's AppRelay and recorder for app frames  replies, then close
                   (SharedUpload ones against a shared region)
peer_session       the GPU daemon's Session stream (SessionOpen, then     none escape:
                   SessionUp frames and batches) into a TorchExecutor      SessionDown(error)
                   and HostReplayer (reading it with rrtod.wire's
                   released_ids, iter_tensor_refs, hash_of); the unary
                   requests' messages                                     DecodeError (raw)
codec              plugins/torch/codec decode_value, from_tensor_data      CodecError
replay_defs        gpu.replay.compile_sequence, then HostReplayer         ValueError/KeyError
                   replays of the definition with a TorchExecutor          (compile); none after
loop_defs          rrtod.loops check and unroll (copied from the bodies,   ValueError (check,
                   with made_from) and compile_sequence on the bodies, of  unroll), ValueError/
                   a looped definition with fuzzed ids, integers, loop     KeyError (compile);
                   fields and variants: equal to unrolling and compiling   copy == whole
                   it whole
native_runs        a definition replayed in the host's native runs         none escape:
                   (plugins/torch/hostloop.cpp) with fuzzed integer        SessionDown(error)
                   arguments, output layouts and input sizes
shim_down          the shim's replay client for what the host sends it     none escape (a bad
                   through the robot daemon (SessionDown: sequence,        definition is not
                   pushed outputs, answers, errors, sizes) and            used; MISS; sizes
                   decode_answer; pushed sizes made into proxies, by the  that fit no tensor:
                   general path and by the hot path (Python, C++)        None, planned)
robot_replayed     the robot's recorder for an aborted replay: the host's  none escape (what
                   answers, pushed outputs, ReplayedPrefix and fetch       cannot be rebuilt is
                   replies (values the app read: wire.scalar_of) into its  not logged)
                   op log, entries then built (recorder.replayed_calls,
                   OpLog.insert)
robot_search       the robot's verification of a candidate's repetitions   Unexplained; every
                   (robot/shapes.explain) on logged app calls: answered    symbol it makes is
                   counts, integers equal to them or not, as the relay     the recorded integer
                   logs them                                               in every repetition
robot_placement    the robot's per-inference placement (robot/placement)   NeedPull (then its
                   of app frames (SessionUp) over a primary and a          ``rewrite``), none
                   replica, and of what hosts send back (SessionDown),     else; in-flight
                   with replicas lost and hosts' definitions refused       counts stay >= 0
=================  =====================================================  ====================
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import atheris
import torch
from google.protobuf.message import DecodeError

from rrto.v1 import local_pb2, ops_pb2, peer_pb2
from rrto_plugins.search.dds import DataDependencySearch
from rrto_plugins.torch import codec, hotpath, native
from rrto_plugins.torch.allowlist import Allowlist, OpNotAllowed
from rrto_plugins.torch.executor import TorchExecutor
from rrto_plugins.torch.journal import Journal
from rrto_plugins.torch.metadata import OpInfo
from rrto_plugins.torch.replay import Active, ReplayClient, Sequence, Step, decode_answer
from rrto_plugins.torch.schemas import schema_hash
from rrtod import loops, partition, shared_uploads
from rrtod.config import SocketLimitsConfig
from rrtod.executor import ExecutorContext
from rrtod.framing import ByteBudget, FrameError, FrameReader, encode, read_frame
from rrtod.gpu.blobstore import BlobStore
from rrtod.gpu.replay import HostReplayer, compile_sequence
from rrtod.gpu.service import REPLAY_FRAMES, _sized_session_up
from rrtod.local_server import STREAM_LIMIT, Connection, LocalServer
from rrtod.robot.oplog import OpLog
from rrtod.robot.placement import Lane, NeedPull, Placement
from rrtod.robot.recorder import Recorder
from rrtod.robot.relay import AppRelay, AppSession
from rrtod.robot.scheduling import Scheduling
from rrtod.robot.shapes import VALUE, Unexplained, explain
from rrtod.wire import (
    HEADER,
    MIN_PART,
    REPLAY_BASE,
    SPAN,
    Parts,
    cut,
    iter_tensor_refs,
    reply_part,
)
from testkit.loopdefs import branched, same_compiled

from . import TARGET_NAMES
from .protogen import Builder

# Files the targets write (weight cache, recorded sequences): under the campaign's work folder.
STATE = Path(os.environ.get("RRTO_FUZZ_STATE") or tempfile.mkdtemp(prefix="rrto-fuzz-"))
STATE.mkdir(parents=True, exist_ok=True)
LOOP = asyncio.new_event_loop()
QUOTA = 1 << 20  # a session's quota: nothing a fuzz input asks for may allocate more
_ALLOW = Allowlist()


def _stream(fdp: atheris.FuzzedDataProvider, kind: type, max_messages: int = 4) -> bytes:
    """Bytes as a peer sends them: raw, or framed messages with some damage done."""
    mode = fdp.ConsumeIntInRange(0, 3)
    if mode == 0:
        return fdp.ConsumeBytes(fdp.remaining_bytes())
    builder = Builder(fdp, budget=120)
    out = bytearray()
    for _ in range(fdp.ConsumeIntInRange(1, max_messages)):
        out += encode(builder.build(kind))
    if mode == 2 and out:  # a lying length prefix or a cut stream
        if fdp.ConsumeBool():
            at = fdp.ConsumeIntInRange(0, len(out) - 1)
            out[at:at + HEADER.size] = HEADER.pack(fdp.ConsumeIntInRange(0, 2**32 - 1))
        else:
            del out[fdp.ConsumeIntInRange(0, len(out) - 1):]
    return bytes(out)


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=LOOP)
    reader.feed_data(data)
    reader.feed_eof()
    return reader


# -- frames ------------------------------------------------------------------------------------
def frames(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    max_frame = fdp.PickValueInList([64 << 10, 1 << 20])
    stream = _stream(fdp, local_pb2.LocalRequest)

    async def burst_reader() -> None:
        budget = ByteBudget(768 << 10)
        frames = FrameReader(_reader(stream), local_pb2.LocalRequest, max_frame, budget)
        try:
            while (got := await frames.read()) is not None:
                assert got and all(isinstance(m, local_pb2.LocalRequest) for m in got)
        except FrameError:
            pass
        assert budget.used == 0, "a frame's share of the budget was not given back"
        assert len(frames.buf) <= len(stream)

    async def one_by_one() -> None:
        reader = _reader(stream)
        try:
            while (m := await read_frame(reader, local_pb2.LocalRequest, max_frame)) is not None:
                assert isinstance(m, local_pb2.LocalRequest)
        except FrameError:
            pass

    LOOP.run_until_complete(burst_reader())
    LOOP.run_until_complete(one_by_one())


# -- local_socket ------------------------------------------------------------------------------
class _Writer:
    """The connection's writing half: what the daemon answers is parsed back, as the app would."""

    def __init__(self) -> None:
        self.out = bytearray()

    def write(self, data: bytes) -> None:
        self.out += data

    async def drain(self) -> None:
        pass

    def replies(self) -> list[local_pb2.LocalReply]:
        frames, buf = [], self.out
        while buf:
            (n,) = HEADER.unpack_from(buf)
            frames.append(local_pb2.LocalReply.FromString(bytes(buf[HEADER.size:HEADER.size + n])))
            buf = buf[HEADER.size + n:]
        return frames


class _HostCall:
    """The gRPC stream to the GPU host, as the relay uses it: it takes messages; it answers the
    session's open with ``ready`` and then stays silent until cancelled."""

    def __init__(self) -> None:
        self.sent: list[ops_pb2.SessionUp] = []
        self.opened = False
        self.cancelled = asyncio.Event()

    async def write(self, message: ops_pb2.SessionUp) -> None:
        self.sent.append(message)

    async def read(self) -> ops_pb2.SessionDown:
        if not self.opened:
            self.opened = True
            return ops_pb2.SessionDown(ready=ops_pb2.SessionReady(session="h1", device="cpu"))
        await self.cancelled.wait()
        raise asyncio.CancelledError

    def cancel(self) -> None:
        self.cancelled.set()


class _Host:
    name, address = "fuzz-host", "unix:fuzz"


LIMITS = SocketLimitsConfig(hello_timeout=5, max_frame=1 << 20, max_buffered=2 << 20)


def local_socket(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    stream = _stream(fdp, local_pb2.LocalRequest, max_messages=6)

    async def on_ctl(request: local_pb2.CtlRequest, cred: Any) -> local_pb2.CtlReply:
        return local_pb2.CtlReply(ok=True, json=repr((request.command, dict(request.args))))

    async def on_app(hello: local_pb2.AppHello, cred: Any, reader: asyncio.StreamReader,
                     writer: Any, budget: ByteBudget) -> None:
        recorder = Recorder(hello.app, "s1", DataDependencySearch(), STATE / "sequences")
        session = AppSession("s1", hello, cred, _Host(), recorder)
        frames = FrameReader(reader, local_pb2.LocalRequest, LIMITS.max_frame, budget)
        relay = AppRelay(session, _HostCall(), frames, writer)
        # ``serve`` less its error replies, and a search is let finish (a search that fails
        # logs an error: a finding) before ``close`` would cancel it.
        await relay.open(ops_pb2.SessionOpen(app=hello.app))
        if hello.shared_uploads and shared_uploads.supported():
            relay.shared = shared_uploads.Region(4096)  # as the welcome gives it, unsent
        try:
            await relay.run()
        except FrameError:
            pass
        await recorder.search_done()
        relay.close()

    server = LocalServer(str(STATE / "unused.sock"), 0o600, on_ctl, on_app, LIMITS)

    async def serve() -> None:
        writer = _Writer()
        task = asyncio.current_task()
        assert task is not None
        await server._serve(_reader(stream), writer, Connection(task, (1, 1000, 1000)))
        writer.replies()  # what the daemon answered parses

    LOOP.run_until_complete(serve())
    assert server.budget.used == 0


# -- the GPU daemon's session stream -----------------------------------------------------------
def _executor() -> TorchExecutor:
    ctx = ExecutorContext(device="cpu", memory_quota=QUOTA, allow_extra=(), deny=(),
                          blobs=BlobStore(STATE / "blobs", 4 << 20), state_dir=STATE,
                          identity="fuzz")
    return TorchExecutor(ctx)


def _drive(replayer: HostReplayer, frame: ops_pb2.SessionUp,
           emit: Callable[[ops_pb2.SessionDown], None]) -> None:
    """What the GPU daemon does with one message of the stream (gpu.GpuRole.Session)."""
    batch = list(frame.batch.frames) if frame.WhichOneof("msg") == "batch" else [frame]
    for f in batch:
        replayer.read(f)
    for f in batch:
        if f.WhichOneof("msg") == "close":
            return
        if f.WhichOneof("msg") in REPLAY_FRAMES:
            replayer.process(f, emit)
        else:
            replayer.forwarded(f, emit)


def _emit(down: ops_pb2.SessionDown) -> None:
    assert isinstance(down, ops_pb2.SessionDown)
    assert down.WhichOneof("msg") != "error" or down.error.code != "INTERNAL", down.error.message
    down.SerializeToString()  # the reply goes back on the wire


UNARY = (peer_pb2.PeerHello, peer_pb2.PingRequest, ops_pb2.SessionUp)


def _host_schema(name: str) -> bytes | None:
    """The schema hash an honest app on this torch sends for ``name`` (None: no such op)."""
    try:
        return schema_hash(_ALLOW.resolve(name))
    except OpNotAllowed:
        return None


def peer_session(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    if fdp.ConsumeIntInRange(0, 4) == 0:  # raw bytes into every message the peer port parses
        raw = fdp.ConsumeBytes(fdp.remaining_bytes())
        for kind in UNARY:
            try:
                kind.FromString(raw)
            except DecodeError:
                pass
        try:  # the Session stream's own deserializer (gpu.service.add_peer)
            assert _sized_session_up(raw)[1] == len(raw)
        except DecodeError:
            pass
        step = 1 + (raw[0] if raw else 0) % 64
        for kind in (ops_pb2.SessionUp, ops_pb2.SessionDown):  # the bytes cut into parts, as
            joiner = Parts(kind, limit=1 << 12)  # the host joins a robot's and the robot a host's
            try:
                for k in range(0, max(len(raw), 1), step):
                    joiner.add(ops_pb2.MessagePart(data=raw[k:k + step],
                                                   last=k + step >= len(raw)))
            except ValueError:
                pass
        return
    builder = Builder(fdp, budget=150, schema_of=_host_schema)
    ex = _executor()
    try:
        request = builder.build(ops_pb2.SessionOpen)
        if fdp.ConsumeBool():  # the app runs the host's torch: sequences need no comparison
            request.versions["torch"] = torch.__version__
        ready = ex.open(ops_pb2.SessionOpen.FromString(request.SerializeToString()))
        assert ready.session
        replayer = HostReplayer(ex)
        stream = Parts(ops_pb2.SessionUp, limit=1 << 16)  # as the GPU daemon joins parts (gpu.service)
        while fdp.remaining_bytes() and builder.budget > 0:
            wire = builder.build(ops_pb2.SessionUp).SerializeToString()
            frame = ops_pb2.SessionUp.FromString(wire)
            try:
                whole = stream.take(frame)
            except ValueError:
                break  # the daemon ends the stream (INVALID_ARGUMENT)
            if whole is None:
                continue
            if whole[1] is not None:  # a joined message
                frame = whole[0]
            elif fdp.ConsumeBool():  # cut as a robot on a slow link does, then joined
                joiner, whole = Parts(ops_pb2.SessionUp), None
                for piece in cut(frame, fdp.ConsumeIntInRange(1, 256)):
                    whole = joiner.add(piece.part)
                assert whole == (frame, frame.ByteSize())
            if frame.WhichOneof("msg") == "part_bytes":  # the stream's, as gpu.service reads it
                part = reply_part(frame.part_bytes)
                assert part == 0 or MIN_PART <= part == max(frame.part_bytes, MIN_PART)
                continue
            _drive(replayer, frame, _emit)
        replayer._finish(_emit)
        assert ex.stats()["bytes_live"] <= QUOTA
    finally:
        ex.close()


# -- codec -------------------------------------------------------------------------------------
def codec_values(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    builder = Builder(fdp, budget=80)
    if fdp.ConsumeBool():
        msg = builder.build(ops_pb2.TensorData)
        if fdp.ConsumeBool():  # a palette of whole groups (the builder's bytes are short)
            dtype = codec.DTYPES.get(msg.meta.dtype)
            n = fdp.ConsumeIntInRange(0, 3) * codec.PALETTE_LEVELS * (
                dtype.itemsize if dtype is not None else 4) + fdp.ConsumeIntInRange(0, 1)
            seed = fdp.ConsumeBytes(16) or b"\0"
            msg.palette = (seed * (n // len(seed) + 1))[:n]
            msg.palette_block = fdp.ConsumeIntInRange(0, 8)
        try:
            t = codec.from_tensor_data(msg)
        except codec.CodecError:
            return
        # never more than the bytes it came with (palette-coded: an element each)
        assert t.numel() * (1 if msg.palette else t.element_size()) <= len(msg.data)
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # strides: dense
        return

    def tensor(ref: ops_pb2.TensorRef) -> Any:
        if ref.WhichOneof("ref") != "upload":
            raise codec.CodecError("not an upload")
        return codec.from_tensor_data(ref.upload)

    try:
        codec.decode_value(builder.build(ops_pb2.Value), tensor, str)
    except codec.CodecError:
        pass


# -- replay definitions ------------------------------------------------------------------------
def _definition(builder: Builder, fdp: atheris.FuzzedDataProvider | None = None
                ) -> ops_pb2.SequenceDef:
    """A fuzzed SequenceDef with as many sources as tensor arguments (past the first check, as
    the robot's own definitions are): always, or as ``fdp`` decides."""
    d = builder.build(ops_pb2.SequenceDef)
    if fdp is None or fdp.ConsumeBool():
        n = sum(1 for call in d.calls for _ in iter_tensor_refs(call))
        del d.sources[n:]
        while len(d.sources) < n:
            builder.fill(d.sources.add(), 1)
    return ops_pb2.SequenceDef.FromString(d.SerializeToString())


def replay_defs(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    builder = Builder(fdp, budget=200)
    d = _definition(builder, fdp)
    ex = _executor()
    try:
        ex.open(ops_pb2.SessionOpen())
        try:
            compile_sequence(d, ex.written_ids)
        except (ValueError, KeyError):
            pass
        replayer = HostReplayer(ex)
        replayer.process(ops_pb2.SessionUp(define=d), _emit)
        for _ in range(fdp.ConsumeIntInRange(0, 2)):
            start = builder.build(ops_pb2.ReplayStart)
            if fdp.ConsumeBool():
                start.sequence = d.id
            _drive(replayer, ops_pb2.SessionUp(start=start), _emit)
            while fdp.remaining_bytes() and builder.budget > 0 and fdp.ConsumeIntInRange(0, 5):
                frame = ops_pb2.SessionUp(arg=builder.build(ops_pb2.ReplayArg))
                _drive(replayer, frame, _emit)
        replayer._finish(_emit)
        if fdp.ConsumeBool():
            _resume_loop(fdp, replayer, d.id + 1)
    finally:
        ex.close()


def _resume_loop(fdp: Any, replayer: HostReplayer, seq_id: int) -> None:
    """``replay_defs``' second part: a loop with variants replayed, aborted at a fuzzed
    position, and resumed (``ReplayStart.loop_choices``) with fuzzed choices, count, position
    and joined values (mostly those the first replay made). Its body's ``select`` may take a
    fuzzed dimension, which fails some iterations' bodies on the host (cut there:
    ``HostReplayer._cut_at_failure``)."""
    d = branched()
    d.id = seq_id
    if fdp.ConsumeBool():
        d.calls[1].args[1].i = fdp.ConsumeIntInRange(-3, 2)
    replayer.process(ops_pb2.SessionUp(define=d), _emit)
    x = torch.tensor([float(fdp.ConsumeIntInRange(-2, 2)) for _ in range(4)])
    first = REPLAY_BASE + 20 * SPAN
    for frame in (ops_pb2.ReplayStart(sequence=seq_id, base_id=first, inference=first),
                  ops_pb2.ReplayArg(slot=0, tensor=ops_pb2.TensorRef(
                      upload=codec.tensor_data(x)))):
        key = "start" if isinstance(frame, ops_pb2.ReplayStart) else "arg"
        _drive(replayer, ops_pb2.SessionUp(**{key: frame}), _emit)
    count = fdp.ConsumeIntInRange(0, 5)
    done = [fdp.ConsumeIntInRange(-2, 2) for _ in range(fdp.ConsumeIntInRange(0, count + 1))]
    position = loops.iteration_start(d, [c if 0 <= c < 2 else loops.SKIP for c in done]) \
        if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 24)
    _drive(replayer, ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=position)), _emit)
    joined = {i: first + i if fdp.ConsumeIntInRange(0, 3) else fdp.ConsumeIntInRange(0, 1 << 62)
              for i in range(fdp.ConsumeIntInRange(0, 16))}
    base = first + SPAN
    _drive(replayer, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(
        sequence=seq_id, base_id=base, inference=base, position=position, joined=joined,
        loop_count=count, loop_choices=done)), _emit)
    _drive(replayer, ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(
        position=fdp.ConsumeIntInRange(0, 40))), _emit)
    replayer._finish(_emit)


# -- the host's native runs ---------------------------------------------------------------------
_NATIVE_BASE: list[tuple[bytes, dict[int, torch.Tensor], tuple[int, ...]]] = []
FIXED = 3 << 20  # the native base's fixed upload, as a tensor argument


def _native_base() -> tuple[bytes, dict[int, torch.Tensor], tuple[int, ...]]:
    """A definition the host replays natively (a small CNN's forward, written out as the
    shim's recorder would send it), its constants by id and its input's shape: built once,
    by running each call to know its output's layout."""
    if _NATIVE_BASE:
        return _NATIVE_BASE[0]
    aten = torch.ops.aten
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 8, 8, generator=gen)
    consts = {2 << 20 | i: t for i, t in enumerate((
        torch.randn(4, 3, 3, 3, generator=gen), torch.randn(4, generator=gen),
        torch.randn(8, 64, generator=gen), torch.randn(8, generator=gen)))}
    w, b, w2, b2 = consts
    d = ops_pb2.SequenceDef(id=1, outputs=[8])
    values: dict[int, torch.Tensor] = {1: x}

    fixed = torch.randn(8, generator=gen)  # made anew by the app with the same bytes

    def ref(tid: int) -> ops_pb2.Value:
        v = ops_pb2.Value()
        if tid == FIXED:  # its upload is in the definition (``SeqSource.fixed``)
            d.sources.add(kind=ops_pb2.SeqSource.INPUT, fixed=True)
            v.tensor.upload.CopyFrom(codec.tensor_data(fixed))
        elif tid == 1:  # the input: uploaded with each start, bound as value 1
            d.sources.add(kind=ops_pb2.SeqSource.INPUT)
            v.tensor.upload.CopyFrom(codec.tensor_data(x))
            v.tensor.bind_id = 1
        elif tid in consts:
            d.sources.add(kind=ops_pb2.SeqSource.CONSTANT, id=tid,
                          meta=codec.meta_of(consts[tid]))
            v.tensor.id = tid
        else:
            d.sources.add(kind=ops_pb2.SeqSource.PRODUCED, id=tid)
            v.tensor.id = tid
        return v

    def add(out: int, op: Any, *args: Any) -> None:
        call = d.calls.add(op=f"{op._schema.name}.{op._overloadname}", out_ids=[out])
        real = []
        for a in args:
            if isinstance(a, tuple):  # a tensor, by id
                call.args.append(ref(a[0]))
                real.append({**values, **consts, FIXED: fixed}[a[0]])
            else:
                codec.encode_value(a, call.args.add(), lambda t: ops_pb2.TensorRef())
                real.append(a)
        values[out] = op(*real)
        call.out_meta.append(codec.meta_of(values[out]))

    d.local_ids.append(1)
    for out, op, *args in ((2, aten.relu.default, (1,)),
                           (3, aten.conv2d.default, (2,), (w,), (b,), [1, 1], [1, 1], [1, 1], 1),
                           (4, aten.max_pool2d.default, (3,), [2, 2], [2, 2]),
                           (4, aten.relu_.default, (4,)),  # in place: copied, or matched
                           (5, aten.sigmoid.default, (4,)),
                           (9, aten.gt.Scalar, (5,), 0.5),
                           (10, aten.nonzero.default, (9,)),  # answered: its count follows x
                           (6, aten.view.default, (5,), [1, -1]),
                           (7, aten.linear.default, (6,), (w2,), (b2,)),
                           (7, aten.add_.Tensor, (7,), (7,)),  # in place, after the answer
                           (11, aten.mul.Tensor, (7,), 2),  # a number as a Tensor argument
                           (12, aten.add.Tensor, (11,), (FIXED,)),  # bytes of the definition
                           (8, aten.softmax.int, (12,), 1)):
        if out not in d.local_ids:
            d.local_ids.append(out)
        add(out, op, *args)
        d.calls[-1].want_meta = op is aten.nonzero.default
    _NATIVE_BASE.append((d.SerializeToString(), consts, tuple(x.shape)))
    return _NATIVE_BASE[0]


def _int_values(v: ops_pb2.Value, found: list[ops_pb2.Value]) -> None:
    kind = v.WhichOneof("kind")
    if kind == "i":
        found.append(v)
    elif kind in ("list", "tuple"):
        for item in getattr(v, kind).items:
            _int_values(item, found)


def native_runs(data: bytes) -> None:
    """A definition the host replays in native runs, with fuzzed integers in its calls'
    arguments (strides, paddings, dims, sizes), fuzzed output layouts and inputs of fuzzed
    sizes, fuzzed claims of how far the app matched (``Release.progress``: its in-place calls
    run with or without a copy taken in the run) and aborts, an answered call whose count
    follows the input's values (the run answers it from inside, and steps where it differs) and
    a fixed upload whose meta may no longer fit its bytes (decoded as a run's external):
    whatever the loop is given from the wire (through ``toIValue`` into the operators), errors
    come back as replies (none ``INTERNAL``) and the process stays up."""
    fdp = atheris.FuzzedDataProvider(data)
    raw, constants, shape = _native_base()
    d = ops_pb2.SequenceDef.FromString(raw)
    ints: list[ops_pb2.Value] = []
    for call in d.calls:
        for v in (*call.args, *call.kwargs.values()):
            _int_values(v, ints)
    metas = [m for call in d.calls for m in call.out_meta]
    metas += [v.tensor.upload.meta for call in d.calls for v in call.args  # a fixed upload's
              if v.tensor.HasField("upload") and not v.tensor.bind_id]   # meta and its bytes
    for _ in range(fdp.ConsumeIntInRange(0, 6)):
        if fdp.ConsumeBool() and ints:
            ints[fdp.ConsumeIntInRange(0, len(ints) - 1)].i = fdp.ConsumeIntInRange(-(1 << 33),
                                                                                 1 << 33)
        elif metas:
            m = metas[fdp.ConsumeIntInRange(0, len(metas) - 1)]
            dims = m.shape if fdp.ConsumeBool() else m.stride
            if dims:
                dims[fdp.ConsumeIntInRange(0, len(dims) - 1)] = fdp.ConsumeIntInRange(-2, 1 << 20)
    ex = _executor()
    try:
        ex.open(ops_pb2.SessionOpen())
        for tid, t in constants.items():
            ex.store.put(tid, t)
        replayer = HostReplayer(ex)
        replayer.process(ops_pb2.SessionUp(define=d), _emit)
        for n in range(1, 3 + fdp.ConsumeIntInRange(0, 1)):  # calibrated, then native
            size = shape if fdp.ConsumeIntInRange(0, 3) != 1 else tuple(  # mostly as recorded
                fdp.ConsumeIntInRange(1, 24) for _ in shape)
            base = REPLAY_BASE + n * SPAN
            upload = ops_pb2.TensorRef(upload=codec.tensor_data(torch.randn(size)))
            progress = ops_pb2.ReplayProgress(
                base_id=base if fdp.ConsumeIntInRange(0, 3) else fdp.ConsumeIntInRange(0, 1 << 62),
                position=fdp.ConsumeIntInRange(0, len(d.calls) + 2))
            frames = [ops_pb2.SessionUp(start=ops_pb2.ReplayStart(
                          sequence=d.id, base_id=base, inference=base)),
                      ops_pb2.SessionUp(release=ops_pb2.Release(progress=progress)),
                      ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload))]
            if fdp.ConsumeIntInRange(0, 3) == 0:  # the app went another way
                frames.append(ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(
                    position=fdp.ConsumeIntInRange(0, len(d.calls)))))
            frames.append(ops_pb2.SessionUp(release=ops_pb2.Release(
                ids=[base + i for i in range(len(d.local_ids))])))
            for frame in frames:
                _drive(replayer, frame, _emit)
        replayer._finish(_emit)
    finally:
        ex.close()


# -- the shim's side of replay ----------------------------------------------------------------
class _ShimSession:
    """What ``ReplayClient`` needs of a ``RemoteSession``, with no connection."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.released: list[int] = []
        self.stale_released: list[int] = []
        self.lost: str | None = None
        self.epoch = 0
        # what the hot path reads of a session (``hotpath.make``)
        self._assigning: dict[int, Any] = {}
        self._late: set[int] = set()
        self.diverged: set[int] = set()

    def send_frames(self, frames: list[Any]) -> None:
        pass

    def release_now(self, at_least: int) -> None:
        pass

    def wait_slice(self, cap: float) -> float:
        return cap

    def past_deadline(self) -> bool:
        return False


def shim_down(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    builder = Builder(fdp, budget=200)
    session = _ShimSession()
    client = ReplayClient(session)  # type: ignore[arg-type]
    for _ in range(fdp.ConsumeIntInRange(1, 4)):
        down = builder.build(ops_pb2.SessionDown)
        down = ops_pb2.SessionDown.FromString(down.SerializeToString())
        kind = down.WhichOneof("msg")
        if kind == "sequence":
            client.define(down.sequence)
        elif kind == "answer":
            client.answered(down.answer)
            decode_answer(down.answer.result, session, torch.device("cpu"))  # type: ignore[arg-type]
        elif kind == "fetched":
            client.pushed(down.fetched)
        elif kind == "search":
            client.search_hint(down.search)
        elif kind == "error" and down.error.base_id:
            client.broken(down.error)  # as the client routes it
        elif kind == "error" and down.error.sequence:
            client.failed(down.error.sequence)
        elif kind == "sizes":
            client.sized(down.sizes)
    # the sizes kept, each made into a proxy as a varying step of some rank would make it
    step = Step("aten::relu.default", 0, (), {}, [], [0], {}, [], variable=True)
    for base, known in list(client._sizes.items())[:4]:
        for position in list(known)[:8]:
            step.dense = (0, torch.float32, torch.device("cpu"), fdp.ConsumeIntInRange(0, 4))
            act = Active(None, base, position=position)  # type: ignore[arg-type]
            proxy = client._dense(act, step)
            assert proxy is None or tuple(proxy.shape) == known[position]
            # the hot path makes the same from them, in Python and natively (none where the
            # host gave up a sequence or broke this inference: the general path decides there)
            if position < 64:
                closed = bool(client._give_up) or base in client._broken
                for hot in _hot_paths(session, client):
                    made = _hot_sized(client, hot, base, position, step.dense[3])
                    assert (made is None) == (proxy is None or closed)
                    assert made is None or tuple(made.shape) == known[position]


def _hot_paths(session: _ShimSession, client: ReplayClient) -> list[Any]:
    share = 0.0  # (none timed: a timed call reads the thread's CPU clock)
    paths = [hotpath.HotPath(session, client, Journal(), random.random, share, 64)]  # type: ignore[arg-type]
    if native.module("shimstep") is not None:
        paths.append(hotpath.make(session, client, Journal(), random.random, share, 64))  # type: ignore[arg-type]
    return paths


def _hot_sized(client: ReplayClient, hot: Any, base: int, position: int, rank: int) -> Any:
    """A call of no arguments at ``position`` of a varying step whose sizes the host pushed,
    answered by ``hot`` (None: left to the general path)."""
    func = torch.ops.aten.relu.default
    fast = hotpath.Fast(func, OpInfo(func), hotpath.grad_mode(), 0, (), (), (), -1, 0, None,
                        rank, {"storage_offset": 0, "dtype": torch.float32,
                               "device": torch.device("cpu"), "requires_grad": False})
    steps = [Step("aten::relu.default", 0, (), {}, [], [0], {}, [])] * (position + 1)
    seq = Sequence(ops_pb2.SequenceDef(), steps, {}, {}, set())
    seq.fast = [None] * position + [fast]
    client._tls.active = Active(seq, base, position=position)
    try:
        return hot(func, ())
    finally:
        client._tls.active = None


# -- the robot's op log, fed what the host sends about an aborted replay ------------------------
def robot_replayed(data: bytes) -> None:
    """A replay the app aborted, as the robot daemon relays it (a definition of its own, the
    shim's start, arguments and abort), then the host's answers and ``ReplayedPrefix`` from the
    network: put into the op log, whose entries are then built, without raising. The
    definition may be a loop with variants, whose start may resume it with fuzzed
    ``loop_count`` and ``loop_choices`` (``recorder._resumed``)."""
    fdp = atheris.FuzzedDataProvider(data)
    builder = Builder(fdp, budget=200)
    d = _definition(builder) if fdp.ConsumeBool() else branched()
    rec = Recorder("fuzz.py", "s1", DataDependencySearch(), STATE / "robot")
    rec._adopt(d, {"id": d.id, "thread": d.thread, "replays": 0, "mismatches": 0,
                   "operators": len(d.calls)})
    start = builder.build(ops_pb2.ReplayStart)
    start.sequence = d.id
    if fdp.ConsumeBool():  # a resume: small counts and choices, mostly ones the loop has
        start.loop_count = fdp.ConsumeIntInRange(0, 5)
        start.loop_choices[:] = [fdp.ConsumeIntInRange(-2, 2)
                                 for _ in range(fdp.ConsumeIntInRange(0, 4))]
    ups = [ops_pb2.SessionUp(start=start)]
    ups += [ops_pb2.SessionUp(arg=builder.build(ops_pb2.ReplayArg))
            for _ in range(fdp.ConsumeIntInRange(0, 3))]
    ups.append(ops_pb2.SessionUp(abort=builder.build(ops_pb2.ReplayAbort)))
    for up in ups:
        rec.observe(up)
    for _ in range(fdp.ConsumeIntInRange(1, 3)):
        down = builder.build(ops_pb2.SessionDown)
        if fdp.ConsumeBool():
            down.replayed.base_id = start.base_id
        down = ops_pb2.SessionDown.FromString(down.SerializeToString())
        kind = down.WhichOneof("msg")
        if kind == "answer":
            rec.observe_answer(down.answer)
        elif kind == "replayed":
            rec.observe_replayed(down.replayed)
        elif kind == "result":
            rec.observe_result(down.result)
        elif kind == "fetched" and not down.fetched.seq:  # a replayed output, pushed
            if fdp.ConsumeBool():
                down.fetched.id = start.base_id + fdp.ConsumeIntInRange(0, 8)
            rec.observe_pushed(down.fetched)
        elif kind == "fetched":  # a fetch's reply (a value the app read), before or after it
            if fdp.ConsumeBool():
                rec.observe(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=down.fetched.seq,
                                                                  id=fdp.ConsumeIntInRange(1, 64))))
            rec.observe_fetched(down.fetched)
    rec.observe(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=1, id=1)))
    rec.log.entries(d.thread)


class _Link:
    """A host link as placement reads it."""

    def __init__(self, name: str):
        self.name, self.up, self.inflight, self.sessions, self.rtt_ms = name, True, 0, 0, 1.0

    def open_session(self) -> Any:
        return _Stream()


class _Stream:
    async def write(self, message: Any) -> None:
        pass

    async def read(self) -> Any:
        await asyncio.sleep(3600)

    def cancel(self) -> None:
        pass


class _FirstOrLast:
    def __init__(self, fdp: atheris.FuzzedDataProvider):
        self.fdp = fdp

    def choose(self, hosts: Any) -> Any:
        return hosts[0]

    def place(self, hosts: Any, job: Any) -> Any:
        return hosts[-1] if self.fdp.ConsumeBool() else hosts[0]

    def observe(self, host: Any, job: Any, seconds: float | None) -> None:
        pass


def robot_placement(data: bytes) -> None:
    """App frames routed over a primary and a replica holding a (fuzzed) sequence, host frames
    from either, a replica lost or a definition refused in between: ``route`` raises nothing
    but ``NeedPull``, whose ``rewrite`` routes; ``from_host`` never raises; no host's count of
    inferences in flight goes below 0."""
    fdp = atheris.FuzzedDataProvider(data)
    builder = Builder(fdp, budget=200)
    d = _definition(builder)

    async def main() -> None:
        links = [_Link("p"), _Link("a")]
        primary = Lane(links[0], _Stream(), primary=True)
        placement = Placement(primary, lambda: links, lambda: _FirstOrLast(fdp),
                              ops_pb2.SessionOpen(app="fuzz.py"))
        placement.enabled = False
        placement.accepted(d, ops_pb2.SequenceAck(id=d.id, accepted=True))
        placement.enabled = True
        replica = Lane(links[1], _Stream(), primary=False, warm=True)
        replica.defined.add(d.id)
        placement.replicas["a"] = replica
        lanes = [primary, replica]
        for _ in range(fdp.ConsumeIntInRange(1, 12)):
            what = fdp.ConsumeIntInRange(0, 9)
            if what <= 5:
                up = builder.build(ops_pb2.SessionUp)
                if up.WhichOneof("msg") == "start" and fdp.ConsumeBool():
                    up.start.sequence = d.id
                up = ops_pb2.SessionUp.FromString(up.SerializeToString())
                try:
                    placement.route(up)
                except NeedPull as need:
                    values = {i: ops_pb2.TensorData() for i in need.ids}
                    placement.route(placement.rewrite(up, values))
            elif what <= 8:
                down = ops_pb2.SessionDown.FromString(
                    builder.build(ops_pb2.SessionDown).SerializeToString())
                placement.from_host(lanes[fdp.ConsumeIntInRange(0, 1)], down)
            elif fdp.ConsumeBool():
                links[1].up = False
                placement.lose(links[1], "fuzz")
            else:
                placement._refused(replica, ops_pb2.Error(code="X", sequence=d.id))
            assert all(link.inflight >= 0 for link in links), [x.inflight for x in links]
        placement.take(primary)
        await placement.close()

    LOOP.run_until_complete(main())




# -- the robot daemon's scheduler: profiles and inference marks from the app ------------------
class _SchedulingConfig:
    scheduler = "min-cut"
    intercept = type("Intercept", (), {"backend": "torch"})
    switch_plans = True


_SCHEDULING: list[Scheduling] = []


class _MeasuredLink:
    name, rtt_min_ms = "fuzz-host", 2.6

    def __init__(self, fdp: atheris.FuzzedDataProvider):
        self.mbit_s = fdp.ConsumeRegularFloat() if fdp.ConsumeBool() else None


def robot_scheduling(data: bytes) -> None:
    """The app's profiles (``SequenceProfile``), inference marks (as the relay attributes
    them: the replays an inference started, its latency), the host's timings of replays
    (``ReplayTiming``) and probed throughputs, fuzzed, for a (fuzzed) sequence the
    ``min-cut`` scheduler placed: the placer raises nothing, and each definition it would send
    again has a current plan whose calls both ends can run."""
    from rrtod.plugins import discover

    if not _SCHEDULING:
        _SCHEDULING.append(Scheduling(discover(), _SchedulingConfig()))  # type: ignore[arg-type]
    fdp = atheris.FuzzedDataProvider(data)
    builder = Builder(fdp, budget=200)
    d = _definition(builder)
    placer = _SCHEDULING[0].session(_MeasuredLink(fdp))
    d = placer.place(d)
    for _ in range(fdp.ConsumeIntInRange(1, 24)):
        mbit_s = fdp.ConsumeRegularFloat() if fdp.ConsumeBool() else None
        again: list[ops_pb2.SequenceDef | None] = []
        what = fdp.ConsumeIntInRange(0, 3)
        if what == 0:
            profile = ops_pb2.SequenceProfile.FromString(
                builder.build(ops_pb2.SequenceProfile).SerializeToString())
            if fdp.ConsumeBool():
                profile.sequence = d.id
            again.append(placer.profiled(profile, fdp.ConsumeBool(), mbit_s))
        elif what == 1:  # the host's timing of a replay (plan switching)
            timing = ops_pb2.ReplayTiming.FromString(
                builder.build(ops_pb2.ReplayTiming).SerializeToString())
            if fdp.ConsumeBool():
                timing.sequence = d.id
            again += placer.observe(placer.uploaded(timing))
        elif what == 2:  # a probe's throughput
            again += placer.observe(mbit_s)
            if fdp.ConsumeBool() and d.id in placer.defined:  # (else it is d, as given)
                again.append(placer.current(d))
        else:
            started: list[tuple[int, int] | None] = [
                None if fdp.ConsumeIntInRange(0, 7) == 0 else
                (d.id if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 1 << 40),
                 fdp.ConsumeIntInRange(0, 3))
                for _ in range(fdp.ConsumeIntInRange(0, 3))]
            for seq in placer.timed(started, float(fdp.ConsumeIntInRange(-1 << 40, 1 << 40))):
                again.append(placer.again(seq, mbit_s))
        for placed in again:
            if placed is not None:
                partition.plan_calls(placed, placed.plan)
                d = placed


def loop_defs(data: bytes) -> None:
    """A definition with a loop of variants, as the robot sends it, with fuzzed integers,
    ids, sources, loop fields and variants, unrolled for a fuzzed count and choice of
    variants (or cut at a fuzzed iteration: ``unroll(cut=)``), each of the host's calls at
    the app's position of the same call: where ``loops.check`` accepts it, the host's
    unrolling copied from its bodies (``unroll(bodies=)``, with ``made_from``) equals the one
    built whole, and compiled on the bodies (``compile_sequence(copied=)``) equals a whole
    compile, field for field."""
    fdp = atheris.FuzzedDataProvider(data)
    d = branched()
    loop = d.loops[0]
    ints: list[ops_pb2.Value] = []
    for call in (*d.calls, *(c for v in loop.variants for c in v.calls)):
        for v in call.args:
            _int_values(v, ints)
    ids = [*d.local_ids, *(r for v in loop.variants for r in v.local_ids)]
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        what = fdp.ConsumeIntInRange(0, 5)
        if what == 0 and ints:
            ints[fdp.ConsumeIntInRange(0, len(ints) - 1)].i = fdp.ConsumeIntInRange(-3, 5)
        elif what == 1:
            loop.start, loop.body = fdp.ConsumeIntInRange(0, 4), fdp.ConsumeIntInRange(0, 4)
        elif what == 2:
            loop.variants[fdp.ConsumeIntInRange(0, 1)].when[:] = [float(fdp.ConsumeBool())]
        elif what == 3:
            src = d.sources[fdp.ConsumeIntInRange(0, len(d.sources) - 1)]
            src.id = ids[fdp.ConsumeIntInRange(0, len(ids) - 1)]
        elif what == 4:
            call = d.calls[fdp.ConsumeIntInRange(0, len(d.calls) - 1)]
            call.out_ids[:] = [ids[fdp.ConsumeIntInRange(0, len(ids) - 1)]]
        else:
            loop.guards[:] = [ids[fdp.ConsumeIntInRange(0, len(ids) - 1)]]
    count = fdp.ConsumeIntInRange(0, 5)
    choices = [fdp.ConsumeIntInRange(0, len(loop.variants) - 1) for _ in range(count)]
    if fdp.ConsumeBool():  # cut at an iteration whose values no variant has
        del choices[fdp.ConsumeIntInRange(0, count):]
    try:
        loops.check(d)
        layout = loops.layout_of(d)
        first = loops.bodies(d, count)
        whole_origins: list[int] = []
        whole = loops.unroll(d, count, whole_origins, choices=choices, bodies_first=True,
                             checked=True, layout=layout, cut=True)
        app = loops.unroll(d, count, choices=choices, checked=True, layout=layout, cut=True)
    except ValueError:
        return
    origins: list[int] = []
    made: list[Any] = []
    copy = loops.unroll(d, count, origins, choices=choices, bodies_first=True, checked=True,
                        layout=layout, bodies=first, made_from=made, cut=True)
    assert copy == whole and origins == whole_origins and len(made) == len(copy.calls)
    where = loops.app_positions(d, count, choices)  # the host's calls, each the app's
    assert len(where) == len(whole.calls) and list(app.local_ids) == list(whole.local_ids)
    assert all(whole.calls[k] == app.calls[a] for k, a in enumerate(where) if a < len(app.calls))
    assert sorted(a for a in where if a < len(app.calls)) == list(range(len(app.calls)))
    try:  # as the host does: the bodies first (a failure there is the replay's, reported)
        ran = compile_sequence(first)
        alone = compile_sequence(whole)
    except (ValueError, KeyError):
        return
    on = compile_sequence(copy, prefix=ran, copied=len(first.calls))
    assert not same_compiled(alone, on), same_compiled(alone, on)
    if choices:
        _resumed_loop(fdp, d, count, choices, layout)


def _resumed_loop(fdp: Any, d: ops_pb2.SequenceDef, count: int, choices: list[int],
                  layout: loops.Layout) -> None:
    """``loop_defs``' unrolling resumed after a cut at a fuzzed iteration (``ordered``, fuzzed
    ``SKIP``s before it): the host's calls from its bodies-only stage on equal the app's at the
    positions ``app_positions`` gives, and the app's calls before the resume point are those of
    the unrolling cut there."""
    ordered = fdp.ConsumeIntInRange(1, len(choices))
    done = [loops.SKIP if k == ordered - 1 or fdp.ConsumeIntInRange(0, 3) == 0 else c
            for k, c in enumerate(choices[:ordered])]
    full = [*done, *choices[ordered:]]
    try:
        host = loops.unroll(d, count, choices=full, bodies_first=True, ordered=ordered,
                            checked=True, layout=layout, cut=True)
        app = loops.unroll(d, count, choices=full, checked=True, layout=layout, cut=True)
        cut = loops.unroll(d, count, choices=done[:-1], checked=True, layout=layout, cut=True)
        stage = loops.unroll(d, count, choices=done, bodies_first=True, ordered=ordered,
                             checked=True, layout=layout) if ordered < count else None
    except ValueError:
        return
    p = loops.iteration_start(d, done)
    assert list(app.calls[:p]) == list(cut.calls) and list(app.local_ids) == list(host.local_ids)
    if stage is not None:
        assert stage.calls[:p] == app.calls[:p] and not stage.outputs
        assert loops.unroll(d, count, choices=full, bodies_first=True, ordered=ordered,
                            checked=True, layout=layout, bodies=stage, cut=True) == host
    where = loops.app_positions(d, count, full, ordered)
    assert len(where) == len(host.calls)
    assert all(host.calls[k] == app.calls[a] for k, a in enumerate(where) if a < len(app.calls))
    assert sorted(a for a in where if a < len(app.calls)) == list(range(len(app.calls)))


# -- the robot's verification of a candidate's repetitions -------------------------------------
def _fuzzed_ints(fdp: atheris.FuzzedDataProvider, counts: list[int], n: int) -> list[int]:
    """``n`` integers for one call of one inference: each a constant, one of this inference's
    answered counts, or a product of two of them."""
    out = []
    for _ in range(n):
        how = fdp.ConsumeIntInRange(0, 3)
        if how == 0 or not counts:
            out.append(fdp.ConsumeIntInRange(-2, 300))
        elif how == 1:
            out.append(counts[fdp.ConsumeIntInRange(0, len(counts) - 1)])
        elif how == 2:
            out.append(counts[fdp.ConsumeIntInRange(0, len(counts) - 1)] * 4)
        else:
            out.append(-1)
    return out


def _int_at(call: ops_pb2.OpCall, path: tuple[Any, ...]) -> int:
    top, where, *items = path
    v = call.args[where] if top == "arg" else call.kwargs[where]
    for j in items:
        v = getattr(v, v.WhichOneof("kind")).items[j]
    return v.i


def robot_search(data: bytes) -> None:
    """Inferences of the same calls (answered ``nonzero``s whose counts the fuzzer picks, per
    inference or the same in all, and ``view``/``zeros`` calls whose integers are constants
    or those counts), logged as the relay logs them; ``explain`` on their repetitions either
    refuses them (``Unexplained``) or makes symbols, and every symbol is, in every repetition,
    the integer the app passed: a size (or product of sizes) of the tensor it names, or the
    value it names."""
    fdp = atheris.FuzzedDataProvider(data)
    log, seq, ids = OpLog(), 0, iter(range(10, 1 << 20))
    shape = [fdp.ConsumeIntInRange(0, 2) for _ in range(fdp.ConsumeIntInRange(2, 8))]
    same = fdp.ConsumeBool()  # every inference answers the same counts
    n_inferences = fdp.ConsumeIntInRange(3, 4)
    fixed = [fdp.ConsumeIntInRange(0, 64) for _ in shape]
    blocks = []
    meta = ops_pb2.TensorMeta(dtype="float32", shape=[8], stride=[1])
    for _ in range(n_inferences):
        blocks.append(len(log.calls))
        counts: list[int] = []
        last = None
        for kind, k in zip(shape, fixed, strict=True):
            seq += 1
            arg = ops_pb2.Value(tensor=ops_pb2.TensorRef(id=last)) if last is not None else \
                ops_pb2.Value(tensor=ops_pb2.TensorRef(upload=ops_pb2.TensorData(meta=meta)))
            if kind == 0:  # answered: its output's count is the host's
                c = ops_pb2.OpCall(seq=seq, op="aten::nonzero.default", args=[arg],
                                   want_meta=True, grad_mode=ops_pb2.INFERENCE_MODE)
                log.record(ops_pb2.SessionUp(call=c))
                n = k if same else fdp.ConsumeIntInRange(0, 64)
                last = next(ids) + (1 << 20)
                log.record_result(ops_pb2.OpResult(seq=seq, outs=[ops_pb2.TensorMeta(
                    dtype="int64", shape=[n, 1], stride=[1, 1])], value=ops_pb2.Value(
                    tensor=ops_pb2.TensorRef(id=last))))
                counts.append(n)
                continue
            ints = _fuzzed_ints(fdp, counts, fdp.ConsumeIntInRange(1, 3))
            size = ops_pb2.Value(list=ops_pb2.ValueList(items=[ops_pb2.Value(i=i) for i in ints]))
            out = next(ids)
            dims = [max(i, 0) for i in ints]
            c = ops_pb2.OpCall(seq=seq, grad_mode=ops_pb2.INFERENCE_MODE, out_ids=[out],
                               out_meta=[ops_pb2.TensorMeta(dtype="float32", shape=dims)])
            if kind == 1:
                c.op = "aten::view.default"
                c.args.extend([arg, size])
            else:
                c.op = "aten::zeros.default"
                c.args.append(size)
            log.record(ops_pb2.SessionUp(call=c))
            last = out
        seq += 1
        log.record(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=seq, id=last)))
    entries = log.entries(0)
    try:
        found = explain(entries, blocks[1:], len(shape))
    except Unexplained:
        return
    for (i, path), (j, o, d, span) in found.symbols.items():
        assert j < i, (i, j)
        for b in blocks[1:]:
            want = _int_at(entries[b + i].raw, path)
            if d == VALUE:
                continue  # (no value is read here)
            got = entries[b + j].out_shapes()[o][d:d + span]
            assert len(got) == span and math.prod(got) == want, (i, path, j, o, d, span, got)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "frames": frames,
    "local_socket": local_socket,
    "peer_session": peer_session,
    "codec": codec_values,
    "replay_defs": replay_defs,
    "native_runs": native_runs,
    "loop_defs": loop_defs,
    "shim_down": shim_down,
    "robot_replayed": robot_replayed,
    "robot_search": robot_search,
    "robot_placement": robot_placement,
    "robot_scheduling": robot_scheduling,
}
assert tuple(TARGETS) == TARGET_NAMES
