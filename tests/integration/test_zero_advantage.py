"""trainer.skip_zero_advantage: a sample with no nonzero advantage (a GRPO group whose rewards
were all equal) is left out of forward and backward, and the step still ends at the weights the
whole batch gives; with a KL loss or an entropy bonus every sample is trained on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.config import AlgorithmConfig
from services.trainer.batching import TrainSample
from services.trainer.objective import samples_with_gradient
from services.trainer.prepare import prepare
from tests.integration.test_algorithms import fixed_groups, load_policy, spec_of
from tests.integration.test_trainer import model_dir  # noqa: F401 (a fixture)


def one_step(model: Path, skip: bool, algorithm: dict[str, Any]) -> tuple[dict[str, torch.Tensor], float]:
    """The weights after one step on three groups, the first of which has all rewards 1."""
    groups = fixed_groups(model)
    for trajectory in groups[0]:
        trajectory.reward = 1.0
    spec = spec_of(model, algorithm, skip_zero_advantage=skip)
    policy = load_policy(spec, model)
    try:
        prepared = prepare(groups, spec, 0, policy)
        stats = policy.optimise(prepared.samples, seed=0, proximal=prepared.proximal)
        weights = {k: v.detach().clone() for k, v in policy.engine.module.state_dict().items()}
    finally:
        policy.close()
    return weights, stats.zero_advantage_skipped


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo"])
def test_leaving_out_zero_advantage_samples_keeps_the_step(model_dir: Path, loss: str) -> None:  # noqa: F811
    algorithm = {"policy_loss": loss, "loss_aggregation": "token_mean"}
    full, none_skipped = one_step(model_dir, False, algorithm)
    lean, skipped = one_step(model_dir, True, algorithm)
    assert none_skipped == 0.0 and skipped == pytest.approx(1 / 3)
    for name, value in full.items():
        assert torch.allclose(lean[name], value, rtol=0, atol=1e-6), name
    fresh = load_policy(spec_of(model_dir, {}), model_dir)
    try:
        start = fresh.engine.module.state_dict()
        assert max(float((lean[n] - start[n]).abs().max()) for n in lean) > 1e-4  # the step moved
    finally:
        fresh.close()


def test_an_entropy_bonus_trains_every_sample(model_dir: Path) -> None:  # noqa: F811
    _, skipped = one_step(model_dir, True, {"entropy_coef": 0.01})
    assert skipped == 0.0


def sample(advantage: float | list[float], response: int = 3) -> TrainSample:
    return TrainSample(
        prompt_token_ids=[1, 5, 6],
        response_token_ids=list(range(7, 7 + response)),
        loss_mask=[True] * response,
        behaviour_logprobs=[-1.0] * response,
        advantage=advantage,
    )


def test_which_samples_have_a_gradient() -> None:
    samples = [sample(0.0), sample(0.5), sample([0.0, 0.0, 0.0]), sample([0.0, -0.2, 0.0])]
    assert samples_with_gradient(samples, AlgorithmConfig()) == [1, 3]
    assert samples_with_gradient(samples, AlgorithmConfig(entropy_coef=0.01)) == [0, 1, 2, 3]
    assert samples_with_gradient(samples, AlgorithmConfig(kl_coef=0.1)) == [0, 1, 2, 3]
    in_reward = AlgorithmConfig(advantage="reinforce_pp", kl_coef=0.1, kl_in_reward=True)
    assert samples_with_gradient(samples, in_reward) == [1, 3]  # the KL is in the advantages
    flat = [sample(0.0, response=4), sample(0.0, response=2), sample(0.0, response=3)]
    assert samples_with_gradient(flat, AlgorithmConfig()) == [1]  # the optimiser still steps
