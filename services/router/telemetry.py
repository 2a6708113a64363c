"""Prometheus metrics of the router: requests routed per engine, and the engines in its view.

The view's gauges are read from the EnginePool at scrape time, on the metrics server's thread:
``EnginePool.links()`` copies the view in one C-level step (atomic under the GIL) and the
gauges read plain attributes of each link, so the scrape never touches the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.pb import common_pb2
from services.router.pool import EngineLink

VIEW_GAUGES = {
    "verst_router_engines": "Engines in the router's view (alive in the registry, not failed since).",
    "verst_router_engines_routable": "Engines in the view that take new requests (not drained or draining).",
}
ENGINE_GAUGES = {
    "verst_router_engine_in_flight": "Samples in flight through this router, by engine.",
    "verst_router_engine_queued_requests": "Requests waiting at the engine, by its last heartbeat.",
    "verst_router_engine_running_requests": "Requests the engine decodes, by its last heartbeat.",
}


class _ViewCollector(Collector):
    """The VIEW_GAUGES and ENGINE_GAUGES of the pool, at each scrape."""

    def __init__(self, links: Callable[[], list[EngineLink]], drained: Callable[[str], bool]) -> None:
        self.links = links
        self.drained = drained

    def describe(self) -> Iterable[Metric]:
        return [
            *(GaugeMetricFamily(name, text) for name, text in VIEW_GAUGES.items()),
            *(GaugeMetricFamily(name, text, labels=["engine"]) for name, text in ENGINE_GAUGES.items()),
        ]

    def collect(self) -> Iterable[Metric]:
        links = self.links()
        routable = [
            link
            for link in links
            if not self.drained(link.engine_id) and link.info.state != common_pb2.ENGINE_STATE_DRAINING
        ]
        families = [
            GaugeMetricFamily("verst_router_engines", VIEW_GAUGES["verst_router_engines"], value=len(links)),
            GaugeMetricFamily(
                "verst_router_engines_routable",
                VIEW_GAUGES["verst_router_engines_routable"],
                value=len(routable),
            ),
        ]
        per_engine = {
            name: GaugeMetricFamily(name, text, labels=["engine"]) for name, text in ENGINE_GAUGES.items()
        }
        for link in links:
            info = link.info
            per_engine["verst_router_engine_in_flight"].add_metric([link.engine_id], link.outstanding)
            per_engine["verst_router_engine_queued_requests"].add_metric(
                [link.engine_id], info.queued_requests
            )
            per_engine["verst_router_engine_running_requests"].add_metric(
                [link.engine_id], info.running_requests
            )
        return [*families, *per_engine.values()]


class RouterMetrics:
    """The router's series, in a registry of its own (tests run several routers in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.routed = Counter(
            "verst_router_routed",
            "Requests sent to an engine (a retry elsewhere counts again), by engine.",
            ["engine"],
            registry=self.registry,
        )

    def follow(self, links: Callable[[], list[EngineLink]], drained: Callable[[str], bool]) -> None:
        """Report the view that ``links`` returns at each scrape."""
        self.registry.register(_ViewCollector(links, drained))
