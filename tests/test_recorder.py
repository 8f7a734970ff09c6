"""The recorder's search scheduling and budget, on synthetic frames fed as the relay does:
every download makes a search due early on, failed searches back off, the log stays bounded,
a search that overruns its time budget counts as failed."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from rrto.v1 import ops_pb2
from rrto_plugins.search.dds import DataDependencySearch
from rrtod.robot.oplog import REBUILT_SEQS
from rrtod.robot.recorder import (
    HINT_BUDGET_S,
    SEARCH_WAIT_S,
    UNMARKED_FRAMES,
    Recorder,
    SearchBudget,
)
from rrtod.wire import REPLAY_BASE
from testkit.frames import W1, W2, App, cnn


class Relay(App):
    """Frames go to a Recorder; a due search runs at once (as the robot's worker would)."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.rec = recorder
        self.log = recorder.log
        self.searches: list[int] = []  # log position (frames recorded) of each search run
        self.found: ops_pb2.SequenceDef | None = None
        self.found_after = 0  # inferences completed when a search found the sequence
        self.done = 0

    def fetch(self, oid: int) -> None:
        self.seq += 1
        if self.rec.observe(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=self.seq, id=oid))):
            self.searches.append(self.rec.log.recorded)
            d = self.rec.search_now()
            if d is not None and self.found is None:
                self.found, self.found_after = d, self.done + 1


def carried(app: Relay, h: int) -> int:
    """A recurrent policy that feeds its state to the next inference: never a sequence."""
    (x,) = app.call("aten::linear", "obs", W1)
    (h,) = app.call("aten::gru_cell", x, h)
    (a,) = app.call("aten::linear", h, W2)
    app.fetch(a)
    app.done += 1
    return h


def recorder(tmp_path, **budget) -> Recorder:
    return Recorder("app.py", "s1", DataDependencySearch(), tmp_path / "seq",
                    SearchBudget(**budget))


def test_static_model_is_searched_after_every_download_and_found_early(tmp_path):
    app = Relay(recorder(tmp_path))
    # The first inference binds its weights as it goes (as the shim does: ``alias`` of a
    # persistent tensor on its first use), so it differs from the steady state.
    (x,) = app.call("aten::conv2d", "img", W1)
    app.call("aten::alias", W2)
    (x,) = app.call("aten::relu", x)
    app.fetch(x)
    app.done += 1
    for _ in range(5):
        cnn(app)
        app.done += 1
        if app.found is not None:
            break
    # Found on the last download of the second steady-state inference (three in all
    # counting the warm-up one): the third is replayed.
    assert app.found is not None and app.found_after == 3
    # A search after every download, none skipped: the third inference's first download
    # (all its calls are logged by then) is enough.
    assert len(app.searches) == 1 + 3 + 1
    (summary,) = app.rec.sequences.values()
    assert summary["found_at"] == 3 and summary["operators"] == 7
    assert app.rec.failed == 0  # reset by the find


def test_failed_searches_back_off_and_the_log_stays_bounded(tmp_path):
    rec = recorder(tmp_path, max_calls=600, eager_work=2_000, growth=1.0, max_gap=3_000)
    app = Relay(rec)
    (h,) = app.call("aten::zeros", "shape")
    for _ in range(4_000):
        h = carried(app, h)
        assert len(rec.log) <= 600
    assert app.found is None
    recorded = rec.log.recorded  # 16k frames: 3 calls and one download per inference
    # Eager at first (every download), then the gaps between searches double, up to max_gap.
    gaps = [b - a for a, b in zip(app.searches, app.searches[1:], strict=False)]
    eager = [g for g in gaps if g == 4]
    assert 10 <= len(eager) <= 40
    backoff = gaps[len(eager):]
    assert backoff and all(b >= a for a, b in zip(backoff, backoff[1:], strict=False))
    assert max(backoff) <= 3_000 + 4 and backoff[-1] >= 3_000
    assert len(app.searches) < len(eager) + 20  # not 4000
    scanned = sum(s["log"] for s in rec.search_stats)
    assert scanned < 0.6 * recorded  # searching costs less than relaying, and stays bounded
    assert rec.describe()["search_budget"]["failed"] == len(app.searches)


