"""The shim's replay client without a connection: what it keeps of the definitions and answers
the host sends it."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import torch

from rrto.v1 import ops_pb2
from rrto_plugins.torch.client import RemoteSession
from rrto_plugins.torch.metadata import MetaCache, OpInfo, app_device
from rrto_plugins.torch.proxy import Handle, new_proxy
from rrto_plugins.torch.replay import (
    MAX_PER_THREAD,
    MAX_TAIL_BYTES,
    MISS,
    RELEASE_STREAM_AT,
    SIZED_INFERENCES,
    Active,
    ReplayClient,
    _read_after,
    decode_answer,
)
from rrtod.wire import REPLAY_BASE, SPAN, released_ids
from testkit.channels import Channel


class Session:
    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.released: list[int] = []
        self.lost: str | None = None
        self.epoch = 0
        self.sent: list[Any] = []
        self.progress: Any = None

    def send_frames(self, frames: list[Any]) -> None:
        if self.released:  # as the real session: pending releases go first
            self.sent.append(RemoteSession._release_frame(self, self.released))  # type: ignore[arg-type]
            self.released = []
        self.sent += frames

    def release_now(self, at_least: int) -> None:
        if len(self.released) >= at_least:
            self.send_frames([])

    def output_template(self, func: Any, args: tuple, kwargs: dict) -> Any:
        return MetaCache(self.counters).output_template(func, args, kwargs)

    app_device = staticmethod(app_device)


def definition(seq_id: int) -> ops_pb2.SequenceDef:
    d = ops_pb2.SequenceDef(id=seq_id, local_ids=[1, 2], outputs=[2])
    call = d.calls.add(op="aten::relu.default", out_ids=[2])
    call.args.add().tensor.CopyFrom(ops_pb2.TensorRef(bind_id=1, upload=ops_pb2.TensorData(
        meta=ops_pb2.TensorMeta(dtype="float32", shape=[4], stride=[1]))))
    d.sources.add(kind=ops_pb2.SeqSource.INPUT)
    return d


def test_a_thread_keeps_a_bounded_number_of_sequences():
    """Variants (input shapes, models, branches) each get a sequence; beyond the bound the
    one found longest ago is dropped, and the robot is told (it drops it on the host)."""
    client = ReplayClient(Session())  # type: ignore[arg-type]
    for i in range(1, MAX_PER_THREAD + 2):
        client.define(definition(i))
    assert [s.id for s in client.sequences[0]] == list(range(MAX_PER_THREAD + 1, 1, -1))
    assert client._give_up == [1] and client.counters["dropped"] == 1


def test_an_answer_decodes_as_forwarding_would_or_not_at_all():
    """A ``ReplayAnswer`` from the network: proxies with the sizes the host found, a value;
    metadata that cannot be a tensor's is no answer (MISS: the call is forwarded)."""
    session = Session()
    ok = ops_pb2.OpResult(outs=[ops_pb2.TensorMeta(dtype="int64", shape=[3, 1], stride=[1, 1])],
                          value=ops_pb2.Value(tensor=ops_pb2.TensorRef(id=7)))
    t = decode_answer(ok, session, torch.device("cpu"))  # type: ignore[arg-type]
    assert tuple(t.shape) == (3, 1) and t.dtype == torch.int64 and t._rrto_handle.id == 7
    assert decode_answer(ops_pb2.OpResult(value=ops_pb2.Value(b=True)), session,  # type: ignore[arg-type]
                         torch.device("cpu")) is True
    bad = ops_pb2.OpResult(outs=[ops_pb2.TensorMeta(dtype="int64", shape=[3], stride=[1, 1])],
                           value=ops_pb2.Value(tensor=ops_pb2.TensorRef(id=7)))
    assert decode_answer(bad, session, torch.device("cpu")) is MISS  # type: ignore[arg-type]
    missing = ops_pb2.OpResult(value=ops_pb2.Value(tensor=ops_pb2.TensorRef(id=7)))
    assert decode_answer(missing, session, torch.device("cpu")) is MISS  # type: ignore[arg-type]


def chain() -> ops_pb2.SequenceDef:
    """relu(input) -> neg -> sigmoid: recorded ids 2, 3, 4 (local 0, 1, 2); the app reads 4."""
    d = ops_pb2.SequenceDef(id=5, local_ids=[2, 3, 4], outputs=[4])
    meta = ops_pb2.TensorMeta(dtype="float32", shape=[4], stride=[1])
    first = d.calls.add(op="aten::relu.default", out_ids=[2], out_meta=[meta])
    first.args.add().tensor.upload.meta.CopyFrom(meta)
    d.sources.add(kind=ops_pb2.SeqSource.INPUT)
    for op, src, out in (("aten::neg.default", 2, 3), ("aten::sigmoid.default", 3, 4)):
        call = d.calls.add(op=op, out_ids=[out], out_meta=[meta])
        call.args.add().tensor.id = src
        d.sources.add(kind=ops_pb2.SeqSource.PRODUCED, id=src)
    return d


