"""Routing rules of per-inference placement (rrtod/robot/placement.py), frame by frame, with
stand-in host links and a balancer that picks what the test says. The same rules with real
daemons and an unmodified app: tests/test_placement_apps.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rrto.v1 import ops_pb2
from rrtod.hookspecs import Job
from rrtod.robot.placement import Lane, NeedPull, Placement, base_of
from rrtod.wire import BIND_OP, REPLAY_BASE, SPAN, release_of, released_ids

SRC = ops_pb2.SeqSource
SEQ = 7
BASE = REPLAY_BASE + 3 * SPAN


class Link:
    """What placement reads of a host link."""

    def __init__(self, name: str):
        self.name = name
        self.up = True
        self.inflight = 0
        self.sessions = 0
        self.rtt_ms = 1.0

    def open_session(self) -> Any:
        return Stream()


class Stream:
    def __init__(self) -> None:
        self.sent: list[ops_pb2.SessionUp] = []

    async def write(self, message: ops_pb2.SessionUp) -> None:
        self.sent.append(message)

    def cancel(self) -> None:
        pass


class Pick:
    """Places every job on the host named ``to``; records what it observed."""

    def __init__(self) -> None:
        self.to = "a"
        self.seen: list[tuple[str, str, float | None]] = []

    def choose(self, hosts: Any) -> Any:
        return hosts[0]

    def place(self, hosts: Any, job: Job) -> Any:
        return next(h for h in hosts if h.name == self.to)

    def observe(self, host: Any, job: Job, seconds: float | None) -> None:
        self.seen.append((host.name, job.key, seconds))


def definition() -> ops_pb2.SequenceDef:
    """x (input) -> conv(x, w) -> relu -> output: one input slot (0), one weight slot (1)."""
    conv = ops_pb2.OpCall(op="aten::conv2d", out_ids=[11], args=[
        ops_pb2.Value(tensor=ops_pb2.TensorRef(id=10)), ops_pb2.Value(tensor=ops_pb2.TensorRef(id=5))])
    relu = ops_pb2.OpCall(op="aten::relu", out_ids=[12], args=[
        ops_pb2.Value(tensor=ops_pb2.TensorRef(id=11))])
    return ops_pb2.SequenceDef(
        id=SEQ, calls=[conv, relu], local_ids=[10, 11, 12], outputs=[12],
        sources=[SRC(kind=SRC.INPUT), SRC(kind=SRC.PERSISTENT, id=5, hash=b"w" * 32),
                 SRC(kind=SRC.PRODUCED, id=11)])


def setup(pinned: str = "") -> tuple[Placement, Pick, Lane, Lane]:
    """A placement with primary ``p`` and a warm replica ``a`` holding the sequence."""
    p_link, a_link = Link("p"), Link("a")
    pick = Pick()
    primary = Lane(p_link, Stream(), primary=True)
    placement = Placement(primary, lambda: [p_link, a_link], lambda: pick,
                          ops_pb2.SessionOpen(app="app"))
    placement.enabled = False  # no background replicas: the test adds one by hand
    placement.accepted(definition(), ops_pb2.SequenceAck(id=SEQ, accepted=True, pinned=pinned))
    placement.enabled = True
    replica = Lane(a_link, Stream(), primary=False, warm=True)
    replica.defined.add(SEQ)
    placement.replicas["a"] = replica
    return placement, pick, primary, replica


def start(base: int = BASE) -> ops_pb2.SessionUp:
    return ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=SEQ, base_id=base))


def upload(slot: int = 0, data: bytes = b"\x00" * 4) -> ops_pb2.SessionUp:
    ref = ops_pb2.TensorRef(upload=ops_pb2.TensorData(
        meta=ops_pb2.TensorMeta(dtype="float32", shape=[1]), data=data))
    return ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=slot, tensor=ref))


def same_as(slot: int = 0) -> ops_pb2.SessionUp:
    return ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=slot, same_as=slot))


def push(tid: int) -> ops_pb2.SessionDown:
    return ops_pb2.SessionDown(fetched=ops_pb2.Fetched(id=tid, tensor=ops_pb2.TensorData()))


def kinds(routed: list[tuple[Lane, ops_pb2.SessionUp]], lane: Lane) -> list[str]:
    return [f.WhichOneof("msg") for x, f in routed if x is lane]


def test_a_placed_inference_goes_whole_to_the_picked_host_with_its_weights_bound_there():
    placement, pick, primary, replica = setup()
    routed = placement.route(start()) + placement.route(upload())
    assert kinds(routed, primary) == []
    # the start, then (first time there) the weight bound by content hash and named, the input
    assert kinds(routed, replica) == ["start", "call", "release", "arg", "arg"]
    bind = [f.call for x, f in routed if f.WhichOneof("msg") == "call"][0]
    assert bind.op == BIND_OP and bind.args[0].tensor.persistent == b"w" * 32
    assert bind.args[0].tensor.bind_id == 5
    assert replica.link.inflight == 1
    # its output comes back from there: delivered once, the job observed
    assert placement.from_host(replica, push(BASE + 2))
    assert not placement.from_host(replica, push(BASE + 2))  # a duplicate is not passed on
    assert replica.link.inflight == 0
    assert [(h, k) for h, k, _ in pick.seen] == [("a", f"app/{SEQ}")]
    # the second inference there pays no bind
    routed = placement.route(start(BASE + SPAN)) + placement.route(upload())
    assert kinds(routed, replica) == ["start", "arg"]


def test_a_repeated_input_goes_as_data_to_a_host_that_never_got_it():
    placement, pick, primary, replica = setup()
    pick.to = "p"
    placement.route(start())
    placement.route(upload(data=b"\x01" * 4))
    placement.from_host(primary, push(BASE + 2))
    pick.to = "a"  # the same input again, on a host that has not seen it
    routed = placement.route(start(BASE + SPAN)) + placement.route(same_as())
    args = [f.arg for x, f in routed if x is replica and f.WhichOneof("msg") == "arg"]
    assert args[-1].WhichOneof("value") == "tensor"
    assert args[-1].tensor.upload.data == b"\x01" * 4
    placement.from_host(replica, push(BASE + SPAN + 2))
    # and once it has it, the repeat stays a repeat there
    routed = placement.route(start(BASE + 2 * SPAN)) + placement.route(same_as())
    args = [f.arg for x, f in routed if x is replica and f.WhichOneof("msg") == "arg"]
    assert args[-1].WhichOneof("value") == "same_as"


def test_a_mismatch_moves_the_inference_to_the_primary_before_its_abort():
    placement, pick, primary, replica = setup()
    placement.route(start())
    placement.route(upload())
    routed = placement.route(ops_pb2.SessionUp(abort=ops_pb2.ReplayAbort(position=1)))
    assert kinds(routed, replica) == ["abort"]  # the replica drops its copy
    assert kinds(routed, primary) == ["start", "arg", "abort"]
    assert placement.counters["moved"] == 1
    # the forwarding that follows names the prefix's values: they are on the primary now
    call = ops_pb2.SessionUp(call=ops_pb2.OpCall(op="aten::add", out_ids=[99], args=[
        ops_pb2.Value(tensor=ops_pb2.TensorRef(id=BASE + 1))]))
    assert kinds(placement.route(call), primary) == ["call"]
    # late frames of the replica's copy are not the app's
    assert not placement.from_host(replica, push(BASE + 2))
    assert placement.from_host(primary, push(BASE + 2))


def test_an_input_already_on_the_host_pins_the_sequence_to_the_primary():
    placement, pick, primary, replica = setup()
    placement.route(start())
    by_ref = ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(slot=0, tensor=ops_pb2.TensorRef(id=42)))
    routed = placement.route(by_ref)
    assert kinds(routed, primary) == ["start", "arg"]
    assert placement.sequence_placement(SEQ)["pinned"].startswith("takes an input")
    routed = placement.route(start(BASE + SPAN))
    assert kinds(routed, primary) == ["start"] and kinds(routed, replica) == []


def test_a_pinned_sequence_never_leaves_its_primary():
    placement, pick, primary, replica = setup(pinned="call 0 writes a value that outlives it")
    routed = placement.route(start()) + placement.route(upload())
    assert kinds(routed, primary) == ["start", "arg"] and kinds(routed, replica) == []
    assert placement.sequence_placement(SEQ) == {
        "pinned": "call 0 writes a value that outlives it", "hosts": ["p"]}


def test_releases_and_downloads_go_where_the_values_are():
    placement, pick, primary, replica = setup()
    placement.route(start())
    placement.route(upload())
    release = ops_pb2.SessionUp(release=release_of([BASE, BASE + 1, 3]))
    release.release.progress.base_id, release.release.progress.position = BASE, 5
    routed = placement.route(release)
    assert [released_ids(f.release) for x, f in routed if x is replica] == [[BASE, BASE + 1]]
    assert [released_ids(f.release) for x, f in routed if x is primary] == [[3]]
    # how far the app matched the replay goes to both (each host checks whose replay it is)
    assert [(f.release.progress.base_id, f.release.progress.position)
            for _x, f in routed] == [(BASE, 5)] * 2
    fetch = ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=4, id=BASE + 2))
    assert kinds(placement.route(fetch), replica) == ["fetch"]


def test_a_forwarded_call_on_a_placed_output_asks_for_it_first():
    placement, pick, primary, replica = setup()
    placement.route(start())
    placement.route(upload())
    placement.from_host(replica, push(BASE + 2))
    call = ops_pb2.SessionUp(call=ops_pb2.OpCall(op="aten::add", out_ids=[99], args=[
        ops_pb2.Value(tensor=ops_pb2.TensorRef(id=BASE + 2))]))
    with pytest.raises(NeedPull) as need:
        placement.route(call)
    assert need.value.ids == [BASE + 2]
    data = ops_pb2.TensorData(meta=ops_pb2.TensorMeta(dtype="float32", shape=[1]), data=b"1234")
    rewritten = placement.rewrite(call, {BASE + 2: data})
    ref = rewritten.call.args[0].tensor
    assert ref.upload.data == b"1234" and ref.bind_id == BASE + 2
    assert kinds(placement.route(rewritten), primary) == ["call"]
    # bound on the primary now: the next frame naming it needs no copy
    assert kinds(placement.route(call), primary) == ["call"]


def test_a_lost_replica_hands_its_inference_in_flight_to_the_primary():
    async def main() -> None:
        placement, pick, primary, replica = setup()
        sent: list[list[tuple[Lane, ops_pb2.SessionUp]]] = []

        async def resend(routed: list[tuple[Lane, ops_pb2.SessionUp]]) -> None:
            sent.append(routed)

        placement.resend = resend
        placement.route(start())
        placement.route(upload())
        replica.link.up = False
        placement.lose(replica.link, "no answer to 2 pings")
        await asyncio.sleep(0)
        assert not replica.alive and placement.counters["failovers"] == 1
        assert [f.WhichOneof("msg") for f in placement.take(primary)] == ["start", "arg"]
        assert sent  # the relay was woken to send them
        # what comes next for that inference goes to the primary as well
        assert kinds(placement.route(upload()), primary) == ["arg"]
        assert placement.from_host(primary, push(BASE + 2))
        assert primary.link.inflight == 0 and replica.link.inflight == 0
        # and the next inference is not placed on the lost host
        assert kinds(placement.route(start(BASE + SPAN)), primary) == ["start"]

    asyncio.run(main())


def test_ids_of_replayed_inferences_map_to_their_base():
    assert base_of(BASE + 17) == BASE
    assert base_of(5) is None


def test_an_inference_late_on_its_replica_is_run_by_the_primary_too():
    async def main() -> None:
        placement, pick, primary, replica = setup()
        placement.resend = _no_resend
        placement.seqs[SEQ].times.extend([0.001] * 8)  # typical: 1 ms; late after 50 ms
        placement.route(start())
        placement.route(upload())
        await asyncio.sleep(0.2)
        assert placement.counters["late"] == 1 and replica.late
        assert [f.WhichOneof("msg") for f in placement.take(primary)] == ["start", "arg"]
        assert [f.WhichOneof("msg") for f in placement.take(replica)] == ["abort"]
        # a late replica gets no new inference until it answers one
        assert kinds(placement.route(start(BASE + SPAN)), primary) == ["start"]
        assert not placement.from_host(replica, push(BASE + 2))  # the late answer is dropped
        assert not replica.late

    asyncio.run(main())


async def _no_resend(routed: Any) -> None:
    pass
