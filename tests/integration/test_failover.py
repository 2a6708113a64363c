"""Fail-over in seconds, with the default lease settings (5 s reclaim bounds, renewals every
second): a trainer process SIGKILLed mid-job is replaced by an idle one, whose next step comes
within 10 s of the kill; a runner process SIGKILLed with a prompt in flight has it taken over by
another runner within 10 s. Real processes, a real Redis; the figures are printed (pytest -s)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.bus import Bus
from services.common.healthcheck import wait_until
from services.common.jobs import JobStore
from services.common.pb import common_pb2, rollout_pb2, router_pb2_grpc
from services.common.redis_server import free_port
from services.common.streams import JOBS, JobStreams
from services.runner.server import GROUP as RUNNERS
from services.trainer.config import TrainerSettings
from services.trainer.job import JOB_GROUP, TRAJECTORY_GROUP, JobRun
from services.trainer.worker import TrainerWorker
from tests.helpers import eventually, serve
from tests.integration.fake_services import FakeReward, FakeRouter, running_job, trajectories
from tests.integration.test_trainer_resume import group, model_dir, submit  # noqa: F401  (fixture)

TAKEOVER_S = 10.0
"""The bound of issue 15: a crashed trainer's or runner's work is taken over within it."""
START_S = 120.0
"""Time for a process to import torch and start, on a loaded test machine."""


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes the test starts; killed at its end, and their output shown if it failed."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        output, _ = process.communicate(timeout=30)
        print(f"--- pid {process.pid} ---\n{output[-3000:]}")


async def holder(bus: Bus, stream: str, group: str, candidates: list[subprocess.Popen[str]]) -> Any:
    """The process whose consumer holds the stream's pending entry (names end in ``-<pid>``)."""

    async def find() -> subprocess.Popen[str] | None:
        rows = await bus.redis.xpending_range(stream, group, "-", "+", 10)
        owners = {row["consumer"].decode() for row in rows}
        return next((p for p in candidates if any(o.endswith(f"-{p.pid}") for o in owners)), None)

    return await eventually(find, f"the process holding {stream}", timeout_s=START_S)


async def newest(bus: Bus, job_id: str) -> common_pb2.CheckpointHandle | None:
    return await bus.latest(JobStreams(job_id).checkpoints, common_pb2.CheckpointHandle)


async def test_a_killed_trainers_next_step_comes_from_its_successor_within_10s(
    bus: Bus,
    redis_url: str,
    model_dir: Path,  # noqa: F811  (fixture)
    tmp_path: Path,
    python_env: dict[str, str],
    processes: list[subprocess.Popen[str]],
) -> None:
    job_id, streams = "failover-0001", JobStreams("failover-0001")
    env = python_env | {"REDIS_URL": redis_url, "VERST_TRAINER_TORCH_THREADS": "1"}
    await start(processes, "trainer", env, count=2)
    await submit(bus, job_id, model_dir, tmp_path / "runs", steps=3, checkpoint_every_steps=1)
    await eventually(lambda: newest(bus, job_id), "v0", timeout_s=START_S)
    victim = await holder(bus, JOBS, JOB_GROUP, processes)
    await bus.publish_many(streams.trajectories, group(job_id, "g0", 0) + group(job_id, "g1", 0))
    await eventually(lambda: _version(bus, job_id, 1), "the durable v1", timeout_s=START_S)
    # Half of step 2 has arrived: the victim holds it, unacked, when it dies.
    await bus.publish_many(streams.trajectories, group(job_id, "g2", 1))
    await asyncio.sleep(0.5)
    victim.kill()
    killed = time.monotonic()
    await bus.publish_many(streams.trajectories, group(job_id, "g3", 1))

    async def successors_v2() -> common_pb2.CheckpointHandle | None:
        handle = await newest(bus, job_id)
        return handle if handle is not None and (handle.epoch, handle.version) == (2, 2) else None

    await eventually(successors_v2, "the successor's v2", timeout_s=60)
    took = time.monotonic() - killed
    print(f"trainer SIGKILL -> the successor's next step (v2): {took:.1f} s")
    assert took < TAKEOVER_S, f"the successor's next step came {took:.1f} s after the kill"
    assert await holder(bus, JOBS, JOB_GROUP, processes) is not victim


