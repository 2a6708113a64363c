"""Helpers the tests share: an in-process gRPC server on a loopback port, a server process on a
free loopback port and waiting for its gRPC health, polling until something holds, the messages on
a stream, and a servicer context for direct calls."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.bus import DATA_FIELD, Bus
from services.common.grpc_client import channel
from services.common.redis_server import free_port

T = TypeVar("T")
M = TypeVar("M", bound=Message)
ROOT = Path(__file__).resolve().parent.parent
SERVING_DEADLINE_S = 20.0
"""How long a server process started by a test may take to report SERVING."""


async def serve(register: Callable[[grpc.aio.Server], object], port: int = 0) -> tuple[grpc.aio.Server, str]:
    """A started gRPC server holding what ``register`` adds, on 127.0.0.1:``port`` (0: a free
    port), and its address."""
    server = grpc.aio.server()
    register(server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{bound}"


def start_server_process(command: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """``command --host 127.0.0.1 --port N`` started in the repository root, N a free port, its
    stdout and stderr together in one pipe; the process and its address."""
    port = free_port()
    proc = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, f"127.0.0.1:{port}"


async def wait_serving(
    address: str,
    service: str,
    proc: subprocess.Popen[str] | None = None,
    timeout_s: float = SERVING_DEADLINE_S,
) -> None:
    """Poll the gRPC health of ``service`` at ``address`` until it is SERVING; the test fails after
    ``timeout_s``, or at once with the process's output when ``proc`` ends first."""
    request = health_pb2.HealthCheckRequest(service=service)
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with channel(address) as client:
        stub = health_pb2_grpc.HealthStub(client)
        while True:
            if proc is not None and proc.poll() is not None:
                output = proc.stdout.read() if proc.stdout is not None else ""
                raise AssertionError(f"{proc.args} exited with {proc.returncode} before serving:\n{output}")
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                what = service or "the server"
                raise AssertionError(f"{address} did not report {what} SERVING within {timeout_s}s")
            try:
                reply = await stub.Check(request, timeout=min(1.0, left))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
            await asyncio.sleep(0.05)


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


def assert_trained_as_one_process(one: dict, many: dict, world: int) -> None:
    """The reports of tests/integration/distributed_policy.py run by one process (``one``) and by
    ``world`` data-parallel ranks (``many``): the same samples, losses and gradients."""
    assert (one["world"], many["world"]) == (1, world)
    assert many["tokens"] == one["tokens"]  # the ranks split the batch: no sample ran twice
    assert many["losses"] == pytest.approx(one["losses"], abs=1e-6)
    assert one["losses"][0] != pytest.approx(one["losses"][1], abs=1e-4)  # the weights moved
    assert many["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
