"""The daemon as a real process: control commands, sessions through the relay, host liveness,
signals, notify protocol, bad input. Uses the testkit's ``echo`` backend (no torch)."""

from __future__ import annotations

import os
import signal
import stat
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from rrto.v1 import local_pb2, ops_pb2
from rrtod.framing import FramedSocket
from rrtod.wire import HEADER, REPLAY_BASE
from testkit.daemons import BIN, ECHO, ECHO_PLUGIN, free_port
from testkit.peer import call, open_app


def test_status_and_plugins(rrtod_daemon):
    d = rrtod_daemon(**ECHO)
    status = d.wait_for(lambda s: s["hosts"] and s["hosts"][0]["state"] == "up", what="host up")
    assert status["roles"] == ["robot", "gpu"]
    assert status["config"]["path"] == str(d.config_path)
    assert status["uptime_s"] >= 0 and status["version"]
    host = status["hosts"][0]
    assert host["name"] == "local" and host["address"] == f"unix:{Path(d.socket).parent}/peer.sock"
    assert host["rtt_ms"] is not None and host["rtt_ms"] > 0
    assert status["gpu"]["device"] == "cpu"
    plugins = d.ctl("plugins")
    assert set(plugins["families"]) == {"interception", "search", "transport", "scheduler",
                                        "balancer", "power"}
    names = {p["name"]: p for fam in plugins["families"].values() for p in fam}
    assert names["grpc"]["distribution"] == "rrtod"
    assert names["echo"]["distribution"] == "rrto-testkit"
    assert d.ctl("sequences") == {"sequences": []}


def test_session_relay_in_order_and_freed(rrtod_daemon):
    d = rrtod_daemon(**ECHO)
    d.wait_for(lambda s: s["hosts"][0]["state"] == "up", what="host up")
    conn, welcome = open_app(d.socket)
    assert welcome.WhichOneof("msg") == "welcome", welcome
    assert welcome.welcome.host == "local" and welcome.welcome.device == "echo"
    for seq in range(1, 51):
        conn.send(call(seq, sync=seq % 10 == 0))
    conn.send(call(51, op="test::boom"))
    conn.send(local_pb2.LocalRequest(session=ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=52, id=7))))
    replies = [conn.recv(local_pb2.LocalReply).session for _ in range(7)]
    kinds = [r.WhichOneof("msg") for r in replies]
    assert kinds == ["result"] * 5 + ["error", "fetched"]
    assert [r.result.seq for r in replies[:5]] == [10, 20, 30, 40, 50]
    assert replies[5].error.code == "OP_FAILED" and replies[5].error.seq == 51
    assert int.from_bytes(replies[6].fetched.tensor.data, "little") == 7
    status = d.ctl("status")
    (session,) = status["sessions"]
    assert session["app"] == "test-app" and session["pid"] == os.getpid()  # SO_PEERCRED
    assert session["ops_forwarded"] == 51
    (hs,) = status["gpu"]["sessions"]
    assert hs["ops"] == 51
    conn.close()
    status = d.wait_for(lambda s: not s["sessions"] and not s["gpu"]["sessions"],
                        what="sessions freed")
    assert status["finished"]["sessions"] == 1 and status["finished"]["ops_forwarded"] == 51


def test_bad_frames_get_errors_and_daemon_keeps_serving(rrtod_daemon):
    d = rrtod_daemon(**ECHO)
    # A length prefix beyond the limit.
    raw = FramedSocket(d.socket, timeout=5)
    raw.sock.sendall(HEADER.pack(0xFFFFFFF0))
    reply = raw.recv(local_pb2.LocalReply)
    assert reply.error.code == "BAD_FRAME" and "limit" in reply.error.message
    raw.close()
    # Garbage that is not a protobuf message.
    raw = FramedSocket(d.socket, timeout=5)
    raw.sock.sendall(HEADER.pack(5) + b"\xff\xff\xff\xff\xff")
    assert raw.recv(local_pb2.LocalReply).error.code == "BAD_FRAME"
    raw.close()
    # A session frame before the hello.
    raw = FramedSocket(d.socket, timeout=5)
    raw.send(call(1))
    assert raw.recv(local_pb2.LocalReply).error.code == "BAD_FRAME"
    raw.close()
    # A connection dropped mid-frame.
    raw = FramedSocket(d.socket, timeout=5)
    raw.sock.sendall(HEADER.pack(100) + b"abc")
    raw.close()
    assert d.ctl("status")["roles"] == ["robot", "gpu"]
    conn, welcome = open_app(d.socket)
    assert welcome.WhichOneof("msg") == "welcome"
    conn.close()


