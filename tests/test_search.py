"""Sequence search on synthetic op logs built as the relay records them (SessionUp frames)."""

from __future__ import annotations

import random
import struct
import time

import pytest

from rrto.v1 import ops_pb2
from rrto_plugins.search.dds import DataDependencySearch
from rrto_plugins.search.period import PeriodSearch, tail_periods, z_function
from rrtod.gpu.replay import compile_sequence
from rrtod.loops import unroll
from rrtod.robot.oplog import OpLog, with_loose_keys
from rrtod.robot.recorder import build_definition
from rrtod.robot.search import Candidate, best, paired, search_log, verify
from rrtod.robot.shapes import VALUE
from testkit.frames import W1, W2, W3, App, cnn

SRC = ops_pb2.SeqSource


def dds_found(app: App):
    return best(app.log.entries(), DataDependencySearch())


def test_static_model_found_after_two_inferences():
    app = App()
    cnn(app)
    assert dds_found(app)[0] is None  # one inference is not a pattern
    cnn(app)
    found, _ = dds_found(app)
    assert found is not None and found.start == 0 and found.period == 7 and found.repeats == 2
    assert found.inputs == [(0, 0)]  # the image upload
    assert found.outputs == [(4, 0), (5, 0), (6, 0)]  # several downloads in one inference
    assert found.sources[(3, 1)] == ("produced", (1, 0))  # residual add reads relu's output


def test_initialisation_prefix_with_a_constant_grid():
    app = App()
    (g,) = app.call("aten::arange", "n")  # built on the first call, cached by the model
    (grid,) = app.call("aten::stack", g)
    for _ in range(3):
        cnn(app, grid=grid)
    found, _ = dds_found(app)
    assert found is not None and found.start == 2 and found.period == 8
    assert found.sources[(4, 1)] == ("constant", grid)
    assert found.found_at == 3  # the grid was built by the first inference


def _grid_inference(app: App, grid: int | None, *, other: bool = False,
                    mark: bool = True) -> int:
    """One inference of a model that builds its grid on its first call (reading the feature
    map for its size) and keeps it; ``other``: a later inference that adds the feature map to
    itself instead, in place of the grid; ``mark``: its mark has come (with the next call)."""
    (x,) = app.call("aten::conv2d", "img", W1)
    (x,) = app.call("aten::relu", x)
    if grid is None:
        (g,) = app.call("aten::arange", x)
        (grid,) = app.call("aten::stack", g)
    (y,) = app.call("aten::add.Tensor", x, x if other else grid)
    (y,) = app.call("aten::sigmoid", y)
    app.fetch(y)
    if mark:
        app.log.mark(0)
    return grid


def test_a_first_inference_that_builds_a_cache_is_the_first_repetition():
    """With the shim's marks, an app whose first inference builds what the next ones reuse
    (an anchor grid) is found after two inferences, not three: the first one, its extra calls
    moved before it, is the steady state's first repetition, and the grid a constant of it.
    The definition is the steady state's calls."""
    app = App()
    grid = _grid_inference(app, None)
    entries, starts = app.log.entries(), app.log.inference_starts()
    assert search_log(entries, DataDependencySearch(), starts=starts).found is None
    _grid_inference(app, grid)
    entries, starts = app.log.entries(), app.log.inference_starts()
    assert starts == [6, 10]
    assert search_log(entries, DataDependencySearch()).found is None  # no marks: needs three
    found = search_log(entries, DataDependencySearch(), starts=starts).found
    assert found is not None and found.period == 4 and found.found_at == 2
    assert found.sources[(2, 1)] == ("constant", grid)
    d = build_definition(found.entries, found, app.log.persistent_bindings(), 1, 0)
    assert [c.op for c in d.calls] == ["aten::conv2d", "aten::relu", "aten::add.Tensor",
                                       "aten::sigmoid"]
    assert [s.kind for s in d.sources][3:5] == [SRC.PRODUCED, SRC.CONSTANT]
    assert [e.op for e in entries[2:4]] == ["aten::arange", "aten::stack"]  # left as it was


def test_a_first_inference_with_extra_calls_is_found_at_the_seconds_last_download():
    """The search at the second inference's last download runs before that inference's mark
    (it comes with the next call): the log's end is taken as where it ends. A download inside
    an inference looks the same, but then the first inference would be the part of it so far
    plus extra calls at its end: never taken."""
    app = App()
    grid = _grid_inference(app, None)
    _grid_inference(app, grid, mark=False)
    found = search_log(app.log.entries(), DataDependencySearch(),
                       starts=app.log.inference_starts()).found
    assert found is not None and found.period == 4 and found.found_at == 2
    app = App()
    grid = _grid_inference(app, None)
    (x,) = app.call("aten::conv2d", "img", W1)
    (x,) = app.call("aten::relu", x)
    app.fetch(x)  # the second inference reads a value halfway
    assert search_log(app.log.entries(), DataDependencySearch(),
                      starts=app.log.inference_starts()).found is None


