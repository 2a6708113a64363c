"""How far behind its streams a consumer group is, read from Redis at each scrape.

Redis 6.2's XINFO GROUPS has no ``lag`` field (7.0 added it), so a group's lag is given as
what 6.2 can tell: its pending entries (delivered, not acked) and the age, in seconds, between
the newest entry of the stream and the newest one the group was delivered (stream ids begin
with their millisecond timestamp). The collector runs on the metrics server's thread: it asks
Redis with a client of its own, synchronous and with a short timeout, never the service's asyncio
client; the streams to report are those the service's loop ``watch``es.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import redis
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.redis_client import RedisTarget, sync_client

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 1.0
"""Longest a scrape waits for Redis; a slow Redis leaves the lag series out, not the page."""
PENDING = "verst_bus_pending"
LAG_SECONDS = "verst_bus_lag_seconds"
HELP = {
    PENDING: "Entries of the stream delivered to the consumer group and not acked yet.",
    LAG_SECONDS: "Age of the stream's newest entry minus that of the newest one delivered to the group "
    "(0: caught up).",
}


def id_ms(entry_id: str | bytes) -> int:
    """The millisecond timestamp that begins a stream entry id ("1700000000000-3" -> 1700000000000)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.partition("-")[0])


def lag_seconds(
    last_generated: str | bytes, last_delivered: str | bytes, first_entry: str | bytes | None
) -> float:
    """Seconds between the stream's newest entry and the group's newest delivered one; a group
    delivered nothing yet counts from the stream's first entry, which it has not seen."""
    newest = id_ms(last_generated)
    delivered = id_ms(last_delivered)
    if delivered == 0:
        if first_entry is None:  # nothing in the stream to deliver
            return 0.0
        delivered = id_ms(first_entry) - 1  # its first undelivered entry is at least a ms old
    return max(0.0, (newest - delivered) / 1000)


class BusLagCollector(Collector):
    """``verst_bus_pending`` and ``verst_bus_lag_seconds`` {stream, group} of the watched streams."""

    def __init__(self, redis_url: str | RedisTarget) -> None:
        self._client = sync_client(redis_url, socket_timeout_s=SCRAPE_TIMEOUT_S)
        self._watched: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._failing = False

    def watch(self, stream: str, group: str) -> None:
        """Report ``group``'s lag on ``stream`` from now on (called by the service's loop)."""
        with self._lock:
            self._watched.add((stream, group))

    def unwatch(self, stream: str, group: str) -> None:
        with self._lock:
            self._watched.discard((stream, group))

    def watched(self) -> list[tuple[str, str]]:
        with self._lock:
            return sorted(self._watched)

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(name, text, labels=["stream", "group"]) for name, text in HELP.items()]

    def collect(self) -> Iterable[Metric]:
        pending = GaugeMetricFamily(PENDING, HELP[PENDING], labels=["stream", "group"])
        lag = GaugeMetricFamily(LAG_SECONDS, HELP[LAG_SECONDS], labels=["stream", "group"])
        for stream, group in self.watched():
            try:
                read = self._read(stream, group)
            except redis.RedisError as err:  # Redis down or slow: this scrape goes without
                if not self._failing:
                    log.warning("bus lag: cannot read %s: %s", stream, err)
                self._failing = True
                break
            self._failing = False
            if read is not None:
                pending.add_metric([stream, group], read[0])
                lag.add_metric([stream, group], read[1])
        return [pending, lag]

    def _read(self, stream: str, group: str) -> tuple[int, float] | None:
        """(pending, lag seconds) of ``group`` on ``stream``; None while either does not exist."""
        try:
            info = self._client.xinfo_stream(stream)
            groups = self._client.xinfo_groups(stream)
        except redis.ResponseError:  # no such stream (yet)
            return None
        for entry in groups:
            name = entry["name"]
            if (name.decode() if isinstance(name, bytes) else name) == group:
                first = info.get("first-entry")
                first_id = first[0] if first else None
                seconds = lag_seconds(info["last-generated-id"], entry["last-delivered-id"], first_id)
                return int(entry["pending"]), seconds
        return None

    def close(self) -> None:
        self._client.close()
