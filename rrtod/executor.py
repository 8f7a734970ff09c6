"""The host-side contract between the GPU daemon and an interception backend's executor.

The GPU daemon owns transport, sessions and isolation; the executor owns what a frame means.
Each session gets its own executor object (``InterceptionBackend.executor(ctx)``), driven from
one dedicated worker thread, so an executor needs no locking and a slow model never stalls
another session or the event loop.

Two capabilities are optional, and declared rather than guessed: an executor says what it
offers through two attributes, each the object that implements it (often the executor itself)
or None. The daemon reads them once per session and never probes for methods.

- ``replay: ReplayExtension | None``: decoded calls, in-place write detection and snapshots,
  so that ``rrtod.gpu.replay`` can replay sequences fast and ones that overwrite values in place
  at all. Without it sequences still replay, through ``handle``, unless they write in place
  (their definition is then refused with a reason and the app keeps forwarding).
- ``reply_memory: ReplyMemory | None``: replies waiting to be sent count against the session's
  memory, so a client that stops reading is disconnected instead of growing the host's queue.

``rrtod.hookspecs`` is the whole plugin contract; this module is its host-executor part.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rrto.v1 import ops_pb2


class HostMemoryExceeded(Exception):
    """Admitting these bytes would take the daemon's sessions over executor.memory_limit."""


class HostMemoryLike(Protocol):
    """The daemon-wide memory cap as an executor uses it (``ExecutorContext.host_memory``;
    the daemon's implementation is ``rrtod.gpu.memory.HostMemory``). Thread-safe."""

    limit: int | None

    def resolve(self, total: int) -> int | None:
        """The limit, the default fixed from ``total`` bytes of device memory if unset."""
        ...

    def charge(self, n: int, what: str) -> None:
        """Count ``n`` more bytes, or raise HostMemoryExceeded and count nothing."""
        ...

    def check(self, n: int, what: str) -> None:
        """Raise HostMemoryExceeded if ``n`` more bytes would not fit now; counts nothing."""
        ...

    def add(self, n: int) -> None:
        """Count ``n`` bytes checked before, without a second check."""
        ...

    def refund(self, n: int) -> None: ...


class BlobStoreLike(Protocol):
    """The weight cache as one identity sees it (``ExecutorContext.identity``): entries others
    uploaded are missing to it unless the cache is shared."""

    def has(self, key: bytes, identity: str) -> bool: ...
    def put(self, key: bytes, tensor: ops_pb2.TensorData, identity: str) -> None: ...
    def get(self, key: bytes, identity: str) -> ops_pb2.TensorData | None: ...


@dataclass(frozen=True)
class ExecutorContext:
    """What the daemon hands an executor factory: ``record.executor(ctx)``."""

    device: str  # "auto", "cpu", "cuda", "cuda:1" ... from config executor.device
    memory_quota: int  # bytes of live tensors this session may hold
    allow_extra: tuple[str, ...]
    deny: tuple[str, ...]
    blobs: BlobStoreLike  # the host's content-addressed weight cache
    state_dir: Path
    identity: str = "local"  # who opened the session: the robot's certificate identity
    # Bytes all sessions of this daemon hold together (executor.memory_limit); None: no cap.
    host_memory: HostMemoryLike | None = None