def forwarded(client: ReplayClient, op: str, arg: ops_pb2.TensorRef, out: int) -> None:
    meta = ops_pb2.TensorMeta(dtype="float32", shape=[4], stride=[1])
    call = ops_pb2.OpCall(op=op, out_ids=[out], out_meta=[meta])
    call.args.add().tensor.CopyFrom(arg)
    client.forwarded(call, None)


def relu_neg(client: ReplayClient, session: Session, upload: ops_pb2.TensorRef, out: int,
             reads: int | None = None) -> torch.Tensor:
    """The app forwards ``relu(upload) -> out`` then ``neg(reads, default out) -> out + 1``;
    returns the proxy of ``out + 1`` (what its next call, sigmoid, takes)."""
    forwarded(client, "aten::relu.default", upload, out)
    forwarded(client, "aten::neg.default", ops_pb2.TensorRef(id=out if reads is None else reads),
              out + 1)
    return new_proxy(Handle(session, out + 1), (4,), (1,), 0, torch.float32,
                     torch.device("cpu"))


def test_a_sequence_that_arrives_mid_inference_joins_it_where_the_app_is():
    """The app forwarded relu and neg (ids 500, 501) before the sequence arrived; its next
    call, sigmoid of 501, joins at position 2, naming 501 as the sequence's local 1 (all the
    host needs: the only value read from there on), and 500 as local 0 for the shim."""
    session = Session()
    client = ReplayClient(session)  # type: ignore[arg-type]
    upload = ops_pb2.TensorRef(upload=ops_pb2.TensorData(meta=ops_pb2.TensorMeta(
        dtype="float32", shape=[4], stride=[1])))
    x = relu_neg(client, session, upload, 500)
    client.define(chain())
    (seq,) = client.sequences[0]
    info = OpInfo(torch.ops.aten.sigmoid.default)
    act, frames = client._join([seq], (x,), {}, info, 0)
    assert act.position == 2 and act.joined == {0: 500, 1: 501} and frames == ()
    assert _read_after(seq, 2, act.joined) == {1: 501}
    # A tail that is not the sequence's dataflow (neg read another value) does not join.
    client.downloaded()
    y = relu_neg(client, session, upload, 600, reads=999)
    assert client._join([seq], (y,), {}, info, 0) is None


def test_an_app_that_reads_nothing_joins_the_inference_under_way():
    """Inferences whose app reads nothing (at most the sizes it was answered) leave no
    download to show where one began: each outermost module call (``inference_started``)
    starts the kept calls afresh, so the sequence that arrives during the sixth joins the
    sixth, not the calls of the first ones. After a read, the calls kept since the read stay
    (the next inference's pre-processing may come before its module call)."""
    session = Session()
    client = ReplayClient(session)  # type: ignore[arg-type]
    upload = ops_pb2.TensorRef(upload=ops_pb2.TensorData(meta=ops_pb2.TensorMeta(
        dtype="float32", shape=[4], stride=[1])))
    for k in range(5):
        client.inference_started()
        relu_neg(client, session, upload, 500 + 10 * k)
        forwarded(client, "aten::sigmoid.default", ops_pb2.TensorRef(id=501 + 10 * k),
                  502 + 10 * k)
    client.inference_started()
    x = relu_neg(client, session, upload, 600)
    client.define(chain())
    (seq,) = client.sequences[0]
    info = OpInfo(torch.ops.aten.sigmoid.default)
    act, _ = client._join([seq], (x,), {}, info, 0)
    assert act.position == 2 and act.joined == {0: 600, 1: 601}
    client.downloaded()
    y = relu_neg(client, session, upload, 700)
    client.inference_started()  # after a read: the calls since it are kept
    act, _ = client._join([seq], (y,), {}, info, 0)
    assert act.position == 2 and act.joined == {0: 700, 1: 701}


def test_forwarded_frames_are_kept_for_a_join_only_up_to_a_bound():
    """The kept frames hold the app's uploads: past ``MAX_TAIL_BYTES`` none are kept and that
    inference is not joined (it replays from its next one); a download starts afresh."""
    session = Session()
    client = ReplayClient(session)  # type: ignore[arg-type]
    big = ops_pb2.TensorRef(upload=ops_pb2.TensorData(
        meta=ops_pb2.TensorMeta(dtype="float32", shape=[4], stride=[1]),
        data=bytes(MAX_TAIL_BYTES)))
    x = relu_neg(client, session, big, 500)
    client.define(chain())
    (seq,) = client.sequences[0]
    info = OpInfo(torch.ops.aten.sigmoid.default)
    assert client._join([seq], (x,), {}, info, 0) is None
    client.downloaded()
    small = ops_pb2.TensorRef(upload=ops_pb2.TensorData(
        meta=ops_pb2.TensorMeta(dtype="float32", shape=[4], stride=[1]), data=bytes(16)))
    y = relu_neg(client, session, small, 600)
    joined = client._join([seq], (y,), {}, info, 0)
    assert joined is not None and joined[0].joined == {0: 600, 1: 601}


