"""Evaluations (services/controller/evaluation.py) of several held-out sets, greedy and with sampled
answers for mean@n and pass@k, their prompts encoded as the training prompts are; and they survive
their engine or router dying mid-call: each failed call is made again, within bounded attempts, and
only when every attempt fails is the evaluation lost, with an error. Real gRPC servers stand in for
the router and the reward service (tests/integration/fake_services.py)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.common.bus import Bus
from services.common.config import DEFAULT_EVAL_SET, JobSpec
from services.common.grpc_client import channel
from services.common.jobs import SUCCEEDED
from services.common.pb import common_pb2, reward_pb2_grpc, rollout_pb2, router_pb2, router_pb2_grpc
from services.common.redis_server import free_port
from services.controller.controller import Controller
from services.controller.eval_scores import pass_at_k
from services.controller.evaluation import (
    DUE_VERSION,
    SERVED_VERSION,
    SERVED_VERSION_MAX,
    EvalError,
    EvalSet,
    Evaluator,
    dues_without_result,
    encode_eval_set,
    prepare_eval_sets,
)
from services.controller.feed import PromptFeed
from services.data import DataError, eval_prompts
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


class LaggingEngineRouter(FakeRouter):
    """Two engines of the job: one serves ``version``, the other is still on ``lagging``. Requests
    alternate between them; one the lagging engine cannot serve (its min_policy_version is newer)
    goes to the other, as the router sends it on after that engine's FAILED_PRECONDITION."""

    def __init__(self, tokenizer: Any, lagging: int = 0) -> None:
        super().__init__(tokenizer)
        self.lagging = lagging
        self.turn = 0

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: Any
    ) -> rollout_pb2.GenerateResponse:
        self.turn += 1
        old = self.turn % 2 == 0 and request.min_policy_version <= self.lagging
        response = await super().Generate(request, context)
        if old:
            for completion in response.completions:
                completion.policy_versions[:] = [self.lagging] * len(completion.token_ids)
        return response

    async def ListEngines(
        self, request: router_pb2.ListEnginesRequest, context: Any
    ) -> router_pb2.ListEnginesResponse:
        reply = await super().ListEngines(request, context)
        lagging = common_pb2.EngineInfo(
            engine_id="lagging-engine", job_id=self.job_id, policy_version=self.lagging,
            state=common_pb2.ENGINE_STATE_SERVING,
        )  # fmt: skip
        reply.engines.append(lagging)
        return reply


def spec(**more: Any) -> JobSpec:
    return JobSpec.model_validate(
        {"eval": {"num_prompts": PROMPTS}, "rollout": {"max_new_tokens": 6}, **more}
    )


def default_set(tokenizer: Any) -> list[EvalSet]:
    return [encode_eval_set(DEFAULT_EVAL_SET, eval_prompts(spec().data, PROMPTS), spec(), tokenizer)]


def knowing(router: FakeRouter) -> FakeRouter:
    """The router's engine serves version 3 of the job and knows every answer."""
    router.job_id, router.version = JOB, 3
    router.correct_at_version = lambda a, b, version: True
    return router


async def evaluator(
    router_address: str,
    reward_address: str,
    attempts: int = 3,
    job_spec: JobSpec | None = None,
    retry_s: float = 0.0,
) -> Evaluator:
    return Evaluator(
        router_pb2_grpc.RouterStub(channel(router_address)),
        reward_pb2_grpc.RewardStub(channel(reward_address)),
        job_spec or spec(),
        JOB,
        concurrency=4,
        attempts=attempts,
        retry_s=retry_s,
        engine_timeout_s=10.0,
    )


