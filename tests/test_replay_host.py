"""Host-side replay against a tiny executor whose tensors are Python numbers: rebinding,
streamed outputs, waiting for inputs, aborts that keep the values before the mismatch and
restore values overwritten in place."""

from __future__ import annotations

import struct

import pytest
import torch

from rrto.v1 import ops_pb2
from rrtod import loops
from rrtod.gpu.replay import HostReplayer
from rrtod.wire import RETIRED_KEPT, SPAN
from testkit.loopdefs import branched
from testkit.numbers import NumberExecutor, num

SRC = ops_pb2.SeqSource


def call(op: str, out: int, *refs: ops_pb2.TensorRef) -> ops_pb2.OpCall:
    c = ops_pb2.OpCall(op=op, out_ids=[out])
    for r in refs:
        c.args.add().tensor.CopyFrom(r)
    return c


def upload(value: float) -> ops_pb2.TensorRef:
    return ops_pb2.TensorRef(upload=num(value))


def ref(i: int) -> ops_pb2.TensorRef:
    return ops_pb2.TensorRef(id=i)


def sequence() -> ops_pb2.SequenceDef:
    """x = input + c;  y = x * x;  x += y (in place);  out: y and x.   Recorded ids 1, 2."""
    d = ops_pb2.SequenceDef(id=7, local_ids=[1, 2], outputs=[2, 1])
    d.calls.extend([call("add", 1, upload(0.0), ref(100)), call("mul", 2, ref(1), ref(1)),
                    call("add_", 1, ref(1), ref(2))])
    d.sources.add(kind=SRC.INPUT)
    d.sources.add(kind=SRC.CONSTANT, id=100)
    d.sources.add(kind=SRC.PRODUCED, id=1)
    d.sources.add(kind=SRC.PRODUCED, id=1)
    d.sources.add(kind=SRC.PRODUCED, id=1)
    d.sources.add(kind=SRC.PRODUCED, id=2)
    return d


def run(replayer: HostReplayer, *frames: ops_pb2.SessionUp) -> list[ops_pb2.SessionDown]:
    out: list[ops_pb2.SessionDown] = []
    for f in frames:
        if f.WhichOneof("msg") in ("define", "start", "arg", "abort"):
            replayer.process(f, out.append)
        else:
            replayer.forwarded(f, out.append)
    return out


def value(down: ops_pb2.SessionDown) -> tuple[int, float]:
    return down.fetched.id, struct.unpack("<d", down.fetched.tensor.data)[0]


def test_definition_is_acknowledged():
    r = HostReplayer(NumberExecutor())
    out = run(r, ops_pb2.SessionUp(define=sequence()))
    assert [(d.defined.id, d.defined.accepted) for d in out] == [(7, True)]


def test_replay_rebinds_and_streams_outputs_as_they_exist():
    ex = NumberExecutor()
    r = HostReplayer(ex)
    run(r, ops_pb2.SessionUp(define=sequence()))
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=1000)))
    assert out == [] and ex.calls == []  # waits for the input
    out = run(r, ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))))
    # x = 12, y = 144 pushed after mul; then x += y -> 156 pushed after add_.
    assert [value(d) for d in out] == [(1001, 144.0), (1000, 156.0)]
    assert ex.calls == ["add", "mul", "add_"] and r.active is None
    # The next inference gets fresh ids and its own input.
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=2000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(0.0))))
    assert [value(d) for d in out] == [(2001, 100.0), (2000, 110.0)]
    assert ex.store[1000] == 156.0  # the earlier inference's values are untouched


def test_replays_run_to_their_end_are_timed_and_counted_once():
    """``timings``: per replay that ran its last call, its calls' CPU on the replay thread and
    the time from its start frame, however many frames it took; one stopped short adds none."""
    r = HostReplayer(NumberExecutor())
    run(r, ops_pb2.SessionUp(define=sequence()),
        ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=1000)))
    assert r.timings()["replays_completed"] == 0  # waits for its input
    run(r, ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))))
    first = r.timings()
    assert first["replays_completed"] == 1
    assert 0 < first["replay_cpu_s"] and 0 < first["replay_wall_s"]
    assert isinstance(first["replay_minor_faults"], int) and first["replay_minor_faults"] >= 0
    # Stopped short: the next start finds it without its input (REPLAY_INCOMPLETE).
    run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=2000)),
        ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=3000)),
        ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(1.0))))
    after = r.timings()
    assert after["replays_completed"] == 2 and r.replays == 3
    assert after["replay_cpu_s"] > first["replay_cpu_s"]


