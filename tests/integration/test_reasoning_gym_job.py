"""A job on reasoning-gym's chain_sum: the real controller issues its prompts and evaluates it, a
real runner rolls them out, and verst's real reward service scores every answer with the
``reasoning_gym`` verifier, from the row's metadata that travels with each prompt (real Redis; the
router is a fake that answers the questions). A bad dataset or option fails the job at once."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from services.common.bus import Bus
from services.common.jobs import FAILED, RUNNING, JobStore
from services.common.pb import router_pb2_grpc
from services.data import PromptExample, encode_prompt, eval_prompts, train_prompts
from services.data import reasoning_gym as gym
from services.runner.server import Runner
from tests.helpers import eventually, serve
from tests.integration.fake_services import CountingReward, FakeRouter, trajectories
from tests.integration.test_controller import Controllers, eval_points, submit

DATA = {
    "train": "reasoning_gym:chain_sum",
    "eval": "reasoning_gym:chain_sum",
    "options": {"size": 50, "eval_size": 8, "min_terms": 2, "max_terms": 3, "max_digits": 2},
}
JOB = {
    "data": DATA,
    "reward": {"verifier": "reasoning_gym"},
    "eval": {"every_steps": 2, "num_prompts": 8},
}


class GymRouter(FakeRouter):
    """Answers the questions it was told of in reasoning-gym's answer tags: a training sample right
    when its index is even, a greedy (held-out) answer right for the first ``version`` held-out
    questions of every four."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.rows: dict[str, tuple[str, int]] = {}

    def learn(self, examples: list[PromptExample], data: Any) -> None:
        for position, example in enumerate(examples):
            ids = encode_prompt(self.tokenizer, example, settings=data)
            self.rows[self.tokenizer.decode(ids, skip_special_tokens=True)] = (example.answer, position)

    def answer(self, text: str, index: int, greedy: bool) -> str:
        answer, position = self.rows[text]
        right = position % 4 < self.version if greedy else index % 2 == 0
        return f"<answer>{answer if right else int(answer) + 1}</answer>"


@pytest.fixture
async def gym_router(tokenizer: Any) -> AsyncIterator[tuple[GymRouter, str]]:
    fake = GymRouter(tokenizer)
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(fake, s))
    yield fake, address
    await server.stop(None)


@pytest.fixture
async def controllers(
    bus: Bus, gym_router: tuple[GymRouter, str], builtin_reward: tuple[CountingReward, str]
) -> AsyncIterator[Controllers]:
    controllers = Controllers(bus, (gym_router[0], gym_router[1], builtin_reward[0], builtin_reward[1]))
    yield controllers
    for controller_id in list(controllers.running):
        stop, task = controllers.running.pop(controller_id)
        stop.set()
        await task


async def test_reasoning_gym_prompts_are_issued_rolled_out_and_scored_by_their_dataset(
    bus: Bus,
    tokenizer_dir: Path,
    gym_router: tuple[GymRouter, str],
    builtin_reward: tuple[CountingReward, str],
    controllers: Controllers,
    runner_for: Callable[..., Awaitable[Runner]],
) -> None:
    fake = gym_router[0]
    spec, trainer = await submit(bus, tokenizer_dir, fake, **JOB)
    train = list(itertools.islice(train_prompts(spec.data, spec.seed), 50))
    held_out = eval_prompts(spec.data, 8)
    fake.learn(train + held_out, spec.data)
    await controllers.start()
    await trainer.publish_version(0)
    await trainer.wait_for_state(RUNNING)
    prompts = await trainer.wait_for_prompts(4)

    assert [p.metadata["source_prompt_id"] for p in prompts] == [e.prompt_id for e in train[:4]]
    for prompt, example in zip(prompts, train, strict=False):
        assert (prompt.answer, prompt.verifier) == (example.answer, "reasoning_gym")
        assert {key: prompt.metadata[key] for key in gym.ROW_KEYS} == dict(example.metadata)

    await runner_for(router_address=gym_router[1], reward_address=builtin_reward[1])
    await eventually(lambda: _at_least(bus, trainer.job_id, 8), what="the trajectories of 4 prompts")
    scored = await trajectories(bus, trainer.job_id)
    assert all(not t.reward_error for t in scored), [t.reward_error for t in scored]
    assert sorted((t.sample_index, t.reward) for t in scored) == [(0, 1.0)] * 4 + [(1, 0.0)] * 4
    assert all(t.reward_components["correct"] == t.reward for t in scored)

    # Held-out accuracy is the verifier's: the first `version` of every four questions are right.
    for version in (1, 2):
        fake.version = version
        await trainer.publish_version(version)
    await eventually(lambda: _has_eval(trainer.store, trainer.job_id, 2), what="the evaluation of v2")
    assert await eval_points(trainer.store, trainer.job_id) == {0: 0.0, 2: 0.5}
    assert set(builtin_reward[0].jobs) == {trainer.job_id}


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"train": "reasoning_gym:chain_summ"}, "data.train: reasoning-gym has no dataset 'chain_summ'"),
        ({"options": {"min_terms": 0}}, "data.options: reasoning-gym's chain_sum refuses {'min_terms': 0}"),
        ({"options": {"digits": 3}}, "data.options: reasoning-gym's chain_sum takes no digits"),
    ],
)
async def test_a_bad_dataset_or_option_fails_the_job_naming_the_field(
    bus: Bus,
    tokenizer_dir: Path,
    gym_router: tuple[GymRouter, str],
    controllers: Controllers,
    data: dict[str, Any],
    named: str,
) -> None:
    _, trainer = await submit(bus, tokenizer_dir, gym_router[0], **{**JOB, "data": {**DATA, **data}})
    await controllers.start()
    await trainer.publish_version(0)
    await trainer.wait_for_state(FAILED)
    assert named in (await trainer.store.get(trainer.job_id)).reason
    assert await trainer.prompts() == []


async def _at_least(bus: Bus, job_id: str, count: int) -> bool:
    return len(await trajectories(bus, job_id)) >= count


async def _has_eval(store: JobStore, job_id: str, step: int) -> bool:
    return step in await eval_points(store, job_id)