def test_a_call_the_host_failed_ahead_of_the_app_is_forwarded_only_when_the_app_gets_there():
    """The host ran ahead and failed call 2 of an inference (``Error.base_id``/``position``).
    The app's calls before it still replay; at call 2 the app mismatches (the call is
    forwarded: it fails there as forwarding fails, if the app makes it) and no error is
    raised for a call the app may never make. If the app had already made it, the error is
    the app's: kept to be raised at its next read."""
    session = Session()
    session.errors = []
    session.add_async_error = session.errors.append  # type: ignore[attr-defined]
    client = ReplayClient(session)  # type: ignore[arg-type]
    client.define(chain())
    (seq,) = client.sequences[0]
    err = ops_pb2.Error(code="OP_FAILED", sequence=seq.id, base_id=REPLAY_BASE, position=2)
    act = Active(seq, REPLAY_BASE, position=1)
    client._tls.active = act
    client.broken(err)
    assert not client._check_broken(act) and client.active is act  # call 1: still replayed
    act.position = 2
    assert client._check_broken(act) and client.active is None and session.errors == []
    assert session.sent[-1].abort.position == 2 and client._aborted[REPLAY_BASE] == 2
    late = Active(seq, REPLAY_BASE + SPAN, position=2)
    client._tls.active = late
    client.broken(ops_pb2.Error(code="OP_FAILED", base_id=REPLAY_BASE + SPAN, position=1))
    assert client._check_broken(late) and [e.position for e in session.errors] == [1]
    assert client.counters["failed_ahead"] == 2 and client.counters["mismatches"] == 2


def test_an_inference_start_waits_for_a_running_search_and_replays_what_it_found():
    """The robot said a search is running (``SearchHint``): the thread's first call after a
    download waits until the search is over, so the sequence found, which arrives first,
    replays this inference. Later calls, and a start once the search is over, never wait."""
    session = Session()
    client = ReplayClient(session)  # type: ignore[arg-type]
    relu, info = torch.ops.aten.relu.default, OpInfo(torch.ops.aten.relu.default)
    client.downloaded()  # the app read the outputs of its second inference
    client.search_hint(ops_pb2.SearchHint(running=True, wait_us=5_000_000))

    def robot() -> None:
        time.sleep(0.05)
        client.define(chain())
        client.search_hint(ops_pb2.SearchHint(running=False))

    t = threading.Thread(target=robot)
    t.start()
    t0 = time.monotonic()
    result = client.dispatch(relu, (torch.ones(4),), {}, info, 0, 0)
    waited = time.monotonic() - t0
    t.join()
    assert result is not MISS and client.active is not None, session.sent
    assert session.sent[0].start.sequence == 5 and 0.04 <= waited < 5, waited
    assert client.counters["search_waits"] == 1 and client.counters["search_wait_ns"] > 0


def test_a_search_hinted_before_a_slow_download_is_waited_for_from_the_download():
    """The robot hints as it forwards the download; the host answers it only once it has run
    the calls queued before it. The hint's bound counts from the download's reply, not from
    the hint: else an inference the host takes longer than the bound to run (resnet50
    forwarded back to back, 127 ms against 100) begins without waiting, and is forwarded."""
    session = Session()
    client = ReplayClient(session)  # type: ignore[arg-type]
    relu, info = torch.ops.aten.relu.default, OpInfo(torch.ops.aten.relu.default)
    client.search_hint(ops_pb2.SearchHint(running=True, wait_us=300_000))
    time.sleep(0.4)  # the host runs the inference: past the hint's bound
    client.downloaded()  # its reply: the bound counts from here
    threading.Timer(0.1, lambda: (client.define(chain()), client.search_hint(
        ops_pb2.SearchHint(running=False)))).start()
    result = client.dispatch(relu, (torch.ones(4),), {}, info, 0, 0)
    assert result is not MISS and session.sent[0].start.sequence == 5, session.sent
    assert client.counters["search_waits"] == 1


def test_a_hint_that_comes_while_a_call_waits_moves_its_bound():
    """The robot hints again when its search finds a sequence (the wait now covers the host's
    definition too): a call already waiting keeps waiting past the first hint's bound, and
    replays the inference with what was found."""
    session = Session()
    client = ReplayClient(session)  # type: ignore[arg-type]
    relu, info = torch.ops.aten.relu.default, OpInfo(torch.ops.aten.relu.default)
    client.search_hint(ops_pb2.SearchHint(running=True, wait_us=100_000))
    threading.Timer(0.05, client.search_hint, (ops_pb2.SearchHint(
        running=True, wait_us=5_000_000),)).start()  # found at 50 ms: the host defines it
    threading.Timer(0.3, lambda: (client.define(chain()), client.search_hint(
        ops_pb2.SearchHint(running=False)))).start()  # defined at 300 ms
    t0 = time.monotonic()
    result = client.dispatch(relu, (torch.ones(4),), {}, info, 0, 0)
    assert result is not MISS and session.sent[0].start.sequence == 5, session.sent
    assert 0.25 <= time.monotonic() - t0 < 5
    assert client.counters["search_waits"] == 1