def test_a_first_inference_whose_extra_value_is_not_reused_is_no_repetition():
    """The second inference reads, where the first read its grid, a value of its own: the
    first is not a repetition of it, and nothing is found from two inferences."""
    app = App()
    _grid_inference(app, None)
    _grid_inference(app, None, other=True)
    entries = app.log.entries()
    assert search_log(entries, DataDependencySearch(),
                      starts=app.log.inference_starts()).found is None


def test_value_carried_across_inferences_is_not_a_sequence():
    app = App()
    (h,) = app.call("aten::zeros", "shape")
    for _ in range(4):
        (x,) = app.call("aten::linear", "obs", W1)
        (h,) = app.call("aten::gru_cell", x, h)  # hidden state from the previous inference
        (a,) = app.call("aten::linear", h, W2)
        app.fetch(a)
    found, rejected = dds_found(app)
    assert found is None


def test_data_dependent_control_flow_is_never_verified_wrongly():
    rng = random.Random(3)
    app = App()
    for _ in range(12):
        (x,) = app.call("aten::conv2d", "img", W1)
        (s,) = app.call("aten::sum", x)
        app.fetch(s)  # the app branches on this value
        branch = rng.random() < 0.5
        (y,) = app.call("aten::relu" if branch else "aten::sigmoid", x)
        app.fetch(y)
    log = app.log.entries()
    for search in (DataDependencySearch(), PeriodSearch()):
        for cand in search.candidates(log):
            found = verify(log, cand)
            if found is None:
                continue
            # Whatever is accepted must really repeat: every copy has the same keys.
            for r in range(found.repeats):
                block = log[found.start + r * found.period: found.start + (r + 1) * found.period]
                assert [e.key for e in block] == found.keys


def test_verify_rejects_a_phase_that_cuts_an_inference():
    app = App()
    for _ in range(3):
        cnn(app)
    log = app.log.entries()
    assert verify(log, Candidate(0, 7)) is not None
    assert verify(log, Candidate(1, 7)) is None  # reads the image conv of the previous block
    assert verify(log, Candidate(0, 4)) is None


def test_period_search_finds_it_too_and_counts_false_positives():
    app = App()
    for _ in range(3):
        cnn(app)
    found, rejected = best(app.log.entries(), PeriodSearch())
    assert found is not None and (found.start, found.period) == (0, 7)
    # A warm-up inference whose first call differs (another input size): the periodic tail
    # reaches one call into it, so the first phase proposed cuts an inference in two.
    app2 = App()
    (x,) = app2.call("aten::conv2d", "img", W1, scalar=1.0)
    (x,) = app2.call("aten::relu", x)
    (y,) = app2.call("aten::conv2d", x, W2)
    (y,) = app2.call("aten::add.Tensor", y, x)
    boxes, scores = app2.call("aten::split", y, outs=2)
    (scores,) = app2.call("aten::sigmoid", scores)
    app2.call("aten::topk", scores, W3)
    for _ in range(3):
        cnn(app2)
    found, rejected = best(app2.log.entries(), PeriodSearch())
    assert found is not None and (found.start, found.period) == (7, 7)
    assert rejected >= 1  # the cut phase was proposed and refused by verification


def test_z_function_and_tail_periods():
    assert z_function([1, 2, 1, 2, 1]) == [5, 0, 3, 0, 1]
    keys = [9, 9, 1, 2, 3, 1, 2, 3, 1, 2, 3]
    assert tail_periods(keys)[0] == (3, 9)


def test_oplog_is_bounded_and_keeps_the_recent_steady_state():
    app = App()
    app.log.max_calls = 64
    for _ in range(20):
        cnn(app)
    assert len(app.log) <= 64 and app.log.truncated > 0
    found, _ = dds_found(app)
    assert found is not None and found.period == 7


@pytest.mark.parametrize("ops_per_inference", [100, 1000])
def test_ten_thousand_op_logs(ops_per_inference):
    app = App()
    inferences = 10_000 // ops_per_inference
    for _ in range(inferences):
        (x,) = app.call("aten::conv2d", "img", W1)
        for i in range(ops_per_inference - 2):
            (x,) = app.call(f"aten::op{i % 7}", x, scalar=float(i % 3))
        (y,) = app.call("aten::linear", x, W2)
        app.fetch(y)
    t0 = time.perf_counter()
    found, _ = dds_found(app)
    elapsed = time.perf_counter() - t0
    assert found is not None and found.period == ops_per_inference
    print(f"dds on {len(app.log)} ops: {elapsed * 1e3:.1f} ms")  # reported by the benchmark


def gru_step(app: App) -> None:
    """The shape of nn.GRU's gates: a split, then in-place ``add_``/``sigmoid_`` on a part (the
    id the op returns is the one it wrote) read again by the next op of the same inference."""
    (x,) = app.call("aten::linear", "obs", W1)
    (g,) = app.call("aten::addmm", x, W2)
    a, b = app.call("aten::unsafe_split", g, outs=2)
    app.call("aten::add_.Tensor", a, b, out_ids=[a])
    app.call("aten::sigmoid_", a, out_ids=[a])
    (y,) = app.call("aten::mul.Tensor", a, x)
    app.fetch(y)


