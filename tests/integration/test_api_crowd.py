"""A crowd: 200 queued jobs (no trainer, so no checkpoint v0 ever comes), submitted with httpx to a
real api process (uvicorn, with its controller) over real Redis. The queued jobs hold no driver and
no connection; then a read load (job lists, single jobs, /metrics, /healthz; http_load.py), paced
at up to TARGET_RATE requests/s, is answered without a single 5xx. The rate reached is printed: it
depends on the machine, so it is reported, not asserted."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.integration.api_process import ApiProcess, serving
from tests.integration.http_load import LoadResult, paced_gets

JOBS = 200
TARGET_RATE = 1000.0
"""Requests per second the load is paced at (at most)."""
SUSTAINED_S = 20.0
"""Longer than every clock of the api that a sustained load runs through: its health checks (1 s),
/metrics refreshes (1 s), controller polls (0.5 s), request timeout (5 s) and its Redis clients'
15 s health-check interval; the Redis clients are sampled 20 times."""
LOAD_CONNECTIONS = 32
REQUEST_CONNECTIONS = 16
"""The api's request pool in these tests (VERST_API_REQUEST_CONNECTIONS)."""
SPARE_CONNECTIONS = 4
"""Redis connections allowed beside that pool: the controller's poll, the test's own client."""
TOKEN = "crowd-token-0123456789"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
SPEC = {"name": "crowd", "trainer": {"steps": 3}}


@pytest.fixture
def api(python: str, python_env: dict[str, str], redis_url: str) -> Iterator[ApiProcess]:
    env = {**python_env, "VERST_LOG_LEVEL": "WARNING"}  # a log line per request would be the load
    with serving(
        python,
        env,
        redis_url,
        TOKEN=TOKEN,
        CHECK_SPECS="false",
        QUEUE_TIMEOUT_S="86400",
        REQUEST_CONNECTIONS=str(REQUEST_CONNECTIONS),
    ) as process:
        yield process


def redis_clients(redis_url: str) -> int:
    """How many clients the Redis server has now (this call's own among them)."""
    with redis.Redis.from_url(redis_url) as client:
        return len(client.client_list())


async def submit_crowd(client: httpx.AsyncClient) -> list[str]:
    async def submit_some(count: int) -> list[str]:
        ids = []
        for _ in range(count):
            reply = await client.post("/v1/jobs", json=SPEC, headers=HEADERS)
            assert reply.status_code == 201, reply.text
            ids.append(reply.json()["job_id"])
        return ids

    batches = await asyncio.gather(*(submit_some(JOBS // 8) for _ in range(8)))
    return [job_id for batch in batches for job_id in batch]


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drivers(metrics_text: str) -> float:
    match = re.search(r"^verst_controller_drivers (\S+)$", metrics_text, re.MULTILINE)
    assert match, "no verst_controller_drivers gauge"
    return float(match.group(1))


async def read_load(
    api: ApiProcess, ids: list[str], duration_s: float, redis_url: str
) -> tuple[LoadResult, int]:
    """The paced reads, and the most clients the Redis server had meanwhile (sampled every second)."""
    paths = itertools.cycle(["/v1/jobs", "/v1/jobs/{id}", "/metrics", "/healthz"])
    rng = random.Random(15)
    done = asyncio.Event()

    async def sample_clients() -> int:
        most = 0
        while not done.is_set():
            most = max(most, await asyncio.to_thread(redis_clients, redis_url))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 1.0)
        return most

    sampler = asyncio.create_task(sample_clients())
    result = await paced_gets(
        api.port,
        lambda: next(paths).format(id=rng.choice(ids)),
        duration_s=duration_s,
        rate=TARGET_RATE,
        connections=LOAD_CONNECTIONS,
        headers=HEADERS,
    )
    done.set()
    return result, await sampler


async def crowd_under_load(api: ApiProcess, redis_url: str, duration_s: float) -> None:
    async with httpx.AsyncClient(base_url=api.url, timeout=30.0) as client:
        ids = await submit_crowd(client)
        await asyncio.sleep(1.5)  # three polls of the controller
        listed = (await client.get("/v1/jobs", params={"limit": 1000}, headers=HEADERS)).json()["jobs"]
        assert len(listed) == JOBS and {job["state"] for job in listed} == {"JOB_STATE_QUEUED"}
        assert drivers((await client.get("/metrics")).text) == 0, "a queued job got a driver"
        idle = redis_clients(redis_url)
        assert idle <= REQUEST_CONNECTIONS + SPARE_CONNECTIONS, (
            f"{idle} Redis clients with {JOBS} queued jobs"
        )

        cpu_before, load_before = cpu_seconds(api.proc.pid), time.process_time()
        result, clients = await read_load(api, ids, duration_s, redis_url)
        api_cpu = (cpu_seconds(api.proc.pid) - cpu_before) / result.elapsed_s
        load_cpu = (time.process_time() - load_before) / result.elapsed_s

        codes, errors = dict(result.codes), dict(result.errors)
        print(
            f"\n{JOBS} queued jobs, {duration_s:.0f}s of reads paced at {TARGET_RATE:.0f}/s over"
            f" {LOAD_CONNECTIONS} connections: {result.rate:.0f} requests/s reached; codes {codes};"
            f" no reply {errors}; at most {clients} Redis clients; CPU seconds per second: the api"
            f" {api_cpu:.2f}, the load {load_cpu:.2f} ({os.cpu_count()} cores)"
        )
        assert not [code for code in codes if code >= 500], f"5xx answers: {codes}"
        assert set(codes) == {200} and not errors, f"codes {codes}, no reply {errors}"
        assert clients <= REQUEST_CONNECTIONS + SPARE_CONNECTIONS, f"{clients} Redis clients under load"
        assert drivers((await client.get("/metrics")).text) == 0
        health = await client.get("/healthz")
        assert (health.status_code, health.json()["status"]) == (200, "ok")


async def test_a_crowd_of_queued_jobs_holds_no_connections_and_reads_never_5xx(
    api: ApiProcess, redis_url: str
) -> None:
    await crowd_under_load(api, redis_url, duration_s=3.0)


@pytest.mark.slow
async def test_a_crowd_of_queued_jobs_under_sustained_reads(api: ApiProcess, redis_url: str) -> None:
    await crowd_under_load(api, redis_url, duration_s=SUSTAINED_S)