async def test_a_killed_runners_prompt_is_taken_over_within_10s(
    bus: Bus,
    redis_url: str,
    tokenizer: Any,
    tokenizer_dir: Path,
    reward: tuple[FakeReward, str],
    python_env: dict[str, str],
    processes: list[subprocess.Popen[str]],
) -> None:
    router = FirstCallHangs(tokenizer)
    server, router_address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s))
    job = await running_job(bus, JobStore(bus.redis), tokenizer, tokenizer_dir)
    env = python_env | {
        "REDIS_URL": redis_url,
        "VERST_RUNNER_ROUTER_ADDRESS": router_address,
        "VERST_RUNNER_REWARD_ADDRESS": reward[1],
    }
    try:
        await start(processes, "runner", env, count=2)
        await bus.publish(job.streams.prompts, job.task(0, "12+34=", "64"))
        await eventually(lambda: _true(router.hanging.is_set()), "the task in flight", timeout_s=30)
        victim = await holder(bus, job.streams.prompts, RUNNERS, processes)
        victim.kill()
        killed = time.monotonic()
        await eventually(lambda: trajectories(bus, job.job_id), "the group's trajectories", timeout_s=60)
        took = time.monotonic() - killed
    finally:
        await server.stop(None)
    print(f"runner SIGKILL -> its prompt's trajectories from another runner: {took:.1f} s")
    assert took < TAKEOVER_S, f"the prompt was taken over {took:.1f} s after the kill"
    assert len(router.requests) == 2 and await job.pending() == 0


async def test_a_long_optimiser_step_does_not_starve_the_renewals(
    bus: Bus,
    model_dir: Path,  # noqa: F811  (fixture)
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step runs in a thread, busy in Python for three reclaim bounds; the event loop still
    renews the job and the trajectories every keepalive_s, so nothing idles near the bound."""
    job_id, streams = "starve-0001", JobStreams("starve-0001")
    busy_s, bound_ms = 3.0, 1000
    plain = JobRun._optimise

    def slow_optimise(run: JobRun, groups: list[Any]) -> Any:
        end = time.monotonic() + busy_s
        while time.monotonic() < end:  # holds the GIL but for the interpreter's switches
            sum(i * i for i in range(1000))
        return plain(run, groups)

    monkeypatch.setattr(JobRun, "_optimise", slow_optimise)
    fast = {"keepalive_s": 0.2, "job_reclaim_idle_ms": bound_ms, "trajectory_reclaim_idle_ms": bound_ms}
    worker = TrainerWorker(bus, TrainerSettings(port=0, poll_block_ms=50, **fast), torch.device("cpu"))
    shutdown = asyncio.Event()
    running = asyncio.create_task(worker.run(shutdown))
    try:
        await submit(bus, job_id, model_dir, tmp_path / "runs", steps=1)
        await eventually(lambda: newest(bus, job_id), "v0", timeout_s=START_S)
        await bus.publish_many(streams.trajectories, group(job_id, "g0", 0) + group(job_id, "g1", 0))
        idle: list[int] = []
        while not await _version(bus, job_id, 1):
            rows = await bus.redis.xpending_range(JOBS, JOB_GROUP, "-", "+", 10)
            rows += await bus.redis.xpending_range(streams.trajectories, TRAJECTORY_GROUP, "-", "+", 10)
            idle += [int(row["time_since_delivered"]) for row in rows]
            await asyncio.sleep(0.05)
    finally:
        shutdown.set()
        await asyncio.wait_for(running, 60)
    assert len(idle) > busy_s / 0.1, "sampled through the step"
    assert max(idle) < bound_ms / 2, f"an entry idled {max(idle)} ms during the step"


class FirstCallHangs(FakeRouter):
    """The first Generate never answers (its runner is killed meanwhile); later ones do."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.hanging = asyncio.Event()

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: Any
    ) -> rollout_pb2.GenerateResponse:
        if not self.hanging.is_set():
            self.requests.append(request)
            self.hanging.set()
            await asyncio.sleep(3600)
        return await super().Generate(request, context)


async def start(
    processes: list[subprocess.Popen[str]], service: str, env: dict[str, str], count: int
) -> None:
    """``count`` processes of ``python -m services.<service>``, once each answers gRPC health."""
    ports = [free_port() for _ in range(count)]
    for port in ports:
        command = [sys.executable, "-m", f"services.{service}"]
        environment = env | {f"VERST_{service.upper()}_PORT": str(port)}
        processes.append(
            subprocess.Popen(
                command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    for port in ports:
        assert await asyncio.to_thread(wait_until, "grpc", f"127.0.0.1:{port}", START_S), f"{service} up"


async def _true(value: bool) -> bool:
    return value


async def _version(bus: Bus, job_id: str, version: int) -> bool:
    handle = await newest(bus, job_id)
    return handle is not None and handle.version >= version
