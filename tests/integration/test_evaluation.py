"""Evaluations survive their engine or router dying mid-call (services/controller/evaluation.py): each
failed call is made again, within bounded attempts, and only when every attempt fails is the
evaluation lost, with an error. Real gRPC servers stand in for the router and the reward service
(tests/integration/fake_services.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.common.bus import Bus
from services.common.config import JobSpec
from services.common.grpc_client import channel
from services.common.jobs import SUCCEEDED
from services.common.pb import common_pb2, reward_pb2_grpc, rollout_pb2, router_pb2_grpc
from services.common.redis_server import free_port
from services.controller.controller import Controller
from services.controller.evaluation import DUE_VERSION, EvalError, Evaluator, dues_without_result
from services.data import PromptExample, eval_prompts
from tests.helpers import eventually, serve
from tests.integration.fake_services import FakeReward, FakeRouter
from tests.integration.test_controller import (  # noqa: F401  (fixtures)
    Controllers,
    Services,
    Trainer,
    controllers,
    eval_points,
    services,
    submit,
)

JOB = "job-eval"
PROMPTS = 6


class DyingEngineRouter(FakeRouter):
    """The first ``dying`` attempts of every request fail mid-call, as when the engine serving
    them is killed; later ones are answered (by another engine)."""

    def __init__(self, tokenizer: Any, dying: int = 1) -> None:
        super().__init__(tokenizer)
        self.dying = dying
        self.attempts: dict[str, int] = {}

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: Any
    ) -> rollout_pb2.GenerateResponse:
        first = request.request_id.split(":retry")[0]
        self.attempts[first] = self.attempts.get(first, 0) + 1
        if self.attempts[first] <= self.dying:
            await asyncio.sleep(0.05)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine-1: Socket closed")
        return await super().Generate(request, context)


def spec() -> JobSpec:
    return JobSpec.model_validate({"eval": {"num_prompts": PROMPTS}, "rollout": {"max_new_tokens": 6}})


def examples() -> list[PromptExample]:
    return eval_prompts(spec().data, PROMPTS)


def knowing(router: FakeRouter) -> FakeRouter:
    """The router's engine serves version 3 of the job and knows every answer."""
    router.job_id, router.version = JOB, 3
    router.correct_at_version = lambda a, b, version: True
    return router


async def evaluator(router_address: str, reward_address: str, attempts: int = 3) -> Evaluator:
    return Evaluator(
        router_pb2_grpc.RouterStub(channel(router_address)),
        reward_pb2_grpc.RewardStub(channel(reward_address)),
        spec(),
        JOB,
        concurrency=4,
        attempts=attempts,
        engine_timeout_s=10.0,
    )


async def test_a_generate_whose_engine_died_is_made_again(
    tokenizer: Any, reward: tuple[FakeReward, str]
) -> None:
    router = knowing(DyingEngineRouter(tokenizer))
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s))
    try:
        evaluation = await evaluator(address, reward[1])
        result = await evaluation.evaluate(3, examples(), tokenizer)
    finally:
        await server.stop(None)
    assert (result.version, result.accuracy, result.errors, result.num_prompts) == (3, 1.0, 0, PROMPTS)
    assert evaluation.retries == PROMPTS and set(router.attempts.values()) == {2}
    retried = sorted(r.request_id for r in router.requests)
    assert retried == sorted(f"{JOB}:eval:v3:{i}:retry1" for i in range(PROMPTS))
    assert all(r.session_id == r.request_id for r in router.requests), "no affinity to the dead engine"


async def test_an_evaluation_outlives_a_router_restart_mid_call(
    tokenizer: Any, reward: tuple[FakeReward, str]
) -> None:
    port = free_port()
    router = knowing(FakeRouter(tokenizer))
    router.delay_s = 1.0
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s), port)
    evaluation = await evaluator(address, reward[1])
    running = asyncio.create_task(evaluation.evaluate(3, examples(), tokenizer))
    await asyncio.sleep(0.3)
    await server.stop(None)  # the router dies with four calls in flight
    await asyncio.sleep(1.0)
    router.delay_s = 0.0
    server, _ = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s), port)
    try:
        result = await asyncio.wait_for(running, 30)
    finally:
        await server.stop(None)
    assert (result.accuracy, result.errors) == (1.0, 0)
    assert evaluation.retries >= 4