def test_rebound_constant_sticks_for_later_inferences():
    ex = NumberExecutor()
    ex.store[555] = 1.0
    r = HostReplayer(ex)
    run(r, ops_pb2.SessionUp(define=sequence()),
        ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=1000)),
        ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=1, tensor=ref(555))))
    out = run(r, ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))))
    assert value(out[0]) == (1001, 9.0)  # (2 + 1)^2
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=2000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(3.0))))
    assert value(out[0]) == (2001, 16.0)


def test_abort_keeps_values_before_the_mismatch_and_restores_in_place_writes():
    ex = NumberExecutor()
    r = HostReplayer(ex)
    run(r, ops_pb2.SessionUp(define=sequence()),
        ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=1000)),
        ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))))
    assert ex.store[1000] == 156.0  # the host ran ahead through the in-place add_
    # The app's third call differed: x must be what forwarding would have left (12), y kept.
    run(r, ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=2)))
    assert ex.store[1000] == 12.0 and ex.store[1001] == 144.0
    # At position 1: y was never the app's, so it is released.
    run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=3000)),
        ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(1.0))),
        ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=1)))
    assert ex.store[3000] == 11.0 and 3001 not in ex.store
    assert r.aborts == 2 and r.replays == 2


def progress(base: int, position: int) -> ops_pb2.SessionUp:
    """A release frame as the shim streams it, saying how far its app has matched."""
    return ops_pb2.SessionUp(release=ops_pb2.Release(
        progress=ops_pb2.ReplayProgress(base_id=base, position=position)))


def test_an_in_place_call_the_app_has_matched_is_not_snapshotted():
    """The app's release frames say how far it has matched a replay (``Release.progress``): an
    in-place call before that position can no longer be undone by an abort, so the host runs
    it without a copy; one at or past it is copied as before, and an abort there restores it.
    A claim about another inference changes nothing."""
    ex = NumberExecutor()
    r = HostReplayer(ex)
    start = ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=1000))
    run(r, ops_pb2.SessionUp(define=sequence()), start)
    r.read(progress(1000, 3))  # read by the transport while the replay waits for its input
    run(r, ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))))
    assert ex.store[1000] == 156.0 and (r.snapshots, r.snapshots_skipped) == (0, 1)
    # The app had matched only the first two calls: add_ (call 2) is copied, and undone.
    run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=3000)),
        progress(3000, 2), progress(1000, 3),
        ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))))
    assert (r.snapshots, r.snapshots_skipped) == (1, 1) and ex.store[3000] == 156.0
    run(r, ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=2)))
    assert ex.store[3000] == 12.0 and ex.store[3001] == 144.0
    # In stream order too, and never lowered: a later, smaller claim keeps the larger one.
    run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=5000)),
        progress(5000, 3), progress(5000, 1),
        ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(1.0))))
    assert (r.snapshots, r.snapshots_skipped) == (1, 2) and r.active is None
    assert r.timings()["replay_snapshots_skipped"] == 2


def test_forwarded_call_after_replay_confirms_it():
    ex = NumberExecutor()
    r = HostReplayer(ex)
    run(r, ops_pb2.SessionUp(define=sequence()),
        ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=1000)),
        ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))),
        ops_pb2.SessionUp(call=call("add", 5000, ref(1000), ref(1001))))
    assert ex.store[5000] == 156.0 + 144.0
    run(r, ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=0)))
    assert ex.store[1000] == 156.0  # too late to abort: nothing rolled back


def test_unknown_sequence_and_failing_call_are_reported():
    ex = NumberExecutor()
    r = HostReplayer(ex)
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=9, base_id=1)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))))
    # One error naming the sequence (the shim stops using it); its arguments are dropped quietly.
    assert [(x.error.code, x.error.sequence) for x in out] == [("UNKNOWN_SEQUENCE", 9)]
    d = sequence()
    d.calls[1].op = "fail"
    run(r, ops_pb2.SessionUp(define=d))
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=1000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))))
    # ... and where: the app may never make that call (it would forward it if it did)
    assert [(x.error.code, x.error.sequence, x.error.base_id, x.error.position)
            for x in out] == [("OP_FAILED", 7, 1000, 1)]
    out = run(r, ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=99, tensor=upload(2.0))))
    assert out == []  # the replay already failed: nothing more runs or is reported


