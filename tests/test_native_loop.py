"""The GPU host's native replay loop (plugins/torch/hostloop.cpp, ``rrto_plugins.torch.batch``).

A replayed model's outputs equal its forward's with the loop and without it (``RRTO_NATIVE=0``),
and the loop keeps the Python path's memory safety: a view reaching outside its storage stops
the run before anything of it is kept (the Python path then reports ``BAD_VIEW``), bytes are
admitted before the calls allocate them, a run whose inputs changed sizes is calibrated again,
and an operator that raises leaves what ran before it and nothing of itself.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from bench import hostloop
from bench.models import MODELS
from rrto.v1 import ops_pb2
from rrto_plugins.torch import native
from rrtod.switches import flag
from testkit.executors import AllowAll, MiB, ints, make, meta, ref

built = native.module() is not None
needs_loop = pytest.mark.skipif(not built, reason="the native loop is not built here "
                                                  "(python -m rrto_plugins.torch.native)")


def test_the_loop_is_built_where_the_suite_runs_in_ci():
    """``make install`` builds it (g++ and ninja are on CI's machines): a CI run that would
    only test the Python fallback is a failure, not a skip."""
    if not flag("CI", False):
        pytest.skip("outside CI the loop may be missing: the other tests skip then")
    assert built, native.library()


def replayed(tmp_path, model_name: str, frames: int = 3):
    spec = MODELS[model_name]
    model, x = spec.make(), spec.inputs(1)[0]
    d, constants, _ = hostloop.definition(model, x)
    harness = hostloop.Harness(d, constants, str(tmp_path))
    outs = []
    with torch.inference_mode():
        for t in spec.inputs(frames, seed=11):
            want = [o for o in torch.utils._pytree.tree_flatten(model(t))[0]
                    if isinstance(o, torch.Tensor)]
            got, _ = harness.replay(t)
            assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
            outs.append(got)
    assert harness.replayer.completed == frames and harness.replayer.aborts == 0
    return harness, outs


@needs_loop
@pytest.mark.parametrize("model_name", ["cnn", "dethead", "transformer"])
def test_a_replayed_model_equals_its_forward_with_the_loop_and_without(tmp_path, monkeypatch,
                                                                      model_name):
    harness, with_loop = replayed(tmp_path / "native", model_name)
    counters = harness.executor.counters
    # every inference after the first ran most of its calls natively (the first calibrates)
    assert counters["native_runs"] >= 2 and counters["native_calls"] > counters["ops"] / 2
    monkeypatch.setenv("RRTO_NATIVE", "0")
    native.module.cache_clear()
    try:
        harness, without = replayed(tmp_path / "python", model_name)
        assert harness.executor.counters["native_calls"] == 0
    finally:
        monkeypatch.delenv("RRTO_NATIVE")
        native.module.cache_clear()
    for a, b in zip(with_loop, without, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@needs_loop
def test_a_run_waits_for_the_weight_the_app_binds_after_the_start(tmp_path):
    """A weight (PERSISTENT) is only bound when the shim names it, possibly after the start:
    a run that reads it waits like the one-by-one path, then reads the tensor bound, never
    the recorded id (the replay would otherwise end before the app's argument arrives)."""
    spec = MODELS["cnn"]
    model, x = spec.make(), spec.inputs(1)[0]
    d, constants, _ = hostloop.definition(model, x)
    harness = hostloop.Harness(d, constants, str(tmp_path))  # defines it with constants
    with torch.inference_mode():
        harness.replay(x)  # the run is calibrated
        harness.replay(x)
    # the same definition, its last weight now a PERSISTENT slot bound per replay
    weight = max(s.id for s in d.sources if s.kind == hostloop.SRC.CONSTANT)
    d2 = ops_pb2.SequenceDef()
    d2.CopyFrom(d)
    d2.id = 2
    slots = [i for i, s in enumerate(d2.sources) if s.id == weight]
    for i in slots:
        d2.sources[i].kind = hostloop.SRC.PERSISTENT
    downs: list[ops_pb2.SessionDown] = []
    harness.replayer.process(ops_pb2.SessionUp(define=d2), downs.append)
    assert downs.pop().defined.accepted
    halved = constants[weight] * 0.5
    harness.executor.store.put(7_000_000, halved)
    with torch.inference_mode():
        param = next(t for t in (*model.parameters(), *model.buffers())
                     if t is constants[weight])
        base = hostloop.REPLAY_BASE + 100 * hostloop.SPAN
        start = ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=2, base_id=base,
                                                           inference=base))
        harness.replayer.process(start, downs.append)
        harness.replayer.process(ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(
            slot=0, tensor=ops_pb2.TensorRef(upload=hostloop.codec.tensor_data(x)))),
            downs.append)
        assert harness.replayer.active is not None  # waits for the weight
        for i in slots:
            harness.replayer.process(ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(
                slot=i, tensor=ops_pb2.TensorRef(id=7_000_000))), downs.append)
        assert not [f for f in downs if f.WhichOneof("msg") == "error"]
        out = [i for i, r in enumerate(d2.local_ids) if r == d2.outputs[0]][0]
        pushed = {f.fetched.id: f.fetched.tensor for f in downs
                  if f.WhichOneof("msg") == "fetched"}
        got = hostloop.codec.from_tensor_data(pushed[base + out])
        param.mul_(0.5)
        assert torch.equal(got, model(x))
        # A later inference binds the slot to another tensor (a reloaded weight): the run
        # reads that one (what it knew of its weights is worked out again at a bind).
        harness.executor.store.put(7_000_001, param * 0.5)
        runs = harness.executor.counters["native_runs"]
        base += hostloop.SPAN
        downs.clear()
        for frame in (ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=2, base_id=base,
                                                                  inference=base)),
                      *(ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(
                          slot=i, tensor=ops_pb2.TensorRef(id=7_000_001))) for i in slots),
                      ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=ops_pb2.TensorRef(
                          upload=hostloop.codec.tensor_data(x))))):
            harness.replayer.process(frame, downs.append)
        assert not [f for f in downs if f.WhichOneof("msg") == "error"]
        pushed = {f.fetched.id: f.fetched.tensor for f in downs
                  if f.WhichOneof("msg") == "fetched"}
        param.mul_(0.5)
        assert torch.equal(hostloop.codec.from_tensor_data(pushed[base + out]), model(x))
        assert harness.executor.counters["native_runs"] > runs  # its runs went natively


