"""The ``grpc`` transport: a direct gRPC channel (TLS, mutual TLS or plaintext) to a GPU daemon."""

from __future__ import annotations

from typing import Any

import grpc
import structlog

from rrtod.config import TLSConfig, is_unix
from rrtod.grpc_options import CHANNEL_OPTIONS
from rrtod.hookspecs import PluginRecord, TransportFactory, hookimpl
from rrtod.tls import channel_credentials

log = structlog.get_logger("rrtod.transport")


def open_channel(address: str, tls: TLSConfig, options: dict[str, Any] | None = None) -> grpc.aio.Channel:
    """``rrtod.hookspecs.TransportFactory``: an asyncio channel to ``address``;
    ``tls.server_name`` overrides the name checked in the host's certificate (hosts addressed by
    IP). A ``unix:`` address is a GPU daemon on this machine: no TLS, the socket's file mode
    decides who may connect."""
    opts = list(CHANNEL_OPTIONS) + list((options or {}).items())
    if is_unix(address):
        return grpc.aio.insecure_channel(address, options=opts)
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    creds = channel_credentials(tls)
    if creds is None:
        log.warning("peer link to this host is plaintext and unauthenticated (tls.mode: "
                    "insecure)", address=address)
        return grpc.aio.insecure_channel(address, options=opts)
    return grpc.aio.secure_channel(address, creds, options=opts)


@hookimpl
def rrto_transports() -> list[PluginRecord[TransportFactory]]:
    return [PluginRecord("grpc", open_channel, "direct gRPC channel, TLS/mTLS or plaintext")]
