"""The torch rollout engine over real gRPC and a real Redis: weights from the checkpoint
stream, logprobs against a full forward pass, sampling controls, batching, aborts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers import LlamaForCausalLM

from services.common.bus import DATA_FIELD, Bus
from services.common.config import JobSpec
from services.common.engine_registry import EngineRegistry
from services.common.pb import common_pb2, rollout_pb2
from services.common.streams import JobStreams, job_key
from tests.helpers import eventually
from tests.integration.rollout_helpers import (
    EOS,
    RunningEngine,
    generate_request,
    handle_for,
    publish_checkpoint,
    reference_logprobs,
    save_checkpoint,
    start_engine,
    start_job,
    tiny_llama,
)

JOB = "job-engine"
PROMPTS = [[1, 5, 6, 7, 8, 9, 10], [1, 20, 21], [1, 30, 31, 32, 33], [1, 40], [1, 50, 51, 52, 53, 54, 55, 56]]
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def base(tmp_path: Path) -> tuple[LlamaForCausalLM, Path]:
    model = tiny_llama(0)
    return model, save_checkpoint(model, tmp_path / "v000000")


@pytest.fixture
async def engine(
    bus: Bus, redis_url: str, base: tuple[LlamaForCausalLM, Path]
) -> AsyncIterator[RunningEngine]:
    await start_job(bus.redis, JOB)
    await publish_checkpoint(bus, JOB, base[1], 0)
    running = await start_engine(redis_url, engine_id="engine-test")
    try:
        await running.wait_for_version(0)
        yield running
    finally:
        await running.stop()


async def generate(
    engine: RunningEngine, prompt: list[int], **sampling: object
) -> rollout_pb2.GenerateResponse:
    return await engine.stub.Generate(generate_request(prompt, **sampling), timeout=30)


async def test_no_weights_is_failed_precondition(bus: Bus, redis_url: str) -> None:
    running = await start_engine(redis_url, engine_id="engine-empty")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(running, [1, 2, 3])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no weights loaded" in (err.value.details() or "")
        info = await running.stub.GetStatus(rollout_pb2.GetEngineStatusRequest(), timeout=5)
        assert info.state == common_pb2.ENGINE_STATE_STARTING and info.policy_version == -1
    finally:
        await running.stop()
    assert await EngineRegistry(bus.redis).get("engine-empty") is None  # it left the registry


async def test_logprobs_equal_a_full_forward_pass(
    engine: RunningEngine, base: tuple[LlamaForCausalLM, Path]
) -> None:
    """Sampled with temperature, top-k and top-p, yet each logprob is the raw model's."""
    model = base[0]
    responses = await asyncio.gather(
        *(
            generate(engine, p, temperature=0.8, top_k=20, top_p=0.9, n=3, max_new_tokens=12, seed=i)
            for i, p in enumerate(PROMPTS)
        )
    )
    checked = 0
    for prompt, response in zip(PROMPTS, responses, strict=True):
        assert [c.index for c in response.completions] == [0, 1, 2]
        assert response.engine_id == "engine-test"
        for completion in response.completions:
            tokens = list(completion.token_ids)
            assert len(completion.logprobs) == len(tokens) == len(completion.policy_versions)
            expected = reference_logprobs(model, prompt, tokens)
            assert list(completion.logprobs) == pytest.approx(expected, abs=1e-4)
            assert set(completion.policy_versions) == {0}
            checked += len(tokens)
    assert checked >= 5 * 3 * 1


async def test_greedy_is_deterministic_and_batching_changes_nothing(
    engine: RunningEngine, base: tuple[LlamaForCausalLM, Path]
) -> None:
    alone = [await generate(engine, p, temperature=0, max_new_tokens=10) for p in PROMPTS]
    together = await asyncio.gather(*(generate(engine, p, temperature=0, max_new_tokens=10) for p in PROMPTS))
    again = [await generate(engine, p, temperature=0, max_new_tokens=10) for p in PROMPTS]
    for prompt, a, b, c in zip(PROMPTS, alone, together, again, strict=True):
        tokens = list(a.completions[0].token_ids)
        assert tokens == list(b.completions[0].token_ids) == list(c.completions[0].token_ids)
        assert list(b.completions[0].logprobs) == pytest.approx(list(a.completions[0].logprobs), abs=1e-4)
        with torch.inference_mode():
            logits = base[0](input_ids=torch.tensor([prompt])).logits[0, -1]
        assert tokens[0] == int(logits.argmax())


