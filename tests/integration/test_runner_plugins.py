"""A user's rollout strategy and reward shapings in the runner: real Redis, a Runner consuming the
job's prompts, and gRPC servers standing in for the router and reward (fake_services.py).

The strategy is examples/plugins/rollout_strategy.py (a second try after a hint for answers that
are not a number), the shapings DAPO's over-long penalty and examples/plugins/reward_shaping.py
(a bonus for a bare integer), each named in the job's spec as a user would name them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from examples.plugins.rollout_strategy import HINT
from services.common.bus import DATA_FIELD, Bus
from services.common.jobs import JobStore
from services.common.pb import common_pb2, router_pb2_grpc
from services.runner.server import Runner
from tests.helpers import eventually, serve
from tests.integration.fake_services import (
    EOS,
    FakeReward,
    FakeRouter,
    RunningJob,
    logprob,
    running_job,
    trajectories,
)

STRATEGY = "examples.plugins.rollout_strategy:retry_with_hint"
FORMAT_BONUS = "examples.plugins.reward_shaping:format_bonus"
BUDGET = 64
"""max_new_tokens of the tasks here: room for a first answer, the hint and a second answer."""


class HintRouter(FakeRouter):
    """Odd samples first answer "x" (not a number); a prompt that ends with the hint gets the
    right answer (its digits reversed, as the addition task writes them)."""

    def answer(self, text: str, index: int, greedy: bool) -> str:
        a, b = (int(x) for x in text.split("=")[0].split("+"))
        return str(a + b)[::-1] if text.endswith(HINT) or index % 2 == 0 else "x"


@pytest.fixture
async def hint_router(tokenizer: Any) -> AsyncIterator[tuple[HintRouter, str]]:
    fake = HintRouter(tokenizer)
    fake.version = 3
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(fake, s))
    yield fake, address
    await server.stop(None)


async def publish_task(job: RunningJob, text: str = "47+85=", answer: str = "231") -> common_pb2.PromptTask:
    task = job.task(0, text, answer)
    task.sampling.max_new_tokens = BUDGET
    task.max_turns = job.spec.rollout.max_turns
    await job.bus.publish(job.streams.prompts, task)
    return task


async def published(bus: Bus, job: RunningJob, count: int) -> list[common_pb2.Trajectory]:
    """The job's trajectories once ``count`` are published and the task is acked."""

    async def done() -> bool:
        return await bus.redis.xlen(job.streams.trajectories) >= count and await job.pending() == 0

    await eventually(done, what=f"{count} trajectories and the ack")
    return sorted(await trajectories(bus, job.job_id), key=lambda t: t.sample_index)


async def test_a_user_strategy_retries_the_answers_that_are_not_a_number(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    hint_router: tuple[HintRouter, str],
    reward: tuple[FakeReward, str],
    runner_for: Callable[..., Awaitable[Runner]],
) -> None:
    fake_router, router_address = hint_router
    rollout = {"strategy": STRATEGY, "max_turns": 2}
    job = await running_job(bus, JobStore(bus.redis), tokenizer, tokenizer_dir, rollout=rollout)
    task = await publish_task(job)
    await runner_for(router_address=router_address, reward_address=reward[1])

    got = await published(bus, job, 4)
    right = [*tokenizer("231")["input_ids"], EOS]
    wrong = [*tokenizer("x")["input_ids"], EOS]
    hint = list(tokenizer(HINT, add_special_tokens=False)["input_ids"])
    for i, t in enumerate(got):
        assert t.reward == 1.0 == t.verifier_reward and t.reward_error == "", "every sample ends right"
        assert t.finish_reason == common_pb2.FINISH_REASON_STOP and list(t.prompt_token_ids) == list(
            task.prompt_token_ids
        )
        assert (
            len(t.behaviour_logprobs)
            == len(t.policy_versions)
            == len(t.loss_mask)
            == len(t.response_token_ids)
        )
        assert set(t.policy_versions) == {3}
        if i % 2 == 0:  # a number at once: one turn, as the group strategy would publish it
            assert (list(t.response_token_ids), t.num_turns, "hinted" in t.metadata) == (right, 1, False)
            assert list(t.loss_mask) == [True] * len(right)
            continue
        assert list(t.response_token_ids) == [*wrong, *hint, *right], "both tries and the hint, as ids"
        assert list(t.loss_mask) == [True] * len(wrong) + [False] * len(hint) + [True] * len(right)
        expected = [
            *(logprob(i, p) for p in range(len(wrong))),
            *[0.0] * len(hint),
            *(logprob(0, p) for p in range(len(right))),  # the second try is its request's sample 0
        ]
        assert list(t.behaviour_logprobs) == pytest.approx(expected)
        assert (t.num_turns, t.metadata["hinted"]) == (2, "1")

    group, *retries = fake_router.requests
    assert group.sampling.n == 4 and len(retries) == 2
    for index, retry in zip((1, 3), sorted(retries, key=lambda r: r.request_id), strict=True):
        assert retry.request_id == f"{task.prompt_id}:{index}:hint"
        assert list(retry.prompt_token_ids) == [*task.prompt_token_ids, *wrong, *hint], "token-in"
        assert retry.sampling.n == 1 and retry.sampling.max_new_tokens == BUDGET - len(wrong) - len(hint)
        assert (retry.session_id, retry.min_policy_version) == (group.session_id, group.min_policy_version)
    [batch] = reward[0].batches
    assert [item.response_text for item in batch.items] == ["231"] * 4, "the verifier scores the last try"
    assert [item.num_turns for item in batch.items] == [1, 2, 1, 2]


