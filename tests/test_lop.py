"""Hybrid-Parallel on a recorded sequence: split regions and bands (``rrtod.lop``), plans that
split (``rrtod.partition``), and LOSS's choice of region and share (``plugins/schedulers``):
on definitions built here (a conv chain into a classifier, a fully convolutional net whose map
the app downloads)."""

from __future__ import annotations

import math

import pytest

from plugins.schedulers import HybridParallel
from plugins.schedulers.hybrid import predict, solve
from plugins.schedulers.mincut import Link
from plugins.torch import rows
from rrto.v1 import ops_pb2
from rrtod import lop, partition
from rrtod.robot.scheduling import LinkEstimate

SRC = ops_pb2.SeqSource


def meta(shape: tuple[int, ...], dtype: str = "float32") -> ops_pb2.TensorMeta:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.insert(0, acc)
        acc *= s
    return ops_pb2.TensorMeta(dtype=dtype, shape=list(shape), stride=stride)


class Builder:
    """A definition call by call: ``x`` is the app's input (local id 1)."""

    def __init__(self, shape: tuple[int, ...]):
        self.d = ops_pb2.SequenceDef(id=7, local_ids=[1])
        self.shape = {1: shape}
        self.first_read = True
        self.next = 2

    def _tensor(self, call: ops_pb2.OpCall, i: int) -> None:
        v = call.args.add()
        if i == 1 and self.first_read:
            v.tensor.upload.meta.CopyFrom(meta(self.shape[1]))
            v.tensor.bind_id = 1
            self.d.sources.add(kind=SRC.INPUT)
            self.first_read = False
        else:
            v.tensor.id = i
            self.d.sources.add(kind=SRC.PRODUCED, id=i)

    def _weight(self, call: ops_pb2.OpCall, n: int) -> None:
        v = call.args.add()
        v.tensor.persistent = bytes([n]) * 32
        self.d.sources.add(kind=SRC.PERSISTENT, hash=bytes([n]) * 32)

    def _out(self, call: ops_pb2.OpCall, shape: tuple[int, ...], dtype: str = "float32") -> int:
        i = self.next
        self.next += 1
        self.d.local_ids.append(i)
        self.shape[i] = shape
        call.out_ids.append(i)
        call.out_meta.append(meta(shape, dtype))
        return i

    def conv(self, x: int, cout: int, k: int = 3, s: int = 1, p: int = 1) -> int:
        n, _c, h, w = self.shape[x]
        call = self.d.calls.add(op="aten::conv2d.default")
        self._tensor(call, x)
        self._weight(call, len(self.d.calls))
        call.args.add().none = True
        for v in ([s, s], [p, p]):
            call.args.add().list.items.extend(ops_pb2.Value(i=i) for i in v)
        return self._out(call, (n, cout, (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1))

    def unary(self, op: str, x: int) -> int:
        call = self.d.calls.add(op=op)
        self._tensor(call, x)
        return self._out(call, self.shape[x])

    def argmax(self, x: int) -> int:
        call = self.d.calls.add(op="aten::argmax.default")
        self._tensor(call, x)
        call.args.add().i = 1
        n, _c, h, w = self.shape[x]
        return self._out(call, (n, h, w), "int64")

    def flatten_linear(self, x: int, classes: int) -> int:
        call = self.d.calls.add(op="aten::flatten.using_ints")
        self._tensor(call, x)
        flat = self._out(call, (self.shape[x][0], math.prod(self.shape[x][1:])))
        call = self.d.calls.add(op="aten::linear.default")
        self._tensor(call, flat)
        self._weight(call, 99)
        return self._out(call, (self.shape[x][0], classes))

    def done(self, *outputs: int) -> ops_pb2.SequenceDef:
        self.d.outputs[:] = list(outputs)
        return self.d


def classifier() -> ops_pb2.SequenceDef:
    b = Builder((1, 3, 64, 64))
    y = b.unary("aten::relu.default", b.conv(1, 16))
    y = b.unary("aten::relu.default", b.conv(y, 32, s=2))
    return b.done(b.flatten_linear(b.conv(y, 8, s=2), 10))


def segmenter() -> ops_pb2.SequenceDef:
    b = Builder((1, 3, 96, 64))
    y = b.unary("aten::relu.default", b.conv(1, 16))
    y = b.unary("aten::relu.default", b.conv(y, 16))
    return b.done(b.argmax(b.conv(y, 4, k=1, p=0)))


def test_regions_grow_from_the_input_and_stop_at_operators_that_mix_rows():
    space = lop.Space(classifier(), rows.rule)
    regions = space.regions()
    assert [r.calls for r in regions] == [(0, 1), (0, 1, 2, 3), (0, 1, 2, 3, 4)]
    assert all(r.inputs == (0,) for r in regions)  # the app's input, by its local index
    assert regions[-1].outputs == (5,)  # the last conv's value, read by flatten on the host
    assert space.edges(regions[-1]) == ([5], [])
    seg = lop.Space(segmenter(), rows.rule)
    whole = seg.regions()[-1]
    assert whole.calls == (0, 1, 2, 3, 4, 5) and seg.edges(whole) == ([], [6])


@pytest.mark.parametrize("at", [0.001, 0.1, 0.37, 0.5, 0.9, 0.999])
def test_bands_meet_and_hold_the_rows_each_side_reads(at):
    d = segmenter()
    space = lop.Space(d, rows.rule)
    region = space.regions()[-1]
    bands = space.bands(region, at)
    for k in region.calls:
        h = bands.height[k]
        assert 1 <= bands.robot[k] <= h and 0 <= bands.host[k] <= bands.robot[k]
        how = bands.rules[k]
        for i in space.row_args[k]:
            if i is None:
                continue
            top, first = bands.held[i]
            assert how.need(0, bands.robot[k])[1] <= top  # the robot has what it reads
            if bands.host[k] < h:
                assert how.need(bands.host[k], h)[0] >= first  # and so has the host
    (out,) = region.outputs
    # the map meets at the split, each side making a row at least (else the host would have
    # nothing to put together or push)
    split = min(max(round(at * 96), 1), 95)
    assert bands.held[out] == (split, split)
    assert all(bands.host[k] < bands.height[k] for k in region.calls)
    # the host's band of the input reaches above the split by the windows' halo (two 3x3)
    assert bands.held[0][1] == max(split - 2, 0)


def test_a_plan_with_a_split_round_trips_and_names_its_measurement():
    d = classifier()
    split = partition.Split((0, 1, 2, 3), 0.25)
    placed = partition.with_plan(d, frozenset(), split)
    assert placed.plan == 1 and list(placed.plans[0].split_calls) == [0, 1, 2, 3]
    assert partition.plan_split(placed, 1) == split and partition.plan_calls(placed, 1) == set()
    assert partition.with_plan(placed, frozenset(), split).plan == 1  # the same plan again
    assert partition.plan_key(placed, 1) != partition.key_of(()) \
        and partition.plan_key(placed, 1) == partition.key_of((), split)
    bad = ops_pb2.SequenceDef()
    bad.CopyFrom(placed)
    for at in (float("nan"), -0.1, 1.5):
        bad.plans[0].split_at = at
        with pytest.raises(ValueError):
            partition.plan_split(bad, 1)
    bad.plans[0].split_at = 0.5
    bad.plans[0].split_calls[:] = [3, 2]
    with pytest.raises(ValueError):
        partition.plan_split(bad, 1)
    with pytest.raises(ValueError):
        lop.Space(d, rows.rule).bands_of([0, 5], 0.5)  # flatten is not a local operator


def test_the_host_refuses_a_split_that_is_not_a_region():
    """A robot daemon's plan is checked where it runs: a split naming calls that are not a
    region (here the classifier's linear layer) is refused, not run."""
    from rrtod.gpu.replay import HostReplayer

    class Ext:
        rows = staticmethod(rows.rule)

        def prepare(self, call):
            return None

        def written_ids(self, call):
            return []

        def viewed_ids(self, call):
            return [0] * len(call.out_ids)

        def missing(self, ids):
            return []

    class Runner:
        replay = Ext()

        def handle(self, frame):
            return []

    replayer = HostReplayer(Runner())
    d = partition.with_plan(classifier(), frozenset(), partition.Split((0, 1, 2, 3, 4, 5), 0.5))
    acks: list[ops_pb2.SessionDown] = []
    replayer.process(ops_pb2.SessionUp(define=d), acks.append)
    (ack,) = acks
    assert not ack.defined.accepted and "not a split region" in ack.defined.reason
    good = partition.with_plan(classifier(), frozenset(), partition.Split((0, 1, 2, 3), 0.5))
    acks.clear()
    replayer.process(ops_pb2.SessionUp(define=good), acks.append)
    assert acks[0].defined.accepted, acks[0].defined.reason


def view_of(d: ops_pb2.SequenceDef, host_ms: float, robot_ms: float) -> partition.SequenceView:
    """``d`` as the scheduler sees it, each call taking ``host_ms`` on the host and
    ``robot_ms`` on the robot, every latency to be modelled (none measurable)."""
    v = partition.view(d, lambda c: [], lambda c: [0] * len(c.out_ids))
    n = len(d.calls)
    space = lop.Space(d, rows.rule, [c.movable for c in v.calls])
    return partition.SequenceView(v.id, v.calls, v.downloads, (host_ms * 1e6,) * n,
                                  (robot_ms * 1e6,) * n, None, space)


def test_loss_splits_where_the_link_and_the_robot_are_both_slow():
    """A segmenter's input and map both cross the link whole under remote-all; on a slow link
    with a robot four times slower than the host, the robot computing a band while the rest
    goes up is predicted faster than either side alone; on a fast link the robot only takes a
    sliver of the rows (the two sides computing at once is all the split has to offer)."""
    d = segmenter()
    slow = Link.of(10.0, 2.6)
    v = view_of(d, 2.0, 8.0)
    plan = solve(v, v.host_ns, v.robot_ns, slow)
    assert plan is not None and 0 < plan.at < 1
    n = len(d.calls)
    whole_robot = sum(v.robot_ns)
    host = [partition.HOST] * n
    from plugins.schedulers.mincut import predicted_ns
    whole_host = predicted_ns(v, host, v.host_ns, v.robot_ns, slow)
    assert plan.predicted_ns < 0.8 * min(whole_robot, whole_host)
    bands = v.space.bands(plan.region, plan.at)
    assert plan.predicted_ns == pytest.approx(predict(v, v.space, bands, v.host_ns, v.robot_ns,
                                                      slow))
    link = LinkEstimate("wifi", 2.6, 10.0)
    placed = HybridParallel().place(v, link)
    assert partition.SPLIT in placed and placed.split_at == plan.at
    fast = HybridParallel().place(view_of(d, 2.0, 8.0), LinkEstimate("fast", 0.1, 10_000.0))
    assert partition.SPLIT not in fast or fast.split_at <= 0.25