class InPlace(torch.nn.Module):
    """Activations written in place, as torchvision's backbones do (``ReLU(inplace=True)``,
    ``Hardswish(inplace=True)``, a residual ``add_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8).eval()
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = torch.nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.bn(self.conv1(x)).relu_()
        z = self.conv2(y)
        z.add_(y)
        z = torch.nn.functional.hardswish(z, inplace=True)
        z = self.conv3(z).relu_()
        return z.mean(dim=(2, 3)), z


@needs_loop
def test_in_place_calls_run_natively_once_the_app_has_matched_them(tmp_path):
    """An in-place call in a run needs no snapshot once the app has matched it (its release
    frames say so: ``Release.progress``); while the app is behind, the run copies what each
    overwrites just before it (an abort would restore it). Both go natively, and outputs
    equal the forward's either way."""
    torch.manual_seed(3)
    model = InPlace().eval()
    frames = [torch.randn(1, 3, 16, 16) for _ in range(4)]
    with torch.inference_mode():
        d, constants, _ = hostloop.definition(model, frames[0].clone())
        assert sum(c.op in ("aten::relu_.default", "aten::add_.Tensor",
                            "aten::hardswish_.default") for c in d.calls) == 4
        harness = hostloop.Harness(d, constants, str(tmp_path))
        r, counters = harness.replayer, harness.executor.counters
        copied = ran_natively = 0
        for ahead in (False, False, True, True, False):
            for x in frames:
                got, _ = harness.replay(x, ahead=ahead)
                want = model(x.clone())
                assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
            if ahead:  # no copies
                assert r.snapshots == copied
            if ran_natively:  # after the calibrating replay, most calls ran in native runs
                assert counters["native_calls"] - ran_natively >= len(d.calls) * len(frames) // 2
            copied, ran_natively = r.snapshots, counters["native_calls"]
        assert r.snapshots == 3 * 4 * len(frames)  # behind: every in-place call copied
        assert r.snapshots_skipped == 2 * 4 * len(frames) and r.aborts == 0


# -- the executor's batch contract, with raw calls ----------------------------------------------
def op_call(op: str, *args: ops_pb2.Value, out: int | list[int]) -> ops_pb2.OpCall:
    outs = out if isinstance(out, list) else [out]
    return ops_pb2.OpCall(op=op, args=list(args), out_ids=outs)


def metas(call: ops_pb2.OpCall, *shapes: tuple[int, ...]) -> ops_pb2.OpCall:
    call.out_meta.extend(meta(list(shape)) for shape in shapes)
    return call


def batch_of(ex, calls: list[ops_pb2.OpCall], sources: list[list[int]], externals: int):
    b = ex.batch([ex.prepare(c) for c in calls], sources, externals)
    assert b is not None
    return b


@needs_loop
def test_an_out_of_bounds_view_stops_the_run_before_it_and_keeps_nothing_of_it(tmp_path):
    """``_reshape_alias`` does not check bounds itself: a 5-element view of the last 4 elements
    reaches one past its storage. The run keeps the calls before it; the Python path, running
    it next, reports BAD_VIEW."""
    ex = make(tmp_path, allow_all=True)
    ex.store.put(1, torch.arange(12.0))
    calls = [
        metas(op_call("aten::relu.default", ref(1), out=10), (12,)),
        metas(op_call("aten::slice.Tensor", ref(10), ops_pb2.Value(i=0), ops_pb2.Value(i=8),
                      out=11), (4,)),
        metas(op_call("aten::_reshape_alias.default", ref(11), ints(5), ints(1), out=12), (5,)),
        metas(op_call("aten::neg.default", ref(12), out=13), (5,)),
    ]
    b = batch_of(ex, calls, [[0], [-1], [-2], [-3]], 1)
    assert ex.run_batch(b, [1], [10, 11, 12, 13]) == 2  # relu and slice ran; the view did not
    assert 10 in ex.store and 11 in ex.store and 12 not in ex.store and 13 not in ex.store
    assert ex.store.pending == 0
    (err,) = ex.handle(ops_pb2.SessionUp(call=ops_pb2.OpCall(
        seq=1, op="aten::_reshape_alias.default", args=[ref(11), ints(5), ints(1)],
        out_ids=[12], sync=True)))
    assert err.error.code == "BAD_VIEW"