def test_an_inference_mark_starts_a_search_only_if_nothing_was_downloaded(tmp_path):
    """The shim marks each inference's end. One that downloaded something was searched at
    its downloads; one that downloaded nothing (the app read only counts) is searched at the
    mark, else it would never be. Its calls are the period a sequence that returns no value
    must have."""
    rec = recorder(tmp_path)
    app = Relay(rec)
    cnn(app)  # downloads: searched there
    assert len(app.searches) == 3 and not rec.inference_ended()
    assert rec.quiet_period is None
    app.call("aten::conv2d", "img", W1)
    app.call("aten::relu", "img")
    assert rec.inference_ended() and rec.quiet_period == 2  # downloaded nothing: 2 calls
    app.call("aten::conv2d", "img", W1)
    assert rec.inference_ended() and rec.quiet_period == 1
    app.fetch(app.call("aten::relu", "img")[0])
    assert not rec.inference_ended() and rec.quiet_period is None


def test_values_read_inside_a_forward_are_searched_at_the_inferences_end(tmp_path):
    """A value the model reads inside its forward (``Fetch.in_forward``: Mask R-CNN reads each
    box's corners) ends no inference: no search there, but one at the inference's mark,
    where the log holds the whole inference; a download outside any forward (the app reads
    a result) is searched as always."""
    rec = recorder(tmp_path)
    app = Relay(rec)
    inside = ops_pb2.Fetch(seq=1, id=1, in_forward=True)
    for _ in range(3):
        (x,) = app.call("aten::conv2d", "img", W1)
        assert not rec.observe(ops_pb2.SessionUp(fetch=inside))
        (y,) = app.call("aten::relu", x)
        assert not rec.observe(ops_pb2.SessionUp(fetch=inside))
        (z,) = app.call("aten::linear", y, W2)
        assert rec.inference_ended()  # the reads inside it left their search to here
        assert rec.quiet_period is None  # (it downloaded: no period of a quiet inference)
    app.fetch(z)
    assert app.searches  # a result read: searched there
    assert not rec.inference_ended()  # and the mark after it has nothing left to search
    # An app whose forward never returns marks nothing: past UNMARKED_FRAMES frames since
    # the last mark, its reads are searched at as any download.
    rec = recorder(tmp_path / "unmarked")
    app = Relay(rec)
    app.call("aten::relu", "img")
    assert not rec.observe(ops_pb2.SessionUp(fetch=inside))
    for _ in range(UNMARKED_FRAMES):
        app.call("aten::relu", "img")
    assert rec.observe(ops_pb2.SessionUp(fetch=inside))


def test_a_cleared_log_starts_the_budget_afresh(tmp_path):
    rec = recorder(tmp_path, eager_work=100, growth=4.0)
    app = Relay(rec)
    (h,) = app.call("aten::zeros", "shape")
    for _ in range(20):
        h = carried(app, h)
    assert rec.next_search > rec.log.recorded  # backing off
    rec.log.clear()  # what dropping a sequence or a stale thread does
    assert rec.search_due() and rec.failed == 0
    for _ in range(3):
        cnn(app)
    assert app.found is not None


def test_a_search_over_its_time_budget_counts_as_failed(tmp_path):
    class Slow:
        def candidates(self, log):
            for _ in log:
                time.sleep(0.01)
                yield from DataDependencySearch().candidates(log)

    rec = Recorder("app.py", "s1", Slow(), tmp_path / "seq", SearchBudget(time_s=0.0))
    app = Relay(rec)
    for _ in range(3):
        cnn(app)
    assert app.found is None
    assert rec.search_stats[-1]["timed_out"] and rec.failed == len(app.searches)


def test_a_rerun_within_backoff_does_not_search(tmp_path):
    rec = recorder(tmp_path, eager_work=0, growth=1.0)
    app = Relay(rec)
    (h,) = app.call("aten::zeros", "shape")
    for _ in range(5):
        h = carried(app, h)
    runs = len(rec.search_stats)
    assert rec.search_now() is None and len(rec.search_stats) == runs  # not due: no search


