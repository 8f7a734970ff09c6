"""The robot's app relay through its steps (open, up, down, close) with a real socket pair on the
app side and a scripted host stream: who ends first decides how the session ends. No daemons."""

from __future__ import annotations

import asyncio
import socket
import types

import grpc
import pytest

from rrto.v1 import local_pb2, ops_pb2
from rrtod.framing import FrameReader, encode, read_frame
from rrtod.robot.relay import AppRelay, AppSession, Phase


class HostCall:
    """The host's Session stream: answers ``ready``, then what the test puts in ``down``
    (``EOF`` ends the stream, an exception breaks it)."""

    def __init__(self) -> None:
        self.written: list[ops_pb2.SessionUp] = []
        self.down: asyncio.Queue[object] = asyncio.Queue()
        self.down.put_nowait(ops_pb2.SessionDown(ready=ops_pb2.SessionReady(session="h1",
                                                                            device="cpu")))
        self.cancelled = False

    async def write(self, message: ops_pb2.SessionUp) -> None:
        self.written.append(message)

    async def read(self) -> object:
        item = await self.down.get()
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


def fetch(seq: int) -> local_pb2.LocalRequest:
    return local_pb2.LocalRequest(session=ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=seq, id=seq)))


async def connect() -> tuple[AppRelay, HostCall, socket.socket]:
    """A relay whose app side is one end of a unix socket pair; the test holds the other."""
    app, daemon = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=daemon)
    host = types.SimpleNamespace(name="h1", address="unix:h1")
    session = AppSession("s1", local_pb2.AppHello(app="app.py"), (1, 1000, 1000), host)
    call = HostCall()
    relay = AppRelay(session, call, FrameReader(reader, local_pb2.LocalRequest), writer)
    app.setblocking(False)
    return relay, call, app


async def replies(app: socket.socket, n: int) -> list[local_pb2.LocalReply]:
    reader, _ = await asyncio.open_unix_connection(sock=app)
    return [await asyncio.wait_for(read_frame(reader, local_pb2.LocalReply), 10)
            for _ in range(n)]


def test_the_app_closing_ends_the_relay_and_its_host_stream() -> None:
    async def main() -> None:
        relay, call, app = await connect()
        app.sendall(encode(fetch(1)) + encode(fetch(2)))
        app.shutdown(socket.SHUT_WR)
        await asyncio.wait_for(relay.serve(ops_pb2.SessionOpen(app="app.py")), 10)
        assert relay.phase is Phase.CLOSED and call.cancelled
        assert call.written[0].WhichOneof("msg") == "open"
        assert [f.fetch.seq for f in call.written[1].batch.frames] == [1, 2]
        (welcome,) = await replies(app, 1)
        assert welcome.welcome.session == "s1" and welcome.welcome.device == "cpu"
        assert relay.session.state == "active" and relay.session.frames_up == 2

    asyncio.run(main())


def test_the_host_ending_first_interrupts_the_relay_as_host_lost() -> None:
    async def main() -> None:
        relay, call, app = await connect()
        call.down.put_nowait(ops_pb2.SessionDown(fetched=ops_pb2.Fetched(seq=1, id=1)))
        call.down.put_nowait(grpc.aio.EOF)  # the app never closes: the host's end must stop it
        await asyncio.wait_for(relay.serve(ops_pb2.SessionOpen(app="app.py")), 10)
        welcome, fetched, lost = await replies(app, 3)
        assert welcome.WhichOneof("msg") == "welcome" and fetched.session.fetched.seq == 1
        assert lost.error.code == "HOST_LOST" and "host closed the session" in lost.error.message
        assert relay.session.state == "host-lost" and relay.phase is Phase.CLOSED
        assert relay.session.frames_down == 1

    asyncio.run(main())


def test_a_broken_host_stream_is_host_lost_with_its_status() -> None:
    async def main() -> None:
        relay, call, app = await connect()
        call.down.put_nowait(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None,
                                                  "connection reset"))
        await asyncio.wait_for(relay.serve(ops_pb2.SessionOpen(app="app.py")), 10)
        _, lost = await replies(app, 2)
        assert lost.error.code == "HOST_LOST" and "UNAVAILABLE connection reset" in lost.error.message

    asyncio.run(main())


