"""Shared fixtures: real ``rrtod`` processes on temporary sockets, ports and state directories.

``rrtod_daemon(**overrides)`` starts a daemon (roles robot+gpu unless overridden) through
``rrtod.launch`` and waits for its systemd-style ``READY=1``. Daemons see ``tests/testkit`` on
their path: the ``echo`` interception backend there lets the daemon tests run without torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rrto.v1 import local_pb2, ops_pb2
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