def test_inconsistent_definition_is_refused_with_a_reason():
    r = HostReplayer(NumberExecutor())
    bad = sequence()
    del bad.sources[-1]
    out = run(r, ops_pb2.SessionUp(define=bad))
    assert out[0].defined.id == 7 and not out[0].defined.accepted
    assert "sources" in out[0].defined.reason and 7 not in r.sequences
    out = run(r, ops_pb2.SessionUp(define=sequence()),
              ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=1000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=6, tensor=upload(2.0))))
    assert out[-1].error.code == "BAD_ARG" and out[-1].error.sequence == 7


def test_definition_naming_more_ids_than_an_inference_range_is_refused():
    """Replayed inference k's ids are base + local index: a definition naming more than SPAN
    ids would hand inference k ids of inference k + 1."""
    r = HostReplayer(NumberExecutor())
    big = sequence()
    big.local_ids.extend(range(1 << 40, (1 << 40) + SPAN))
    out = run(r, ops_pb2.SessionUp(define=big))
    assert not out[0].defined.accepted and "id range" in out[0].defined.reason
    assert 7 not in r.sequences


def test_call_reading_a_released_constant_waits_for_the_apps_abort():
    """The app let go of the recorded constant (id 100): it cannot match call 0 any more, so
    the host must not run it ahead (the tensor is freed); the abort that follows is clean."""
    ex = NumberExecutor()
    r = HostReplayer(ex)
    run(r, ops_pb2.SessionUp(define=sequence()))
    r.forwarded(ops_pb2.SessionUp(release=ops_pb2.Release(ids=[100])), [].append)
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=1000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))),
              ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=0)))
    assert out == [] and ex.calls == [] and r.active is None
    # a constant bound in its place (a host-side rebind) is waited for no more
    ex.store[555] = 1.0
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=2000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=1, tensor=ref(555))),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))))
    assert value(out[0]) == (2001, 9.0)  # (2 + 1)^2


def test_a_definition_whose_constant_was_released_already_is_refused():
    """The search ran while the app let go of the recorded constant (id 100): the definition
    arrives after the release, so no replay could match it and running ahead would read a
    freed tensor. The host refuses it (the robot records again) instead of failing later."""
    ex = NumberExecutor()
    r = HostReplayer(ex)
    r.forwarded(ops_pb2.SessionUp(release=ops_pb2.Release(ids=[100])), [].append)
    (ack,) = run(r, ops_pb2.SessionUp(define=sequence()))
    assert not ack.defined.accepted and "released" in ack.defined.reason
    assert 7 not in r.sequences


def test_in_place_writes_need_an_executor_that_snapshots():
    class NoSnapshots:
        replay = None  # declares no replay extension

        def __init__(self) -> None:
            self.handle = NumberExecutor().handle

    r = HostReplayer(NoSnapshots())
    out = run(r, ops_pb2.SessionUp(define=sequence()))  # add_ writes x in place
    assert not out[0].defined.accepted and "in place" in out[0].defined.reason


def test_weight_slots_wait_until_the_shim_names_them_once():
    """A weight may be bound by the app only when its call is matched: the host must not run
    ahead of that. Named once, the binding holds for later inferences."""
    ex = NumberExecutor()
    ex.store[42] = 3.0
    d = sequence()
    d.sources[1].kind = SRC.PERSISTENT
    d.sources[1].hash = b"w"
    r = HostReplayer(ex)
    out = run(r, ops_pb2.SessionUp(define=d),
              ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=1000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))))
    assert out[1:] == [] and ex.calls == []
    out = run(r, ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=1, tensor=ref(42))))
    assert value(out[0]) == (1001, 25.0)  # (2 + 3)^2
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=2000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(1.0))))
    assert value(out[0]) == (2001, 16.0)


def test_empty_definition_drops_the_sequence_and_a_start_that_crossed_it_still_runs():
    """The robot drops a sequence (replaced, flushed) while an app thread starts it: the start
    comes after the drop, and the app already holds proxies of the calls it matched. The
    retired sequence runs it; only the last ``RETIRED_KEPT`` are kept."""
    r = HostReplayer(NumberExecutor())
    run(r, ops_pb2.SessionUp(define=sequence()))
    assert 7 in r.sequences
    run(r, ops_pb2.SessionUp(define=ops_pb2.SequenceDef(id=7)))
    assert 7 not in r.sequences
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=1000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))))
    assert [value(d) for d in out] == [(1001, 144.0), (1000, 156.0)]
    for i in range(8, 8 + RETIRED_KEPT):
        d = sequence()
        d.id = i
        run(r, ops_pb2.SessionUp(define=d), ops_pb2.SessionUp(define=ops_pb2.SequenceDef(id=i)))
    assert sorted(r.retired) == list(range(8, 8 + RETIRED_KEPT))
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=2000)))
    assert [(x.error.code, x.error.sequence) for x in out] == [("UNKNOWN_SEQUENCE", 7)]


