"""The rollout engine's Prometheus /metrics, scraped over HTTP from a real engine on a real Redis,
and the weight_update_mode setting."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.bus import Bus
from services.common.metrics_http import serving_metrics
from services.common.pb import common_pb2, rollout_pb2
from services.common.redis_server import free_port
from services.rollout.metrics import RATE_WINDOW_S, EngineMetrics, TokenRate
from tests.helpers import eventually
from tests.integration.rollout_helpers import (
    RunningEngine,
    generate_request,
    handle_for,
    publish_checkpoint,
    save_checkpoint,
    start_engine,
    start_job,
    tiny_llama,
)
from tests.integration.test_services import grpc_health, start, stop

JOB = "job-metrics"
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT
SYNC_DELAY_S = 3.0
"""How long before the load the second checkpoint's handle says it was published."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def scrape(url: str) -> dict[str, float]:
    """Every sample on the page, keyed like the exposition format: name{label="value",...}."""
    async with httpx.AsyncClient() as client:
        response = await client.get(url, timeout=5)
    response.raise_for_status()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


async def engine_serving_v0(bus: Bus, redis_url: str, tmp_path: Path, **settings: object) -> RunningEngine:
    """A running job with checkpoint v0 (a long-context tiny model), and an engine serving it."""
    await start_job(bus.redis, JOB)
    await publish_checkpoint(bus, JOB, save_checkpoint(tiny_llama(0, max_positions=2048), tmp_path / "v0"), 0)
    engine = await start_engine(redis_url, **settings)
    await engine.wait_for_version(0)
    return engine


@pytest.fixture
async def engine(bus: Bus, redis_url: str, tmp_path: Path) -> AsyncIterator[RunningEngine]:
    running = await engine_serving_v0(bus, redis_url, tmp_path, engine_id="engine-metrics")
    try:
        yield running
    finally:
        await running.stop()


def test_token_rate_counts_only_the_recent_window() -> None:
    now = [100.0]
    rate = TokenRate(window_s=10.0, clock=lambda: now[0])
    rate.add(30)
    now[0] += 4.0
    rate.add(20)
    assert rate.per_second() == 5.0
    now[0] += 7.0  # the first 30 tokens are 11 s old
    assert rate.per_second() == 2.0
    now[0] += 10.0
    assert rate.per_second() == 0.0


async def test_metrics_of_generation_and_weight_loads(engine: RunningEngine, tmp_path: Path) -> None:
    with serving_metrics(engine.app.metrics.registry, "127.0.0.1", 0, enabled=True) as server:
        assert server is not None
        before = await scrape(server.url)
        assert before["verst_engine_policy_version"] == 0
        assert before['verst_engine_weight_loads_total{outcome="ok"}'] == 1  # v0, by the watcher
        assert before["verst_engine_generated_tokens_total"] == 0

        requests = [
            generate_request([1, 5, 6, 7], request_id="a", max_new_tokens=6, ignore_eos=True),
            generate_request([1, 20], request_id="b", max_new_tokens=9, n=2, temperature=1.0, seed=1),
            generate_request([1, 30, 31], request_id="c", max_new_tokens=4, temperature=0),
        ]
        replies = await asyncio.gather(*(engine.stub.Generate(r, timeout=30) for r in requests))
        completions = [c for reply in replies for c in reply.completions]
        tokens = sum(len(c.token_ids) for c in completions)
        assert tokens >= 6
        after = await scrape(server.url)
        assert after["verst_engine_generated_tokens_total"] == tokens
        assert after["verst_engine_tokens_per_second"] == pytest.approx(tokens / RATE_WINDOW_S)
        assert after["verst_engine_time_to_first_token_seconds_count"] == len(requests)
        assert 0 < after["verst_engine_time_to_first_token_seconds_sum"] < 30
        reasons = Counter("length" if c.finish_reason == LENGTH else "stop" for c in completions)
        assert reasons["length"] >= 1  # request a ignores EOS
        for reason, count in reasons.items():
            assert after[f'verst_engine_completions_total{{finish_reason="{reason}"}}'] == count
        assert sum(v for k, v in after.items() if k.startswith("verst_engine_completions_total")) == 4

        path = save_checkpoint(tiny_llama(1, max_positions=2048), tmp_path / "v1")
        bad = handle_for(JOB, path, 1, sha256="0" * 64)
        with pytest.raises(grpc.aio.AioRpcError):
            await engine.stub.LoadWeights(rollout_pb2.LoadWeightsRequest(handle=bad), timeout=30)
        handle = handle_for(JOB, path, 1)
        handle.created_at.FromNanoseconds(time.time_ns() - int(SYNC_DELAY_S * 1e9))
        await engine.stub.LoadWeights(rollout_pb2.LoadWeightsRequest(handle=handle), timeout=30)
        loaded = await scrape(server.url)
        assert loaded["verst_engine_policy_version"] == 1
        assert loaded['verst_engine_weight_loads_total{outcome="ok"}'] == 2
        assert loaded['verst_engine_weight_loads_total{outcome="refused"}'] == 1
        assert loaded["verst_engine_weight_sync_latency_seconds_count"] == 2  # v0 and v1
        latest = loaded["verst_engine_last_weight_sync_latency_seconds"]
        assert SYNC_DELAY_S <= latest < SYNC_DELAY_S + 30
        assert latest <= loaded["verst_engine_weight_sync_latency_seconds_sum"] < latest + 30
        assert loaded["verst_engine_running_requests"] == 0
        assert loaded["verst_engine_queued_requests"] == 0
        assert loaded["verst_engine_outstanding_tokens"] == 0
    with pytest.raises(httpx.TransportError):  # the server is gone with the block
        await scrape(server.url)


