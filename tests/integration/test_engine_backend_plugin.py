"""An engine backend of one's own: ``python -m services.rollout`` with
``VERST_ENGINE_BACKEND=examples.plugins.engine_backend:open_engine`` (transformers' generate()).

A real engine process on a real Redis takes a tiny Llama's checkpoints from the job's stream and
answers Generate over gRPC: tokens, logprobs against an independent full forward pass of the
same weights, the policy version of every token (also across a checkpoint loaded between two
decode steps), stops, seeds, aborts, pauses and the status codes of bad requests. A backend
name that does not resolve stops the process with status 2 and a message naming the setting.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from transformers import LlamaForCausalLM

from services.common.bus import Bus
from services.common.grpc_client import channel
from services.common.pb import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.redis_server import free_port
from tests.helpers import ROOT, eventually, wait_serving
from tests.integration.rollout_helpers import (
    EOS,
    VOCAB,
    generate_request,
    handle_for,
    publish_checkpoint,
    reference_logprobs,
    save_checkpoint,
    start_job,
    tiny_llama,
)
from tests.integration.test_services import stop

BACKEND = "examples.plugins.engine_backend:open_engine"
JOB = "job-plugin-backend"
PROMPTS = [[1, 5, 6, 7, 8, 9, 10], [1, 20, 21], [1, 30, 31, 32, 33]]
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the reference passes here; the engine has its own


@dataclass
class EngineProcess:
    stub: rollout_pb2_grpc.RolloutStub
    model: LlamaForCausalLM
    """The weights of v0, as the test made them."""

    async def status(self) -> common_pb2.EngineInfo:
        return await self.stub.GetStatus(rollout_pb2.GetEngineStatusRequest(), timeout=5)

    async def generate(self, prompt: list[int], **sampling: object) -> rollout_pb2.GenerateResponse:
        return await self.stub.Generate(generate_request(prompt, **sampling), timeout=60)

    async def wait_for_version(self, version: int) -> None:
        async def serving() -> bool:
            return (await self.status()).policy_version == version

        await eventually(serving, what=f"the engine to serve v{version}", timeout_s=60)

    async def wait_running(self) -> None:
        async def running() -> bool:
            return (await self.status()).running_requests == 1

        await eventually(running, what="the request to run")


@pytest.fixture
async def engine(
    bus: Bus, redis_url: str, python: str, python_env: dict[str, str], tmp_path: Path
) -> AsyncIterator[EngineProcess]:
    model = tiny_llama(0)
    await start_job(bus.redis, JOB)
    await publish_checkpoint(bus, JOB, save_checkpoint(model, tmp_path / "v000000"), 0)
    port = free_port()
    env = {
        **python_env,
        "REDIS_URL": redis_url,
        "VERST_ENGINE_BACKEND": BACKEND,
        "VERST_ENGINE_PORT": str(port),
        "VERST_ENGINE_HOST": "127.0.0.1",
        "VERST_ENGINE_ENGINE_ID": "engine-plugin",
        "VERST_ENGINE_DEVICE": "cpu",
        "VERST_ENGINE_TORCH_THREADS": "1",
        "VERST_ENGINE_WEIGHT_POLL_S": "0.05",
        "VERST_ENGINE_HEARTBEAT_S": "0.2",
    }
    proc = subprocess.Popen(
        [python, "-m", "services.rollout"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        await wait_serving(address, "verst.v1.Rollout", proc, timeout_s=60)
        async with channel(address) as client:
            running = EngineProcess(rollout_pb2_grpc.RolloutStub(client), model)
            await running.wait_for_version(0)
            yield running
    finally:
        code, output = stop(proc)
    assert code == 0 and "stopped" in output, output
    assert "transformers generate() on cpu" in output, output


@torch.inference_mode()
def greedy_reference(model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by full forward passes, one token at a time, up to EOS."""
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, -1]
        tokens.append(int(logits.argmax()))
        if tokens[-1] == EOS:
            break
    return tokens


