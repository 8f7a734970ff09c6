"""The GPU daemon's memory cap: bytes held by all of its sessions together.

The daemon builds one ``HostMemory`` from ``executor.memory_limit`` and hands it to every
executor through ``ExecutorContext.host_memory``; executors see it as ``rrtod.executor.HostMemoryLike``
(the contract), this is the implementation.
"""

from __future__ import annotations

import threading

from rrtod.executor import HostMemoryExceeded

__all__ = ["HostMemory", "HostMemoryExceeded"]


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
