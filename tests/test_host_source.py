"""Hosts from a DNS name (``hosts: [{address: dns:///NAME:PORT}]``, rrtod/robot/host_source.py):
one host per address, followed as the name's records change.

The source and the robot role with a resolver given in-process, then a real robot daemon
resolving through the system resolver: it runs in a mount namespace of its own whose
/etc/hosts gives the name three addresses (127.0.0.1-3, three GPU daemons on one port), so
the daemon's own getaddrinfo path is what is tested, with nothing in the daemon for tests.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rrto.v1 import local_pb2
from rrtod.config import HostConfig, TLSConfig, from_mapping
from rrtod.plugins import discover
from rrtod.robot.host_source import DnsSource, HostSource, source_for
from rrtod.robot.role import RobotRole
from testkit.daemons import BIN, ECHO, free_port
from testkit.peer import call, open_app
from testkit.pki import CA

POOL = "rrto-gpu.test"


class FakeDns:
    """Answers for one name, changed by the test; an exception instance is raised instead."""

    def __init__(self, *answer: str):
        self.answer: tuple[str, ...] | Exception = answer
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, name: str, port: int) -> list[str]:
        self.asked.append((name, port))
        if isinstance(self.answer, Exception):
            raise self.answer
        return list(self.answer)


def _entry(**kw: object) -> HostConfig:
    return HostConfig(**{"name": "gpu-pool", "address": f"dns:///{POOL}:7730", **kw})


def test_a_host_per_address_named_after_the_entry() -> None:
    dns = FakeDns("10.0.0.5", "10.0.0.6", "10.0.0.5", "fd00::7")
    source = source_for(_entry(transport="grpc"), dns)
    assert isinstance(source, DnsSource) and source.hosts == ()
    assert asyncio.run(source.refresh()) is True
    assert dns.asked == [(POOL, 7730)]
    assert [(h.name, h.address) for h in source.hosts] == [
        ("gpu-pool/10.0.0.5:7730", "10.0.0.5:7730"),
        ("gpu-pool/10.0.0.6:7730", "10.0.0.6:7730"),
        ("gpu-pool/[fd00::7]:7730", "[fd00::7]:7730"),
    ]
    assert asyncio.run(source.refresh()) is False  # same addresses: no change
    # The links dial addresses: the certificate is checked for the name, unless told otherwise.
    tls = TLSConfig(ca="ca.crt", cert="r.crt", key="r.key")
    assert source.tls(tls).server_name == POOL
    assert source.tls(tls.model_copy(update={"server_name": "x"})).server_name == "x"
    static = source_for(HostConfig(name="edge1", address="edge1.local:7730"), dns)
    assert type(static) is HostSource and static.tls(tls) is tls
    assert [h.name for h in static.hosts] == ["edge1"]


def test_a_failed_resolution_keeps_the_last_addresses() -> None:
    dns = FakeDns("10.0.0.5")
    source = DnsSource(_entry(), dns)

    async def main() -> None:
        assert await source.refresh()
        dns.answer = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        assert await source.refresh() is False
        assert [h.address for h in source.hosts] == ["10.0.0.5:7730"]
        assert "not known" in source.error
        assert source.describe()["error"] == source.error
        dns.answer = ("10.0.0.6",)
        assert await source.refresh() and source.error is None

    asyncio.run(main())


def test_robot_role_follows_the_name_and_retires_hosts_once_idle() -> None:
    dns = FakeDns("10.0.0.5", "10.0.0.6", "10.0.0.7")
    config = from_mapping({
        "roles": ["robot"], "tls": {"mode": "insecure"},
        "health": {"interval": 0.05, "timeout": 0.05},
        "hosts": [{"name": "edge1", "address": "127.0.0.1:9"},
                  {"name": "gpu-pool", "address": f"dns:///{POOL}:7730", "refresh": 0.05}]})

    async def until(predicate, what: str) -> None:
        for _ in range(200):
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"timed out: {what}")

    async def main() -> None:
        role = RobotRole(config, discover(), resolve=dns)
        await role.start()  # the first resolution is in before start returns
        assert list(role.hosts) == ["edge1", "gpu-pool/10.0.0.5:7730", "gpu-pool/10.0.0.6:7730",
                                    "gpu-pool/10.0.0.7:7730"]
        busy = role.hosts["gpu-pool/10.0.0.6:7730"]
        busy.sessions = 1  # an app session runs on it
        dns.answer = ("10.0.0.5", "10.0.0.7", "10.0.0.8")
        await until(lambda: "gpu-pool/10.0.0.8:7730" in role.hosts, "new address connected")
        assert list(role.hosts) == ["edge1", "gpu-pool/10.0.0.5:7730", "gpu-pool/10.0.0.7:7730",
                                    "gpu-pool/10.0.0.8:7730"]
        assert role.retiring == {busy}  # no new sessions, but its session goes on
        assert not busy._task.done()  # still pinging its host
        busy.sessions = 0
        role._close_if_idle(busy)  # what serve_app does when a session ends
        assert not role.retiring
        await until(lambda: busy._task.done(), "idle link closed")
        # A reload that drops the entry retires its hosts; the static one stays.
        await role.reload(config.model_copy(update={"hosts": config.hosts[:1]}))
        assert list(role.hosts) == ["edge1"] and not role.retiring
        assert role.describe()["host_sources"] == [
            {"name": "edge1", "address": "127.0.0.1:9", "hosts": ["edge1"]}]
        await role.stop()

    asyncio.run(main())


# --- a real robot daemon and the system resolver -------------------------------------------


def _private_hosts_file(hosts: Path) -> tuple[str, ...]:
    """A command prefix that runs a program with ``hosts`` as its /etc/hosts (a bind mount in
    a user and mount namespace of its own), or () where this machine cannot."""
    prefix = ("unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
              'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts))
    if shutil.which("unshare") is None:
        return ()
    hosts.write_text(f"127.0.0.1 localhost\n127.0.0.7 {POOL}\n")
    probe = subprocess.run([*prefix, sys.executable, "-c",
                            f"import socket; print(socket.gethostbyname({POOL!r}))"],
                           capture_output=True, text=True, timeout=30)
    return prefix if probe.stdout.strip() == "127.0.0.7" else ()


def _write_hosts(path: Path, *addresses: str) -> None:
    """Rewritten in place: the bind mount follows the file, not the name."""
    with open(path, "r+") as f:
        f.truncate()
        f.write("127.0.0.1 localhost\n" + "".join(f"{a} {POOL}\n" for a in addresses))


def test_robot_daemon_uses_every_address_of_the_name(rrtod_daemon, tmp_path):
    hosts = tmp_path / "hosts"
    prefix = _private_hosts_file(hosts)
    if not prefix:
        pytest.skip("no user and mount namespaces here (unshare): cannot give the daemon an "
                    "/etc/hosts of its own")
    addresses = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
    _write_hosts(hosts, *addresses)
    # The pool as on Kubernetes: mutual TLS, one server certificate for every pod, which names
    # the Service (not the pods' addresses), and each robot admitted by its identity.
    pki = CA(tmp_path / "pki")
    server = pki.issue("pool", cn="pool", dns=(POOL,), usage=("serverAuth",))
    robot_cert = pki.robot("robot-1")
    port = free_port()
    gpus = [rrtod_daemon(f"gpu{i + 1}", roles=["gpu"], listen=f"{address}:{port}", wait=False,
                         tls={"mode": "mtls", "ca": str(pki.path), "cert": str(server.cert),
                              "key": str(server.key)},
                         access={"spiffe://fleet/robot-1": {"max_sessions": 4}},
                         intercept=ECHO["intercept"], executor={"backend": "echo", "device": "cpu"})
            for i, address in enumerate(addresses)]
    for gpu in gpus:  # started together, ready one by one
        gpu.wait_notify("READY=1")
    robot = rrtod_daemon("robot1", roles=["robot"], prefix=prefix, balancer="least-loaded",
                         hosts=[{"name": "gpu-pool", "address": f"dns:///{POOL}:{port}",
                                 "refresh": 0.3}],
                         tls={"mode": "mtls", "ca": str(pki.path), "cert": str(robot_cert.cert),
                              "key": str(robot_cert.key)}, **ECHO)
    names = [f"gpu-pool/{a}:{port}" for a in addresses]
    status = robot.wait_for(lambda s: [h["name"] for h in s["hosts"]] == names
                            and all(h["state"] == "up" for h in s["hosts"]), what="3 hosts up")
    assert [h["address"] for h in status["hosts"]] == [f"{a}:{port}" for a in addresses]
    (source,) = status["host_sources"]
    assert source["hosts"] == names and source["error"] is None
    text = subprocess.run([str(BIN / "rrtoctl"), "--config", str(robot.config_path), "status"],
                          capture_output=True, text=True, timeout=30).stdout
    assert f"gpu-pool: dns:///{POOL}:{port} resolves to 3 host(s)" in text, text

    # Three app sessions: the least-loaded balancer puts one on each host.
    apps = []
    for _ in addresses:
        conn, welcome = open_app(robot.socket)
        assert welcome.WhichOneof("msg") == "welcome", welcome
        apps.append((conn, welcome.welcome.host))
    assert sorted(host for _, host in apps) == names
    for seq, (conn, _) in enumerate(apps, 1):
        conn.send(call(seq, sync=True))
        assert conn.recv(local_pb2.LocalReply).session.result.seq == seq
    status = robot.ctl("status")
    assert sorted(s["host"] for s in status["sessions"]) == names
    assert all(h["sessions"] == 1 for h in status["hosts"])
    for gpu in gpus:  # each GPU daemon runs one, for the robot's certificate identity
        (session,) = gpu.ctl("status")["gpu"]["sessions"]
        assert session["identity"] == "spiffe://fleet/robot-1"

    # The name loses an address: no new session goes there, the one running there goes on.
    _write_hosts(hosts, *addresses[:2])
    robot.wait_for(lambda s: [h["name"] for h in s["hosts"]] == names[:2], what="host dropped")
    on_third = next(conn for conn, host in apps if host == names[2])
    on_third.send(call(10, sync=True))
    assert on_third.recv(local_pb2.LocalReply).session.result.seq == 10
    conn, welcome = open_app(robot.socket)
    assert welcome.welcome.host in names[:2]
    conn.close()
    # ... and it comes back.
    _write_hosts(hosts, *addresses)
    robot.wait_for(lambda s: [h["name"] for h in s["hosts"]] == names
                   and all(h["state"] == "up" for h in s["hosts"]), what="host back")
    for conn, _ in apps:
        conn.close()
    robot.wait_for(lambda s: not s["sessions"], what="sessions closed")
    logs = robot.logs()
    assert "hosts resolved" in logs and f"127.0.0.3:{port}" in logs