def test_in_place_writes_inside_an_inference_are_replayable():
    """The GRU bug: reads resolved to an id's last writer in the whole log, so ``sigmoid_``
    reading what ``add_`` wrote just before looked like a value from the next inference."""
    app = App()
    for _ in range(3):
        gru_step(app)
    log = app.log.entries()
    found = verify(log, Candidate(0, 6))
    assert found is not None and found.repeats == 3
    assert found.sources[(4, 0)] == ("produced", (3, 0))  # sigmoid_ reads add_'s write
    assert found.sources[(3, 0)] == ("produced", (2, 0))  # add_ reads the split
    for search in (DataDependencySearch(), PeriodSearch()):
        found, _ = best(log, search)
        assert found is not None and (found.start, found.period) == (0, 6)


def test_buffer_updated_in_place_every_inference_is_a_constant():
    """A buffer that exists before the steady state and is written in place (a counter, a
    running statistic) keeps its id: the host updates it exactly as forwarding does."""
    app = App()
    (count,) = app.call("aten::zeros", "shape")
    for _ in range(3):
        (x,) = app.call("aten::linear", "obs", W1)
        app.call("aten::add_.Tensor", count, scalar=1.0, out_ids=[count])
        (y,) = app.call("aten::mul.Tensor", x, count)
        app.fetch(y)
    found, _ = dds_found(app)
    assert found is not None and (found.start, found.period) == (1, 3)
    assert found.sources[(1, 0)] == ("constant", count)
    assert found.sources[(2, 1)] == ("produced", (1, 0))


def test_dds_proposes_starts_after_downloads_first():
    """A warm-up inference that binds its weights: the periodic tail reaches into it, but the
    call right after its last download is proposed first, so nothing is rejected."""
    app = App()
    app.call("aten::alias", W1)  # weights named once, in the first inference
    app.call("aten::alias", W2)
    for _ in range(3):
        cnn(app)
    log = app.log.entries()
    assert [e.index for e in log if e.after_fetch] == [9, 16]
    found, rejected = best(log, DataDependencySearch())
    assert found is not None and (found.start, found.period) == (2, 7) and rejected == 0


def test_search_gives_up_when_its_time_budget_runs_out():
    class Slow:
        def candidates(self, log):
            for s in range(len(log)):
                time.sleep(0.02)
                yield Candidate(s, 1)  # never verifies

    app = App()
    for _ in range(3):
        cnn(app)
    t0 = time.perf_counter()
    outcome = search_log(app.log.entries(), Slow(), budget_s=0.05)
    assert outcome.timed_out and outcome.found is None and outcome.rejected >= 1
    assert time.perf_counter() - t0 < 1.0
    assert not search_log(app.log.entries(), DataDependencySearch(), budget_s=5).timed_out


def test_entries_are_built_incrementally_and_equal_a_full_build():
    rng = random.Random(5)
    app = App()
    app.log.max_calls = 100
    for step in range(60):
        cnn(app, grid=None)
        app.log.mark(0)
        if rng.random() < 0.4:
            got = app.log.entries()
            full = OpLog()
            full.calls, full.fetched = list(app.log.calls), list(app.log.fetched)
            full.fetch_after, full.marks = list(app.log.fetch_after), list(app.log.marks)
            want = full.entries()
            assert [(e.index, e.key, e.refs, e.reads, e.outputs, e.downloads, e.after_fetch)
                    for e in got] == [(e.index, e.key, e.refs, e.reads, e.outputs, e.downloads,
                                       e.after_fetch) for e in want], step
            assert app.log.inference_starts() == full.inference_starts(), step
    assert app.log.truncated > 0
    assert app.log.inference_starts()[-3:] == [len(app.log) - 14, len(app.log) - 7,
                                               len(app.log)]


def _call(log: OpLog, seq: int, thread: int) -> None:
    log.record(ops_pb2.SessionUp(call=ops_pb2.OpCall(seq=seq, op="aten::relu.default",
                                                     thread=thread, out_ids=[seq])))


def test_marks_say_where_each_threads_inferences_start():
    """A mark (the shim's ``InferenceMark``, sent with the thread's next call) is where that
    thread's next inference starts, as a position in its own entries: other threads' marks
    are not its boundaries; the same mark again with no call between counts once; marks of
    calls dropped by truncation go with them."""
    log = OpLog()
    _call(log, 1, 0)
    _call(log, 2, 0)
    log.mark(0)
    _call(log, 3, 1)
    log.mark(1)
    _call(log, 4, 0)
    _call(log, 5, 0)
    log.mark(0)
    log.mark(0)  # replayed inferences log no call: no new boundary
    assert len(log.entries(0)) == 4 and log.inference_starts(0) == [2, 4]
    assert len(log.entries(1)) == 1 and log.inference_starts(1) == [1]
    assert len(log.entries()) == 5 and log.inference_starts() == [2, 3, 5]
    log.max_calls = 6
    for seq in range(6, 9):  # the 7th call drops the oldest 3, and the marks among them
        _call(log, seq, 0)
    log.mark(0)
    assert [e.seq for e in log.entries(0)] == [4, 5, 6, 7, 8]
    assert log.inference_starts(0) == [2, 5]


