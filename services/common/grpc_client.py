"""gRPC channels with verst's defaults: large messages, keepalive, bounded reconnect backoff."""

from __future__ import annotations

import grpc

from services.common.grpc_options import KEEPALIVE, KeepAlive


def channel(address: str, keepalive: KeepAlive = KEEPALIVE) -> grpc.aio.Channel:
    """An asyncio channel to ``host:port`` that pings as verst's servers allow (grpc_options.py).
    Every call on it must still pass a ``timeout``."""
    return grpc.aio.insecure_channel(address, options=keepalive.client_options())


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
