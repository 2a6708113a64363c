"""A group's samples as the runner scores and publishes them: the text they are scored on (the
engine's when it sent one, as SGLang does, else decoded by the runner; a resumed sample's always
decoded whole) and the loss mask of the model's own tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

import grpc
import pytest

from services.common.config import RolloutConfig
from services.common.pb import common_pb2, reward_pb2, rollout_pb2
from services.runner.batching import CoalescingReward, rpc_error
from services.runner.group import (
    GroupClients,
    Sample,
    finish_group,
    response_texts,
    roll_out_group,
    set_all_true_mask,
)

ABORT = common_pb2.FINISH_REASON_ABORT
LENGTH = common_pb2.FINISH_REASON_LENGTH


class LetterTokenizer:
    """Token id i is the letter chr(ord('a') + i); counts the sequences it decodes."""

    def __init__(self) -> None:
        self.decoded: list[list[int]] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decoded.append(list(ids))
        return "".join(chr(ord("a") + i) for i in ids)


def completion(
    index: int, ids: list[int], finish: int = LENGTH, text: str | None = None
) -> rollout_pb2.Completion:
    n = len(ids)
    return rollout_pb2.Completion(
        index=index,
        token_ids=ids,
        logprobs=[-0.5] * n,
        policy_versions=[1] * n,
        finish_reason=finish,
        text=text,
    )


def test_the_engines_text_is_used_and_only_the_others_are_decoded() -> None:
    tokenizer = LetterTokenizer()
    samples = [
        Sample(completion(0, [0, 1], text="from the engine"), "e"),
        Sample(completion(1, [2, 3]), "e"),
        Sample(completion(2, [], text=""), "e"),  # an empty text is a text: nothing to decode
    ]
    assert response_texts(samples, tokenizer) == ["from the engine", "cd", ""]
    assert tokenizer.decoded == [[2, 3]]


class ScriptedRouter:
    """Answers a group's Generate with ``first``, each resume with the next of ``resumes``."""

    def __init__(self, first: list[rollout_pb2.Completion], resumes: list[rollout_pb2.Completion]) -> None:
        self.first = first
        self.resumes = resumes
        self.requests: list[rollout_pb2.GenerateRequest] = []

    async def Generate(self, request: rollout_pb2.GenerateRequest, timeout: float | None = None):
        self.requests.append(request)
        pieces = [self.resumes.pop(0)] if request.resume_offset else self.first
        return rollout_pb2.GenerateResponse(request_id=request.request_id, completions=pieces, engine_id="e")


class RecordingReward:
    def __init__(self) -> None:
        self.texts: list[str] = []

    async def ScoreBatch(self, request: reward_pb2.ScoreBatchRequest, timeout: float | None = None):
        self.texts += [item.response_text for item in request.items]
        return reward_pb2.ScoreBatchResponse(
            results=[reward_pb2.ScoreResponse(reward=1.0) for _ in request.items]
        )


def clients(router: ScriptedRouter, reward: RecordingReward, tokenizer: LetterTokenizer) -> GroupClients:
    return GroupClients(
        router=router,  # type: ignore[arg-type]
        reward=reward,  # type: ignore[arg-type]
        tokenizer=tokenizer,
        request_timeout_s=5.0,
        reward_timeout_s=5.0,
        retry_s=0.0,
        max_resumes=2,
        serving=lambda: True,
        tools=None,  # type: ignore[arg-type]
        rollout=RolloutConfig(),
    )


def test_a_resumed_sample_is_scored_on_its_whole_response_decoded() -> None:
    task = common_pb2.PromptTask(
        prompt_id="p", group_id="g", job_id="j", prompt_token_ids=[5], n_samples=2,
        sampling=common_pb2.SamplingParams(max_new_tokens=8),
    )  # fmt: skip
    router = ScriptedRouter(
        first=[completion(0, [0, 1], ABORT, text="ab"), completion(1, [7], text="engine text")],
        resumes=[completion(0, [2], text="c")],  # the resume's text is its piece's alone
    )
    reward, tokenizer = RecordingReward(), LetterTokenizer()
    trajectories = asyncio.run(roll_out_group(task, clients(router, reward, tokenizer)))
    assert [list(t.response_token_ids) for t in trajectories] == [[0, 1, 2], [7]]
    assert [list(t.loss_mask) for t in trajectories] == [[True] * 3, [True]]
    assert [list(t.behaviour_logprobs) for t in trajectories] == [[-0.5] * 3, [-0.5]]
    assert [list(t.prompt_token_ids) for t in trajectories] == [[5], [5]]
    assert reward.texts == ["abc", "engine text"]
    assert tokenizer.decoded == [[0, 1, 2]]
    assert len(router.requests) == 2  # the group, then one resume of sample 0 alone


