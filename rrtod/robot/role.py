"""The ``robot`` role: app sessions from the unix socket, relayed to GPU daemons.

The role keeps the connections to GPU hosts (``HostLink``, one per host its ``hosts`` entries
name: an address, or every address a ``dns:///`` name resolves to (``host_source``); watched for
liveness) and the app sessions. A host that is no longer named gets no new sessions and its
link is closed once its last session ends. An app's connection becomes a session after ``AppHello``:
the host balancer picks an up host, and an ``AppRelay`` (``rrtod/robot/relay.py``) moves the
session's frames both ways in order until either side ends; its ``Recorder`` sees every frame.
When a host's link goes down (its ping loop's ``on_down``), the sessions on it are failed at
once with ``HOST_LOST`` (``AppRelay.lose_host``): a stalled host never closes their streams.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import structlog

from rrto.v1 import local_pb2, ops_pb2
from rrtod import shared_uploads
from rrtod.config import Config
from rrtod.framing import ByteBudget, FrameReader, encode
from rrtod.hookspecs import HostBalancer
from rrtod.plugins import Registry
from rrtod.robot import balancing
from rrtod.robot.balancing import build_balancer, close_balancer
from rrtod.robot.host_link import HostLink
from rrtod.robot.host_source import HostSource, Resolver, source_for, system_resolver
from rrtod.robot.placement import Lane, Placement
from rrtod.robot.recorder import Recorder, SearchBudget
from rrtod.robot.relay import AppRelay, AppSession, error_reply
from rrtod.robot.scheduling import Scheduling

log = structlog.get_logger("rrtod.robot")


class RobotRole:
    def __init__(self, config: Config, registry: Registry, energy: Any = None,
                 resolve: Resolver = system_resolver):
        self.config = config
        self.registry = registry
        self.energy = energy
        self.resolve = resolve
        self.sources: dict[str, HostSource] = {}  # by hosts entry, in config order
        self.hosts: dict[str, HostLink] = {}  # the hosts they name, in the same order
        self.retiring: set[HostLink] = set()  # no longer named: closed once idle
        self._closing: set[asyncio.Task[None]] = set()
        self.relays: dict[str, AppRelay] = {}  # the live app sessions', by session id
        # Built at start and when a reload changes `balancer` or its `balancers` block (the old
        # one closed first, so the new one loads what it persisted); closed at stop.
        self.balancer: HostBalancer = build_balancer(registry, config)
        self._balancer_selection = balancing.selection(config)
        self.search_factory = registry.get("search", config.search).factory
        self.scheduling = Scheduling(registry, config)  # ``scheduler``: placement of calls
        self.draining = False
        self._ids = itertools.count(1)
        # Counters of sessions that have ended, so demos and benchmarks can read what a
        # finished app cost after its session is gone.
        self.finished = {"sessions": 0, "ops_forwarded": 0, "frames_up": 0, "frames_down": 0,
                         "bytes_up": 0, "bytes_down": 0, "inferences": 0,
                         "shared_uploads": 0}

    @property
    def sessions(self) -> dict[str, AppSession]:
        """The live app sessions, by id."""
        return {sid: relay.session for sid, relay in self.relays.items()}

    async def start(self) -> None:
        await self._set_sources(self.config)

    def _host_down(self, link: HostLink, why: str) -> None:
        """``link`` went from up to down: fail its sessions now (each relay's own task tells its
        app and cleans up, as for a broken stream)."""
        relays = [r for r in self.relays.values() if r.session.host is link]
        if relays:
            log.warning("failing the sessions of a host that is down", host=link.name,
                        address=link.address, sessions=[r.session.id for r in relays], why=why)
        for relay in relays:
            relay.lose_host(why)
        for relay in self.relays.values():  # replicas of other sessions there
            if relay.placement is not None and relay.session.host is not link:
                relay.placement.lose(link, why)

    async def reload(self, config: Config) -> None:
        """New hosts are connected, removed ones closed once idle; changed ones reconnect (the
        old link too is closed once idle)."""
        reconnect = config.tls != self.config.tls
        self.config = config
        if balancing.selection(config) != self._balancer_selection:
            close_balancer(self.balancer)
            self.balancer = build_balancer(self.registry, config)
            self._balancer_selection = balancing.selection(config)
        self.search_factory = self.registry.get("search", config.search).factory
        if (config.scheduler, config.switch_plans) != (self.scheduling.name,  # sequences
                                                       self.scheduling.switch_plans):  # from now on
            self.scheduling = Scheduling(self.registry, config)
        await self._set_sources(config, reconnect)

    async def _set_sources(self, config: Config, reconnect: bool = False) -> None:
        """One source per hosts entry: unchanged ones kept, others (re)started."""
        wanted = {h.name: h for h in config.peer_hosts()}
        for name, source in list(self.sources.items()):
            if wanted.get(name) != source.entry:
                del self.sources[name]
                await source.close()
        new = [source_for(h, self.resolve) for name, h in wanted.items() if name not in self.sources]
        self.sources.update((s.entry.name, s) for s in new)
        self.sources = {name: self.sources[name] for name in wanted}
        await asyncio.gather(*(s.start(self._sync) for s in new))
        self._sync(reconnect)

    def _sync(self, reconnect: bool = False) -> None:
        """One link per host the sources name: new ones connected, gone or changed ones retired.
        Called by the sources whenever their hosts change; no await, so never interleaved."""
        wanted = {h.name: (h, s) for s in self.sources.values() for h in s.hosts}
        for name, link in list(self.hosts.items()):
            if reconnect or name not in wanted or wanted[name][0] != link.config:
                del self.hosts[name]
                self.retiring.add(link)
                self._close_if_idle(link)
        for name, (host, source) in wanted.items():
            if name not in self.hosts:
                open_channel = self.registry.get("transport", host.transport).factory
                link = HostLink(host, source.tls(self.config.tls), self.config.health,
                                open_channel, self.config.node)
                link.on_down.append(self._host_down)
                self.hosts[name] = link
                link.start()
        self.hosts = {name: self.hosts[name] for name in wanted}

    def _close_if_idle(self, link: HostLink) -> None:
        if link in self.retiring and link.sessions == 0:
            self.retiring.discard(link)
            task = asyncio.get_running_loop().create_task(link.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def stop(self) -> None:
        close_balancer(self.balancer)
        for source in self.sources.values():
            await source.close()
        for link in [*self.hosts.values(), *self.retiring]:
            await link.close()
        await asyncio.gather(*self._closing, return_exceptions=True)
        self.hosts.clear()
        self.retiring.clear()

    # ----- one app connection -----
    async def serve_app(self, hello: local_pb2.AppHello, cred: tuple[int, int, int],
                        reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        budget: ByteBudget | None = None) -> None:
        """Relay one app's session to the host the balancer picks (``AppRelay``). Its frames
        are read within ``socket_limits.max_frame`` and the socket's shared receive
        ``budget``."""
        if self.draining:
            await _refuse(writer, "DRAINING", "rrtod is shutting down")
            return
        link = await self._choose_host()
        if link is None:
            states = ", ".join([*(f"{h.name}={h.state}" for h in self.hosts.values()),
                                *(f"{s.entry.name}: {s.error}" for s in self.sources.values()
                                  if s.error)]) or "none configured"
            await _refuse(writer, "NO_HOST", f"no GPU host is up ({states})")
            return
        sid = f"s{next(self._ids)}"
        record = self.config.record
        recorder = Recorder(hello.app, sid, self.search_factory(),
                            Path(self.config.state_dir) / "sequences",
                            SearchBudget(search_wait=record.search_wait,
                                         hint_budget=record.hint_budget))
        session = AppSession(sid, hello, cred, link, recorder)
        frames = FrameReader(reader, local_pb2.LocalRequest, self.config.socket_limits.max_frame,
                             budget)
        request = ops_pb2.SessionOpen(
            app=hello.app, pid=cred[0], uid=cred[1], robot=self.config.node,
            executor=hello.executor or self.config.intercept.backend, versions=hello.versions,
            part_bytes=link.part_bytes or 0)
        call = link.open_session()
        placement = None
        if self.config.placement == "inference":
            placement = Placement(Lane(link, call, primary=True), lambda: list(self.hosts.values()),
                                  lambda: self.balancer, request)
        shared = (self.config.socket_limits.shared_bytes
                  if hello.shared_uploads and shared_uploads.supported() else 0)
        relay = AppRelay(session, call, frames, writer, self.energy, placement,
                         placer=self.scheduling.session(link), shared_bytes=shared)
        link.sessions += 1
        self.relays[sid] = relay
        try:
            await relay.serve(request)
        finally:
            link.sessions -= 1
            self._close_if_idle(link)
            self.relays.pop(sid, None)
            done = session.describe()
            self.finished["sessions"] += 1
            for key in ("ops_forwarded", "frames_up", "frames_down", "bytes_up", "bytes_down",
                        "inferences", "shared_uploads"):
                self.finished[key] += done[key]
            if self.energy is not None:
                self.energy.close_session(sid)
            relay.log.info("app session closed", ops=session.calls, frames_up=session.frames_up)

    async def _choose_host(self) -> HostLink | None:
        """The balancer's pick. Right after start (or a reload) hosts are still 'connecting':
        an app that arrives then waits for their first answer instead of a spurious NO_HOST."""
        deadline = time.monotonic() + self.config.health.timeout + self.config.health.interval
        while True:
            link = self.balancer.choose(list(self.hosts.values()))
            connecting = any(h.state == "connecting" for h in self.hosts.values())
            if link is not None or not connecting or time.monotonic() > deadline:
                return link
            await asyncio.sleep(0.02)

    async def flush(self, app: str | None) -> int:
        """Drop live sequences (of ``app``, or all): host and shim forget them, recording
        resumes. Returns how many were dropped."""
        dropped = 0
        for relay in list(self.relays.values()):
            if app is None or relay.session.app == app:
                dropped += await relay.flush()
        return dropped

    def describe(self) -> dict[str, Any]:
        return {
            "hosts": [h.describe() for h in self.hosts.values()],
            "host_sources": [s.describe() for s in self.sources.values()],
            "sessions": [s.describe() for s in self.sessions.values()],
            "finished": dict(self.finished),
            "scheduling": self.scheduling.describe(),
        }


async def _refuse(writer: asyncio.StreamWriter, code: str, message: str) -> None:
    """An app that gets no session is told why."""
    writer.write(encode(error_reply(code, message)))
    await writer.drain()
