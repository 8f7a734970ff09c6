"""deploy/kubernetes/: the GPU pool's manifests validate against the Kubernetes schemas (the
copies kubernetes-validate ships: no cluster, no network), hang together (names, labels, ports,
paths), carry a configuration the daemon accepts, and their probes work against a real GPU
daemon run with that configuration."""

from __future__ import annotations

import contextlib
import queue
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rrto.v1 import ops_pb2, peer_pb2, peer_pb2_grpc
from rrtod.config import Config, load
from testkit.daemons import ECHO, free_port
from testkit.pki import CA

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
# The oldest Kubernetes the manifests need (grpc probes: 1.27; preStop sleep: 1.30), and the
# newest whose schemas kubernetes-validate has.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
LABELS = {"app.kubernetes.io/name": "rrtod", "app.kubernetes.io/component": "gpu"}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in sorted(K8S.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kind(kind: str) -> dict[str, Any]:
    (doc,) = [d for _, d in _documents() if d["kind"] == kind]
    return doc


def _container() -> dict[str, Any]:
    (container,) = _kind("StatefulSet")["spec"]["template"]["spec"]["containers"]
    return container


def _config(tmp_path: Path) -> Config:
    path = tmp_path / "rrtod.yaml"
    path.write_text(_kind("ConfigMap")["data"]["rrtod.yaml"])
    return load(path).config


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(version: str) -> None:
    documents = _documents()
    kinds = sorted(doc["kind"] for _, doc in documents)
    assert kinds == ["ConfigMap", "Kustomization", "Namespace", "PodDisruptionBudget", "Secret",
                     "Service", "StatefulSet"]
    for name, doc in documents:
        if doc["kind"] == "Kustomization":  # kustomize's own file: no Kubernetes schema
            continue
        try:  # strict: an unknown field (a typo) is an error, as kubectl's server-side check
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name}: {doc['kind']} invalid for Kubernetes {version}: {where}: "
                        f"{exc.message}")