def _meta(*shape: int) -> ops_pb2.TensorMeta:
    return ops_pb2.TensorMeta(dtype="float32", shape=shape, device="cpu")


class _Frames:
    """Calls and downloads into ``log`` as the relay records them, numbered and named as the
    shim does (a ``want_meta`` call's outputs are the host's: ``answer``)."""

    def __init__(self, log: OpLog) -> None:
        self.log, self.seq, self.ids = log, 0, iter(range(10, 1_000_000))

    def call(self, op: str, *args: ops_pb2.Value, out_meta=None, want_meta=False) -> int:
        self.seq += 1
        c = ops_pb2.OpCall(seq=self.seq, op=op, args=list(args), want_meta=want_meta,
                           grad_mode=ops_pb2.INFERENCE_MODE)
        oid = next(self.ids)
        if out_meta is not None:
            c.out_ids.append(oid)
            c.out_meta.append(out_meta)
        self.log.record(ops_pb2.SessionUp(call=c))
        return oid

    def call_n(self, op: str, *args: ops_pb2.Value, metas: list[ops_pb2.TensorMeta]) -> list[int]:
        """A call of as many outputs as ``metas`` (``unbind``): their ids."""
        self.seq += 1
        oids = [next(self.ids) for _ in metas]
        self.log.record(ops_pb2.SessionUp(call=ops_pb2.OpCall(
            seq=self.seq, op=op, args=list(args), out_ids=oids, out_meta=metas,
            grad_mode=ops_pb2.INFERENCE_MODE)))
        return oids

    def answer(self, *outs: ops_pb2.TensorMeta) -> int:
        """The host's reply to the last (``want_meta``) call: its one output's id."""
        oid = next(self.ids) + 1_000_000
        self.log.record_result(ops_pb2.OpResult(seq=self.seq, outs=list(outs),
                                                value=ops_pb2.Value(tensor=ops_pb2.TensorRef(id=oid))))
        return oid

    def fetch(self, oid: int) -> None:
        self.seq += 1
        self.log.record(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=self.seq, id=oid)))


def _t(i: int) -> ops_pb2.Value:
    return ops_pb2.Value(tensor=ops_pb2.TensorRef(id=i))


def _upload() -> ops_pb2.Value:
    return ops_pb2.Value(tensor=ops_pb2.TensorRef(upload=ops_pb2.TensorData(meta=_meta(8))))


def _dynamic_inferences(log: OpLog, counts: list[int], size_of=lambda k: k,
                        download: bool = True) -> None:
    """Per inference: ``mask = gt(x)``, ``idx = nonzero(mask)`` (its shape is the host's
    answer: ``want_meta``), ``y = view(idx, [size_of(k), -1])``, then ``y`` is downloaded
    (unless not ``download``: the app looks only at the count it was answered)."""
    f = _Frames(log)
    for k in counts:
        mask = f.call("aten::gt.Scalar", _upload(), ops_pb2.Value(f=0.5), out_meta=_meta(8))
        f.call("aten::nonzero.default", _t(mask), want_meta=True)
        idx = f.answer(_meta(k, 1))
        shape = ops_pb2.Value(list=ops_pb2.ValueList(items=[ops_pb2.Value(i=size_of(k)),
                                                             ops_pb2.Value(i=-1)]))
        y = f.call("aten::view.default", _t(idx), shape, out_meta=_meta(k, 1))
        if download:
            f.fetch(y)


def test_sizes_that_follow_the_data_become_symbols():
    """A count that differs every inference: nothing repeats exactly, the loose keys do, and
    the integer the app passed to ``view`` is the count the host answered, every time."""
    log = OpLog()
    _dynamic_inferences(log, [3, 5, 2, 4])
    found, _ = best(log.entries(0), DataDependencySearch())
    assert found is not None and found.period == 3
    assert found.shapes.varies_from == 1  # from the nonzero on
    assert found.shapes.symbols == {(2, ("arg", 1, 0)): (1, 0, 0, 1)}  # nonzero's size 0


def test_a_count_that_happened_to_be_the_same_in_every_repetition_is_a_symbol_too():
    """The host answered the same count (40 boxes) in every recorded inference, so the
    integer the app passed to ``view`` does not differ; it is the count all the same, and a
    later frame with 41 boxes must get 41 from the host, not the 40 recorded. An integer that
    equals no answered size, or a count below ``MIN_COUNT`` (a few boxes, which coincide
    with a model's own constants too often), stays what it was recorded as."""
    log = OpLog()
    _dynamic_inferences(log, [40, 40, 40, 40])
    found, _ = best(log.entries(0), DataDependencySearch())
    assert found is not None and found.period == 3
    assert found.shapes.symbols == {(2, ("arg", 1, 0)): (1, 0, 0, 1)}  # nonzero's size 0
    for counts, size_of in (([40] * 4, lambda k: 7), ([4] * 4, lambda k: k)):
        log = OpLog()
        _dynamic_inferences(log, counts, size_of=size_of)
        found, _ = best(log.entries(0), DataDependencySearch())
        assert found is not None and found.period == 3 and found.shapes.symbols == {}


