"""gRPC credentials from the ``tls`` config section, for the GPU daemon's server and robot clients.

``mtls``: both sides present certificates signed by ``ca`` and the server requires a client
certificate. ``tls``: the server presents ``cert``/``key``, clients verify it against ``ca``.
``insecure``: plaintext (the daemon warns at start).
"""

from __future__ import annotations

from pathlib import Path

import grpc

from rrtod.config import ConfigError, TLSConfig


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