def test_a_call_waits_for_a_search_no_longer_than_the_robot_allows():
    """A hinted search holds the next call of a thread that replays nothing: at an inference
    start (the hint came before a download's reply) or a few calls into it (the hint came at
    the inference mark, which the shim sends with the inference's first calls; the sequence
    found then joins it). A search that finds nothing ends the wait at once; one whose end
    never comes costs at most ``wait_us``; once over or past its bound, calls do not wait."""
    session = Session()
    client = ReplayClient(session)  # type: ignore[arg-type]
    relu, info = torch.ops.aten.relu.default, OpInfo(torch.ops.aten.relu.default)
    client.search_hint(ops_pb2.SearchHint(running=True, wait_us=5_000_000))
    threading.Timer(0.05, client.search_hint, (ops_pb2.SearchHint(running=False),)).start()
    t0 = time.monotonic()
    assert client.dispatch(relu, (torch.ones(4),), {}, info, 0, 0) is MISS
    assert 0.04 <= time.monotonic() - t0 < 5
    assert client.dispatch(relu, (torch.ones(4),), {}, info, 0, 0) is MISS
    assert client.counters["search_waits"] == 1  # over: no wait
    client.search_hint(ops_pb2.SearchHint(running=True, wait_us=50_000))
    t0 = time.monotonic()
    assert client.dispatch(relu, (torch.ones(4),), {}, info, 0, 0) is MISS
    assert 0.04 <= time.monotonic() - t0 < 5
    assert client.dispatch(relu, (torch.ones(4),), {}, info, 0, 0) is MISS
    assert client.counters["search_waits"] == 2  # its end never came, but its bound passed
    assert client.counters["search_waits"] == 2 and session.sent == []


def looped(dim: int = 0) -> ops_pb2.SequenceDef:
    """``y = relu(x)``, then ``for i in range(y.shape[dim]): y.select(0, i)``."""
    d = ops_pb2.SequenceDef(id=11, local_ids=[1, 2, 3], outputs=[3])
    relu = d.calls.add(op="aten::relu.default", out_ids=[2])
    relu.args.add().tensor.CopyFrom(ops_pb2.TensorRef(bind_id=1, upload=ops_pb2.TensorData(
        meta=ops_pb2.TensorMeta(dtype="float32", shape=[3], stride=[1]))))
    relu.out_meta.add(dtype="float32", shape=[3], stride=[1])
    select = d.calls.add(op="aten::select.int", out_ids=[3])
    select.args.add().tensor.id = 2
    select.args.add().i = 0
    select.args.add().i = 0
    select.out_meta.add(dtype="float32", shape=[], stride=[])
    d.sources.add(kind=ops_pb2.SeqSource.INPUT, any_shape=True)
    d.sources.add(kind=ops_pb2.SeqSource.PRODUCED, id=2)
    d.symbols.add(call=1, arg=2, index=True)
    d.loops.add(start=1, body=1, tensor=2, dim=dim)
    d.varies_from = 0
    return d


def test_a_loop_is_unrolled_for_the_count_the_app_has_now():
    """The head's end: the count is the size of a tensor the replay made, as the app holds it
    (4 rows); the thread goes on with the loop unrolled four times, under the same base, and
    the inference ends after the fourth ``select``. A count it cannot know is a mismatch."""
    session = Session()
    client = ReplayClient(session)  # type: ignore[arg-type]
    client.define(looped())
    relu, select = torch.ops.aten.relu.default, torch.ops.aten.select.int
    y = client.dispatch(relu, (torch.ones(4),), {}, OpInfo(relu), 0, 0)
    assert tuple(y.shape) == (4,) and client.active is not None
    act = client.active
    assert len(act.seq.steps) == 5 and act.seq.root is not None
    for i in range(4):
        got = client.dispatch(select, (y, 0, i), {}, OpInfo(select), 0, 0)
        assert got is not MISS and got._rrto_handle.id == act.base + act.seq.local[
            act.seq.definition.calls[1 + i].out_ids[0]]
    assert client.active is None and client.counters["mismatches"] == 0
    assert client._bases[act.base] is act.seq  # pushes are expected by the unrolled outputs

    # A join that the head's last call completes: the loop reads ``y``, made before the join,
    # so the host must be told where it is (else it would read an id nobody made).
    (seq,) = client.sequences[0]
    assert _read_after(seq, len(seq.steps), {0: 98, 1: 99}) == {1: 99}

    other = ReplayClient(Session())  # type: ignore[arg-type]
    other.define(looped(dim=1))  # a 1-D tensor has no size 1: the loop cannot be unrolled
    other.dispatch(relu, (torch.ones(4),), {}, OpInfo(relu), 0, 0)
    assert other.active is None and other.counters["mismatches"] == 1
    assert other.session.sent[-1].abort.position == 1


def varying() -> ops_pb2.SequenceDef:
    """``relu(x)`` of an input of any size: its output's sizes follow the data."""
    d = ops_pb2.SequenceDef(id=12, local_ids=[1, 2], outputs=[2])
    relu = d.calls.add(op="aten::relu.default", out_ids=[2])
    relu.args.add().tensor.CopyFrom(ops_pb2.TensorRef(bind_id=1, upload=ops_pb2.TensorData(
        meta=ops_pb2.TensorMeta(dtype="float32", shape=[3], stride=[1]))))
    relu.out_meta.add(dtype="float32", shape=[3], stride=[1])
    d.sources.add(kind=ops_pb2.SeqSource.INPUT, any_shape=True)
    d.varies_from = 0
    return d