class AsyncRelay(Relay):
    """As the relay schedules searches: a due one is requested, and runs in a worker thread."""

    def __init__(self, recorder: Recorder):
        super().__init__(recorder)
        self.pushed: list[ops_pb2.SequenceDef] = []

    def fetch(self, oid: int) -> None:
        self.seq += 1
        if self.rec.observe(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=self.seq, id=oid))):
            self.rec.request_search(self.push)

    async def push(self, d: ops_pb2.SequenceDef) -> None:
        self.rec.offered(d)
        self.pushed.append(d)


def test_a_search_requested_while_one_runs_runs_once_more_after_it(tmp_path):
    """One search at a time: downloads during a search make it look again when it ends (on
    the longer log), instead of starting a second one."""
    gate = threading.Event()
    logs: list[int] = []

    class Gated:
        def candidates(self, log):
            logs.append(len(log))
            gate.wait(10)
            return DataDependencySearch().candidates(log)

    async def main() -> None:
        rec = Recorder("app.py", "s1", Gated(), tmp_path / "seq")
        app = AsyncRelay(rec)
        cnn(app)  # one inference: not enough to find it
        while not logs:  # the first search runs, and waits at the gate
            await asyncio.sleep(0.01)
        for _ in range(3):
            cnn(app)  # downloads meanwhile: a rerun, not a second search
        gate.set()
        await asyncio.wait_for(rec.search_done(), 10)
        assert len(logs) == 2 and logs[1] > logs[0]
        (d,) = app.pushed
        assert list(rec.sequences) == [d.id] and len(d.calls) == 7
        assert rec.acknowledged(ops_pb2.SequenceAck(id=d.id, accepted=True)) is d

    asyncio.run(main())


async def _found_cnn(tmp_path: Path) -> tuple[Recorder, ops_pb2.SequenceDef]:
    """A session's recorder that found the CNN's sequence in three inferences."""
    rec = Recorder("app.py", "s1", DataDependencySearch(), tmp_path / "seq")
    app = AsyncRelay(rec)
    for _ in range(3):
        cnn(app)
    await asyncio.wait_for(rec.search_done(), 10)
    (d,) = app.pushed
    return rec, d


def test_close_stops_a_search_and_adds_the_counts_to_the_saved_file(tmp_path):
    async def main() -> None:
        rec, d = await _found_cnn(tmp_path)
        rec.observe(ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=d.id)))
        rec.observe(ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=d.id)))
        rec.close()
        again = Recorder("app.py", "s2", DataDependencySearch(), tmp_path / "seq")
        ((summary, saved),) = again.saved
        assert saved == d and summary["replays"] == 0  # a new session counts afresh
        (listed,) = again.store.list()
        assert listed["replays"] == 2 and listed["id"] == d.id

        slow = threading.Event()

        class Blocked:
            def candidates(self, log):
                slow.wait(10)
                return iter(())

        rec = Recorder("app.py", "s3", Blocked(), tmp_path / "seq")
        app = AsyncRelay(rec)
        cnn(app)
        await asyncio.sleep(0.05)
        rec.close()  # the session ends while its search runs
        await asyncio.wait_for(rec.search_done(), 10)
        slow.set()
        assert app.pushed == []

    asyncio.run(main())


def test_the_session_counts_replays_of_a_sequence_dropped_since(tmp_path):
    """A sequence replaced by one with more loop variants leaves the list, and its replays
    with it; the session's own count keeps them (the benchmark's replayed share reads it)."""
    async def main() -> None:
        rec, d = await _found_cnn(tmp_path)
        for _ in range(2):
            rec.observe(ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=d.id)))
        assert rec.describe()["replays"] == 2
        rec.drop(d.id)
        rec.observe(ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=d.id)))
        described = rec.describe()
        assert described["replays"] == 3 and described["sequences"] == []
        rec.close()

    asyncio.run(main())