def test_a_bad_app_frame_is_answered_after_the_good_ones_went_up() -> None:
    async def main() -> None:
        relay, call, app = await connect()
        bad = local_pb2.LocalRequest(ctl=local_pb2.CtlRequest(command="status"))
        app.sendall(encode(fetch(1)) + encode(bad))
        await asyncio.wait_for(relay.serve(ops_pb2.SessionOpen(app="app.py")), 10)
        _, error = await replies(app, 2)
        assert error.error.code and "unexpected ctl" in error.error.message
        assert [m.WhichOneof("msg") for m in call.written] == ["open", "fetch"]
        assert call.cancelled

    asyncio.run(main())


def test_a_part_frame_from_an_app_is_refused() -> None:
    """Parts (``MessagePart``) and their size are the robot daemon's own, towards its
    host: an app's would have the host join bytes the robot never cut, or cut its replies
    at a size the robot never measured."""
    async def main() -> None:
        for kind, frame in (("part", ops_pb2.SessionUp(
                part=ops_pb2.MessagePart(data=b"\x08", last=True))),
                            ("part_bytes", ops_pb2.SessionUp(part_bytes=1))):
            relay, call, app = await connect()
            app.sendall(encode(fetch(1)) + encode(local_pb2.LocalRequest(session=frame)))
            await asyncio.wait_for(relay.serve(ops_pb2.SessionOpen(app="app.py")), 10)
            _, error = await replies(app, 2)
            assert error.error.code and f"{kind} frame from an app" in error.error.message
            assert [m.WhichOneof("msg") for m in call.written] == ["open", "fetch"]

    asyncio.run(main())


def test_a_link_measured_again_restates_its_part_size() -> None:
    """The host cuts its replies at the size the robot stated at the open; a link measured
    again since (``HostLink.part_bytes`` changed) restates it before its next frames
    (``SessionUp.part_bytes``), once."""
    async def main() -> None:
        relay, call, app = await connect()
        relay.session.host.part_bytes = None  # type: ignore[attr-defined]
        await relay.open(ops_pb2.SessionOpen(app="app.py"))
        task = asyncio.get_running_loop().create_task(relay.run())
        relay.session.host.part_bytes = 100_000  # type: ignore[attr-defined]
        app.sendall(encode(fetch(1)))
        await asyncio.sleep(0.1)
        app.sendall(encode(fetch(2)))
        await asyncio.sleep(0.1)
        kinds = [m.WhichOneof("msg") for m in call.written]
        assert kinds == ["open", "part_bytes", "fetch", "fetch"], kinds
        assert call.written[1].part_bytes == 100_000
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        relay.close()

    asyncio.run(main())


def test_a_cancel_that_is_not_the_hosts_end_propagates() -> None:
    """The daemon stopping cancels the relay: that is not a lost host."""
    async def main() -> None:
        relay, call, app = await connect()
        await relay.open(ops_pb2.SessionOpen(app="app.py"))
        task = asyncio.get_running_loop().create_task(relay.run())
        await asyncio.sleep(0.05)
        assert relay.phase is Phase.RELAYING
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert relay.phase is Phase.UP_ENDED
        relay.close()
        assert relay.phase is Phase.CLOSED and call.cancelled

    asyncio.run(main())


def test_a_drop_goes_to_host_and_app_a_definition_to_the_host_only() -> None:
    async def main() -> None:
        relay, call, app = await connect()
        d = ops_pb2.SequenceDef(id=7, thread=1)
        d.calls.add(op="aten::relu.default")
        await relay.push_sequence(d)
        await relay.push_sequence(ops_pb2.SequenceDef(id=8))  # a drop: no calls
        assert [m.define.id for m in call.written] == [7, 8]
        (dropped,) = await replies(app, 1)
        assert dropped.session.sequence.id == 8 and not dropped.session.sequence.calls

    asyncio.run(main())


