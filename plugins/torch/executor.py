"""The host side of the torch backend: one ``TorchExecutor`` per app session.

The GPU daemon drives it from one worker thread per session (rrtod.executor). It resolves each
operator against the allowlist, turns tensor refs into tensors of the session's store (uploads,
persistent tensors from the weight cache, earlier outputs), runs the operator on the configured
device and keeps the outputs under the ids the client chose. Errors become ``SessionDown(error)``
with a stable code; the outputs of a failed call are *poisoned* so that later calls that use them
fail quietly and a download reports the original failure instead of a cascade of unknown ids.

Memory safety does not rest on the allowlist alone. Before an operator runs, the host computes
what it will allocate (``sizing``: meta execution, cached) and admits those bytes against the
session's quota and the daemon's memory limit; the client's declared output metadata is never
trusted for that. After it runs, every output and every argument it wrote in place is checked
to stay inside its storage (``bounds``); a view reaching outside is ``BAD_VIEW`` and never stored.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rrto.v1 import ops_pb2
from rrtod.executor import ExecutorContext
from rrtod.gpu.blobstore import BlobError
from rrtod.switches import flag
from rrtod.wire import BIND_OP, HOST_ID_BASE, hash_of, int_of, released_ids

from . import aliasing, codec, native, sizing
from . import batch as batch_
from . import rows as rows_
from .allowlist import Allowlist, OpNotAllowed
from .bounds import BadView, check_view
from .prepared import Layout, PreparedCall, _dense, _layout, written_args
from .schemas import SchemaCheck, SchemaMismatch
from .store import QuotaExceeded, TensorStore

# Runs whose sizes follow the data run natively within their calls' caps (``batch``), not
# stepped; ``RRTO_BOUNDED_RUNS=0`` steps them (the loop's A/B, and a way back).
BOUNDED_RUNS = flag("RRTO_BOUNDED_RUNS", True)


class CallFailed(Exception):
    """A frame that cannot be executed; ``code`` is the wire error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class _Poisoned(Exception):
    """An argument is the output of a call that failed; the failure was already reported."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"executor.device is {name!r} but this host has no CUDA device")
    return dev


def device_memory(device: torch.device) -> int:
    """Bytes of memory of ``device``: the GPU's, or the host's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import psutil

    return psutil.virtual_memory().total


