"""A session's live tensors on the host, with the byte accounting the memory limits need.

Views share their base's storage, so bytes are counted once per storage: a storage is charged
when the first tensor on it enters the store and refunded when the last one leaves.

Memory is admitted before it is allocated: the executor computes what an operator will
allocate (plugins/torch/sizing.py) and ``admit``s it; the outputs are then charged by
``put_many(..., admitted=n)``, which only checks what exceeds the admitted bytes. Replies
waiting to be sent (``queue_reply``) count too. Every byte is charged both to the session's
quota and to the daemon-wide ``HostMemory`` (executor.memory_limit), when there is one.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import torch

from rrtod.executor import HostMemoryExceeded, HostMemoryLike


class QuotaExceeded(Exception):
    """Storing a tensor would take the session over its memory quota (or the host over its
    memory limit)."""


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class TensorStore:
    def __init__(self, quota: int, host: HostMemoryLike | None = None):
        self.quota = quota
        self.host = host
        self._tensors: dict[Hashable, torch.Tensor] = {}
        self._keys: dict[Hashable, tuple[int, int]] = {}
        self._refs: dict[tuple[int, int], int] = {}
        self.bytes_live = 0
        self.pending = 0  # admitted for the operator now running, not yet stored
        self.queued = 0  # replies waiting to be sent (any thread: under _lock)
        self.peak = 0
        self._lock = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def get(self, key: Hashable) -> torch.Tensor | None:
        return self._tensors.get(key)

    def keys_of(self, t: torch.Tensor) -> list[Hashable]:
        """The keys under which this very tensor object is stored (slow: error paths only)."""
        return [k for k, v in self._tensors.items() if v is t]

    @property
    def held(self) -> int:
        """Bytes charged to the session: live tensors, admitted outputs, queued replies."""
        return self.bytes_live + self.pending + self.queued

    def check(self, extra: int, what: str) -> None:
        """Raise QuotaExceeded if ``extra`` more bytes would not fit now; charges nothing."""
        if self.held + extra > self.quota:
            raise QuotaExceeded(
                f"{what} needs {extra} bytes; the session holds {self.held} of its "
                f"{self.quota}-byte memory quota"
            )
        if self.host is not None:
            try:
                self.host.check(extra, what)
            except HostMemoryExceeded as exc:
                raise QuotaExceeded(str(exc)) from None

    def _charge(self, n: int, what: str) -> None:
        """Check and charge the host for ``n`` bytes (the caller counts them in the session)."""
        self.check(n, what)
        if self.host is not None and n:
            try:
                self.host.charge(n, what)
            except HostMemoryExceeded as exc:  # another session took it since the check
                raise QuotaExceeded(str(exc)) from None

    def admit(self, n: int, what: str) -> None:
        """Reserve ``n`` bytes for an operator about to allocate them (QuotaExceeded if they
        do not fit). ``put_many(..., admitted=n)`` or ``cancel(n)`` ends the reservation."""
        self._charge(n, what)
        self.pending += n

    def cancel(self, n: int) -> None:
        """End a reservation whose outputs are not stored (the operator failed)."""
        self.pending -= n
        if self.host is not None:
            self.host.refund(n)

    def put_many(self, items: list[tuple[Hashable, torch.Tensor]], what: str,
                 admitted: int = 0) -> None:
        """Store all of ``items`` or none (QuotaExceeded, and the reservation ends too)."""
        keyed = [(key, t, _storage_key(t)) for key, t in items]
        extra = 0  # bytes of storages not yet charged
        if len(keyed) == 1:  # the common case: one output, no storage to count once
            k = keyed[0][2]
            extra = 0 if k in self._refs else k[1]
        else:
            seen: set[tuple[int, int]] = set()
            for _, _, k in keyed:
                if k not in self._refs and k not in seen:
                    seen.add(k)
                    extra += k[1]
        self.pending -= admitted
        try:
            self._charge(extra - admitted, what)
        except QuotaExceeded:
            if self.host is not None:
                self.host.refund(admitted)
            raise
        for key, t, k in keyed:
            self._put(key, t, k)

    def put(self, key: Hashable, t: torch.Tensor) -> None:
        """Store ``t`` after a ``check`` by the caller; its storage is counted like
        ``put_many``'s, without a second check."""
        self._put(key, t, _storage_key(t), charge_host=True)

    def _put(self, key: Hashable, t: torch.Tensor, k: tuple[int, int],
             charge_host: bool = False) -> None:
        old = self._keys.get(key)
        if old == k:  # the same storage under the same key (an in-place op): counted already
            self._tensors[key] = t
            return
        if old is not None:
            self.pop(key)
        n = self._refs.get(k, 0)
        if n == 0:
            self.bytes_live += k[1]
            self.peak = max(self.peak, self.bytes_live)
            if charge_host and self.host is not None:
                self.host.add(k[1])
        self._refs[k] = n + 1
        self._tensors[key] = t
        self._keys[key] = k

    def pop(self, key: Hashable) -> torch.Tensor | None:
        t = self._tensors.pop(key, None)
        if t is None:
            return None
        k = self._keys.pop(key)
        n = self._refs[k] - 1
        if n == 0:
            del self._refs[k]
            self.bytes_live -= k[1]
            if self.host is not None:
                self.host.refund(k[1])
        else:
            self._refs[k] = n
        return t

    # -- replies waiting to be sent (worker thread charges, any thread refunds) --------------
    def queue_reply(self, n: int, what: str) -> None:
        """Count a reply of ``n`` bytes queued for the client; QuotaExceeded if no room."""
        with self._lock:
            self._charge(n, what)
            self.queued += n

    def unqueue_reply(self, n: int) -> None:
        with self._lock:
            n = min(n, self.queued)  # replies still queued when the session closed
            self.queued -= n
        if self.host is not None and n:
            self.host.refund(n)

    def clear(self) -> None:
        with self._lock:
            held = self.bytes_live + self.pending + self.queued
            self.queued = 0
        self._tensors.clear()
        self._keys.clear()
        self._refs.clear()
        self.bytes_live = 0
        self.pending = 0
        if self.host is not None and held:
            self.host.refund(held)
