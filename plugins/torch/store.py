"""A session's live tensors on the host, with the byte accounting the memory quota needs.

Views share their base's storage, so bytes are counted once per storage: a storage is charged
when the first tensor on it enters the store and refunded when the last one leaves.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch


class QuotaExceeded(Exception):
    """Storing a tensor would take the session over its memory quota."""


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class TensorStore:
    def __init__(self, quota: int):
        self.quota = quota
        self._tensors: dict[Hashable, torch.Tensor] = {}
        self._keys: dict[Hashable, tuple[int, int]] = {}
        self._refs: dict[tuple[int, int], int] = {}
        self.bytes_live = 0
        self.peak = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def get(self, key: Hashable) -> torch.Tensor | None:
        return self._tensors.get(key)

    def new_bytes(self, tensors: list[torch.Tensor]) -> int:
        """Bytes that storing ``tensors`` would add (storages not yet charged)."""
        seen: set[tuple[int, int]] = set()
        total = 0
        for t in tensors:
            k = _storage_key(t)
            if k not in self._refs and k not in seen:
                seen.add(k)
                total += k[1]
        return total

    def check(self, extra: int, what: str) -> None:
        if self.bytes_live + extra > self.quota:
            raise QuotaExceeded(
                f"{what} needs {extra} bytes; the session holds {self.bytes_live} of its "
                f"{self.quota}-byte memory quota"
            )

    def put_many(self, items: list[tuple[Hashable, torch.Tensor]], what: str) -> None:
        """Store all of ``items`` or none (QuotaExceeded)."""
        self.check(self.new_bytes([t for _, t in items]), what)
        for key, t in items:
            self.put(key, t)

    def put(self, key: Hashable, t: torch.Tensor) -> None:
        if key in self._tensors:
            self.pop(key)
        k = _storage_key(t)
        n = self._refs.get(k, 0)
        if n == 0:
            self.bytes_live += k[1]
            self.peak = max(self.peak, self.bytes_live)
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
        else:
            self._refs[k] = n
        return t

    def clear(self) -> None:
        self._tensors.clear()
        self._keys.clear()
        self._refs.clear()
        self.bytes_live = 0
