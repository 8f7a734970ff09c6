"""Memory safety of a real GPU daemon, attacked as the issue-10 review did: a raw gRPC client
on its peer port (issue 10, findings 1 and 4).

The daemon's memory is measured from outside (its peak and current RSS from /proc through
psutil): a refused request must not have allocated first.
"""

from __future__ import annotations

import time

import grpc
import psutil
import pytest

from rrto.v1 import ops_pb2
from rrtod.grpc_options import CHANNEL_OPTIONS
from testkit.daemons import TEST_DEFAULTS, Launcher
from testkit.peer import RawPeerSession

MiB = 1 << 20
EXECUTOR = {"device": "cpu", "memory_quota": "512MiB", "memory_limit": "1GiB",
            # sec-ops' allowlist may keep this operator out by default: admit it here, so that
            # the test exercises the output bound check itself
            "allow_extra": ["unsafe:aten::_reshape_alias"]}


class RawSession(RawPeerSession):
    """A session opened by hand on the GPU daemon's peer port, frame by frame."""

    def __init__(self, address: str, quota: int = 0):
        super().__init__(address, quota, options=tuple(CHANNEL_OPTIONS))

    def call(self, op: str, args: list[ops_pb2.Value], out_ids=(), seq=1, out_meta=(),
             sync=True) -> ops_pb2.SessionDown | None:
        self.send(call=ops_pb2.OpCall(seq=seq, op=op, args=args, out_ids=list(out_ids),
                                      out_meta=list(out_meta), sync=sync))
        return self.recv() if sync else None



def ints(*v: int) -> ops_pb2.Value:
    return ops_pb2.Value(list=ops_pb2.ValueList(items=[ops_pb2.Value(i=i) for i in v]))


def zeros(n: int, bind: int) -> ops_pb2.Value:
    data = ops_pb2.TensorData(meta=ops_pb2.TensorMeta(dtype="float32", shape=[n], device="cpu"),
                              data=bytes(4 * n))
    return ops_pb2.Value(tensor=ops_pb2.TensorRef(upload=data, bind_id=bind))


class Memory:
    """The daemon's resident memory: how much it grew, at its peak, since ``__init__``."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.rss0, self.hwm0 = self._now()

    def _now(self) -> tuple[int, int]:
        with open(f"/proc/{self.proc.pid}/status") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        return self.proc.memory_info().rss, hwm

    def growth(self) -> int:
        rss, hwm = self._now()
        return max(rss - self.rss0, hwm - self.hwm0)


@pytest.fixture(scope="module")
def daemon():
    with Launcher() as launcher:
        d = launcher.start("gpu", **{**TEST_DEFAULTS, "roles": ["gpu"], "executor": EXECUTOR})
        warm = RawSession(d.listen)  # torch loaded, a first operator run: the baseline
        down = warm.call("aten::add.Tensor", [zeros(4, 1), zeros(4, 2)], out_ids=[3])
        assert down.WhichOneof("msg") == "result", down
        warm.close()
        yield d


@pytest.fixture
def gpu_daemon(daemon):
    """The module's daemon once the sessions of earlier tests are gone (and their memory)."""
    # generous: a loaded 2-core machine is slow to close
    daemon.wait_for(lambda s: not s["gpu"]["sessions"], timeout=30,
                    what="the sessions of earlier tests to close")
    return daemon


def alive(daemon) -> None:
    """The daemon keeps serving: a new session runs an operator."""
    s = RawSession(daemon.listen)
    down = s.call("aten::neg.default", [zeros(8, 1)], out_ids=[2])
    assert down.WhichOneof("msg") == "result", down
    s.close()
    assert daemon.proc.poll() is None