def test_state_written_but_not_returned_is_restored_on_abort():
    """A running statistic: ``bump`` returns a + c and increments the constant c in place
    (the executor knows from the operator's schema). The host runs ahead; an abort before the
    call must leave c as forwarding would."""
    ex = NumberExecutor()
    d = ops_pb2.SequenceDef(id=8, local_ids=[1, 2], outputs=[2])
    d.calls.extend([call("add", 1, upload(0.0), upload(0.0)), call("bump", 2, ref(1), ref(100))])
    for kind, i in ((SRC.INPUT, 0), (SRC.INPUT, 0), (SRC.PRODUCED, 1), (SRC.CONSTANT, 100)):
        d.sources.add(kind=kind, id=i)
    r = HostReplayer(ex)
    run(r, ops_pb2.SessionUp(define=d))
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=8, base_id=1000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(1.0))),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=1, tensor=upload(2.0))))
    assert value(out[0]) == (1001, 13.0) and ex.store[100] == 11.0
    run(r, ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=1)))
    assert ex.store[100] == 10.0 and ex.store[1000] == 3.0 and 1001 not in ex.store


def waiting_sequence() -> ops_pb2.SequenceDef:
    """a = in0 + c;  b = a * a;  d = b + in1, where in1 comes later.   Recorded ids 1, 2, 3."""
    d = ops_pb2.SequenceDef(id=8, local_ids=[1, 2, 3], outputs=[3])
    d.calls.extend([call("add", 1, upload(0.0), ref(100)), call("mul", 2, ref(1), ref(1)),
                    call("add", 3, ref(2), upload(0.0))])
    for kind, i in [(SRC.INPUT, 0), (SRC.CONSTANT, 100), (SRC.PRODUCED, 1), (SRC.PRODUCED, 1),
                    (SRC.PRODUCED, 2), (SRC.INPUT, 0)]:
        d.sources.add(kind=kind, id=i)
    return d


def daemon(r: HostReplayer, *frames: ops_pb2.SessionUp) -> list[ops_pb2.SessionDown]:
    """As the GPU daemon: every frame is read (``HostReplayer.read``), then processed."""
    for f in frames:
        r.read(f)
    return run(r, *frames)


def release(*ids: int) -> ops_pb2.SessionUp:
    return ops_pb2.SessionUp(release=ops_pb2.Release(ids=ids))