@needs_loop
def test_bytes_are_admitted_before_the_run_and_a_run_that_does_not_fit_runs_nothing(tmp_path):
    ex = make(tmp_path, quota=MiB)
    ex.store.put(1, torch.ones(64, 64))  # 16 KiB
    calls = [metas(op_call("aten::mul.Tensor", ref(1), ref(1), out=10 + j), (64, 64))
             for j in range(4)]
    b = batch_of(ex, calls, [[0, 0]] * 4, 1)
    assert ex.run_batch(b, [1], [10, 11, 12, 13]) == 4  # calibrates: 4 x 16 KiB admitted
    assert b.total == 4 * 64 * 64 * 4
    for i in (10, 11, 12, 13):
        ex.store.pop(i)
    live = ex.store.bytes_live
    ex.store.quota = live + 3 * 64 * 64 * 4  # room for three of the four
    assert ex.run_batch(b, [1], [10, 11, 12, 13]) == 0
    assert ex.store.bytes_live == live and ex.store.pending == 0 and 10 not in ex.store


@needs_loop
def test_inputs_of_other_sizes_are_calibrated_again_and_the_results_follow(tmp_path):
    ex = make(tmp_path)
    calls = [metas(op_call("aten::mm.default", ref(1), ref(2), out=10), (2, 2)),
             metas(op_call("aten::relu.default", ref(10), out=11), (2, 2)),
             metas(op_call("aten::chunk.default", ref(11), ops_pb2.Value(i=2), out=[12, 13]),
                   (1, 2), (1, 2)),
             metas(op_call("aten::cat.default", ops_pb2.Value(list=ops_pb2.ValueList(
                 items=[ref(13), ref(12)])), out=14), (2, 2))]
    b = batch_of(ex, calls, [[0, 1], [-1], [-2], [-4, -3]], 2)
    for n in (2, 2, 3):  # calibrated by the first, native for the second, again for the third
        a, w = torch.randn(n, 2), torch.randn(2, 2)
        ex.store.put(1, a)
        ex.store.put(2, w)
        runs = ex.counters["native_runs"]
        assert ex.run_batch(b, [1, 2], [10, 11, 12, 13, 14]) == 4
        assert ex.counters["native_runs"] == runs + 1
        half = (n + 1) // 2
        r = torch.relu(a @ w)
        assert torch.equal(ex.store.get(14), torch.cat([r[half:], r[:half]]))
        assert ex.store.get(14).shape == (n, 2)
    assert ex.store.pending == 0


@needs_loop
def test_values_the_app_let_go_of_are_dropped_after_their_last_use_never_stored(tmp_path):
    ex = make(tmp_path)
    calls = [metas(op_call("aten::relu.default", ref(1), out=10), (64,)),
             metas(op_call("aten::neg.default", ref(10), out=11), (64,)),
             metas(op_call("aten::exp.default", ref(11), out=12), (64,)),
             metas(op_call("aten::add.Tensor", ref(12), ref(10), out=13), (64,))]
    b = batch_of(ex, calls, [[0], [-1], [-2], [-3, -1]], 1)
    x = torch.randn(64)
    ex.store.put(1, x)
    want = torch.exp(-torch.relu(x)) + torch.relu(x)
    for first in (10, 20):  # calibrating, then native: the same values kept
        ids = [first, first + 1, first + 2, first + 3]
        # 11 after neg's reader (call 2), 12 after its reader (call 3): 12 is read by the last
        # call, so only 11 may go inside the run
        assert ex.run_batch(b, [1], ids, [(2, 1)]) == 4
        assert ids[1] not in ex.store and ids[0] in ex.store and ids[2] in ex.store
        assert torch.equal(ex.store.get(ids[3]), want)
    # a value dropped before a call that still reads it (neg reads relu's) stops the run there
    assert ex.run_batch(b, [1], [30, 31, 32, 33], [(0, 0)]) == 1
    assert 30 not in ex.store and 31 not in ex.store and ex.store.pending == 0


@needs_loop
def test_an_operator_that_raises_keeps_what_ran_before_it_and_nothing_of_itself(tmp_path):
    ex = make(tmp_path)
    calls = [metas(op_call("aten::relu.default", ref(1), out=10), (2, 3)),
             metas(op_call("aten::mm.default", ref(10), ref(2), out=11), (2, 2)),
             metas(op_call("aten::neg.default", ref(11), out=12), (2, 2)),
             metas(op_call("aten::neg.default", ref(12), out=13), (2, 2))]
    b = batch_of(ex, calls, [[0], [-1, 1], [-2], [-3]], 2)
    ex.store.put(1, torch.randn(2, 3))
    ex.store.put(2, torch.randn(3, 2))
    assert ex.run_batch(b, [1, 2], [10, 11, 12, 13]) == 4
    ex.store.put(2, torch.randn(4, 2))  # the weight now has the wrong shape: mm raises
    assert ex.run_batch(b, [1, 2], [20, 21, 22, 23]) == 1
    assert 20 in ex.store and 21 not in ex.store and ex.store.pending == 0


def selected(ex) -> object:
    """``exp(-x[x > 0])`` of an 8-element input as a run: the count follows the data."""
    calls = [metas(op_call("aten::gt.Scalar", ref(1), ops_pb2.Value(i=0), out=10), (8,)),
             metas(op_call("aten::index.Tensor", ref(1), ops_pb2.Value(list=ops_pb2.ValueList(
                 items=[ref(10)])), out=11), (3,)),
             metas(op_call("aten::neg.default", ref(11), out=12), (3,)),
             metas(op_call("aten::exp.default", ref(12), out=13), (3,))]
    return batch_of(ex, calls, [[0], [0, -1], [-2], [-3]], 1)