def test_a_replaced_sequence_stays_in_use_until_the_host_accepts_what_replaces_it(tmp_path):
    """A search that left a sequence with loop variants finds one with more (``replaces``):
    the old one is dropped only once the host has accepted the new one, its drop then
    following the new definition to the shim (``superseded``), so that the app's thread is
    never without a sequence while the host defines the new one (Mask R-CNN: a frame or two
    forwarded whole each time a variant was learnt). A refused replacement leaves the old one
    in use, and so does a replacement dropped before the host answered."""
    def replacement(rec: Recorder, old: ops_pb2.SequenceDef) -> ops_pb2.SequenceDef:
        new = ops_pb2.SequenceDef()
        new.CopyFrom(old)
        new.id = old.id + 1
        # as ``search_now`` records a sequence found with more of ``old``'s loop variants
        rec._adopt(new, {**rec.sequences[old.id], "id": new.id, "replaces": old.id})
        rec._replacing[new.id] = old.id
        rec.offered(new)
        return new

    async def main() -> None:
        rec, d = await _found_cnn(tmp_path)
        assert rec.acknowledged(ops_pb2.SequenceAck(id=d.id, accepted=True)) is d
        assert rec.superseded() == []
        new = replacement(rec, d)
        assert rec.superseded() == [] and set(rec.sequences) == {d.id, new.id}
        assert rec.acknowledged(ops_pb2.SequenceAck(id=new.id, accepted=True)) is new
        (gone,) = rec.superseded()
        assert gone.id == d.id and not gone.calls and list(rec.sequences) == [new.id]
        assert rec.superseded() == [] and 0 in rec.active_threads

        refused = replacement(rec, new)
        assert rec.acknowledged(ops_pb2.SequenceAck(id=refused.id, accepted=False)) is None
        assert rec.superseded() == [] and list(rec.sequences) == [new.id]

        flushed = replacement(rec, new)
        rec.drop(flushed.id)  # (``rrtoctl flush`` drops all, this one first)
        assert rec.acknowledged(ops_pb2.SequenceAck(id=flushed.id, accepted=True)) is None
        assert rec.superseded() == [] and list(rec.sequences) == [new.id]
        rec.close()

    asyncio.run(main())


def test_state_written_in_place_then_read_is_a_constant_the_host_accepts(tmp_path):
    """A buffer updated in place every inference and read after its update (``calls.add_(1)``
    then ``y + calls``; an EMA copy's ``mul_``/``add_`` then its forward): the read's latest
    write is inside the block, but the tensor existed before it. It was sent as a PRODUCED
    source with a non-local id, which the host refused ("produced source N is not a local
    id"); it is the same tensor every inference: a constant by id, written and read in order
    by the host."""
    from rrtod.gpu.replay import compile_sequence

    app = Relay(recorder(tmp_path))
    (buf,) = app.call("aten::zeros", W1)  # a buffer made before the first inference
    for _ in range(4):
        app.call("aten::add_.Tensor", buf, scalar=1.0, out_ids=[buf])
        (x,) = app.call("aten::conv2d", "img", W1)
        (y,) = app.call("aten::add.Tensor", x, buf)
        app.fetch(y)
        app.done += 1
    d = app.found
    assert d is not None
    compiled = compile_sequence(d)  # raised ValueError before
    reads = [s for s in d.sources if s.id == buf]
    assert len(reads) == 2 and all(s.kind == ops_pb2.SeqSource.CONSTANT for s in reads)
    assert buf not in d.local_ids and compiled.writes[0] == [0]  # snapshot before the write


def relu_in_use(tmp_path) -> Recorder:
    """A recorder with sequence 3 in use on thread 0: one ``relu`` of a constant."""
    rec = Recorder("app.py", "s1", DataDependencySearch(), tmp_path / "seq")
    d = ops_pb2.SequenceDef(id=3, local_ids=[1], outputs=[1])
    d.calls.add(op="aten::relu.default", out_ids=[1]).args.add().tensor.id = 100
    d.sources.add(kind=ops_pb2.SeqSource.CONSTANT, id=100)
    rec._adopt(d, {"id": 3, "thread": 0, "replays": 0, "mismatches": 0, "operators": 1})
    return rec


