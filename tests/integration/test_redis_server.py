"""The embedded Redis: a real server that starts, persists when asked, and never outlives its owner."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import redis

from services.common.redis_server import EmbeddedRedis, redis_url

OWNER = """
import sys, time
from services.common.redis_server import EmbeddedRedis
server = EmbeddedRedis()
server.start()
print(server.process.pid, server.url, flush=True)
time.sleep(120)
"""


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_starts_serves_streams_and_stops() -> None:
    server = EmbeddedRedis()
    url = server.start()
    client = redis.Redis.from_url(url)
    try:
        info = client.info("server")
        assert info["redis_version"].startswith("6.2") or int(info["redis_version"].split(".")[0]) >= 7
        client.xadd("s", {"a": "1"})
        client.xgroup_create("s", "g", id="0")
        assert client.xautoclaim("s", "g", "c", min_idle_time=0)[0] == b"0-0"
        pid = server.process.pid  # type: ignore[union-attr]
    finally:
        client.close()
        server.stop()
    assert wait_gone(pid)
    server.stop()  # idempotent


def test_two_servers_get_different_ports() -> None:
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.url != b.url


def test_persists_across_restarts_with_a_data_dir(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        client.xadd("verst:jobs", {"t": "x"})
        client.close()
    with EmbeddedRedis(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        assert client.xlen("verst:jobs") == 1
        client.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_server_dies_with_its_owner(sig: int, python: str, python_env: dict[str, str]) -> None:
    owner = subprocess.Popen([python, "-c", OWNER], env=python_env, stdout=subprocess.PIPE, text=True)
    try:
        pid_text, url = owner.stdout.readline().split()  # type: ignore[union-attr]
        redis_pid = int(pid_text)
        assert redis.Redis.from_url(url).ping()
        os.kill(owner.pid, sig)
        owner.wait(timeout=10)
        assert wait_gone(redis_pid), "redis-server outlived its owner"
    finally:
        owner.kill()
        owner.wait(timeout=10)


def test_redis_url_prefers_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://example.invalid:6379/3")
    with redis_url() as url:
        assert url == "redis://example.invalid:6379/3"
    monkeypatch.delenv("REDIS_URL")
    with redis_url() as url:
        assert redis.Redis.from_url(url).ping()


def test_fixed_port_in_use_fails_clearly() -> None:
    with EmbeddedRedis() as first:
        taken = EmbeddedRedis(port=first.port, start_timeout_s=5)
        with pytest.raises(RuntimeError, match="failed to start"):
            taken.start()