async def test_seeds_reproduce_samples(engine: RunningEngine) -> None:
    prompt = PROMPTS[0]
    first = await generate(engine, prompt, temperature=1.0, n=4, seed=1234, max_new_tokens=12)
    second = await generate(engine, prompt, temperature=1.0, n=4, seed=1234, max_new_tokens=12)
    other = await generate(engine, prompt, temperature=1.0, n=4, seed=99, max_new_tokens=12)
    samples = [list(c.token_ids) for c in first.completions]
    assert samples == [list(c.token_ids) for c in second.completions]
    assert samples != [list(c.token_ids) for c in other.completions]
    assert len({tuple(s) for s in samples}) == 4  # the n samples of one request differ


async def test_stop_tokens_and_max_new_tokens(engine: RunningEngine) -> None:
    prompt = PROMPTS[1]
    greedy = list((await generate(engine, prompt, temperature=0, max_new_tokens=10)).completions[0].token_ids)
    assert EOS not in greedy  # else the default stop would have ended it early
    stop_at = 3
    stop_token = greedy[stop_at]
    first = greedy.index(stop_token)
    stopped = (
        await generate(engine, prompt, temperature=0, max_new_tokens=10, stop_token_ids=[stop_token])
    ).completions[0]
    assert list(stopped.token_ids) == greedy[: first + 1]
    assert stopped.finish_reason == STOP
    short = (await generate(engine, prompt, temperature=0, max_new_tokens=4)).completions[0]
    assert list(short.token_ids) == greedy[:4] and short.finish_reason == LENGTH


async def test_eos_of_a_new_model_config_stops_unless_ignored(
    engine: RunningEngine, bus: Bus, base: tuple[LlamaForCausalLM, Path], tmp_path: Path
) -> None:
    """A checkpoint whose config differs is swapped in whole; its EOS ends responses."""
    prompt = PROMPTS[2]
    greedy = list((await generate(engine, prompt, temperature=0, max_new_tokens=10)).completions[0].token_ids)
    model = base[0]
    model.config.eos_token_id = greedy[2]
    model.generation_config.eos_token_id = greedy[2]
    await publish_checkpoint(bus, JOB, save_checkpoint(model, tmp_path / "v000001"), 1)
    await engine.wait_for_version(1)
    ended = (await generate(engine, prompt, temperature=0, max_new_tokens=10)).completions[0]
    assert list(ended.token_ids) == greedy[: greedy.index(greedy[2]) + 1] and ended.finish_reason == STOP
    ignored = (await generate(engine, prompt, temperature=0, max_new_tokens=10, ignore_eos=True)).completions[
        0
    ]
    assert list(ignored.token_ids) == greedy and ignored.finish_reason == LENGTH
    assert set(ignored.policy_versions) == {1}


async def test_new_checkpoint_is_served_with_its_version(
    engine: RunningEngine, bus: Bus, tmp_path: Path
) -> None:
    new_model = tiny_llama(1)
    await publish_checkpoint(bus, JOB, save_checkpoint(new_model, tmp_path / "v000001"), 1)
    await engine.wait_for_version(1)
    completion = (await generate(engine, PROMPTS[0], temperature=1.0, seed=5, max_new_tokens=10)).completions[
        0
    ]
    assert set(completion.policy_versions) == {1}
    expected = reference_logprobs(new_model, PROMPTS[0], list(completion.token_ids))
    assert list(completion.logprobs) == pytest.approx(expected, abs=1e-4)

    async def registry_has_v1() -> bool:
        info = await EngineRegistry(bus.redis).get("engine-test")
        return info is not None and info.policy_version == 1 and info.job_id == JOB

    await eventually(registry_has_v1, what="the registry to report v1")
    entries = await bus.redis.xrange(JobStreams(JOB).metrics)
    metrics = [common_pb2.Metric.FromString(fields[DATA_FIELD]) for _, fields in entries]
    assert [(m.source, m.policy_version) for m in metrics] == [("rollout", 0), ("rollout", 1)]
    assert 0 <= metrics[1].values["weight_sync_latency_s"] < 10 and metrics[1].values["weight_load_s"] > 0


async def test_a_resumed_trainers_reissued_version_is_loaded(
    engine: RunningEngine, bus: Bus, tmp_path: Path
) -> None:
    """A resumed trainer begins a new epoch at a lower version with other weights: the watcher
    loads it, and tokens carry that version with those weights; within an epoch, an older
    version is not loaded again."""
    await publish_checkpoint(bus, JOB, save_checkpoint(tiny_llama(1), tmp_path / "v2-e1"), 2, epoch=1)
    await engine.wait_for_version(2)
    resumed = tiny_llama(3)
    await publish_checkpoint(bus, JOB, save_checkpoint(resumed, tmp_path / "v1-e2"), 1, epoch=2)

    async def serves_v1() -> bool:
        return await engine.version() == 1

    await eventually(serves_v1, what="the engine to serve epoch 2's v1")
    completion = (await generate(engine, PROMPTS[0], temperature=1.0, seed=5, max_new_tokens=10)).completions[
        0
    ]
    assert set(completion.policy_versions) == {1}
    expected = reference_logprobs(resumed, PROMPTS[0], list(completion.token_ids))
    assert list(completion.logprobs) == pytest.approx(expected, abs=1e-4)
    older = save_checkpoint(tiny_llama(4), tmp_path / "v0-e2")
    await publish_checkpoint(bus, JOB, older, 0, epoch=2)  # never from a trainer: the rule holds
    await asyncio.sleep(0.3)
    assert await engine.version() == 1