def sizes(base: int, *calls: tuple[int, tuple[int, ...]]) -> ops_pb2.ReplaySizes:
    return ops_pb2.ReplaySizes(base_id=base, positions=[p for p, _ in calls],
                               ranks=[len(d) for _, d in calls],
                               dims=[n for _, d in calls for n in d])


def test_a_varying_steps_proxy_is_made_from_the_sizes_the_host_pushed():
    """The first replay works the output's sizes out from the arguments; later ones take the
    sizes the host pushed for the inference (it runs ahead), without working them out. (The
    host pushes its own tensor's sizes, which are the app's; here they differ on purpose, to
    show where the proxy's came from.) Sizes that do not add up, or have another rank than the
    step's output, or no tensor could have, or are for another inference, are not used: the
    step is worked out as before."""
    client = ReplayClient(Session())  # type: ignore[arg-type]
    client.define(varying())
    relu = torch.ops.aten.relu.default

    def replay(n: int) -> torch.Tensor:
        out = client.dispatch(relu, (torch.ones(n),), {}, OpInfo(relu), 0, 0)
        assert out is not MISS and client.active is None
        return out

    base = REPLAY_BASE
    assert tuple(replay(4).shape) == (4,) and client.counters["sized"] == 0  # worked out
    base += SPAN
    client.sized(sizes(base, (0, (7,))))
    assert tuple(replay(5).shape) == (7,) and client.counters["sized"] == 1  # the host's
    base += SPAN
    client.sized(sizes(base + SPAN, (0, (7,))))  # another inference's
    client.sized(ops_pb2.ReplaySizes(base_id=base, positions=[0], ranks=[2], dims=[7]))
    assert tuple(replay(5).shape) == (5,)
    base += SPAN
    client.sized(sizes(base, (0, (7, 1))))  # rank 2 for a rank-1 output
    assert tuple(replay(5).shape) == (5,)
    base += SPAN
    client.sized(sizes(base, (0, (-3,))))  # no tensor has these
    assert tuple(replay(6).shape) == (6,) and client.counters["sized"] == 1
    assert client.counters["mismatches"] == 0

    # kept for a bounded number of inferences the app has not reached (then not at all)
    for k in range(2 * SIZED_INFERENCES):
        client.sized(sizes(base + (10 + k) * SPAN, (0, (3,))))
    assert len(client._sizes) <= SIZED_INFERENCES


def long_chain(n: int) -> ops_pb2.SequenceDef:
    """relu(input) then ``n - 1`` negs, each of the one before: local ``i`` is call ``i``'s."""
    d = ops_pb2.SequenceDef(id=9, local_ids=list(range(2, n + 2)), outputs=[n + 1])
    meta = ops_pb2.TensorMeta(dtype="float32", shape=[4], stride=[1])
    first = d.calls.add(op="aten::relu.default", out_ids=[2], out_meta=[meta])
    first.args.add().tensor.upload.meta.CopyFrom(meta)
    d.sources.add(kind=ops_pb2.SeqSource.INPUT)
    for out in range(3, n + 2):
        call = d.calls.add(op="aten::neg.default", out_ids=[out], out_meta=[meta])
        call.args.add().tensor.id = out - 1
        d.sources.add(kind=ops_pb2.SeqSource.PRODUCED, id=out - 1)
    return d


def test_what_the_app_drops_goes_to_the_host_while_the_replay_runs_ahead():
    """An app that drops each value as soon as the next call has read it (a forward): its
    releases go up a frame per RELEASE_STREAM_AT values while it matches the sequence, not
    only when it waits for an output, so a host slower than the app frees them after their
    last use instead of holding the whole inference (``HostReplayer.read``)."""
    n = 3 * RELEASE_STREAM_AT + 10
    session = Session()
    client = ReplayClient(session)  # type: ignore[arg-type]
    client.define(long_chain(n))
    relu, neg = torch.ops.aten.relu.default, torch.ops.aten.neg.default
    x = client.dispatch(relu, (torch.ones(4),), {}, OpInfo(relu), 0, 0)
    for _ in range(n - 1):
        x = client.dispatch(neg, (x,), {}, OpInfo(neg), 0, 0)  # the last x is dropped here
        assert x is not MISS
    releases = [f for f in session.sent if f.WhichOneof("msg") == "release"]
    assert len(releases) == 3 and all(len(released_ids(f.release)) == RELEASE_STREAM_AT
                                      for f in releases)
    assert session.sent[0].WhichOneof("msg") == "start"  # none before the inference began
    base = session.sent[0].start.base_id
    dropped = sorted(i for f in releases for i in released_ids(f.release))
    assert dropped == [base + i for i in range(3 * RELEASE_STREAM_AT)]
    # ... each saying how far the app had matched: past every value it released (each value
    # is dropped once the call after it read it), so the host copies nothing for an abort
    # before there (``Release.progress``)
    for f in releases:
        assert f.release.progress.base_id == base
        assert f.release.progress.position >= max(released_ids(f.release)) - base + 2