async def test_tokens_are_counted_as_they_are_generated(engine: RunningEngine) -> None:
    """A long generation moves the counter and the rate while it runs (held there by a Pause, so
    it cannot finish first); once it ends the counter holds its tokens once, not twice."""
    registry = engine.app.metrics.registry
    length = 1500
    request = generate_request([1, 5, 6], max_new_tokens=length, ignore_eos=True, temperature=1.0)
    call = asyncio.ensure_future(engine.stub.Generate(request, timeout=60))

    async def counted() -> float:
        return registry.get_sample_value("verst_engine_generated_tokens_total") or 0.0

    await eventually(counted, what="tokens counted before the sample finished")
    await engine.stub.Pause(rollout_pb2.PauseRequest(), timeout=5)
    try:
        info = await engine.stub.GetStatus(rollout_pb2.GetEngineStatusRequest(), timeout=5)
        assert not call.done() and info.running_requests == 1
        assert 0 < await counted() < length
        assert (registry.get_sample_value("verst_engine_tokens_per_second") or 0.0) > 0
    finally:
        await engine.stub.Resume(rollout_pb2.ResumeRequest(), timeout=5)
    completion = (await call).completions[0]
    assert len(completion.token_ids) == length and completion.finish_reason == LENGTH
    assert await counted() == length
    assert registry.get_sample_value("verst_engine_completions_total", {"finish_reason": "length"}) == 1


async def test_running_and_queued_requests_are_read_at_scrape_time(engine: RunningEngine) -> None:
    metrics = engine.app.metrics.registry
    await engine.stub.Pause(rollout_pb2.PauseRequest(), timeout=5)
    held = asyncio.ensure_future(
        engine.stub.Generate(generate_request([1, 5], max_new_tokens=4, n=3), timeout=30)
    )

    def queued() -> float | None:
        return metrics.get_sample_value("verst_engine_queued_requests")

    async def is_queued() -> bool:
        return queued() == 1

    await eventually(is_queued, what="the request to be queued")
    assert metrics.get_sample_value("verst_engine_outstanding_tokens") == 12
    await engine.stub.Resume(rollout_pb2.ResumeRequest(), timeout=5)
    await held
    assert queued() == 0 and metrics.get_sample_value("verst_engine_running_requests") == 0


async def test_abort_mode_ends_requests_in_flight_on_a_weight_load(
    bus: Bus, redis_url: str, tmp_path: Path
) -> None:
    engine = await engine_serving_v0(
        bus, redis_url, tmp_path, engine_id="engine-abort", weight_update_mode="abort"
    )
    try:
        request = generate_request([1, 5, 6], max_new_tokens=2000, ignore_eos=True, temperature=1.0)
        call = asyncio.ensure_future(engine.stub.Generate(request, timeout=30))

        async def running() -> bool:
            info = await engine.stub.GetStatus(rollout_pb2.GetEngineStatusRequest(), timeout=5)
            return info.running_requests == 1

        await eventually(running, what="the request to run")
        handle = handle_for(JOB, save_checkpoint(tiny_llama(1, max_positions=2048), tmp_path / "v1"), 1)
        loaded = await engine.stub.LoadWeights(rollout_pb2.LoadWeightsRequest(handle=handle), timeout=30)
        assert loaded.policy_version == 1 and loaded.aborted_requests == 1  # the mode came from settings
        completion = (await call).completions[0]
        assert completion.finish_reason == ABORT
        assert 0 < len(completion.token_ids) < 2000 and set(completion.policy_versions) == {0}
        registry = engine.app.metrics.registry
        assert registry.get_sample_value("verst_engine_completions_total", {"finish_reason": "abort"}) == 1
        assert registry.get_sample_value("verst_engine_generated_tokens_total") == len(completion.token_ids)
    finally:
        await engine.stop()


def test_disabled_metrics_serve_nothing_and_a_busy_port_is_named() -> None:
    metrics = EngineMetrics(lambda: pytest.fail("a disabled endpoint is never scraped"))
    with serving_metrics(metrics.registry, "127.0.0.1", 0, enabled=False) as server:
        assert server is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with (
            pytest.raises(OSError, match=f"127.0.0.1:{port} \\(VERST_ENGINE_METRICS_PORT\\)"),
            serving_metrics(
                metrics.registry, "127.0.0.1", port, enabled=True, setting="VERST_ENGINE_METRICS_PORT"
            ),
        ):
            pass


def test_the_engine_process_serves_metrics_until_it_stops(
    python: str, python_env: dict[str, str], redis_url: str
) -> None:
    metrics_port = free_port()
    env = {**python_env, "VERST_ENGINE_METRICS_PORT": str(metrics_port), "VERST_ENGINE_DEVICE": "cpu"}
    proc, port = start(python, env, ["services.rollout"], "VERST_ENGINE_PORT", redis_url)
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        grpc_health(port)
        samples = asyncio.run(scrape(url))
        assert samples["verst_engine_policy_version"] == -1  # no running job, no weights
        assert samples["verst_engine_generated_tokens_total"] == 0
    finally:
        code, output = stop(proc)
    assert code == 0, output
    assert f"metrics at {url}" in output
    with pytest.raises(httpx.TransportError):
        httpx.get(url, timeout=2)
