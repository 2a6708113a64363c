"""Helpers the tests share: an in-process gRPC server on a loopback port, polling until something
holds, the messages on a stream, and a servicer context for direct calls."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from services.common.bus import DATA_FIELD, Bus

T = TypeVar("T")
M = TypeVar("M", bound=Message)


async def serve(register: Callable[[grpc.aio.Server], object], port: int = 0) -> tuple[grpc.aio.Server, str]:
    """A started gRPC server holding what ``register`` adds, on 127.0.0.1:``port`` (0: a free
    port), and its address."""
    server = grpc.aio.server()
    register(server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{bound}"


async def eventually(probe: Callable[[], Awaitable[T]], what: str = "", timeout_s: float = 10.0) -> T:
    """The first truthy result of ``probe``, polled every 20 ms; the test fails after ``timeout_s``."""
    timer = asyncio.timeout(timeout_s)
    try:
        async with timer:
            while not (value := await probe()):
                await asyncio.sleep(0.02)
    except TimeoutError:
        if not timer.expired():
            raise
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what or probe}") from None
    return value


async def stream_messages(bus: Bus, stream: str, message_type: type[M]) -> list[M]:
    """Every message on ``stream``, oldest first."""
    return [message_type.FromString(fields[DATA_FIELD]) for _, fields in await bus.redis.xrange(stream)]


class Aborted(Exception):
    """What ``FakeContext.abort`` raises: the status a servicer ended a call with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class FakeContext:
    """A ServicerContext for calling a servicer's methods directly (no deadline)."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def time_remaining(self) -> float | None:
        return None


def lineage_trained_ids(job_dir: Path) -> list[str]:
    """Every trajectory id trained into the newest durable checkpoint of a job, from the
    manifests of its chain of durable checkpoints (each names the previous one's version),
    with repeats: an id trained twice into the surviving weights appears twice."""
    from services.trainer.checkpoints import CheckpointStore

    store = CheckpointStore(job_dir.parent, job_dir.name, keep=1)
    saved = {checkpoint.handle.version: checkpoint for checkpoint in store.durable_checkpoints()}
    ids: list[str] = []
    version = max(saved, default=0)
    while version > 0:
        assert version in saved, f"durable checkpoint v{version} of the chain is gone"
        ids.extend(saved[version].consumed)
        version = saved[version].since_version
    return ids


async def metrics_of(bus: Bus, job_id: str) -> dict[int, dict[str, float]]:
    """The trainer's metrics of a job so far, merged per step."""
    from services.common.pb import common_pb2
    from services.common.streams import JobStreams

    found = await stream_messages(bus, JobStreams(job_id).metrics, common_pb2.Metric)
    assert all(m.source == "trainer" and m.policy_version == m.step for m in found)
    merged: dict[int, dict[str, float]] = {}
    for metric in found:
        merged.setdefault(metric.step, {}).update(metric.values)
    return merged


async def step_metrics(bus: Bus, job_id: str, step: int, timeout_s: float = 60.0) -> dict[str, float]:
    """One step's trainer metrics, once published (they follow the step's checkpoint handle)."""

    async def found() -> dict[str, float] | None:
        return (await metrics_of(bus, job_id)).get(step)

    return await eventually(found, f"metrics of step {step} of {job_id}", timeout_s=timeout_s)