def test_an_inference_the_host_refused_to_replay_is_finished_here():
    """The host refused a start, or failed a replay without saying where (an error naming the
    sequence, no inference): the calls the app matched may have made nothing there, and
    forwarding on from them would name values the host never made (UNKNOWN_TENSOR in the
    app). The next call, or a read of a replayed output, hands the inference to the session
    to finish here from its journal; the sequence is not started again. The shim may have
    dropped the sequence first (the robot's drop crossed the start): the same."""
    relu, neg = torch.ops.aten.relu.default, torch.ops.aten.neg.default

    def begin(session: Session, calls: int) -> tuple[ReplayClient, Any]:
        client = ReplayClient(session)  # type: ignore[arg-type]
        client.define(long_chain(4))
        x = client.dispatch(relu, (torch.ones(4),), {}, OpInfo(relu), 0, 0)
        for _ in range(calls - 1):
            x = client.dispatch(neg, (x,), {}, OpInfo(neg), 0, 0)
            assert x is not MISS
        return client, x

    for dropped_first in (False, True):
        for calls in (2, 4):  # in the middle: the next call; all matched: the output's read
            session = Session()
            finished: list[str] = []
            session.finish_here = lambda why, f=finished: f.append(why) or True  # type: ignore[attr-defined]
            client, x = begin(session, calls)
            base = session.sent[0].start.base_id
            if dropped_first:
                client.define(ops_pb2.SequenceDef(id=9))
            client.failed(9)
            assert finished == [] and not client.sequences
            if calls == 2:
                assert client.dispatch(neg, (x,), {}, OpInfo(neg), 0, 0) is MISS
            else:
                assert client.take(base + 3) is None
            assert finished == ["replay"]
    # A session that cannot finish it here (nothing to rebuild from, ``fallback: error``)
    # forwards from there, as before.
    session = Session()
    session.finish_here = lambda why: False  # type: ignore[attr-defined]
    client, x = begin(session, 2)
    client.failed(9)
    assert client.dispatch(neg, (x,), {}, OpInfo(neg), 0, 0) is MISS and client.active is None


def test_an_input_is_named_not_sent_only_when_every_byte_is_the_same():
    """``ReplayArg.same_as`` for an input whose bytes did not change since the last inference
    (compared exactly, the last byte included), an upload for one that did."""
    session = Session()
    client = ReplayClient(session)  # type: ignore[arg-type]
    client.define(definition(1))
    relu = torch.ops.aten.relu.default

    def arg_frame(x: torch.Tensor) -> str:
        session.sent.clear()
        assert client.dispatch(relu, (x,), {}, OpInfo(relu), 0, 0) is not MISS
        (arg,) = [f for f in session.sent if getattr(f, "kind", None) == "arg"
                  or (isinstance(f, ops_pb2.SessionUp) and f.WhichOneof("msg") == "arg")]
        return "same" if isinstance(arg, ops_pb2.SessionUp) else "upload"

    first = torch.arange(4.0)
    last_changed = first.clone()
    last_changed[-1] = 7.0
    assert [arg_frame(x) for x in (first, first.clone(), last_changed, last_changed.clone(),
                                   first)] == ["upload", "same", "upload", "same", "upload"]


def test_only_other_bytes_of_a_fixed_input_make_a_sequence_stale():
    """A sequence's first step reads a fixed input (a constant the app makes anew each
    inference, recorded with its bytes). The same operator met elsewhere (on a tensor of the
    session, or another shape) is just not this sequence's start; only the app's own tensor
    of the recorded kind with other bytes says the sequence was recorded on a dummy input
    (``stale``: given up at its next mismatch). Mask R-CNN's ``clone`` calls after a
    mismatch once marked its sequences stale, dropping them every few frames."""
    session = Session()
    session.diverged = set()
    client = ReplayClient(session)  # type: ignore[arg-type]
    fixed = torch.arange(4.0)
    d = definition(1)
    upload = d.calls[0].args[0].tensor.upload
    upload.data = fixed.numpy().tobytes()
    upload.meta.ClearField("stride")  # (C-contiguous, as the shim sends it)
    d.sources[0].fixed = True
    client.define(d)
    relu = torch.ops.aten.relu.default
    (seq,) = client.sequences[0]
    proxy = new_proxy(Handle(session, 5), (4,), (1,), 0, torch.float32, "cpu")  # type: ignore[arg-type]
    for other in (proxy, torch.arange(5.0), torch.arange(4, dtype=torch.float64)):
        assert client.dispatch(relu, (other,), {}, OpInfo(relu), 0, 0) is MISS
        assert not seq.stale
    assert client.dispatch(relu, (fixed.clone(),), {}, OpInfo(relu), 0, 0) is not MISS
    client._tls.active = None  # (that one replays; the next inference begins)
    assert client.dispatch(relu, (fixed + 1,), {}, OpInfo(relu), 0, 0) is MISS
    assert seq.stale


