"""Two local stacks side by side on one host (`verst up --port-base`), and the supervisor of the
first bringing back an engine that was SIGKILLed: registered and serving again within a deadline,
its restart logged and shown by GET /v1/cluster and `verst status`; the second stack untouched."""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from services.cli import main
from services.common.healthcheck import grpc_serving
from services.common.streams import ENGINE_HEARTBEATS
from services.stack import Stack, StackConfig
from services.stack_ports import PortPlanError, port_span
from services.supervisor import RestartPolicy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

QUICK = RestartPolicy(first_delay_s=0.5, max_delay_s=2.0, poll_s=0.2)
"""A quick first restart, so the test waits on the engine's start, not on the backoff."""
BACK_WITHIN_S = 120.0
"""Deadline for the killed engine to serve and heartbeat again (its start imports torch)."""
LOW, HIGH = 20_000, 32_000
"""Bases below the kernel's ephemeral range (32768 up), where free_port's picks land."""


def start_beside(tmp_path: Path, name: str, low: int, **config: Any) -> Stack:
    """A supervised stack at the first free base from a random one at or above ``low``; a base
    with a taken port is refused (PortPlanError) before anything starts, so the next is tried."""
    span = port_span(config.get("engines", 1), config.get("trainers", 1))
    base = random.Random().randrange(low, HIGH - 20 * span)
    for attempt in range(20):
        stack = Stack(StackConfig(log_dir=tmp_path / name, port_base=base + attempt * span, supervise=True,
                                  restart_policy=QUICK, **config))  # fmt: skip
        try:
            stack.start()
            return stack
        except PortPlanError:
            continue
    pytest.fail(f"no free port base for {name} from {base}")


@pytest.fixture
def stacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Stack, Stack]]:
    monkeypatch.delenv("REDIS_URL", raising=False)  # each stack its own embedded Redis
    # No trainer: nothing here trains, and two stacks' processes share the CI's cores.
    first = start_beside(tmp_path, "first", LOW, engines=1, trainers=0)
    try:
        past_first = first.ports["api"] + port_span(1, 0)  # the api is the base's own port
        second = start_beside(tmp_path, "second", past_first, engines=0, trainers=0)
        try:
            yield first, second
        finally:
            second.stop()
    finally:
        first.stop()


def cluster(stack: Stack) -> dict[str, Any]:
    reply = httpx.get(f"{stack.api_url}/v1/cluster", timeout=10)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def heartbeat_of(stack: Stack, engine_id: str) -> float:
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    try:
        return float(client.zscore(ENGINE_HEARTBEATS, engine_id) or 0.0)
    finally:
        client.close()


def wait_back(stack: Stack, killed_at: float) -> dict[str, Any]:
    """Until engine-0 serves gRPC health, has heartbeated since ``killed_at`` and /v1/cluster shows
    its restart as done; that restart row."""
    address = f"{stack.config.host}:{stack.ports['engine-0']}"
    deadline = time.monotonic() + BACK_WITHIN_S
    while time.monotonic() < deadline:
        rows = {row["service"]: row for row in cluster(stack)["services"]}
        row = rows.get("engine-0", {"state": "not restarted"})
        restarted = row["state"] == "running" and heartbeat_of(stack, "engine-0") > killed_at
        if restarted and grpc_serving(address):
            return row
        time.sleep(0.5)
    pytest.fail(f"engine-0 not back within {BACK_WITHIN_S}s:\n{stack.log_tail('engine-0')}")


def test_a_killed_engine_comes_back_beside_a_second_stack(
    stacks: tuple[Stack, Stack],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    first, second = stacks
    assert first.ports["api"] + port_span(1, 0) <= second.ports["api"]
    assert first.redis_url != second.redis_url and first.api_url != second.api_url
    base = first.ports["api"]
    with pytest.raises(PortPlanError, match=rf"^port {base} \(api\) is taken"):
        Stack(StackConfig(log_dir=tmp_path / "third", port_base=base, trainers=0)).start()

    victim = first.running()["engine-0"]
    killed_at = time.time()
    with caplog.at_level(logging.WARNING, logger="services.supervisor"):
        os.kill(victim.pid, signal.SIGKILL)
        row = wait_back(first, killed_at)
    assert first.running()["engine-0"].pid != victim.pid
    assert (row["restarts"], row["last_exit"], row["crash_loop"]) == (1, "signal SIGKILL", False)
    assert "engine-0 ended (signal SIGKILL)" in caplog.text and "restarted engine-0 (pid" in caplog.text
    assert "--- verst: starting engine-0 again (restart 1 after signal SIGKILL) ---" in first.log_tail(
        "engine-0", 400
    )
    [engine] = cluster(first)["engines"]
    assert engine["engine_id"] == "engine-0"

    assert main(["status", "--api", first.api_url]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[-2].split() == ["service", "restarts", "last", "exit", "state"]
    assert shown[-1].split() == ["engine-0", "1", "signal", "SIGKILL", "running"]

    first.restart("router")  # on request, under the stack's lock: no crash for the supervisor
    time.sleep(3 * QUICK.poll_s)
    assert [row["service"] for row in cluster(first)["services"]] == ["engine-0"]

    assert cluster(second)["services"] == [], "the second stack saw no restart"
    assert main(["status", "--api", second.api_url]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1, "the job table's header alone"
    first.check_alive()
    second.check_alive()
