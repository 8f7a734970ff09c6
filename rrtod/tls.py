"""Peer-link credentials and the identity of whoever is on the other end of a peer call.

Credentials from the ``tls`` config section, for TCP links only (a unix peer socket is guarded by
its file mode): ``mtls``: both sides present certificates signed by ``ca`` and the server requires
a client certificate. ``tls``: the server presents ``cert``/``key``, clients verify it against
``ca``. ``insecure``: plaintext (the daemon warns, naming the port).

Identity: a robot is who its client certificate says, never what a message field says. The
certificate's first URI subjectAltName (``spiffe://fleet/robot-1``), else its first DNS name,
else its subject CN. The certificate must carry the clientAuth extended key usage: a GPU host's
server certificate (serverAuth only) signed by the same CA cannot open sessions. Robots need no
code for the converse: the TLS library checks the purpose of the host's certificate (a
certificate whose extended key usage lacks serverAuth is refused at the handshake).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rrtod.config import ConfigError, TLSConfig

LOCAL = "local"  # a caller on this machine's unix peer socket
ANONYMOUS = "anonymous"  # a TCP caller without a client certificate (tls.mode insecure or tls)
RESERVED = frozenset({LOCAL, ANONYMOUS})


def _read(path: str | None, key: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(path, f"tls.{key}", f"cannot read: {exc.strerror}") from None


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials | None:
    if tls.mode == "insecure":
        return None
    cert, key = _read(tls.cert, "cert"), _read(tls.key, "key")
    if cert is None or key is None:
        raise ConfigError("<config>", "tls.cert", "a gpu daemon needs cert and key for TLS")
    return grpc.ssl_server_credentials(
        [(key, cert)],
        root_certificates=_read(tls.ca, "ca") if tls.mode == "mtls" else None,
        require_client_auth=tls.mode == "mtls",
    )


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials | None:
    if tls.mode == "insecure":
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca, "ca"),
        private_key=_read(tls.key, "key"),
        certificate_chain=_read(tls.cert, "cert"),
    )


@dataclass(frozen=True)
class PeerIdentity:
    """Who called: ``name`` is what access rules match; ``error`` says why a presented
    certificate cannot identify anyone (then the call is refused whatever the rules say)."""

    name: str
    peer: str  # transport address, for logs ("ipv4:10.0.0.7:51234", "unix:")
    error: str | None = None


@dataclass(frozen=True)
class CertificateIdentity:
    name: str | None
    client_auth: bool


@functools.lru_cache(maxsize=256)
def certificate_identity(pem: bytes) -> CertificateIdentity:
    """Identity and clientAuth usage of a PEM certificate (cached: every Ping carries one)."""
    cert = x509.load_pem_x509_certificate(pem)
    name: str | None = None
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = None
    if san is not None:
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
        dns = san.get_values_for_type(x509.DNSName)
        name = (uris or dns or [None])[0]
    if not name:
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        name = str(cns[0].value) if cns else None
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        client_auth = ExtendedKeyUsageOID.CLIENT_AUTH in eku
    except x509.ExtensionNotFound:
        client_auth = False  # no usage written: not told apart from a server certificate
    return CertificateIdentity(name, client_auth)


def peer_identity(context: Any) -> PeerIdentity:
    """The identity of the caller of a gRPC method, from the transport alone.

    A unix-socket caller is ``local`` (the socket's file mode decides who gets that far; gRPC
    does not expose the caller's uid). A TCP caller with a verified client certificate is that
    certificate's identity; without one it is ``anonymous``."""
    peer = context.peer() or ""
    if peer.startswith("unix:"):
        return PeerIdentity(LOCAL, peer)
    auth = context.auth_context() or {}
    pems = auth.get("x509_pem_cert")
    if not pems:
        return PeerIdentity(ANONYMOUS, peer)
    try:
        cert = certificate_identity(bytes(pems[0]))
    except ValueError as exc:
        return PeerIdentity("?", peer, f"unreadable client certificate: {exc}")
    if not cert.name:
        return PeerIdentity("?", peer, "client certificate names no identity (SAN or CN)")
    if cert.name in RESERVED:
        return PeerIdentity(cert.name, peer, f"certificate identity {cert.name!r} is reserved")
    if not cert.client_auth:
        return PeerIdentity(cert.name, peer, "certificate lacks the clientAuth extended key "
                                             "usage (a server certificate cannot open sessions)")
    return PeerIdentity(cert.name, peer)
