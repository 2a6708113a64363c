"""The trainer's choice of torch threads over a job's first steps (services/trainer/threads.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from services.trainer.threads import TORCH_DEFAULT_THREADS, ThreadChoice, candidates, job_threads


def test_the_candidates_are_the_threads_and_half_of_them_when_tuning() -> None:
    assert candidates(8, tune=True) == (8, 4)
    assert candidates(3, tune=True) == (3, 1)
    assert candidates(2, tune=True) == (2, 1)
    assert candidates(1, tune=True) == (1,)
    assert candidates(8, tune=False) == (8,)


def test_each_job_starts_from_the_configured_threads_not_the_last_jobs_choice() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # what a job that chose one thread leaves set
        assert job_threads(0) == TORCH_DEFAULT_THREADS
        assert job_threads(6) == 6
    finally:
        torch.set_num_threads(before)


def run(
    choice: ThreadChoice, seconds_per_token: dict[int, float], steps: int, tokens: int = 100
) -> list[int]:
    """The thread counts of ``steps`` steps, each taking its count's seconds per token."""
    used = []
    for _ in range(steps):
        threads = choice.next()
        used.append(threads)
        choice.record(threads, seconds_per_token[threads] * tokens, tokens)
    return used


def test_the_warmup_runs_on_all_threads_then_the_candidates_take_turns_and_the_faster_stays(
    caplog: pytest.LogCaptureFixture,
) -> None:
    choice = ThreadChoice((2, 1), min_trials=3, max_trials=8, warmup=2)
    with caplog.at_level(logging.INFO, logger="services.trainer.threads"):
        used = run(choice, {2: 0.5e-3, 1: 0.4e-3}, steps=12)
    # Every 1-thread step faster than every 2-thread one: chosen after three each.
    assert used == [2, 2, 2, 1, 2, 1, 2, 1, 1, 1, 1, 1]
    assert choice.chosen == 1
    assert "on 1 torch threads" in caplog.text and "median 400.0 us/token over 3 steps" in caplog.text


def test_more_threads_stay_when_they_are_faster() -> None:
    choice = ThreadChoice((4, 2), min_trials=2, max_trials=4, warmup=0)
    assert run(choice, {4: 1e-4, 2: 2e-4}, steps=6) == [4, 2, 4, 2, 4, 4]
    assert choice.chosen == 4


def test_overlapping_steps_are_timed_until_the_most_trials_and_the_lower_median_wins() -> None:
    choice = ThreadChoice((2, 1), min_trials=3, max_trials=5, warmup=0)
    # Per token: 2 threads 100 us but one slow step, 1 thread 90 us (0.018 s / 200 tokens) but one
    # slower step, so neither is faster in every step, and by the medians 1 thread is.
    two = [0.010, 0.050, 0.010, 0.010, 0.011]
    one = [0.018, 0.030, 0.018, 0.018, 0.018]
    for step, (a, b) in enumerate(zip(two, one, strict=True)):
        assert choice.chosen is None, f"chosen after {step} steps each"
        choice.record(2, a, 100)
        choice.record(1, b, 200)
    assert choice.chosen == 1


def test_steps_without_tokens_and_warmup_steps_are_not_timed() -> None:
    choice = ThreadChoice((2, 1), min_trials=1, max_trials=1, warmup=1)
    choice.record(2, 4.0, 100)  # warm-up: a slow first step does not count
    choice.record(1, 1.0, 0)  # nothing trained: not timed
    assert choice.chosen is None and choice.seconds_per_token == {2: [], 1: []}
    choice.record(2, 0.01, 100)
    choice.record(1, 0.02, 100)
    assert choice.chosen == 2


def test_one_candidate_is_chosen_at_once() -> None:
    choice = ThreadChoice((3,))
    assert choice.chosen == 3 and run(choice, {3: 1e-3}, steps=3) == [3, 3, 3]


def test_one_slow_step_of_the_faster_candidate_keeps_the_trials_going() -> None:
    choice = ThreadChoice((2, 1), min_trials=3, max_trials=8, warmup=0)
    # 2 threads' median (113) is below every 1-thread step, but its slow step (160) is above
    # their median (128): not apart yet.
    for a, b in [(105, 120), (113, 128), (160, 130)]:
        choice.record(2, a * 1e-6, 1)
        choice.record(1, b * 1e-6, 1)
    assert choice.chosen is None
    choice.record(2, 100e-6, 1)  # median 109, slowest 160 > 1 thread's median 128: still not
    choice.record(1, 140e-6, 1)
    assert choice.chosen is None


def test_a_long_warmup_step_keeps_all_the_threads_untried(caplog: pytest.LogCaptureFixture) -> None:
    choice = ThreadChoice((2, 1), warmup=2, longest_step_s=5.0)
    choice.record(2, 40.0, 100)  # the first step: its one-off work does not count
    assert choice.chosen is None
    with caplog.at_level(logging.INFO, logger="services.trainer.threads"):
        choice.record(2, 30.0, 100)
    assert choice.chosen == 2 and choice.next() == 2
    assert "untried: a step took 30.0 s" in caplog.text


def test_long_steps_after_the_warmup_are_tried_as_any() -> None:
    choice = ThreadChoice((2, 1), min_trials=1, max_trials=1, warmup=1, longest_step_s=5.0)
    choice.record(2, 1.0, 100)
    choice.record(2, 9.0, 100)
    choice.record(1, 6.0, 100)
    assert choice.chosen == 1


@pytest.mark.parametrize(
    "args", [((),), ((0, 1),), ((2, 1), 0), ((2, 1), 3, 2), ((2, 1), 1, 1, -1), ((2, 1), 1, 1, 0, -1.0)]
)
def test_bad_settings_are_refused(args: tuple) -> None:
    with pytest.raises(ValueError, match="ThreadChoice needs"):
        ThreadChoice(*args)
