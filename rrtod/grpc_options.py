"""Channel and server options shared by both ends of the peer link.

Reconnect backoff is capped at 2 s (gRPC's default grows to 120 s) so that a GPU daemon that
comes back is seen within a few seconds; keepalive on the client is never shorter than what the
server permits, or the server would drop the connection (shared/NOTES.md).
"""

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
