"""The job controller through a Redis outage (a real redis-server SIGKILLed and started again with
its append-only file): within VERST_REDIS_OUTAGE_S the job keeps its state and carries on where it
stood, although the outage lasted longer than its stall timeout; beyond it the job fails, saying why."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.common.bus import Bus, connect
from services.common.jobs import FAILED, RUNNING, SUCCEEDED
from services.common.pb import common_pb2
from services.common.redis_server import EmbeddedRedis
from tests.integration.test_controller import Controllers, Services, submit
from tests.integration.test_controller import services as services  # a fixture


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path / "redis", appendfsync="always") as started:  # SIGKILLed
        yield started


@pytest.fixture
async def outage_controllers(server: EmbeddedRedis, services: Services) -> AsyncIterator[Controllers]:
    controllers = Controllers(Bus(connect(server.url, outage_s=2.0)), services)
    yield controllers
    for stop, task in controllers.running.values():
        stop.set()
        await asyncio.wait_for(task, 30)
    await controllers.bus.close()


async def test_a_job_keeps_its_state_through_an_outage_longer_than_its_stall_timeout(
    server: EmbeddedRedis, tokenizer_dir: Path, services: Services, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services.common.outage")
    bus = Bus(connect(server.url, outage_s=60.0))
    controllers = Controllers(bus, services)
    _, trainer = await submit(bus, tokenizer_dir, services[0], eval={"at_start": False})
    await controllers.start(stall_timeout_s=2.0, stall_startup_s=2.0)
    await trainer.publish_version(0)
    await trainer.wait_for_prompts(4)
    server.kill()
    await asyncio.sleep(4.0)
    await asyncio.to_thread(server.start)
    await asyncio.sleep(1.0)
    assert await trainer.state() == RUNNING
    services[0].version = 1
    await trainer.publish_version(1)
    prompts = await trainer.wait_for_prompts(6)
    assert [p.prompt_id.split(":", 1)[1] for p in prompts] == ["0:0", "0:1", "1:0", "1:1", "2:0", "2:1"]
    await trainer.report(common_pb2.JOB_STATE_SUCCEEDED, 1)
    await trainer.wait_for_state(SUCCEEDED)
    for stop, task in controllers.running.values():
        stop.set()
        await asyncio.wait_for(task, 30)
    await bus.close()
    outage = [r for r in caplog.records if r.name == "services.common.outage"]
    assert [r.levelname for r in outage] == ["WARNING", "INFO"], [r.getMessage() for r in outage]


async def test_an_outage_beyond_the_bound_fails_the_job_with_that_reason(
    server: EmbeddedRedis, tokenizer_dir: Path, services: Services, outage_controllers: Controllers
) -> None:
    _, trainer = await submit(outage_controllers.bus, tokenizer_dir, services[0], eval={"at_start": False})
    await outage_controllers.start()
    await trainer.publish_version(0)
    await trainer.wait_for_prompts(4)
    server.kill()
    await asyncio.sleep(5.0)
    await asyncio.to_thread(server.start)
    await trainer.wait_for_state(FAILED, timeout_s=15.0)
    record = await trainer.store.get(trainer.job_id)
    assert "Redis unreachable for more than 2 s" in record.reason, record.reason
