"""Issue 10, findings 2 and 3: who may use a GPU daemon, as seen from outside it.

Finding 2: the shipped single-machine setup served the peer link as plaintext TCP on loopback, so
a local user without access to the app socket could open sessions and read every session (the
``Stats`` peer method, since deleted: ``rrtoctl status`` on the host shows them). Finding 3: mTLS
accepted any certificate the CA signed (the GPU host's own server certificate too), took the
robot's name from a message field, and had no per-robot limits.

Real daemons, real sockets, real gRPC with certificates made here (testkit/pki.py); the echo
backend reports what the daemon granted each session (memory quota, extra operators, identity).
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rrto.v1 import local_pb2, ops_pb2, peer_pb2, peer_pb2_grpc
from rrtod import shared_uploads
from rrtod.config import from_mapping
from rrtod.framing import FramedSocket
from rrtod.gpu.access import AccessPolicy
from rrtod.tls import certificate_identity
from testkit.daemons import ECHO, free_port
from testkit.peer import call, open_app
from testkit.pki import CA, Issued

ROBOT_1 = "spiffe://fleet/robot-1"
ROBOT_2 = "spiffe://fleet/robot-2"
ACCESS = {
    ROBOT_1: {"max_sessions": 1, "memory_quota": "1MiB"},
    "spiffe://fleet/robot-*": {"max_sessions": 2, "memory_quota": "2MiB",
                               "allow_extra": ["aten::special_op"]},
}


# --- the unix peer default (finding 2) ---------------------------------------------------------


def _tcp_listeners(pid: int) -> list[str]:
    return [f"{c.laddr.ip}:{c.laddr.port}"
            for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN]


def test_default_daemon_listens_on_no_tcp_port_and_peers_over_its_unix_socket(rrtod_daemon):
    # The shipped default: no `listen`, no `tls` section (the launcher's plaintext TCP removed).
    d = rrtod_daemon(listen=None, tls={}, **ECHO)
    assert _tcp_listeners(d.proc.pid) == []
    peer = Path(d.socket).parent / "peer.sock"
    assert stat.S_ISSOCK(peer.stat().st_mode)
    assert stat.S_IMODE(peer.stat().st_mode) == stat.S_IMODE(os.stat(d.socket).st_mode) == 0o660
    status = d.wait_for(lambda s: s["hosts"] and s["hosts"][0]["state"] == "up", what="host up")
    assert status["hosts"][0]["address"] == f"unix:{peer}"
    assert status["gpu"]["listen"] is None and status["gpu"]["tls"] is None
    # An app session runs end to end over the unix peer link, as the identity "local".
    conn, welcome = open_app(d.socket)
    assert welcome.WhichOneof("msg") == "welcome", welcome
    conn.send(call(1, sync=True))
    assert conn.recv(local_pb2.LocalReply).session.result.seq == 1
    (hs,) = d.ctl("status")["gpu"]["sessions"]
    assert hs["identity"] == "local" and hs["ctx_identity"] == "local"
    conn.close()


def test_an_undecodable_session_message_gets_an_error_status_and_the_daemon_keeps_serving(
        rrtod_daemon):
    """The Session stream's messages are read with their size (``gpu.service.add_peer``): bytes
    that are no SessionUp end that stream with an error status, nothing else."""
    d = rrtod_daemon(listen=None, tls={}, **ECHO)
    peer = Path(d.socket).parent / "peer.sock"
    with grpc.insecure_channel(f"unix:{peer}") as channel:
        session = channel.stream_stream("/rrto.v1.Peer/Session",
                                        request_serializer=lambda raw: raw,
                                        response_deserializer=ops_pb2.SessionDown.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            list(session(iter([b"\xff\xff\xff\xff"]), timeout=20))
        assert refused.value.code() != grpc.StatusCode.OK
    conn, welcome = open_app(d.socket)  # and an app session still runs end to end
    assert welcome.WhichOneof("msg") == "welcome", welcome
    conn.send(call(1, sync=True))
    assert conn.recv(local_pb2.LocalReply).session.result.seq == 1
    conn.close()


@pytest.mark.skipif(not shared_uploads.supported(), reason="no sealable memfd here")
def test_a_shared_upload_outside_its_region_is_refused_and_the_daemon_keeps_serving(
        rrtod_daemon):
    """An app's shared upload region (``rrtod.shared_uploads``) comes sealed at its size, so
    the app cannot make the daemon's reads of it fault, and each ``SharedUpload`` is checked
    against it: a range beyond it, or one on a session given no region, ends that session
    with BAD_FRAME; the daemon never reads outside it and serves the next app."""
    d = rrtod_daemon(listen=None, tls={}, **ECHO)
    meta = ops_pb2.TensorMeta(dtype="uint8", shape=[16]).SerializeToString()
    conn = FramedSocket(d.socket, timeout=10)
    conn.send(local_pb2.LocalRequest(app_hello=local_pb2.AppHello(
        app="test-app", pid=os.getpid(), executor="echo", shared_uploads=True)))
    welcome, fds = conn.recv_with_fds(local_pb2.LocalReply)
    size = welcome.welcome.shared_bytes
    assert size == 64 << 20 and len(fds) == 1, welcome
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fds[0], 4096)
    finally:
        os.close(fds[0])
    conn.send(local_pb2.LocalRequest(shared_upload=local_pb2.SharedUpload(
        seq=1, meta=meta, offset=size - 8, length=16)))
    reply = conn.recv(local_pb2.LocalReply)
    assert reply.error.code == "BAD_FRAME" and "outside" in reply.error.message, reply
    conn.close()
    conn, welcome = open_app(d.socket)  # asked for none: none given
    assert welcome.welcome.shared_bytes == 0, welcome
    conn.send(call(1, sync=True))
    assert conn.recv(local_pb2.LocalReply).session.result.seq == 1
    conn.send(local_pb2.LocalRequest(shared_upload=local_pb2.SharedUpload(
        seq=1, meta=meta, length=16)))
    reply = conn.recv(local_pb2.LocalReply)
    assert reply.error.code == "BAD_FRAME" and "unexpected shared_upload" in reply.error.message
    conn.close()
    conn, welcome = open_app(d.socket)
    conn.send(call(2, sync=True))
    assert conn.recv(local_pb2.LocalReply).session.result.seq == 2
    conn.close()


def test_a_daemon_configured_without_shared_uploads_gives_no_region(rrtod_daemon):
    d = rrtod_daemon(listen=None, tls={}, socket_limits={"shared_upload": 0}, **ECHO)
    conn = FramedSocket(d.socket, timeout=10)
    conn.send(local_pb2.LocalRequest(app_hello=local_pb2.AppHello(
        app="test-app", pid=os.getpid(), executor="echo", shared_uploads=True)))
    welcome, fds = conn.recv_with_fds(local_pb2.LocalReply)
    assert welcome.welcome.shared_bytes == 0 and fds == [], welcome
    conn.send(call(1, sync=True))
    assert conn.recv(local_pb2.LocalReply).session.result.seq == 1
    conn.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a probe as another user")
def test_user_outside_the_group_cannot_reach_the_peer_link(rrtod_daemon):
    """A local user who cannot open the app socket finds no way into the GPU daemon: no TCP
    port to connect to, and the unix peer socket refuses them as the app socket does."""
    d = rrtod_daemon(listen=None, tls={}, **ECHO)
    base = Path(d.socket).parent
    base.chmod(0o755)  # the directory is open: only the sockets' own modes keep the user out
    # As that user: connect to every TCP port the daemon listens on, and to both sockets.
    ports = [int(a.rpartition(":")[2]) for a in _tcp_listeners(d.proc.pid)]
    probe = f"""
