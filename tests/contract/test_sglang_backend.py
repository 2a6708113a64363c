"""Contract tests of SGLangBackend against recorded SGLang exchanges (sglang_exchange.json).

A fake SGLang server on a loopback port replays the recorded responses and records what the
backend sends; every request is checked against the recorded request and against SGLang's
documented /generate fields. SGLang itself needs CUDA and is never run here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from services.common.pb import common_pb2
from services.common.redis_server import free_port
from services.rollout.sglang.backend import SGLangBackend, Timeouts
from services.rollout.sglang.protocol import (
    SGLangConnectionError,
    SGLangError,
    SGLangHTTPError,
    SGLangResponseError,
    SGLangTimeoutError,
    SGLangWeightsError,
)
from tests.contract.sglang_fake import (
    ABORT,
    ERROR,
    LENGTH,
    STOP,
    FakeSGLang,
    check_served,
    params,
    wait_arrival,
)

# -- generate ------------------------------------------------------------------------------


async def test_generate_stop_returns_tokens_logprobs_and_versions(fake, backend) -> None:
    fake.expect("generate_stop")
    [completion] = await backend.generate([11, 12, 13], params(), "req-stop")
    assert list(completion.token_ids) == [21, 22, 2]
    assert list(completion.logprobs) == [-0.5, -1.25, -0.125]
    assert list(completion.policy_versions) == [3, 3, 3]  # meta_info.weight_version "3"
    assert (completion.index, completion.finish_reason, completion.error) == (0, STOP, "")
    assert completion.text == "ab"  # SGLang's text (no special tokens) comes along for the runner


async def test_generate_length_maps_sampling_and_version_spans(fake, fake_backend_seeded) -> None:
    fake.expect("generate_length")
    sampling = common_pb2.SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_new_tokens=4)
    [completion] = await fake_backend_seeded.generate([11, 12], sampling, "req-len")
    assert completion.finish_reason == LENGTH
    assert list(completion.token_ids) == [31, 32, 33, 34]
    assert list(completion.policy_versions) == [3, 3, 4, 4]  # meta_info.weight_versions spans
    [request] = fake.received("/generate")
    seed = request["body"]["sampling_params"]["sampling_seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**31 - 1  # always_seed: random when unseeded


@pytest.fixture
async def fake_backend_seeded(fake: FakeSGLang) -> AsyncIterator[SGLangBackend]:
    client = SGLangBackend([fake.url], timeouts=Timeouts(generate_s=5.0), always_seed=True)
    yield client
    await client.close()


async def test_abort_returns_the_partial_sample_marked_abort(fake, backend) -> None:
    fake.expect("generate_abort", "abort_request")
    task = asyncio.create_task(backend.generate([11], params(), "req-abort"))
    await wait_arrival(fake, "/generate")
    assert backend.status().running_requests == 1
    assert await backend.abort("req-abort") == 1
    [completion] = await task
    assert (completion.finish_reason, completion.error) == (ABORT, "")
    assert list(completion.token_ids) == [41, 42]
    assert list(completion.policy_versions) == [3, 3]  # "default" is no version: the backend's own
    [abort] = fake.received("/abort_request")
    [generate] = fake.received("/generate")
    assert abort["body"]["rid"] == generate["body"]["rid"]
    assert await backend.abort("req-abort") == 0  # no longer in flight: nothing sent


async def test_abort_with_an_error_status_is_a_failed_sample(fake, backend) -> None:
    fake.expect("generate_error_abort")
    [completion] = await backend.generate([11], params(), "req-oom")
    assert completion.finish_reason == ERROR
    assert "out of memory" in completion.error


async def test_n_samples_are_one_batch_with_stop_ids_and_per_sample_seeds(fake, backend) -> None:
    fake.expect("generate_n3_stop_ids")
    sampling = params(max_new_tokens=3, stop_token_ids=[9, 7], seed=1234, n=3)
    completions = await backend.generate([11, 12], sampling, "req-group")
    assert [c.index for c in completions] == [0, 1, 2]
    assert [c.finish_reason for c in completions] == [STOP, LENGTH, STOP]
    assert [list(c.token_ids) for c in completions] == [[51, 7], [52, 53, 54], [9]]
    assert all(list(c.policy_versions) == [5] * len(c.token_ids) for c in completions)
    [request] = fake.received("/generate")
    assert len(set(request["body"]["rid"])) == 3


async def test_bad_input_is_refused_before_any_request(backend) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        await backend.generate([], params(), "req-x")
    with pytest.raises(ValueError, match="top_p"):
        await backend.generate([1], params(top_p=1.5), "req-x")
    with pytest.raises(ValueError, match="n must be"):
        await backend.generate([1], params(), "req-x", n=0)


# -- weights and control -----------------------------------------------------------------------


async def test_load_weights_success_and_failure(fake, backend) -> None:
    fake.expect("update_weights_ok", "update_weights_fail")
    message = await backend.load_weights("/ckpt/job-1/v4", 4)
    assert "Succeeded" in message and backend.policy_version == 4
    with pytest.raises(SGLangWeightsError) as failure:
        await backend.load_weights("/ckpt/missing", 5)
    assert failure.value.endpoint == "/update_weights_from_disk" and failure.value.status == 400
    assert "repository not found" in str(failure.value) and fake.url in str(failure.value)
    assert backend.policy_version == 4  # the failed load changed nothing


async def test_pause_in_place_holds_requests_until_resume(fake, backend) -> None:
    fake.expect("generate_held_by_pause", "pause_in_place", "continue_generation")
    task = asyncio.create_task(backend.generate([11], params(), "req-held"))
    await wait_arrival(fake, "/generate")
    assert await backend.pause() == 0
    assert backend.status().paused
    with pytest.raises(SGLangError, match="in-place pause"):
        await backend.load_weights("/ckpt/job-1/v4", 4)  # would deadlock on SGLang's update lock
    await asyncio.sleep(0.05)
    assert not task.done()
    await backend.resume()
    [completion] = await task
    assert completion.finish_reason == STOP and not backend.status().paused


async def test_pause_abort_and_abort_all(fake, backend) -> None:
    fake.expect("pause_abort", "abort_all")
    assert await backend.pause(abort_inflight=True) == 0
    assert await backend.abort_all() == 0


async def test_health_flush_cache_and_model_info(fake, backend) -> None:
    fake.expect("health_generate", "flush_cache", "get_model_info", "health_generate_unhealthy")
    await backend.health()
    await backend.flush_cache()
    info = await backend.model_info()
    assert info[fake.url]["weight_version"] == "4"
    with pytest.raises(SGLangHTTPError) as unhealthy:
        await backend.health()
    assert unhealthy.value.status == 503 and unhealthy.value.endpoint == "/health_generate"


# -- errors and timeouts --------------------------------------------------------------------------


async def test_server_errors_carry_endpoint_status_and_message(fake, backend) -> None:
    fake.expect("generate_500", "generate_400")
    with pytest.raises(SGLangHTTPError) as internal:
        await backend.generate([11], params(), "req-500")
    assert (internal.value.status, internal.value.endpoint) == (500, "/generate")
    assert str(internal.value) == f"SGLang {fake.url}/generate: HTTP 500: Internal Server Error"
    with pytest.raises(SGLangHTTPError, match="longer than the model's context length"):
        await backend.generate([11], params(), "req-400")
    assert backend.status().running_requests == 0


async def test_malformed_bodies_are_clear_errors(fake, backend) -> None:
    fake.expect("generate_malformed_json", "generate_missing_logprobs")
    with pytest.raises(SGLangResponseError, match="body is not JSON") as bad:
        await backend.generate([11], params(), "req-bad")
    assert bad.value.endpoint == "/generate"
    with pytest.raises(SGLangResponseError, match="output_token_logprobs is missing"):
        await backend.generate([11], params(), "req-nolp")


async def test_timeout_is_honoured_and_the_request_aborted(fake) -> None:
    fake.expect("generate_slow", "abort_request_slow_rid")
    client = SGLangBackend([fake.url], timeouts=Timeouts(generate_s=0.3, control_s=2.0))
    started = time.monotonic()
    with pytest.raises(SGLangTimeoutError, match=r"no answer within 0\.3s"):
        await client.generate([11], params(), "req-slow")
    assert time.monotonic() - started < 2.0
    await client.close()  # waits for the best-effort abort
    [abort] = fake.received("/abort_request")
    assert abort["body"]["rid"] == fake.received("/generate")[0]["body"]["rid"]


async def test_only_idempotent_calls_retry_connection_errors() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) < 3:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200)

    client = SGLangBackend(["http://sglang.test"], backoff_s=0.001, transport=httpx.MockTransport(handler))
    await client.health()
    assert calls == ["/health_generate"] * 3
    calls.clear()
    with pytest.raises(SGLangConnectionError, match="cannot connect"):
        await client.generate([1], params(), "req-1")
    assert calls == ["/generate"]  # never retried: it may have run
    await client.close()


async def test_an_unreachable_server_names_itself() -> None:
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    client = SGLangBackend([url], retries=1, backoff_s=0.01)
    with pytest.raises(SGLangConnectionError) as failure:
        await client.health()
    assert str(failure.value).startswith(f"SGLang {url}/health_generate: cannot connect")
    await client.close()


async def test_several_servers_share_requests_and_load_weights_together(fake) -> None:
    other = FakeSGLang()
    try:
        fake.expect("update_weights_ok", "generate_stop")
        other.expect("update_weights_ok", "generate_stop")
        client = SGLangBackend([fake.url, other.url])
        await client.load_weights("/ckpt/job-1/v4", 4)
        results = await asyncio.gather(
            *(client.generate([11, 12, 13], params(), "req-stop") for _ in range(2))
        )
        assert [len(r) for r in results] == [1, 1] and client.policy_version == 4
        await client.close()
    finally:
        other.close()
    check_served(other)
