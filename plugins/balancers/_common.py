"""What the built-in balancers share: the usual tie-breaks, and bounded per-key memory."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from rrtod.hookspecs import HostView

V = TypeVar("V")


def rtt(host: HostView) -> float:
    """The host's measured RTT, unmeasured last."""
    return host.rtt_ms if host.rtt_ms is not None else math.inf


def least(hosts: Sequence[HostView], load: Callable[[HostView], float]) -> HostView | None:
    """The host with the least ``load``; ties go to the lower RTT, then to the earlier host."""
    best: HostView | None = None
    best_key: tuple[float, float, int] | None = None
    for i, host in enumerate(hosts):
        key = (load(host), rtt(host), i)
        if best_key is None or key < best_key:
            best, best_key = host, key
    return best


def up(hosts: Sequence[HostView]) -> list[HostView]:
    return [h for h in hosts if h.up]


class Recent(Generic[V]):
    """A mapping that keeps the ``limit`` most recently used keys (job keys come and go as apps
    flush and re-record sequences: memory stays bounded). O(1) per access."""

    def __init__(self, limit: int, make: Callable[[], V]) -> None:
        self.limit = limit
        self.make = make
        self.items: OrderedDict[str, V] = OrderedDict()

    def __call__(self, key: str) -> V:
        """The value of ``key``, made if absent; ``key`` becomes the most recent."""
        value = self.items.get(key)
        if value is None:
            value = self.items[key] = self.make()
            if len(self.items) > self.limit:
                self.items.popitem(last=False)
        else:
            self.items.move_to_end(key)
        return value

    def get(self, key: str) -> V | None:
        return self.items.get(key)

    def __len__(self) -> int:
        return len(self.items)