def abort_then_forward(rec: Recorder, base: int) -> None:
    """Sequence 3 started at ``base``, aborted after its call, a ``neg`` forwarded; then the
    host's account of the replayed call."""
    for frame in (ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=3, base_id=base)),
                  ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=1)),
                  ops_pb2.SessionUp(call=ops_pb2.OpCall(seq=1, op="aten::neg.default"))):
        rec.observe(frame)
    rec.observe_replayed(ops_pb2.ReplayedPrefix(base_id=base, calls=[ops_pb2.OutSizes()]))


def test_a_replayed_prefix_the_robot_did_not_see_aborted_is_ignored(tmp_path):
    """The host's ``ReplayedPrefix`` comes from the network: one that names no replay this
    robot saw aborted (or a switch to a variant, where nothing was forwarded after the abort)
    puts nothing into the op log and marks no thread for a variant search."""
    rec = relu_in_use(tmp_path)
    sizes = ops_pb2.ReplayedPrefix(base_id=7, calls=[ops_pb2.OutSizes()])
    rec.observe_replayed(sizes)  # no replay at all
    for frame in (ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=3, base_id=7)),
                  ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=1)),
                  ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=3, base_id=8,
                                                               position=1))):
        rec.observe(frame)  # aborted at 1, then a variant joined there: a switch
    rec.observe_replayed(sizes)
    assert len(rec.log) == 0 and not rec.variant_threads
    # the same abort followed by a forwarded call: the replayed call goes into the log first
    abort_then_forward(rec, 9)
    assert [c.op for c in rec.log.calls] == ["aten::relu.default", "aten::neg.default"]
    assert rec.log.calls[0].out_ids == [9] and rec.variant_threads == {0}


def test_a_variant_search_is_waited_for_as_long_as_the_inference_forwarded(tmp_path):
    """At the mark of an inference that left its sequence, a search with the kept log is
    due: the app's next start may wait for it as long as that inference forwarded after the
    abort (what the variant found saves it). A switch to a known variant forwarded nothing
    in between. A waited-for search that finds nothing stops such waits until one finds."""
    rec = relu_in_use(tmp_path)
    rec._found_from[3] = ([], [])  # sequence 3 has loop variants: its log is kept
    abort_then_forward(rec, 9)
    time.sleep(0.05)
    assert rec.inference_ended(0)  # the merge search is due
    assert 0.05 <= rec.forwarded_s < 5 and rec.variant_wait(0, True) == rec.forwarded_s
    assert rec.variant_wait(1, True) is None  # no variant of thread 1
    assert rec.variant_wait(0, False) is None  # no search due, none running

    async def search(found: ops_pb2.SequenceDef | None) -> None:
        rec.search_now = lambda: found  # type: ignore[method-assign]
        pushed: list[ops_pb2.SequenceDef] = []

        async def push(d: ops_pb2.SequenceDef) -> None:
            pushed.append(d)

        await rec._search(push, None)
        assert pushed == ([found] if found is not None else [])

    asyncio.run(search(None))  # waited for, found nothing
    assert not rec.variant_hints and rec.variant_wait(0, True) is None
    asyncio.run(search(None))  # not waited for: changes nothing
    assert not rec.variant_hints
    rec.variant_hints = True
    assert rec.variant_wait(0, True) is not None
    asyncio.run(search(ops_pb2.SequenceDef(id=4)))
    assert rec.variant_hints
    # aborted, then a variant switched to at once: nothing forwarded in between
    rec.observe(ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=3, base_id=11)))
    rec.observe(ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=1)))
    rec.observe(ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=3, base_id=12,
                                                             position=1)))
    time.sleep(0.05)
    rec.inference_ended(0)
    assert rec.forwarded_s < 0.05


