"""Hybrid-Parallel's local operator scheduling strategy (LOSS) on a recorded sequence: which
split region (``rrtod.lop``) and which share of its rows the robot computes while the rest
of the input crosses the link and the host computes the other rows.

The model is the paper's timeline of two devices and one link, on the sequence's calls (the
paper's layers): the robot uploads the host's band of the input first and computes its own
band meanwhile; the host computes its band once that band is in; at the region's edge the
robot's band of each value the host reads on goes up after the robot is done, the host's
band of each value the app downloads comes down after the host is done; the host runs every
call outside the region. A call's time on a side is its measured time scaled by the share of
its rows that side computes (the rows a window reaches past the split are computed on both
sides, so the shares add up to more than one). The link carries one transfer at a time.

The variables are the region (an integer: how deep from the input the split reaches) and the
robot's share of the rows at its edge (continuous); ``scipy.optimize.differential_evolution``
searches them, as the paper's LOSS does. The share is rounded to ``SHARE_STEP`` so that a link
estimate that moves a little keeps the same plan (one plan per bandwidth band is kept: plan
switching, docs/scheduling.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scipy.optimize import differential_evolution

from rrtod.lop import Bands, Region, Space
from rrtod.partition import SequenceView

from .mincut import Link

SHARE_STEP = 1 / 32


@dataclass(frozen=True)
class SplitPlan:
    region: Region
    at: float  # the robot's share of the rows at the region's edge
    predicted_ns: float


def predict(view: SequenceView, space: Space, bands: Bands, host_ns: Sequence[float],
            robot_ns: Sequence[float], link: Link) -> float:
    """One inference's latency under ``bands`` as the model sees it (module docstring)."""
    region = bands.region
    inside = set(region.calls)
    robot = host_band = 0.0
    for k in region.calls:
        h = bands.height[k] or 1
        robot += robot_ns[k] * bands.robot[k] / h
        host_band += host_ns[k] * (h - bands.host[k]) / h
    up_first = sum((space.height(i) - bands.held[i][1]) * space.row_bytes(i)
                   for i in region.inputs)
    up_first += sum(c.input_bytes for k, c in enumerate(view.calls) if k not in inside)
    read_on, downloaded = space.edges(region)
    up_edge = sum(bands.held[i][1] * space.row_bytes(i) for i in read_on)
    down_edge = sum((space.height(i) - bands.held[i][1]) * space.row_bytes(i)
                    for i in downloaded)
    rest = sum(host_ns[k] for k in range(len(view.calls)) if k not in inside)
    down_rest = sum(view.calls[k].out_bytes for k in view.downloads if k not in inside)
    link_free = up_first * link.up_ns_per_byte  # the link, busy with the host's input band
    host_start = link_free + link.one_way_ns if up_first else 0.0
    host_done = host_start + host_band
    if up_edge:  # the robot's band of what the host reads on, once the robot is done
        arrived = max(robot, link_free) + up_edge * link.up_ns_per_byte + link.one_way_ns
        host_done = max(host_done, arrived)
    end = max(robot, host_done + rest)
    if down_rest:
        end = max(end, host_done + rest + down_rest * link.down_ns_per_byte + link.one_way_ns)
    if down_edge:
        end = max(end, host_start + host_band + down_edge * link.down_ns_per_byte
                  + link.one_way_ns)
    return end


def solve(view: SequenceView, host_ns: Sequence[float], robot_ns: Sequence[float],
          link: Link, seed: int = 0) -> SplitPlan | None:
    """The split with the least predicted latency (differential evolution over the region
    and the share), None if the sequence has no split region."""
    space: Space | None = view.space
    regions = space.regions() if space is not None else []
    if not regions:
        return None
    cache: dict[tuple[int, float], float] = {}

    def cost(x: Sequence[float]) -> float:
        r = min(max(int(round(x[1])), 0), len(regions) - 1)
        at = min(max(round(x[0] / SHARE_STEP) * SHARE_STEP, SHARE_STEP), 1.0 - SHARE_STEP)
        key = (r, at)
        if key not in cache:
            bands = space.bands(regions[r], at)
            cache[key] = predict(view, space, bands, host_ns, robot_ns, link)
        return cache[key]

    result = differential_evolution(cost, [(SHARE_STEP, 1.0 - SHARE_STEP),
                                           (0, len(regions) - 1)],
                                    integrality=[False, True], seed=seed, maxiter=40,
                                    popsize=8, tol=1e-4, polish=False)
    (r, at), best = min(cache.items(), key=lambda kv: kv[1])
    del result  # the cache holds every evaluation, rounded as the plans are made
    return SplitPlan(regions[r], at, best)
