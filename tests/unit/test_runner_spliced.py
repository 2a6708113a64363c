"""Trajectories spliced from the engine's bytes (services/runner/spliced.py): a trajectory stream's
consumer parses exactly what the runner built field by field before, whatever the group; the
runner's later stages read and write them as Trajectories; and a reply whose arrays are encoded
unpacked (which the format allows) loses nothing."""

from __future__ import annotations

import asyncio

import pytest

from services.common.pb import common_pb2, reward_pb2, rollout_pb2
from services.common.wire import record, varint
from services.runner.batching import CoalescingRouter
from services.runner.group import roll_out_group, roll_out_group_spliced
from services.runner.spliced import SplicedTrajectory, array_lengths, packed_batch, token_ids, varint_count
from services.runner.strategy import check_trajectories
from tests.unit.test_runner_group import (
    LetterTokenizer,
    RecordingReward,
    ScriptedRouter,
    clients,
    completion,
)

STOP = common_pb2.FINISH_REASON_STOP


class ComponentReward(RecordingReward):
    """Scores with components; the last item of each batch fails its verifier."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[reward_pb2.ScoreRequest] = []

    async def ScoreBatch(self, request: reward_pb2.ScoreBatchRequest, timeout: float | None = None):
        self.items += request.items
        results = [
            reward_pb2.ScoreResponse(reward=0.5 + i, components={"correct": float(i)})
            for i in range(len(request.items))
        ]
        results[-1].error = "verifier failed"
        return reward_pb2.ScoreBatchResponse(results=results)


def group() -> list[rollout_pb2.Completion]:
    """Texts sent and not, an engine error, an empty sample, ids past one varint byte."""
    failed = completion(1, [2], text="c")
    failed.error = "engine gave up"
    long = completion(3, [300, 70_000, 5] * 50, finish=STOP)
    long.logprobs[:] = [-0.25 * (i % 7) for i in range(len(long.token_ids))]
    long.policy_versions[:] = [3 + i // 100 for i in range(len(long.token_ids))]
    return [
        completion(2, [3, 4, 5]),
        failed,
        completion(0, [0, 1], text="ab"),
        completion(4, [], text=""),
        long,
    ]


def stamped_alike(trajectory: common_pb2.Trajectory) -> common_pb2.Trajectory:
    """The trajectory with the times that differ between two runs set to one value."""
    trajectory.created_at.Clear()
    trajectory.stages.generated = trajectory.stages.scored = 1.0
    return trajectory


def task(n: int) -> common_pb2.PromptTask:
    return common_pb2.PromptTask(
        prompt_id="p7", group_id="g7", job_id="j", prompt_token_ids=[5, 6], n_samples=n,
        prompt_text="question", answer="42", verifier="exact", policy_version=4,
        metadata={"source_id": "row-9"}, split=common_pb2.SPLIT_EVAL,
    )  # fmt: skip


@pytest.mark.parametrize("text_only", [False, True])
def test_the_spliced_bytes_parse_as_the_trajectories_built_field_by_field(
    text_only: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def says(reward: object, verifier: str) -> bool:
        return text_only

    monkeypatch.setattr("services.runner.group.text_only", says)
    built, spliced, scored = [], [], []
    for roll_out, out in ((roll_out_group, built), (roll_out_group_spliced, spliced)):
        reward = ComponentReward()
        router = ScriptedRouter(first=group(), resumes=[])
        out += asyncio.run(roll_out(task(5), clients(router, reward, LetterTokenizer())))
        scored.append(reward.items)

    assert all(isinstance(t, SplicedTrajectory) for t in spliced)
    parsed = [common_pb2.Trajectory.FromString(t.SerializeToString()) for t in spliced]
    assert [stamped_alike(t) for t in parsed] == [stamped_alike(t) for t in built]
    assert scored[0] == scored[1], "the same ScoreRequests, token ids included unless text-only"
    ids = [len(item.response_token_ids) for item in scored[1]]
    assert ids == ([0] * 5 if text_only else [2, 1, 3, 150, 0])
    check_trajectories("group", task(5), spliced)


def test_a_spliced_trajectory_reads_and_writes_as_a_trajectory() -> None:
    head = common_pb2.Trajectory(id="p:0", prompt_id="p", reward=1.0)
    packed = rollout_pb2.PackedCompletion.FromString(completion(0, [7, 300, 9]).SerializeToString())
    trajectory = SplicedTrajectory(head, packed)
    assert array_lengths(trajectory) == (3, 3, 3, 3)

    trajectory.reward = 0.25  # a shaping's
    trajectory.metadata["strategy"] = "group"
    trajectory.stages.published = 2.0
    before = common_pb2.Trajectory.FromString(trajectory.SerializeToString())
    assert (before.reward, before.metadata["strategy"], before.stages.published) == (0.25, "group", 2.0)
    assert list(before.response_token_ids) == [7, 300, 9] and list(before.loss_mask) == [True] * 3

    assert list(trajectory.response_token_ids) == [7, 300, 9], "reading an array parses the tail in"
    assert trajectory.SerializeToString() == before.SerializeToString(), "and nothing twice"
    assert array_lengths(trajectory) == (3, 3, 3, 3)


def test_varints_are_counted_by_their_last_bytes() -> None:
    values = [0, 1, 127, 128, 16_383, 16_384, 2**31 - 1, 2**40]
    assert varint_count(b"".join(varint(v) for v in values)) == len(values)


def unpacked(number: int, values: list[int]) -> bytes:
    """A repeated varint field as one record per element, as an old or foreign encoder may send it."""
    return b"".join(varint(number << 3) + varint(v) for v in values)


def test_a_reply_with_unpacked_arrays_is_read_whole() -> None:
    whole = completion(0, [3, 300, 4])
    ids = list(whole.token_ids)
    whole.ClearField("token_ids")
    raw = whole.SerializeToString() + unpacked(rollout_pb2.Completion.TOKEN_IDS_FIELD_NUMBER, ids)
    response = rollout_pb2.GenerateResponse(request_id="r").SerializeToString() + record(2, raw)
    data = record(1, record(1, response))  # a GenerateBatchResponse of one result
    assert (
        list(rollout_pb2.GenerateBatchResponse.FromString(data).results[0].response.completions[0].token_ids)
        == ids
    )

    [got] = packed_batch(data).results[0].response.completions
    assert varint_count(got.token_ids) == 3 and len(got.logprobs) == 12
    assert token_ids(got) == ids


def test_a_reply_whose_arrays_come_in_pieces_is_read_whole() -> None:
    """Each array packed in two records (a merge of two encodings does that): the packed view
    would keep the last piece of each, aligned, so only the size check sees what was lost."""
    first, second = completion(0, [3, 300]), completion(0, [4, 5])
    first.ClearField("text")
    second.ClearField("text")
    raw = first.SerializeToString() + second.SerializeToString()
    response = rollout_pb2.GenerateResponse(request_id="r").SerializeToString() + record(2, raw)
    data = record(1, record(1, response)) + record(
        1, record(1, rollout_pb2.GenerateResponse().SerializeToString())
    )
    parsed = rollout_pb2.GenerateBatchResponse.FromString(data)
    assert list(parsed.results[0].response.completions[0].token_ids) == [3, 300, 4, 5]

    view = packed_batch(data)
    [got] = view.results[0].response.completions
    assert token_ids(got) == [3, 300, 4, 5]
    assert len(got.logprobs) == 16 and varint_count(got.policy_versions) == 4
    assert len(view.results) == 2


def test_a_whole_reply_is_read_as_it_came() -> None:
    batch = rollout_pb2.GenerateBatchResponse()
    for request in range(3):
        batch.results.add().response.CopyFrom(
            rollout_pb2.GenerateResponse(request_id=f"r{request}", completions=[completion(0, [1] * 200)])
        )
    batch.results.add(code=5, details="no such job")
    data = batch.SerializeToString()
    view = packed_batch(data)
    assert view.SerializeToString() == data


class BatchStub:
    """A router stub whose GenerateBatch answers each request with one completion."""

    async def GenerateBatch(self, batch: rollout_pb2.GenerateBatchRequest, timeout: float | None = None):
        return rollout_pb2.GenerateBatchResponse(
            results=[
                rollout_pb2.GenerateResult(
                    response=rollout_pb2.GenerateResponse(
                        request_id=r.request_id, completions=[completion(0, [1, 2], text="bc")]
                    )
                )
                for r in batch.requests
            ]
        )


def test_the_coalescing_router_answers_packed_and_parsed() -> None:
    async def both() -> tuple[rollout_pb2.PackedGenerateResponse, rollout_pb2.GenerateResponse]:
        router = CoalescingRouter(BatchStub(), window_s=0.001, max_calls=2)  # type: ignore[arg-type]
        packed, parsed = await asyncio.gather(
            router.GeneratePacked(rollout_pb2.GenerateRequest(request_id="a"), timeout=5),
            router.Generate(rollout_pb2.GenerateRequest(request_id="b"), timeout=5),
        )
        return packed, parsed

    packed, parsed = asyncio.run(both())
    assert packed.request_id == "a" and token_ids(packed.completions[0]) == [1, 2]
    assert parsed.request_id == "b" and list(parsed.completions[0].token_ids) == [1, 2]
