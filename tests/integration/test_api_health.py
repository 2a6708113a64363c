"""/healthz and Redis errors: an api that cannot reach Redis answers 503 (never 500), says why on
/healthz, and `python -m services.api` exits for its supervisor once that lasted
VERST_API_UNHEALTHY_EXIT_S."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI

from services.api.config import ApiSettings
from services.api.health import EXIT_UNHEALTHY, Health, request_client
from services.api.server import create_app
from services.common.redis_server import EmbeddedRedis, free_port
from tests.integration.api_process import ApiProcess

TOKEN = "health-token-0123456789"


@pytest.fixture
async def unreachable_app() -> AsyncIterator[FastAPI]:
    """An api whose REDIS_URL is a closed port (its controller's retries would only slow the test)."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    settings = ApiSettings.model_validate(
        {"REDIS_URL": url, "controller": False, "check_specs": False, "request_timeout_s": 0.5}
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        yield app


async def test_without_redis_every_endpoint_is_a_503_with_a_reason(unreachable_app: FastAPI) -> None:
    transport = httpx.ASGITransport(app=unreachable_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        health = await client.get("/healthz")
        assert health.status_code == 503
        body = health.json()
        assert body["status"] == "unhealthy" and body["service"] == "api"
        assert [p for p in body["problems"] if p.startswith("redis does not answer: ConnectionError")]
        for method, path in [
            ("GET", "/v1/jobs"),
            ("GET", "/v1/jobs/addition-00000000"),
            ("GET", "/v1/jobs/addition-00000000/metrics"),
            ("POST", "/v1/jobs/addition-00000000/cancel"),
            ("GET", "/metrics"),
        ]:
            reply = await client.request(method, path)
            assert reply.status_code == 503, (path, reply.text)
            assert reply.json()["detail"].startswith("the job store (Redis) is unavailable: ConnectionError")
            assert len(reply.json()["detail"]) < 300 and reply.headers["retry-after"] == "1"
        submitted = await client.post("/v1/jobs", json={"name": "addition"})
        assert submitted.status_code == 503, submitted.text


async def test_health_sees_a_stalled_controller_and_recovers(redis_url: str) -> None:
    settings = ApiSettings.model_validate({"REDIS_URL": redis_url, "controller_stall_s": 1.0})
    client = request_client(redis_url, settings)
    controller = SimpleNamespace(last_poll=time.monotonic())
    health = Health(client, settings, controller)
    try:
        assert await health.check() == [] and health.unhealthy_since is None
        controller.last_poll -= 5.0
        [problem] = await health.check()
        assert problem == "the controller has not finished a poll for 5s" and health.unhealthy_since
        assert health.exit_reason(time.monotonic(), 1.0) == "", "not for longer than the bound yet"
        health.unhealthy_since -= 2.0
        assert health.exit_reason(time.monotonic(), 1.0).startswith("unhealthy for 2s: the controller")
        controller.last_poll = time.monotonic()
        assert await health.check() == [] and health.unhealthy_since is None
        assert health.exit_reason(time.monotonic(), 1.0) == ""
        later = time.monotonic() + settings.request_timeout_s + 3.0
        assert health.current(later)[-1].startswith("no health check has finished for")
    finally:
        await client.aclose()


def test_the_api_process_goes_unhealthy_and_exits_when_redis_goes(
    python: str, python_env: dict[str, str]
) -> None:
    with EmbeddedRedis() as redis_server:
        api = ApiProcess(
            python,
            python_env,
            redis_server.url,
            TOKEN=TOKEN,
            UNHEALTHY_EXIT_S="3",
            REQUEST_TIMEOUT_S="0.5",
            CHECK_SPECS="false",
        )
        try:
            api.wait_until_serving()
            healthy = httpx.get(f"{api.url}/healthz", timeout=5)
            assert (healthy.status_code, healthy.json()) == (200, {"status": "ok", "service": "api"})
            redis_server.stop()
            gone_at = time.monotonic()
            unhealthy = _poll_health(api.url, until=503)
            assert "redis does not answer" in " ".join(unhealthy.json()["problems"])
            code = api.proc.wait(timeout=30)
            took = time.monotonic() - gone_at
        finally:
            code, output = api.stop()
    assert code == EXIT_UNHEALTHY, output
    assert 3.0 < took < 15.0, f"exited {took:.1f}s after Redis went"
    assert "exiting (status 3) for its supervisor" in output
    assert "Traceback" not in output, output


def _poll_health(url: str, until: int, timeout_s: float = 10.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        reply = httpx.get(f"{url}/healthz", timeout=5)
        if reply.status_code == until or time.monotonic() > deadline:
            assert reply.status_code == until, reply.text
            return reply
        time.sleep(0.1)


async def test_a_redis_error_in_a_handler_is_logged_once_per_burst(
    unreachable_app: FastAPI, caplog: pytest.LogCaptureFixture
) -> None:
    transport = httpx.ASGITransport(app=unreachable_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        replies = await asyncio.gather(*(client.get("/v1/jobs") for _ in range(5)))
    assert [reply.status_code for reply in replies] == [503] * 5
    assert len([r for r in caplog.records if "503: redis" in r.getMessage()]) == 1
