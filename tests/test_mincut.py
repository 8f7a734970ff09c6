"""The ``min-cut`` scheduler's cut (plugins/schedulers/mincut.py): the s-t construction must
price every placement exactly as the sequential latency model does, so that the minimum cut is
the placement with the least predicted latency."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

from plugins.schedulers import MinCutScheduler
from plugins.schedulers.mincut import Link, min_cut, predicted_ns
from rrtod.partition import HOST, ROBOT, CallView, SequenceView
from rrtod.robot.scheduling import LinkEstimate

MS = 1e6


def chain(out_bytes: list[int], input_bytes: int, groups: list[int] | None = None,
          movable: list[bool] | None = None) -> SequenceView:
    n = len(out_bytes)
    calls = tuple(CallView(op=f"op{k}", reads=(k - 1,) if k else (), out_bytes=out_bytes[k],
                           input_bytes=input_bytes if k == 0 else 0,
                           group=(groups or list(range(n)))[k],
                           movable=(movable or [True] * n)[k]) for k in range(n))
    return SequenceView(1, calls, downloads=(n - 1,))


def test_a_fast_link_and_a_slow_robot_keep_everything_on_the_host():
    v = chain([1000] * 4, 150_000)
    cut = min_cut(v, [1 * MS] * 4, [8 * MS] * 4, Link.of(1000.0, 1.0))
    assert cut.placement == [HOST] * 4


def test_a_slow_link_keeps_everything_on_the_robot():
    v = chain([1000] * 4, 150_000)
    cut = min_cut(v, [1 * MS] * 4, [4 * MS] * 4, Link.of(1.0, 20.0))
    assert cut.placement == [ROBOT] * 4


def test_the_robot_shrinks_a_big_input_and_the_host_does_the_heavy_rest():
    """A camera frame of 1.2 MB, a first layer that shrinks it to 20 kB: at 20 Mbit/s
    uploading the frame costs 480 ms, the small activation 8 ms; the robot is 4x slower."""
    v = chain([20_000, 20_000, 20_000, 40], 1_200_000)
    host = [2 * MS, 30 * MS, 30 * MS, 1 * MS]
    robot = [8 * MS, 120 * MS, 120 * MS, 4 * MS]
    link = Link.of(20.0, 5.0)
    cut = min_cut(v, host, robot, link)
    assert cut.placement == [ROBOT, HOST, HOST, HOST]
    every = [predicted_ns(v, [side] * 4, host, robot, link) for side in (HOST, ROBOT)]
    assert cut.predicted_ns == predicted_ns(v, cut.placement, host, robot, link) < min(every)


def test_groups_stay_together_and_unmovable_calls_stay_home():
    v = chain([20_000, 20_000, 20_000, 40], 1_200_000, groups=[0, 0, 2, 3],
              movable=[True, True, True, False])
    cut = min_cut(v, [2 * MS, 30 * MS, 30 * MS, 1 * MS], [8 * MS, 120 * MS, 120 * MS, 4 * MS],
                  Link.of(20.0, 5.0))
    assert cut.placement[0] == cut.placement[1] and cut.placement[3] == HOST


def test_the_cut_is_the_best_placement_on_random_graphs():
    """Every placement of small random dataflow graphs (several readers per value, groups,
    unmovable calls), enumerated: the cut's predicted latency is the least any allowed
    placement has, and it is what the model predicts for the cut's own placement."""
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(2, 7)
        calls = []
        for k in range(n):
            reads = tuple(sorted(rng.sample(range(k), rng.randint(0, min(k, 2))))) if k else ()
            calls.append(CallView(op="op", reads=reads, out_bytes=rng.choice([0, 10, 1000, 50_000]),
                                  input_bytes=rng.choice([0, 0, 100_000]),
                                  group=rng.choice([k, k, max(k - 1, 0)]),
                                  movable=rng.random() > 0.15))
        # a group with an unmovable call is unmovable as a whole (as partition.view says)
        home = {c.group for c in calls if not c.movable}
        calls = [CallView(c.op, c.reads, c.out_bytes, c.input_bytes, c.group,
                          c.group not in home) for c in calls]
        v = SequenceView(1, tuple(calls), downloads=(n - 1,))
        host = [rng.uniform(0.1, 5) * MS for _ in range(n)]
        robot = [h * rng.uniform(0.5, 6) for h in host]
        link = Link.of(rng.choice([5.0, 50.0, 500.0]), rng.choice([1.0, 10.0]))
        cut = min_cut(v, host, robot, link)
        best = min(
            predicted_ns(v, list(p), host, robot, link)
            for p in itertools.product((HOST, ROBOT), repeat=n)
            if all(c.movable or s == HOST for c, s in zip(calls, p, strict=True))
            and all(p[k] == p[j] for k in range(n) for j in range(n)
                    if calls[k].group == calls[j].group))
        assert abs(cut.predicted_ns - best) <= n, (cut, best)
        assert abs(predicted_ns(v, cut.placement, host, robot, link) - best) <= n


def test_the_scheduler_measures_first_then_cuts():
    v = chain([20_000, 20_000, 20_000, 40], 1_200_000)
    s = MinCutScheduler()
    link = LinkEstimate("edge", rtt_ms=5.0, mbit_s=20.0)
    assert s.place(v, link) == [HOST] * 4  # nothing measured: the host measures its times
    host_ns = (2 * MS, 30 * MS, 30 * MS, 1 * MS)
    v = replace(v, host_ns=host_ns, robot_ns=(None,) * 4)
    assert s.place(v, link) == [HOST] * 4  # and the app that placement's latency
    v = replace(v, measured_ns={frozenset(): 80 * MS})
    assert s.place(v, link) == [ROBOT] * 4  # then the robot measures its own
    v = replace(v, robot_ns=(8 * MS, 120 * MS, 120 * MS, 4 * MS))
    assert s.place(v, link) == [ROBOT] * 4  # with that placement's latency
    everything = frozenset(range(4))
    v = replace(v, measured_ns={frozenset(): 80 * MS, everything: 260 * MS})
    assert s.place(v, link) == [ROBOT, HOST, HOST, HOST]  # then the cut
    assert s.place(v, LinkEstimate("edge", rtt_ms=None, mbit_s=None)) == [HOST] * 4
    # The app's clock decides: a cut measured slower than everything on the host is dropped
    # for it, one measured faster kept.
    measured = {frozenset(): 80 * MS, everything: 260 * MS, frozenset({0}): 95 * MS}
    assert s.place(replace(v, measured_ns=measured), link) == [HOST] * 4
    measured[frozenset({0})] = 70 * MS
    assert s.place(replace(v, measured_ns=measured), link) == [ROBOT, HOST, HOST, HOST]
    # A sequence whose latency cannot be measured alone is placed by the model alone.
    v = replace(v, measured_ns=None, robot_ns=(None,) * 4)
    assert s.place(v, link) == [ROBOT] * 4
    v = replace(v, robot_ns=(8 * MS, 120 * MS, 120 * MS, 4 * MS))
    assert s.place(v, link) == [ROBOT, HOST, HOST, HOST]
