"""A robot daemon's link to one GPU daemon: channel, liveness, measured RTT, session streams.

A ping loop measures the round trip every ``health.interval`` seconds. ``down_after`` lost pings
in a row mark the host down; the first successful ping marks it up again. The channel reconnects
by itself (backoff capped at 2 s, see grpc_options), so a GPU daemon that restarts is back in
``rrtoctl status`` within a few seconds with no restart of the robot daemon.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from typing import Any

import grpc
import structlog

from rrto.v1 import peer_pb2, peer_pb2_grpc
from rrtod import __version__
from rrtod.config import HealthConfig, HostConfig, TLSConfig

log = structlog.get_logger("rrtod.host")


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
        self.device: str | None = None
        self.executors: list[str] = []
        self.remote_version: str | None = None
        self._lost = 0
        self._task: asyncio.Task[None] | None = None

    # The attributes host balancers read (see plugins/balancers).
    @property
    def up(self) -> bool:
        return self.state == "up"

    @property
    def rtt_ms(self) -> float | None:
        return statistics.median(self.rtts) * 1e3 if self.rtts else None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._monitor(), name=f"host:{self.name}")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.channel.close(grace=None)

    def _set_state(self, state: str, error: str | None = None) -> None:
        if state != self.state:
            self.since = time.time()
            event = log.info if state == "up" else log.warning
            event("host state", host=self.name, address=self.address, state=state, error=error)
        self.state = state
        self.last_error = error

    async def _hello(self) -> None:
        reply = await self.stub.Hello(
            peer_pb2.PeerHello(version=__version__, node=self.node), timeout=self.health.timeout
        )
        self.device = reply.device
        self.executors = list(reply.executors)
        self.remote_version = reply.version

    async def ping(self) -> float:
        sent = time.monotonic_ns()
        await self.stub.Ping(peer_pb2.PingRequest(sent_ns=sent), timeout=self.health.timeout)
        return (time.monotonic_ns() - sent) / 1e9

    async def _monitor(self) -> None:
        while True:
            try:
                if self.state != "up":
                    await self._hello()
                self.rtts.append(await self.ping())
                self._lost = 0
                self._set_state("up")
            except grpc.aio.AioRpcError as exc:
                self._lost += 1
                if self.state == "up" and self._lost < self.health.down_after:
                    pass  # one lost ping is noise, not an outage
                else:
                    self._set_state("down", f"{exc.code().name}: {exc.details()}")
            await asyncio.sleep(self.health.interval)

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
            "device": self.device,
            "version": self.remote_version,
            "sessions": self.sessions,
            "last_error": self.last_error,
        }
