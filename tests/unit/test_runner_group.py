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
from services.runner.group import GroupClients, Sample, response_texts, roll_out_group, set_all_true_mask

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