def positives(n: int) -> torch.Tensor:
    """8 values, the first ``n`` of them positive."""
    return torch.cat([torch.arange(1.0, n + 1), -torch.arange(1.0, 9 - n)])


@needs_loop
def test_an_output_that_follows_the_data_steps_the_run_on_from_where_it_differs(tmp_path):
    """``x[x > 0]`` is admitted at its bound (every element selected); when this inference
    selects another count than the calibrating one, the native run stops before it and the
    batch steps through it and the rest, each call admitted for its own sizes, with this
    inference's results; from then on its sizes follow the data, and it runs *bounded*: the
    most each call allocated when stepped is admitted, and the loop takes any sizes within."""
    ex = make(tmp_path)
    b = selected(ex)
    for first, x, varies in ((10, positives(3), False),
                             (20, positives(3).flip(0), False),
                             (30, positives(5), True),  # 5 now
                             (40, positives(3), True)):  # bounded: within what 5 took
        ex.store.put(1, x)
        assert ex.run_batch(b, [1], [first, first + 1, first + 2, first + 3]) == 4
        assert torch.equal(ex.store.get(first + 3), torch.exp(-x[x > 0]))
        assert b.varies is varies and ex.store.pending == 0
    assert ex.counters["native_calibrations"] == 2  # the first, the one that met 5
    assert ex.counters["bounded_runs"] == 1 and b.caps[2:] == [5 * 4, 5 * 4]


@needs_loop
def test_a_run_whose_inputs_take_other_sizes_each_inference_runs_bounded(tmp_path):
    """A calibrated run whose external tensor comes with other sizes (a mask head's boxes,
    every frame their own number) runs nothing natively and is stepped; from then on its
    sizes follow the data and it runs *bounded*, not stepped (and calibrated) every time."""
    ex = make(tmp_path)
    calls = [metas(op_call("aten::relu.default", ref(1), out=10), (3,)),
             metas(op_call("aten::neg.default", ref(10), out=11), (3,)),
             metas(op_call("aten::exp.default", ref(11), out=12), (3,))]
    b = batch_of(ex, calls, [[0], [-1], [-2]], 1)
    for first, n, varies in ((10, 3, False), (20, 5, True), (30, 4, True), (40, 5, True)):
        x = torch.randn(n)
        ex.store.put(1, x)
        assert ex.run_batch(b, [1], [first, first + 1, first + 2]) == 3
        assert torch.equal(ex.store.get(first + 2), torch.exp(-torch.relu(x)))
        assert b.varies is varies and ex.store.pending == 0
    assert ex.counters["native_calibrations"] == 2  # the first, and the one that met 5
    assert ex.counters["bounded_runs"] == 2  # 4 and 5 again: within what 5 took


@needs_loop
def test_a_bounded_run_stops_before_a_call_that_takes_more_than_it_ever_did(tmp_path):
    """A count above any stepped one: the bounded run keeps the calls before the first whose
    new outputs take more than its cap (``neg`` of 7 elements, against 5 before), and the
    batch steps from there, each call admitted for its own sizes; the caps grow, and the next
    such count runs bounded to its end. Admitted bytes are settled to what was stored."""
    ex = make(tmp_path)
    b = selected(ex)
    for first, n in ((10, 3), (20, 5), (30, 3)):  # calibrated, stepped (5), bounded
        ex.store.put(1, positives(n))
        assert ex.run_batch(b, [1], [first, first + 1, first + 2, first + 3]) == 4
    steps = ex.counters["native_calibrations"]
    ex.store.put(1, positives(7))
    assert ex.run_batch(b, [1], [40, 41, 42, 43]) == 4
    assert ex.counters["native_calibrations"] == steps + 1  # stepped from ``neg`` on
    assert torch.equal(ex.store.get(43), torch.exp(-positives(7)[:7]))
    assert b.caps[2:] == [7 * 4, 7 * 4] and ex.store.pending == 0
    runs = ex.counters["bounded_runs"]
    ex.store.put(1, positives(6))
    assert ex.run_batch(b, [1], [50, 51, 52, 53]) == 4
    assert ex.counters["bounded_runs"] == runs + 1 and ex.counters["native_calibrations"] == steps + 1
    assert torch.equal(ex.store.get(53), torch.exp(-positives(6)[:6]))
    live = ex.store.bytes_live
    for i in range(50, 54):
        ex.store.pop(i)
    assert ex.store.bytes_live < live and ex.store.pending == 0


@needs_loop
def test_a_bounded_run_whose_caps_do_not_fit_the_quota_is_stepped(tmp_path):
    """Caps are the most each call ever took: where their sum does not fit what the quota
    leaves, the run is stepped, each call admitted for its own (smaller) sizes."""
    ex = make(tmp_path)
    b = selected(ex)
    for first, n in ((10, 3), (20, 8), (30, 3)):  # a frame selecting all 8 raises the caps
        ex.store.put(1, positives(n) if n < 8 else torch.arange(1.0, 9))
        assert ex.run_batch(b, [1], [first, first + 1, first + 2, first + 3]) == 4
    assert ex.counters["bounded_runs"] == 1  # the last, within what 8 took
    for i in range(10, 34):
        ex.store.pop(i)
    runs, steps = ex.counters["bounded_runs"], ex.counters["native_calibrations"]
    ex.store.put(1, positives(1))
    ex.store.quota = ex.store.bytes_live + sum(b.caps) - 1
    assert ex.run_batch(b, [1], [40, 41, 42, 43]) == 4  # one selected: fits, stepped
    assert ex.counters["bounded_runs"] == runs and ex.counters["native_calibrations"] == steps + 1
    assert torch.equal(ex.store.get(43), torch.exp(-torch.ones(1))) and ex.store.pending == 0