def test_inferences_that_download_nothing_are_found_by_the_shapes_the_app_waited_for():
    """The app reads only the count (the answered ``nonzero``), never a value: the answered
    calls anchor the period, and a sequence with no downloaded output is still one (the app
    saw something of every inference: its shapes) if its period is the calls per inference
    that the app's marks showed."""
    log = OpLog()
    log.record(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=0, id=1)))  # set-up downloads before
    _dynamic_inferences(log, [3, 5, 2, 4], download=False)
    assert best(log.entries(0), DataDependencySearch())[0] is None  # not seen to be quiet
    # quiet, but the app's inferences (from its marks) are longer: a block is part of one
    assert best(log.entries(0), DataDependencySearch(), quiet_period=5)[0] is None
    found, _ = best(log.entries(0), DataDependencySearch(), quiet_period=3)
    assert found is not None and found.period == 3 and found.outputs == []
    assert found.shapes.symbols == {(2, ("arg", 1, 0)): (1, 0, 0, 1)}


def test_answered_blocks_before_a_download_are_part_of_an_inference():
    """Per inference, three classes each answered a ``nonzero`` (a per-class loop), then the
    result is downloaded. A search whose log ends inside the loop (its snapshot taken after
    the relay logged more) finds each class's block repeating, with an answered call and no
    download; the app downloads, so that block is not an inference: the whole inference is
    found (as it is once the fifth is whole)."""
    log = OpLog()
    f = _Frames(log)
    for n in range(5):
        views = []
        for k in (3, 3, 3):
            mask = f.call("aten::gt.Scalar", _upload(), ops_pb2.Value(f=0.5), out_meta=_meta(8))
            f.call("aten::nonzero.default", _t(mask), want_meta=True)
            idx = f.answer(_meta(k, 1))
            views.append(f.call("aten::relu.default", _t(idx), out_meta=_meta(k, 1)))
        if n == 4:  # the search's snapshot: three classes of the fifth inference
            found, _ = best(log.entries(0), DataDependencySearch())
            assert found is not None and found.period == 10  # the whole inference, not a class
            # what an app whose marked inferences were 3 calls long would allow
            with_quiet, _ = best(log.entries(0), DataDependencySearch(), quiet_period=3)
            assert with_quiet is not None and with_quiet.period == 3
        items = ops_pb2.Value(list=ops_pb2.ValueList(items=[_t(v) for v in views]))
        f.fetch(f.call("aten::cat.default", items, out_meta=_meta(9, 1)))
    found, _ = best(log.entries(0), DataDependencySearch())
    assert found is not None and found.period == 10 and found.outputs


def test_calls_nobody_waited_for_are_no_sequence():
    """The same calls with neither a download nor an answered call: nothing of them reached
    the app, so nothing anchors a period and nothing is found."""
    log = OpLog()
    f = _Frames(log)
    for _ in range(4):
        mask = f.call("aten::gt.Scalar", _upload(), ops_pb2.Value(f=0.5), out_meta=_meta(8))
        f.call("aten::relu.default", _t(mask), out_meta=_meta(8))
    found, _ = best(log.entries(0), DataDependencySearch())
    assert found is None


def test_an_integer_that_is_no_size_refuses_the_candidate():
    """``view(idx, [k + 1, -1])``: the integer differs every inference and no size of the
    inference explains it; the host could not know it, so there is no sequence."""
    log = OpLog()
    _dynamic_inferences(log, [3, 5, 2, 4], size_of=lambda k: k + 100)
    found, _ = best(log.entries(0), DataDependencySearch())
    assert found is None


def test_inferences_of_different_lengths_replay_the_calls_they_begin_with():
    """20 calls every inference, then a loop whose count the data decides (one call per
    class present), then the download: nothing repeats as a block, but the calls the recent
    inferences begin with are a segment (``common_prefix``)."""
    log = OpLog()
    seq, ids = 0, iter(range(10, 100_000))

    def call(op: str, arg: ops_pb2.Value) -> int:
        nonlocal seq
        seq += 1
        oid = next(ids)
        log.record(ops_pb2.SessionUp(call=ops_pb2.OpCall(
            seq=seq, op=op, args=[arg], out_ids=[oid], out_meta=[_meta(8)],
            grad_mode=ops_pb2.INFERENCE_MODE)))
        return oid

    for loops in (2, 5, 3, 4):
        x = call("aten::relu.default", ops_pb2.Value(tensor=ops_pb2.TensorRef(
            upload=ops_pb2.TensorData(meta=_meta(8)))))
        for _ in range(19):
            x = call("aten::sigmoid.default", ops_pb2.Value(tensor=ops_pb2.TensorRef(id=x)))
        for _ in range(loops):
            x = call("aten::neg.default", ops_pb2.Value(tensor=ops_pb2.TensorRef(id=x)))
        seq += 1
        log.record(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=seq, id=x)))
    found, _ = best(log.entries(0), DataDependencySearch())
    # The two complete inferences after the first (5 and 3 loops) begin with the same 23
    # calls: 20, and the 3 loop calls both have.
    assert found is not None and (found.start, found.period, found.repeats) == (22, 23, 2)
    # the 3-loop inference downloaded its last call: pushed when a replay gets there
    assert found.outputs == [(22, 0)]


