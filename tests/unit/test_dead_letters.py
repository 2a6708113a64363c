"""How the controller reads a job's dead letters (services/controller/dead_letters.py)."""

from __future__ import annotations

import pytest

from services.common.config import JobSpec
from services.common.pb import common_pb2
from services.common.streams import JobStreams
from services.controller.dead_letters import RepeatedFailures, failure_kind, failure_limit, replaces_work

STREAMS = JobStreams("job-1")


def letter(reason: str, stream: str = STREAMS.prompts, **fields: bool) -> common_pb2.DeadLetter:
    return common_pb2.DeadLetter(source_stream=stream, reason=reason, **fields)


def test_a_failure_kind_masks_what_names_one_entry() -> None:
    a = "invalid task: router: INVALID_ARGUMENT: prompt (7 tokens) + 64 = 71 exceeds 32 positions"
    b = "invalid task: router: INVALID_ARGUMENT: prompt (12 tokens) + 64 = 76 exceeds 32 positions"
    assert failure_kind(a) == failure_kind(b)
    group = "group 'j:0:{}' cannot be trained: trajectory 'j:0:{}:0': scoring failed: reward 1.5e-3"
    assert failure_kind(group.format(1, 1)) == failure_kind(group.format(7, 7))
    assert failure_kind("no group_id") != failure_kind("no id")


def test_prompt_tasks_and_unreported_trajectories_are_replaced() -> None:
    assert replaces_work(letter("x"), STREAMS)
    assert replaces_work(letter("x", STREAMS.trajectories), STREAMS)
    assert not replaces_work(letter("x", STREAMS.trajectories, no_replacement=True), STREAMS)
    assert not replaces_work(letter("x", STREAMS.checkpoints), STREAMS)
    assert not replaces_work(letter("x", JobStreams("job-2").prompts), STREAMS)


def test_the_limit_is_at_least_one_steps_samples() -> None:
    spec = JobSpec.model_validate({"algorithm": {"group_size": 4}, "rollout": {"prompts_per_step": 8}})
    assert failure_limit(16, spec) == 32
    assert failure_limit(100, spec) == 100


def test_one_reason_repeated_to_the_limit_is_named_and_progress_resets_the_count() -> None:
    failures = RepeatedFailures(3)
    assert failures.add(letter("prompt 1 too long")) is None
    assert failures.add(letter("something else")) is None
    assert failures.add(letter("prompt 2 too long")) is None
    failures.progress()
    assert failures.add(letter("prompt 3 too long")) is None
    assert failures.add(letter("prompt 4 too long")) is None
    reason = failures.add(letter("prompt 5 too long"))
    assert reason == (
        "the same failure repeated: 3 entries dead-lettered for it without a new policy version "
        "(the last from the prompts stream): prompt 5 too long"
    )
    with pytest.raises(ValueError):
        RepeatedFailures(0)