def test_calls_the_loop_cannot_hold_stay_on_the_python_path(tmp_path):
    """A write in place of an argument the operator does not return (a batch norm's running
    statistics: the loop checks only what calls return). An in-place call that returns what it
    writes (``relu_``) can run in the loop, as can a number where the schema says Tensor."""
    ex = make(tmp_path)
    ex.allow = AllowAll()
    for i, t in enumerate((torch.ones(1, 3, 4), torch.ones(3), torch.zeros(3), torch.zeros(3),
                           torch.ones(3)), start=1):
        ex.store.put(i, t)
    stats = metas(op_call("aten::_native_batch_norm_legit.default", *(ref(i) for i in range(1, 6)),
                          ops_pb2.Value(b=True), ops_pb2.Value(f=0.1), ops_pb2.Value(f=1e-5),
                          out=[10, 11, 12]), (1, 3, 4), (3,), (3,))
    assert not ex.batchable(ex.prepare(stats))
    assert ex.batchable(ex.prepare(metas(op_call("aten::div.Tensor", ref(2), ops_pb2.Value(i=2),
                                                 out=10), (3,)))) is built
    relu_ = metas(op_call("aten::relu_.default", ref(2), out=2), (3,))
    assert ex.batchable(ex.prepare(relu_)) is built
    assert ex.batchable(ex.prepare(metas(op_call("aten::div.Scalar", ref(2), ops_pb2.Value(i=2),
                                                 out=10), (3,)))) is built
    assert os.environ.get("RRTO_NATIVE") is None


def _masked_loop(ex):
    """A detector's per-class NMS step in miniature, on externals x (8,), keep (8,) bool,
    acc (8,) and one (a bool scalar): ``m = x > 0``, its indices (answered: the app needs
    their count, and describes no layout for them), ``x[m]``, ``keep[m] = one`` and
    ``acc += x`` (both in place)."""
    mask = ops_pb2.Value(list=ops_pb2.ValueList(items=[ref(10)]))
    calls = [metas(op_call("aten::gt.Scalar", ref(1), ops_pb2.Value(i=0), out=10), (8,)),
             op_call("aten::nonzero.default", ref(10), out=11),  # answered: no layout
             metas(op_call("aten::index.Tensor", ref(1), mask, out=12), (3,)),
             metas(op_call("aten::index_put_.default", ref(2), mask, ref(4), out=2), (8,)),
             metas(op_call("aten::add_.Tensor", ref(3), ref(1), out=3), (8,))]
    return calls, batch_of(ex, calls, [[0], [-1], [0, -1], [1, -1, 3], [2, 0]], 4)


@needs_loop
def test_a_run_answers_its_answered_calls_and_copies_what_it_overwrites(tmp_path):
    """Answered and in-place calls inside a run, native and stepped: the app gets each
    answer as the call ran, the very reply the one-by-one path gives (``want_meta``); what
    each in-place call overwrites is copied just before it (an abort restores it); outputs
    equal eager ones. A count that changes within the run steps it from there on."""
    ex = make(tmp_path)
    calls, b = _masked_loop(ex)
    for frame, x in enumerate((torch.tensor([1., -1, 2, -2, 3, -3, -4, -5]),  # calibrates
                               torch.tensor([-1., 1, -2, 2, -3, 3, -4, -5]),  # native
                               torch.tensor([1., 1, 1, 1, -3, 3, -4, -5]))):  # 5: steps on
        keep, acc = torch.zeros(8, dtype=torch.bool), torch.arange(8.0)
        for i, t in ((1, x), (2, keep), (3, acc), (4, torch.tensor(True))):
            ex.store.put(i, t)
        first = 100 * (frame + 1)
        out_ids = [first + j for j in range(5)]
        answers: list[tuple[int, ops_pb2.OpResult]] = []
        snapshots: list = []
        calibrations = ex.counters["native_calibrations"]
        assert ex.run_batch(b, [1, 2, 3, 4], out_ids, writes=[3, 4], answered=[1],
                            on_answer=lambda j, r, into=answers: into.append((j, r)),
                            snapshots=snapshots) == 5
        assert ex.counters["native_calibrations"] == calibrations + (frame != 1)
        assert torch.equal(ex.store.get(first + 2), x[x > 0])
        assert torch.equal(keep, x > 0) and torch.equal(acc, torch.arange(8.0) + x)
        # the answer, as the one-by-one path replies it to the same call
        other = make(tmp_path / f"one-{frame}")
        other.store.put(10, x > 0)
        (reply,) = other.run_prepared(other.prepare(calls[1]), [10], [first + 1],
                                      want_meta=True)
        assert answers == [(1, reply.result)]
        assert [j for j, _ in snapshots] == [3, 4]
        for _j, token in reversed(snapshots):  # an abort before the in-place calls
            ex.restore(token)
        assert not keep.any() and torch.equal(acc, torch.arange(8.0))
        assert ex.store.pending == 0
    assert b.varies