def test_a_common_prefix_the_app_waits_for_nothing_in_is_no_segment():
    """As above, but every inference ends with one more call whose value is downloaded, so
    the calls the inferences begin with hold no download and no answered call: forwarding
    them costs the app no round trip, and a segment of them would only add one."""
    log = OpLog()
    f = _Frames(log)
    for loops in (2, 5, 3, 4):
        x = f.call("aten::relu.default", _upload(), out_meta=_meta(8))
        for _ in range(19 + loops):
            x = f.call("aten::sigmoid.default", _t(x), out_meta=_meta(8))
        f.fetch(f.call("aten::abs.default", _t(x), out_meta=_meta(8)))
    assert best(log.entries(0), DataDependencySearch())[0] is None


def _read_then_passed(log: OpLog, values: list[float], passed=int, reply_first=False) -> None:
    """Per inference: ``w = amax(x)`` (one element), the app reads it (a fetch and its reply,
    which the relay may see before the fetch it answers), then ``y = add(w, passed(value))``
    and ``y`` is downloaded."""
    seq, ids = 0, iter(range(10, 10_000))
    for v in values:
        x = ops_pb2.Value(tensor=ops_pb2.TensorRef(upload=ops_pb2.TensorData(meta=_meta(8))))
        w = next(ids)
        seq += 1
        log.record(ops_pb2.SessionUp(call=ops_pb2.OpCall(seq=seq, op="aten::amax.default",
                                                         args=[x], out_ids=[w],
                                                         out_meta=[_meta()])))
        seq += 1
        fetch = ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=seq, id=w))
        reply = ops_pb2.Fetched(seq=seq, tensor=ops_pb2.TensorData(
            meta=_meta(), data=struct.pack("<f", v)))
        if reply_first:
            log.record_fetched(reply)
        log.record(fetch)
        if not reply_first:
            log.record_fetched(reply)
        y = next(ids)
        seq += 1
        log.record(ops_pb2.SessionUp(call=ops_pb2.OpCall(
            seq=seq, op="aten::add.Scalar", out_ids=[y], out_meta=[_meta()],
            args=[ops_pb2.Value(tensor=ops_pb2.TensorRef(id=w)), ops_pb2.Value(i=passed(v))])))
        seq += 1
        log.record(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=seq, id=y)))


@pytest.mark.parametrize("reply_first", [False, True])
def test_integers_from_values_the_app_read_become_symbols(reply_first):
    """``int(w.item())`` passed on: the integer differs every inference and is no size, but it
    is ``int()`` of the value the app read of ``w`` every time (whichever of a fetch and its
    reply the relay logged first): a ``SymbolicInt`` of that value (``VALUE``)."""
    log = OpLog()
    _read_then_passed(log, [3.5, 7.25, 2.0, 11.75], reply_first=reply_first)
    found, _ = best(log.entries(0), DataDependencySearch())
    assert found is not None and found.period == 2
    assert found.shapes.symbols == {(1, ("arg", 1)): (0, 0, VALUE, 0)}


def test_a_value_read_by_an_answered_item_call_becomes_a_symbol_too():
    """``x[: y.item()]`` on a proxy: the app's ``__index__`` is an ``item`` call forwarded
    with ``want_meta``, its reply the number (no download). That number is a value the app
    read of ``w`` (``OpLog.record_result``), and the integer passed after it a ``VALUE``."""
    log = OpLog()
    f = _Frames(log)
    for v in (3, 7, 2, 11):
        w = f.call("aten::amax.default", _upload(), out_meta=_meta())
        f.call("aten::item.default", _t(w), want_meta=True)
        log.record_result(ops_pb2.OpResult(seq=f.seq, value=ops_pb2.Value(i=v)))
        y = f.call("aten::add.Scalar", _t(w), ops_pb2.Value(i=v), out_meta=_meta())
        f.fetch(y)
    entries = log.entries(0)
    amax = [e for e in entries if e.op == "aten::amax.default"][-1]
    assert amax.values == {amax.outputs[0]: 11}
    found, _ = best(entries, DataDependencySearch())
    assert found is not None and found.period == 3
    assert found.shapes.symbols == {(2, ("arg", 1)): (0, 0, VALUE, 0)}


def test_an_integer_that_is_not_the_value_read_refuses_the_candidate():
    """``int(w.item()) + 1``: the host could not know it."""
    log = OpLog()
    _read_then_passed(log, [3.5, 7.25, 2.0, 11.75], passed=lambda v: int(v) + 1)
    found, _ = best(log.entries(0), DataDependencySearch())
    assert found is None


