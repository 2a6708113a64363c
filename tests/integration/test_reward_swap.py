"""Swapping the reward service: a job whose spec points ``reward.address`` at another server.

The other server is ``examples/reward_server`` (partial credit for addition), started as its
own process. A real runner, on real Redis, runs two jobs at once through a fake router (the
engine answers right for even sample indices, "0" for odd ones): one job with the swapped
address, one without. The swapped job's trajectories carry the partial-credit scores and
components, the other job's carry verst's, and verst's reward service, which runs at the
runner's default address, never sees an item of the swapped job.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.bus import Bus
from services.common.grpc_client import channel
from services.common.jobs import JobStore
from services.common.pb import reward_pb2, reward_pb2_grpc, router_pb2_grpc
from services.runner.config import RunnerSettings
from services.runner.server import Runner
from tests.helpers import ROOT, eventually, serve, start_server_process, wait_serving
from tests.integration.fake_services import CountingReward, FakeRouter, running_job, trajectories
from tests.integration.test_services import stop

SERVICE = "verst.v1.Reward"
PARTIAL_CREDIT = {"digits_right", "length_penalty", "exact"}
"""The components of examples/reward_server's rule."""
BUILTIN = {"correct", "format"}
"""The components of verst's addition verifier."""


@pytest.fixture
def example_server(python: str, python_env: dict[str, str]) -> Iterator[str]:
    proc, address = start_server_process([python, "-m", "examples.reward_server"], python_env)
    yield address
    code, output = stop(proc)
    assert code == 0 and "stopped" in output, output


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    from services.tasks.addition_model import build_char_tokenizer

    build_char_tokenizer().save_pretrained(tmp_path)
    return tmp_path


async def test_a_job_scored_by_the_reward_server_its_spec_names(
    bus: Bus, tokenizer_dir: Path, example_server: str, builtin_reward: tuple[CountingReward, str]
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    builtin, builtin_address = builtin_reward
    await wait_serving(example_server, SERVICE)
    router = FakeRouter(tokenizer)
    router_server, router_address = await serve(
        lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s)
    )
    store = JobStore(bus.redis)
    swapped = await running_job(bus, store, tokenizer, tokenizer_dir, reward={"address": example_server})
    control = await running_job(bus, store, tokenizer, tokenizer_dir)
    for job in (swapped, control):
        await bus.publish(job.streams.prompts, job.task(0, "55+45=", "001"))
        await bus.publish(job.streams.prompts, job.task(1, "47+85=", "231"))

    runner = Runner(
        bus,
        store,
        RunnerSettings(router_address=router_address, reward_address=builtin_address, jobs_refresh_s=0.05),
    )
    stop_runner = asyncio.Event()
    running = asyncio.create_task(runner.run(stop_runner))
    try:

        async def published() -> bool:
            counts = [len(await trajectories(bus, job.job_id)) for job in (swapped, control)]
            return counts == [8, 8]

        await eventually(published, timeout_s=30, what="8 trajectories of each job")
    finally:
        stop_runner.set()
        await asyncio.wait_for(running, 10)
        await router_server.stop(None)

    # Even samples answer right, odd ones answer "0": against "001", one digit right and two short.
    partial = {"001": [1.0, 1 / 3 - 0.2] * 2, "231": [1.0, 0.0] * 2}
    got = sorted(await trajectories(bus, swapped.job_id), key=lambda t: t.id)
    assert all(set(t.reward_components) == PARTIAL_CREDIT and not t.reward_error for t in got)
    assert [t.reward for t in got] == pytest.approx(partial["001"] + partial["231"])
    odd_001 = got[1].reward_components
    assert (odd_001["digits_right"], odd_001["length_penalty"], odd_001["exact"]) == pytest.approx(
        (1 / 3, 0.2, 0.0)
    )

    got = sorted(await trajectories(bus, control.job_id), key=lambda t: t.id)
    assert all(set(t.reward_components) == BUILTIN for t in got)
    assert [t.reward for t in got] == [1.0, 0.0] * 4, "verst's verifier gives no partial credit"
    assert builtin.jobs.count(control.job_id) == 8
    assert swapped.job_id not in builtin.jobs, "verst's reward service never saw the swapped job"


async def test_the_example_runs_as_a_script(python: str, python_env: dict[str, str]) -> None:
    proc, address = start_server_process(
        [python, str(ROOT / "examples" / "reward_server" / "server.py")], python_env
    )
    try:
        await wait_serving(address, SERVICE, proc)
        async with channel(address) as client:
            reply = await reward_pb2_grpc.RewardStub(client).Score(
                reward_pb2.ScoreRequest(response_text="2310", answer="231"), timeout=5
            )
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await health_pb2_grpc.HealthStub(client).Check(
                    health_pb2.HealthCheckRequest(service="verst.v1.Nothing"), timeout=5
                )
    finally:
        code, output = stop(proc)
    assert (reply.reward, reply.components["exact"], reply.info["scorer"]) == (
        pytest.approx(0.9),  # 3 of 3 digits right, one character too many
        0.0,
        "partial_credit",
    )
    assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
    assert code == 0, output