@needs_loop
def test_an_abort_inside_a_native_run_leaves_what_the_one_by_one_path_leaves(tmp_path,
                                                                             monkeypatch):
    """The host ran a whole inference ahead of an app that then differed between two in-place
    calls of one native run: the first's write stays, the later ones are undone (their
    copies, taken in the run), exactly as the one-by-one path (``RRTO_NATIVE=0``) leaves it,
    and the value written in place is what forwarding would have left."""
    torch.manual_seed(3)
    model = InPlace().eval()
    frames = [torch.randn(1, 3, 16, 16) for _ in range(2)]
    with torch.inference_mode():
        d, constants, _ = hostloop.definition(model, frames[0].clone())
    in_place = [k for k, c in enumerate(d.calls)
                if c.op in ("aten::relu_.default", "aten::add_.Tensor", "aten::hardswish_.default")]
    position = in_place[1]  # the app matched the first relu_, not the add_
    left = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("RRTO_NATIVE", setting)
        native.module.cache_clear()
        harness = hostloop.Harness(d, constants, str(tmp_path / setting))
        r, counters = harness.replayer, harness.executor.counters
        base = hostloop.REPLAY_BASE + 2 * hostloop.SPAN
        downs: list[ops_pb2.SessionDown] = []
        with torch.inference_mode():
            harness.replay(frames[0], ahead=False)  # calibrates the runs
            ran, copied = counters["native_calls"], r.snapshots
            for frame in (ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=1, base_id=base,
                                                                     inference=base)),
                          ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=ops_pb2.TensorRef(
                              upload=hostloop.codec.tensor_data(frames[1]))))):
                r.process(frame, downs.append)
            assert r.active is None and r.snapshots - copied == len(in_place)
            if setting == "1":  # the in-place calls ran in native runs, copied there
                assert counters["native_calls"] - ran >= len(d.calls) // 2
            r.process(ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=position)),
                      downs.append)
        assert not [f for f in downs if f.WhichOneof("msg") == "error"]
        store = harness.executor.store
        left[setting] = {i: store.get(i).clone() for i in range(base, base + hostloop.SPAN)
                         if store.get(i) is not None}
    monkeypatch.delenv("RRTO_NATIVE")
    native.module.cache_clear()
    assert left["1"].keys() == left["0"].keys() and left["1"]
    assert all(torch.equal(left["1"][i], left["0"][i]) for i in left["1"])
    with torch.inference_mode():  # z = conv2(y) as it was before its add_
        y = model.bn(model.conv1(frames[1])).relu()
        z = model.conv2(y)
    written = base + list(d.local_ids).index(d.calls[position].out_ids[0])
    assert torch.allclose(left["1"][written], z)


@needs_loop
def test_a_number_where_the_schema_says_tensor_promotes_as_a_python_scalar(tmp_path):
    """``x * 0.5`` records ``mul.Tensor(x, 0.5)``: the loop makes the number the tensor
    Python's argument parser makes (a wrapped number), so dtypes promote as on the one-by-one
    path: a 0-dim float32 times 0.5 stays float32 (a plain float64 tensor would make it
    float64), int64 / 2 is float32, float16 + 1 stays float16, times True stays float32."""
    ex = make(tmp_path)
    x0, ints, halves = torch.tensor(3.0), torch.arange(3), torch.ones(3, dtype=torch.float16)
    for i, t in ((1, x0), (2, ints), (3, halves)):
        ex.store.put(i, t)
    calls = [metas(op_call("aten::mul.Tensor", ref(1), ops_pb2.Value(f=0.5), out=10), ()),
             metas(op_call("aten::div.Tensor", ref(2), ops_pb2.Value(i=2), out=11), (3,)),
             metas(op_call("aten::add.Tensor", ref(3), ops_pb2.Value(i=1), out=12), (3,)),
             metas(op_call("aten::mul.Tensor", ref(10), ops_pb2.Value(b=True), out=13), ())]
    b = batch_of(ex, calls, [[0], [1], [2], [-1]], 3)
    want = [x0 * 0.5, ints / 2, halves + 1, x0 * 0.5 * True]
    for first in (20, 30):  # calibrating, then native
        assert ex.run_batch(b, [1, 2, 3], [first + j for j in range(4)]) == 4
        for j, w in enumerate(want):
            got = ex.store.get(first + j)
            assert got.dtype == w.dtype and torch.equal(got, w)
    assert ex.counters["native_calibrations"] == 1


