"""A host balancer (``rrtod.hookspecs.HostBalancer``): which GPU host a new app session goes to.

The robot daemon builds one balancer per configuration as ``factory(options, state_dir)``:
``options`` is this balancer's block of the ``balancers`` key (``{}`` when there is none),
``state_dir`` a directory for anything it learns (created by the balancer when it first writes).
It calls ``choose(hosts)`` for every new session, on its event loop, with the configured hosts
in configuration order. Each host object has ``name: str``, ``up: bool``, ``rtt_ms: float | None``
(median measured round trip, None before the first ping), ``sessions: int`` (open sessions) and
``inflight: int`` (replayed inferences in flight). ``choose`` must return one of the objects it
was given, or None when no host is up (the app then falls back as ``intercept.fallback`` says).
It must not block: it runs on the event loop.

A balancer also places each replayed inference (``place(hosts, job)``), learns from its latency
(``observe``) and persists what it learned (``close``). Deriving from
``rrtod.hookspecs.BalancerBase`` gives defaults for all three (``place`` calls ``choose``), the
``(options, state_dir)`` constructor, and validation of ``options`` against ``Options``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from rrtod.hookspecs import BalancerBase, BalancerOptions, HostView


class WeightedOptions(BalancerOptions):
    """``balancers: {weighted: {weights: {gpu-a: 3, gpu-b: 1}, default_weight: 1}}``.
    Unknown keys and bad values are refused at start, reload and ``rrtod --check-config``,
    named as ``balancers.weighted.<key>``."""

    weights: dict[str, float] = Field(default_factory=dict)  # host name -> weight (> 0)
    default_weight: float = Field(default=1.0, gt=0)  # of hosts not listed in weights

    def weight(self, name: str) -> float:
        return self.weights.get(name, self.default_weight)

    @field_validator("weights", mode="before")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        for name, weight in v.items() if isinstance(v, dict) else ():
            if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
                raise ValueError(f"host {name!r}: expected a number > 0, got {weight!r}")
        return v


class Weighted(BalancerBase):
    """New sessions spread over the up hosts in proportion to their weights, evenly interleaved
    (nginx's smooth weighted round robin: weights 3 and 1 give a, a, b, a, ...).

    Each up host's credit grows by its weight at every choice; the host with the most credit is
    chosen and pays the total weight of the up hosts. Credit is kept by host *name*, so hosts
    going down and coming back, or a reload that edits the list, keep the proportions.
    """

    Options = WeightedOptions

    def __init__(self, options: Mapping[str, Any] | None = None, state_dir: Path | None = None,
                 /) -> None:
        super().__init__(options, state_dir)  # validates options into self.options
        self._credit: dict[str, float] = {}

    def choose(self, hosts: Sequence[HostView]) -> HostView | None:
        up = [h for h in hosts if h.up]
        if not up:
            return None
        total = 0.0
        best: HostView | None = None
        for host in up:
            weight = self.options.weight(host.name)
            total += weight
            self._credit[host.name] = self._credit.get(host.name, 0.0) + weight
            if best is None or self._credit[host.name] > self._credit[best.name]:
                best = host
        assert best is not None
        self._credit[best.name] -= total
        # Forget hosts that are gone, so the credit map stays as small as the host list.
        for name in set(self._credit) - {h.name for h in hosts}:
            del self._credit[name]
        return best