def test_kustomization_applies_everything_but_the_secret_template() -> None:
    kustomization = _kind("Kustomization")
    files = {path.name for path in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files - {"tls-secret.example.yaml"}
    assert kustomization["namespace"] == _kind("Namespace")["metadata"]["name"] == "rrto"
    assert [i["name"] for i in kustomization["images"]] == [_container()["image"]]
    secret = _kind("Secret")
    # A template only: placeholders, no key material.
    assert all("BEGIN" not in v for v in secret["stringData"].values())


def test_the_pool_hangs_together() -> None:
    service, pool = _kind("Service"), _kind("StatefulSet")
    pdb, config_map = _kind("PodDisruptionBudget"), _kind("ConfigMap")
    pod = pool["spec"]["template"]
    # Headless: one record per ready pod, which the robots' dns:/// hosts entry resolves.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["ipFamilyPolicy"] == "SingleStack"
    assert not service["spec"]["publishNotReadyAddresses"]
    assert pool["spec"]["serviceName"] == service["metadata"]["name"]
    for selector in (service["spec"]["selector"], pool["spec"]["selector"]["matchLabels"],
                     pdb["spec"]["selector"]["matchLabels"]):
        assert selector == LABELS and selector.items() <= pod["metadata"]["labels"].items()
    assert pdb["spec"]["maxUnavailable"] == 1
    container = _container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (grpc_port,) = service["spec"]["ports"]
    assert grpc_port["port"] == ports[grpc_port["targetPort"]] == 7730
    # One GPU per pod, through the NVIDIA device plugin.
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
        pod["spec"]["tolerations"])
    # Probes: the kubelet's own gRPC health check, on the plaintext health port.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["health"], probe
    assert container["readinessProbe"]["grpc"]["service"] == "rrto.v1.Peer"
    # Not root, no privileges, nothing writable but the volumes.
    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] != 0
    assert security["seccompProfile"]["type"] == "RuntimeDefault"
    assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert not pod["spec"]["automountServiceAccountToken"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    claims = {c["metadata"]["name"] for c in pool["spec"]["volumeClaimTemplates"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert {m["name"] for m in mounts.values()} == volumes.keys() | claims
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert volumes["tls"]["secret"]["secretName"] == _kind("Secret")["metadata"]["name"]
    assert mounts["/etc/rrto/rrtod.yaml"]["subPath"] in config_map["data"]
    assert container["command"] == ["rrtod", "--config", "/etc/rrto/rrtod.yaml"]
    for path in ("/tmp", "/var/cache/rrto"):
        assert path in mounts and not mounts[path].get("readOnly")
    env = {e["name"]: e["value"] for e in container["env"]}
    assert all(any(env[k].startswith(m) for m in mounts) for k in ("HOME", "XDG_CACHE_HOME"))


def test_the_config_map_is_a_gpu_daemon_config_matching_the_pod(tmp_path: Path) -> None:
    config = _config(tmp_path)
    container, pod = _container(), _kind("StatefulSet")["spec"]["template"]["spec"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert config.roles == ("gpu",)
    assert _port(config.listen) == ports["grpc"]
    assert _port(config.health_listen) == ports["health"]
    assert _port(config.metrics.listen) == ports["metrics"]
    assert config.executor.device == "cuda:0"
    # Certificates: files of the mounted Secret; the state and the sockets on writable volumes.
    assert config.tls.mode == "mtls"
    secret_keys = set(_kind("Secret")["stringData"])
    for path in (config.tls.ca, config.tls.cert, config.tls.key):
        directory, _, name = path.rpartition("/")
        assert mounts[directory]["name"] == "tls" and name in secret_keys, path
    assert mounts[config.state_dir]["name"] == "state"
    assert mounts[str(Path(config.socket).parent)]["name"] == "run"
    # SIGTERM comes after the preStop pause; the daemon then drains for drain_timeout.
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pause + config.drain_timeout
    assert config.access, "an mtls host serves only the identities its access rules admit"


def test_the_probes_work_against_the_daemon_with_this_config(rrtod_daemon, tmp_path):
    """The ConfigMap's configuration, run with this test's sockets, ports and certificates,
    probed as the kubelet does: a plaintext gRPC health check, no certificate."""
    config = yaml.safe_load(_kind("ConfigMap")["data"]["rrtod.yaml"])
    pki = CA(tmp_path / "pki")
    server = pki.server()
    port, health_port = free_port(), free_port()
    for key in ("socket", "state_dir"):
        del config[key]  # the test's own (testkit.daemons.base_config)
    config.update(listen=f"127.0.0.1:{port}", health_listen=f"127.0.0.1:{health_port}",
                  metrics={"listen": None}, drain_timeout=5, intercept=ECHO["intercept"],
                  executor={**config["executor"], **ECHO["executor"], "device": "cpu"},
                  tls={"mode": "mtls", "ca": str(pki.path), "cert": str(server.cert),
                       "key": str(server.key)})
    d = rrtod_daemon("rrto-gpu-0", **config)
    readiness = _container()["readinessProbe"]["grpc"].get("service", "")
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", readiness):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        # That port serves the health service and nothing else.
        with pytest.raises(grpc.RpcError) as err:
            peer_pb2_grpc.PeerStub(channel).Hello(peer_pb2.PeerHello(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # What the kubelet's probe would get on the peer port: no plaintext there.
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    status = d.ctl("status")["gpu"]
    assert status["health_listen"] == f"127.0.0.1:{health_port}" and status["tls"] == "mtls"

    # Draining (SIGTERM, after the preStop pause) with a session running: NOT_SERVING, so the
    # readiness probe fails and the pod leaves the Service's records while the session ends.
    frames: queue.Queue[ops_pb2.SessionUp | None] = queue.Queue()
    peer = grpc.insecure_channel(f"unix:{Path(d.socket).parent / 'peer.sock'}")
    replies = peer_pb2_grpc.PeerStub(peer).Session(iter(frames.get, None), timeout=60)
    frames.put(ops_pb2.SessionUp(open=ops_pb2.SessionOpen(app="probe", executor="echo")))
    assert next(replies).WhichOneof("msg") == "ready"
    d.proc.send_signal(signal.SIGTERM)
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 10
        while (health.Check(health_pb2.HealthCheckRequest(service=readiness), timeout=5).status
               != health_pb2.HealthCheckResponse.NOT_SERVING):
            assert time.monotonic() < deadline, "still SERVING while draining"
            time.sleep(0.05)
    frames.put(ops_pb2.SessionUp(close=ops_pb2.Close()))
    frames.put(None)
    with contextlib.suppress(grpc.RpcError):
        for _ in replies:
            pass
    peer.close()
    assert d.proc.wait(timeout=20) == 0