@needs_loop
def test_bytes_the_definition_holds_are_decoded_for_a_native_run(tmp_path, monkeypatch):
    """A tensor the app makes anew each inference with the same bytes (``x * torch.tensor(
    0.5)``; ``SeqSource.fixed``: its upload is in the definition) is an external of the run,
    so the calls reading it run natively; the app's own input still waits for its upload.
    Its bytes are decoded once (``fixed_upload``); each inference gets a copy of its own,
    bound to its id as the one-by-one path binds it, so an in-place write by the app into
    one inference's copy is not in the next. Outputs equal eager ones."""
    decoded = []
    decode = hostloop.codec.from_tensor_data
    monkeypatch.setattr(hostloop.codec, "from_tensor_data",
                        lambda msg, *a: decoded.append(tuple(msg.meta.shape)) or decode(msg, *a))
    ex = make(tmp_path)
    r = hostloop.HostReplayer(ex)
    half, offsets = torch.tensor(0.5), torch.tensor([1.0, 2.0, 3.0])
    d = ops_pb2.SequenceDef(id=1, local_ids=[1, 2, 3, 4, 5, 6, 7], outputs=[7])

    def upload(t: torch.Tensor, fixed: bool, bind: int = 0) -> ops_pb2.Value:
        d.sources.add(kind=ops_pb2.SeqSource.INPUT, fixed=fixed)
        return ops_pb2.Value(tensor=ops_pb2.TensorRef(upload=hostloop.codec.tensor_data(t),
                                                      bind_id=bind))

    def produced(i: int) -> ops_pb2.Value:
        d.sources.add(kind=ops_pb2.SeqSource.PRODUCED, id=i)
        return ref(i)

    x0 = torch.randn(3)
    d.calls.extend([
        metas(op_call("aten::relu.default", upload(x0, False, bind=1), out=2), (3,)),
        metas(op_call("aten::mul.Tensor", produced(2), upload(half, True), out=3), (3,)),
        metas(op_call("aten::add.Tensor", produced(3), upload(offsets, True, bind=4), out=5),
              (3,)),
        metas(op_call("aten::sub.Tensor", produced(5), produced(4), out=6), (3,)),
        metas(op_call("aten::exp.default", produced(6), out=7), (3,))])
    downs: list[ops_pb2.SessionDown] = []
    r.process(ops_pb2.SessionUp(define=d), downs.append)
    assert downs.pop().defined.accepted
    for n in range(1, 4):
        x = torch.randn(3)
        base = hostloop.REPLAY_BASE + n * hostloop.SPAN
        before = ex.counters["native_calls"]
        for frame in (ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=1, base_id=base,
                                                                 inference=base)),
                      ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=ops_pb2.TensorRef(
                          upload=hostloop.codec.tensor_data(x))))):
            r.process(frame, downs.append)
        assert not [f for f in downs if f.WhichOneof("msg") == "error"]
        pushed = {f.fetched.id: f.fetched.tensor for f in downs if f.WhichOneof("msg") == "fetched"}
        want = torch.exp(x.relu() * half + offsets - offsets)
        assert torch.equal(decode(pushed[base + 6]), want)
        assert ex.counters["native_calls"] - before == 4  # all but the call reading the input
        assert torch.equal(ex.store.get(base + 3), offsets)  # the bound copy, as the app's
        ex.store.get(base + 3).add_(100.0)  # the app writes its copy in place afterwards
    # the app's input each inference, the definition's two fixed uploads once
    assert sorted(decoded) == sorted([(3,)] * 3 + [(), (3,)])


@needs_loop
def test_a_fixed_upload_whose_bytes_do_not_fit_its_meta_is_refused_as_on_the_python_path(
        tmp_path):
    """The definition's bytes come from the network: a fixed upload whose meta names more
    elements than its data holds is not decoded into a run (the run runs nothing); the
    one-by-one path then refuses it with ``BAD_FRAME`` at that call, every inference, and the
    session goes on (nothing charged, no exception)."""
    ex = make(tmp_path)
    r = hostloop.HostReplayer(ex)
    d = ops_pb2.SequenceDef(id=1, local_ids=[1, 2, 3, 4, 5, 6], outputs=[6])

    def produced(i: int) -> ops_pb2.Value:
        d.sources.add(kind=ops_pb2.SeqSource.PRODUCED, id=i)
        return ref(i)

    d.sources.add(kind=ops_pb2.SeqSource.INPUT)
    x_ref = ops_pb2.Value(tensor=ops_pb2.TensorRef(
        upload=hostloop.codec.tensor_data(torch.randn(3)), bind_id=1))
    bad = hostloop.codec.tensor_data(torch.ones(3))
    bad.meta.shape[:] = [4]  # four floats named, three sent
    bad.meta.stride[:] = [1]
    d.calls.append(metas(op_call("aten::relu.default", x_ref, out=2), (3,)))
    relu = produced(2)  # the sources in argument order
    d.sources.add(kind=ops_pb2.SeqSource.INPUT, fixed=True)
    d.calls.append(metas(op_call("aten::add.Tensor", relu,
                                 ops_pb2.Value(tensor=ops_pb2.TensorRef(upload=bad)), out=3), (3,)))
    d.calls.extend([metas(op_call("aten::neg.default", produced(3), out=4), (3,)),
                    metas(op_call("aten::exp.default", produced(4), out=5), (3,)),
                    metas(op_call("aten::neg.default", produced(5), out=6), (3,))])
    downs: list[ops_pb2.SessionDown] = []
    r.process(ops_pb2.SessionUp(define=d), downs.append)
    assert downs.pop().defined.accepted
    for n in (1, 2):
        base = hostloop.REPLAY_BASE + n * hostloop.SPAN
        for frame in (ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=1, base_id=base,
                                                                 inference=base)),
                      ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=ops_pb2.TensorRef(
                          upload=hostloop.codec.tensor_data(torch.randn(3)))))):
            r.process(frame, downs.append)
        errors = [f.error for f in downs if f.WhichOneof("msg") == "error"]
        assert [e.code for e in errors] == ["BAD_FRAME"] and errors[0].position == 1
        downs.clear()
    assert ex.counters["native_calls"] == 0 and ex.store.pending == 0