class ReleasingExecutor(NumberExecutor):
    """Declares the replay extension's optional ``release``: frees without a frame."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[list[int]] = []

    def release(self, ids: list[int]) -> None:
        self.released.append(list(ids))
        for i in ids:
            self.store.pop(i, None)


@pytest.mark.parametrize("executor", [NumberExecutor, ReleasingExecutor])
def test_values_the_app_released_are_freed_after_their_last_use(executor):
    """The app drops a and b while the host waits for in1: a is freed as soon as the host runs
    on, b only after d read it, before their release frame is processed. An executor with
    ``release`` frees them through it, one without gets Release frames."""
    ex = executor()
    ex.store[5] = 1.0  # not this inference's: left to the release frame itself
    r = HostReplayer(ex)
    daemon(r, ops_pb2.SessionUp(define=waiting_sequence()),
           ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=8, base_id=1000)),
           ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))))
    assert ex.store[1000] == 12.0 and ex.store[1001] == 144.0  # waits for in1
    r.read(release(1000, 1001, 5))  # read; it waits in the queue behind the next argument
    out = run(r, ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=5, tensor=upload(5.0))))
    assert [value(x) for x in out] == [(1002, 149.0)]  # b was still there for d
    assert 1000 not in ex.store and 1001 not in ex.store and ex.store[5] == 1.0
    if isinstance(ex, ReleasingExecutor):
        assert sorted(i for ids in ex.released for i in ids) == [1000, 1001]
    run(r, release(1000, 1001, 5))
    assert 5 not in ex.store


def test_release_behind_a_frame_that_may_read_the_value_waits_for_its_turn():
    """The daemon reads frames ahead of the worker. A forwarded call read before the release
    may still read the value (the app mismatched and went on forwarding), and so may an
    argument that names it: the value must outlive both, although the replay's own last use
    of it has passed when the worker sees the release."""
    for reader in (ops_pb2.SessionUp(call=call("add", 2000, ref(1000), ref(1000))),
                   ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=5, tensor=ref(1000)))):
        ex = NumberExecutor()
        r = HostReplayer(ex)
        # a = 12 is computed; the replay waits for in1 while the next frames are read.
        out = daemon(r, ops_pb2.SessionUp(define=waiting_sequence()),
                     ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=8, base_id=1000)))
        frames = [ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0)))]
        if reader.WhichOneof("msg") == "call":
            frames.append(ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=5, tensor=upload(5.0))))
        frames += [reader, release(1000)]
        for f in frames:
            r.read(f)
        out += run(r, *frames)
        assert [x.WhichOneof("msg") for x in out] == ["defined", "fetched"]
        assert value(out[1]) == (1002, 149.0 if reader.WhichOneof("msg") == "call" else 156.0)
        assert ex.store.get(2000, 24.0) == 24.0 and 1000 not in ex.store


def two_inputs() -> ops_pb2.SequenceDef:
    """y = a + b;  out: y.   Two inputs, no constant."""
    d = ops_pb2.SequenceDef(id=9, local_ids=[1], outputs=[1])
    d.calls.append(call("add", 1, upload(0.0), upload(0.0)))
    d.sources.add(kind=SRC.INPUT)
    d.sources.add(kind=SRC.INPUT)
    return d


def arg(slot: int, **value) -> ops_pb2.SessionUp:
    return ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=slot, **value))


def start(base: int, seq: int = 9) -> ops_pb2.SessionUp:
    return ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=seq, base_id=base))


def test_repeated_input_is_named_not_sent():
    """``same_as``: the latest data uploaded for a slot, from this inference (one tensor read
    twice) or an earlier one (an input that did not change)."""
    r = HostReplayer(NumberExecutor())
    run(r, ops_pb2.SessionUp(define=two_inputs()))
    out = run(r, start(1000), arg(0, tensor=upload(3.0)), arg(1, same_as=0))
    assert [value(d) for d in out] == [(1000, 6.0)]
    out = run(r, start(2000), arg(0, same_as=0), arg(1, tensor=upload(5.0)))
    assert [value(d) for d in out] == [(2000, 8.0)]
    out = run(r, start(3000), arg(0, tensor=upload(1.0)), arg(1, same_as=1))
    assert [value(d) for d in out] == [(3000, 6.0)]  # slot 1's latest: 5 (sent at 2000)
    out = run(r, start(4000), arg(0, same_as=1), arg(1, same_as=0))
    assert [value(d) for d in out] == [(4000, 10.0)]  # 5, then slot 0's latest (now 5)


def test_repeat_of_a_slot_without_data_fails_and_is_forgotten():
    ex = NumberExecutor()
    r = HostReplayer(ex)
    run(r, ops_pb2.SessionUp(define=two_inputs()), ops_pb2.SessionUp(define=sequence()))
    out = run(r, start(1000), arg(0, tensor=upload(3.0)), arg(1, same_as=1))
    assert [(x.error.code, x.error.sequence) for x in out] == [("BAD_ARG", 9)]
    assert ex.calls == []
    # Only an INPUT slot takes a repeat.
    out = run(r, start(1500, seq=7), arg(0, tensor=upload(2.0)))
    assert [value(d) for d in out] == [(1501, 144.0), (1500, 156.0)]
    out = run(r, start(2000, seq=7), arg(1, same_as=0))
    assert [(x.error.code, x.error.sequence) for x in out] == [("BAD_ARG", 7)]
    # The failed slot's older data is forgotten: repeating it fails instead of reading it.
    run(r, start(3000), arg(0, tensor=upload(1.0)), arg(1, tensor=upload(2.0)))
    out = run(r, start(4000), arg(0, tensor=upload(1.0)), arg(1, same_as=0))
    assert [value(d) for d in out] == [(4000, 2.0)]
    out = run(r, start(5000), arg(1, same_as=5))
    assert out[-1].error.code == "BAD_ARG"
    out = run(r, start(6000), arg(0, tensor=upload(1.0)), arg(1, same_as=1))
    assert out[-1].error.code == "BAD_ARG" and 6000 not in ex.store


def test_inputs_of_a_failed_inference_are_still_kept_for_repeats():
    """The shim keeps sending (and remembering) inputs until it learns of a failure: the host
    must remember them too, or the next inference would repeat older data."""
    ex = NumberExecutor()
    d = two_inputs()
    r = HostReplayer(ex)
    run(r, ops_pb2.SessionUp(define=d), start(1000), arg(0, tensor=upload(1.0)),
        arg(1, tensor=upload(1.0)))
    out = run(r, start(2000), arg(5, tensor=upload(9.0)), arg(0, tensor=upload(4.0)),
              arg(1, tensor=upload(4.0)))
    assert [x.error.code for x in out] == ["BAD_ARG"] and 2000 not in ex.store
    out = run(r, start(3000), arg(0, same_as=0), arg(1, same_as=1))
    assert [value(d) for d in out] == [(3000, 8.0)]


def test_a_symbolic_integer_the_host_could_not_fill_in_is_refused():
    """A ``SymbolicInt`` must name an integer argument of its call and a size of a tensor
    made before that call in the same inference; otherwise the definition is refused (the
    host would run the call with a size it cannot know)."""
    def refused(**sym) -> str:
        d = sequence()
        d.calls[0].args.add(i=4)  # an integer argument for the symbols to name
        d.symbols.add(**sym)
        (down,) = run(HostReplayer(NumberExecutor()), ops_pb2.SessionUp(define=d))
        assert not down.defined.accepted
        return down.defined.reason

    assert "made after it" in refused(call=0, arg=2, tensor=1, dim=0)  # 1 is made by call 0
    assert "not an integer" in refused(call=1, arg=1, tensor=1, dim=0)  # a tensor argument
    assert "no argument" in refused(call=1, arg=9, tensor=1, dim=0)
    assert "no tensor" in refused(call=1, arg=0, tensor=55, dim=0)
    # the same for a value the app read (``SymbolicInt.value``)
    assert "made after it" in refused(call=0, arg=2, tensor=1, value=True)
    assert "not an integer" in refused(call=1, arg=1, tensor=1, value=True)


def test_a_start_that_joins_under_way_runs_the_rest_on_the_apps_values():
    """The app forwarded the first call itself (its output is id 500 = 12.0); the start joins
    at call 1, naming 500 as local value 0. The host runs only mul and add_, reads 500 where
    the sequence reads local 0, writes it in place, and pushes only what it made under base."""
    ex = NumberExecutor()
    ex.store[500] = 12.0
    r = HostReplayer(ex)
    run(r, ops_pb2.SessionUp(define=sequence()))
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=1000,
                                                             position=1, joined={0: 500})))
    assert ex.calls == ["mul", "add_"]  # no input to wait for: call 0 is the app's own
    assert [value(d) for d in out] == [(1001, 144.0)]  # 500 is the app's: it fetches it
    assert ex.store[500] == 156.0 and 1000 not in ex.store
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=2000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(0.0))))
    assert [value(d) for d in out] == [(2001, 100.0), (2000, 110.0)]  # then as usual


@pytest.mark.parametrize("position, joined", [(3, {}), (1, {2: 500})])
def test_a_join_past_the_sequence_is_refused_and_its_arguments_dropped(position, joined):
    ex = NumberExecutor()
    r = HostReplayer(ex)
    run(r, ops_pb2.SessionUp(define=sequence()))
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=1000,
                                                             position=position, joined=joined)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))))
    assert [(x.error.code, x.error.sequence) for x in out] == [("BAD_START", 7)]
    assert ex.calls == [] and r.active is None


@pytest.mark.parametrize("sequence_id, count, choices, position", [
    (7, 2, [-1], 1),  # no loop at all
    (9, 3, [-1], 4),  # iteration 1 begins at call 3 (head 1, body 2, no variant)
    (9, 3, [2], 5),  # a variant the loop does not have
    (9, 3, [-2], 3),  # nor a choice below SKIP
    (9, 1, [0, -1], 6),  # more iterations done than the loop has
    (9, 0, [], 3),  # a count with no choice: nothing done to resume after
    (9, 1 << 21, [-1], 3),  # a count past ``loops.MAX_COUNT``
])
def test_a_resume_that_does_not_fit_its_loop_is_refused_and_its_arguments_dropped(
        sequence_id, count, choices, position):
    """``ReplayStart.loop_choices`` from the network: a start whose sequence has no loop with
    variants, or whose choices, count or position do not fit it, is refused with one
    BAD_START; its arguments are dropped without more errors, and the next start replays."""
    ex = NumberExecutor()
    r = HostReplayer(ex)
    d = branched()
    d.id = 9
    assert loops.iteration_start(d, [-1]) == 3
    run(r, ops_pb2.SessionUp(define=sequence()), ops_pb2.SessionUp(define=d))
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(
        sequence=sequence_id, base_id=1000, position=position, joined={0: 500},
        loop_count=count, loop_choices=choices)),
        ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(2.0))))
    assert [(x.error.code, x.error.sequence) for x in out] == [("BAD_START", sequence_id)]
    assert ex.calls == [] and r.active is None
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=7, base_id=2000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(0.0))))
    assert [value(d) for d in out] == [(2001, 100.0), (2000, 110.0)]


def test_an_integer_the_app_computes_from_a_value_it_read_is_the_hosts_own():
    """``SymbolicInt.value``: call 1 takes ``int()`` of the value call 0 made (the app read it
    and passed ``int(x.item())`` on). The host fills it in from its own tensor, every
    inference with its own value; without that tensor the replay fails, saying where."""
    d = ops_pb2.SequenceDef(id=8, local_ids=[1, 2], outputs=[2])
    d.calls.extend([call("add", 1, upload(0.0), ref(100)), call("scale", 2, ref(1))])
    d.calls[1].args.add(i=3)  # as recorded: 3 then
    d.sources.add(kind=SRC.INPUT)
    d.sources.add(kind=SRC.CONSTANT, id=100)
    d.sources.add(kind=SRC.PRODUCED, id=1)
    d.symbols.add(call=1, arg=1, tensor=1, value=True)
    ex = NumberExecutor()
    r = HostReplayer(ex)
    run(r, ops_pb2.SessionUp(define=d))
    out = run(r, start(1000, seq=8), arg(0, tensor=upload(2.5)))
    assert [value(x) for x in out] == [(1001, 12.5 * 12)] and ex.calls[-1] == "scale 12"
    out = run(r, start(2000, seq=8), arg(0, tensor=upload(-6.5)))
    assert [value(x) for x in out] == [(2001, 3.5 * 3)] and ex.calls[-1] == "scale 3"
    ex.scalar = lambda tid: None  # type: ignore[method-assign]  # (not one element, say)
    out = run(r, start(3000, seq=8), arg(0, tensor=upload(1.0)))
    assert [(x.error.code, x.error.base_id, x.error.position) for x in out] == [
        ("REPLAY_FAILED", 3000, 1)]


def test_a_value_read_is_kept_until_the_call_that_takes_it_runs():
    """The app reads ``x`` (``item()``) and drops it at once; the call that takes ``int(x)``
    waits for another input. The release reaches the host first: ``x`` is still freed only
    after that call (a symbol is a use), never before, which would fail the replay."""
    d = ops_pb2.SequenceDef(id=8, local_ids=[1, 2], outputs=[2])
    d.calls.extend([call("add", 1, upload(0.0), ref(100)), call("scale", 2, upload(0.0))])
    d.calls[1].args.add(i=3)
    d.sources.add(kind=SRC.INPUT)
    d.sources.add(kind=SRC.CONSTANT, id=100)
    d.sources.add(kind=SRC.INPUT)
    d.symbols.add(call=1, arg=1, tensor=1, value=True)
    ex = NumberExecutor()
    r = HostReplayer(ex)
    run(r, ops_pb2.SessionUp(define=d))
    out = run(r, start(1000, seq=8), arg(0, tensor=upload(2.5)),
              ops_pb2.SessionUp(release=ops_pb2.Release(ids=[1000])),
              arg(2, tensor=upload(5.0)))
    assert [value(x) for x in out] == [(1001, 5.0 * 12)]
    assert 1000 not in ex.store  # freed once taken


def looped() -> ops_pb2.SequenceDef:
    """x = input + c, then ``for i in range(len(x))``: y = x * i (``scale``, the index an
    integer argument). Outputs: x, and every iteration's y."""
    d = ops_pb2.SequenceDef(id=9, local_ids=[1, 2], outputs=[1, 2])
    scale = ops_pb2.OpCall(op="scale", out_ids=[2])
    scale.args.add().tensor.id = 1
    scale.args.add().i = 0
    d.calls.extend([call("add", 1, upload(0.0), ref(100)), scale])
    d.sources.add(kind=SRC.INPUT)
    d.sources.add(kind=SRC.CONSTANT, id=100)
    d.sources.add(kind=SRC.PRODUCED, id=1)
    d.symbols.add(call=1, arg=1, index=True)
    d.loops.add(start=1, body=1, tensor=1, dim=0)
    return d