def test_a_tensor_of_the_session_of_other_sizes_is_no_input_of_the_sequence():
    """An input slot may be given a tensor the host already holds (named, not uploaded), but
    only one of the recorded dtype and sizes: the steps after it were planned for those, and
    the app would get proxies of the recorded sizes for values the host made of others
    (``paste_masks --branch``: a ``mul`` of the masks matched a sequence's first call, the
    ``mul`` of its input row, and the app's masks came back as that row's size)."""
    session = Session()
    client = ReplayClient(session)  # type: ignore[arg-type]
    client.define(definition(1))
    relu = torch.ops.aten.relu.default
    for shape, dtype in (((5,), torch.float32), ((4,), torch.float64), ((2, 2), torch.float32)):
        other = new_proxy(Handle(session, 5), shape, (1,) * len(shape), 0, dtype, "cpu")  # type: ignore[arg-type]
        assert client.dispatch(relu, (other,), {}, OpInfo(relu), 0, 0) is MISS
        assert not session.sent
    same = new_proxy(Handle(session, 6), (4,), (1,), 0, torch.float32, "cpu")  # type: ignore[arg-type]
    assert client.dispatch(relu, (same,), {}, OpInfo(relu), 0, 0) is not MISS
    args = [f.arg for f in session.sent if isinstance(f, ops_pb2.SessionUp)
            and f.WhichOneof("msg") == "arg"]
    assert [a.tensor.id for a in args] == [6]  # named, not uploaded


def test_a_sequence_given_up_is_told_at_the_next_inference_start_never_into_a_lost_host():
    """A sequence the host failed is told to the robot (a definition without calls) when the
    thread begins its next inference: with no sequence left it makes no replayed call to say
    it then. With the host lost by then, nothing is sent and the app's forward goes on."""
    from rrto_plugins.torch.errors import HostLost

    class Losing(Session):
        def send_frames(self, frames: list[Any]) -> None:
            if self.lost is not None:
                raise HostLost(self.lost)
            super().send_frames(frames)

    session = Losing()
    client = ReplayClient(session)  # type: ignore[arg-type]
    client.define(definition(5))
    client.failed(5)
    assert not client.sequences.get(0) and session.sent == []
    client.inference_started()
    (drop,) = session.sent
    assert drop.define.id == 5 and not drop.define.calls
    client.define(definition(6))
    client.failed(6)
    session.lost = "gone"
    client.inference_started()  # does not raise
    assert len(session.sent) == 1


def test_after_an_inference_left_its_replay_the_next_start_waits_for_the_robots_answer():
    """The app's call differs from its replay, and the rest is forwarded: a hint that comes
    now is not waited for within that inference (a sequence found would not join it: its
    first calls were replayed, not forwarded). Its mark goes flagged, the client told first
    (``await_answer``): the next inference start waits for the robot's answer, and a search
    the robot runs for the way it went replays that inference whole with what it found. An
    answer that the robot runs nothing ends the wait at once."""
    session = Session()
    client = ReplayClient(session)  # type: ignore[arg-type]
    client.define(chain())
    relu, exp, sigmoid = (torch.ops.aten.relu.default, torch.ops.aten.exp.default,
                          torch.ops.aten.sigmoid.default)
    client.inference_started()
    x = client.dispatch(relu, (torch.ones(4),), {}, OpInfo(relu), 0, 0)
    assert x is not MISS and not client.left_inference()
    assert client.dispatch(exp, (x,), {}, OpInfo(exp), 0, 0) is MISS  # chain() has neg
    assert client.left_inference() and session.sent[-1].abort.position == 1
    client.search_hint(ops_pb2.SearchHint(running=True, wait_us=5_000_000))
    assert client.dispatch(sigmoid, (torch.ones(4),), {}, OpInfo(sigmoid), 0, 0) is MISS
    assert client.counters["search_waits"] == 0  # forwarded at once
    client.search_hint(ops_pb2.SearchHint(running=False))

    client.await_answer()  # its mark goes
    client.inference_started()
    assert not client.left_inference()
    variant = chain()
    variant.id = 6
    threading.Timer(0.02, client.search_hint, (ops_pb2.SearchHint(
        running=True, wait_us=5_000_000),)).start()  # the answer: a search runs
    threading.Timer(0.2, lambda: (client.define(variant), client.search_hint(
        ops_pb2.SearchHint(running=False)))).start()  # found, and defined by the host
    t0 = time.monotonic()
    assert client.dispatch(relu, (torch.ones(4),), {}, OpInfo(relu), 0, 0) is not MISS
    assert 0.15 <= time.monotonic() - t0 < 5
    starts = [f.start for f in session.sent if f.WhichOneof("msg") == "start"]
    assert starts[-1].sequence == 6 and client.counters["search_waits"] == 1

    client._tls.active = None  # (that inference ends)
    client.await_answer()
    client.inference_started()
    client.search_hint(ops_pb2.SearchHint(running=False))  # the answer: nothing runs
    assert client.dispatch(relu, (torch.ones(4),), {}, OpInfo(relu), 0, 0) is not MISS
    assert client.counters["search_waits"] == 1


