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


class Channels:
    """One channel per address, opened on first use and closed together."""

    def __init__(self) -> None:
        self._open: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        if address not in self._open:
            self._open[address] = channel(address)
        return self._open[address]

    async def close(self) -> None:
        for chan in self._open.values():
            await chan.close()
        self._open.clear()