async def test_sha256_mismatch_is_refused(engine: RunningEngine, bus: Bus, tmp_path: Path) -> None:
    path = save_checkpoint(tiny_llama(2), tmp_path / "v000002")
    bad = handle_for(JOB, path, 2, sha256="0" * 64)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await engine.stub.LoadWeights(rollout_pb2.LoadWeightsRequest(handle=bad), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sha256 mismatch" in (err.value.details() or "")
    await publish_checkpoint(bus, JOB, path, 2, sha256="f" * 64)  # the watcher refuses it too
    await asyncio.sleep(0.3)
    assert await engine.version() == 0
    good = await engine.stub.LoadWeights(
        rollout_pb2.LoadWeightsRequest(handle=handle_for(JOB, path, 2)), timeout=30
    )
    assert good.policy_version == 2 and await engine.version() == 2


async def test_weights_change_between_decode_steps(engine: RunningEngine, tmp_path: Path) -> None:
    """Paused mid-response, new weights, resumed: later tokens carry the new version."""
    call = asyncio.ensure_future(
        generate(engine, PROMPTS[0], temperature=1.0, seed=3, max_new_tokens=200, ignore_eos=True)
    )

    async def running() -> bool:
        info = await engine.stub.GetStatus(rollout_pb2.GetEngineStatusRequest(), timeout=5)
        return info.running_requests == 1

    await eventually(running, what="the request to run")
    await engine.stub.Pause(rollout_pb2.PauseRequest(), timeout=5)
    handle = handle_for(JOB, save_checkpoint(tiny_llama(3), tmp_path / "v000001"), 1)
    loaded = await engine.stub.LoadWeights(rollout_pb2.LoadWeightsRequest(handle=handle), timeout=30)
    assert loaded.policy_version == 1 and loaded.aborted_requests == 0
    await engine.stub.Resume(rollout_pb2.ResumeRequest(), timeout=5)
    completion = (await call).completions[0]
    versions = list(completion.policy_versions)
    assert len(versions) == 200 and completion.finish_reason == LENGTH
    switch = versions.index(1)
    assert switch > 0 and versions == [0] * switch + [1] * (200 - switch)


async def test_a_pause_without_resume_ends_by_itself(engine: RunningEngine) -> None:
    """A caller that paused the engine and died does not leave it holding requests for good."""
    engine.app.servicer.max_pause_s = 0.5
    call = asyncio.ensure_future(
        generate(engine, PROMPTS[0], temperature=1.0, seed=3, max_new_tokens=100, ignore_eos=True)
    )

    async def state() -> int:
        return (await engine.stub.GetStatus(rollout_pb2.GetEngineStatusRequest(), timeout=5)).state

    async def running() -> bool:
        info = await engine.stub.GetStatus(rollout_pb2.GetEngineStatusRequest(), timeout=5)
        return info.running_requests == 1

    await eventually(running, what="the request to run")
    await engine.stub.Pause(rollout_pb2.PauseRequest(), timeout=5)
    paused_at = time.monotonic()
    assert await state() == common_pb2.ENGINE_STATE_PAUSED
    completion = (await asyncio.wait_for(call, 30)).completions[0]
    assert time.monotonic() - paused_at >= 0.5 and len(completion.token_ids) == 100
    assert await state() == common_pb2.ENGINE_STATE_SERVING


async def test_abort_returns_the_tokens_so_far(engine: RunningEngine, tmp_path: Path) -> None:
    request = generate_request(
        PROMPTS[0], request_id="long", max_new_tokens=200, ignore_eos=True, temperature=1.0
    )
    call = asyncio.ensure_future(engine.stub.Generate(request, timeout=30))

    async def running() -> bool:
        info = await engine.stub.GetStatus(rollout_pb2.GetEngineStatusRequest(), timeout=5)
        return info.running_requests == 1

    await eventually(running, what="the request to run")
    aborted = await engine.stub.Abort(rollout_pb2.AbortRequest(request_ids=["long"]), timeout=5)
    assert aborted.aborted == 1
    completion = (await call).completions[0]
    assert completion.finish_reason == ABORT and 0 < len(completion.token_ids) < 200
    # A weight update in ABORT mode ends running requests the same way.
    call = asyncio.ensure_future(engine.stub.Generate(request, timeout=30))
    await eventually(running, what="the request to run")
    handle = handle_for(JOB, save_checkpoint(tiny_llama(4), tmp_path / "v000001"), 1)
    mode = rollout_pb2.WEIGHT_UPDATE_MODE_ABORT
    loaded = await engine.stub.LoadWeights(
        rollout_pb2.LoadWeightsRequest(handle=handle, mode=mode), timeout=30
    )
    assert loaded.aborted_requests == 1
    completion = (await call).completions[0]
    assert completion.finish_reason == ABORT and set(completion.policy_versions) == {0}


async def test_pause_holds_requests_and_a_deadline_cancels_them(engine: RunningEngine) -> None:
    await engine.stub.Pause(rollout_pb2.PauseRequest(), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await engine.stub.Generate(generate_request(PROMPTS[0]), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    async def nothing_queued() -> bool:
        info = await engine.stub.GetStatus(rollout_pb2.GetEngineStatusRequest(), timeout=5)
        return info.queued_requests == 0 and info.state == common_pb2.ENGINE_STATE_PAUSED

    await eventually(nothing_queued, what="the expired request to leave the queue")
    held = asyncio.ensure_future(generate(engine, PROMPTS[0], temperature=0))
    await asyncio.sleep(0.2)
    assert not held.done()
    await engine.stub.Resume(rollout_pb2.ResumeRequest(), timeout=5)
    assert (await held).completions[0].finish_reason == LENGTH


async def test_requests_for_another_job_are_refused(engine: RunningEngine) -> None:
    request = generate_request(PROMPTS[0])
    request.job_id = JOB
    assert len((await engine.stub.Generate(request, timeout=30)).completions) == 1
    request.job_id = "job-other"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await engine.stub.Generate(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "engine serves job 'job-engine', not 'job-other'" in (err.value.details() or "")


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ([], {}, "prompt_token_ids is empty"),
        ([1, 100], {}, "outside the vocabulary"),
        ([1, -1], {}, "outside the vocabulary"),
        ([1, 2], {"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ([1, 2], {"max_new_tokens": 255}, "exceeds the model's 256 positions"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
        ([1, 2], {"temperature": -1.0}, "temperature"),
        ([1, 2], {"stop": ["x"]}, "stop strings need a tokenizer"),
    ],
)
async def test_bad_requests_are_invalid_argument(
    engine: RunningEngine, prompt: list[int], sampling: dict[str, object], message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(engine, prompt, **sampling)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")


async def test_a_stream_sends_tokens_as_they_are_sampled(engine: RunningEngine) -> None:
    """Increments per sample while it decodes; joined up they equal the unary reply (same seed)."""
    request = generate_request(PROMPTS[0], temperature=1.0, n=2, seed=42, max_new_tokens=60, ignore_eos=True)
    chunks = [chunk async for chunk in engine.stub.GenerateStream(request, timeout=30)]
    unary = await engine.stub.Generate(request, timeout=30)
    for completion in unary.completions:
        mine = [c for c in chunks if c.index == completion.index]
        assert len(mine) > 1  # not one chunk at the end
        assert [c.finish_reason for c in mine] == [0] * (len(mine) - 1) + [LENGTH]
        assert [t for c in mine for t in c.token_ids] == list(completion.token_ids)
        assert [lp for c in mine for lp in c.logprobs] == pytest.approx(list(completion.logprobs), abs=1e-5)
        assert [v for c in mine for v in c.policy_versions] == list(completion.policy_versions)
        assert {(c.engine_id, c.request_id) for c in mine} == {("engine-test", request.request_id)}


async def test_a_jobs_weight_update_abort_applies_to_the_watchers_loads(
    engine: RunningEngine, bus: Bus, tmp_path: Path
) -> None:
    """rollout.weight_update in the JobSpec: the engine aborts that job's samples on its next checkpoint."""
    spec = JobSpec.model_validate({"rollout": {"weight_update": "abort"}})
    await bus.redis.hset(job_key(JOB), "spec_json", spec.model_dump_json())
    call = asyncio.ensure_future(
        generate(engine, PROMPTS[0], temperature=1.0, seed=3, max_new_tokens=240, ignore_eos=True)
    )

    async def running() -> bool:
        info = await engine.stub.GetStatus(rollout_pb2.GetEngineStatusRequest(), timeout=5)
        return info.running_requests == 1

    await eventually(running, what="the request to run")
    await engine.stub.Pause(rollout_pb2.PauseRequest(), timeout=5)  # hold it mid-response
    await publish_checkpoint(bus, JOB, save_checkpoint(tiny_llama(4), tmp_path / "v000001"), 1)
    await engine.wait_for_version(1)
    await engine.stub.Resume(rollout_pb2.ResumeRequest(), timeout=5)
    completion = (await call).completions[0]
    assert completion.finish_reason == ABORT and 0 < len(completion.token_ids) < 240
    assert set(completion.policy_versions) == {0}