def test_a_link_gone_down_ends_a_waiting_relay_as_host_lost() -> None:
    """The host's stream stays silent (a stalled host): ``lose_host`` ends the relay at once,
    its stream cancelled, the app told why."""
    async def main() -> None:
        relay, call, app = await connect()
        task = asyncio.get_running_loop().create_task(
            relay.serve(ops_pb2.SessionOpen(app="app.py")))
        app.sendall(encode(fetch(1)))  # its answer never comes
        while len(call.written) < 2:  # open, then the fetch
            await asyncio.sleep(0.01)
        relay.lose_host("no answer to 2 pings in 2.0 s")
        relay.lose_host("again")  # once only
        await asyncio.wait_for(task, 10)
        welcome, lost = await replies(app, 2)
        assert welcome.WhichOneof("msg") == "welcome"
        assert lost.error.code == "HOST_LOST"
        assert lost.error.message == "GPU host h1 (unix:h1) lost: no answer to 2 pings in 2.0 s"
        assert relay.session.state == "host-lost" and relay.phase is Phase.CLOSED
        assert call.cancelled

    asyncio.run(main())


def test_a_link_gone_down_ends_a_relay_waiting_for_ready() -> None:
    async def main() -> None:
        relay, call, app = await connect()
        call.down.get_nowait()  # the host never answers the open
        task = asyncio.get_running_loop().create_task(
            relay.serve(ops_pb2.SessionOpen(app="app.py")))
        await asyncio.sleep(0.05)
        assert relay.phase is Phase.OPENING
        relay.lose_host("no answer to 2 pings in 2.0 s")
        await asyncio.wait_for(task, 10)
        (lost,) = await replies(app, 1)
        assert lost.error.code == "HOST_LOST" and "no answer to 2 pings" in lost.error.message
        assert call.cancelled

    asyncio.run(main())


def test_a_link_gone_down_after_the_app_closed_changes_nothing() -> None:
    async def main() -> None:
        relay, call, app = await connect()
        app.shutdown(socket.SHUT_WR)
        await asyncio.wait_for(relay.serve(ops_pb2.SessionOpen(app="app.py")), 10)
        relay.lose_host("no answer to 2 pings in 2.0 s")
        assert relay.lost is None and relay.session.state == "active"
        (welcome,) = await replies(app, 1)
        assert welcome.WhichOneof("msg") == "welcome"

    asyncio.run(main())


def test_the_daemon_stopping_while_a_link_goes_down_still_stops() -> None:
    """A cancel from the daemon's stop is not swallowed by a lost host's report."""
    async def main() -> None:
        relay, call, app = await connect()
        task = asyncio.get_running_loop().create_task(
            relay.serve(ops_pb2.SessionOpen(app="app.py")))
        await asyncio.sleep(0.05)
        assert relay.phase is Phase.RELAYING
        relay.lose_host("no answer to 2 pings in 2.0 s")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        assert relay.phase is Phase.CLOSED and call.cancelled

    asyncio.run(main())


def test_a_flush_while_the_session_ends_drops_its_sequences_without_raising() -> None:
    """``rrtoctl flush`` races a session's end: its host stream already finished (grpc's
    ``InvalidStateError``). The sequences are dropped all the same, and the flush answers."""
    async def main() -> None:
        relay, call, _app = await connect()

        async def finished(message: ops_pb2.SessionUp) -> None:
            raise asyncio.InvalidStateError("RPC already finished.")
        call.write = finished  # type: ignore[method-assign]
        held = {7: {}, 8: {}}
        relay.recorder = types.SimpleNamespace(  # type: ignore[assignment]
            sequences=held, drop=lambda i: (held.pop(i), ops_pb2.SequenceDef(id=i))[1])
        assert await relay.flush() == 2 and not held

    asyncio.run(main())