def test_out_of_bounds_alias_is_refused_and_the_daemon_keeps_answering(gpu_daemon):
    s = RawSession(gpu_daemon.listen)
    for n, seq in ((65_536, 1), (1 << 18, 2)):  # 64 KiB and 1 MiB views over 16 bytes
        down = s.call("aten::_reshape_alias.default", [zeros(4, 1), ints(n), ints(1)],
                      out_ids=[2], seq=seq)
        assert down.error.code == "BAD_VIEW", down
        s.send(fetch=ops_pb2.Fetch(seq=10 + seq, id=2))
        down = s.recv()
        assert down.error.code == "POISONED" and not down.HasField("fetched")
    down = s.call("aten::fill_.Scalar", [ops_pb2.Value(tensor=ops_pb2.TensorRef(id=2)),
                                         ops_pb2.Value(f=7.0)], out_ids=[2], seq=3)
    assert down.error.code == "POISONED"
    s.close()
    alive(gpu_daemon)


def test_one_gib_declared_as_one_element_is_refused_before_it_is_allocated(gpu_daemon):
    """``ones`` of 1 GiB with a declared 1-element output against the 512 MiB quota:
    QUOTA_EXCEEDED, and the daemon's memory grows by less than 64 MiB."""
    mem = Memory(gpu_daemon.proc.pid)
    s = RawSession(gpu_daemon.listen)
    one = ops_pb2.TensorMeta(dtype="float32", shape=[1], stride=[1], device="cpu")
    down = s.call("aten::ones.default", [ints(1 << 28)], out_ids=[1], out_meta=[one])
    assert down.error.code == "QUOTA_EXCEEDED", down
    assert "needs 1073741824 bytes" in down.error.message
    print(f"daemon RSS growth (peak or current): {mem.growth() / MiB:.1f} MiB")
    assert mem.growth() < 64 * MiB, mem.growth() / MiB
    s.close()
    alive(gpu_daemon)


def test_sessions_together_are_held_to_the_host_memory_limit(gpu_daemon):
    """Six sessions of 400 MiB each against the 1 GiB memory limit: two fit, the rest are
    refused, whatever their own quota (512 MiB) would allow."""
    sessions = [RawSession(gpu_daemon.listen) for _ in range(6)]
    codes = []
    for s in sessions:  # empty: address space only, these tests do not need the RAM
        down = s.call("aten::empty.memory_format", [ints(100 * MiB)], out_ids=[1])
        codes.append(down.error.code or down.WhichOneof("msg"))
    assert codes == ["result", "result"] + ["QUOTA_EXCEEDED"] * 4
    sessions[0].close()
    deadline = time.monotonic() + 10
    while True:  # the daemon frees the closed session's memory as it notices the close
        down = sessions[2].call("aten::empty.memory_format", [ints(100 * MiB)], out_ids=[1],
                                seq=2)
        if down.WhichOneof("msg") == "result" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert down.WhichOneof("msg") == "result", down
    for s in sessions[1:]:
        s.close()
    alive(gpu_daemon)


def test_client_that_does_not_read_is_disconnected_not_buffered(gpu_daemon):
    """1,500 fetches of a 1 MiB tensor whose replies the client never reads: the daemon
    stops at the session's quota (64 MiB here) and ends the stream with RESOURCE_EXHAUSTED."""
    mem = Memory(gpu_daemon.proc.pid)
    s = RawSession(gpu_daemon.listen, quota=64 * MiB)
    s.call("aten::clone.default", [zeros(MiB // 4, 1)], out_ids=[2], sync=False)
    for i in range(1500):
        s.send(fetch=ops_pb2.Fetch(seq=i + 1, id=2))
    deadline = time.monotonic() + 30
    while "client does not read" not in gpu_daemon.logs() and time.monotonic() < deadline \
            and mem.growth() < 512 * MiB:
        time.sleep(0.1)
    print(f"daemon RSS growth (peak or current): {mem.growth() / MiB:.1f} MiB")
    assert mem.growth() < 128 * MiB, mem.growth() / MiB
    assert "client does not read" in gpu_daemon.logs()
    with pytest.raises(grpc.RpcError) as err:
        while True:
            s.recv()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "not being read" in err.value.details()
    s.close()
    alive(gpu_daemon)
