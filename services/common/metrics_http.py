"""``/metrics`` over HTTP for a service that has no web server of its own (engines, the controller).

The api serves its metrics through FastAPI; every other process uses ``serving_metrics``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)

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
