"""The reward service over real gRPC: Score, ScoreBatch, and failures reported as errors, not zeros."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_client import channel
from services.common.pb import reward_pb2, reward_pb2_grpc
from services.reward.config import RewardSettings
from services.reward.server import SERVICE_NAME, RewardServicer, register
from services.reward.verifiers import VERIFIERS, VerifierResult
from tests.helpers import serve
from tests.integration.test_services import start, stop

DEADLINE_S = 10.0
PLUGIN = "tests.unit.test_verifiers:length_plugin"
"""A sync plugin: 1 / (1 + characters of difference), component ``gap``."""
TIMEOUT_S = 1.0
"""score_timeout_s of the in-process server."""


def sleepy(response_text: str, answer: str, metadata: Mapping[str, str]) -> VerifierResult:
    """Exact match after sleeping ``metadata["sleep_s"]`` seconds."""
    time.sleep(float(metadata.get("sleep_s", "0")))
    return VERIFIERS["exact_match"](response_text, answer, metadata)


def broken(response_text: str, answer: str, metadata: Mapping[str, str]) -> VerifierResult:
    raise ZeroDivisionError("division by zero")


def not_a_number(response_text: str, answer: str, metadata: Mapping[str, str]) -> VerifierResult:
    return float("nan"), {}, {}


def wrong_shape(response_text: str, answer: str, metadata: Mapping[str, str]) -> VerifierResult:
    return 1.0  # type: ignore[return-value]


TEST_VERIFIERS = {**VERIFIERS, "sleepy": sleepy, "broken": broken, "nan": not_a_number, "shape": wrong_shape}


@contextlib.asynccontextmanager
async def served(score_timeout_s: float) -> AsyncIterator[reward_pb2_grpc.RewardStub]:
    settings = RewardSettings(port=0, score_timeout_s=score_timeout_s, score_workers=8)
    servicer = RewardServicer(settings, TEST_VERIFIERS)
    server, address = await serve(lambda s: reward_pb2_grpc.add_RewardServicer_to_server(servicer, s))
    try:
        async with channel(address) as client:
            yield reward_pb2_grpc.RewardStub(client)
    finally:
        await server.stop(0)


@pytest.fixture
async def stub() -> AsyncIterator[reward_pb2_grpc.RewardStub]:
    async with served(TIMEOUT_S) as client:
        yield client


@pytest.fixture
async def roomy_stub() -> AsyncIterator[reward_pb2_grpc.RewardStub]:
    """Items may take DEADLINE_S: a math worker's first start imports sympy."""
    async with served(DEADLINE_S) as client:
        yield client


def request(response: str, answer: str, verifier: str = "", **metadata: str) -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(
        response_text=response, answer=answer, verifier=verifier, metadata=metadata
    )


async def test_score_uses_the_default_addition_verifier(stub: reward_pb2_grpc.RewardStub) -> None:
    right = await stub.Score(request(" 231\n", "231"), timeout=DEADLINE_S)
    assert (right.reward, dict(right.components), right.error) == (1.0, {"correct": 1.0, "format": 1.0}, "")
    assert right.info["parsed"] == "231"
    wrong = await stub.Score(request("132", "231", verifier="addition"), timeout=DEADLINE_S)
    assert (wrong.reward, dict(wrong.components), wrong.error) == (0.0, {"correct": 0.0, "format": 1.0}, "")
    garbled = await stub.Score(request("2x1", "231"), timeout=DEADLINE_S)
    assert dict(garbled.components) == {"correct": 0.0, "format": 0.0}


async def test_exact_match(stub: reward_pb2_grpc.RewardStub) -> None:
    result = await stub.Score(request(" Paris ", "Paris", verifier="exact_match"), timeout=DEADLINE_S)
    assert (result.reward, result.error) == (1.0, "")


async def test_unknown_verifier_is_an_error_not_a_zero(stub: reward_pb2_grpc.RewardStub) -> None:
    result = await stub.Score(request("231", "231", verifier="nope"), timeout=DEADLINE_S)
    assert result.reward == 0.0
    assert result.error.startswith("unknown verifier 'nope'; known verifiers: addition, broken")