async def test_tokens_logprobs_and_versions(engine: EngineProcess, bus: Bus, tmp_path: Path) -> None:
    info = await engine.status()
    assert (info.backend, info.engine_id, info.job_id) == ("hf_generate", "engine-plugin", JOB)

    sampled = await asyncio.gather(
        *(
            engine.generate(p, temperature=0.8, top_k=20, top_p=0.9, n=3, max_new_tokens=12, seed=i)
            for i, p in enumerate(PROMPTS)
        )
    )
    for prompt, response in zip(PROMPTS, sampled, strict=True):
        assert [c.index for c in response.completions] == [0, 1, 2]
        assert response.engine_id == "engine-plugin"
        for completion in response.completions:
            tokens = list(completion.token_ids)
            assert len(completion.logprobs) == len(tokens) == len(completion.policy_versions) > 0
            assert all(0 <= t < VOCAB for t in tokens)
            expected = reference_logprobs(engine.model, prompt, tokens)
            assert list(completion.logprobs) == pytest.approx(expected, abs=1e-4)
            assert set(completion.policy_versions) == {0}
            if completion.finish_reason == STOP:
                assert tokens[-1] == EOS and EOS not in tokens[:-1]
            else:
                assert completion.finish_reason == LENGTH and len(tokens) == 12 and EOS not in tokens
        assert len({tuple(c.token_ids) for c in response.completions}) == 3  # the n samples differ

    again = await engine.generate(
        PROMPTS[0], temperature=0.8, top_k=20, top_p=0.9, n=3, max_new_tokens=12, seed=0
    )
    assert [list(c.token_ids) for c in again.completions] == [
        list(c.token_ids) for c in sampled[0].completions
    ]

    for prompt in PROMPTS:
        greedy = (await engine.generate(prompt, temperature=0, max_new_tokens=10)).completions[0]
        assert list(greedy.token_ids) == greedy_reference(engine.model, prompt, 10)

    greedy = list(
        (await engine.generate(PROMPTS[1], temperature=0, max_new_tokens=10)).completions[0].token_ids
    )
    stop_token = greedy[3]
    stopped = (
        await engine.generate(PROMPTS[1], temperature=0, max_new_tokens=10, stop_token_ids=[stop_token])
    ).completions[0]
    assert list(stopped.token_ids) == greedy[: greedy.index(stop_token) + 1] and stopped.finish_reason == STOP

    new_model = tiny_llama(1)
    await publish_checkpoint(bus, JOB, save_checkpoint(new_model, tmp_path / "v000001"), 1)
    await engine.wait_for_version(1)
    completion = (await engine.generate(PROMPTS[0], temperature=1.0, seed=5, max_new_tokens=10)).completions[
        0
    ]
    assert set(completion.policy_versions) == {1}
    expected = reference_logprobs(new_model, PROMPTS[0], list(completion.token_ids))
    assert list(completion.logprobs) == pytest.approx(expected, abs=1e-4)