class _Placer:
    """The scheduler's side as the relay uses it (``SessionPlacer``): every throughput it
    observes switches sequence 3 to its plan 1."""

    def __init__(self, placed: bool) -> None:
        self.plan = ops_pb2.SequenceDef(id=3, calls=[ops_pb2.OpCall(op="aten::relu")], plan=1)
        self.plan.plans.add().robot_calls[:] = [0]
        self.defined = {3: self.plan} if placed else {}
        self.observed: list[float | None] = []
        self.band = None
        self.scheduling = types.SimpleNamespace(follows_link=True)  # ``switch_plans: true``

    def timed(self, started, latency_ns):
        return []

    def uploaded(self, timing):
        return timing.upload_bytes * 8e3 / timing.upload_ns

    def observe(self, mbit_s):
        self.observed.append(mbit_s)
        return [self.plan]

    def current(self, d):
        return d

    def describe(self):
        return {}


def _inference() -> bytes:
    """A replayed inference's start, then its mark (as the shim sends them)."""
    start = ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=3, base_id=1 << 40, plan=1))
    return (encode(local_pb2.LocalRequest(session=start))
            + encode(local_pb2.LocalRequest(mark=local_pb2.InferenceMark(
                index=1, start_ns=1, end_ns=2_000_001))))


def _with_placer(relay: AppRelay, placer: _Placer, probes: list[int]) -> None:
    async def time_upload(nbytes: int) -> float:
        probes.append(nbytes)
        return 0.01

    relay.placer = relay.session.placer = placer  # type: ignore[assignment]
    relay.session.host.time_upload = time_upload  # type: ignore[attr-defined]


def test_the_link_is_probed_for_plan_switching_only_when_a_sequence_is_placed() -> None:
    """An inference that tells nothing of the link is followed by a probe, and what it reads
    goes to the placer; a session with nothing placed (``remote-all``) probes nothing."""
    async def main() -> None:
        for placed in (False, True):
            relay, call, app = await connect()
            probes: list[int] = []
            placer = _Placer(placed)
            _with_placer(relay, placer, probes)
            await relay.open(ops_pb2.SessionOpen(app="app.py"))
            task = asyncio.get_running_loop().create_task(relay.run())
            app.sendall(_inference())
            await asyncio.sleep(0.2)
            if not placed:
                assert probes == [] and placer.observed == []
            else:
                assert probes == [64 << 10] and placer.observed == [pytest.approx(52.4288)]
                # a new plan for the host: the definition goes there first
                assert [m.define.plan for m in call.written if m.WhichOneof("msg") == "define"] \
                    == [1]
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            relay.close()

    asyncio.run(main())


def test_a_plan_the_host_holds_is_switched_to_by_a_local_message_and_a_timed_replay_reads_the_link() -> None:
    """The host's ``ReplayTiming`` of a replay is the link's throughput (no probe after that
    inference); switching to a plan the host already holds is a definition written to the
    shim alone, nothing to the host."""
    async def main() -> None:
        relay, call, app = await connect()
        probes: list[int] = []
        placer = _Placer(True)
        _with_placer(relay, placer, probes)
        relay._host_plans[3] = 1  # the host holds the plan
        await relay.open(ops_pb2.SessionOpen(app="app.py"))
        task = asyncio.get_running_loop().create_task(relay.run())
        call.down.put_nowait(ops_pb2.SessionDown(timing=ops_pb2.ReplayTiming(
            sequence=3, plan=1, upload_bytes=625_000, upload_ns=100_000_000)))
        await asyncio.sleep(0.1)
        app.sendall(_inference())
        welcome, switched = await replies(app, 2)
        assert welcome.WhichOneof("msg") == "welcome"
        assert switched.session.sequence == placer.plan
        await asyncio.sleep(0.1)
        assert placer.observed == [pytest.approx(50.0)] and probes == []
        assert not any(m.WhichOneof("msg") == "define" for m in call.written)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        relay.close()

    asyncio.run(main())