async def test_an_evaluation_is_lost_only_after_every_attempt_failed(
    tokenizer: Any, reward: tuple[FakeReward, str]
) -> None:
    router = knowing(DyingEngineRouter(tokenizer, dying=10))
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s))
    try:
        evaluation = await evaluator(address, reward[1], attempts=2)
        with pytest.raises(EvalError, match="UNAVAILABLE: engine-1: Socket closed"):
            await evaluation.evaluate(3, examples(), tokenizer)
    finally:
        await server.stop(None)
    assert max(router.attempts.values()) == 2, "bounded: two attempts per call"


async def test_an_evaluation_running_when_its_api_died_is_made_by_the_next_one(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,  # noqa: F811  (fixtures)
    controllers: Controllers,  # noqa: F811
) -> None:
    router = services[0]
    trainer, first = await _evaluating_version_2(
        bus, tokenizer_dir, router, controllers, delay_s=30.0, consumer="controller-before"
    )  # the evaluation of version 2 hangs in its engine
    await controllers.stop(first)  # the api process goes away with it
    assert await eval_points(trainer.store, trainer.job_id) == {}

    router.delay_s = 0.0
    await controllers.start(consumer="controller-after")
    await eventually(lambda: eval_points(trainer.store, trainer.job_id), "the evaluation made again")
    assert (await eval_points(trainer.store, trainer.job_id)).keys() == {2}


async def test_an_evaluation_running_when_training_ends_finishes_before_the_final_one(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,  # noqa: F811  (fixtures)
    controllers: Controllers,  # noqa: F811
) -> None:
    router = services[0]
    trainer, _ = await _evaluating_version_2(bus, tokenizer_dir, router, controllers, delay_s=2.0)
    for version in (3, 4):
        await trainer.publish_version(version)
    await trainer.report(common_pb2.JOB_STATE_SUCCEEDED, 4)  # while it runs

    await eventually(lambda: eval_points(trainer.store, trainer.job_id), "the evaluation of version 2")
    assert (await eval_points(trainer.store, trainer.job_id)).keys() == {2}
    router.delay_s, router.version = 0.0, 4
    await trainer.wait_for_state(SUCCEEDED)
    assert (await eval_points(trainer.store, trainer.job_id)).keys() == {2, 4}


async def test_one_evaluation_of_a_newer_version_serves_two_dues_and_names_the_first(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,  # noqa: F811  (fixtures)
    controllers: Controllers,  # noqa: F811
) -> None:
    """The engines lag the trainer (killed, or Redis was down): the evaluations due at 2 and 4
    both wait, and once an engine serves version 4 one evaluation of it covers both dues."""
    router = services[0]
    spec_eval = {"at_start": False, "every_steps": 2, "num_prompts": 12}
    _, trainer = await submit(bus, tokenizer_dir, router, trainer={"steps": 6}, eval=spec_eval)
    controller = await controllers.start()
    for version in range(5):
        await trainer.publish_version(version)
    await trainer.wait_for_prompts(12)  # batches up to 5 out: the driver saw every handle
    assert await eval_points(trainer.store, trainer.job_id) == {}, "no engine serves version 2 yet"

    router.version = 4

    async def covered() -> bool:
        registry = controller.metrics.registry
        return registry.get_sample_value("verst_controller_evaluations_total", {"outcome": "covered"}) == 1

    await eventually(covered, "the due at 4 found version 4 evaluated")
    rows = await trainer.store.history(trainer.job_id, source="eval")
    assert [(row.step, row.values[DUE_VERSION]) for row in rows] == [(4, 2.0)]
    assert dues_without_result([(row.step, row.values[DUE_VERSION]) for row in rows], [2, 4], 2) == []


async def _evaluating_version_2(
    bus: Bus,
    tokenizer_dir: Path,
    router: FakeRouter,
    controllers: Controllers,  # noqa: F811
    delay_s: float,
    consumer: str = "",
) -> tuple[Trainer, Controller]:
    """A job evaluated every 2 versions whose trainer reached version 2, and a controller whose
    evaluation of it is running (each Generate taking ``delay_s``)."""
    spec_eval = {"at_start": False, "every_steps": 2, "num_prompts": 12}
    _, trainer = await submit(bus, tokenizer_dir, router, eval=spec_eval)
    controller = await controllers.start(consumer=consumer)
    await trainer.publish_version(0)
    await trainer.wait_for_prompts(4)
    router.delay_s, router.version = delay_s, 2
    for version in (1, 2):
        await trainer.publish_version(version)
    await eventually(lambda: _greedy_calls(router), "the evaluation of version 2 running")
    return trainer, controller


async def _greedy_calls(router: FakeRouter) -> bool:
    return any(r.sampling.temperature == 0 for r in router.requests)