def test_no_replay_starts_while_another_threads_is_under_way():
    """The host runs one replay at a time per session and a ``ReplayArg`` names no replay, so
    a thread starts one only while no other thread's is under way: until then its calls are
    forwarded (MISS, nothing sent). Once the other replay is over (here: it mismatched), or
    its thread is gone, the next start replays."""
    session = Session()
    client = ReplayClient(session)  # type: ignore[arg-type]
    relu, info = torch.ops.aten.relu.default, OpInfo(torch.ops.aten.relu.default)
    client.define(chain())  # lane 0's
    other = chain()
    other.id, other.thread = 6, 1
    client.define(other)  # lane 1's

    def on_a_thread(job: Any) -> Any:
        out: list[Any] = []
        t = threading.Thread(target=lambda: out.append(job()))
        t.start()
        t.join()
        return out[0]

    # a thread whose replay stays under way: it made the first call, then waits
    started, finish, first = threading.Event(), threading.Event(), []

    def stays() -> None:
        first.append(client.dispatch(relu, (torch.ones(4),), {}, info, 0, 0))
        started.set()
        finish.wait(5)
    t = threading.Thread(target=stays)
    t.start()
    assert started.wait(5) and first[0] is not MISS
    sent = len(session.sent)
    assert client.dispatch(relu, (torch.ones(4),), {}, info, 1, 0) is MISS
    assert len(session.sent) == sent and client.active is None
    finish.set()
    t.join()  # (gone: its replay under way no longer holds the session)
    assert client.dispatch(relu, (torch.ones(4),), {}, info, 1, 0) is not MISS
    assert session.sent[-2].start.sequence == 6 and client.active is not None
    # and while this thread's replay is under way, another thread's start waits in turn
    assert on_a_thread(lambda: client.dispatch(relu, (torch.ones(4),), {}, info, 0, 0)) is MISS
    exp = torch.ops.aten.exp.default
    assert client.dispatch(exp, (torch.ones(4),), {}, OpInfo(exp), 1, 0) is MISS  # a mismatch
    assert client.active is None and session.sent[-1].abort.position == 1
    assert on_a_thread(lambda: client.dispatch(relu, (torch.ones(4),), {}, info, 0, 0)) \
        is not MISS


def weighted(seq_id: int, lane: int) -> ops_pb2.SequenceDef:
    """``mul(x, w) -> relu``: an upload and a weight bound by its hash, on ``lane``."""
    meta = ops_pb2.TensorMeta(dtype="float32", shape=[4], stride=[1])
    d = ops_pb2.SequenceDef(id=seq_id, thread=lane, local_ids=[2, 3], outputs=[3])
    mul = d.calls.add(op="aten::mul.Tensor", out_ids=[2], out_meta=[meta])
    mul.args.add().tensor.upload.meta.CopyFrom(meta)
    d.sources.add(kind=ops_pb2.SeqSource.INPUT)
    mul.args.add().tensor.persistent = b"w" * 16
    d.sources.add(kind=ops_pb2.SeqSource.PERSISTENT, hash=b"w" * 16)
    relu = d.calls.add(op="aten::relu.default", out_ids=[3], out_meta=[meta])
    relu.args.add().tensor.id = 2
    d.sources.add(kind=ops_pb2.SeqSource.PRODUCED, id=2)
    return d


def test_a_start_that_loses_the_race_for_the_replay_binds_nothing_it_did_not_send():
    """Two lanes with sequences that read the same weight. Thread B's first call comes when
    no replay is under way, and thread A's replay starts before B's does (the race between
    B's look and its claim, made here by hiding A's replay from the look): B's call is
    forwarded with nothing sent. Matching commits the weight's binding, so B claims the
    session's replay before it matches: its start, later, still binds the weight (before,
    B's bindings said bound, the host had never got it and stopped the replay at its first
    call: ``UNKNOWN_TENSOR`` in the app)."""
    channel = Channel()
    session = RemoteSession(channel)
    session.hot = None
    weight = new_proxy(Handle(session, 1 << 40, b"w" * 16, torch.ones(4)), (4,), (1,), 0,
                       torch.float32, torch.device("cpu"))
    weight._rrto_handle.bound = False
    client = session.replay
    client.define(weighted(5, 0))
    client.define(weighted(6, 1))
    mul = torch.ops.aten.mul.Tensor
    started, finish = threading.Event(), threading.Event()

    def lane_a() -> None:  # its replay stays under way: it made the first call, then waits
        assert client.dispatch(mul, (torch.ones(4), weight), {}, OpInfo(mul), 0, 0) \
            is not MISS
        started.set()
        finish.wait(5)
    a = threading.Thread(target=lane_a)
    a.start()
    assert started.wait(5)
    sent = len(channel.frames)
    client._replaying_elsewhere = lambda: False  # type: ignore[method-assign]
    assert client.dispatch(mul, (torch.ones(4), weight), {}, OpInfo(mul), 1, 0) is MISS
    assert len(channel.frames) == sent and client.active is None
    del client._replaying_elsewhere
    finish.set()
    a.join()  # gone: the session's replay is free
    assert client.dispatch(mul, (torch.ones(4), weight), {}, OpInfo(mul), 1, 0) is not MISS
    frames = [f for f in channel.frames[sent:] if not isinstance(f, bytes | memoryview)]
    ups = [f for f in frames if isinstance(f, ops_pb2.SessionUp)]
    assert [u.start.sequence for u in ups if u.HasField("start")] == [6]
    assert [u.arg.slot for u in ups if u.HasField("arg") and u.arg.tensor.id == 1 << 40] \
        == [1]
