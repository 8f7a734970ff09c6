"""The app side of one offloading session: forwards operators on proxies to the host.

``RemoteSession.dispatch`` is called from ``RemoteTensor.__torch_dispatch__`` in whatever thread
the app runs. It infers the outputs' metadata (``metadata.py``; a synchronous round trip for
data-dependent shapes), encodes the call with tensors as refs (proxies by id, persistent tensors
by content hash at first use, local tensors as uploads), and returns proxies at once. In
``stream`` mode nothing waits but downloads (``downloads.py``); an error the host reports for a
streamed call is raised at the next download. In ``sync`` mode every call waits for the host's
acknowledgement (Cricket semantics). Calls that replay answers (``replay.py``) or that run in
the app (``fallback.py``) leave from here too.

This module owns the session's state and its wire: ids, sequence numbers, the send lock, the
waiters for replies, releases and the loss of the connection. The parts around it use the
session only through ``session_api.Session``.
"""

from __future__ import annotations

import collections
import itertools
import os
import random
import sys
import threading
import time
import weakref
from collections.abc import Callable
from time import thread_time_ns
from typing import Any

import torch

from rrto.v1 import ops_pb2
from rrtod.shim.channel import Channel
from rrtod.switches import flag
from rrtod.wire import BIND_OP, HOST_ID_BASE, content_hash, release_of

from . import codec, downloads, hotpath
from .assignment import Assignment
from .errors import DeadlineMissed, HostLost, OffloadError, RemoteOpError
from .fallback import run_local, run_lost, writes_local
from .journal import Journal, Unrecoverable
from .lanes import Lanes
from .metadata import MetaCache, OpInfo, app_device, arg_at, materialize, restride
from .proxy import Handle, RemoteTensor, new_proxy
from .reconnect import Reconnect
from .replay import MISS, RELEASE_STREAM_AT, ReplayClient
from .schemas import schema_hash, schema_of

# Host refusals after which an operator runs in the app instead (``fallback: local``).
_REFUSED = ("OP_NOT_ALLOWED", "SCHEMA_MISMATCH")
# The share of replayed calls whose CPU time the shim measures (``RemoteSession._remote``):
# drawn at random, so no position of a repeating sequence is favoured.
TIMED_SHARE = 0.125
_sample = random.Random().random


class _Dead:
    """The channel of a forked child: sends nothing."""

    answers_marks = False

    def send(self, frames: list) -> None:
        raise OSError("no connection in a forked child")

    def mark(self, index: int, start_ns: int, end_ns: int, thread: int = 0,
             search_wait_us: int = 0, left_replay: bool = False) -> None:
        pass

    def flush_marks(self) -> None:
        pass

    def close(self) -> None:
        pass

    def reopen(self) -> Any:
        raise OSError("a forked child does not offload")