def test_a_loop_runs_as_many_times_as_this_inferences_count():
    """The host runs the head, takes the count from its own tensor, and goes on unrolled: each
    iteration with its index and its own ids, each output pushed when made; the next inference
    unrolls for its own count."""
    ex = NumberExecutor()
    r = HostReplayer(ex)
    (ack,) = run(r, ops_pb2.SessionUp(define=looped()))
    assert ack.defined.accepted, ack
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=9, base_id=1000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(-7.0))))
    # x = 3: three iterations; x is pushed once the loop is unrolled (nothing writes it after)
    assert ex.calls == ["add", "scale 0", "scale 1", "scale 2"] and r.active is None
    pushed = [value(d) for d in out]
    assert pushed[0] == (1000, 3.0) and [v for _, v in pushed[1:]] == [0.0, 3.0, 6.0]
    assert len({i for i, _ in pushed}) == 4  # every iteration's y has an id of its own
    ex.calls.clear()
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=9, base_id=2000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(-10.0))))
    assert ex.calls == ["add"] and [value(d) for d in out] == [(2000, 0.0)]  # no iteration
    assert r.active is None


def test_a_loop_without_a_count_fails_the_replay_and_says_where():
    """The count's tensor has no size here (this inference's data took another path): the
    replay fails at the loop, reported with its position; nothing is run past it."""
    ex = NumberExecutor()
    r = HostReplayer(ex)
    run(r, ops_pb2.SessionUp(define=looped()))
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=9, base_id=1000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(-12.0))))
    (err,) = [d.error for d in out if d.WhichOneof("msg") == "error"]
    assert (err.code, err.sequence, err.base_id, err.position) == ("REPLAY_FAILED", 9, 1000, 1)
    assert ex.calls == ["add"]


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD"), reason="Linux only")
def test_the_replay_threads_page_faults_count_memory_touched_afresh():
    """``timings()["replay_minor_faults"]`` counts the replay thread's minor page faults: what a
    replay writing into fresh memory costs (stop 30's finding); 64 MiB touched afresh is at
    least its pages' worth."""
    from rrtod.gpu.replay import _minor_faults

    before = _minor_faults()
    fresh = torch.ones(16 << 20)  # 64 MiB: a fresh mapping, every page written
    assert _minor_faults() - before >= (64 << 20) // (2 << 20)  # even with 2 MiB huge pages
    del fresh