@pytest.mark.parametrize("op, outs", [
    (torch.ops.aten.nonzero.default, [torch.tensor([[0], [2]])]),  # one tensor
    (torch.ops.aten.where.default, [torch.tensor([1, 3])]),  # a list (Tensor[]) of one
    (torch.ops.aten.where.default, []),  # an empty list still says it is one
    (torch.ops.aten.sort.default, [torch.tensor([1.0, 2.0]), torch.tensor([1, 0])]),  # a tuple
])
def test_an_answer_built_in_place_is_the_encoded_result(op, outs):
    """The native loop's answer to a call (``executor._answer``, built in place) is what the
    codec encodes for the value the operator returned, each tensor by its id in order, with
    every output's metadata."""
    from rrto_plugins.torch import codec
    from rrto_plugins.torch.executor import _answer

    ids = [100 + i for i in range(len(outs))]
    returns = op._schema.returns
    value = (outs[0] if len(returns) == 1 and str(returns[0].type) == "Tensor"
             else list(outs) if len(returns) == 1 else tuple(outs))
    want = ops_pb2.OpResult(seq=0, outs=[codec.meta_of(t) for t in outs])
    by_id = {id(t): i for t, i in zip(outs, ids, strict=True)}
    codec.encode_value(value, want.value, lambda t: ops_pb2.TensorRef(id=by_id[id(t)]))
    assert _answer(op, outs, ids) == want


@needs_loop
@pytest.mark.parametrize("asks", [True, False])
def test_a_run_asks_again_between_its_calls_when_its_answers_want(tmp_path, asks):
    """``on_answer`` returns when it wants to be asked again (the transport holds replies to
    share a message until then): a run still going at that time calls ``on_answer(-1,
    None)`` before its next call, stepped and native alike, and not again unless asked; a
    hook that asks for nothing is called only for the answers."""
    ex = make(tmp_path)
    calls = [op_call("aten::nonzero.default", ref(1), out=10),  # answered
             metas(op_call("aten::gt.Scalar", ref(1), ops_pb2.Value(i=0), out=11), (8,)),
             op_call("aten::nonzero.default", ref(11), out=12)]  # answered
    b = batch_of(ex, calls, [[0], [0], [-2]], 1)
    for frame in range(2):  # calibrates (stepped), then native
        ex.store.put(1, torch.tensor([1., -1, 2, -2, 3, -3, 0, 5]))
        asked: list[int] = []

        def on_answer(j, result, asked=asked):
            asked.append(j)
            assert (result is None) == (j < 0)
            return time.monotonic() - 1.0 if asks and j >= 0 else 0.0

        first = 100 * (frame + 1)
        calibrations = ex.counters["native_calibrations"]
        assert ex.run_batch(b, [1], [first, first + 1, first + 2], answered=[0, 2],
                            on_answer=on_answer) == 3
        assert ex.counters["native_calibrations"] == calibrations + (frame == 0)
        assert asked == ([0, -1, 2] if asks else [0, 2])
        for i in (first, first + 1, first + 2):
            ex.store.pop(i)


def test_the_gpu_daemons_paced_executor_offers_every_optional_method_the_executor_has(tmp_path):
    """The GPU daemon hands its replayer the executor through ``_PacedReplay``; an optional
    method of ``rrtod.executor.ReplayExtension`` it does not pass on is silently not used
    (the replayer asks with ``getattr``): ``fixed_upload`` once was not."""
    from rrtod.gpu.service import _PacedReplay

    ex = make(tmp_path)
    paced = _PacedReplay(ex, lambda run, *args: run(*args))
    optional = ("release", "dense_sizes", "synchronize", "rows", "run_rows", "batchable",
                "batch", "run_batch", "fixed_upload")
    offered = [name for name in optional if getattr(ex, name, None) is not None]
    assert "fixed_upload" in offered and "run_batch" in offered
    assert [name for name in offered if getattr(paced, name, None) is None] == []


@needs_loop
def test_a_joined_inference_runs_the_rest_in_native_runs_on_the_apps_values(tmp_path):
    """A start that joins an inference at call ``p`` (the app made calls ``0..p-1``' values
    itself; they are live under its ids) runs calls ``p..`` in native runs as any replay does,
    reading those values by the app's ids; the outputs equal the forward's."""
    spec = MODELS["cnn"]
    model, x = spec.make(), spec.inputs(1)[0]
    d, constants, _ = hostloop.definition(model, x)
    harness = hostloop.Harness(d, constants, str(tmp_path))
    x0, x1 = spec.inputs(2, seed=3)
    harness.replay(x0)  # calibrates the runs
    r, ex = harness.replayer, harness.executor
    local = {rid: i for i, rid in enumerate(d.local_ids)}
    p = len(d.calls) // 2
    # the app's values for x1 (a whole replay under base ``app``, nothing released)
    app = hostloop.REPLAY_BASE + 50 * hostloop.SPAN
    downs: list[ops_pb2.SessionDown] = []
    for frame in (ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=1, base_id=app,
                                                             inference=app)),
                  ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=ops_pb2.TensorRef(
                      upload=hostloop.codec.tensor_data(x1))))):
        r.process(frame, downs.append)
    joined = {0: app}
    joined.update({local[o]: app + local[o] for call in d.calls[:p] for o in call.out_ids})
    base = hostloop.REPLAY_BASE + 51 * hostloop.SPAN
    before = dict(ex.counters)
    downs.clear()
    r.process(ops_pb2.SessionUp(start=ops_pb2.ReplayStart(
        sequence=1, base_id=base, inference=base, position=p, joined=joined)), downs.append)
    assert not [f for f in downs if f.WhichOneof("msg") == "error"]
    assert ex.counters["native_calls"] - before["native_calls"] >= (len(d.calls) - p) // 2
    pushed = {f.fetched.id: f.fetched.tensor for f in downs if f.WhichOneof("msg") == "fetched"}
    with torch.inference_mode():
        want = [o for o in torch.utils._pytree.tree_flatten(model(x1))[0]
                if isinstance(o, torch.Tensor)]
    got = [hostloop.codec.from_tensor_data(pushed[base + i]) for i in harness.outputs]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
