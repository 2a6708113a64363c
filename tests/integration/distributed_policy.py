"""Run by tests/integration/test_trainer_distributed.py, alone or under torchrun: build a Policy
on the tiny Llama in ``--model``, run ``--steps`` optimisation steps on a fixed batch, save a
checkpoint (every rank takes part), and let rank 0 write what happened as JSON to ``--out``.

    python tests/integration/distributed_policy.py --model DIR --out FILE [--zero-stage 2]
    python -m torch.distributed.run --nproc_per_node=2 --master_port PORT \\
        tests/integration/distributed_policy.py --model DIR --out FILE
"""

from __future__ import annotations

import argparse
import json
import random
from datetime import timedelta
from pathlib import Path

import torch

from services.common.config import parse_job_spec
from services.tasks.addition_model import build_char_tokenizer
from services.trainer import distributed
from services.trainer.batching import TrainSample
from services.trainer.policy import Policy, init_distributed

CPU = torch.device("cpu")


def fixed_batch() -> list[TrainSample]:
    """Seven samples of different lengths and both signs of advantage (behaviour logprobs
    are filled in from the policy itself)."""
    tokenizer = build_char_tokenizer()
    rng = random.Random(0)
    samples = []
    for i in range(7):
        prompt = [1, *tokenizer(f"{10 + i}+{20 + 3 * i}=", add_special_tokens=False).input_ids]
        response = [rng.randint(4, 98) for _ in range(rng.randint(2, 9))] + [2]
        samples.append(
            TrainSample(prompt, response, [True] * len(response), [0.0] * len(response), i % 3 - 1.0)
        )
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=28)  # 5 packs: one rank pads
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_distributed(CPU, timedelta(seconds=60))
    spec = parse_job_spec(
        {
            "seed": 3,
            "model": {"path": str(args.model)},
            "algorithm": {"group_size": 2},
            "rollout": {"max_new_tokens": 16},
            "trainer": {
                "steps": 10,
                "learning_rate": 3e-3,
                "warmup_steps": 1,
                "ppo_epochs": 2,  # the second pass's ratios are not 1: its loss shows the update
                "scheduler": "cosine",
                "zero_stage": args.zero_stage,
                "micro_batch_tokens": args.micro_batch_tokens,
            },
        }
    )
    policy = Policy.load(spec, args.model, args.model, CPU)
    samples = fixed_batch()
    behaviour = policy.response_logprobs(samples)
    samples = [
        TrainSample(s.prompt_token_ids, s.response_token_ids, s.loss_mask, b, s.advantage)
        for s, b in zip(samples, behaviour, strict=True)
    ]
    stats = [policy.optimise(samples, seed=step) for step in range(args.steps)]
    saved = args.out.parent / f"{args.out.stem}-checkpoint"
    if distributed.rank() == 0:
        saved.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    policy.save(saved)
    policy.save_training_state(saved)
    if distributed.rank() == 0:
        result = {
            "world": distributed.size(),
            "losses": [s.loss for s in stats],
            "grad_norms": [s.grad_norm for s in stats],
            "tokens": [s.tokens for s in stats],
            "learning_rates": [s.learning_rate for s in stats],
            "checkpoint": str(saved),
        }
        args.out.write_text(json.dumps(result))
    policy.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