async def test_reward_shapings_apply_in_order_and_keep_the_verifier_reward(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    router: tuple[FakeRouter, str],
    reward: tuple[FakeReward, str],
    runner_for: Callable[..., Awaitable[Runner]],
) -> None:
    shaping = [
        {"type": "overlong_penalty", "max_tokens": 6, "buffer_tokens": 4},
        {"type": FORMAT_BONUS, "bonus": 0.25},
    ]
    job = await running_job(bus, JobStore(bus.redis), tokenizer, tokenizer_dir, reward={"shaping": shaping})
    await publish_task(job)
    await runner_for(router_address=router[1], reward_address=reward[1])

    got = await published(bus, job, 4)
    # even samples: "231" + EOS, 4 tokens, right: 1 - 0.5 (2 past the 2 free tokens of 4) + 0.25;
    # odd samples: "0" + EOS, 2 tokens, wrong: 0 + 0 + 0.25 (a bare integer all the same)
    assert [len(t.response_token_ids) for t in got] == [4, 2, 4, 2]
    assert [t.reward for t in got] == pytest.approx([0.75, 0.25, 0.75, 0.25])
    assert [t.verifier_reward for t in got] == [1.0, 0.0, 1.0, 0.0]
    assert [dict(t.reward_components) for t in got] == [{"correct": r} for r in (1.0, 0.0, 1.0, 0.0)]


@pytest.mark.parametrize(
    ("spec", "says", "why"),
    [
        ({"rollout": {"strategy": "examples.plugins.nowhere:loop"}}, "rollout.strategy", "cannot import"),
        (
            {"reward": {"shaping": [{"type": "examples.plugins.reward_shaping:gone"}]}},
            "reward.shaping.0",
            "has no 'gone'",
        ),
    ],
)
async def test_a_plug_in_that_cannot_be_loaded_dead_letters_the_task_naming_the_field(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    router: tuple[FakeRouter, str],
    reward: tuple[FakeReward, str],
    runner_for: Callable[..., Awaitable[Runner]],
    spec: dict[str, Any],
    says: str,
    why: str,
) -> None:
    job = await running_job(bus, JobStore(bus.redis), tokenizer, tokenizer_dir, **spec)
    task = await publish_task(job)
    await runner_for(router_address=router[1], reward_address=reward[1])

    async def dead_lettered() -> bool:
        return await bus.redis.xlen(job.streams.dead) == 1 and await job.pending() == 0

    await eventually(dead_lettered, what="the dead letter")
    [entry] = await bus.redis.xrange(job.streams.dead)
    letter = common_pb2.DeadLetter.FromString(entry[1][DATA_FIELD])
    assert letter.reason.startswith(f"invalid task: {says}") and why in letter.reason
    assert common_pb2.PromptTask.FromString(letter.payload).prompt_id == task.prompt_id
    assert router[0].requests == [] and await trajectories(bus, job.job_id) == [], "nothing generated"
