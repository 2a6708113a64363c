"""The bus lag collector (services/common/bus_lag.py) against a real Redis: pending entries and
the age between a stream's newest entry and its group's newest delivered one, read at scrape
time with a client of its own."""

from __future__ import annotations

import redis
from prometheus_client import CollectorRegistry, generate_latest

from services.common.bus_lag import BusLagCollector, lag_seconds
from services.common.redis_server import free_port

STREAM, GROUP = "verst:job:lag:prompts", "runners"


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, str], float]:
    return {
        (s.labels["stream"], s.labels["group"]): s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == name
    }


def test_pending_and_lag_follow_the_group(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    for ms in (1_000, 3_000, 6_000):  # ids whose timestamps are known
        client.xadd(STREAM, {"data": b"x"}, id=f"{ms}-0")
    client.xgroup_create(STREAM, GROUP, id="0")
    collector = BusLagCollector(redis_url)
    registry = CollectorRegistry()
    registry.register(collector)
    assert samples(registry, "verst_bus_pending") == {}, "nothing watched, nothing reported"

    collector.watch(STREAM, GROUP)
    collector.watch("verst:job:lag:missing", GROUP)  # no stream yet: left out, not an error
    assert samples(registry, "verst_bus_pending") == {(STREAM, GROUP): 0}
    assert samples(registry, "verst_bus_lag_seconds") == {(STREAM, GROUP): 5.001}  # none delivered

    client.xreadgroup(GROUP, "c1", {STREAM: ">"}, count=1)
    assert samples(registry, "verst_bus_pending") == {(STREAM, GROUP): 1}
    assert samples(registry, "verst_bus_lag_seconds") == {(STREAM, GROUP): 5.0}

    client.xreadgroup(GROUP, "c1", {STREAM: ">"}, count=2)
    client.xack(STREAM, GROUP, "1000-0")
    assert samples(registry, "verst_bus_pending") == {(STREAM, GROUP): 2}
    assert samples(registry, "verst_bus_lag_seconds") == {(STREAM, GROUP): 0.0}
    assert b'verst_bus_pending{group="runners",stream="verst:job:lag:prompts"} 2.0' in generate_latest(
        registry
    )

    collector.unwatch(STREAM, GROUP)
    assert samples(registry, "verst_bus_lag_seconds") == {}
    collector.close()
    client.close()


def test_another_group_on_the_stream_is_not_confused(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.xadd(STREAM, {"data": b"x"}, id="2000-0")
    client.xgroup_create(STREAM, "others", id="$")
    collector = BusLagCollector(redis_url)
    collector.watch(STREAM, GROUP)  # the stream exists, this group does not
    registry = CollectorRegistry()
    registry.register(collector)
    assert samples(registry, "verst_bus_pending") == {}
    collector.close()
    client.close()


def test_a_scrape_without_redis_leaves_the_series_out() -> None:
    collector = BusLagCollector(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    collector.watch(STREAM, GROUP)
    registry = CollectorRegistry()
    registry.register(collector)
    assert b"verst_bus_lag_seconds" in generate_latest(registry)  # the page renders, help and type
    assert samples(registry, "verst_bus_lag_seconds") == {}
    collector.close()


def test_lag_counts_from_the_first_entry_before_any_delivery() -> None:
    assert lag_seconds("5000-1", "3000-0", "1000-0") == 2.0
    assert lag_seconds("5000-1", "0-0", "1000-0") == 4.001
    assert lag_seconds("0-0", "0-0", None) == 0.0  # an empty stream
    assert lag_seconds(b"3000-0", b"3000-0", b"1000-0") == 0.0
