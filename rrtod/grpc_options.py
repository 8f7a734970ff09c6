"""Channel and server options shared by both ends of the peer link.

Reconnect backoff is capped at 2 s (gRPC's default grows to 120 s) so that a GPU daemon that
comes back is seen within a few seconds; keepalive on the client is never shorter than what the
server permits, or the server would drop the connection.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

# gRPC's EventEngine endpoints (the default since grpcio ~1.6x) hand every received message
# through two more threads than the older polling engine does before the Python side sees it:
# an EventEngine poller wakes an EventEngine worker, which reads the socket and kicks the
# completion-queue thread, which wakes the event loop. With these experiments off, the thread
# that waits on the completion queue reads the socket itself. Each hand-off is a wake-up of an
# idle thread (tens of microseconds, more on a loaded machine), twice per replayed inference and
# per daemon. bench.plumbing, mlp, median of 6 interleaved runs: rrto 1.79 -> 1.65 ms, gRPC
# hops 0.27 -> 0.17 ms up and 0.18 -> 0.14 ms down, robot and GPU daemon CPU -0.1 ms per
# inference. Set GRPC_EXPERIMENTS yourself (even empty) to keep gRPC's defaults.
POLLING_EXPERIMENTS = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"


def prefer_polling_engine(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Ask gRPC for its polling engine unless the operator chose experiments. gRPC reads the
    variable once, when it is imported: returns False (and changes nothing) if that was
    already done in this process."""
    if "grpc" in sys.modules or "GRPC_EXPERIMENTS" in environ:
        return False
    environ["GRPC_EXPERIMENTS"] = POLLING_EXPERIMENTS
    return True


MAX_MESSAGE = 1 << 30
# Session frames that are ready together travel in one message (SessionUpBatch,
# SessionDownBatch) up to this many bytes: each message on the stream costs ~0.1-0.3 ms of
# thread and process handoffs here whatever its size, while batching copies the frames once.
BATCH_BYTES = 256 << 10

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