def _looped_inferences(log: OpLog, counts: list[int], last_only: bool = False) -> None:
    """Per inference: ``keep = nonzero(x)`` (its shape the host's answer), then for each of
    its ``k`` rows ``r = keep.select(0, i)``, ``v = r * 2``, then ``stack`` of every ``v``
    (``last_only``: of the last one alone), downloaded."""
    f = _Frames(log)
    for k in counts:
        f.call("aten::nonzero.default", _upload(), want_meta=True)
        keep = f.answer(_meta(k, 1))
        vs = []
        for i in range(k):
            r = f.call("aten::select.int", _t(keep), ops_pb2.Value(i=0), ops_pb2.Value(i=i),
                       out_meta=_meta(1))
            vs.append(f.call("aten::mul.Scalar", _t(r), ops_pb2.Value(f=2.0), out_meta=_meta(1)))
        items = [_t(v) for v in (vs[-1:] if last_only else vs)]
        f.fetch(f.call("aten::stack.default", ops_pb2.Value(list=ops_pb2.ValueList(items=items)),
                       out_meta=_meta(len(items), 1)))


def test_a_loop_whose_count_follows_the_data_is_folded_to_one_iteration():
    """2, 4, 3, 5 rows: no block repeats, but with the loop folded every inference has the
    same four calls; the loop is counted by the ``nonzero``'s size 0, its ``select`` takes the
    iteration's index, and the ``stack`` gathers one value per iteration."""
    log = OpLog()
    _looped_inferences(log, [2, 4, 3, 5])
    found, _ = best(log.entries(0), DataDependencySearch())
    assert found is not None and found.period == 4 and found.entries is not None
    (loop,) = found.loops
    assert (loop.start, loop.body, loop.count) == (1, 2, (0, 0, 0))
    assert loop.shared.index == [(0, ("arg", 2))]
    assert loop.gathers == [(3, (0,))]
    d = build_definition(found.entries, found, {}, seq_id=1, thread=0)
    assert [(lp.start, lp.body, lp.dim) for lp in d.loops] == [(1, 2, 0)]
    assert [(s.call, s.index) for s in d.symbols if s.index] == [(1, True)]
    assert [len(unroll(d, n).calls) for n in (0, 3)] == [2, 8]


def test_a_loop_whose_last_value_alone_is_read_after_it_is_not_folded():
    """After the loop only the last iteration's value is read: unrolling one iteration could
    not say which, so there is no loop (and no sequence)."""
    log = OpLog()
    _looped_inferences(log, [2, 4, 3, 5], last_only=True)
    found, _ = best(log.entries(0), DataDependencySearch())
    assert found is None or not found.loops


def _class_loops(log: OpLog, counts: list[int], decoy: bool = False) -> None:
    """Per inference: ``classes = _unique2(x)`` (``k`` of them: the host's answer), then ``for c
    in classes`` (one ``unbind`` before the loop, an output per class): ``m = eq(x, c)``,
    ``n = sum(m)``; then ``stack`` of every ``n``, downloaded. ``decoy``: between them, a
    ``nonzero`` that happens to find ``k`` rows too."""
    f = _Frames(log)
    for k in counts:
        x = f.call("aten::relu.default", _upload(), out_meta=_meta(8))
        f.call("aten::_unique2.default", _t(x), want_meta=True)
        classes = f.answer(_meta(k))
        if decoy:
            f.call("aten::nonzero.default", _t(x), want_meta=True)
            f.answer(_meta(k, 1))
        ns = []
        for c in f.call_n("aten::unbind.int", _t(classes), metas=[_meta()] * k):
            m = f.call("aten::eq.Tensor", _t(x), _t(c), out_meta=_meta(8))
            ns.append(f.call("aten::sum.default", _t(m), out_meta=_meta()))
        f.fetch(f.call("aten::stack.default", ops_pb2.Value(
            list=ops_pb2.ValueList(items=[_t(n) for n in ns])), out_meta=_meta(k)))


def test_a_loop_over_a_tensors_items_reads_the_unbound_one_of_its_iteration():
    """``for c in torch.unique(x)``: iteration ``i`` reads output ``i`` of the ``unbind``
    before the loop, which makes as many as the count. The ``unbind`` is scattered (folded to
    its first output, unrolled to ``count``) and the loop is counted by the ``_unique2``'s size
    before it. The first three inferences have the same count, and so do the next two, so
    their calls repeat whole: the loops inside such runs are found too, and grouped with the
    last one's (3, 3, 3, 2, 2, then 4)."""
    log = OpLog()
    _class_loops(log, [3, 3, 3, 2, 2, 4])
    found, _ = best(log.entries(0), DataDependencySearch())
    assert found is not None and found.period == 6 and found.entries is not None
    (loop,) = found.loops
    assert (loop.start, loop.body, loop.count, loop.scatters) == (3, 2, (1, 0, 0), [2])
    d = build_definition(found.entries, found, {}, seq_id=1, thread=0)
    assert [(lp.start, lp.body, list(lp.scatters)) for lp in d.loops] == [(3, 2, [2])]
    for n in (0, 2, 5):
        u = unroll(d, n)
        assert len(u.calls[2].out_ids) == n and len(u.calls) == 4 + 2 * n
        compile_sequence(u)