def _written_tensors(op: Any, args: list[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for i, name in written_args(op):
        sizing.flatten_tensors(args[i] if i < len(args) else kwargs.get(name), out)
    return out


def _has_non_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return False
    if isinstance(value, (list, tuple)):
        return any(_has_non_tensor(v) for v in value)
    return True


def _conform(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The output as the app's proxy describes it. The client infers metadata by meta
    execution, and for some composite operators the meta decomposition lays out its result
    differently from the device kernel; the app's view of the tensor is what later calls
    (``view``, ``as_strided``) rely on, so the host copies the value into that layout."""
    shape, stride = layout
    strides = t.stride()
    if strides == stride or t.shape != shape or not _dense(shape, stride):
        # A different shape: auxiliary outputs such as native_batch_norm's saved statistics in
        # eval are empty on CPU but sized by the meta kernel; nothing reads them, so keep what
        # the kernel made.
        return t
    if len(stride) != len(strides) or t.numel() <= 1 or all(
            size == 1 or st == ps for size, st, ps in zip(shape, strides, stride, strict=True)):
        return t
    return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device).copy_(t)


def _rebuild(value: Any, swap: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return swap.get(id(value), value)
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, swap) for v in value)
    return value


# The C++ guard behind ``torch.inference_mode()``, entered directly: the Python context manager
# costs a few microseconds per operator (about 5 % of a replayed call's host time, sampled
# with py-spy on yolov8n). Where a torch lacks it, the public context manager.
_inference_mode: Callable[[], Any] = (
    functools.partial(torch._C._InferenceMode, True) if hasattr(torch._C, "_InferenceMode")
    else torch.inference_mode)


_NO_REPLIES: tuple[ops_pb2.SessionDown, ...] = ()


def _new_bytes(p: PreparedCall, tensors: list[torch.Tensor], args: list[Any],
               kwargs: dict[str, Any], ints: list[tuple[list[Any], int]] | None = None) -> int:
    """Bytes prepared call ``p`` allocates with these tensors (``sizing``), kept per their
    sizes on the call: a replay pays no meta execution."""
    key: Any = p.size_key(tensors)
    if ints:  # the bytes it allocates may depend on them (``new_zeros([n, 4])``)
        key = (key, tuple(n for _, n in ints))
    need = p.sizes.get(key)
    if need is None:
        need = sizing.new_bytes(p.op, args, kwargs)
        if len(p.sizes) >= 16:
            p.sizes.clear()
        p.sizes[key] = need
    return need


_RETURN_ONE, _RETURN_LIST, _RETURN_TUPLE = 0, 1, 2
_RETURN_KINDS: dict[Any, int] = {}  # operator -> how it returns its tensors (``_answer``)


def _return_kind(op: Any) -> int:
    """One tensor, a list (``Tensor[]``) or a tuple of tensors, per operator once: its
    schema is a new Python object at every ``_schema``."""
    kind = _RETURN_KINDS.get(op)
    if kind is None:
        returns = op._schema.returns
        kind = _RETURN_KINDS[op] = (
            _RETURN_TUPLE if len(returns) != 1
            else _RETURN_LIST if str(returns[0].type) == "List[Tensor]" else _RETURN_ONE)
    return kind


def answerable(op: Any) -> bool:
    """Whether an answer to ``op``'s call can be built from its output tensors alone
    (``_answer``): one return, or only ``Tensor`` returns."""
    returns = op._schema.returns
    return len(returns) == 1 or all(str(r.type) == "Tensor" for r in returns)


def _answer(op: Any, outs: list[torch.Tensor], ids: list[int]) -> ops_pb2.OpResult:
    """The reply ``run_prepared`` with ``want_meta`` gives for a call that made ``outs``
    under ``ids`` (in order): their metadata and the returned value - the tensor, the list or
    the tuple of them, each by its id. Built in place: it is the reply to most answered calls
    of a detector's replay (~3.7 us against ~9 us through ``meta_of`` and ``encode_value``)."""
    reply = ops_pb2.OpResult(seq=0)
    for t in outs:
        codec.fill_meta(reply.outs.add(), t)
    value = reply.value
    kind = _return_kind(op)
    if kind == _RETURN_ONE:
        value.tensor.id = ids[0]
    else:
        items = value.list if kind == _RETURN_LIST else value.tuple
        items.SetInParent()  # an empty one still says which
        for i in ids:
            items.items.add().tensor.id = i
    return reply


# ``run_batch``'s answer hook: (call, its reply) after an answered call ran, (-1, None) when
# the time it asked for came during the run; returns when to be asked again (0/None: not).
OnAnswer = Callable[[int, ops_pb2.OpResult | None], float | None]


class _FixedUpload:
    """A definition's upload decoded once (``TorchExecutor.fixed_upload``): a native run takes
    a copy of it each inference (a clone, ~2 us, against ~22 us to decode the bytes)."""

    __slots__ = ("tensor", "need", "nbytes")

    def __init__(self, tensor: torch.Tensor, need: int, nbytes: int):
        self.tensor, self.need, self.nbytes = tensor, need, nbytes  # (admitted, sent)


class _Hooks:
    """What ``run_batch`` does around a run's calls for the replayer: copies of what the
    ``writes`` calls overwrite, taken just before each runs (``snapshots``: (call, token)),
    and the answers of the ``answered`` calls, given to ``on_answer`` as each ran."""

    __slots__ = ("batch", "out_ids", "writes", "answered", "on_answer", "snapshots", "copies",
                 "taken")

    def __init__(self, b: batch_.Batch, out_ids: list[int], writes: Sequence[int],
                 answered: Sequence[int],
                 on_answer: OnAnswer | None,
                 snapshots: list[tuple[int, Any]] | None):
        if (answered and on_answer is None) or (writes and snapshots is None):
            raise ValueError("answered calls need on_answer, written ones snapshots")
        self.batch, self.out_ids = b, out_ids
        self.writes = frozenset(writes)
        self.answered = frozenset(answered)
        self.on_answer = on_answer
        self.snapshots = snapshots
        # for the native loop: (call, hole) of each tensor to copy before its call
        self.copies = [(j, h) for j in sorted(self.writes) for h in b.written[j]]
        self.taken = 0  # snapshots appended by this run

    def keep(self, copied: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """The native loop's copies, as (call, tensor, copy)."""
        token: list[tuple[torch.Tensor, torch.Tensor]] = []
        for n, (j, t, copy) in enumerate(copied):
            token.append((t, copy))
            if n + 1 == len(copied) or copied[n + 1][0] != j:
                self._add(j, token)
                token = []

    def copy(self, j: int, tensors: list[torch.Tensor]) -> bool:
        """Before stepped call ``j``: copy what it writes, if it is one of ``writes``."""
        if j not in self.writes:
            return False
        with torch.inference_mode():  # as the operators ran (their tensors are inference ones)
            self._add(j, [(t, t.clone()) for h in self.batch.written[j]
                          if (t := tensors[h]) is not None])
        return True

    def drop_copy(self) -> None:
        """The call just copied for failed: what it may have written is written back, and
        nothing of it is kept (as where a native run stops)."""
        assert self.snapshots is not None
        _j, token = self.snapshots.pop()
        self.taken -= 1
        _restore(token)

    def _add(self, j: int, token: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        assert self.snapshots is not None
        self.snapshots.append((j, token))
        self.taken += 1

    def ran(self, j: int, made: list[torch.Tensor]) -> float | None:
        """Call ``j`` ran and made ``made``: the app waits for its answer? Returns what
        ``on_answer`` does: when to be asked again (``j = -1``: the run still goes and that
        time came), so that replies held for the stream are not held behind a long run."""
        if j < 0:
            return self.on_answer(-1, None)  # type: ignore[misc]
        if j in self.answered:
            b = self.batch
            return self.on_answer(j, _answer(b.calls[j].op, made,  # type: ignore[misc]
                                             self.out_ids[b.first[j]:b.first[j + 1]]))
        return None

    def undo(self) -> None:
        """Nothing of the run is kept: what its calls wrote in place is written back."""
        assert self.snapshots is not None or not self.taken
        for _ in range(self.taken):
            _j, token = self.snapshots.pop()  # type: ignore[union-attr]
            _restore(token)
        self.taken = 0


def _restore(token: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write copies back in place, so views of those tensors see the old values too."""
    with torch.inference_mode():
        for t, copy in token:
            t.copy_(copy)


class TorchExecutor:
    """Executes one session's frames. Not thread-safe by design: one worker thread drives it."""

    def __init__(self, ctx: ExecutorContext):
        self.ctx = ctx
        self.device = resolve_device(ctx.device)
        if self.device.type == "cuda":
            # The app computes float32 in float32 on its own device; so does its host (cuDNN
            # would otherwise run convolutions in TF32, with ~1e-3 relative error).
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        self.allow = Allowlist(ctx.allow_extra, ctx.deny)
        host = ctx.host_memory
        if host is not None:
            host.resolve(device_memory(self.device))
        self.store = TensorStore(ctx.memory_quota, host)
        self.blobs = ctx.blobs
        self.identity = ctx.identity  # whose view of the weight cache this session has
        self.session = ""
        self.versions = {"torch": torch.__version__}  # what this host runs (SessionReady)
        self.schemas = SchemaCheck({}, self.versions)  # the app's versions come with open
        self.poisoned: dict[int, str] = {}  # id -> why its value does not exist
        self._host_ids = itertools.count(HOST_ID_BASE)
        self.counters = {
            "ops": 0, "errors": 0, "fetches": 0, "bytes_up": 0, "bytes_down": 0,
            "blob_puts": 0, "blob_hits": 0,
            # replayed calls the native loop ran (``batch``), in how many runs, how many of
            # those calibrated (their calls one at a time: new sizes), how many bounded
            "native_calls": 0, "native_runs": 0, "native_calibrations": 0, "bounded_runs": 0,
        }
        self._closed = False

    # -- contract (rrtod.executor.Executor) ---------------------------------------------------
    # Both optional capabilities are implemented by the executor itself (properties, not
    # ``self`` stored in an attribute: no reference cycle keeps a closed session's object alive).
    @property
    def replay(self) -> TorchExecutor:
        """Its ``ReplayExtension``: ``prepare``/``run_prepared``, ``written_ids``,
        ``snapshot``/``restore`` below."""
        return self

    @property
    def reply_memory(self) -> TorchExecutor:
        """Its ``ReplyMemory``: ``charge_reply``/``refund_reply`` below."""
        return self

    def open(self, request: ops_pb2.SessionOpen) -> ops_pb2.SessionReady:
        if request.memory_quota > 0:  # an app may ask for less than the host allows, not more
            self.store.quota = min(self.store.quota, request.memory_quota)
        self.session = uuid.uuid4().hex[:12]
        self.schemas = SchemaCheck(dict(request.versions), self.versions)
        return ops_pb2.SessionReady(session=self.session, device=str(self.device),
                                    versions=self.versions)

    def handle(self, frame: ops_pb2.SessionUp) -> Iterator[ops_pb2.SessionDown]:
        kind = frame.WhichOneof("msg")
        try:
            if kind == "call":
                return self._call(frame.call)
            if kind == "fetch":
                return self._fetch(frame.fetch)
            if kind == "release":
                self._release(released_ids(frame.release))
                return iter(())
            if kind == "blob":
                return self._blob_put(frame.blob)
            if kind == "query":
                return self._query(frame.query)
            if kind == "close":
                self.close()
                return iter(())
            if kind == "open":
                return self._error("BAD_FRAME", "session is already open", 0)
            return self._error("BAD_FRAME", "empty SessionUp frame", 0)
        except codec.CodecError as exc:  # a value the frame describes that is not valid
            return self._error("BAD_FRAME", str(exc), frame.call.seq if kind == "call" else 0)
        except Exception as exc:  # a bug must not take the session's worker thread down
            return self._error("INTERNAL", f"{type(exc).__name__}: {exc}", 0)

    def stats(self) -> dict[str, int]:
        return {
            **self.counters,
            "bytes_live": self.store.bytes_live,
            "bytes_peak": self.store.peak,
            "tensors": len(self.store),
            "memory_quota": self.store.quota,
            "bytes_queued": self.store.queued,
            "schema_mismatches": len(self.schemas.refused),
        }

    # -- ReplyMemory: replies queued for the client (rrtod/gpu/service.py Outbox) ---------------
    def charge_reply(self, nbytes: int) -> str | None:
        """A reply of ``nbytes`` waits to be sent: count it against the session's quota and
        the host's limit. The reason when there is no room (the client does not read)."""
        try:
            self.store.queue_reply(nbytes, f"a reply of {nbytes} bytes")
        except QuotaExceeded as exc:
            return str(exc)
        return None

    def refund_reply(self, nbytes: int) -> None:
        self.store.unqueue_reply(nbytes)

    # -- ReplayExtension (rrtod/gpu/replay.py; prepare/run_prepared further down) -------------
    def snapshot(self, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of live tensors a replayed call is about to overwrite in place (``relu_``
        on an earlier output, a running statistic). Unknown ids have nothing to protect."""
        with torch.inference_mode():  # as the operators ran (their tensors are inference ones)
            return [(t, t.clone()) for i in ids if (t := self.store.get(i)) is not None]

    def written_ids(self, call: ops_pb2.OpCall) -> list[int]:
        """Ids of the tensor arguments ``call`` writes in place, from its operator's schema
        (``Tensor(a!)``): running statistics of a batch norm in training mode are written but
        not returned, so its output ids do not show them. Raises ValueError (the sequence is
        refused) for an operator whose schema this session has not compared (``schemas``)."""
        self.schemas.require(call.op)
        try:
            op = self.allow.resolve(call.op)
        except OpNotAllowed:
            return []
        return aliasing.written_ids(op, call)

    def viewed_ids(self, call: ops_pb2.OpCall) -> list[int]:
        """Per output id of ``call``: the argument whose storage it shares, 0 for none
        (``aliasing.viewed_ids``); an operator that is not allowed shares nothing."""
        try:
            op = self.allow.resolve(call.op)
        except OpNotAllowed:
            return [0] * len(call.out_ids)
        return aliasing.viewed_ids(op, call)

    @staticmethod
    def rows(call: ops_pb2.OpCall, in_shapes: Any, out_shapes: Any) -> rows_.Rule | None:
        """ReplayExtension.rows: ``call`` as a local operator (``rows.rule``)."""
        return rows_.rule(call, in_shapes, out_shapes)

    def missing(self, ids: list[int]) -> list[int]:
        """Ids no live tensor has: a sequence reading one as its constant can never match."""
        return [i for i in ids if self.store.get(i) is None]

    def synchronize(self) -> None:
        """Wait for the device's queued work (a profiled replay times each call so)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shape(self, tid: int) -> tuple[int, ...] | None:
        """The live tensor's sizes (a replayed call's symbolic integers), None if not live."""
        t = self.store.get(tid)
        return None if t is None else tuple(t.shape)

    def dense_sizes(self, tid: int) -> tuple[int, ...] | None:
        """The live tensor's sizes if it is laid out as ``torch.empty`` of them would be
        (C-contiguous strides, offset 0), else None: the shim then makes its proxy from the
        sizes alone (``ReplaySizes``)."""
        t = self.store.get(tid)
        if t is None or t.storage_offset():
            return None
        shape = tuple(t.shape)
        return shape if t.stride() == codec.contiguous_strides(shape) else None

    def scalar(self, tid: int) -> int | None:
        """``int()`` of the live one-element tensor (a value the app read and passed on)."""
        t = self.store.get(tid)
        if t is None or t.numel() != 1 or t.is_complex():
            return None
        return int_of(t.item())

    def restore(self, token: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write the copies back in place, so views of those tensors see the old values too."""
        _restore(token)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.store.clear()
        self.poisoned.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- helpers -----------------------------------------------------------------------------
    def _error(self, code: str, message: str, seq: int) -> Iterator[ops_pb2.SessionDown]:
        self.counters["errors"] += 1
        yield ops_pb2.SessionDown(error=ops_pb2.Error(code=code, message=message, seq=seq))

    def _map_device(self, _name: str) -> torch.device:
        # The app names the device it believes in ("cpu", "cuda:0"); everything it forwards runs
        # on this host's device.
        return self.device

    def _live(self, tid: int, what: str) -> torch.Tensor:
        t = self.store.get(tid)
        if t is not None:
            return t
        if tid in self.poisoned:
            raise _Poisoned(self.poisoned[tid])
        raise CallFailed("UNKNOWN_TENSOR", f"{what}: tensor {tid} is not live in this session")

    def _tensor_from_ref(self, ref: ops_pb2.TensorRef, what: str) -> torch.Tensor:
        kind = ref.WhichOneof("ref")
        if kind == "id":
            return self._live(ref.id, what)
        if kind == "upload":
            need = codec.nbytes_of(ref.upload.meta)
            self.store.check(need, f"{what}: an upload of {ref.upload.meta.dtype}"
                                   f"{list(ref.upload.meta.shape)}")
            try:
                t = codec.from_tensor_data(ref.upload, self.device)
            except codec.CodecError as exc:
                raise CallFailed("BAD_FRAME", f"{what}: {exc}") from None
            self.counters["bytes_up"] += len(ref.upload.data)
        elif kind == "persistent":
            t = self._load_blob(ref.persistent, what)
        else:
            raise CallFailed("BAD_FRAME", f"{what}: empty tensor ref")
        if ref.bind_id:
            self.store.put_many([(ref.bind_id, t)], what)
        return t

    def fixed_upload(self, ref: ops_pb2.TensorRef) -> _FixedUpload | None:
        """A definition's upload decoded once for the native runs of every inference
        (``rrtod.executor.ReplayExtension``); None if it does not decode (the run then meets
        the ref, and the one-by-one path reports it)."""
        if ref.WhichOneof("ref") != "upload":
            return None
        try:
            return _FixedUpload(codec.from_tensor_data(ref.upload, self.device),
                                codec.nbytes_of(ref.upload.meta), len(ref.upload.data))
        except codec.CodecError:
            return None

    def _fresh(self, given: tuple[_FixedUpload, int], what: str) -> torch.Tensor:
        """This inference's copy of a fixed upload, admitted and bound (to ``bind_id`` if not
        0) as ``_tensor_from_ref`` admits and binds the upload it was decoded from."""
        fixed, bind_id = given
        t = fixed.tensor
        self.store.check(fixed.need, f"{what}: an upload of {t.dtype}{list(t.shape)}")
        t = t.clone()  # the same layout (the decoded upload's strides), a normal tensor as well
        self.counters["bytes_up"] += fixed.nbytes
        if bind_id:
            self.store.put_many([(bind_id, t)], what)
        return t

    def _load_blob(self, key: bytes, what: str) -> torch.Tensor:
        t = self.store.pop(("blob", key))  # prefetched by a query or put in this session
        if t is not None:
            return t
        data = self.blobs.get(key, self.identity)
        if data is None:
            raise CallFailed("BLOB_MISSING", f"{what}: persistent tensor {key.hex()} is not in "
                                             "the host's weight cache (upload it first)")
        self.store.check(codec.nbytes_of(data.meta), f"{what}: persistent tensor {key.hex()}")
        self.counters["blob_hits"] += 1
        return codec.from_tensor_data(data, self.device)

    # -- frames ------------------------------------------------------------------------------
    def _call(self, call: ops_pb2.OpCall) -> Iterator[ops_pb2.SessionDown]:
        what = f"{call.op} (call {call.seq})"

        def decode() -> tuple[Any, list[Any], dict[str, Any]]:
            op = self.allow.resolve(call.op)
            if call.schema or call.op in self.schemas.refused:
                self.schemas.check(call.op, op, call.schema)
            args = [codec.decode_value(v, lambda r: self._tensor_from_ref(r, what),
                                       self._map_device) for v in call.args]
            kwargs = {k: codec.decode_value(v, lambda r: self._tensor_from_ref(r, what),
                                            self._map_device) for k, v in call.kwargs.items()}
            return op, args, kwargs, sizing.new_bytes(op, args, kwargs), True

        counts = not (call.op == BIND_OP and call.args[0].tensor.HasField("persistent"))
        return self._execute(decode, what, [_layout(m) for m in call.out_meta], list(call.out_ids),
                             call.seq, call.sync, call.want_meta, counts)

    # -- replay fast path (rrtod/gpu/replay.py) ----------------------------------------------
    def prepare(self, call: ops_pb2.OpCall) -> PreparedCall:
        """``call`` decoded once for replay: a replayed inference then only fills in its
        tensors (``run_prepared``) instead of decoding a protobuf call per operator. Raises
        OpNotAllowed / CodecError like forwarding would; the replayer then keeps the slow path,
        which reports the error at replay time."""
        return PreparedCall(self.allow.resolve(call.op), call, self._map_device)

    def run_prepared(self, p: PreparedCall, refs: list[int | ops_pb2.TensorRef],
                     out_ids: list[int], ints: list[tuple[list[Any], int]] | None = None,
                     want_meta: bool = False) -> Iterator[ops_pb2.SessionDown]:
        """Run a prepared call with this inference's tensors: ``refs`` per tensor argument
        (in ``iter_tensor_refs`` order), a live id or a ref to resolve; ``out_ids`` as
        rebound; ``ints``, this inference's symbolic integers. Same semantics as forwarding
        the rebound call with those integers (errors, poison, quota, ``want_meta``)."""
        if p.plain and ints is None and not want_meta and self._run_plain(p, refs, out_ids):
            return _NO_REPLIES
        what = p.what

        def decode() -> tuple[Any, list[Any], dict[str, Any], int, bool]:
            tensors = [self._live(r, what) if type(r) is int else self._tensor_from_ref(r, what)
                       for r in refs]
            args, kwargs = p.fill(tensors, ints)
            return p.op, args, kwargs, _new_bytes(p, tensors, args, kwargs, ints), p.written

        return self._execute(decode, what, p.layouts, out_ids, 0, False, want_meta, p.counts)

    def batchable(self, prepared: Any, answered: bool = False) -> bool:
        """Whether a prepared call can be part of a native run (``batch.batchable``); one the
        app waits for the answer of only where the answer can be built from its outputs."""
        mod = native.module()
        return mod is not None and batch_.batchable(prepared, mod) \
            and (not answered or answerable(prepared.op))

    def batch(self, prepared: list[Any], sources: list[list[int]], externals: int) -> Any:
        """A run of prepared calls built into the native loop (``batch.Batch``), or None where
        the loop is not built or a call is not ``batchable``: per call, per tensor argument,
        its source (``e >= 0``: external tensor ``e``; ``-(v + 1)``: the run's ``v``-th
        value, its calls' outputs in order)."""
        mod = native.module()
        if mod is None or not all(batch_.batchable(p, mod) for p in prepared):
            return None
        try:
            return batch_.Batch(mod, prepared, sources, externals)
        except (ValueError, RuntimeError, TypeError):  # an argument the loop cannot hold
            return None

    def run_batch(self, b: batch_.Batch,
                  externals: Sequence[int | ops_pb2.TensorRef | tuple[_FixedUpload, int]],
                  out_ids: list[int],
                  drops: Sequence[tuple[int, int]] = (), writes: Sequence[int] = (),
                  answered: Sequence[int] = (),
                  on_answer: OnAnswer | None = None,
                  snapshots: list[tuple[int, Any]] | None = None) -> int:
        """Run a batch with these external tensors (live ids, or refs to resolve as
        ``run_prepared`` resolves them: an upload is decoded, and bound if it names an id; or
        a ``fixed_upload`` with its bind id, copied and bound the same),
        its values stored under ``out_ids``: how many of its calls ran (in order; the caller
        runs the rest one by one). Calibrated, one native call after admitting what the
        calibrating run allocated; else, and from where a calibrated run met other sizes than
        its own, *stepped*: each call admitted what it allocates for its sizes (``sizing``)
        and run on its own (``batch``).
        ``drops``: (call, value) pairs, in call order, of values let go of once that call ran
        (never stored). ``writes``: calls, in order, whose in-place writes an abort may have
        to undo: what they write is copied just before they run, appended to ``snapshots`` as
        (call, ``snapshot`` token). ``answered``: calls, in order, whose result the app waits
        for: ``on_answer(call, result)`` right after each ran, as ``run_prepared`` with
        ``want_meta`` would reply. ``on_answer`` may return when it wants to be asked again
        (``time.monotonic``; 0 or None: not): if the run still goes then, it is called as
        ``on_answer(-1, None)`` between two calls (replies held for the stream go out)."""
        get = self.store.get
        try:
            tensors = [get(i) if type(i) is int
                       else self._fresh(i, b.what) if type(i) is tuple
                       else self._tensor_from_ref(i, b.what)
                       for i in externals]
        except (CallFailed, QuotaExceeded):  # the one-by-one path says what went wrong
            return 0
        if any(t is None for t in tensors):
            return 0  # released or poisoned: the Python path says so
        hooks = _Hooks(b, out_ids, writes, answered, on_answer, snapshots)
        admitted, done, outs = 0, 0, []
        tried = b.loop.calibrated() and not b.varies
        if tried:
            try:
                admitted, done, outs = self._run_loop(b, b.total, tensors, drops, hooks,
                                                      answered)
            except QuotaExceeded:
                return 0
        elif b.varies and BOUNDED_RUNS:
            try:
                admitted, done, outs = self._run_loop(b, sum(b.caps), tensors, drops, hooks,
                                                      answered, b.caps)
            except QuotaExceeded:
                pass  # more than the quota leaves: stepped, each call for its own sizes
            else:
                if done:
                    self.counters["bounded_runs"] += 1
        if done < len(b.calls):
            # A calibrated run met other sizes: within (or a failing call), or in its external
            # tensors, when it ran nothing (Mask R-CNN's mask head and paste loop: each frame
            # its own number of boxes, every run stepped ~100 times in 30 frames, 4 s of the
            # host's CPU, until that too made them bounded)
            stopped = tried
            stepped, done, outs = self._step(b, tensors, drops, done, outs, hooks)
            admitted += stepped
            if done == len(b.calls):
                b.varies = b.varies or stopped
                b.loop.calibrate(tensors)
                b.total = sum(b.needs)
            self.counters["native_calibrations"] += 1
        if done:
            try:
                self.store.put_many([(i, t) for i, t in zip(out_ids, outs, strict=False)
                                     if t is not None], b.what, admitted=admitted)
            except QuotaExceeded:  # nothing stored: the calls run again, one by one
                hooks.undo()
                return 0
            self.counters["ops"] += done
            self.counters["native_calls"] += done
            self.counters["native_runs"] += 1
        elif admitted:
            self.store.cancel(admitted)
        return done

    def _run_loop(self, b: batch_.Batch, need: int, tensors: list[torch.Tensor],
                  drops: Sequence[tuple[int, int]], hooks: _Hooks, answered: Sequence[int],
                  caps: list[int] | None = None) -> tuple[int, int, list[torch.Tensor | None]]:
        """One native call of the batch, ``need`` bytes admitted first (QuotaExceeded, with
        nothing run); calibrated, or bounded by ``caps``: (bytes admitted, calls run, values).
        Nothing stays admitted where not even its first call ran (sizes the run has not seen,
        a first call over its cap, or one that failed)."""
        self.store.admit(need, b.what)
        done, outs, copied = b.loop.run(tensors, drops, hooks.copies, list(answered),
                                        hooks.ran if answered else None, caps or [])
        hooks.keep(copied)
        if not outs:
            self.store.cancel(need)
            return 0, 0, []
        return need, done, outs

    def _step(self, b: batch_.Batch, externals: list[torch.Tensor],
              drops: Sequence[tuple[int, int]], start: int, outs: list[torch.Tensor | None],
              hooks: _Hooks) -> tuple[int, int, list[torch.Tensor | None]]:
        """The batch's calls from ``start`` on, one at a time, each admitted what it allocates
        for these sizes before it runs (``Batch.needs``): the bytes admitted, the calls run
        (from the first) and the values they made."""
        admitted = 0
        done = start
        dropping = iter([d for d in drops if d[0] >= start])
        drop = next(dropping, None)
        due = 0.0  # as the native loop asks ``on_answer`` again (``hostloop.cpp``: ``run``)
        for j in range(start, len(b.calls)):
            if due and time.monotonic() >= due:
                due = hooks.ran(-1, []) or 0.0  # (None: nothing held either)
            p = b.calls[j]
            tensors = [externals[s] if s >= 0 else outs[-s - 1] for s in b.sources[j]]
            if any(t is None for t in tensors):
                break  # a value dropped too early: the one-by-one path reports it
            try:
                # the arguments only where these sizes are new (the native call has its own)
                need = p.sizes.get(p.size_key(tensors))  # type: ignore[arg-type]
                if need is None:
                    args, kwargs = p.fill(tensors)  # type: ignore[arg-type]
                    need = _new_bytes(p, tensors, args, kwargs)  # type: ignore[arg-type]
                self.store.admit(need, p.what)
            except (sizing.Unsizable, sizing.MetaFailed, QuotaExceeded):
                break
            copied = hooks.copy(j, tensors)
            made = b.loop.step(j, tensors)
            if made is None:
                self.store.cancel(need)
                if copied:
                    hooks.drop_copy()
                break
            b.needs[j] = need
            if need > b.caps[j]:
                b.caps[j] = need
            admitted += need
            outs.extend(made)
            done += 1
            asked = hooks.ran(j, made)
            if asked is not None:
                due = asked
            while drop is not None and drop[0] <= j:
                if drop[1] < len(outs):
                    outs[drop[1]] = None
                drop = next(dropping, None)
        return admitted, done, outs

    def _run_plain(self, p: PreparedCall, refs: list[int | ops_pb2.TensorRef],
                   out_ids: list[int]) -> bool:
        """``run_prepared`` for the call most replayed calls are (``PreparedCall.plain``: one
        tensor out, nothing written) whose tensors are all live and whose bytes are known
        from an earlier replay of the same sizes: the same checks - memory admitted before
        it runs, the output's bounds, its layout, the quota - without the general path's
        decoding and error mapping (5-6 us of Python a call less on yolov8n: ``bench.hostloop``).
        False, with nothing stored or charged, where anything is not so: the general path
        then runs the call (again: it writes nothing) and reports what went wrong."""
        if len(out_ids) != 1:
            return False
        get = self.store.get
        tensors: list[torch.Tensor] = []
        for r in refs:
            t = get(r) if type(r) is int else None
            if t is None:
                return False
            tensors.append(t)
        args, kwargs = p.fill(tensors)
        need = p.sizes.get(p.size_key(tensors))
        if need is None:  # sizes this call has not had (a count that follows the data)
            try:
                need = _new_bytes(p, tensors, args, kwargs)
            except (sizing.Unsizable, sizing.MetaFailed):
                return False
        store, what = self.store, p.what
        try:
            store.admit(need, what)
        except QuotaExceeded:
            return False
        try:
            with _inference_mode():
                out = p.op(*args, **kwargs)
            if type(out) is not torch.Tensor:
                raise TypeError(type(out).__name__)
            check_view(out, what)
            out = _conform(out, p.layouts[0])
        except Exception:  # noqa: BLE001 - the general path runs it again and says what
            store.cancel(need)
            return False
        try:
            store.put_many([(out_ids[0], out)], what, admitted=need)
        except QuotaExceeded:  # the reservation ended with it
            return False
        if p.counts:
            self.counters["ops"] += 1
        return True

    def run_rows(self, p: PreparedCall, refs: list[int | ops_pb2.TensorRef], out_ids: list[int],
                 how: rows_.Rule, starts: list[int | None], lo: int, hi: int
                 ) -> Iterator[ops_pb2.SessionDown]:
        """Rows ``[lo, hi)`` of a prepared call's outputs (``rows.run``), from its tensors as
        ``run_prepared`` takes them, each with rows holding them from ``starts`` on (this
        host's bands of a split region's values, ``rrtod.lop``). Checked, admitted and kept
        as any call's outputs, in the band's own layout."""
        what = p.what

        def decode() -> tuple[Any, list[Any], dict[str, Any], int, bool]:
            tensors = [self._live(r, what) if type(r) is int else self._tensor_from_ref(r, what)
                       for r in refs]
            args, kwargs = p.fill(tensors)
            held = {id(t): start for t, start in zip(tensors, starts, strict=True)
                    if start is not None}
            # a bound: the whole outputs at 8 bytes an element, and a padded copy of the input
            need = sum(8 * math.prod(shape) for shape, _ in p.layouts) + max(
                (t.numel() * t.element_size() for t in tensors), default=0)

            def band(*a: Any, **kw: Any) -> Any:
                return rows_.run(p.op, list(a), kw, how, held, lo, hi)
            return band, args, kwargs, need, p.written

        return self._execute(decode, what, [], out_ids, 0, False, False, False)

    def _execute(self, decode: Any, what: str, layouts: list[Layout], ids: list[int], seq: int,
                 sync: bool, want_meta: bool, counts: bool) -> Iterator[ops_pb2.SessionDown]:
        """Run one operator call: ``decode()`` gives (operator, args, kwargs, the bytes it
        allocates, whether it writes arguments in place). Those bytes are admitted before it
        runs; its outputs are checked to stay inside their storages and kept under ``ids`` in
        the recorded ``layouts``. Errors poison the outputs and become a SessionDown(error)."""
        admitted = 0
        try:
            op, args, kwargs, need, writes = decode()
            self.store.admit(need, what)
            admitted = need
            with _inference_mode():
                result = op(*args, **kwargs)
            outs: list[torch.Tensor] = []
            sizing.flatten_tensors(result, outs)
            for t in outs:
                check_view(t, what)
            if writes:  # in place: sizes and strides of its arguments may have changed too
                for t in _written_tensors(op, args, kwargs):
                    check_view(t, what)
            if layouts and len(layouts) == len(outs):
                conformed = [_conform(t, lay) for t, lay in zip(outs, layouts, strict=True)]
                if any(a is not b for a, b in zip(conformed, outs, strict=True)):
                    result = _rebuild(result, dict(zip(map(id, outs), conformed, strict=True)))
                    outs = conformed
            if len(ids) < len(outs):
                if not want_meta:
                    raise CallFailed("BAD_FRAME", f"{what}: {len(outs)} tensor outputs but "
                                                  f"{len(ids)} output ids")
                ids = ids + [next(self._host_ids) for _ in range(len(outs) - len(ids))]
            admitted = 0  # put_many ends the reservation, whether it stores or refuses
            self.store.put_many(list(zip(ids, outs, strict=False)), what, admitted=need)
        except BadView as exc:
            return self._fail(ids + self._bad_views(exc.tensor), seq, "BAD_VIEW", str(exc))
        except OpNotAllowed as exc:
            return self._fail(ids, seq, "OP_NOT_ALLOWED", str(exc))
        except SchemaMismatch as exc:
            return self._fail(ids, seq, "SCHEMA_MISMATCH", str(exc))
        except QuotaExceeded as exc:
            return self._fail(ids, seq, "QUOTA_EXCEEDED", str(exc))
        except CallFailed as exc:
            return self._fail(ids, seq, exc.code, str(exc))
        except codec.CodecError as exc:
            return self._fail(ids, seq, "BAD_FRAME", f"{what}: {exc}")
        except _Poisoned as exc:
            for i in ids:
                self.poisoned[i] = exc.cause
            if sync or want_meta:
                return self._error("POISONED", exc.cause, seq)
            return iter(())
        except sizing.Unsizable as exc:
            return self._fail(ids, seq, "OP_NOT_ALLOWED", f"{what}: {exc}")
        except sizing.MetaFailed as exc:
            return self._fail(ids, seq, "OP_FAILED", f"{what}: {exc}")
        except Exception as exc:  # the operator itself raised (bad shapes, dtype, OOM)
            if self.device.type == "cuda" and isinstance(exc, torch.OutOfMemoryError):
                return self._fail(ids, seq, "QUOTA_EXCEEDED", f"{what}: device out of memory")
            return self._fail(ids, seq, "OP_FAILED", f"{what}: {type(exc).__name__}: {exc}")
        finally:
            if admitted:  # an error path above that did not end the reservation
                self.store.cancel(admitted)
        if counts:
            self.counters["ops"] += 1  # a weight's bind is bookkeeping, not an operator
        if not (sync or want_meta or _has_non_tensor(result)):
            return iter(())
        reply = ops_pb2.OpResult(seq=seq)
        if want_meta:
            for t in outs:
                reply.outs.append(codec.meta_of(t))
        if want_meta or _has_non_tensor(result):
            id_of = {id(t): i for i, t in zip(ids, outs, strict=False)}
            codec.encode_value(result, reply.value,
                               lambda t: ops_pb2.TensorRef(id=id_of[id(t)]))
        return iter((ops_pb2.SessionDown(result=reply),))

    def _bad_views(self, t: torch.Tensor | None) -> list[int]:
        """Ids under which the session stores the tensor that became an out-of-bounds view
        (an in-place ``as_strided_`` on a live tensor): it is dropped with the outputs."""
        if t is None:
            return []
        return [k for k in self.store.keys_of(t) if isinstance(k, int)]

    def _fail(self, out_ids: list[int], seq: int, code: str,
              message: str) -> Iterator[ops_pb2.SessionDown]:
        cause = f"{code}: {message}"
        for i in out_ids:
            self.store.pop(i)
            self.poisoned[i] = cause
        if len(self.poisoned) > 100_000:  # bound the memory a failing client can make us hold
            for k in list(itertools.islice(self.poisoned, 50_000)):
                del self.poisoned[k]
        return self._error(code, message, seq)

    def _fetch(self, fetch: ops_pb2.Fetch) -> Iterator[ops_pb2.SessionDown]:
        t = self.store.get(fetch.id)
        if t is None:
            if fetch.id in self.poisoned:
                return self._error("POISONED", f"tensor {fetch.id} has no value: "
                                   f"{self.poisoned[fetch.id]}", fetch.seq)
            return self._error("UNKNOWN_TENSOR", f"tensor {fetch.id} is not live in this session",
                               fetch.seq)
        data = codec.tensor_data(t, code_ints=True)  # (a class map: a byte an element)
        self.counters["fetches"] += 1
        self.counters["bytes_down"] += len(data.data) + len(data.palette)
        return iter((ops_pb2.SessionDown(fetched=ops_pb2.Fetched(seq=fetch.seq, tensor=data)),))

    def _release(self, ids: Any) -> None:
        for i in ids:
            self.store.pop(i)
            self.poisoned.pop(i, None)

    release = _release  # ReplayExtension.release: a replay frees values after their last use

    def _blob_put(self, put: ops_pb2.BlobPut) -> Iterator[ops_pb2.SessionDown]:
        key = bytes(put.hash)
        if hash_of(put.tensor) != key:
            return self._error("BLOB_INVALID", f"blob {key.hex()} does not match its content hash",
                               0)
        try:
            self.store.check(codec.nbytes_of(put.tensor.meta), f"persistent tensor {key.hex()}")
            t = codec.from_tensor_data(put.tensor, self.device)
        except QuotaExceeded as exc:
            return self._error("QUOTA_EXCEEDED", str(exc), 0)
        except codec.CodecError as exc:
            return self._error("BAD_FRAME", f"blob {key.hex()}: {exc}", 0)
        self.counters["blob_puts"] += 1
        self.counters["bytes_up"] += len(put.tensor.data)
        self.store.put(("blob", key), t)
        try:
            self.blobs.put(key, put.tensor, self.identity)
        except BlobError:
            pass  # too big for the cache: the session keeps its own copy
        return iter(())

    def _query(self, query: ops_pb2.BlobQuery) -> Iterator[ops_pb2.SessionDown]:
        missing = []
        for key in dict.fromkeys(bytes(h) for h in query.hashes):
            if ("blob", key) in self.store:
                continue
            data = self.blobs.get(key, self.identity)
            if data is None:
                missing.append(key)
                continue
            # Load now: the cache may evict it before the first call binds it.
            try:
                self.store.check(codec.nbytes_of(data.meta), "prefetch")
            except QuotaExceeded:
                continue  # loaded from disk again at bind time
            self.store.put(("blob", key), codec.from_tensor_data(data, self.device))
            self.counters["blob_hits"] += 1
        return iter((ops_pb2.SessionDown(query=ops_pb2.BlobQueryReply(missing=missing)),))