@pytest.mark.parametrize("tokens", [0, 1, 127, 128, 1000, 16_384, 300_000])
def test_an_all_true_mask_is_that_many_trues(tokens: int) -> None:
    trajectory = common_pb2.Trajectory(response_token_ids=[3] * tokens)
    set_all_true_mask(trajectory, tokens)
    assert list(trajectory.loss_mask) == [True] * tokens
    assert common_pb2.Trajectory.FromString(trajectory.SerializeToString()) == trajectory


class CheckingReward:
    """A reward stub whose CheckVerifier says ``text_only``, or fails with ``code``."""

    def __init__(self, text_only: bool, code: grpc.StatusCode | None = None) -> None:
        self.text_only, self.code = text_only, code
        self.checks = 0
        self.items: list[reward_pb2.ScoreRequest] = []

    async def CheckVerifier(self, request: reward_pb2.CheckVerifierRequest, timeout: float | None = None):
        self.checks += 1
        await asyncio.sleep(0.01)  # the groups of a step ask together: one call answers them
        if self.code is not None:
            raise rpc_error(self.code, "cannot tell")
        return reward_pb2.CheckVerifierResponse(ok=True, text_only=self.text_only)

    async def ScoreBatch(self, request: reward_pb2.ScoreBatchRequest, timeout: float | None = None):
        self.items += request.items
        return reward_pb2.ScoreBatchResponse(
            results=[reward_pb2.ScoreResponse(reward=1.0) for _ in request.items]
        )


def score_groups(stub: CheckingReward, groups: int) -> None:
    async def main() -> None:
        reward = CoalescingReward(stub, window_s=0.001, max_calls=64)  # type: ignore[arg-type]
        tasks = [
            common_pb2.PromptTask(prompt_id=f"p{i}", group_id=f"g{i}", job_id="j", prompt_token_ids=[5],
                                  n_samples=1, verifier="exact_match")
            for i in range(groups)
        ]  # fmt: skip
        router = ScriptedRouter(first=[completion(0, [0, 1], text="ab")], resumes=[])
        group_clients = replace(clients(router, RecordingReward(), LetterTokenizer()), reward=reward)
        await asyncio.gather(*(roll_out_group(task, group_clients) for task in tasks))
        await reward.close()

    asyncio.run(main())


def test_token_ids_are_left_out_of_score_requests_for_a_text_only_verifier() -> None:
    stub = CheckingReward(text_only=True)
    score_groups(stub, 4)
    assert stub.checks == 1 and len(stub.items) == 4
    assert all(not item.prompt_token_ids and not item.response_token_ids for item in stub.items)
    assert {item.response_text for item in stub.items} == {"ab"}


@pytest.mark.parametrize("code", [None, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE])
def test_token_ids_are_sent_unless_the_service_says_the_verifier_reads_texts(code) -> None:
    stub = CheckingReward(text_only=False, code=code)
    score_groups(stub, 2)
    assert [list(item.response_token_ids) for item in stub.items] == [[0, 1], [0, 1]]
    assert all(list(item.prompt_token_ids) == [5] for item in stub.items)


class ComponentReward:
    """Scores each item by its index in the batch, with components; keeps the requests."""

    def __init__(self) -> None:
        self.items: list[reward_pb2.ScoreRequest] = []

    async def ScoreBatch(self, request: reward_pb2.ScoreBatchRequest, timeout: float | None = None):
        self.items += list(request.items)
        results = [
            reward_pb2.ScoreResponse(reward=float(i) + 1, components={"correct": float(i), "format": 0.5})
            for i, _ in enumerate(request.items)
        ]
        results[-1].error = "verifier failed"
        return reward_pb2.ScoreBatchResponse(results=results)


