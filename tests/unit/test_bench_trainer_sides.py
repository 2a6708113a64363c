"""bench/trainer_sides.py's RL batch: the response lengths it is given, or its own long tail."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.trainer_sides import PlainModel, Shape, job_spec, rl_batch
from services.models import resolve_model_path

SHAPE = Shape(groups=2, group_size=3, max_new_tokens=6)
PROMPTS = [[1, 5, 6, 7], [1, 8, 9]]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return Path(resolve_model_path("builtin:addition"))


def test_rl_batch_takes_the_lengths_it_is_given(model_dir: Path) -> None:
    spec = job_spec(model_dir, SHAPE, 1024, 1e-4)
    lengths = [2, 6, 4, 3, 5, 1]
    samples = rl_batch(PlainModel(model_dir, spec), PROMPTS, SHAPE, spec, model_dir, seed=0, lengths=lengths)
    assert [len(s.response_token_ids) for s in samples] == lengths
    assert [s.prompt_token_ids for s in samples] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    # a response shorter than the budget ended by itself, one at the budget ran out of it
    eos = samples[0].response_token_ids[-1]
    assert all(s.response_token_ids[-1] == eos for s in samples if len(s.response_token_ids) < 6)


def test_rl_batch_refuses_lengths_that_do_not_match_its_samples(model_dir: Path) -> None:
    spec = job_spec(model_dir, SHAPE, 1024, 1e-4)
    with pytest.raises(ValueError, match="5 response lengths for 6 samples"):
        rl_batch(PlainModel(model_dir, spec), PROMPTS, SHAPE, spec, model_dir, seed=0, lengths=[3] * 5)
