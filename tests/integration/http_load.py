"""A paced read load on an HTTP server, over keep-alive HTTP/1.1 connections written by hand.

The load is all GETs of small, Content-Length-framed replies, so a client needs no more than a
request line and a header parser; it costs a small part of what httpx costs per request. On
this 2-core machine httpx was the bottleneck, not the api: 48 connections of one AsyncClient
reached 92 requests/s of /healthz with the api 8% busy, where these connections reach thousands.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

READ_TIMEOUT_S = 30.0


class Connection:
    """One keep-alive HTTP/1.1 connection to 127.0.0.1:``port``."""

    def __init__(self, port: int, headers: dict[str, str]) -> None:
        self.port = port
        self._headers = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def get(self, path: str) -> int:
        """GET ``path``; its status code (its body is read and dropped)."""
        if self._streams is None:
            self._streams = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self._streams
        writer.write(f"GET {path} HTTP/1.1\r\nHost: api\r\n{self._headers}\r\n".encode())
        async with asyncio.timeout(READ_TIMEOUT_S):
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            if "content-length" not in fields:
                raise ValueError(f"a reply without Content-Length: {lines[0]}")
            await reader.readexactly(int(fields["content-length"]))
        return int(lines[0].split(" ", 2)[1])

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


@dataclass
class LoadResult:
    codes: Counter[int] = field(default_factory=Counter)
    """Replies by status code."""
    errors: Counter[str] = field(default_factory=Counter)
    """Requests that got no reply, by exception type."""
    elapsed_s: float = 0.0

    @property
    def rate(self) -> float:
        """Requests per second, answered or not."""
        return (sum(self.codes.values()) + sum(self.errors.values())) / self.elapsed_s


async def paced_gets(
    port: int,
    paths: Iterator[str] | Callable[[], str],
    *,
    duration_s: float,
    rate: float,
    connections: int,
    headers: dict[str, str],
) -> LoadResult:
    """GETs over ``connections`` connections for ``duration_s``, paced at ``rate`` requests/s at
    most (behind the pace, as fast as the server answers); ``paths`` gives each request's path."""
    next_path = paths if callable(paths) else paths.__next__
    slots = itertools.count()
    result = LoadResult()
    start = time.monotonic()
    end = start + duration_s

    async def worker() -> None:
        connection = Connection(port, headers)
        try:
            while (now := time.monotonic()) < end:
                due = start + next(slots) / rate
                if due > now:
                    await asyncio.sleep(due - now)
                try:
                    result.codes[await connection.get(next_path())] += 1
                except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError) as err:
                    result.errors[type(err).__name__] += 1
                    connection.close()  # a fresh connection for the next request
        finally:
            connection.close()

    await asyncio.gather(*(worker() for _ in range(connections)))
    result.elapsed_s = time.monotonic() - start
    return result