async def test_aborts_pauses_and_weights_between_decode_steps(engine: EngineProcess, tmp_path: Path) -> None:
    long = generate_request(
        PROMPTS[0], request_id="long", max_new_tokens=240, ignore_eos=True, temperature=1.0
    )
    call = asyncio.ensure_future(engine.stub.Generate(long, timeout=60))
    await engine.wait_running()
    aborted = await engine.stub.Abort(rollout_pb2.AbortRequest(request_ids=["long"]), timeout=5)
    completion = (await call).completions[0]
    assert aborted.aborted == 1 and completion.finish_reason == ABORT
    assert 0 < len(completion.token_ids) < 240
    expected = reference_logprobs(engine.model, PROMPTS[0], list(completion.token_ids))
    assert list(completion.logprobs) == pytest.approx(expected, abs=1e-4)

    # Paused mid-response, new weights of the same architecture, resumed: later tokens carry v1.
    call = asyncio.ensure_future(engine.stub.Generate(long, timeout=60))
    await engine.wait_running()
    await engine.stub.Pause(rollout_pb2.PauseRequest(), timeout=5)
    assert (await engine.status()).state == common_pb2.ENGINE_STATE_PAUSED
    handle = handle_for(JOB, save_checkpoint(tiny_llama(3), tmp_path / "v000001"), 1)
    loaded = await engine.stub.LoadWeights(rollout_pb2.LoadWeightsRequest(handle=handle), timeout=30)
    assert loaded.policy_version == 1 and loaded.aborted_requests == 0
    await engine.stub.Resume(rollout_pb2.ResumeRequest(), timeout=5)
    completion = (await call).completions[0]
    versions = list(completion.policy_versions)
    assert len(versions) == 240 and completion.finish_reason == LENGTH
    switch = versions.index(1)
    assert switch > 0 and versions == [0] * switch + [1] * (240 - switch)

    # A weight update in ABORT mode ends the request in flight, and counts it.
    call = asyncio.ensure_future(engine.stub.Generate(long, timeout=60))
    await engine.wait_running()
    handle = handle_for(JOB, save_checkpoint(tiny_llama(4), tmp_path / "v000002"), 2)
    mode = rollout_pb2.WEIGHT_UPDATE_MODE_ABORT
    loaded = await engine.stub.LoadWeights(
        rollout_pb2.LoadWeightsRequest(handle=handle, mode=mode), timeout=30
    )
    completion = (await call).completions[0]
    assert loaded.aborted_requests == 1 and completion.finish_reason == ABORT
    assert set(completion.policy_versions) == {1} and (await engine.status()).policy_version == 2

    # Paused: a request waits in the queue; aborted there, it ends without tokens.
    await engine.stub.Pause(rollout_pb2.PauseRequest(), timeout=5)
    queued = asyncio.ensure_future(engine.stub.Generate(long, timeout=60))

    async def waiting() -> bool:
        return (await engine.status()).queued_requests == 1

    await eventually(waiting, what="the request to wait in the queue")
    assert (await engine.stub.Abort(rollout_pb2.AbortRequest(all=True), timeout=5)).aborted == 1
    completion = (await queued).completions[0]
    assert completion.finish_reason == ABORT and not completion.token_ids
    await engine.stub.Resume(rollout_pb2.ResumeRequest(), timeout=5)

    for bad, says in (
        (generate_request([1, VOCAB + 5]), "outside the vocabulary"),
        (generate_request([]), "prompt_token_ids is empty"),
        (generate_request([1, 2], max_new_tokens=300), "exceeds the model's 256 positions"),
        (generate_request([1, 2], stop=["x"]), "stop strings need a tokenizer"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await engine.stub.Generate(bad, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in (err.value.details() or "")
    other_job = generate_request([1, 2])
    other_job.job_id = "another-job"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await engine.stub.Generate(other_job, timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and JOB in (err.value.details() or "")


@pytest.mark.parametrize(
    ("backend", "says"),
    [
        ("no_such_backend", "'no_such_backend' is not available"),
        ("examples.plugins.no_such_module:open_engine", "cannot import 'examples.plugins.no_such_module'"),
        ("examples.plugins.engine_backend:no_such_function", "has no 'no_such_function'"),
        ("os:system", "may not come from the standard library"),
    ],
)
def test_a_backend_that_does_not_resolve_exits_2(
    python: str, python_env: dict[str, str], backend: str, says: str
) -> None:
    result = subprocess.run(
        [python, "-m", "services.rollout"],
        cwd=ROOT,
        env={**python_env, "VERST_ENGINE_BACKEND": backend},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result
    assert "invalid setting VERST_ENGINE_BACKEND" in result.stderr and says in result.stderr, result.stderr
