"""Back to offloading after the host was lost, without a restart of the app.

While the session runs locally (``fallback: local``), each inference start (``poll``) may try
the robot daemon again, at most once per ``RETRY_S``, in a background thread so that the app
never waits for it: a new connection (``Channel.reopen``: the daemon's balancer picks a host
that is up, another one or the same one back), then every live persistent tensor offered to
that host by content hash and the missing ones uploaded from the app's copies (weights the
host's cache has cost nothing). Only when all are there does the next inference start swap to
the new connection (``RemoteSession.swap``): so the inference that swaps pays no upload.

A session with a persistent tensor whose value only the lost host had (a weight written there)
never goes back: it has no value to offer.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from rrto.v1 import ops_pb2

from . import codec

RETRY_S = 1.0  # between attempts while no host takes the session
REPLY_S = 30.0  # for the new host's answer to a blob query


class _Pending:
    """A connection being readied: until the swap, its replies are the blob queries' own."""

    def __init__(self, session: Any, channel: Any):
        self.session = session
        self.channel = channel
        self.live = False  # set at the swap: from then on, frames are the session's
        self.dead: str | None = None  # lost before the swap
        self.lock = threading.Lock()  # a loss is either before the swap or the session's
        self.replies: queue.Queue[Any] = queue.Queue()

    def on_down(self, down: ops_pb2.SessionDown) -> None:
        if self.live:
            self.session._on_down(down)
        elif down.WhichOneof("msg") == "query":
            self.replies.put(down.query)
        elif down.WhichOneof("msg") == "error":
            self.replies.put(f"{down.error.code}: {down.error.message}")

    def on_lost(self, reason: str) -> None:
        with self.lock:
            if not self.live:
                self.dead = reason
                self.replies.put(f"lost: {reason}")
                return
        self.session._on_lost(reason)

    def query(self, hashes: list[bytes]) -> list[bytes]:
        """The hashes the host lacks among ``hashes``; raises ``OSError`` if it fails."""
        self.channel.send([ops_pb2.SessionUp(query=ops_pb2.BlobQuery(hashes=hashes))])
        try:
            reply = self.replies.get(timeout=REPLY_S)
        except queue.Empty:
            raise OSError("the new host did not answer") from None
        if isinstance(reply, str):
            raise OSError(reply)
        return list(reply.missing)


class Reconnect:
    """A lost session's way back to a host (see the module docstring)."""

    def __init__(self, session: Any):
        self.session = session
        self._lock = threading.Lock()
        self._next = 0.0
        self._busy = False
        self._ready: _Pending | None = None
        self.last_error: str | None = None

    def stop(self) -> None:
        """Never try again (a forked child, which must not open a session of its own)."""
        with self._lock:
            self._busy = True
            self._ready = None

    def poll(self) -> None:
        """At an inference start while lost: swap to a readied connection, or start readying
        one (in the background) if none is under way and the last try is old enough."""
        with self._lock:
            ready, self._ready = self._ready, None
            start = ready is None and not self._busy and time.monotonic() >= self._next
            if start:
                self._busy = True
        if ready is not None:
            with ready.lock:
                if ready.dead is None:
                    ready.live = True
                    self.session.swap(ready.channel)
                    return
            ready.channel.close()  # lost while readied: try again
            with self._lock:
                self._next = time.monotonic() + RETRY_S
            return
        if start:
            threading.Thread(target=self._attempt, name="rrto-reconnect", daemon=True).start()

    def _attempt(self) -> None:
        pending = None
        try:
            handles = self.session.persistent_handles()
            if any(h.local is None for h in handles):
                self.last_error = "a weight's only value was on the lost host"
                return  # never again: _busy stays set
            pending = _Pending(self.session, self.session.channel.reopen())
            pending.channel.start(pending.on_down, pending.on_lost)
            by_hash = {h.hash: h for h in handles}
            missing = pending.query(list(by_hash)) if by_hash else []
            for key in missing:
                t = by_hash[key].local
                pending.channel.send([ops_pb2.SessionUp(blob=ops_pb2.BlobPut(
                    hash=key, tensor=codec.tensor_data(t)))])
                self.session.counters["blob_bytes_up"] += t.numel() * t.element_size()
            if missing and pending.query(missing):  # in order after the puts: all arrived?
                raise OSError("the new host did not keep the uploaded weights")
        except Exception as exc:  # no daemon, no host up (NoHost), a host lost meanwhile
            self.last_error = str(exc)
            if pending is not None:
                pending.channel.close()
            with self._lock:
                self._busy = False
                self._next = time.monotonic() + RETRY_S
            return
        with self._lock:
            self._ready = pending
            self._busy = False
