"""Raw clients of a daemon's sockets, driven frame by frame: an app on the app socket
(``open_app``, ``call``) and a robot on a GPU daemon's ``Peer.Session`` (``RawPeerSession``), as
the daemon, security, socket-limit and memory-safety tests need them: nothing in between that
would correct or refuse what a hostile peer sends."""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import grpc

from rrto.v1 import local_pb2, ops_pb2, peer_pb2_grpc
from rrtod.framing import FramedSocket


def open_app(sock: str, app: str = "test-app") -> tuple[FramedSocket, local_pb2.LocalReply]:
    """Connect to a robot daemon's app socket as an app of the ``echo`` backend; returns the
    connection and the daemon's reply to the hello."""
    conn = FramedSocket(sock, timeout=10)
    conn.send(local_pb2.LocalRequest(app_hello=local_pb2.AppHello(app=app, pid=os.getpid(),
                                                                   executor="echo")))
    return conn, conn.recv(local_pb2.LocalReply)


def call(seq: int, op: str = "aten::add.Tensor", sync: bool = False) -> local_pb2.LocalRequest:
    """An app's operator call frame."""
    return local_pb2.LocalRequest(session=ops_pb2.SessionUp(
        call=ops_pb2.OpCall(seq=seq, op=op, sync=sync)))


class RawPeerSession:
    """One Peer.Session stream opened by hand on a GPU daemon and driven frame by frame, as
    a hostile robot would: the security tests' client."""

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

    def close(self, timeout: float = 30.0) -> None:
        """End the session as a robot does (a ``close`` frame, then the end of the stream) and
        wait up to ``timeout`` for the daemon to end it too, so that the session is gone from
        the daemon once this returns: closing the channel alone leaves the daemon to notice a
        cancelled stream, which under load can take longer than the next test waits."""
        self.send(close=ops_pb2.Close())
        self.frames.put(None)
        drain = threading.Thread(target=self._drain, daemon=True)
        drain.start()
        drain.join(timeout)
        self.channel.close()

    def _drain(self) -> None:
        try:
            for _ in self.replies:
                pass
        except grpc.RpcError:
            pass  # ended by the daemon with an error status (a test may have asked for one)
