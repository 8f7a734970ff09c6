"""Where a robot daemon's GPU hosts come from: each ``hosts`` entry is a source of host links.

An entry whose address is ``HOST:PORT`` or ``unix:/path`` is one host. An entry whose address is
``dns:///NAME:PORT`` is every address NAME resolves to, each a host named ``ENTRY/ADDRESS``
(``gpu-pool/10.0.0.5:7730``): NAME is resolved at start and again every ``refresh`` seconds, so
a GPU pool that grows, shrinks or moves (the headless Service of a Kubernetes StatefulSet, whose
A records are its ready pods) needs no list of hosts on the robots. Resolution is the system's
(``getaddrinfo``: /etc/hosts, DNS, whatever nsswitch.conf names), as for any other host name.
A failed resolution keeps the last addresses (their links' health checks tell whether they
still serve) and is reported in ``rrtoctl status``.

A source only says which hosts there are; ``RobotRole`` connects new ones and retires the ones
that are gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from rrtod.config import DNS_PREFIX, HostConfig, TLSConfig, is_dns

log = structlog.get_logger("rrtod.hosts")

# NAME, PORT -> the addresses (IP literals) NAME resolves to; raises OSError when it does not.
Resolver = Callable[[str, int], Awaitable[list[str]]]
# How long the daemon's start (or a reload) waits for a name's first resolution.
FIRST_RESOLUTION_TIMEOUT = 5.0


async def system_resolver(name: str, port: int) -> list[str]:
    """``getaddrinfo`` in the event loop's thread pool (it blocks), TCP addresses only."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        name, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return [str(info[4][0]) for info in infos]


class HostSource:
    """A hosts entry as a source of hosts: by itself, the one host its address names."""

    error: str | None = None  # why the hosts may be out of date

    def __init__(self, entry: HostConfig):
        self.entry = entry
        self.hosts: tuple[HostConfig, ...] = (entry,)

    async def start(self, on_change: Callable[[], None]) -> None:
        pass

    async def close(self) -> None:
        pass

    def tls(self, tls: TLSConfig) -> TLSConfig:
        return tls

    def describe(self) -> dict[str, Any]:
        return {"name": self.entry.name, "address": self.entry.address,
                "hosts": [h.name for h in self.hosts]}


class DnsSource(HostSource):
    """Every address a name resolves to, followed every ``refresh`` seconds."""

    def __init__(self, entry: HostConfig, resolve: Resolver = system_resolver):
        super().__init__(entry)
        self.hosts = ()
        self.dns_name, _, port = entry.address.removeprefix(DNS_PREFIX).rpartition(":")
        self.port = int(port)
        self.resolve = resolve
        self.resolved_at: float | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, on_change: Callable[[], None]) -> None:
        """Resolve once (at most ``FIRST_RESOLUTION_TIMEOUT`` seconds, so apps that arrive
        right after start find the hosts), then keep following the name."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.refresh(), FIRST_RESOLUTION_TIMEOUT)
        self._task = asyncio.get_running_loop().create_task(self._follow(on_change),
                                                            name=f"dns:{self.entry.name}")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def tls(self, tls: TLSConfig) -> TLSConfig:
        """The links dial addresses, not the name: the hosts' certificate must carry the name
        (the one certificate every pod of a pool shares), unless ``tls.server_name`` says
        another."""
        return tls if tls.server_name else tls.model_copy(update={"server_name": self.dns_name})

    async def refresh(self) -> bool:
        """Resolve the name now; True when the hosts changed."""
        try:
            found = await self.resolve(self.dns_name, self.port)
            if not found:
                raise OSError("no address")
        except (OSError, UnicodeError) as exc:  # gaierror; an IDNA label over 63 characters
            error = str(exc) or type(exc).__name__
            if error != self.error:
                log.warning("cannot resolve hosts, keeping the last addresses", host=self.entry.name,
                            address=self.entry.address, error=error, kept=len(self.hosts))
            self.error = error
            return False
        self.error = None
        self.resolved_at = time.time()
        hosts = tuple(self._host(a) for a in dict.fromkeys(found))
        if {h.name for h in hosts} == {h.name for h in self.hosts}:
            return False
        log.info("hosts resolved", host=self.entry.name, address=self.entry.address,
                 addresses=[h.address for h in hosts])
        self.hosts = hosts
        return True

    def _host(self, ip: str) -> HostConfig:
        """The host at one address. Built, not validated: a configured name has no "/", so
        ENTRY/ADDRESS names only this host (and the address is the resolver's IP literal)."""
        address = f"[{ip}]:{self.port}" if ":" in ip else f"{ip}:{self.port}"
        return HostConfig.model_construct(name=f"{self.entry.name}/{address}", address=address,
                                          transport=self.entry.transport)

    async def _follow(self, on_change: Callable[[], None]) -> None:
        while True:
            await asyncio.sleep(self.entry.refresh)
            if await self.refresh():
                on_change()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "refresh": self.entry.refresh,
                "resolved_at": self.resolved_at, "error": self.error}


def source_for(entry: HostConfig, resolve: Resolver = system_resolver) -> HostSource:
    return DnsSource(entry, resolve) if is_dns(entry.address) else HostSource(entry)
