"""The app side of one offloading session: forwards operators on proxies to the host.

``RemoteSession.dispatch`` is called from ``RemoteTensor.__torch_dispatch__`` in whatever thread
the app runs. It infers the outputs' metadata (meta execution, cached per operator and argument
signature; a synchronous round trip for data-dependent shapes), encodes the call with tensors as
refs (proxies by id, persistent tensors by content hash at first use, local tensors as uploads),
and returns proxies at once. In ``stream`` mode nothing waits but downloads; an error the host
reports for a streamed call is raised at the next download. In ``sync`` mode every call waits for
the host's acknowledgement (Cricket semantics).
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import weakref
from time import thread_time_ns
from typing import Any

import torch
import torch.utils._mode_utils
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from rrto.v1 import ops_pb2
from rrtod.shim.channel import Channel
from rrtod.wire import BIND_OP, content_hash, release_of

from . import codec
from .errors import HostLost, OffloadError, RemoteOpError
from .proxy import Handle, RemoteTensor, new_proxy

try:  # record/replay builds on this client (plugins/torch/replay.py)
    from .replay import MISS, ReplayClient
except ImportError:  # a tree without it: plain forwarding
    MISS, ReplayClient = object(), None

_GRAD = {"inference": ops_pb2.INFERENCE_MODE, "no_grad": ops_pb2.NO_GRAD,
         "grad": ops_pb2.GRAD_ENABLED}
# Operators answered without the host: they only relabel a handle.
_LOCAL_ALIAS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default,
                torch.ops.aten.lift_fresh.default}


class _Dead:
    """The channel of a forked child: sends nothing."""

    def send(self, frames: list) -> None:
        raise OSError("no connection in a forked child")

    def mark(self, index: int, start_ns: int, end_ns: int) -> None:
        pass

    def flush_marks(self) -> None:
        pass


class _Waiter:
    __slots__ = ("event", "value", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def wait(self) -> Any:
        self.event.wait()
        if self.error is not None:
            raise self.error
        return self.value


class _OpInfo:
    """What the client needs to know about an operator, computed once per overload."""

    __slots__ = ("name", "value_op", "ret_alias", "writes", "probed", "local", "namespace",
                 "inplace_view", "alias_only", "func")

    def __init__(self, func: torch._ops.OpOverload):
        self.func = func  # held: the client's table is keyed by its id
        self.alias_only = func in _LOCAL_ALIAS
        schema = func._schema
        self.namespace = func.namespace
        self.name = f"{func.namespace}::{schema.name.split('::')[-1]}.{func._overloadname}"
        self.value_op = any(str(r.type) not in ("Tensor", "List[Tensor]", "Tensor[]",
                                                "Optional[Tensor]") for r in schema.returns)
        self.writes: list[tuple[int, str]] = []  # mutated arguments: (position, name)
        sets: dict[str, tuple[int, str]] = {}
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                self.writes.append((i, a.name))
                for s in a.alias_info.before_set:
                    sets[s] = (i, a.name)
        self.ret_alias: list[tuple[int, str] | None] = []
        for r in schema.returns:
            hit = None
            if r.alias_info is not None and r.alias_info.is_write and str(r.type) == "Tensor":
                for s in r.alias_info.before_set:
                    hit = sets.get(s, hit)
            self.ret_alias.append(hit)
        self.probed = False
        self.local = False
        self.inplace_view = torch.Tag.inplace_view in func.tags  # transpose_, unsqueeze_, ...


def _arg(args: tuple, kwargs: dict, pos: int, name: str) -> Any:
    return args[pos] if pos < len(args) else kwargs.get(name)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    shape, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
    size = 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True)) if all(shape) else 0
    base = torch.empty((offset + size,), dtype=t.dtype, device="meta")
    return base.as_strided(shape, stride, offset)


def _sig(x: Any) -> Any:
    """A hashable signature of an argument for the metadata cache."""
    if isinstance(x, torch.Tensor):
        return (x.dtype, tuple(x.shape), x.stride(), x.storage_offset(), x.device.type)
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_sig(v) for v in x))
    if isinstance(x, float) and x != x:
        return ("nan",)
    return x


class _Out:
    """Placeholder for the k-th tensor output in a cached result template."""

    __slots__ = ("k", "shape", "stride", "offset", "dtype")

    def __init__(self, k: int, t: torch.Tensor):
        self.k, self.shape, self.stride, self.offset, self.dtype = (
            k, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)


def _template(result: Any, outs: list[_Out]) -> Any:
    if isinstance(result, torch.Tensor):
        o = _Out(len(outs), result)
        outs.append(o)
        return o
    if isinstance(result, (list, tuple)):
        return type(result)(_template(r, outs) for r in result)
    return result


def restride(func: Any, args: tuple, kwargs: dict) -> None:
    """Apply an in-place view op (``transpose_``) to the proxy's own metadata, without
    dispatching: the host changed its tensor's layout, the app's wrapper must follow."""
    with torch.utils._mode_utils.no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _meta_like(x)
    if isinstance(x, torch.device):
        return torch.device("meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    return x


def _materialize(x: Any, handles: list, info: _OpInfo, args: tuple, kwargs: dict,
                 device: torch.device) -> Any:
    """The call's result: proxies for new outputs, the argument itself for in-place ones."""
    if isinstance(x, _Out):
        h = handles[x.k]
        if h is None:
            return _arg(args, kwargs, *info.ret_alias[x.k])
        return new_proxy(h, x.shape, x.stride, x.offset, x.dtype, device)
    if isinstance(x, (list, tuple)):
        return type(x)(_materialize(v, handles, info, args, kwargs, device) for v in x)
    return x