class _Recorder:
    """The recorder as the relay asks it at an inference mark: a search is due there, and
    ``wait`` is what a variant search asks the app to wait (None: no variant search)."""

    searching = True

    def __init__(self, wait: float | None) -> None:
        self.wait = wait
        self.searches = 0

    def app_waited(self, seconds: float) -> None:
        pass

    def hint_wait(self) -> float | None:
        return None  # a sequence is in use

    def inference_ended(self, thread: int = 0) -> bool:
        return True

    def variant_wait(self, thread: int, due: bool) -> float | None:
        return self.wait

    def request_search(self, push, ended) -> None:
        self.searches += 1

    def observe(self, frame) -> bool:
        return False

    def awaiting_host(self) -> bool:
        return True

    def close(self) -> None:
        pass


def test_the_mark_of_an_inference_that_left_its_replay_is_answered() -> None:
    """``InferenceMark.left_replay``: the app's next inference start waits to hear whether
    the robot searches for the way that inference went. A variant search due there is hinted
    with its bound; with no search the answer is that none runs, at once."""
    async def main() -> None:
        for wait in (1.5, None):
            relay, call, app = await connect()
            relay.recorder = _Recorder(wait)  # type: ignore[assignment]
            await relay.open(ops_pb2.SessionOpen(app="app.py"))
            task = asyncio.get_running_loop().create_task(relay.run())
            app.sendall(encode(local_pb2.LocalRequest(mark=local_pb2.InferenceMark(
                index=3, start_ns=1, end_ns=2, left_replay=True))))
            reader, _ = await asyncio.open_unix_connection(sock=app)
            while True:
                reply = await asyncio.wait_for(read_frame(reader, local_pb2.LocalReply), 10)
                if reply.WhichOneof("msg") == "session" \
                        and reply.session.WhichOneof("msg") == "search":
                    break
            hint = reply.session.search
            if wait is None:
                assert not hint.running
            else:
                assert hint.running and hint.wait_us == 1_500_000
            assert relay.recorder.searches == 1
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            relay.close()

    asyncio.run(main())


def test_an_inference_run_on_the_robot_whole_is_timed_here_and_never_reaches_the_host() -> None:
    """``ReplayStart.here``: the app ran the inference on its own tensors (a plan with every
    call on the robot). Its start times the plan with the inference's mark, as any replay's
    does, and the recorder logs it; the host, which has no call to run for it, gets nothing.
    An ordinary start is still relayed."""
    class Timing(_Placer):
        def __init__(self) -> None:
            super().__init__(True)
            self.latencies: list[tuple[list, int]] = []

        def timed(self, started, latency_ns):
            self.latencies.append((list(started), latency_ns))
            return []

    class Logging(_Recorder):
        def __init__(self) -> None:
            super().__init__(None)
            self.seen: list[str] = []

        def observe(self, frame) -> bool:
            self.seen.append(frame.WhichOneof("msg"))
            return False

    def inference(index: int, here: bool) -> bytes:
        start = ops_pb2.SessionUp(start=ops_pb2.ReplayStart(
            sequence=3, base_id=(1 << 40) * index, plan=1, here=here))
        return (encode(local_pb2.LocalRequest(session=start))
                + encode(local_pb2.LocalRequest(mark=local_pb2.InferenceMark(
                    index=index, start_ns=1, end_ns=1 + 1_000_000 * index))))

    async def main() -> None:
        relay, call, app = await connect()
        placer = Timing()
        placer.scheduling.follows_link = False  # (no probe of the link after a mark)
        _with_placer(relay, placer, [])
        relay.recorder = Logging()  # type: ignore[assignment]
        await relay.open(ops_pb2.SessionOpen(app="app.py"))
        task = asyncio.get_running_loop().create_task(relay.run())
        app.sendall(inference(1, here=True) + inference(2, here=False))
        for _ in range(100):
            if len(placer.latencies) == 2:
                break
            await asyncio.sleep(0.02)
        assert placer.latencies == [([(3, 1)], 1_000_000), ([(3, 1)], 2_000_000)]
        starts = [m.start for m in call.written if m.WhichOneof("msg") == "start"]
        assert [s.base_id for s in starts] == [2 << 40] and not starts[0].here
        assert relay.recorder.seen == ["start", "start"]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        relay.close()

    asyncio.run(main())