@runtime_checkable
class ReplayExtension(Protocol):
    """What ``rrtod.gpu.replay.HostReplayer`` uses beyond ``handle``. Called from the session's
    worker thread only."""

    def prepare(self, call: ops_pb2.OpCall) -> Any:
        """Decode ``call`` once, when its sequence is defined: an opaque object handed back to
        ``run_prepared`` for every replay of it. May raise: that call then replays through
        ``handle``, which reports the problem when it runs."""
        ...

    def run_prepared(self, prepared: Any, refs: list[int | ops_pb2.TensorRef],
                     out_ids: list[int], ints: list[tuple[list[Any], int]] | None = None,
                     want_meta: bool = False) -> Iterable[ops_pb2.SessionDown]:
        """Run a prepared call with this inference's tensors: per tensor argument a live id or
        a ref to resolve, and the ids its outputs take. ``ints``: this inference's values of
        the call's symbolic integers, each at its path (an argument's index or keyword name,
        then item indices in lists). ``want_meta``: the app is answered this call's result,
        its outputs' metadata included. Replies as ``handle`` would for the same call."""
        ...

    def written_ids(self, call: ops_pb2.OpCall) -> list[int]:
        """Ids of the tensor arguments ``call`` writes in place without returning them (a
        batch norm's running statistics in training mode)."""
        ...

    def viewed_ids(self, call: ops_pb2.OpCall) -> list[int]:
        """Per output id of ``call``: the id of the tensor argument whose storage it shares (a
        view; an in-place op's ``self``), 0 for new storage. With ``written_ids``, when a
        replayed output is final (``rrtod.wire.final_writes``)."""
        ...

    def snapshot(self, ids: list[int]) -> Any:
        """Copies of the live tensors ``ids`` (unknown ids have nothing to keep): a token."""
        ...

    def restore(self, token: Any) -> None:
        """Write a snapshot back in place, so views of those tensors see the old values."""
        ...

    def shape(self, tid: int) -> tuple[int, ...] | None:
        """The sizes of live tensor ``tid`` (None if it is not live): a replayed call's
        integer arguments that follow this inference's data (``SymbolicInt``)."""
        ...

    def scalar(self, tid: int) -> int | None:
        """``int()`` of live one-element tensor ``tid`` (None if it is not live, has more
        elements or is not finite): an integer the app computed from a value it read
        (``SymbolicInt.value``)."""
        ...

    def missing(self, ids: list[int]) -> list[int]:
        """Those of ``ids`` that are not live in this session (released, or never made)."""
        ...

    # Optional: ``dense_sizes(tid)``, the sizes of live tensor ``tid`` if it is laid out as a
    # fresh tensor of them (C-contiguous strides, offset 0), else None: the host then sends the
    # sizes of outputs that follow the data to the shim (``ReplaySizes``), which builds its
    # proxies from them; without it the shim works every such output out itself.
    # Optional: ``synchronize()`` waits until the device has run what was queued on it, so
    # that a profiled replay (``rrtod.gpu.replay.PROFILED``) times each call's work, not its
    # launch; without it a call's time is the time until its call returned.
    # Optional: ``release(ids)`` frees live tensors as a ``Release`` frame of ``ids`` would,
    # without one (a replay frees each value after its last use: a frame each cost as much as
    # a small operator). Without it the replayer sends the executor ``Release`` frames.
    # Optional, together: ``batchable(prepared, answered=False)``, ``batch(prepared_calls,
    # sources, externals)`` and ``run_batch(batch, externals, out_ids, drops, *, writes,
    # answered, on_answer, snapshots) -> int``: a run of prepared calls replayed by one native
    # call (``rrtod.gpu.replay.Run``). ``batchable`` is asked with ``answered=True`` of a call
    # whose result the app waits for. ``batch`` gets, per call, per tensor argument, ``e >= 0``
    # (external tensor ``e``: a live id, or a ref to resolve as ``run_prepared`` does, when
    # the run starts) or ``-(v + 1)`` (the run's ``v``-th value, its calls' outputs in order),
    # and may return None; ``run_batch`` returns how many calls ran, in order, with the checks
    # of ``run_prepared`` (a call that fails is left to the caller, which runs it one by one
    # and reports it), never stores a value of ``drops`` ((call, value) pairs: let go of once
    # that call ran), appends to ``snapshots`` a (call, ``snapshot``-like token) per call of
    # ``writes`` (what it overwrites, copied just before it ran) and calls
    # ``on_answer(call, OpResult)`` as each call of ``answered`` ran (the reply
    # ``run_prepared`` with ``want_meta`` gives); ``on_answer`` may return a time
    # (``time.monotonic``) at which, if the run still goes, it is called as ``on_answer(-1,
    # None)`` between two calls (the transport sends replies it held), and returns the next
    # (0.0 or None: none). Calls are counted from the run's first.
    # Optional, with ``run_batch``: ``fixed_upload(ref)``, a definition's upload (``ref``, a
    # TensorRef with ``upload``) decoded once into an opaque object, or None where it cannot
    # be (it is then passed as the ref); ``run_batch`` then takes ``(that object, bind id or
    # 0)`` as an external, a fresh copy of the value each time, bound to the id as the ref
    # would be (~22 us each to decode; by py-spy's share, some 300-400 an SSDlite frame).
    # Optional, together: ``rows`` (a recorded call as a local operator, ``rrtod.lop.RuleOf``)
    # and ``run_rows(prepared, refs, out_ids, rule, starts, lo, hi)``, which runs rows
    # ``[lo, hi)`` of a prepared call's outputs from tensors holding their rows from
    # ``starts`` on (Hybrid-Parallel, ``rrtod.lop``). Without them a plan that splits calls
    # by rows is refused.


@runtime_checkable
class ReplyMemory(Protocol):
    """Replies queued for the client count against the session's memory (the daemon's
    ``Outbox``)."""

    def charge_reply(self, nbytes: int) -> str | None:
        """From the worker thread, before a reply is queued: None, or the reason the session
        has no room for it (the client is then disconnected)."""
        ...

    def refund_reply(self, nbytes: int) -> None:
        """From any thread, once the reply was sent."""
        ...


@runtime_checkable
class Executor(Protocol):
    """One app session on the host."""

    replay: ReplayExtension | None  # see the module docstring; None: plain ``handle`` only
    reply_memory: ReplyMemory | None  # None: queued replies are not counted

    def open(self, request: ops_pb2.SessionOpen) -> ops_pb2.SessionReady: ...

    def handle(self, frame: ops_pb2.SessionUp) -> Iterable[ops_pb2.SessionDown]:
        """Execute one frame; yield the replies it produces (none for a streamed call).
        Errors are replied as ``SessionDown(error=...)``, never raised, except for bugs."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters for status/metrics: at least ``ops`` (operators executed) and ``bytes_live``."""
        ...

    def close(self) -> None:
        """Free everything the session holds. Called once, also when the app vanished."""
        ...
