"""trainer.gradient_checkpointing: activations recomputed in backward give the step the same loss
and the same gradients, with samples packed and groups sharing their prompt (DeepSpeed, CPU)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from services.trainer.batching import TrainSample
from services.trainer.policy import Policy
from tests.integration.test_trainer import encode, load_policy, model_dir, response_logprobs

__all__ = ["model_dir"]  # the tiny model's fixture, shared with test_trainer.py


def groups(model: Path) -> list[TrainSample]:
    """Three prompts with two samples each: a step that packs rows and shares prompts."""
    rng = random.Random(1)
    samples = []
    for i in range(3):
        prompt = encode(f"{30 + i}+{40 + i}=")
        for sign in (1.0, -1.0):
            response = [rng.randint(4, 98) for _ in range(rng.randint(3, 7))] + [2]
            behaviour = response_logprobs(model, prompt, response)
            samples.append(TrainSample(prompt, response, [True] * len(response), behaviour, sign * 0.7))
    return samples


def step_with_gradients(policy: Policy, samples: list[TrainSample]) -> tuple[float, list[torch.Tensor]]:
    """One optimiser step's loss and the gradients it stepped with (read before the optimiser)."""
    engine = policy.engine
    gradients: list[torch.Tensor] = []
    step = engine.step

    def recording_step(*args: object, **kwargs: object) -> object:
        gradients.extend(p.grad.detach().clone() for p in engine.module.parameters())
        return step(*args, **kwargs)

    engine.step = recording_step
    loss = policy.optimise(samples, seed=0).loss
    return loss, gradients


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(model_dir: Path) -> None:
    samples = groups(model_dir)
    results = []
    for checkpointing in (False, True):
        policy = load_policy(model_dir, micro_batch_tokens=40, gradient_checkpointing=checkpointing)
        try:
            layers = policy.engine.module.modules()
            assert any(getattr(m, "gradient_checkpointing", False) for m in layers) is checkpointing
            assert policy.packed and policy.shared  # the layouts it must keep working with
            results.append(step_with_gradients(policy, samples))
        finally:
            policy.close()
    (loss, gradients), (recomputed_loss, recomputed) = results
    assert recomputed_loss == pytest.approx(loss, abs=1e-7)
    assert any(float(g.abs().max()) > 0 for g in gradients)
    for plain, again in zip(gradients, recomputed, strict=True):
        torch.testing.assert_close(again, plain, rtol=1e-5, atol=1e-7)