def test_an_inference_that_joined_its_replay_under_way_and_left_it_is_searched_as_a_variant(
        tmp_path):
    """A sequence (``relu`` then ``neg``) reached the shim after its inference forwarded the
    ``relu``: the replay joined it at 1 and was aborted after the ``neg``. The variant's search
    starts at the inference's first call, the forwarded ``relu``, logged before the replay.
    Counted back, a call that is not the sequence's first operator marks no variant. The
    search waits for the inference's mark, and the mark finds it due."""
    def run(first_op: str) -> Recorder:
        rec = Recorder("app.py", "s1", DataDependencySearch(), tmp_path / first_op)
        d = ops_pb2.SequenceDef(id=3, local_ids=[1, 2], outputs=[2])
        d.calls.add(op="aten::relu.default", out_ids=[1]).args.add().tensor.id = 100
        d.calls.add(op="aten::neg.default", out_ids=[2]).args.add().tensor.id = 1
        d.sources.add(kind=ops_pb2.SeqSource.CONSTANT, id=100)
        d.sources.add(kind=ops_pb2.SeqSource.PRODUCED, id=1)
        rec._adopt(d, {"id": 3, "thread": 0, "replays": 0, "mismatches": 0, "operators": 2})
        forwarded = ops_pb2.OpCall(seq=1, op=first_op, out_ids=[50])
        forwarded.args.add().tensor.id = 100
        start = ops_pb2.ReplayStart(sequence=3, base_id=REPLAY_BASE, position=1)
        start.joined[0] = 50
        for frame in (ops_pb2.SessionUp(call=forwarded), ops_pb2.SessionUp(start=start),
                      ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=2)),
                      ops_pb2.SessionUp(call=ops_pb2.OpCall(seq=2, op="aten::exp.default"))):
            rec.observe(frame)
        rec.observe_replayed(ops_pb2.ReplayedPrefix(base_id=REPLAY_BASE, start=1,
                                                    calls=[ops_pb2.OutSizes()]))
        assert [c.op for c in rec.log.calls] == [first_op, "aten::neg.default",
                                                 "aten::exp.default"]
        return rec

    joined = run("aten::relu.default")
    assert joined.variant_threads == {0} and joined._variant_from[0] is joined.log.calls[0]
    assert not run("aten::sigmoid.default").variant_threads
    # Searched with the log sequence 3 was found in (kept) once it has ended: a search at a
    # download before its mark is not due, and is no failed search that would make the mark
    # wait for a later download (Mask R-CNN's: the next frame's end)
    joined._found_from[3] = ([], [])
    assert joined.search_now() is None and joined.failed == 0
    assert joined.inference_ended(0) is True


def test_a_start_of_a_sequence_dropped_meanwhile_is_still_logged_when_aborted(tmp_path):
    """The shim learns of a drop (a replacement, a flush) after the host, which still runs a
    start that crossed it: its abort puts the replayed calls into the op log as for a sequence
    in use, so the inference is in the log whole."""
    rec = relu_in_use(tmp_path)
    assert rec.drop(3) == ops_pb2.SequenceDef(id=3) and 3 not in rec.definitions
    abort_then_forward(rec, 9)
    assert [c.op for c in rec.log.calls] == ["aten::relu.default", "aten::neg.default"]


def test_the_app_is_told_to_wait_only_for_first_searches_within_a_time_budget(tmp_path):
    """``hint_wait`` (asked before a download is logged, or at an inference mark): not until
    an inference has ended (the app's first mark), then ``SEARCH_WAIT_S`` while the hinted
    searches have taken less than ``HINT_BUDGET_S`` in all (what is left of it, at the end);
    never once a sequence is in use; a cleared log starts afresh."""
    rec = recorder(tmp_path)
    app = Relay(rec)
    assert rec.hint_wait() is None  # nothing logged yet: no search can find anything
    h = carried(app, 0)
    assert rec.hint_wait() is None  # downloads of set-up or of the first inference: neither
    rec.inference_ended(0)
    assert rec.hint_wait() == SEARCH_WAIT_S
    rec.hinted_s = HINT_BUDGET_S - 0.03
    assert rec.hint_wait() == pytest.approx(0.03)
    rec.hinted_s = HINT_BUDGET_S
    assert rec.hint_wait() is None  # spent: a model that never replays stops waiting
    carried(app, h)
    rec.log.clear()
    assert rec.hint_wait() is None and rec.hinted_s == 0  # afresh: no inference ended yet
    rec.inference_ended(0)
    assert rec.hint_wait() == SEARCH_WAIT_S
    rec.active_threads.add(0)
    assert rec.hint_wait() is None  # a variant search never holds the app


