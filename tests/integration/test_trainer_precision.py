"""The policy with trainer.autocast: bfloat16 compute over float32 weights (DeepSpeed, CPU)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.integration.test_trainer import fixed_batch, load_policy, model_dir

__all__ = ["model_dir"]  # the tiny model's fixture, shared with test_trainer.py


def test_policy_learns_with_bfloat16_autocast_over_float32_weights(model_dir: Path) -> None:
    samples = fixed_batch(model_dir)
    policy = load_policy(model_dir, learning_rate=3e-3, micro_batch_tokens=24, autocast="bfloat16")
    try:
        before = policy.response_logprobs(samples)
        losses = [policy.optimise(samples, seed=step).loss for step in range(4)]
        after = policy.response_logprobs(samples)
        dtypes = {p.dtype for p in policy.engine.module.parameters()}
    finally:
        policy.close()
    assert dtypes == {torch.float32}  # the master weights; only the compute is bfloat16
    errors = [
        abs(got - behaviour)
        for logprobs, sample in zip(before, samples, strict=True)
        for got, behaviour in zip(logprobs, sample.behaviour_logprobs, strict=True)
    ]
    assert 0 < max(errors) < 0.05  # computed in bfloat16 (not float32's 1e-6), yet close
    assert losses[-1] < losses[0]
    for sample, old, new in zip(samples, before, after, strict=True):
        change = sum(new) - sum(old)
        assert change > 0 if sample.advantage > 0 else change < 0