async def test_a_generate_whose_engine_died_is_made_again(
    tokenizer: Any, reward: tuple[FakeReward, str]
) -> None:
    router = knowing(DyingEngineRouter(tokenizer))
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s))
    try:
        evaluation = await evaluator(address, reward[1])
        result = await evaluation.evaluate(3, default_set(tokenizer), tokenizer)
    finally:
        await server.stop(None)
    scores = result.sets[DEFAULT_EVAL_SET]
    assert (result.version, scores.accuracy, scores.errors, scores.num_prompts) == (3, 1.0, 0, PROMPTS)
    assert evaluation.retries == PROMPTS and set(router.attempts.values()) == {2}
    retried = sorted(r.request_id for r in router.requests)
    assert retried == sorted(f"{JOB}:eval:v3:{i}:retry1" for i in range(PROMPTS))
    assert all(r.session_id == r.request_id for r in router.requests), "no affinity to the dead engine"


async def test_an_evaluation_is_labelled_with_the_version_its_engines_served(
    tokenizer: Any, reward: tuple[FakeReward, str]
) -> None:
    """The controller asks for version 0 (a final evaluation whose trainer's status lagged, say)
    while one engine serves version 5 and another is still on 0: every answer comes from version
    5, the version the engines serve as it starts, and the evaluation says so."""
    router = knowing(LaggingEngineRouter(tokenizer))
    router.version = 5
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s))
    try:
        evaluation = await evaluator(address, reward[1])
        served = await evaluation.wait_for_version(0, 5.0)  # as JobEvals.evaluate asks
        result = await evaluation.evaluate(0, default_set(tokenizer), tokenizer, served=served)
    finally:
        await server.stop(None)
    assert (served, result.version, result.newest_version) == (5, 5, 5)
    assert result.metric_values()[SERVED_VERSION] == 5
    assert {r.min_policy_version for r in router.requests} == {5}
    assert len(router.requests) == PROMPTS


async def test_an_evaluation_outlives_a_router_restart_mid_call(
    tokenizer: Any, reward: tuple[FakeReward, str]
) -> None:
    port = free_port()
    router = knowing(FakeRouter(tokenizer))
    router.delay_s = 1.0
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s), port)
    evaluation = await evaluator(address, reward[1])
    running = asyncio.create_task(evaluation.evaluate(3, default_set(tokenizer), tokenizer))
    await asyncio.sleep(0.3)
    await server.stop(None)  # the router dies with four calls in flight
    await asyncio.sleep(1.0)
    router.delay_s = 0.0
    server, _ = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s), port)
    try:
        result = await asyncio.wait_for(running, 30)
    finally:
        await server.stop(None)
    assert (result.sets[DEFAULT_EVAL_SET].accuracy, result.sets[DEFAULT_EVAL_SET].errors) == (1.0, 0)
    assert evaluation.retries >= 4


async def test_an_evaluation_is_lost_only_after_every_attempt_failed(
    tokenizer: Any, reward: tuple[FakeReward, str]
) -> None:
    router = knowing(DyingEngineRouter(tokenizer, dying=10))
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s))
    try:
        evaluation = await evaluator(address, reward[1], attempts=2)
        with pytest.raises(EvalError, match="UNAVAILABLE: engine-1: Socket closed"):
            await evaluation.evaluate(3, default_set(tokenizer), tokenizer)
    finally:
        await server.stop(None)
    assert max(router.attempts.values()) == 2, "bounded: two attempts per call"


async def test_a_call_is_made_again_past_its_attempts_while_its_retry_time_lasts(
    tokenizer: Any, reward: tuple[FakeReward, str]
) -> None:
    """An engine killed mid-evaluation takes seconds to come back, longer than two attempts'
    pause: within ``retry_s`` the call goes on being made, so the evaluation is not lost."""
    router = knowing(DyingEngineRouter(tokenizer, dying=3))
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s))
    try:
        evaluation = await evaluator(address, reward[1], attempts=2, retry_s=30.0)
        result = await evaluation.evaluate(3, default_set(tokenizer), tokenizer)
    finally:
        await server.stop(None)
    scores = result.sets[DEFAULT_EVAL_SET]
    assert (scores.accuracy, scores.errors) == (1.0, 0)
    assert set(router.attempts.values()) == {4}, "two attempts, then two more within retry_s"