def test_the_wait_and_its_budget_are_the_configs(tmp_path):
    """``record.search_wait`` and ``record.hint_budget`` (the robot's config) bound the hints."""
    rec = recorder(tmp_path, search_wait=2.0, hint_budget=3.0)
    carried(Relay(rec), 0)
    rec.inference_ended(0)
    assert rec.hint_wait() == 2.0
    rec.hinted_s = 2.5
    assert rec.hint_wait() == pytest.approx(0.5)
    rec.hinted_s = 3.0
    assert rec.hint_wait() is None


def test_an_aborted_replay_is_logged_with_this_inferences_integers_answers_and_downloads(tmp_path):
    """What the host sent during a replay the app aborted at call 3 goes into the log as
    forwarding would have logged it: the answered ``nonzero`` as a ``want_meta`` call with
    the answer as its reply; the integer that follows a value the app read (``zeros(n)``
    after ``n = int(t.item())``) as this inference's value, pushed, not the recorded one; the
    pushed outputs the app took as its downloads: the number as a fetch (an inference boundary
    as forwarding makes it), the tensor as a download only."""
    meta = ops_pb2.TensorMeta(dtype="float32", shape=[5], stride=[1])
    d = ops_pb2.SequenceDef(id=3, local_ids=[10, 11, 12, 13, 14], outputs=[12, 13])
    nz = d.calls.add(op="aten::nonzero.default", want_meta=True, out_ids=[11])
    nz.args.add().tensor.CopyFrom(ops_pb2.TensorRef(bind_id=10, upload=ops_pb2.TensorData(meta=meta)))
    sel = d.calls.add(op="aten::select.int", out_ids=[12])
    sel.args.add().tensor.id = 11
    sel.args.add(i=0)
    sel.args.add(i=0)
    zeros = d.calls.add(op="aten::zeros.default", out_ids=[13])
    zeros.args.add().list.items.add(i=7)  # recorded: 7
    d.calls.add(op="aten::neg.default", out_ids=[14]).args.add().tensor.id = 13
    for kind, sid in ((ops_pb2.SeqSource.INPUT, 0), (ops_pb2.SeqSource.PRODUCED, 11),
                      (ops_pb2.SeqSource.PRODUCED, 13)):
        d.sources.add(kind=kind, id=sid)
    d.symbols.add(call=2, arg=0, items=[0], tensor=12, value=True)
    rec = Recorder("app.py", "s1", DataDependencySearch(), tmp_path / "seq")
    rec._adopt(d, {"id": 3, "thread": 0, "replays": 0, "mismatches": 0, "operators": 4})
    base = REPLAY_BASE
    upload = ops_pb2.TensorRef(upload=ops_pb2.TensorData(meta=meta, data=bytes(20)))
    rec.observe(ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=3, base_id=base)))
    rec.observe(ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload)))
    answer = ops_pb2.OpResult(outs=[ops_pb2.TensorMeta(dtype="int64", shape=[4, 1], stride=[1, 1])],
                              value=ops_pb2.Value(tensor=ops_pb2.TensorRef(id=base + 1)))
    rec.observe_answer(ops_pb2.ReplayAnswer(base_id=base, position=0, result=answer))
    number = ops_pb2.TensorData(meta=ops_pb2.TensorMeta(dtype="int64"), data=(4).to_bytes(8, "little"))
    rec.observe_pushed(ops_pb2.Fetched(id=base + 2, tensor=number))
    rec.observe_pushed(ops_pb2.Fetched(id=base + 3, tensor=ops_pb2.TensorData(
        meta=ops_pb2.TensorMeta(dtype="float32", shape=[4], stride=[1]), data=bytes(16))))
    rec.observe(ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=3)))
    rec.observe(ops_pb2.SessionUp(call=ops_pb2.OpCall(seq=1, op="aten::relu.default")))
    rec.observe_replayed(ops_pb2.ReplayedPrefix(base_id=base, calls=[ops_pb2.OutSizes()] * 3))

    log = rec.log
    assert [c.op for c in log.calls] == ["aten::nonzero.default", "aten::select.int",
                                         "aten::zeros.default", "aten::relu.default"]
    nz_logged = log.calls[0]
    assert nz_logged.want_meta and nz_logged.seq >= REBUILT_SEQS and not nz_logged.out_ids
    assert log.results[nz_logged.seq] == answer
    assert log.calls[2].args[0].list.items[0].i == 4  # this inference's value, not 7
    assert log.fetched == [base + 2, base + 3] and log.fetch_after == [2, 3]
    assert log.quiet == {base + 3} and log.values[base + 2] == 4
    entries = log.entries(0)
    assert entries[0].outputs == (base + 1,)  # named by the answer, as a forwarded reply
    assert entries[1].downloads == [base + 2] and entries[2].downloads == [base + 3]
    assert [e.after_fetch for e in entries] == [False, False, True, False]


