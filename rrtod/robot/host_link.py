"""A robot daemon's link to one GPU daemon: channel, liveness, measured RTT, session streams.

A ping loop measures the round trip every ``health.interval`` seconds: a ping starts
``interval`` after the previous one started, or as soon as it ends if it took longer (a ping
without an answer takes ``health.timeout``). ``down_after`` lost pings in a row mark the host
down; the first successful ping marks it up again. The channel reconnects by itself (backoff
capped at 2 s, see grpc_options), so a GPU daemon that restarts is back in ``rrtoctl status``
within a few seconds with no restart of the robot daemon.

Going from up to down calls each of ``on_down`` (the robot role fails the link's app sessions
there with ``HOST_LOST``). That is how a host that stops answering without closing its
connection (a stopped process, a network that drops packets without a reset) ends the sessions
on it: their gRPC streams would wait for TCP or keepalive to give up (41-62 s measured, issue
14). The bound: a host is down at most ``(down_after - 1) * max(interval, timeout) + timeout``
(<= ``down_after * max(interval, timeout)``) after the first ping it leaves unanswered was sent,
and at most one ``interval`` more after it stalled (``detection_bound``): with the defaults
(interval 1 s, timeout 1 s, down_after 2), 2 s after the first lost ping, 3 s after the stall.
A refused connection (the daemon exited) fails a ping at once instead of after ``timeout``; its
sessions' streams end by themselves then.

A ping that goes unanswered while a session stream of the link moved data since it was sent
(``note_progress``: a write the host's flow control let through, a message from the host) is
not lost: the link is busy, not down. On a slow link a ping waits behind what is queued ahead
of it (resnet50's 100 MB of weights take 16 s at 50 Mbit/s), and the benchmark's trace links
once lost their host that way in the middle of a model's first upload. A single message can
take longer than that: resnet18's largest weight is 9.4 MB, 7.5 s at 10 Mbit/s, and no write
completed while it went, so the host was lost in the app's first forward. So the link's
throughput is probed when it first comes up (and every ``REPROBE_S`` after), and on a link
that slow a longer message goes in parts of a quarter second of the link each (``part_bytes``;
``wire.cut``), both ways: the host says it has each of the robot's (``PartsReceived``), and
cuts its own replies at the size the robot states (``SessionOpen.part_bytes``); each is a
message from the host. A stalled host takes nothing: its streams stop moving once its
flow-control windows are full, and the bound above runs from then.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc
import structlog

from rrto.v1 import peer_pb2, peer_pb2_grpc
from rrtod import __version__
from rrtod.config import HealthConfig, HostConfig, TLSConfig
from rrtod.grpc_options import MAX_MESSAGE
from rrtod.wire import MIN_PART

THROUGHPUT_PROBE_BYTES = 256 << 10  # a ping this big measures the link's throughput...
# ...once one this big said it would take under half a ping's timeout (else this one does)
FIRST_PROBE_BYTES = 16 << 10
SWITCH_PROBE_BYTES = 64 << 10  # a probe after an inference that moved too little to tell
THROUGHPUT_MAX_AGE_S = 2.0  # a throughput measured longer ago than this is measured again
THROUGHPUT_WINDOW_S = 60.0  # the estimate is the best probe of this window (a windowed max)
# The ping loop probes at least this often (so the window holds a probe taken on the link as
# it is now: a robot driving out of range cuts its messages to the slower link within a
# window and a half)
REPROBE_S = THROUGHPUT_WINDOW_S / 2
# A session message is cut into parts of at most this many seconds of the link
# (``HostLink.part_bytes``), none smaller than ``PART_MIN_BYTES``
PART_S, PART_MIN_BYTES = 0.25, MIN_PART

log = structlog.get_logger("rrtod.host")

# Called when a link goes from up to down, with the link and why ("no answer to 2 pings in
# 2.0 s (DEADLINE_EXCEEDED: Deadline Exceeded)"), from the ping loop: must not block.
OnDown = Callable[["HostLink", str], None]


def detection_bound(health: HealthConfig) -> float:
    """Seconds at most from a host's stall (it stops answering, its connection stays open) to
    its link going down: up to one ``interval`` until the next ping, then ``down_after`` lost
    pings, each started ``max(interval, timeout)`` after the one before, the last one lost
    ``timeout`` after it started. Event-loop delays come on top."""
    step = max(health.interval, health.timeout)
    return health.interval + (health.down_after - 1) * step + health.timeout


class HostLink:
    def __init__(self, host: HostConfig, tls: TLSConfig, health: HealthConfig, open_channel: Any,
                 node: str):
        self.config = host
        self.name = host.name
        self.address = host.address
        self.health = health
        self.node = node
        self.channel: grpc.aio.Channel = open_channel(host.address, tls)
        self.stub = peer_pb2_grpc.PeerStub(self.channel)
        self.state = "connecting"
        self.since = time.time()
        self.last_error: str | None = None
        self.rtts: deque[float] = deque(maxlen=20)
        self.sessions = 0
        # Replayed inferences this robot daemon has in flight on the host (placed by the
        # balancer, not yet answered): kept by whoever sends them, read by balancers.
        self.inflight = 0
        self.device: str | None = None
        self.executors: list[str] = []
        self.remote_version: str | None = None
        self.on_down: list[OnDown] = []  # called on each up -> down transition
        self._lost = 0  # lost pings in a row
        self.progressed = 0.0  # when a session stream last moved data (time.monotonic)
        self._lost_since = 0.0  # when the first of them was sent (time.monotonic)
        self._task: asyncio.Task[None] | None = None
        # The link's throughput (``probe_throughput``): the best of the probes (monotonic
        # time, Mbit/s) of the last ``THROUGHPUT_WINDOW_S``
        self.mbit_s: float | None = None
        self._probes: deque[tuple[float, float]] = deque(maxlen=16)
        self._probe_due = 0.0  # when the ping loop probes next (``_monitor``)

    # The attributes host balancers read (see plugins/balancers).
    @property
    def up(self) -> bool:
        return self.state == "up"

    @property
    def rtt_ms(self) -> float | None:
        return statistics.median(self.rtts) * 1e3 if self.rtts else None

    @property
    def part_bytes(self) -> int | None:
        """The longest part the relay writes a session message in (``wire.cut``): a quarter
        second of the link's measured throughput (at least ``PART_MIN_BYTES``), or None
        (messages go whole) while that is unmeasured or past the largest message (on
        loopback, ~650 MB: no message is cut)."""
        if not self.mbit_s:
            return None
        part = int(self.mbit_s * 1e6 / 8 * PART_S)
        return max(part, PART_MIN_BYTES) if part < MAX_MESSAGE else None

    def note_progress(self) -> None:
        """A session stream on this link moved data (the relay, after each write and read)."""
        self.progressed = time.monotonic()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._monitor(), name=f"host:{self.name}")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.channel.close(grace=None)

    def _set_state(self, state: str, error: str | None = None, why: str | None = None) -> None:
        """``why``: the reason handed to ``on_down`` when the host goes from up to down."""
        previous = self.state
        if state != previous:
            self.since = time.time()
            event = log.info if state == "up" else log.warning
            event("host state", host=self.name, address=self.address, state=state, error=error,
                  why=why)
        self.state = state
        self.last_error = error
        if previous == "up" and state == "down":
            # (the link may come back another: measured afresh when it is up again)
            self._probes.clear()
            self.mbit_s, self._probe_due = None, 0.0
            for callback in list(self.on_down):
                try:
                    callback(self, why or error or "down")
                except Exception:  # one subscriber's bug must not stop the ping loop
                    log.exception("host down callback failed", host=self.name)

    async def _hello(self) -> None:
        reply = await self.stub.Hello(
            peer_pb2.PeerHello(version=__version__, node=self.node), timeout=self.health.timeout
        )
        self.device = reply.device
        self.executors = list(reply.executors)
        self.remote_version = reply.version

    @property
    def rtt_min_ms(self) -> float | None:
        """The least recent round trip: the link's own latency, without the time pings spent
        queued behind data (which the median includes on a busy, slow link)."""
        return min(self.rtts) * 1e3 if self.rtts else None

    async def probe_throughput(self, max_age_s: float = THROUGHPUT_MAX_AGE_S) -> float | None:
        """The link's throughput towards the host in Mbit/s: the best of the probes of the
        last ``THROUGHPUT_WINDOW_S``, with a new probe if the last is older than ``max_age_s``.
        A probe is the time of a ping that carries ``THROUGHPUT_PROBE_BYTES`` less the link's
        own round trip (the least one measured, an empty ping's included). Data queued ahead
        of a probe can only make it look slower, never faster: one probe behind the app's
        600 kB input read 15.6 Mbit/s on a 50 Mbit/s link, so the estimate is a windowed
        maximum (as BBR estimates a bottleneck's bandwidth) of probes taken each time a
        scheduler asks. None if it cannot be measured (the host is down). Schedulers place
        calls with it (``rrtod.robot.scheduling``). A link too slow to carry the full probe
        within a ping's ``timeout`` (256 KiB take 1 s at 2 Mbit/s) is measured with the
        first, smaller one (``FIRST_PROBE_BYTES``): the full probe went unanswered there,
        and such a link, the slowest, sent its messages whole (``part_bytes``). A fast link
        is measured with the full one, as the small one's time is mostly the round trip's
        noise there."""
        now = time.monotonic()
        if self._probes and now - self._probes[-1][0] < max_age_s or not self.up:
            return self.mbit_s
        try:
            self.rtts.append(await self._timed_ping(b""))
            mbit_s = await self._probe(FIRST_PROBE_BYTES)
        except grpc.aio.AioRpcError:
            return self.mbit_s
        if THROUGHPUT_PROBE_BYTES * 8 / 1e6 / mbit_s < self.health.timeout / 2:
            try:
                mbit_s = await self._probe(THROUGHPUT_PROBE_BYTES)
            except grpc.aio.AioRpcError:
                pass  # (slower since, or queued behind data: the first probe's figure)
        self._probes.append((now, mbit_s))
        self.mbit_s = max(m for at, m in self._probes if now - at <= THROUGHPUT_WINDOW_S)
        return self.mbit_s

    async def _probe(self, nbytes: int) -> float:
        """Mbit/s of one ping that carries ``nbytes``, less the least round trip measured."""
        took = await self._timed_ping(bytes(nbytes))
        return nbytes * 8 / 1e6 / max(took - min(self.rtts), 1e-6)

    async def time_upload(self, nbytes: int = SWITCH_PROBE_BYTES) -> float | None:
        """Seconds ``nbytes`` take to reach the host now beyond the link's own round trip: one
        ping carrying them, less the least round trip measured. Not a windowed best: plan
        switching follows the link from one inference to the next (``rrtod.robot.scheduling``).
        None if the host is down or the ping failed; a ping that times out counts as taking
        its timeout (an outage is slow, not unknown)."""
        if not self.up:
            return None
        sent = time.monotonic()
        try:
            took = await self._timed_ping(bytes(nbytes))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                return None
            took = time.monotonic() - sent
        return max(took - (min(self.rtts) if self.rtts else 0.0), 0.0)

    async def _timed_ping(self, payload: bytes) -> float:
        sent = time.monotonic_ns()
        await self.stub.Ping(peer_pb2.PingRequest(sent_ns=sent, payload=payload),
                             timeout=self.health.timeout)
        return (time.monotonic_ns() - sent) / 1e9

    async def ping(self) -> float:
        sent = time.monotonic_ns()
        await self.stub.Ping(peer_pb2.PingRequest(sent_ns=sent), timeout=self.health.timeout)
        return (time.monotonic_ns() - sent) / 1e9

    async def _monitor(self) -> None:
        """Ping every ``interval``: the next ping starts ``interval`` after this one started, at
        once if this one took longer. (Sleeping a full ``interval`` after a ping that hung for
        ``timeout`` made each lost ping cost ``interval + timeout``: with the defaults a stalled
        host was down 3 s after its first lost ping instead of 2, 4 s after it stalled instead
        of 3.)"""
        while True:
            started = time.monotonic()
            try:
                if self.state != "up":
                    await self._hello()
                self.rtts.append(await self.ping())
                self._lost = 0
                self._set_state("up")
                if started >= self._probe_due:  # first before the first session's uploads
                    self._probe_due = started + REPROBE_S  # (``part_bytes``), then and again
                    await self.probe_throughput(max_age_s=REPROBE_S)
            except grpc.aio.AioRpcError as exc:
                if self.state == "up" and self.progressed >= started:
                    self._lost = 0  # queued behind the sessions' data, which the host takes
                else:
                    self._ping_lost(started, f"{exc.code().name}: {exc.details()}")
            await asyncio.sleep(max(0.0, started + self.health.interval - time.monotonic()))

    def _ping_lost(self, started: float, error: str) -> None:
        """The ping sent at ``started`` went unanswered: down after ``down_after`` in a row."""
        if self._lost == 0:
            self._lost_since = started
        self._lost += 1
        if self.state == "up" and self._lost < self.health.down_after:
            return  # one lost ping is noise, not an outage
        n = self._lost
        why = (f"no answer to {n} ping{'s' if n > 1 else ''} in "
               f"{time.monotonic() - self._lost_since:.1f} s ({error})")
        self._set_state("down", error, why)

    def open_session(self) -> grpc.aio.StreamStreamCall:
        return self.stub.Session()

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "address": self.address,
            "transport": self.config.transport,
            "state": self.state,
            "since": self.since,
            "rtt_ms": None if self.rtt_ms is None else round(self.rtt_ms, 3),
            "mbit_s": None if self.mbit_s is None else round(self.mbit_s, 1),
            "device": self.device,
            "version": self.remote_version,
            "sessions": self.sessions,
            "inflight": self.inflight,
            "last_error": self.last_error,
        }