class DenseNumbers(NumberExecutor):
    """Numbers as tensors of that many elements, every one laid out densely; a call whose
    result the app waits for is answered with its sizes."""

    def dense_sizes(self, tid):
        return self.shape(tid)

    def handle(self, frame):
        yield from super().handle(frame)
        if frame.WhichOneof("msg") == "call" and frame.call.want_meta:
            yield ops_pb2.SessionDown(result=ops_pb2.OpResult(outs=[ops_pb2.TensorMeta(
                dtype="float64", shape=self.shape(frame.call.out_ids[0]))]))


def test_the_sizes_of_outputs_that_follow_the_data_go_to_the_shim_ahead_of_its_answers():
    """Calls whose sizes follow the data (``varies_from``): the sizes of each one's dense
    output go to the shim (``ReplaySizes``, as the app counts calls) before the next answer
    the app waits for, and the rest when the host has run what it can; an answered call's
    sizes come with its answer, and an output that is not dense is not sent."""
    d = ops_pb2.SequenceDef(id=21, local_ids=[1, 2, 3, 4], outputs=[4])
    d.calls.extend([call("add", 1, upload(0.0), ref(100)), call("mul", 2, ref(1), ref(1)),
                    call("add", 3, ref(2), ref(1)), call("add", 4, ref(3), ref(100))])
    d.calls[1].want_meta = True  # the app waits for its answer
    d.sources.add(kind=SRC.INPUT, any_shape=True)
    d.sources.add(kind=SRC.CONSTANT, id=100)
    for i in (1, 1, 2, 1, 3):
        d.sources.add(kind=SRC.PRODUCED, id=i)
    d.sources.add(kind=SRC.CONSTANT, id=100)
    d.varies_from = 0
    ex = DenseNumbers()
    r = HostReplayer(ex)
    (ack,) = run(r, ops_pb2.SessionUp(define=d))
    assert ack.defined.accepted, ack
    ex.store[100] = -20.0  # so that call 3 makes -8: no tensor of its own sizes
    out = run(r, ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=21, base_id=1000)),
              ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=upload(22.0))))
    kinds = [f.WhichOneof("msg") for f in out]
    assert kinds == ["sizes", "answer", "fetched", "sizes"], out
    first, last = out[0].sizes, out[3].sizes
    assert (first.base_id, list(first.positions), list(first.ranks), list(first.dims)) == (
        1000, [0], [1], [2])  # call 0 made 22 - 20 = 2
    assert out[1].answer.position == 1  # 2 * 2 = 4, with its own metadata
    assert (list(last.positions), list(last.dims)) == ([2], [6])  # 4 + 2; call 3's -14 not
