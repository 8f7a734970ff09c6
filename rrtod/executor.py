"""The host-side contract between the GPU daemon and an interception backend's executor.

The GPU daemon owns transport, sessions and isolation; the executor owns what a frame means.
Each session gets its own executor object, driven from one dedicated worker thread, so an
executor needs no locking and a slow model never stalls another session or the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rrto.v1 import ops_pb2


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
    host_memory: HostMemory | None = None


class HostMemoryExceeded(Exception):
    """Admitting these bytes would take the daemon's sessions over executor.memory_limit."""


class HostMemory:
    """The daemon-wide memory cap: bytes held by all sessions together (their tensors and the
    replies queued for them) against ``executor.memory_limit``. Each session charges what it
    is about to allocate before allocating it, so one robot cannot starve the others.
    Thread-safe: every session's worker thread charges it.

    ``limit`` None means the default, fixed by the first session from its device
    (``default_limit``): half the device memory of a GPU, half the RAM of a CPU host."""

    DEFAULT_FRACTION = 0.5

    def __init__(self, limit: int | None = None):
        self.configured = limit
        self.default: int | None = None  # from the device, once a session saw it
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def configure(self, limit: int | None) -> None:
        """A new executor.memory_limit (reload): applies to the next allocation."""
        with self._lock:
            self.configured = limit
            self.limit = limit if limit is not None else self.default

    def resolve(self, total: int) -> int | None:
        """The limit, fixing the default from ``total`` bytes of device memory if unset."""
        with self._lock:
            if self.default is None:
                self.default = int(total * self.DEFAULT_FRACTION)
            if self.configured is None:
                self.limit = self.default
            return self.limit

    def charge(self, n: int, what: str) -> None:
        """Count ``n`` more bytes, or raise HostMemoryExceeded and count nothing."""
        with self._lock:
            if n > 0 and self.limit is not None and self.used + n > self.limit:
                raise HostMemoryExceeded(
                    f"{what} needs {n} bytes; the sessions of this host hold {self.used} of "
                    f"its {self.limit}-byte memory limit (executor.memory_limit)")
            self.used += n

    def check(self, n: int, what: str) -> None:
        """Raise HostMemoryExceeded if ``n`` more bytes would not fit now; counts nothing."""
        if n > 0 and self.limit is not None and self.used + n > self.limit:
            raise HostMemoryExceeded(
                f"{what} needs {n} bytes; the sessions of this host hold {self.used} of its "
                f"{self.limit}-byte memory limit (executor.memory_limit)")

    def add(self, n: int) -> None:
        """Count ``n`` bytes that were checked before (``check``), without a second check."""
        with self._lock:
            self.used += n

    def refund(self, n: int) -> None:
        with self._lock:
            self.used -= n


class BlobStoreLike(Protocol):
    """The weight cache as one identity sees it (``ExecutorContext.identity``): entries others
    uploaded are missing to it unless the cache is shared."""

    def has(self, key: bytes, identity: str) -> bool: ...
    def put(self, key: bytes, tensor: ops_pb2.TensorData, identity: str) -> None: ...
    def get(self, key: bytes, identity: str) -> ops_pb2.TensorData | None: ...


class Executor(Protocol):
    """One app session on the host."""

    def open(self, request: ops_pb2.SessionOpen) -> ops_pb2.SessionReady: ...

    def handle(self, frame: ops_pb2.SessionUp) -> Iterable[ops_pb2.SessionDown]:
        """Execute one frame; yield the replies it produces (none for a streamed call).
        Errors are replied as ``SessionDown(error=...)``, never raised, except for bugs."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters for status/metrics: at least ``ops`` (operators executed) and ``bytes_live``."""
        ...

    # Optional, for replay of sequences that overwrite existing values in place:
    #   snapshot(ids) -> token   copies of those tensors
    #   restore(token)           write the copies back (in place, keeping views valid)
    # Optional, so that replies waiting to be sent count against the session's memory:
    #   charge_reply(nbytes) -> str | None   from the worker thread, before a reply is queued;
    #                                         a reason when the session has no room for it
    #   refund_reply(nbytes)                  from any thread, once the reply was sent

    def close(self) -> None:
        """Free everything the session holds. Called once, also when the app vanished."""
        ...
