"""gRPC channels with verst's defaults: large messages, keepalive, bounded reconnect backoff."""

from __future__ import annotations

import grpc

from services.common.grpc_server import MAX_MESSAGE_BYTES

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def channel(address: str) -> grpc.aio.Channel:
    """An asyncio channel to ``host:port``. Every call on it must still pass a ``timeout``."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
