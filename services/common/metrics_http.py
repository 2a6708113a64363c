"""``/metrics`` over HTTP for a service that has no web server of its own (engines, the controller).

The api serves its metrics through FastAPI; every other process uses ``serving_metrics``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server

from services.common.settings import ServiceSettings

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
"""Histogram buckets of every latency in seconds, from a health check (a millisecond) to a long
generation or step (ten minutes): one set, so that panels of different services line up."""

_CLOSE_TIMEOUT_S = 5.0
"""How long closing waits for the server's thread."""


class MetricsServer:
    """``/metrics`` of one registry over HTTP, on prometheus_client's daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port = int(self._httpd.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(_CLOSE_TIMEOUT_S)


@contextlib.contextmanager
def serving_metrics(
    registry: CollectorRegistry, host: str, port: int, enabled: bool, *, setting: str = "metrics port"
) -> Iterator[MetricsServer | None]:
    """Serve ``metrics`` on host:port (0: a free port) while the block runs; None when disabled.

    A port in use raises OSError at once: the service does not start with its metrics missing.
    """
    if not enabled:
        log.info("metrics disabled")
        yield None
        return
    try:
        server = MetricsServer(registry, host, port)
    except OSError as err:  # say which setting to change, not just "address already in use"
        raise OSError(err.errno, f"cannot serve metrics on {host}:{port} ({setting}): {err}") from None
    log.info("metrics at %s", server.url)
    try:
        yield server
    finally:
        server.close()


def serving_service_metrics(
    registry: CollectorRegistry, settings: ServiceSettings
) -> contextlib.AbstractContextManager[MetricsServer | None]:
    """``serving_metrics`` on a service's own ``host``, ``metrics_port`` and ``metrics_enabled`` (on
    when the settings have no such field), errors naming the service's metrics port variable."""
    return serving_metrics(
        registry,
        settings.host,
        settings.metrics_port,  # type: ignore[attr-defined]
        getattr(settings, "metrics_enabled", True),
        setting=type(settings).env_name("metrics_port"),
    )
