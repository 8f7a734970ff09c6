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

    def put_many(self, items: list[tuple[Hashable, torch.Tensor]], what: str) -> None:
        """Store all of ``items`` or none (QuotaExceeded)."""
        keyed = [(key, t, _storage_key(t)) for key, t in items]
        seen: set[tuple[int, int]] = set()
        extra = 0  # bytes of storages not yet charged
        for _, _, k in keyed:
            if k not in self._refs and k not in seen:
                seen.add(k)
                extra += k[1]
        self.check(extra, what)
        for key, t, k in keyed:
            self._put(key, t, k)

    def check(self, extra: int, what: str) -> None:
        if self.bytes_live + extra > self.quota:
            raise QuotaExceeded(
                f"{what} needs {extra} bytes; the session holds {self.bytes_live} of its "
                f"{self.quota}-byte memory quota"
            )

    def put(self, key: Hashable, t: torch.Tensor) -> None:
        self._put(key, t, _storage_key(t))

    def _put(self, key: Hashable, t: torch.Tensor, k: tuple[int, int]) -> None:
        if key in self._tensors:
            self.pop(key)
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