@pytest.mark.parametrize(
    ("verifier", "error"),
    [
        ("broken", "verifier 'broken' failed: ZeroDivisionError: division by zero"),
        ("nan", "verifier 'nan' returned a malformed result: reward is nan"),
        ("shape", "verifier 'shape' returned a malformed result: expected (reward, components, info)"),
    ],
)
async def test_failing_verifiers_are_errors(
    stub: reward_pb2_grpc.RewardStub, verifier: str, error: str
) -> None:
    result = await stub.Score(request("1", "1", verifier=verifier), timeout=DEADLINE_S)
    assert result.reward == 0.0
    assert result.error.startswith(error)


async def test_a_verifier_past_its_deadline_is_an_error(stub: reward_pb2_grpc.RewardStub) -> None:
    started = time.monotonic()
    result = await stub.Score(request("1", "1", verifier="sleepy", sleep_s="3"), timeout=DEADLINE_S)
    assert time.monotonic() - started < 2.5
    assert result.reward == 0.0
    assert result.error == f"verifier 'sleepy' did not finish within {TIMEOUT_S:g}s"


async def test_score_batch_keeps_order_scores_concurrently_and_isolates_failures(
    stub: reward_pb2_grpc.RewardStub,
) -> None:
    # Earlier items sleep longer, so they finish last; one after the other they would take 1.8s.
    items = [request("1", "1" if i % 2 else "0", "sleepy", sleep_s=f"{0.6 - 0.1 * i:.1f}") for i in range(4)]
    items += [request("231", "231"), request("1", "1", verifier="broken"), request("1", "1", verifier="nope")]
    started = time.monotonic()
    reply = await stub.ScoreBatch(reward_pb2.ScoreBatchRequest(items=items), timeout=DEADLINE_S)
    assert time.monotonic() - started < 1.4
    assert [r.reward for r in reply.results] == [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert [bool(r.error) for r in reply.results] == [False] * 5 + [True] * 2
    assert "ZeroDivisionError" in reply.results[5].error
    assert "unknown verifier 'nope'" in reply.results[6].error


async def test_empty_batch(stub: reward_pb2_grpc.RewardStub) -> None:
    reply = await stub.ScoreBatch(reward_pb2.ScoreBatchRequest(), timeout=DEADLINE_S)
    assert list(reply.results) == []


async def test_register_names_the_service() -> None:
    server = grpc.aio.server()
    settings = RewardSettings(port=0, tools_enabled=False)  # with tools: test_tools_service.py
    assert register(server, settings) == [SERVICE_NAME] == ["verst.v1.Reward"]


def test_unknown_default_verifier_is_a_settings_error() -> None:
    with pytest.raises(ValueError, match="unknown verifier 'nope'; known: addition, code, exact_match"):
        RewardSettings(default_verifier="nope")
    assert RewardSettings(default_verifier=PLUGIN).default_verifier == PLUGIN


async def test_the_call_deadline_bounds_each_item(stub: reward_pb2_grpc.RewardStub) -> None:
    """An item whose verifier outlives the caller's deadline is answered, as an error, in time."""
    started = time.monotonic()
    reply = await stub.ScoreBatch(
        reward_pb2.ScoreBatchRequest(items=[request("1", "1", "sleepy", sleep_s="3"), request("231", "231")]),
        timeout=0.5,
    )
    assert time.monotonic() - started < 0.5
    assert reply.results[0].error.startswith("verifier 'sleepy' did not finish within 0.4")
    assert (reply.results[1].reward, reply.results[1].error) == (1.0, "")


async def test_check_verifier_names_what_would_score(stub: reward_pb2_grpc.RewardStub) -> None:
    def check(name: str) -> reward_pb2.CheckVerifierRequest:
        return reward_pb2.CheckVerifierRequest(verifier=name)

    known = await stub.CheckVerifier(check("exact_match"), timeout=DEADLINE_S)
    assert (known.ok, known.error) == (True, "") and "sleepy" in known.verifiers
    assert known.text_only  # a registered verifier reads texts: the runner may leave ids out
    default = await stub.CheckVerifier(check(""), timeout=DEADLINE_S)
    assert default.ok and default.text_only, "empty is the default"
    plugin = await stub.CheckVerifier(check(PLUGIN), timeout=DEADLINE_S)
    assert plugin.ok and not plugin.text_only  # a plugin gets the whole request, token ids too
    unknown = await stub.CheckVerifier(check("nope"), timeout=DEADLINE_S)
    assert not unknown.ok and not unknown.text_only
    assert unknown.error.startswith("unknown verifier 'nope'; known verifiers: ")
    missing = await stub.CheckVerifier(check("tests.no_such_module:score"), timeout=DEADLINE_S)
    assert not missing.ok and "cannot import 'tests.no_such_module'" in missing.error
    refused = await stub.CheckVerifier(check("os:system"), timeout=DEADLINE_S)
    assert not refused.ok and "may not be a plugin" in refused.error


async def test_registry_verifiers_and_plugins_in_one_batch(roomy_stub: reward_pb2_grpc.RewardStub) -> None:
    tests = json.dumps(["assert add(1, 2) == 3", "assert add(2, 2) == 5"])
    items = [
        request("about 3.14159", "3.1416", "numeric"),
        request("so \\boxed{\\frac{1}{2}}", "0.5", "math"),
        request("```python\ndef add(a, b):\n    return a + b\n```", tests, "code"),
        request("23", "231", PLUGIN),
        request("231", "231", "tests.unit.test_verifiers:raising_plugin"),
    ]
    reply = await roomy_stub.ScoreBatch(reward_pb2.ScoreBatchRequest(items=items), timeout=DEADLINE_S + 1)
    numeric, math, code, plugin, raising = reply.results
    assert (numeric.reward, numeric.info["parsed"], numeric.error) == (0.0, "3.14159", "")  # outside 1e-6
    assert (math.reward, dict(math.components), math.error) == (1.0, {"correct": 1.0, "parsed": 1.0}, "")
    assert (code.reward, code.components["test:0"], code.components["test:1"]) == (0.5, 1.0, 0.0)
    assert (plugin.reward, dict(plugin.components), plugin.error) == (0.5, {"gap": 1.0}, "")
    assert (raising.reward, raising.error) == (
        0.0,
        "plugin 'tests.unit.test_verifiers:raising_plugin' failed: RuntimeError: the judge is out to lunch",
    )


async def test_the_service_process_scores(python: str, python_env: dict[str, str], redis_url: str) -> None:
    proc, port = start(python, python_env, ["services.reward"], "VERST_REWARD_PORT", redis_url)
    try:
        async with channel(f"127.0.0.1:{port}") as client:
            health = health_pb2_grpc.HealthStub(client)
            check = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            status = await health.Check(check, timeout=30, wait_for_ready=True)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            reply = await reward_pb2_grpc.RewardStub(client).ScoreBatch(
                reward_pb2.ScoreBatchRequest(
                    items=[
                        request("231", "231"),
                        request("22", "231"),
                        request("\\boxed{0.5}", "1/2", "math"),  # a worker process of the service
                        request("23", "231", PLUGIN),
                    ]
                ),
                timeout=30,  # the math worker's first start imports sympy
            )
    finally:
        code, output = stop(proc)
    assert [(r.reward, r.error) for r in reply.results] == [(1.0, ""), (0.0, ""), (1.0, ""), (0.5, "")]
    assert code == 0, output


async def test_the_reward_recipe_scores_through_the_service(roomy_stub: reward_pb2_grpc.RewardStub) -> None:
    """docs/extending.md's reward function, named by its module:function, scored by the service."""
    name = "examples.plugins.reward:close_enough"
    check = await roomy_stub.CheckVerifier(reward_pb2.CheckVerifierRequest(verifier=name), timeout=DEADLINE_S)
    assert check.ok, check.error
    items = [
        request("the sum is 132", "132", name),
        request("130", "132", name),
        request("none", "132", name),
    ]
    reply = await roomy_stub.ScoreBatch(reward_pb2.ScoreBatchRequest(items=items), timeout=DEADLINE_S)
    exact, close, missing = reply.results
    assert (exact.reward, dict(exact.components), exact.info["parsed"]) == (
        1.0,
        {"parsed": 1.0, "exact": 1.0},
        "132",
    )
    assert close.reward == pytest.approx(1 / (1 + 2 / 132)) and close.components["exact"] == 0.0
    assert (missing.reward, missing.error, missing.info["why"]) == (0.0, "", "no number")