class ChatRouter(FakeRouter):
    """A FakeRouter that finds the problem inside a chat-rendered prompt."""

    def answer(self, text: str, index: int, greedy: bool) -> str:
        found = re.findall(r"(\d+\+\d+=)", text)
        return super().answer(found[-1], index, greedy)


def addition_rows(path: Path, problems: list[tuple[int, int]]) -> str:
    """A JSONL file of addition prompts, answered as the builtin task answers (the sum reversed)."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)[::-1]} for a, b in problems]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


HARD = [(12, 34), (56, 78), (90, 12), (34, 56)]


async def test_several_sets_with_sampled_answers_report_mean_and_pass_at_k(
    tokenizer: Any, reward: tuple[FakeReward, str], tmp_path: Path
) -> None:
    hard = addition_rows(tmp_path / "hard.jsonl", HARD)
    sampling = {"samples_per_prompt": 4, "pass_k": [1, 2, 4], "temperature": 0.7}
    job = spec(eval={"num_prompts": PROMPTS, "sets": {"hard": {"location": hard}}, **sampling})
    router = knowing(FakeRouter(tokenizer))  # greedy: right; sampled: right for even indices (2 of 4)
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s))
    try:
        evaluation = await evaluator(address, reward[1], job_spec=job)
        result = await evaluation.evaluate(3, prepare_eval_sets(job, tokenizer), tokenizer)
    finally:
        await server.stop(None)

    for name, count in ((DEFAULT_EVAL_SET, PROMPTS), ("hard", len(HARD))):
        scores = result.sets[name]
        assert (scores.accuracy, scores.num_prompts, scores.errors, scores.samples) == (1.0, count, 0, 4)
        assert scores.mean_at_n == 0.5
        assert scores.pass_at == {1: 0.5, 2: pytest.approx(5 / 6), 4: 1.0}
        assert scores.pass_at == {k: pytest.approx(pass_at_k(4, 2, k)) for k in (1, 2, 4)}
    values = result.metric_values()
    assert values["pass@2"] == values["hard/pass@2"] == pytest.approx(5 / 6)
    assert (values["mean@4"], values["hard/accuracy"]) == (0.5, 1.0)
    assert (values[SERVED_VERSION], values[SERVED_VERSION_MAX]) == (3.0, 3.0)

    greedy = {r.request_id for r in router.requests if r.sampling.temperature == 0}
    assert greedy == {f"{JOB}:eval:v3:{i}" for i in range(PROMPTS)} | {
        f"{JOB}:eval:hard:v3:{i}" for i in range(4)
    }
    sampled = [r for r in router.requests if r.sampling.temperature > 0]
    assert len(sampled) == PROMPTS + len(HARD), "one Generate of n per prompt"
    assert all(r.sampling.n == 4 and r.sampling.temperature == pytest.approx(0.7) for r in sampled)
    assert sorted(len(batch.items) for batch in reward[0].batches) == [5] * (PROMPTS + len(HARD))


async def test_eval_prompts_are_encoded_as_the_feed_encodes_training_prompts(
    tokenizer_dir: Path, reward: tuple[FakeReward, str], tmp_path: Path
) -> None:
    """A chat job: every set is rendered by the tokenizer's chat template, system prompt included,
    to exactly the ids the prompt feed gives the same rows for training."""
    from transformers import AutoTokenizer

    chat = AutoTokenizer.from_pretrained(tokenizer_dir)
    chat.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}[assistant] "
    )
    rows = addition_rows(tmp_path / "rows.jsonl", HARD)
    data = {"train": rows, "eval": rows, "shuffle": False, "system_prompt": "Add."}
    job = spec(data=data, rollout={"max_new_tokens": 6, "prompts_per_step": len(HARD)})
    job.eval.sets = {"again": {"location": rows}}  # type: ignore[dict-item]  (validated on assignment)
    trained = {task.prompt_text: list(task.prompt_token_ids) for task in PromptFeed(job, JOB, chat).batch(0)}
    router = knowing(ChatRouter(chat))
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s))
    try:
        evaluation = await evaluator(address, reward[1], job_spec=job)
        sets = prepare_eval_sets(job, chat)
        result = await evaluation.evaluate(3, sets, chat)
    finally:
        await server.stop(None)

    assert chat.decode(list(sets[0].prompts[0])).startswith("[system] Add. [user] 12+34=")
    by_set = {eval_set.name: eval_set for eval_set in sets}
    for request in router.requests:
        name = "again" if ":again:" in request.request_id else DEFAULT_EVAL_SET
        example = by_set[name].examples[int(request.request_id.rsplit(":", 1)[1])]
        assert list(request.prompt_token_ids) == trained[example.text]
    assert len(router.requests) == 2 * len(HARD)
    assert result.sets[DEFAULT_EVAL_SET].accuracy == result.sets["again"].accuracy == 1.0


def test_a_set_that_cannot_be_read_or_encoded_fails_naming_itself(tokenizer: Any, tmp_path: Path) -> None:
    gone = spec(eval={"sets": {"gone": {"location": str(tmp_path / "no.jsonl")}}})
    with pytest.raises(DataError, match=r"eval set 'gone' \(eval\.sets\.gone\.location\): cannot read"):
        prepare_eval_sets(gone, tokenizer)
    long = spec(data={"max_prompt_tokens": 3})
    with pytest.raises(DataError, match=r"eval set 'default': prompt addition:eval:0: prompt is \d+ tokens"):
        prepare_eval_sets(long, tokenizer)


async def test_a_job_evaluates_every_set_with_pass_at_k_end_to_end(
    bus: Bus,
    tmp_path: Path,
    tokenizer_dir: Path,
    services: Services,  # noqa: F811  (fixtures)
    controllers: Controllers,  # noqa: F811
) -> None:
    router = services[0]  # greedy: right when (a + b) % 4 < version; sampled: 2 of 4 right
    hard = addition_rows(tmp_path / "hard.jsonl", HARD)
    spec_eval = {"every_steps": 2, "num_prompts": 12, "sets": {"hard": {"location": hard}}}
    spec_eval |= {"samples_per_prompt": 4, "pass_k": [1, 2]}
    _, trainer = await submit(bus, tokenizer_dir, router, eval=spec_eval)
    await controllers.start()
    await trainer.publish_version(0)
    await eventually(lambda: eval_points(trainer.store, trainer.job_id), "the evaluation of version 0")
    for version in (1, 2, 3, 4):
        router.version = version
        await trainer.publish_version(version)
        if version == 2:
            await eventually(lambda: _evaluated(trainer, 2), "the evaluation of version 2")
    await trainer.report(common_pb2.JOB_STATE_SUCCEEDED, 4)
    await trainer.wait_for_state(SUCCEEDED)

    rows = await trainer.store.history(trainer.job_id, source="eval")
    assert [row.step for row in rows] == [0, 2, 4]
    for row in rows:
        values = row.values
        assert (values[SERVED_VERSION], values[SERVED_VERSION_MAX], values[DUE_VERSION]) == (row.step,) * 3
        assert (values["num_prompts"], values["hard/num_prompts"]) == (12, len(HARD))
        for prefix in ("", "hard/"):
            assert values[f"{prefix}pass@1"] == values[f"{prefix}mean@4"] == 0.5
            assert values[f"{prefix}pass@2"] == pytest.approx(5 / 6)
            assert f"{prefix}pass@4" not in values, "only the k named"
    assert rows[0].values["accuracy"] == rows[0].values["hard/accuracy"] == 0.0, "version 0 knows none"
    assert rows[2].values["accuracy"] == rows[2].values["hard/accuracy"] == 1.0, "version 4 knows all"
    record = await trainer.store.get(trainer.job_id)
    assert record.metrics["eval/accuracy"] == record.metrics["eval/hard/accuracy"] == 1.0
    assert record.metrics["eval/hard/pass@2"] == pytest.approx(5 / 6)


async def _evaluated(trainer: Trainer, version: int) -> bool:
    return version in await eval_points(trainer.store, trainer.job_id)


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
