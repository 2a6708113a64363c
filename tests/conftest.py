"""Shared fixtures: one real Redis server per test session, a clean database per test."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis

from services.common.bus import Bus
from services.common.redis_server import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    """VERST_TEST_REDIS_URL when set (a server the tests may flush), else an embedded one."""
    url = os.environ.get("VERST_TEST_REDIS_URL")
    if url:
        yield url
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    """The session's server, emptied before the test."""
    client = redis.Redis.from_url(redis_server_url)
    client.flushdb()
    client.close()
    return redis_server_url


@pytest.fixture
async def bus(redis_url: str) -> AsyncIterator[Bus]:
    bus = Bus.from_url(redis_url, max_deliveries=3)
    yield bus
    await bus.close()


@pytest.fixture
def python_env() -> dict[str, str]:
    """Environment for child Python processes of the repo, without a REDIS_URL leak."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERST_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    env["VERST_ENGINE_METRICS_PORT"] = "0"  # engines of parallel test runs must not fight over 9400
    for service in ("ROUTER", "REWARD", "TRAINER", "RUNNER", "CONTROLLER"):  # nor others over theirs
        env[f"VERST_{service}_METRICS_PORT"] = "0"
    return env


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; the default comes back for the other tests."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