_SESSIONS: weakref.WeakSet[RemoteSession] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for session in list(_SESSIONS):
        session._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class RemoteSession:
    """Client state of one app session: ids, sequence numbers, waiters, errors, caches."""

    def __init__(self, channel: Channel, mode: str = "stream", fallback: str = "local",
                 replay: bool = True):
        self.channel = channel
        self.mode = mode
        self.fallback = fallback
        self.device = channel.device
        self.lost: str | None = None
        self.released: list[int] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._ids = itertools.count(1)
        self._waiters: dict[int, _Waiter] = {}
        self._query_waiters: collections.deque[_Waiter] = collections.deque()
        self._async_errors: collections.deque[ops_pb2.Error] = collections.deque()
        self._ops: dict[int, _OpInfo] = {}  # id(OpOverload) -> its info
        self._meta_cache: dict[Any, Any] = {}
        self._tls = threading.local()
        self._threads = itertools.count(0)
        self.counters = collections.Counter()
        # Told of every proxy the app reads (the interceptor ends inference marks with them).
        self.on_read: Any = None
        # Record/replay (plugins/torch/replay.py): sequences pushed by the robot daemon.
        self.replay = ReplayClient(self) if replay and ReplayClient is not None else None
        channel.start(self._on_down, self._on_lost)
        _SESSIONS.add(self)

    def _forked(self) -> None:
        """A forked child shares the parent's socket but not its reader thread or its session:
        it must never write to the connection. It continues like a session whose host is lost."""
        self.lost = "this process was forked from the offloading app; its session stays with the parent"
        self.channel = _Dead()

    # -- wire --------------------------------------------------------------------------------
    def _on_down(self, down: ops_pb2.SessionDown) -> None:
        kind = down.WhichOneof("msg")
        if kind == "fetched" and down.fetched.seq == 0 and self.replay is not None:
            self.replay.pushed(down.fetched)  # a replayed output, sent unasked
        elif kind == "sequence":
            if self.replay is not None:
                self.replay.define(down.sequence)
        elif kind in ("result", "fetched"):
            msg = getattr(down, kind)
            w = self._waiters.pop(msg.seq, None)
            if w is not None:
                w.value = msg
                w.event.set()
        elif kind == "query":
            if self._query_waiters:
                w = self._query_waiters.popleft()
                w.value = down.query
                w.event.set()
        elif kind == "error":
            err = down.error
            w = self._waiters.pop(err.seq, None) if err.seq else None
            if w is not None:
                w.error = RemoteOpError(err.code, err.message)
                w.event.set()
            else:
                self._async_errors.append(err)
                if err.sequence and self.replay is not None:
                    self.replay.failed(err.sequence)

    def _on_lost(self, reason: str) -> None:
        self.lost = reason
        waiters = list(self._waiters.values()) + list(self._query_waiters)
        self._waiters.clear()
        self._query_waiters.clear()
        for w in waiters:
            w.error = HostLost(reason)
            w.event.set()

    def _submit(self, up: ops_pb2.SessionUp, numbered: bool = False, wait: bool = False,
                query: bool = False) -> Any:
        """Send ``up`` (after any pending releases); wait for its reply when asked."""
        w = _Waiter() if (wait or query) else None
        with self._lock:
            if self.lost is not None:
                raise HostLost(self.lost)
            frames = []
            if self.released:
                ids, self.released = self.released, []
                frames.append(ops_pb2.SessionUp(release=release_of(ids)))
            if numbered:  # a call or fetch: number it in send order
                self._seq += 1
                getattr(up, up.WhichOneof("msg")).seq = self._seq
                if w is not None:
                    self._waiters[self._seq] = w
            if query:
                self._query_waiters.append(w)
            frames.append(up)
            try:
                self.channel.send(frames)
            except OSError as exc:
                self._on_lost(f"connection to rrtod lost: {exc}")
                raise HostLost(self.lost or str(exc)) from None
            self.counters["frames"] += len(frames)
        if w is None:
            return None
        self.counters["round_trips"] += 1  # the app waits for this reply
        return w.wait()

    def send_frames(self, frames: list[ops_pb2.SessionUp]) -> None:
        """Stream ``frames`` in order without waiting (after any pending releases)."""
        with self._lock:
            if self.lost is not None:
                raise HostLost(self.lost)
            if self.released:
                ids, self.released = self.released, []
                frames = [ops_pb2.SessionUp(release=release_of(ids)), *frames]
            if not frames:
                return
            try:
                self.channel.send(frames)
            except OSError as exc:
                self._on_lost(f"connection to rrtod lost: {exc}")
                raise HostLost(self.lost or str(exc)) from None
            self.counters["frames"] += len(frames)

    def release_now(self, at_least: int) -> None:
        """Send pending releases now, if there are ``at_least``: while the app waits for a
        replayed output, the host can free what the app dropped before it computes on (see
        rrtod/gpu/replay.py); a few releases are not worth a message of their own."""
        if len(self.released) >= at_least:
            self.send_frames([])

    def raise_async_errors(self) -> None:
        """Raise the first error the host reported for a streamed call, if any."""
        if self._async_errors:
            err = self._async_errors.popleft()
            self._async_errors.clear()
            raise RemoteOpError(err.code, err.message)

    def flush(self) -> None:
        """Wait until the host has executed everything sent so far; raise its errors."""
        if self.released or self.mode == "stream":
            self._submit(ops_pb2.SessionUp(query=ops_pb2.BlobQuery()), query=True)
        self.raise_async_errors()

    # -- persistent tensors ------------------------------------------------------------------
    def persist(self, tensors: list[torch.Tensor]) -> list[RemoteTensor]:
        """Proxies for persistent tensors: offered by content hash, uploaded only if missing."""
        hashes, datas = [], []
        for t in tensors:
            data = codec.tensor_data(t)
            datas.append(data)
            hashes.append(content_hash(data.meta.dtype, list(data.meta.shape), data.data))
        uniq = list(dict.fromkeys(hashes))
        if uniq:
            reply = self._submit(ops_pb2.SessionUp(query=ops_pb2.BlobQuery(hashes=uniq)),
                                 query=True)
            missing = set(reply.missing)
            sent = set()
            for h, data in zip(hashes, datas, strict=True):
                if h in missing and h not in sent:
                    sent.add(h)
                    self._submit(ops_pb2.SessionUp(blob=ops_pb2.BlobPut(hash=h, tensor=data)))
                    self.counters["blob_bytes_up"] += len(data.data)
            self.counters["blob_hits"] += len(uniq) - len(sent)
        out = []
        for t, h in zip(tensors, hashes, strict=True):
            handle = Handle(self, next(self._ids), hash=h, local=t.detach())
            out.append(RemoteTensor(handle, t.shape, t.stride(), t.storage_offset(), t.dtype,
                                    t.device, requires_grad=t.requires_grad))
        return out

    # -- downloads ---------------------------------------------------------------------------
    def download(self, proxy: RemoteTensor) -> torch.Tensor:
        """The value of ``proxy`` (an app's data read)."""
        value = self._download(proxy)
        if self.on_read is not None:
            self.on_read(proxy._rrto_handle.id)
        return value

    def _download(self, proxy: RemoteTensor) -> torch.Tensor:
        h = proxy._rrto_handle
        if not h.bound and h.local is not None:  # persistent, never used remotely: exact copy
            return self._shape_like(h.local, proxy)
        if self.lost is not None:
            raise HostLost(f"{self.lost}; the value of this tensor lived on the GPU host")
        if self.replay is not None and self.replay.is_replayed(h.id):
            data = self.replay.take(h.id)  # pushed by the host during replay: no round trip
            self.raise_async_errors()
            if data is not None:
                self.counters["bytes_down"] += len(data.data)
                return self._shape_like(codec.from_tensor_data(data), proxy)
            if self.lost is not None:
                raise HostLost(f"{self.lost}; the value of this tensor lived on the GPU host")
        fetch = ops_pb2.Fetch(id=h.id)
        reply = self._submit(ops_pb2.SessionUp(fetch=fetch), numbered=True, wait=True)
        self.raise_async_errors()
        self.counters["bytes_down"] += len(reply.tensor.data)
        t = codec.from_tensor_data(reply.tensor)
        return self._shape_like(t, proxy)

    @staticmethod
    def _shape_like(t: torch.Tensor, proxy: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if tuple(t.shape) != tuple(proxy.shape):
            t = t.reshape(proxy.shape)
        if t.stride() != proxy.stride() and t.numel() > 1:
            t = torch.empty_strided(proxy.shape, proxy.stride(), dtype=t.dtype).copy_(t)
        if proxy.requires_grad:
            t = t.requires_grad_(False)
        return t

    # -- dispatch ----------------------------------------------------------------------------
    def _thread(self) -> int:
        idx = getattr(self._tls, "idx", None)
        if idx is None:
            idx = self._tls.idx = next(self._threads)
        return idx

    def _info(self, func: Any) -> _OpInfo:
        # Keyed by id: an OpOverload hashes in Python, an int in C; the info holds the
        # OpOverload, so its id is never reused while the entry exists.
        info = self._ops.get(id(func))
        if info is None:
            info = self._ops[id(func)] = _OpInfo(func)
        return info

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        info = self._ops.get(id(func)) or self._info(func)
        if info.alias_only:
            src = args[0]
            return new_proxy(src._rrto_handle, src.shape, src.stride(), src.storage_offset(),
                             src.dtype, src.device)
        if self.lost is not None:
            return self._run_lost(func, args, kwargs)
        if info.local or (info.writes and self._writes_local(args, kwargs, info)):
            return self._run_local(func, args, kwargs, info)
        replay = self.replay
        if replay is not None and replay.sequences:
            # The shim's own cost per replayed operator (matching, proxies, input frames), as
            # this thread's CPU time: wall time would add what is not the shim's, the time this
            # thread is off the CPU (the daemons replaying on the same cores, the daemon woken
            # by the start frame taking the CPU of its writer).
            t0, planned = thread_time_ns(), replay.planning_ns
            result = replay.dispatch(func, args, kwargs, info, self._thread(),
                                     self._grad_mode(), self._build)
            if result is not MISS:
                if info.inplace_view:  # transpose_ and co. change the proxy's own layout
                    restride(func, args, kwargs)
                plan = replay.planning_ns - planned  # a step's first replay only
                self.counters["replay_shim_ns"] += thread_time_ns() - t0 - plan
                if plan:
                    self.counters["replay_plan_ns"] += plan
                return result
        if info.value_op:
            return self._forward(func, args, kwargs, info, None)
        return self._forward(func, args, kwargs, info, self.output_template(func, args, kwargs))

    @staticmethod
    def _writes_local(args: tuple, kwargs: dict, info: _OpInfo) -> bool:
        """Whether the operator writes into a plain local tensor (then it runs locally)."""
        for i, n in info.writes:
            target = _arg(args, kwargs, i, n)
            if isinstance(target, torch.Tensor) and not isinstance(target, RemoteTensor):
                return True
        return False

    def output_template(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """(result template, output metadata) for this call, cached per operator and argument
        signature; None when the output shapes depend on data (ask the host)."""
        key = (func, _sig(args), _sig(tuple(kwargs.items())) if kwargs else None)
        try:
            return self._meta_cache[key]
        except KeyError:
            pass
        template = self._infer(func, args, kwargs)
        if len(self._meta_cache) < 50_000:
            self._meta_cache[key] = template
        return template

    def _infer(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Output template from meta execution; None when the shapes depend on data."""
        margs = _to_meta(args)
        mkwargs = {k: _to_meta(v) for k, v in kwargs.items()}
        try:
            result = func(*margs, **mkwargs)
        except DynamicOutputShapeException:
            return None
        except Exception:  # no meta kernel, or an error the host will report verbatim
            self.counters["meta_fallbacks"] += 1
            return None
        outs: list[_Out] = []
        return (_template(result, outs), outs)

    def _app_device(self, args: tuple, kwargs: dict) -> torch.device:
        dev = kwargs.get("device")
        if isinstance(dev, torch.device):
            return dev
        for a in args:
            if isinstance(a, torch.Tensor):
                return a.device
            if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                return a[0].device
        return torch.device("cpu")

    def _grad_mode(self) -> int:
        if torch.is_inference_mode_enabled():
            return ops_pb2.INFERENCE_MODE
        return ops_pb2.GRAD_ENABLED if torch.is_grad_enabled() else ops_pb2.NO_GRAD

    def _encode_tensor(self, t: torch.Tensor, device: str | None = None) -> ops_pb2.TensorRef:
        if isinstance(t, RemoteTensor):
            h = t._rrto_handle
            if h.session is not self:
                raise OffloadError("WRONG_SESSION", "a tensor of another rrto session was used")
            if not h.bound:
                self._bind(h)
            return ops_pb2.TensorRef(id=h.id)
        data = self._upload_data(t, device)
        self.counters["bytes_up"] += len(data.data)
        return ops_pb2.TensorRef(upload=data)

    def _upload_data(self, t: torch.Tensor, device: str | None = None) -> ops_pb2.TensorData:
        """A local tensor's value as uploaded (not counted: the caller counts what it sends)."""
        if t.requires_grad or type(t) is not torch.Tensor:
            t = t.detach()
        return codec.tensor_data(t, device=device)

    def _bind(self, h: Handle) -> None:
        """First use of a persistent tensor: have the host bind the cached blob to its id.

        The bind must reach the host before any call that refers to the id, from any thread, so
        it is its own frame sent under the send lock (a bind-only ``aten::alias`` whose output
        is released at once), not a ref inside a call that another thread could overtake.
        """
        call = ops_pb2.OpCall(op=BIND_OP, args=[ops_pb2.Value(tensor=ops_pb2.TensorRef(
            persistent=h.hash, bind_id=h.id))], out_ids=[next(self._ids)])
        up = ops_pb2.SessionUp(call=call)
        with self._lock:
            if h.bound:
                return
            if self.lost is not None:
                raise HostLost(self.lost)
            self._seq += 1
            up.call.seq = self._seq
            try:
                self.channel.send([up])
            except OSError as exc:
                self._on_lost(f"connection to rrtod lost: {exc}")
                raise HostLost(self.lost or str(exc)) from None
            h.bound = True
            self.released.append(call.out_ids[0])

    def _forward(self, func: Any, args: tuple, kwargs: dict, info: _OpInfo, template: Any) -> Any:
        call = ops_pb2.OpCall(op=info.name, grad_mode=self._grad_mode(), thread=self._thread())
        try:
            for a in args:
                codec.encode_value(a, call.args.add(), self._encode_tensor)
            for k, v in kwargs.items():
                codec.encode_value(v, call.kwargs[k], self._encode_tensor)
        except codec.CodecError:
            return self._run_local(func, args, kwargs, info)
        device = self._app_device(args, kwargs)
        want = template is None
        probe = not info.probed
        if want:
            call.want_meta = True
        else:
            tmpl, outs = template
            handles: list[Handle | None] = []
            for k, o in enumerate(outs):
                alias = info.ret_alias[k] if k < len(info.ret_alias) and len(outs) == len(
                    info.ret_alias) else None
                target = _arg(args, kwargs, *alias) if alias else None
                if isinstance(target, RemoteTensor):
                    handles.append(None)
                    call.out_ids.append(target._rrto_handle.id)
                else:
                    h = Handle(self, next(self._ids))
                    handles.append(h)
                    call.out_ids.append(h.id)
                call.out_meta.add(dtype=codec.DTYPE_NAMES[o.dtype], shape=o.shape,
                                  stride=o.stride, storage_offset=o.offset, device=str(device))
        wait = want or probe or self.mode == "sync"
        call.sync = wait
        try:
            reply = self._submit(ops_pb2.SessionUp(call=call), numbered=True, wait=wait)
        except RemoteOpError as exc:
            if exc.code == "OP_NOT_ALLOWED" and (info.namespace != "aten"
                                                 or self.fallback == "local"):
                info.local = True
                return self._run_local(func, args, kwargs, info)
            raise
        info.probed = True
        self.counters["calls"] += 1
        if info.inplace_view:
            restride(func, args, kwargs)
        if want:
            return self._from_reply(reply, device)
        return self._build(tmpl, handles, outs, info, args, kwargs, device)

    def _build(self, tmpl: Any, handles: list, outs: list[_Out], info: _OpInfo, args: tuple,
               kwargs: dict, device: torch.device) -> Any:
        return _materialize(tmpl, handles, info, args, kwargs, device)

    def _from_reply(self, reply: ops_pb2.OpResult, device: torch.device) -> Any:
        metas = iter(reply.outs)

        def tensor(ref: ops_pb2.TensorRef) -> torch.Tensor:
            m = next(metas)
            return RemoteTensor(Handle(self, ref.id), tuple(m.shape), tuple(m.stride),
                                m.storage_offset, codec.dtype_of(m.dtype), device)
        return codec.decode_value(reply.value, tensor, torch.device)

    # -- local execution ---------------------------------------------------------------------
    def _run_local(self, func: Any, args: tuple, kwargs: dict, info: _OpInfo) -> Any:
        """Download the proxies, run ``func`` here, write mutated proxies back to the host."""
        self.counters["local_ops"] += 1
        real: dict[int, torch.Tensor] = {}
        largs = self._downloaded(args, real)
        lkwargs = {k: self._downloaded(v, real) for k, v in kwargs.items()}
        result = func(*largs, **lkwargs)
        for i, n in info.writes:  # keep the host's copy of a mutated proxy in step
            target = _arg(args, kwargs, i, n)
            if isinstance(target, RemoteTensor):
                self.dispatch(torch.ops.aten.copy_.default, (target, real[id(target)]), {})
        # Outputs that alias a mutated proxy are that proxy, as they would be locally.
        for k, alias in enumerate(info.ret_alias):
            if alias is not None and isinstance(_arg(args, kwargs, *alias), RemoteTensor):
                if isinstance(result, tuple):
                    result = result[:k] + (_arg(args, kwargs, *alias),) + result[k + 1:]
                else:
                    result = _arg(args, kwargs, *alias)
        return result

    def _run_lost(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The host is gone: persistent tensors still have their local copy; nothing else does."""
        if self.fallback != "local":
            raise HostLost(self.lost or "")
        return func(*self._local_copies(args, func), **{k: self._local_copies(v, func)
                                                          for k, v in kwargs.items()})

    # Recursive helpers are methods or module functions, never closures: a recursive closure is
    # a reference cycle that would keep the call's proxies (and the host's tensors) alive until
    # the cyclic garbage collector runs.
    def _downloaded(self, x: Any, real: dict[int, torch.Tensor]) -> Any:
        if isinstance(x, RemoteTensor):
            if id(x) not in real:
                real[id(x)] = self.download(x).clone()
            return real[id(x)]
        if isinstance(x, (list, tuple)):
            return type(x)(self._downloaded(v, real) for v in x)
        return x

    def _local_copies(self, x: Any, func: Any) -> Any:
        if isinstance(x, RemoteTensor):
            h = x._rrto_handle
            if h.local is None:
                raise HostLost(f"{self.lost}; the value of a tensor used by "
                               f"{func} lived on the GPU host")
            t = h.local
            return t if tuple(t.shape) == tuple(x.shape) else t.view(x.shape)
        if isinstance(x, (list, tuple)):
            return type(x)(self._local_copies(v, func) for v in x)
        return x