import socket
reached = []
for port in {ports!r}:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        reached.append(port)
    except OSError:
        pass
for path in ({str(base / 'peer.sock')!r}, {d.socket!r}):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        reached.append(path)
    except PermissionError:
        pass
print(reached)
"""
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    out = subprocess.run([python, "-c", probe], user=65534, group=65534, cwd="/",
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_plaintext_tcp_warns_naming_the_port(rrtod_daemon):
    port = free_port()
    d = rrtod_daemon("gpu-plain", roles=["gpu"], listen=f"127.0.0.1:{port}",
                     tls={"mode": "insecure"}, **ECHO)
    warning = [json.loads(line) for line in d.logs().splitlines()
               if "plaintext" in line and line.startswith("{")]
    assert warning and warning[0]["level"] == "warning" and warning[0]["port"] == port
    assert f"TCP port {port}" in warning[0]["event"]


# --- certificates and identities (finding 3) ----------------------------------------------------


def test_identity_comes_from_the_certificate(tmp_path):
    ca = CA(tmp_path)
    pem = lambda issued: issued.cert.read_bytes()  # noqa: E731
    assert certificate_identity(pem(ca.robot("robot-1"))).name == ROBOT_1
    dns = ca.issue("d", cn="cn-name", dns=("robot-3.fleet.example",))
    assert certificate_identity(pem(dns)).name == "robot-3.fleet.example"
    assert certificate_identity(pem(ca.issue("c", cn="robot-4"))).name == "robot-4"
    assert certificate_identity(pem(ca.server())).client_auth is False
    assert certificate_identity(pem(ca.issue("n", cn="x", usage=()))).client_auth is False
    assert certificate_identity(pem(ca.robot("robot-1"))).client_auth is True


def test_access_rules_exact_then_first_glob_and_reserved_names():
    policy = AccessPolicy(from_mapping({"access": {**ACCESS, "local": {"max_sessions": 3}}}))
    r1, r2 = policy.grant(ROBOT_1), policy.grant(ROBOT_2)
    assert (r1.rule, r1.max_sessions, r1.memory_quota) == (ROBOT_1, 1, 2**20)
    assert (r2.rule, r2.max_sessions, r2.memory_quota) == ("spiffe://fleet/robot-*", 2, 2 << 20)
    assert r2.allow_extra == ("aten::special_op",)
    assert policy.grant("spiffe://fleet/intruder") is None
    local = policy.grant("local")
    assert local.rule == "local" and local.max_sessions == 3
    anonymous = policy.grant("anonymous")
    assert anonymous.rule is None  # admitted: insecure was written out
    # A glob never makes a certificate identity out of the reserved names.
    glob_all = AccessPolicy(from_mapping({"access": {"*": {"max_sessions": 1}}}))
    assert glob_all.grant("local").max_sessions is None


class Client:
    """A raw gRPC client of the peer service, presenting one certificate."""

    def __init__(self, address: str, ca: Path, who: Issued):
        creds = grpc.ssl_channel_credentials(ca.read_bytes(), who.key.read_bytes(),
                                             who.cert.read_bytes())
        self.channel = grpc.secure_channel(address, creds)
        self.stub = peer_pb2_grpc.PeerStub(self.channel)
        self.streams: list[queue.Queue[ops_pb2.SessionUp | None]] = []
        self.calls: list[object] = []  # a call whose object is collected is cancelled

    def code(self, method: str, request: object) -> grpc.StatusCode:
        try:
            getattr(self.stub, method)(request, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    def open(self, robot: str = "whatever-i-say",
             executor: str = "echo") -> tuple[grpc.StatusCode, str]:
        """Open a session (kept open until ``close``); (status, session id or error)."""
        q: queue.Queue[ops_pb2.SessionUp | None] = queue.Queue()
        q.put(ops_pb2.SessionUp(open=ops_pb2.SessionOpen(app="probe", pid=1, robot=robot,
                                                         executor=executor)))
        self.streams.append(q)

        def frames() -> Iterator[ops_pb2.SessionUp]:
            while (frame := q.get()) is not None:
                yield frame

        replies = self.stub.Session(frames(), timeout=60)
        self.calls.append(replies)
        try:
            first = next(replies)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        return grpc.StatusCode.OK, first.ready.session

    def send(self, frame: ops_pb2.SessionUp) -> ops_pb2.SessionDown:
        """Send a frame on the last opened session and wait for its reply."""
        self.streams[-1].put(frame)
        reply = next(self.calls[-1])
        while reply.WhichOneof("msg") == "batch":
            reply = reply.batch.frames[0]
        return reply

    def close(self) -> None:
        for q in self.streams:
            q.put(None)
        self.channel.close()


@pytest.fixture
def pki(tmp_path: Path) -> CA:
    return CA(tmp_path / "pki")


@pytest.fixture
def mtls_gpu(rrtod_daemon, pki):
    server = pki.server()
    port = free_port()
    d = rrtod_daemon("gpu-mtls", roles=["gpu"], listen=f"127.0.0.1:{port}", access=ACCESS,
                     tls={"mode": "mtls", "ca": str(pki.path), "cert": str(server.cert),
                          "key": str(server.key)}, **ECHO)
    d.port = port
    clients: list[Client] = []

    def client(who: Issued) -> Client:
        c = Client(f"localhost:{port}", pki.path, who)
        clients.append(c)
        return c

    d.client = client
    yield d
    for c in clients:
        c.close()


def test_unadmitted_identity_is_refused_on_every_method_and_logged(mtls_gpu, pki):
    intruder = mtls_gpu.client(pki.issue("intruder", cn="intruder",
                                         uris=("spiffe://other/intruder",)))
    for method, request in (("Hello", peer_pb2.PeerHello()), ("Ping", peer_pb2.PingRequest())):
        assert intruder.code(method, request) == grpc.StatusCode.PERMISSION_DENIED, method
    code, detail = intruder.open()
    assert code == grpc.StatusCode.PERMISSION_DENIED and "spiffe://other/intruder" in detail
    # The standard health service stays open for probes (it tells only SERVING or not).
    health = health_pb2_grpc.HealthStub(intruder.channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service="rrto.v1.Peer"), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    refusals = [json.loads(line) for line in mtls_gpu.logs().splitlines()
                if "peer call refused" in line]
    assert refusals and refusals[0]["identity"] == "spiffe://other/intruder"
    assert refusals[0]["peer"].startswith("ipv4:127.0.0.1:")


def test_server_certificate_used_as_client_is_refused(mtls_gpu, pki):
    # The host's own certificate (serverAuth only): the TLS handshake fails.
    as_client = mtls_gpu.client(pki.server("gpu-2"))
    assert as_client.code("Hello", peer_pb2.PeerHello()) == grpc.StatusCode.UNAVAILABLE
    # A certificate with no extended key usage at all (openssl's default, what the review used)
    # naming an admitted robot: the handshake passes, the daemon refuses it.
    no_usage = mtls_gpu.client(pki.issue("no-eku", cn="robot-1", uris=(ROBOT_1,), usage=()))
    assert no_usage.code("Hello", peer_pb2.PeerHello()) == grpc.StatusCode.UNAUTHENTICATED
    code, detail = no_usage.open()
    assert code == grpc.StatusCode.UNAUTHENTICATED and "clientAuth" in detail


def test_certificate_of_another_ca_is_refused(mtls_gpu, tmp_path):
    other = CA(tmp_path / "other", "other-ca")
    stranger = Client(f"localhost:{mtls_gpu.port}", other.path, other.robot("robot-1"))
    try:
        assert stranger.code("Hello", peer_pb2.PeerHello()) == grpc.StatusCode.UNAVAILABLE
    finally:
        stranger.close()


def test_two_robots_get_the_limits_their_rules_give_them(mtls_gpu, pki):
    r1 = mtls_gpu.client(pki.robot("robot-1"))
    r2 = mtls_gpu.client(pki.robot("robot-2"))
    # robot-1 claims to be robot-2 in SessionOpen: informational only.
    code, sid1 = r1.open(robot=ROBOT_2)
    assert code == grpc.StatusCode.OK
    code, detail = r1.open()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions 1" in detail
    assert [r2.open()[0] for _ in range(3)] == [grpc.StatusCode.OK, grpc.StatusCode.OK,
                                                grpc.StatusCode.RESOURCE_EXHAUSTED]
    every = {s["id"]: s for s in mtls_gpu.ctl("status")["gpu"]["sessions"]}
    assert len(every) == 3
    assert every[sid1]["identity"] == ROBOT_1 and every[sid1]["robot"] == ROBOT_2
    assert every[sid1]["memory_quota"] == 1 << 20 and every[sid1]["allow_extra"] == []
    assert every[sid1]["ctx_identity"] == ROBOT_1
    r2_sessions = [s for s in every.values() if s["identity"] == ROBOT_2]
    assert {s["memory_quota"] for s in r2_sessions} == {2 << 20}
    assert all(s["allow_extra"] == ["aten::special_op"] for s in r2_sessions)
    # A closed session frees its slot.
    r1.streams[0].put(None)
    mtls_gpu.wait_for(lambda s: len(s["gpu"]["sessions"]) == 2, what="session closed")
    assert r1.open()[0] == grpc.StatusCode.OK


def test_robot_daemon_over_mtls_and_plaintext_robot_refused(mtls_gpu, pki, rrtod_daemon):
    robot = pki.robot("robot-1")
    hosts = [{"name": "edge", "address": f"localhost:{mtls_gpu.port}"}]
    good = rrtod_daemon("robot-ok", roles=["robot"], hosts=hosts, **ECHO,
                        tls={"mode": "mtls", "ca": str(pki.path), "cert": str(robot.cert),
                             "key": str(robot.key)})
    good.wait_for(lambda s: s["hosts"][0]["state"] == "up", what="mTLS host up")
    conn, welcome = open_app(good.socket)
    assert welcome.WhichOneof("msg") == "welcome", welcome
    (hs,) = mtls_gpu.ctl("status")["gpu"]["sessions"]
    assert hs["identity"] == ROBOT_1 and hs["robot"] == "robot-ok"
    conn.close()
    plain = rrtod_daemon("robot-plain", roles=["robot"], hosts=hosts, **ECHO,
                         tls={"mode": "insecure"})
    plain.wait_for(lambda s: s["hosts"][0]["last_error"], what="plaintext refused")
    assert plain.ctl("status")["hosts"][0]["state"] != "up"


def test_robot_refuses_a_host_presenting_a_client_certificate(pki):
    """The converse of a server certificate used as a client: a GPU host (or an impostor with a
    robot's certificate) whose certificate lacks serverAuth is refused by the robot's TLS."""
    from plugins.grpc_transport import open_channel
    from rrtod.config import TLSConfig

    impostor = pki.issue("impostor", cn="localhost", dns=("localhost",), usage=("clientAuth",))
    genuine = pki.server("gpu")
    robot = pki.robot("robot-1")
    tls = TLSConfig(mode="mtls", ca=str(pki.path), cert=str(robot.cert), key=str(robot.key))

    async def hello_with(server_cert: Issued) -> grpc.StatusCode:
        server = grpc.aio.server()
        peer_pb2_grpc.add_PeerServicer_to_server(peer_pb2_grpc.PeerServicer(), server)
        creds = grpc.ssl_server_credentials(
            [(server_cert.key.read_bytes(), server_cert.cert.read_bytes())],
            root_certificates=pki.path.read_bytes(), require_client_auth=True)
        port = server.add_secure_port("127.0.0.1:0", creds)
        await server.start()
        try:
            async with open_channel(f"localhost:{port}", tls) as channel:
                await peer_pb2_grpc.PeerStub(channel).Hello(peer_pb2.PeerHello(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            await server.stop(None)
        return grpc.StatusCode.OK

    # The genuine host gets past TLS (the bare servicer answers UNIMPLEMENTED); the impostor not.
    assert asyncio.run(hello_with(genuine)) == grpc.StatusCode.UNIMPLEMENTED
    assert asyncio.run(hello_with(impostor)) == grpc.StatusCode.UNAVAILABLE


def test_memory_quota_of_the_rule_is_enforced_by_the_torch_executor(rrtod_daemon, pki):
    """The same 2 MiB upload: refused for robot-1 (1 MiB rule), executed for robot-2 (4 MiB)."""
    server = pki.server()
    port = free_port()
    rrtod_daemon("gpu-torch", roles=["gpu"], listen=f"127.0.0.1:{port}",
                 access={ROBOT_1: {"memory_quota": "1MiB"}, ROBOT_2: {"memory_quota": "4MiB"}},
                 tls={"mode": "mtls", "ca": str(pki.path), "cert": str(server.cert),
                      "key": str(server.key)})
    n = 512 * 1024  # float32: 2 MiB
    meta = ops_pb2.TensorMeta(dtype="float32", shape=[n], stride=[1], device="cpu")
    upload = ops_pb2.Value(tensor=ops_pb2.TensorRef(
        upload=ops_pb2.TensorData(meta=meta, data=bytes(4 * n))))
    clone = ops_pb2.SessionUp(call=ops_pb2.OpCall(seq=1, op="aten::clone.default", args=[upload],
                                                  out_ids=[1], sync=True, out_meta=[meta]))
    codes = {}
    for name, identity in (("robot-1", ROBOT_1), ("robot-2", ROBOT_2)):
        client = Client(f"localhost:{port}", pki.path, pki.robot(name))
        try:
            assert client.open(executor="torch")[0] == grpc.StatusCode.OK
            reply = client.send(clone)
            codes[identity] = reply.error.code if reply.WhichOneof("msg") == "error" else "OK"
        finally:
            client.close()
    assert codes == {ROBOT_1: "QUOTA_EXCEEDED", ROBOT_2: "OK"}


def test_access_rules_reload_without_restart(mtls_gpu, pki):
    import yaml

    newcomer = mtls_gpu.client(pki.issue("robot-9", cn="robot-9", uris=("spiffe://lab/robot-9",)))
    assert newcomer.code("Hello", peer_pb2.PeerHello()) == grpc.StatusCode.PERMISSION_DENIED
    config = dict(mtls_gpu.config, access={**ACCESS, "spiffe://lab/robot-9": {}})
    mtls_gpu.config_path.write_text(yaml.safe_dump(config))
    assert mtls_gpu.ctl("reload") == {"reloaded": True}
    assert newcomer.code("Hello", peer_pb2.PeerHello()) == grpc.StatusCode.OK