def test_socket_permissions(rrtod_daemon):
    d = rrtod_daemon(socket_mode="0660", **ECHO)
    mode = os.stat(d.socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660


def test_second_daemon_on_same_socket_refuses(rrtod_daemon):
    d = rrtod_daemon(**ECHO)
    cfg = dict(d.config, listen=f"127.0.0.1:{free_port()}")
    path = Path(d.config_path).with_name("second.yaml")
    path.write_text(yaml.safe_dump(cfg))
    out = run_rrtod("--config", str(path))
    assert out.returncode != 0 and "already serving" in out.stderr
    assert d.ctl("status")  # the first one is untouched


def run_rrtod(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ECHO_PLUGIN)}
    return subprocess.run([str(BIN / "rrtod"), *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_bad_config_names_file_key_and_reason(tmp_path):
    echo = "intercept: {backend: echo}\n"
    bad = tmp_path / "rrtod.yaml"
    bad.write_text(echo + "roles: [robot]\nhosts:\n  - {name: edge1, address: edge1.local}\n")
    out = run_rrtod("--config", str(bad))
    assert out.returncode == 78
    assert str(bad) in out.stderr and "hosts[0].address" in out.stderr
    assert "HOST:PORT" in out.stderr and "Traceback" not in out.stderr
    bad.write_text(echo + "roles: [robot]\nbalancer: nope\n")
    out = run_rrtod("--config", str(bad), "--check-config")
    assert out.returncode == 78 and "balancer" in out.stderr and "'nope'" in out.stderr
    assert "least-loaded" in out.stderr  # the error lists what is installed
    good = tmp_path / "good.yaml"
    good.write_text(echo + "roles: [robot]\nhosts: [{name: a, address: 'a:1'}]\n"
                    "tls: {mode: insecure}\n")
    out = run_rrtod("--config", str(good), "--check-config")
    assert out.returncode == 0 and "configuration ok" in out.stdout


def test_rrtoctl_unreachable_is_one_line_exit_2(tmp_path):
    sock = str(tmp_path / "none.sock")
    out = subprocess.run([str(BIN / "rrtoctl"), "--socket", sock, "status"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and sock in out.stderr
    assert "Traceback" not in out.stderr


def test_peer_down_and_back_without_robot_restart(rrtod_daemon):
    port = free_port()
    gpu = rrtod_daemon("gpu1", roles=["gpu"], listen=f"127.0.0.1:{port}", **ECHO)
    robot = rrtod_daemon("robot1", roles=["robot"], hosts=[{"name": "edge",
                                                            "address": f"127.0.0.1:{port}"}],
                         **ECHO)
    robot.wait_for(lambda s: s["hosts"][0]["state"] == "up", what="host up")
    robot_pid = robot.proc.pid
    gpu.stop(signal.SIGKILL)
    t0 = time.monotonic()
    status = robot.wait_for(lambda s: s["hosts"][0]["state"] == "down", timeout=10,
                            what="host down")
    assert time.monotonic() - t0 < 10
    assert status["hosts"][0]["last_error"]
    conn, reply = open_app(robot.socket)
    assert reply.error.code == "NO_HOST"  # a clear refusal, never a hang
    conn.close()
    gpu2 = rrtod_daemon("gpu1", roles=["gpu"], listen=f"127.0.0.1:{port}", **ECHO)
    robot.wait_for(lambda s: s["hosts"][0]["state"] == "up", timeout=15, what="host back up")
    assert robot.proc.pid == robot_pid and robot.proc.poll() is None
    gpu2.stop()


def test_host_lost_mid_session_reports_error(rrtod_daemon):
    port = free_port()
    gpu = rrtod_daemon("gpu1", roles=["gpu"], listen=f"127.0.0.1:{port}", **ECHO)
    robot = rrtod_daemon("robot1", roles=["robot"],
                         hosts=[{"name": "edge", "address": f"127.0.0.1:{port}"}], **ECHO)
    robot.wait_for(lambda s: s["hosts"][0]["state"] == "up", what="host up")
    conn, welcome = open_app(robot.socket)
    assert welcome.WhichOneof("msg") == "welcome"
    conn.send(call(1, sync=True))
    assert conn.recv(local_pb2.LocalReply).session.result.seq == 1
    gpu.stop(signal.SIGKILL)
    reply = conn.recv(local_pb2.LocalReply)
    assert reply.error.code == "HOST_LOST" and "edge" in reply.error.message
    conn.close()
    robot.wait_for(lambda s: not s["sessions"], what="session cleaned up")
    assert robot.proc.poll() is None


def test_reload_applies_valid_and_keeps_old_on_invalid(rrtod_daemon):
    d = rrtod_daemon(**ECHO)
    good = dict(d.config, hosts=[{"name": "other", "address": d.listen}])
    d.config_path.write_text(yaml.safe_dump(good))
    d.proc.send_signal(signal.SIGHUP)
    msg = d.wait_notify("RELOADING=1")
    assert "MONOTONIC_USEC=" in msg
    d.wait_notify("READY=1")
    status = d.ctl("status")
    assert [h["name"] for h in status["hosts"]] == ["other"]
    assert status["config"]["reloads"] == 1
    d.config_path.write_text(yaml.safe_dump(dict(good, roles=["robot"], health={"interval": -3})))
    d.proc.send_signal(signal.SIGHUP)
    d.wait_notify("RELOADING=1")
    d.wait_notify("READY=1")
    status = d.ctl("status")
    assert status["config"]["reloads"] == 1 and status["roles"] == ["robot", "gpu"]
    assert "reload failed" in d.logs() and "health.interval" in d.logs()


def test_sigterm_drains_and_exits_zero(rrtod_daemon):
    d = rrtod_daemon(**ECHO)
    conn, _ = open_app(d.socket)
    d.proc.send_signal(signal.SIGTERM)
    d.wait_notify("STOPPING=1")
    conn.close()  # the session ends inside the drain window
    assert d.proc.wait(20) == 0
    assert not Path(d.socket).exists()


def test_watchdog_pings(rrtod_daemon):
    d = rrtod_daemon(extra_env={"WATCHDOG_USEC": "400000"}, **ECHO)
    d.wait_notify("WATCHDOG=1", timeout=5)
    d.wait_notify("WATCHDOG=1", timeout=5)


def test_metrics_endpoint(rrtod_daemon):
    port = free_port()
    d = rrtod_daemon(metrics={"listen": f"127.0.0.1:{port}"}, **ECHO)
    d.wait_for(lambda s: s["hosts"][0]["state"] == "up", what="host up")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'rrto_host_up{host="local"} 1.0' in body
    assert "rrto_host_rtt_seconds" in body


def test_cli_entry_points_run_as_modules():
    out = subprocess.run([sys.executable, "-m", "rrtod", "--version"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("rrtod ")


def test_status_reports_model_meter_and_energy_per_inference(rrtod_daemon):
    d = rrtod_daemon(power={"meter": "auto", "sample_hz": 50}, **ECHO)
    conn, welcome = open_app(d.socket)
    assert welcome.WhichOneof("msg") == "welcome"
    sid = welcome.welcome.session
    for index in range(3):
        start = time.monotonic_ns()
        for seq in range(1, 20):
            conn.send(call(index * 100 + seq))
        conn.send(call(index * 100 + 99, sync=True))
        reply = conn.recv(local_pb2.LocalReply)
        while reply.session.WhichOneof("msg") == "search":  # advisory: a search runs at a
            reply = conn.recv(local_pb2.LocalReply)         # mark after no download
        assert reply.session.result.seq == index * 100 + 99
        time.sleep(0.05)
        conn.send(local_pb2.LocalRequest(mark=local_pb2.InferenceMark(
            index=index, start_ns=start, end_ns=time.monotonic_ns())))
    status = d.wait_for(
        lambda s: s["power"]["sessions"].get(sid, {}).get("inferences") == 3, what="3 inferences")
    power = status["power"]
    assert power["meter"] == "model"  # no sensor on this machine: the model, not an error
    per = power["sessions"][sid]["energy_per_inference_j"]
    # Each inference lasted >= 50 ms at no less than the model's lowest power (4.04 W).
    assert per >= 0.05 * 4.04 * 0.9
    conn.close()


class EchoApp:
    """A scripted app session: each inference uploads an image, applies two ops to it (the
    first with a weight bound by hash on first use) and downloads the result."""

    W, HASH = 900, b"w" * 16

    def __init__(self, sock: str, app: str = "record-app"):
        self.conn, welcome = open_app(sock, app)
        assert welcome.WhichOneof("msg") == "welcome", welcome
        self.next_id, self.seq, self.bound = 1000, 0, False
        # (SearchHint.running, .wait_us), in the order received
        self.hints: list[tuple[bool, int]] = []
        self.inferences = 0

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _send(self, **frame: object) -> None:
        self.conn.send(local_pb2.LocalRequest(session=ops_pb2.SessionUp(**frame)))

    INFERENCE_NS = 7_000_000_000  # how long each inference took, as its mark says

    def inference(self) -> int:
        """One inference: the previous one's mark (a shim sends it with its next write), a
        convolution of fresh data, a relu, the download of its output."""
        if self.inferences:
            self.conn.send(local_pb2.LocalRequest(mark=local_pb2.InferenceMark(
                index=self.inferences, start_ns=0, end_ns=self.INFERENCE_NS)))
        self.inferences += 1
        meta = ops_pb2.TensorMeta(dtype="float32", shape=[4], stride=[1], device="cpu")
        conv = ops_pb2.OpCall(seq=self._id(), op="aten::conv2d.default", out_ids=[self._id()])
        # fresh data every inference, as a camera's: an upload that never changes would be
        # kept in the sequence as fixed bytes (SeqSource.fixed)
        conv.args.add().tensor.upload.CopyFrom(ops_pb2.TensorData(
            meta=meta, data=struct.pack("<f", conv.seq) + b"\0" * 12))
        weight = conv.args.add().tensor
        if self.bound:
            weight.id = self.W
        else:
            weight.persistent, weight.bind_id, self.bound = self.HASH, self.W, True
        relu = ops_pb2.OpCall(seq=self._id(), op="aten::relu.default", out_ids=[self._id()])
        relu.args.add().tensor.id = conv.out_ids[0]
        self._send(call=conv)
        self._send(call=relu)
        self._send(fetch=ops_pb2.Fetch(seq=self._id(), id=relu.out_ids[0]))
        return relu.out_ids[0]

    def recv(self) -> ops_pb2.SessionDown:
        """The next session frame; the robot's search hints (``SearchHint``) are advisory, and
        a client that does not wait for searches skips them. Each hint that says a search is
        running is followed by one that says it is over."""
        while True:
            reply = self.conn.recv(local_pb2.LocalReply)
            assert reply.WhichOneof("msg") == "session", reply
            if reply.session.WhichOneof("msg") != "search":
                return reply.session
            self.hints.append((reply.session.search.running, reply.session.search.wait_us))


def test_an_app_that_downloads_nothing_is_told_of_the_search_at_its_mark(rrtod_daemon):
    """An inference that downloaded nothing (an app that reads only the sizes it was answered)
    is searched at its mark, which a shim sends with the next inference's first call: from
    the app's second mark on, the robot tells it that search runs (``SearchHint``), then that
    it is over, so that its next call can wait for what it finds."""
    d = rrtod_daemon(**ECHO)
    conn, welcome = open_app(d.socket)
    assert welcome.WhichOneof("msg") == "welcome"
    hints: list[bool] = []

    def answered(seq: int) -> None:
        conn.send(call(seq, sync=True))  # answered: the app waits for it
        while True:
            reply = conn.recv(local_pb2.LocalReply)
            if reply.session.WhichOneof("msg") == "search":
                hints.append(reply.session.search.running)
            elif reply.session.result.seq == seq:
                return

    deadline, index = time.monotonic() + 30, 0
    while False not in hints and time.monotonic() < deadline:  # as a real app, keep going
        if index:
            conn.send(local_pb2.LocalRequest(mark=local_pb2.InferenceMark(index=index)))
        conn.send(call(index * 100 + 1))
        answered(index * 100 + 99)
        if index == 1:
            assert hints == [], hints  # the first mark: nothing a search could find yet
        index += 1
    assert hints[:2] == [True, False], hints
    # What the app says it waited (with its next mark) is what the hint budget is charged.
    conn.send(local_pb2.LocalRequest(mark=local_pb2.InferenceMark(index=index,
                                                                  search_wait_us=40_000)))
    answered(5000)
    (session,) = d.status()["sessions"]
    assert abs(session["record"]["search_budget"]["hinted_s"] - 0.04) < 1e-6, session


def test_record_search_define_replay_persist_and_flush(rrtod_daemon):
    d = rrtod_daemon(**ECHO)
    app = EchoApp(d.socket)
    definition = None
    # The search runs off the relay's path and the host must accept the definition before
    # the app sees it: keep inferring (as a real app does) until it arrives, however slow
    # the machine.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = app.inference()
        down = app.recv()
        if down.WhichOneof("msg") == "sequence":
            definition = down.sequence
            told = list(app.hints)
            down = app.recv()
        assert down.fetched.tensor.data == struct.pack("<q", out)
        if definition is not None:
            break
    assert definition is not None, d.logs()[-3000:]
    # From its second download on the app was told of each search (for at most the test
    # daemons' ``search_wait`` of 5 s), and of its end. The search that found the sequence was told
    # again as it found it: the app's wait then covers the host's definition, for at most
    # as long as its last inference took (forwarded, the one the definition saves). Its end
    # came right after the definition (read with the next frame).
    assert told[-2:] == [(True, 5_000_000), (True, EchoApp.INFERENCE_NS // 1000)], told
    assert app.hints == told + [(False, 0)], app.hints
    assert [c.op for c in definition.calls] == ["aten::conv2d.default", "aten::relu.default"]
    kinds = [s.kind for s in definition.sources]
    assert kinds == [ops_pb2.SeqSource.INPUT, ops_pb2.SeqSource.PERSISTENT,
                     ops_pb2.SeqSource.PRODUCED]
    assert definition.sources[1].hash == EchoApp.HASH
    # The definition reached the app only after the host accepted it, so the host knows it.
    # One start, its input, and (first replay in this session) the weight's id: the host
    # replays both calls and pushes the output unasked.
    assert not definition.calls[0].args[0].tensor.upload.data  # an input's bytes: not kept
    base = REPLAY_BASE  # inference 0 of the replay id range
    app._send(start=ops_pb2.ReplayStart(sequence=definition.id, base_id=base))
    meta = ops_pb2.TensorMeta(dtype="float32", shape=[4], stride=[1], device="cpu")
    app._send(arg=ops_pb2.ReplayArg(slot=0, tensor=ops_pb2.TensorRef(
        upload=ops_pb2.TensorData(meta=meta, data=b"\0" * 16))))
    app._send(arg=ops_pb2.ReplayArg(slot=1, tensor=ops_pb2.TensorRef(id=EchoApp.W)))
    pushed = app.recv()
    # each search ended
    assert app.hints[:-3] == [(True, 5_000_000), (False, 0)] * (len(app.hints) // 2 - 1)
    out_index = list(definition.local_ids).index(definition.outputs[0])
    assert pushed.fetched.seq == 0 and pushed.fetched.id == base + out_index
    assert pushed.fetched.tensor.data == struct.pack("<q", base + out_index)
    status = d.ctl("status")
    assert status["gpu"]["sessions"][0]["replays"] == 1
    (listed,) = d.ctl("sequences")["sequences"]
    assert listed["app"] == "record-app" and listed["operators"] == 2
    assert listed["inputs"] == 1 and listed["outputs"] == 1 and listed["replays"] == 1
    app.conn.close()
    # A restarted app is offered the saved sequence as soon as it shows the weights.
    d.wait_for(lambda s: not s["sessions"], what="first session closed")
    again = EchoApp(d.socket)
    again._send(query=ops_pb2.BlobQuery(hashes=[EchoApp.HASH]))
    first = again.recv()
    if first.WhichOneof("msg") == "query":
        first = again.recv()
    assert first.WhichOneof("msg") == "sequence" and first.sequence.id == definition.id
    flushed = d.ctl("flush", "--app", "record-app")
    assert flushed["flushed"] == 1
    dropped = again.recv()
    assert dropped.WhichOneof("msg") == "sequence" and not dropped.sequence.calls
    assert d.ctl("sequences")["sequences"] == []
    again.conn.close()


def test_standard_grpc_health_service(rrtod_daemon):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    d = rrtod_daemon(roles=["gpu"], **ECHO)
    with grpc.insecure_channel(d.listen) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "rrto.v1.Peer"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _raw_session(address: str, frames: list[ops_pb2.SessionUp],
                 part_bytes: int = 0) -> list[ops_pb2.SessionDown]:
    """One Peer.Session stream on a GPU daemon of the echo backend: ``open`` (with
    ``part_bytes``), then ``frames``; the messages after ``ready`` (a batch unpacked), until
    the host ends the stream."""
    import grpc

    from rrto.v1 import peer_pb2_grpc

    opened = ops_pb2.SessionUp(open=ops_pb2.SessionOpen(app="raw", executor="echo",
                                                        part_bytes=part_bytes))
    with grpc.insecure_channel(address) as channel:
        replies = peer_pb2_grpc.PeerStub(channel).Session(iter([opened, *frames]), timeout=30)
        out = []
        for down in replies:
            out.extend(down.batch.frames if down.WhichOneof("msg") == "batch" else [down])
    assert out[0].WhichOneof("msg") == "ready", out
    return out[1:]


def test_the_host_joins_a_message_cut_into_parts_and_ends_a_stream_of_bad_parts(rrtod_daemon,
                                                                             monkeypatch):
    """A robot daemon cuts a long message into ``part``s on a slow link (``wire.cut``): the
    GPU daemon joins them and handles the message as if it had come whole. Parts that join
    into no message, or a frame in the middle of a message's parts, end that stream with
    INVALID_ARGUMENT; the daemon serves the next."""
    import grpc

    from rrtod.wire import Parts, cut

    monkeypatch.syspath_prepend(str(ECHO_PLUGIN))
    from rrto_testkit import LARGE  # the echo backend's large replies

    gpu = rrtod_daemon("gpu1", roles=["gpu"], **ECHO)
    big = ops_pb2.SessionUp(call=ops_pb2.OpCall(seq=7, op="aten::relu.default", sync=True))
    big.call.args.add().tensor.upload.data = bytes(300_000)
    pieces = cut(big, 64 << 10)
    replies = _raw_session(gpu.listen, [*pieces,
                                        ops_pb2.SessionUp(call=ops_pb2.OpCall(seq=8, sync=True))])
    # each part but the last said received (the robot sees its link move), then the joined
    # call's answer, then the next frame's
    assert [r.parts.bytes for r in replies[:len(pieces) - 1]] == [
        (k + 1) * (64 << 10) for k in range(len(pieces) - 1)]
    assert [r.result.seq for r in replies[len(pieces) - 1:]] == [7, 8]
    garbage = ops_pb2.SessionUp(part=ops_pb2.MessagePart(data=b"\xff" * 9, last=True))
    interleaved = [*cut(big, 64 << 10)[:2], ops_pb2.SessionUp(call=big.call)]
    for frames in ([garbage], interleaved):
        with pytest.raises(grpc.RpcError) as err:
            _raw_session(gpu.listen, frames)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert [r.result.seq for r in _raw_session(gpu.listen, [big])] == [7]
    # A robot on a slow link says how long a part of the host's messages may be: a longer
    # reply comes in parts, which join into it.
    fetch = ops_pb2.SessionUp(fetch=ops_pb2.Fetch(seq=9, id=LARGE + 300_000))
    replies = _raw_session(gpu.listen, [fetch], part_bytes=64 << 10)
    assert len(replies) == 5 and all(r.WhichOneof("msg") == "part" for r in replies)
    joiner = Parts(ops_pb2.SessionDown)
    (whole,) = [w for r in replies if (w := joiner.add(r.part)) is not None]
    assert whole[0].fetched.seq == 9 and len(whole[0].fetched.tensor.data) == 300_000
    assert [r.fetched.seq for r in _raw_session(gpu.listen, [fetch])] == [9]  # 0: whole
    # The robot measured its link again and restates the size (``SessionUp.part_bytes``):
    # the replies after it come so. A size under 64 KiB is cut at 64 KiB (a robot that
    # stated 1 byte would have the host cut a reply into one message per byte).
    replies = _raw_session(gpu.listen, [ops_pb2.SessionUp(part_bytes=1), fetch])
    assert len(replies) == 5 and all(r.WhichOneof("msg") == "part"
                                     and len(r.part.data) <= 64 << 10 for r in replies)
    replies = _raw_session(gpu.listen, [ops_pb2.SessionUp(part_bytes=0), fetch],
                           part_bytes=64 << 10)
    assert [r.fetched.seq for r in replies] == [9]  # restated: whole from then
    assert gpu.proc.poll() is None


def test_a_message_longer_than_a_ping_on_a_slow_link_leaves_the_host_up(rrtod_daemon, monkeypatch):
    """At 1.5 Mbit/s an app's 750 kB value takes 4 s to reach the host, past two lost pings
    of 1 s, and so does a 750 kB reply coming back. The robot measured the link as it came
    up (with the 16 KiB probe alone: the 256 KiB one would take longer than a ping's 1 s):
    it writes its message in parts of a quarter second of the link, which the host says it
    has one by one, and the host sends its reply so too. The host stays up and the app gets
    both answers. (Sent whole, nothing showed the link moving: the host was down after ~2 s
    and the app got HOST_LOST; under ~2 Mbit/s, before the 16 KiB probe, the link went
    unmeasured and its messages whole.)"""
    from bench.link import LinkProcess, LinkSpec

    monkeypatch.syspath_prepend(str(ECHO_PLUGIN))
    from rrto_testkit import LARGE  # the echo backend's large replies

    gpu = rrtod_daemon("gpu1", roles=["gpu"], **ECHO)
    with LinkProcess(LinkSpec("slow", rtt_ms=2.0, mbps=1.5), [gpu.listen]) as link:
        robot = rrtod_daemon("robot1", roles=["robot"], **ECHO,
                             health={"interval": 0.2, "timeout": 1.0, "down_after": 2},
                             hosts=[{"name": "slow", "address": link.address(0)}])
        (host,) = robot.wait_for(lambda s: s["hosts"][0]["mbit_s"], what="link measured")["hosts"]
        assert host["state"] == "up" and 0.75 < host["mbit_s"] < 2.25, host
        conn, welcome = open_app(robot.socket)
        assert welcome.WhichOneof("msg") == "welcome"
        frame = call(1, sync=True)
        frame.session.call.args.add().tensor.upload.data = bytes(750_000)
        conn.send(frame)
        reply = conn.recv(local_pb2.LocalReply)
        assert reply.session.result.seq == 1, reply
        conn.send(local_pb2.LocalRequest(session=ops_pb2.SessionUp(
            fetch=ops_pb2.Fetch(seq=2, id=LARGE + 750_000))))
        reply = conn.recv(local_pb2.LocalReply)
        assert reply.session.fetched.seq == 2, reply
        assert len(reply.session.fetched.tensor.data) == 750_000
        (host,) = robot.ctl("status")["hosts"]
        assert host["state"] == "up" and host["since"] < time.time() - 8, host
        conn.close()