def test_every_field_of_a_groups_trajectories_and_score_requests() -> None:
    """Each sample's own fields and the group's shared ones, as a field-by-field reference."""
    task = common_pb2.PromptTask(
        prompt_id="p7", group_id="g7", job_id="j", prompt_token_ids=[5, 6], n_samples=3,
        prompt_text="question", answer="42", verifier="exact", policy_version=4,
        metadata={"source_id": "row-9"}, split=common_pb2.SPLIT_EVAL,
    )  # fmt: skip
    first = completion(0, [0, 1], text="ab")
    second = completion(1, [2], text="c")
    second.error = "engine gave up"
    third = completion(2, [3, 4, 5], text="def")
    samples = [
        Sample(first, "e0", resumes=2, info={"tool_calls": "1"}),
        Sample(second, "e1"),
        Sample(third, "e2", loss_mask=[True, False, True], num_turns=2, final_text="f"),
    ]
    reward = ComponentReward()
    group_clients = clients(None, reward, LetterTokenizer())  # type: ignore[arg-type]
    trajectories = asyncio.run(finish_group(task, samples, group_clients))

    assert [t.id for t in trajectories] == ["p7:0", "p7:1", "p7:2"]
    assert [t.sample_index for t in trajectories] == [0, 1, 2]
    assert [t.engine_id for t in trajectories] == ["e0", "e1", "e2"]
    assert [t.reward for t in trajectories] == [1.0, 0.0, 0.0]  # errors score 0
    errors = ["", "generation failed: engine gave up", "verifier failed"]
    assert [t.reward_error for t in trajectories] == errors
    components = [{"correct": float(i), "format": 0.5} for i in range(3)]
    assert [dict(t.reward_components) for t in trajectories] == components
    assert [t.num_turns for t in trajectories] == [1, 1, 2]
    assert [dict(t.metadata) for t in trajectories] == [
        {"task_policy_version": "4", "resumes": "2", "tool_calls": "1"},
        {"task_policy_version": "4", "resumes": "0"},
        {"task_policy_version": "4", "resumes": "0"},
    ]
    assert [list(t.loss_mask) for t in trajectories] == [[True, True], [True], [True, False, True]]
    assert [list(t.response_token_ids) for t in trajectories] == [[0, 1], [2], [3, 4, 5]]
    for t in trajectories:
        assert (t.job_id, t.prompt_id, t.group_id, t.group_size) == ("j", "p7", "g7", 3)
        assert t.split == common_pb2.SPLIT_EVAL and list(t.prompt_token_ids) == [5, 6]
        assert t.created_at.seconds > 0 and 0 < t.stages.generated <= t.stages.scored
        assert len(t.behaviour_logprobs) == len(t.policy_versions) == len(t.response_token_ids)
    assert trajectories[0].created_at == trajectories[2].created_at, "one stamp for the group"

    assert [item.trajectory_id for item in reward.items] == ["p7:0", "p7:1", "p7:2"]
    assert [item.response_text for item in reward.items] == ["ab", "c", "f"]
    assert [item.num_turns for item in reward.items] == [1, 1, 2]
    assert [dict(item.metadata) for item in reward.items] == [
        {"source_id": "row-9", "tool_calls": "1"},
        {"source_id": "row-9"},
        {"source_id": "row-9", "transcript": "def"},
    ]
    for item in reward.items:
        assert (item.job_id, item.prompt_id, item.prompt_text, item.answer, item.verifier) == (
            "j", "p7", "question", "42", "exact",
        )  # fmt: skip
        assert list(item.prompt_token_ids) == [5, 6], "a stub without text_only gets the ids"
    assert [list(item.response_token_ids) for item in reward.items] == [[0, 1], [2], [3, 4, 5]]


def test_a_group_of_another_split_defaults_to_train() -> None:
    task = common_pb2.PromptTask(prompt_id="p", group_id="g", job_id="j", prompt_token_ids=[5], n_samples=1)
    samples = [Sample(completion(0, [1], text="b"), "e")]
    group_clients = clients(None, RecordingReward(), LetterTokenizer())  # type: ignore[arg-type]
    [trajectory] = asyncio.run(finish_group(task, samples, group_clients))
    assert trajectory.split == common_pb2.SPLIT_TRAIN and trajectory.reward == 1.0
