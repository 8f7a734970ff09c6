"""Shared fixtures: real ``rrtod`` processes on temporary sockets, ports and state directories.

``rrtod_daemon(**overrides)`` starts a daemon (roles robot+gpu unless overridden) through
``rrtod.launch`` and waits for its systemd-style ``READY=1``. Daemons see ``tests/testkit`` on
their path: the ``echo`` interception backend there lets the daemon tests run without torch.
"""

from __future__ import annotations

import os
import queue
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rrto.v1 import local_pb2, ops_pb2, peer_pb2_grpc
from rrtod.framing import FramedSocket
from rrtod.launch import Launcher, free_port  # noqa: F401 - re-exported for tests

# A daemon whose apps and sessions use the suite's ``echo`` backend (tests/testkit), and the
# frames an app sends it: shared by the daemon, security and socket-limit tests.
ECHO = {"intercept": {"backend": "echo"}, "executor": {"backend": "echo"}}


def open_app(sock: str, app: str = "test-app") -> tuple[FramedSocket, local_pb2.LocalReply]:
    conn = FramedSocket(sock, timeout=10)
    conn.send(local_pb2.LocalRequest(app_hello=local_pb2.AppHello(app=app, pid=os.getpid(),
                                                                   executor="echo")))
    return conn, conn.recv(local_pb2.LocalReply)


def call(seq: int, op: str = "aten::add.Tensor", sync: bool = False) -> local_pb2.LocalRequest:
    return local_pb2.LocalRequest(session=ops_pb2.SessionUp(
        call=ops_pb2.OpCall(seq=seq, op=op, sync=sync)))


class RawPeerSession:
    """One Peer.Session stream opened by hand on a GPU daemon and driven frame by frame, as a
    hostile robot would: the security tests' client."""

    def __init__(self, address: str, quota: int = 0, options: tuple[Any, ...] = (),
                 timeout: float | None = None):
        self.channel = grpc.insecure_channel(address, options=list(options))
        self.frames: queue.Queue[ops_pb2.SessionUp | None] = queue.Queue()
        self.pending: list[ops_pb2.SessionDown] = []
        self.replies = peer_pb2_grpc.PeerStub(self.channel).Session(
            iter(self.frames.get, None), timeout=timeout)
        self.send(open=ops_pb2.SessionOpen(app="raw", executor="torch", memory_quota=quota))
        assert self.recv().WhichOneof("msg") == "ready"

    def send(self, **frame: object) -> None:
        self.frames.put(ops_pb2.SessionUp(**frame))

    def recv(self) -> ops_pb2.SessionDown:
        while not self.pending:
            down = next(self.replies)
            # the host may batch replies: take them in order
            self.pending = list(down.batch.frames) if down.WhichOneof("msg") == "batch" else [down]
        return self.pending.pop(0)

    def close(self) -> None:
        self.frames.put(None)
        self.channel.close()


REPO = Path(__file__).resolve().parent.parent
TESTKIT = REPO / "tests" / "testkit"
BIN = Path(sys.executable).parent

TEST_DEFAULTS: dict[str, Any] = {
    "health": {"interval": 0.2, "timeout": 0.5, "down_after": 2},
    "log": {"format": "json", "level": "debug"},
    "drain_timeout": 3,
}


@pytest.fixture
def rrtod_daemon() -> Iterator[Any]:
    path = os.pathsep.join(filter(None, [str(TESTKIT), os.environ.get("PYTHONPATH")]))
    launcher = Launcher(extra_env={"PYTHONPATH": path})

    def start(name: str = "rrtod", extra_env: dict[str, str] | None = None, wait: bool = True,
              **overrides: Any) -> Any:
        return launcher.start(name, extra_env=extra_env, wait=wait, **{**TEST_DEFAULTS, **overrides})

    yield start
    launcher.close()