def _names(args: tuple, kwargs: dict, ids: set[int]) -> bool:
    """Whether a proxy among the arguments has its id in ``ids``."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, RemoteTensor):
            if a._rrto_handle.id in ids:
                return True
        elif isinstance(a, (list, tuple)) and _names(tuple(a), {}, ids):
            return True
    return False


def _never() -> bool:
    return False


def _host_ids(result: ops_pb2.OpResult) -> list[int]:
    """The ids the host gave the outputs of a ``want_meta`` call (to release a late one's)."""
    ids: list[int] = []
    codec.decode_value(result.value, lambda ref: ids.append(ref.id), torch.device)
    return [i for i in ids if i >= HOST_ID_BASE]


class _Waiter:
    __slots__ = ("event", "value", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def wait(self, at: int | None = None, give_up: Any = None) -> Any:
        """The reply; with ``at`` (CLOCK_MONOTONIC ns), ``DeadlineMissed`` if none came by
        then and ``give_up()`` says the app goes on without it."""
        if at is not None:
            left = (at - time.monotonic_ns()) / 1e9
            if not self.event.wait(max(left, 0.0)) and give_up():
                raise DeadlineMissed
        self.event.wait()
        if self.error is not None:
            raise self.error
        return self.value


_SESSIONS: weakref.WeakSet[RemoteSession] = weakref.WeakSet()


def _before_fork() -> None:
    for session in list(_SESSIONS):
        session._before_fork()


def _after_fork_in_child() -> None:
    for session in list(_SESSIONS):
        session._forked()


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


class RemoteSession:
    """Client state of one app session: ids, sequence numbers, waiters, errors, caches.
    Implements ``session_api.Session``."""

    def __init__(self, channel: Channel, mode: str = "stream", fallback: str = "local",
                 replay: bool = True, deadline_ms: float | None = None):
        self.channel = channel
        self.mode = mode
        self.fallback = fallback
        self.device = channel.device
        self.lost: str | None = None
        # Failover (docs/offloading.md "When the host is lost"): the calls of the open
        # inferences, the values rebuilt from them after a loss, and the connection number
        # (``epoch``: a proxy made under an earlier one names a value of a host now gone).
        self.journal = Journal()
        self.recovered: dict[int, torch.Tensor] = {}  # by proxy id, of every loss so far
        self._rebuild_due = False
        self._lost_at = 0
        self._recovery_lock = threading.Lock()
        self.epoch = 0
        self.stale_released: list[int] = []  # like ``released``, for earlier epochs' ids
        self._persistent: weakref.WeakSet[Handle] = weakref.WeakSet()
        self._replay_on = replay
        self._reconnect = Reconnect(self)
        # Deadlines: a thread whose inference passed it computes the rest here (``_late``);
        # proxies written here since are newer than the host's copy (``diverged``: sent as
        # their value, read from here); want_meta replies that come too late name host ids
        # to release.
        self.deadline_ns = int(deadline_ms * 1e6) if deadline_ms and fallback == "local" else 0
        self._late: set[int] = set()
        self.diverged: set[int] = set()
        self._late_replies: set[int] = set()
        self.released: list[int] = []
        # The calling thread's replay under way, told with each release frame it sends (set by
        # the replay client): how far the app has matched it (``Release.progress``).
        self.progress: Callable[[], ops_pb2.ReplayProgress | None] | None = None
        self._lock = threading.Lock()
        self._seq = 0
        self._ids = itertools.count(1)
        self._waiters: dict[int, _Waiter] = {}
        self._query_waiters: collections.deque[_Waiter] = collections.deque()
        self._async_errors: collections.deque[ops_pb2.Error] = collections.deque()
        self._ops: dict[int, OpInfo] = {}  # id(OpOverload) -> its info
        self.local_warned: set[str] = set()  # what warn_once warned about (operators, patterns)
        self._warn_lock = threading.Lock()
        self._tls = threading.local()
        # ``__setitem__`` calls under way whose value has leading ones (assignment.py), by thread
        self._assigning: dict[int, Assignment] = {}
        # Persistent tensors written on the host since the last fork (_note_writes), by id.
        self._written: weakref.WeakValueDictionary[int, Handle] = weakref.WeakValueDictionary()
        # The wire's thread index: a lane that app threads taking turns share (lanes.py)
        self.lanes = Lanes()
        self.counters: collections.Counter[str] = collections.Counter()
        self._metadata = MetaCache(self.counters)
        # Told of every proxy the app reads (the interceptor ends inference marks with them).
        self.on_read: Any = None
        self.in_forward: Callable[[], bool] = _never  # the interceptor's, once installed
        # Record/replay (replay.py): sequences pushed by the robot daemon.
        self.replay: ReplayClient | None = None
        self.hot: Callable[[Any, tuple], Any] | None = None  # the replay's hot path
        self._new_replay()
        channel.start(self._on_down, self._on_lost)
        _SESSIONS.add(self)

    def _new_replay(self) -> None:
        """A replay client with no sequences yet (at the start; a new host after a loss), and
        its hot path (``hotpath.py``: native where built, else Python; ``RRTO_HOT_PATH=0``
        leaves every call to the general path)."""
        self.replay = ReplayClient(self) if self._replay_on else None
        self.hot = None
        if self.replay is not None and flag("RRTO_HOT_PATH", True):
            self.hot = hotpath.make(self, self.replay, self.journal, _sample, TIMED_SHARE,
                                    RELEASE_STREAM_AT)

    def _note_writes(self, args: tuple, kwargs: dict, info: OpInfo) -> None:
        """A persistent tensor written in place on the host (``load_state_dict``, a fused or
        edited weight, an EMA step, a buffer the forward updates) no longer equals the app's
        copy of it, which is what a forked child or a lost host computes with."""
        for i, n in info.writes:
            t = arg_at(args, kwargs, i, n)
            if isinstance(t, RemoteTensor) and t._rrto_handle.local is not None:
                self._written[t._rrto_handle.id] = t._rrto_handle

    def local_is_current(self, handle: Handle) -> bool:
        return handle.local is not None and handle.id not in self._written

    def _before_fork(self) -> None:
        """In the parent, before ``fork``: bring the app's copies of the persistent tensors
        written on the host up to date (one fetch each), so that the child, which computes
        locally with them (``_forked``), computes what the parent would. A copy that cannot
        be fetched is dropped: the child then fails with HostLost, never computes with an old
        weight."""
        if self.lost is not None:
            return
        for h in list(self._written.values()):
            local = h.local
            if local is None:
                continue
            proxy = new_proxy(h, local.shape, local.stride(), 0, local.dtype, local.device)
            try:
                h.local = downloads.read_value(self, proxy)
            except Exception:  # the host is gone or refuses: no copy beats an old one
                h.local = None
        self._written.clear()

    def _forked(self) -> None:
        """A forked child shares the parent's socket but not its reader thread or its session:
        it must never write to the connection. It continues like a session whose host is lost."""
        self.lost = "this process was forked from the offloading app; its session stays with the parent"
        self.channel = _Dead()
        self._reconnect.stop()

    # -- wire --------------------------------------------------------------------------------
    def _on_down(self, down: ops_pb2.SessionDown) -> None:
        kind = down.WhichOneof("msg")
        if kind == "fetched" and down.fetched.seq == 0 and self.replay is not None:
            self.replay.pushed(down.fetched)  # a replayed output, sent unasked
        elif kind == "answer" and self.replay is not None:
            self.replay.answered(down.answer)  # a replayed call's reply, sent unasked
        elif kind == "sizes" and self.replay is not None:
            self.replay.sized(down.sizes)  # replayed outputs' sizes that follow the data
        elif kind == "sequence":
            if self.replay is not None:
                self.replay.define(down.sequence)
        elif kind == "search":
            if self.replay is not None:
                self.replay.search_hint(down.search)
        elif kind in ("result", "fetched"):
            msg = getattr(down, kind)
            w = self._waiters.pop(msg.seq, None)
            if w is not None:
                w.value = msg
                w.event.set()
            elif kind == "result" and msg.seq in self._late_replies:
                self._late_replies.discard(msg.seq)
                self.released.extend(_host_ids(msg))
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
            elif err.base_id and self.replay is not None:
                self.replay.broken(err)  # a replayed call the app may never make failed
            elif err.sequence and self.replay is not None:
                # The replay's, not an app call's (a start the host refused, an argument it
                # could not take): the sequence goes, and an inference the app began with it
                # is finished here (``ReplayClient.failed``). A crash while the host handled
                # a forwarded call is that call's: the app hears of that one; one while it
                # handled the replay's own frames (``in_replay``) is not.
                if err.code == "INTERNAL" and not err.in_replay:
                    self._async_errors.append(err)
                self.replay.failed(err.sequence)
            else:
                self._async_errors.append(err)

    def _on_lost(self, reason: str) -> None:
        if self.lost is not None:
            return
        self.lost = reason
        self._rebuild_due = True
        self._lost_at = time.monotonic_ns()
        self.counters["hosts_lost"] += 1
        for h in list(self._written.values()):  # their copies are older than the host's
            h.local = None
        waiters = list(self._waiters.values()) + list(self._query_waiters)
        self._waiters.clear()
        self._query_waiters.clear()
        for w in waiters:
            w.error = HostLost(reason)
            w.event.set()
        if self.replay is not None:
            self.replay.wake()

    # -- failover ----------------------------------------------------------------------------
    def value_after_loss(self, h: Handle) -> torch.Tensor | None:
        """A proxy's value once its host is gone: the app's copy of a persistent tensor, or
        the value the journal rebuilds here (once per loss, at the first need); None if
        neither has it."""
        if h.local is not None and (not h.split or h.local.shape[-2] == h.split):
            return h.local  # (not the first rows alone of a split value: ``rrtod.lop``)
        self._rebuild()
        return self.recovered.get(h.id)

    def _rebuild(self) -> None:
        """Once per loss: the values of the journal's calls, rebuilt here."""
        with self._recovery_lock:
            if self._rebuild_due:
                self._rebuild_due = False
                try:
                    self.recovered.update(self.journal.rebuild(set(self._written.keys()),
                                                               self.recovered))
                    self.counters["recoveries"] += 1
                    self.counters["recovered_calls"] += len(self.journal)
                except Unrecoverable as exc:
                    self.warn_once("unrecoverable", f"the GPU host was lost and the values of "
                                   f"this inference cannot be rebuilt here: {exc}")
                self.journal.clear()

    def inference_started(self) -> None:
        """A thread's outermost module call (the interceptor's): the journal's window moves;
        after a loss, rebuilt values the app dropped go, and the way back is tried."""
        self.lanes.begin()  # (a thread that has no lane takes one here: lanes.py)
        if self.replay is not None:
            self.replay.inference_started()
        if self.deadline_ns:
            self._tls.began = time.monotonic_ns()
        if self._late:  # a deadline missed, a replay finished here (``finish_here``)
            self._late.discard(self._thread())
        if self.lost is None and not self.recovered:
            self.journal.begin(self._thread())
            return
        if self.recovered:  # rebuilt values of proxies the app dropped since
            dropped, self.stale_released[:] = list(self.stale_released), []
            if self.lost is not None:  # (else ``released`` still goes to the host)
                dropped += self.released
                self.released[:] = []
            for i in dropped:
                self.recovered.pop(i, None)
        if self.lost is None:
            self.journal.begin(self._thread())
        elif self.fallback == "local":
            self._reconnect.poll()

    def inference_ended(self) -> None:
        """This thread's inference ended (the interceptor's mark: its outputs read). Its lane
        may go to the next thread that begins one, unless its replay is still under way."""
        replay = self.replay
        if replay is None or replay.active is None:
            self.lanes.end()

    def persistent_handles(self) -> list[Handle]:
        """The live persistent tensors' handles a new host must have (not those written
        here since the loss: their content no longer has their hash; they are sent as values)."""
        return [h for h in list(self._persistent) if h.id not in self.diverged]

    # -- deadlines ---------------------------------------------------------------------------
    def deadline_at(self) -> int | None:
        """When this thread's inference stops waiting for the host (CLOCK_MONOTONIC ns)."""
        began = getattr(self._tls, "began", None)
        if not self.deadline_ns or began is None:
            return None
        return began + self.deadline_ns

    def wait_slice(self, cap: float) -> float:
        """Seconds a wait may block before it looks at the deadline again."""
        at = self.deadline_at()
        return cap if at is None else min(cap, max(0.0, (at - time.monotonic_ns()) / 1e9))

    def is_late(self) -> bool:
        return bool(self._late) and self._thread() in self._late

    def past_deadline(self) -> bool:
        """Whether this thread's inference goes on here: its deadline passed and its values
        could be rebuilt (then its replay is abandoned); False to keep waiting."""
        at = self.deadline_at()
        if at is None or time.monotonic_ns() < at or self.lost is not None:
            return False
        return self.finish_here("deadline")

    def finish_here(self, why: str) -> bool:
        """This thread's inference goes on here from the values the journal rebuilds, its
        replay abandoned: its deadline passed (``why`` "deadline"), or the host refused or
        failed its replay without saying where ("replay": a start it refused, after the app
        had matched calls whose values it then never made). False if they cannot be rebuilt:
        the inference goes on with the host (always under ``fallback: error``)."""
        if self.lost is not None or self.fallback != "local":
            return False  # everything runs here already; or nothing may
        t = self._thread()
        if t in self._late:
            return True
        written = set(self._written.keys())
        try:  # this inference's calls; those of the one before if it reads their values
            values = self.journal.rebuild(written, self.recovered, thread=t)
        except Unrecoverable:
            try:
                values = self.journal.rebuild(written, self.recovered)
            except Unrecoverable as exc:
                if why == "deadline":
                    self._tls.began = None  # no deadline for the rest of this inference
                    self.warn_once("deadline", "an inference passed intercept.deadline_ms but "
                                   f"cannot be finished here ({exc}): it waits for the host")
                else:
                    self.warn_once("replay", "the GPU host could not replay an inference the "
                                   f"app had begun, and it cannot be finished here ({exc})")
                return False
        self.recovered.update(values)
        self._late.add(t)
        self.counters["deadline_misses" if why == "deadline" else "finished_here"] += 1
        if self.replay is not None:
            self.replay.abandon()
        return True

    def swap(self, channel: Channel) -> None:
        """Offload again, through ``channel`` (connected, its blobs offered; ``Reconnect``):
        a new epoch. Persistent tensors bind again at their next use; every other proxy the
        app still has is of the lost host, and is sent as its rebuilt value if it has one."""
        self._rebuild()  # the journal goes with the old epoch
        with self._lock:
            old = self.channel
            self.epoch += 1
            for h in self.persistent_handles():
                h.bound, h.epoch = False, self.epoch
            self.released = []
            self._seq = 0
            self._waiters.clear()
            self._query_waiters.clear()
            self._async_errors.clear()
            self._written.clear()
            for info in self._ops.values():
                info.probed = False  # the new host checks each operator's schema again
            self._new_replay()
            self.journal.clear()
            self.device = channel.device
            self.channel = channel
            self.lost = None
            self.counters["reconnects"] += 1
            self.counters["offline_ns"] += time.monotonic_ns() - self._lost_at
        try:
            old.close()
        except OSError:
            pass

    def submit(self, up: ops_pb2.SessionUp, numbered: bool = False, wait: bool = False,
               query: bool = False) -> Any:
        """Send ``up`` (after any pending releases); wait for its reply when asked."""
        w = _Waiter() if (wait or query) else None
        seq = 0
        with self._lock:
            if self.lost is not None:
                raise HostLost(self.lost)
            frames = []
            if self.released:
                ids, self.released = self.released, []
                frames.append(self._release_frame(ids))
            if numbered:  # a call or fetch: number it in send order
                self._seq += 1
                seq = self._seq
                getattr(up, up.WhichOneof("msg")).seq = seq
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
        if not numbered or not self.deadline_ns:
            return w.wait()
        try:
            return w.wait(self.deadline_at(), self.past_deadline)
        except DeadlineMissed:
            with self._lock:
                if self._waiters.pop(seq, None) is not None and up.WhichOneof("msg") == "call" \
                        and up.call.want_meta:
                    self._late_replies.add(seq)  # the host names its outputs: release them
            raise

    def send_frames(self, frames: list[ops_pb2.SessionUp]) -> None:
        """Stream ``frames`` in order without waiting (after any pending releases)."""
        with self._lock:
            if self.lost is not None:
                raise HostLost(self.lost)
            if self.released:
                ids, self.released = self.released, []
                frames = [self._release_frame(ids), *frames]
            if not frames:
                return
            try:
                self.channel.send(frames)
            except OSError as exc:
                self._on_lost(f"connection to rrtod lost: {exc}")
                raise HostLost(self.lost or str(exc)) from None
            self.counters["frames"] += len(frames)

    def _release_frame(self, ids: list[int]) -> ops_pb2.SessionUp:
        msg = release_of(ids)
        progress = self.progress() if self.progress is not None else None
        if progress is not None:
            msg.progress.CopyFrom(progress)
        return ops_pb2.SessionUp(release=msg)

    def release_now(self, at_least: int) -> None:
        """Send pending releases now, if there are ``at_least``: while the app waits for a
        replayed output, the host can free what the app dropped before it computes on (see
        rrtod/gpu/replay.py); a few releases are not worth a message of their own. Never
        raises: releases only help the host, and a lost host is the next call's to report
        (the replay client calls this after every matched call)."""
        if len(self.released) >= at_least and self.lost is None:
            try:
                self.send_frames([])
            except HostLost:
                pass

    def add_async_error(self, err: ops_pb2.Error) -> None:
        self._async_errors.append(err)

    def raise_async_errors(self) -> None:
        """Raise the first error the host reported for a streamed call, if any."""
        if self._async_errors:
            err = self._async_errors.popleft()
            self._async_errors.clear()
            raise RemoteOpError(err.code, err.message)

    def flush(self) -> None:
        """Wait until the host has executed everything sent so far; raise its errors."""
        if self.lost is not None and self.fallback == "local":
            return  # everything runs here now
        if self.released or self.mode == "stream":
            self.submit(ops_pb2.SessionUp(query=ops_pb2.BlobQuery()), query=True)
        self.raise_async_errors()

    # -- persistent tensors ------------------------------------------------------------------
    def persist(self, tensors: list[torch.Tensor]) -> list[RemoteTensor]:
        """Proxies for persistent tensors: offered by content hash, uploaded only if missing.
        A host lost meanwhile (under ``fallback: local``) leaves them as after a loss: each
        proxy keeps the app's own copy, which the calls then run on, and a host that comes
        back is offered them (``Reconnect``). A slow link's first upload of a model's weights
        (resnet50's 100 MB on the benchmark's outdoor trace) once lost the host on pings
        queued behind it, and the app's first forward raised."""
        hashes, datas = [], []
        for t in tensors:
            data = codec.tensor_data(t)
            datas.append(data)
            hashes.append(content_hash(data.meta.dtype, list(data.meta.shape), data.data))
        uniq = list(dict.fromkeys(hashes))
        if uniq and self.lost is None:  # after a loss, a new host is offered them (Reconnect)
            try:
                self._offer(uniq, hashes, datas)
            except HostLost:
                if self.fallback != "local":
                    raise
        out = []
        for t, h in zip(tensors, hashes, strict=True):
            handle = Handle(self, next(self._ids), hash=h, local=t.detach())
            self._persistent.add(handle)
            out.append(RemoteTensor(handle, t.shape, t.stride(), t.storage_offset(), t.dtype,
                                    t.device, requires_grad=t.requires_grad))
        return out

    def _offer(self, uniq: list[bytes], hashes: list[bytes],
               datas: list[ops_pb2.TensorData]) -> None:
        """Offer ``uniq`` by hash; upload the ones the host lacks (HostLost if it is lost)."""
        reply = self.submit(ops_pb2.SessionUp(query=ops_pb2.BlobQuery(hashes=uniq)), query=True)
        missing = set(reply.missing)
        sent = set()
        for h, data in zip(hashes, datas, strict=True):
            if h in missing and h not in sent:
                sent.add(h)
                self.submit(ops_pb2.SessionUp(blob=ops_pb2.BlobPut(hash=h, tensor=data)))
                self.counters["blob_bytes_up"] += len(data.data)
        self.counters["blob_hits"] += len(uniq) - len(sent)

    # -- downloads ---------------------------------------------------------------------------
    def download(self, proxy: RemoteTensor) -> torch.Tensor:
        """The value of ``proxy`` (an app's data read)."""
        value = downloads.read_value(self, proxy)
        if self.replay is not None:
            self.replay.downloaded()
        if self.on_read is not None:
            self.on_read(proxy._rrto_handle.id)
        return value

    # -- dispatch ----------------------------------------------------------------------------
    def thread_index(self) -> int:
        """This app thread's index on the wire (``OpCall.thread``, ``InferenceMark.thread``)."""
        return self._thread()

    def _thread(self) -> int:
        return self.lanes.lane()

    def _info(self, func: Any) -> OpInfo:
        # Keyed by id: an OpOverload hashes in Python, an int in C; the info holds the
        # OpOverload, so its id is never reused while the entry exists.
        info = self._ops.get(id(func))
        if info is None:
            info = self._ops[id(func)] = OpInfo(func)
        return info

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self._assigning:
            assigning = self._assigning.get(threading.get_ident())
            if assigning is not None and not assigning.done:
                view = assigning.defer(func, args)
                if view is not None:
                    return view
                args = assigning.taken(self, func, args)
        info = self._ops.get(id(func)) or self._info(func)
        if info.alias_only:
            src = args[0]
            return new_proxy(src._rrto_handle, src.shape, src.stride(), src.storage_offset(),
                             src.dtype, src.device)
        if info.writes and self.lost is None:
            self._note_writes(args, kwargs, info)
        if self.lost is not None or (self._late and self._thread() in self._late):
            return self._run_here(func, args, kwargs, info)
        if info.local or (info.writes and writes_local(args, kwargs, info)):
            return run_local(self, func, args, kwargs, info)
        try:
            if self.diverged and _names(args, kwargs, self.diverged):
                # the host's copy of an argument is older: forwarded, with its value
                result = self._forward(func, args, kwargs, info,
                                       None if info.value_op else
                                       self._metadata.output_template(func, args, kwargs))
            else:
                result = self._remote(func, args, kwargs, info)
        except HostLost:
            if self.fallback != "local":
                raise
            return self._run_here(func, args, kwargs, info)  # on the journal's values
        except DeadlineMissed:
            return self._run_here(func, args, kwargs, info)
        self.journal.add(func, args, kwargs, result)
        return result

    def assign(self, func: Any, args: tuple, kwargs: dict) -> None:
        """``target[index] = value`` (``Tensor.__setitem__``) with a proxy ``value`` that has
        leading ones: its view without them waits for the call that takes it
        (``assignment.py``), so the calls do not depend on whether a count was 1."""
        thread = threading.get_ident()
        fresh = self.lost is None and thread not in self._assigning
        if fresh:
            self._assigning[thread] = Assignment(args[2])
        try:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        finally:
            if fresh:
                del self._assigning[thread]

    def _run_here(self, func: Any, args: tuple, kwargs: dict, info: OpInfo) -> Any:
        """The call on local values (the host is lost, or the inference passed its
        deadline): a proxy it writes is newer here than on any host."""
        result = run_lost(self, func, args, kwargs)
        for i, n in info.writes:
            t = arg_at(args, kwargs, i, n)
            if isinstance(t, RemoteTensor):
                self.diverged.add(t._rrto_handle.id)
        return result

    def _remote(self, func: Any, args: tuple, kwargs: dict, info: OpInfo) -> Any:
        """Replay the call or forward it to the host."""
        replay = self.replay
        if replay is not None and (replay.sequences or replay.search_pending):
            # The shim's own cost per replayed operator (matching, proxies, input frames), as
            # this thread's CPU time: wall time would add what is not the shim's, the time this
            # thread is off the CPU (the daemons replaying on the same cores, the daemon woken
            # by the start frame taking the CPU of its writer). Reading it is a system call
            # (~0.6-0.9 us here, two to four a call): a random sample of the calls is timed
            # (``TIMED_SHARE``), and the mean per call is ``replay_shim_ns / replay_timed``.
            timed = _sample() < TIMED_SHARE
            if timed:
                t0, planned = thread_time_ns(), replay.planning_ns
            result = replay.dispatch(func, args, kwargs, info, self._thread(),
                                     hotpath.grad_mode(), timed)
            if result is not MISS:
                if info.inplace_view:  # transpose_ and co. change the proxy's own layout
                    restride(func, args, kwargs)
                if timed:
                    plan = replay.planning_ns - planned  # working out the step's outputs
                    counters = self.counters
                    counters["replay_shim_ns"] += thread_time_ns() - t0 - plan
                    counters["replay_timed"] += 1
                    if plan:
                        counters["replay_plan_ns"] += plan
                return result
            if self._late and self._thread() in self._late:
                raise DeadlineMissed  # an answer waited for past the deadline
        if info.value_op:
            return self._forward(func, args, kwargs, info, None)
        return self._forward(func, args, kwargs, info,
                             self._metadata.output_template(func, args, kwargs))

    def output_template(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """(result template, outputs) for this call, cached per operator and argument
        signature; None when the output shapes depend on data (ask the host)."""
        return self._metadata.output_template(func, args, kwargs)

    @staticmethod
    def app_device(args: tuple, kwargs: dict) -> torch.device:
        """The device the app sees a call's outputs on (``metadata.app_device``)."""
        return app_device(args, kwargs)

    def _encode_tensor(self, t: torch.Tensor, device: str | None = None) -> ops_pb2.TensorRef:
        if isinstance(t, RemoteTensor):
            h = t._rrto_handle
            if h.session is not self:
                raise OffloadError("WRONG_SESSION", "a tensor of another rrto session was used")
            if h.epoch != self.epoch or (self.diverged and h.id in self.diverged):
                # made on a host lost since, or written here since: send the value here
                local = self.value_after_loss(h)
                if local is None:
                    raise HostLost(f"{self.lost or 'the GPU host was lost'}; the value of a "
                                   "tensor made before lived on it")
                return self._encode_tensor(downloads.shape_like(local, t), device)
            if h.split:  # a split region's value (``rrtod.lop``): the host has a band of it
                downloads.whole(self, t)
                return self._encode_tensor(downloads.shape_like(h.local, t), device)
            if not h.bound:
                if h.hash is None and h.local is not None:
                    # made here by a robot-placed call (``ReplayClient._on_robot``): its data
                    return self._encode_tensor(downloads.shape_like(h.local, t), device)
                self.bind(h)
            return ops_pb2.TensorRef(id=h.id)
        data = self._upload_data(t, device)
        self.counters["bytes_up"] += len(data.data)
        return ops_pb2.TensorRef(upload=data)

    def _upload_data(self, t: torch.Tensor, device: str | None = None) -> ops_pb2.TensorData:
        """A local tensor's value as uploaded (not counted: the caller counts what it sends)."""
        if t.requires_grad or type(t) is not torch.Tensor:
            t = t.detach()
        return codec.tensor_data(t, device=device, keep_layout=True)

    def bind(self, h: Handle) -> None:
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

    def warn_once(self, key: str, message: str) -> None:
        """One ``rrto: warning:`` line on stderr per ``key`` (an operator, a pattern) for the
        life of the process: the app's owner should know, and a loop must not flood its log."""
        with self._warn_lock:  # not the send lock: callers may hold it
            if key in self.local_warned:
                return
            self.local_warned.add(key)
        print(f"rrto: warning: {message}", file=sys.stderr, flush=True)

    def _runs_locally(self, info: OpInfo, why: str) -> None:
        """One warning line per operator that runs in the app instead of on the host: its
        inputs then cross the wire each call, which the app's owner should know about."""
        self.warn_once(info.name, f"{info.name} runs locally (on this machine), not on the GPU "
                                  f"host: {why}")

    def _forward(self, func: Any, args: tuple, kwargs: dict, info: OpInfo, template: Any) -> Any:
        if info.writes and self.replay is not None:  # a replayed value's push is now stale
            for i, n in info.writes:
                t = arg_at(args, kwargs, i, n)
                if isinstance(t, RemoteTensor):
                    self.replay.rewritten(t._rrto_handle.id)
        call = ops_pb2.OpCall(op=info.name, grad_mode=hotpath.grad_mode(), thread=self._thread())
        try:
            for a in args:
                codec.encode_value(a, call.args.add(), self._encode_tensor)
            for k, v in kwargs.items():
                codec.encode_value(v, call.kwargs[k], self._encode_tensor)
        except codec.CodecError as exc:
            self._runs_locally(info, f"an argument cannot be sent ({exc})")
            return run_local(self, func, args, kwargs, info)
        device = app_device(args, kwargs)
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
                target = arg_at(args, kwargs, *alias) if alias else None
                if isinstance(target, RemoteTensor):
                    handles.append(None)
                    call.out_ids.append(target._rrto_handle.id)
                else:
                    h = Handle(self, next(self._ids))
                    handles.append(h)
                    call.out_ids.append(h.id)
                call.out_meta.add(dtype=codec.DTYPE_NAMES[o.dtype], shape=o.shape,
                                  stride=o.stride, storage_offset=o.offset, device=str(device))
        if probe:  # the host compares the schema once (schemas.py); the call waits for it anyway
            call.schema = schema_hash(func)
        wait = want or probe or self.mode == "sync"
        call.sync = wait
        try:
            reply = self.submit(ops_pb2.SessionUp(call=call), numbered=True, wait=wait)
        except RemoteOpError as exc:
            # Another library's operator the host lacks runs here even under fallback: error
            # (the app could not run otherwise); a schema that differs only under local.
            if exc.code in _REFUSED and (self.fallback == "local" or (
                    exc.code == "OP_NOT_ALLOWED" and info.namespace != "aten")):
                info.local = True
                why = f"the GPU host refuses it ({exc})"
                if exc.code == "SCHEMA_MISMATCH":
                    why += f"; here: {schema_of(func)}"
                self._runs_locally(info, why)
                return run_local(self, func, args, kwargs, info)
            raise
        info.probed = True
        self.counters["calls"] += 1
        if info.inplace_view:
            restride(func, args, kwargs)
        if want:
            result = self._from_reply(reply, device)
        else:
            result = materialize(tmpl, handles, info, args, kwargs, device)
        if self.replay is not None:  # a sequence found meanwhile may join this inference
            self.replay.forwarded(call, result)
        return result

    def _from_reply(self, reply: ops_pb2.OpResult, device: torch.device) -> Any:
        metas = iter(reply.outs)

        def tensor(ref: ops_pb2.TensorRef) -> torch.Tensor:
            m = next(metas)
            return RemoteTensor(Handle(self, ref.id), tuple(m.shape), tuple(m.stride),
                                m.storage_offset, codec.dtype_of(m.dtype), device)
        return codec.decode_value(reply.value, tensor, torch.device)