def test_a_loop_over_a_tensors_items_is_counted_by_that_tensor():
    """Another tensor made just before the loop has as many rows as there are classes in every
    recorded inference; the loop is still counted by the classes it iterates (what the
    ``unbind`` unbinds), which holds in any inference."""
    log = OpLog()
    _class_loops(log, [3, 2, 4, 5], decoy=True)
    found, _ = best(log.entries(0), DataDependencySearch())
    assert found is not None
    (loop,) = found.loops
    assert loop.count == (1, 0, 0) and loop.scatters == [3]


def test_two_loops_of_one_inference_are_each_folded_and_unrolled_in_turn():
    """Two per-row loops with counts of their own (``keep`` and ``other`` from two
    ``nonzero``s): each is folded and counted by its own size; unrolled one after the other,
    the definition has the calls of that inference."""
    log = OpLog()
    f = _Frames(log)
    for a, b in ((2, 3), (4, 2), (3, 5), (5, 4)):
        stacks = []
        for n, op in ((a, "aten::mul.Scalar"), (b, "aten::add.Scalar")):
            f.call("aten::nonzero.default", _upload(), want_meta=True)
            keep = f.answer(_meta(n, 1))
            vs = [f.call(op, _t(f.call("aten::select.int", _t(keep), ops_pb2.Value(i=0),
                                       ops_pb2.Value(i=i), out_meta=_meta(1))),
                         ops_pb2.Value(f=2.0), out_meta=_meta(1)) for i in range(n)]
            stacks.append(f.call("aten::stack.default", ops_pb2.Value(
                list=ops_pb2.ValueList(items=[_t(v) for v in vs])), out_meta=_meta(n, 1)))
        f.fetch(f.call("aten::cat.default", ops_pb2.Value(
            list=ops_pb2.ValueList(items=[_t(s) for s in stacks])), out_meta=_meta(a + b, 1)))
    found, _ = best(log.entries(0), DataDependencySearch())
    assert found is not None and found.period == 9
    assert [(lp.start, lp.body, lp.count) for lp in found.loops] == [(1, 2, (0, 0, 0)),
                                                                     (5, 2, (4, 0, 0))]
    d = build_definition(found.entries, found, {}, seq_id=1, thread=0)
    u = unroll(unroll(d, 3), 1)
    assert [c.op for c in u.calls] == [
        "aten::nonzero.default", *["aten::select.int", "aten::mul.Scalar"] * 3,
        "aten::stack.default", "aten::nonzero.default", "aten::select.int", "aten::add.Scalar",
        "aten::stack.default", "aten::cat.default"]
    assert not u.loops
    compile_sequence(u)


def _way(app: App, way: str, state: int | None = None) -> int:
    """One inference that goes way ``a``, ``b`` or ``c`` after its first calls (as the data
    decides: a size that is 1 or not), then marks its end; ``state``: it also reads this
    value (made by an earlier inference). Returns its output."""
    (x,) = app.call("aten::conv2d", "img", W1)
    (x,) = app.call({"a": "aten::relu", "b": "aten::sigmoid", "c": "aten::tanh"}[way], x)
    if state is not None:
        (x,) = app.call("aten::add", x, state)
    (y,) = app.call("aten::linear", x, W2)
    app.fetch(y)
    app.log.mark(0)
    return y


def test_inferences_that_never_repeat_in_a_row_pair_with_an_earlier_one():
    """Three ways in an order where no two inferences in a row are alike: the log's end
    never repeats, and the last inference is searched with the earlier ones that made the
    same calls, wherever they are (``search.paired``: blocks that are not neighbours)."""
    app = App()
    for way in "abc":
        _way(app, way)
    log = app.log.entries()
    found = search_log(log, DataDependencySearch(), starts=app.log.inference_starts()).found
    assert found is None or found.period != 3  # (a segment of the calls they begin with)
    _way(app, "a")  # like the first
    found = search_log(app.log.entries(), DataDependencySearch(),
                       starts=app.log.inference_starts()).found
    assert found is not None and found.period == 3 and found.repeats == 2
    assert found.start == 0 and app.log.entries()[1].op == "aten::relu"
    assert found.inputs == [(0, 0)] and found.outputs == [(2, 0)]
    for way in "cb":  # then b, paired with the second inference
        _way(app, way)
    found = search_log(app.log.entries(), DataDependencySearch(),
                       starts=app.log.inference_starts()).found
    assert found is not None and found.repeats == 2 and found.start == 3
    assert app.log.entries()[found.start + 1].op == "aten::sigmoid"


def test_a_value_carried_from_an_inference_between_the_pair_is_refused():
    """Blocks that are not neighbours: what the last one reads of an inference between them
    (state it carried) is no constant, since the earlier block cannot have read it."""
    app = App()
    _way(app, "a")
    y = _way(app, "b")
    _way(app, "c")
    _way(app, "a", state=y)  # reads b's output
    _way(app, "b")
    y = _way(app, "c")
    _way(app, "a", state=y)  # reads the c just before it
    log, starts = app.log.entries(), app.log.inference_starts()
    pairs = paired(log, with_loose_keys(log), starts)
    assert [blocks for _, blocks, _, _ in pairs] == [[9, 19]]  # proposed, then refused:
    found = search_log(log, DataDependencySearch(), starts=starts).found
    assert found is None or found.period != 4
