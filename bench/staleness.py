"""Learning per step under staleness, in one process: the trainer's own parts (``prepare``,
``Policy.optimise``) on a task of the race (bench/e2e_tasks.py: ``addition``, or the compute-bound
``reverse``), with the rollouts of step k sampled by the weights of version k - lag, as an
asynchronous pipeline at its staleness bound serves them.

    .venv/bin/python bench/staleness.py --lag 1 --set off_policy_correction=decoupled --seeds 0 1 2
    .venv/bin/python bench/staleness.py --task reverse --lag 0 --steps 40

The job is the race's on that task (group size, prompts per step, max_new_tokens, learning rate and
clipping of its ``BENCH_TASKS`` entry); rewards are the task's scorer (partial credit on reverse)
and accuracy is held-out greedy exact match (``Task.is_correct``).

Each run prints the held-out greedy accuracy after every ``--eval-every`` steps and, at the end,
one JSON line per run. Behaviour logprobs are the sampling weights' own (an exact engine), so the
only difference between the runs is the lag and the algorithm settings.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import yaml

from bench.e2e_tasks import BENCH_TASKS, BenchTask, get_bench_task
from services.common.config import JobSpec, parse_job_spec
from services.common.pb import common_pb2
from services.data import encode_prompt, eval_prompts, train_prompts
from services.models import resolve_model_path
from services.tasks import Task, get_task
from services.tasks.tiny_llama import generate_texts
from services.trainer.batching import token_logprobs
from services.trainer.policy import Policy, init_distributed
from services.trainer.prepare import prepare

CPU = torch.device("cpu")


def job_spec(task: BenchTask, seed: int, lag: int, settings: dict[str, Any], steps: int) -> JobSpec:
    """The race's job on ``task`` with ``settings`` (keys of the algorithm section); on addition
    that is examples/addition.yaml's."""
    hyper = task.hyper
    algorithm: dict[str, Any] = {
        "group_size": int(hyper["group_size"]),
        "clip_low": hyper["clip_low"],
        "clip_high": hyper["clip_high"],
        "max_staleness": lag,
    }
    algorithm |= settings
    return parse_job_spec(
        {
            "seed": seed,
            "model": {"path": task.model},
            "data": {"train": task.data, "eval": task.data},
            "reward": {"verifier": task.verifier},
            "algorithm": algorithm,
            "rollout": {
                "prompts_per_step": int(hyper["prompts_per_step"]),
                "max_new_tokens": int(hyper["max_new_tokens"]),
            },
            "trainer": {"steps": steps, "learning_rate": hyper["learning_rate"]},
        }
    )


@torch.no_grad()
def sample_groups(
    sampler: Any,
    tokenizer: Any,
    prompts: list[Any],
    spec: JobSpec,
    task: Task,
    version: int,
    rng: torch.Generator,
) -> list[list[common_pb2.Trajectory]]:
    """``group_size`` responses per prompt at temperature 1, with the sampler's logprobs and rewards."""
    n, budget = spec.algorithm.group_size, spec.rollout.max_new_tokens
    eos = tokenizer.eos_token_id
    groups = []
    for g, example in enumerate(prompts):
        prompt = encode_prompt(tokenizer, example.text)
        ids = torch.tensor([prompt] * n)
        for _ in range(budget):  # plain ancestral sampling: every row decodes the full budget
            logits = sampler(input_ids=ids).logits[:, -1].float()
            ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1, generator=rng)], dim=1)
        logprobs = token_logprobs(sampler(input_ids=ids).logits, ids)[:, len(prompt) - 1 :]
        group = []
        for i in range(n):
            response = ids[i, len(prompt) :].tolist()
            end = response.index(eos) + 1 if eos in response else len(response)
            response = response[:end]
            text = tokenizer.decode(response, skip_special_tokens=True)
            group.append(
                common_pb2.Trajectory(
                    id=f"{version}:{g}:{i}",
                    group_id=f"{version}:{g}",
                    sample_index=i,
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    behaviour_logprobs=logprobs[i, :end].tolist(),
                    loss_mask=[True] * end,
                    policy_versions=[version] * end,
                    reward=task.score(text, example.answer)[0],
                )
            )
        groups.append(group)
    return groups


@torch.no_grad()
def accuracy(model: Any, tokenizer: Any, examples: list[Any], budget: int, task: Task) -> float:
    """Greedy exact match on the held-out prompts."""
    prefixes = [encode_prompt(tokenizer, e.text) for e in examples]
    texts = generate_texts(model, tokenizer, prefixes, budget, sample=False)
    right = sum(task.is_correct(t, e.answer) for t, e in zip(texts, examples, strict=True))
    return right / len(examples)


def run(
    bench_task: BenchTask,
    seed: int,
    lag: int,
    settings: dict[str, Any],
    steps: int,
    eval_every: int,
    eval_n: int,
) -> dict:
    spec = job_spec(bench_task, seed, lag, settings, steps)
    task = get_task(bench_task.catalog_name)
    path = resolve_model_path(spec.model.path)
    policy = Policy.load(spec, path, path, CPU)
    module, tokenizer = policy.engine.module, policy.tokenizer
    sampler = copy.deepcopy(module).eval()
    held_out = eval_prompts(spec.data, eval_n)
    prompts = train_prompts(spec.data, spec.seed)
    rng = torch.Generator().manual_seed(seed)
    versions: collections.deque[dict[str, torch.Tensor]] = collections.deque(maxlen=lag + 1)
    budget = spec.rollout.max_new_tokens
    curve = {0: accuracy(module, tokenizer, held_out, budget, task)}
    started = time.monotonic()
    try:
        for version in range(steps):
            versions.append({k: v.detach().clone() for k, v in module.state_dict().items()})
            sampler.load_state_dict(versions[0])  # the oldest kept: version - lag (or 0)
            sampled_by = max(version - lag, 0)
            batch = [next(prompts) for _ in range(spec.rollout.prompts_per_step)]
            groups = sample_groups(sampler, tokenizer, batch, spec, task, sampled_by, rng)
            prepared = prepare(groups, spec, version, policy)
            stats = policy.optimise(prepared.samples, seed * 1_000_003 + version, proximal=prepared.proximal)
            if (version + 1) % eval_every == 0:
                curve[version + 1] = accuracy(module, tokenizer, held_out, budget, task)
                print(f"  seed {seed} step {version + 1}: accuracy {curve[version + 1]:.3f} "
                      f"reward {sum(prepared.rewards) / len(prepared.rewards):.3f} "
                      f"clip {stats.clip_fraction:.3f}", flush=True)  # fmt: skip
    finally:
        policy.close()
    return {"task": bench_task.name, "seed": seed, "lag": lag, "settings": settings, "accuracy": curve,
            "seconds": round(time.monotonic() - started)}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--task", default="addition", help=f"of {', '.join(BENCH_TASKS)} (%(default)s)")
    parser.add_argument("--lag", type=int, default=1, help="versions between sampler and trainer")
    parser.add_argument("--set", action="append", default=[], help="algorithm setting, key=value (YAML)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-prompts", type=int, default=200)
    args = parser.parse_args(argv)
    settings = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    task = get_bench_task(args.task)
    init_distributed(CPU)
    torch.set_num_threads(1)
    for seed in args.seeds:
        print(json.dumps(run(task, seed, args.lag, settings, args.steps, args.eval_every, args.eval_prompts)))


if __name__ == "__main__":
    main()