def test_the_log_a_sequence_was_found_in_joined_with_an_inference_that_left_it(tmp_path):
    """``_joined``: the kept log, then the calls since the inference that left its sequence
    began, as one log of its own: positions renumbered, each read resolved within it, the
    inference starts of both (the first new call begins one, whether or not the kept log
    ends with a mark), and the oldest inferences left out past ``most`` entries."""
    from rrtod.robot.recorder import _joined

    app = App()
    for _ in range(3):
        cnn(app)
        app.log.mark(0)
    kept = app.log.entries(0)
    kept_starts = app.log.inference_starts(0)
    per = len(kept) // 3
    assert kept_starts == [per, 2 * per, 3 * per]
    cnn(app)
    app.log.mark(0)
    new = app.log.entries(0)[3 * per:]
    log, starts = _joined((kept, kept_starts), new, [0, per], most=10 * per)
    assert [e.op for e in log] == [e.op for e in kept + new]
    assert [e.index for e in log] == list(range(len(log)))
    assert starts == [per, 2 * per, 3 * per, 4 * per]
    # a read resolves to the write of the same log, never to the entries copied from
    assert all(e.reads == k.reads for e, k in zip(log, kept, strict=False))
    assert log[3 * per].reads == tuple((p + 3 * per if p >= 0 else p, o, b + 3 * per
                                        if b >= 0 else b) for p, o, b in new[0].reads)
    assert kept[0].index == 0 and new[0].index == 3 * per  # the originals are left alone
    # Kept as found at the last inference's download, before its mark: the new calls still
    # begin an inference of their own (else the two run together in the search).
    log, starts = _joined((kept, kept_starts[:-1]), new, [0, per], most=10 * per)
    assert starts == [per, 2 * per, 3 * per, 4 * per]
    log, starts = _joined((kept, kept_starts), new, [0, per], most=2 * per)
    assert len(log) == 2 * per and starts == [0, per, 2 * per]  # the first two left out
    assert [e.op for e in log] == [e.op for e in (kept + new)[2 * per:]]


def test_the_op_log_keeps_its_threads_as_it_logs():
    app = App()
    cnn(app)
    assert app.log.threads() == [0]
    call = ops_pb2.OpCall(seq=99, op="aten::relu", thread=3)
    call.args.add().tensor.id = 1
    app.log.insert(len(app.log.calls), len(app.log.fetched), [call], [])
    assert app.log.threads() == [0, 3]
    app.log.clear()
    assert app.log.threads() == []


def test_a_stream_with_no_sequence_is_searched_while_another_streams_is_in_use(tmp_path):
    """Two threads (lanes) run inferences: once lane 0 has a sequence in use, lane 1, which
    ended inferences of its own and has none, is still searched (it never was before). A
    helper thread's calls, which end no inference, are no reason to search: its failed
    searches would back off the session's."""
    rec = recorder(tmp_path)
    app = Relay(rec)
    cnn(app)
    rec.active_threads.add(0)  # lane 0's sequence in use
    assert not rec.searching
    c = ops_pb2.OpCall(seq=99, op="aten::relu", thread=2)
    c.args.add().tensor.id = 5
    c.out_ids.append(77)
    rec.observe(ops_pb2.SessionUp(call=c))  # a helper thread's call: no inference ends
    assert 2 in rec.log.threads() and not rec.searching
    rec.inference_ended(1)  # lane 1 ended an inference
    assert rec.searching
    rec.active_threads.add(1)  # found: both lanes' sequences in use
    assert not rec.searching
