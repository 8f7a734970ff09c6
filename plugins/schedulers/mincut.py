"""The minimum-latency cut of a sequence's dataflow graph (DADS, MCOP): which calls the robot
runs so that robot compute + host compute + the transfers across the cut add up to the least.

The graph is the classic s-t construction: the source side is the robot, the sink side the
host. Per call ``k``, an edge robot -> k costs what running it on the host costs (its host time,
the app inputs it would have to upload, its outputs the app would have to download), and
k -> host what running it on the robot costs (its robot time). Per value that crosses, one
transfer: a value node per direction lets a value read by several calls on the other side cost
one transfer, not one per reader. Calls that must stay on the host (``CallView.movable``) have
an uncuttable edge to the host, and the calls of one group uncuttable edges to each other. The
minimum cut (``networkx.minimum_cut``, max-flow by preflow-push) is the placement; its value
is the predicted latency of one inference under it.

The model is the sequential one of DADS' light-load case: one side computes while the other
waits, and each crossing costs its bytes at the link's throughput plus half its round trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx

from rrtod.partition import HOST, ROBOT, SequenceView


@dataclass(frozen=True)
class Link:
    """What a crossing costs: nanoseconds per byte each way, plus a one-way latency."""

    up_ns_per_byte: float
    down_ns_per_byte: float
    one_way_ns: float

    @classmethod
    def of(cls, mbit_s: float, rtt_ms: float) -> Link:
        per_byte = 8e3 / mbit_s  # ns per byte at mbit_s Mbit/s
        return cls(per_byte, per_byte, rtt_ms * 1e6 / 2)


@dataclass(frozen=True)
class Cut:
    placement: list[str]
    predicted_ns: float  # one inference under ``placement``, as the model sees it


def min_cut(view: SequenceView, host_ns: Sequence[float], robot_ns: Sequence[float],
            link: Link) -> Cut:
    """The placement of ``view``'s calls with the least predicted latency."""
    g = nx.DiGraph()
    n = len(view.calls)
    downloads = set(view.downloads)
    readers: dict[int, list[int]] = {}
    for k, c in enumerate(view.calls):
        for u in c.reads:
            readers.setdefault(u, []).append(k)
    for k, c in enumerate(view.calls):
        on_host = host_ns[k] + c.input_bytes * link.up_ns_per_byte
        if c.input_bytes:
            on_host += link.one_way_ns
        if k in downloads:
            on_host += c.out_bytes * link.down_ns_per_byte + link.one_way_ns
        g.add_edge("robot", k, capacity=round(on_host))
        if c.movable:
            g.add_edge(k, "host", capacity=round(robot_ns[k]))
        else:
            g.add_edge(k, "host")  # no capacity: uncuttable, the call stays on the host
    first: dict[int, int] = {}
    for k, c in enumerate(view.calls):
        g0 = first.setdefault(c.group, k)
        if g0 != k:  # one group, one side
            g.add_edge(g0, k)
            g.add_edge(k, g0)
    for u, ks in readers.items():
        size = view.calls[u].out_bytes
        up, down = ("up", u), ("down", u)
        g.add_edge(u, up, capacity=round(size * link.up_ns_per_byte + link.one_way_ns))
        g.add_edge(down, u, capacity=round(size * link.down_ns_per_byte + link.one_way_ns))
        for k in ks:
            g.add_edge(up, k)  # a reader on the host: the robot's value goes up once
            g.add_edge(k, down)  # a reader on the robot: the host's value comes down once
    value, (robot_side, _host_side) = nx.minimum_cut(g, "robot", "host")
    return Cut([ROBOT if k in robot_side else HOST for k in range(n)], float(value))


def predicted_ns(view: SequenceView, placement: list[str], host_ns: Sequence[float],
                 robot_ns: Sequence[float], link: Link) -> float:
    """What the model predicts for one inference under any placement (to compare a cut with
    the all-host and all-robot ones)."""
    total = 0.0
    side = placement
    for k, c in enumerate(view.calls):
        if side[k] == ROBOT:
            total += robot_ns[k]
        else:
            total += host_ns[k]
            if c.input_bytes:
                total += c.input_bytes * link.up_ns_per_byte + link.one_way_ns
            if k in view.downloads:
                total += c.out_bytes * link.down_ns_per_byte + link.one_way_ns
    readers: dict[int, list[int]] = {}
    for k, c in enumerate(view.calls):
        for u in c.reads:
            readers.setdefault(u, []).append(k)
    for u, ks in readers.items():
        size = view.calls[u].out_bytes
        if side[u] == ROBOT and any(side[k] == HOST for k in ks):
            total += size * link.up_ns_per_byte + link.one_way_ns
        if side[u] == HOST and any(side[k] == ROBOT for k in ks):
            total += size * link.down_ns_per_byte + link.one_way_ns
    return total
