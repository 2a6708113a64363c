"""The best ratio the race (bench/e2e.py) could show on this machine: TRL's seconds per step
against the CPU floor of the model work verst's loop cannot skip.

Whatever the services around the model cost, one step of verst's loop runs at least its engine's
generation of the step's samples and its trainer's ``prepare`` and ``Policy.optimise`` on them. On
a machine of C cores a step cannot take less than the CPU seconds of those two over C, even if
every other process cost nothing and the two overlapped perfectly. This measures both on the
race's own step, in this process, one torch thread (so CPU seconds are not inflated by thread
teams waiting):

- engine: a ``TorchEngine`` (the rollout service's, its defaults but one batch of the whole step)
  samples ``prompts_per_step`` requests of ``group_size`` samples of the task's training prompts
  from the base model, temperature 1, stopping at EOS or ``max_new_tokens``, as the runner asks;
- trainer: those very samples, rewarded by the task's scorer, through the trainer's ``prepare``
  and ``Policy.optimise`` under the race's job spec (bench/e2e_verst.py's).

Alternating with them, TRL's side of the race (bench/e2e_trl.py, its own process, the race's
settings and threads) runs ``--trl-steps`` steps; its seconds per step after step 1 are the other
figure. ``ceiling = TRL s/step / verst floor s/step`` is the time-to-target ratio the race could
reach if both sides learned the same per step, verst's loop cost nothing beyond its model work,
and its engine and trainer never waited for each other.

    .venv/bin/python bench/ceiling.py --task reverse
    .venv/bin/python bench/ceiling.py --task addition --trl-steps 24
    .venv/bin/python bench/ceiling.py --task smollm2 --repeat 1 --verst-rounds 2   # SmolLM2-135M, bfloat16

The last line: ``ceiling: task=<t> trl_step_s=<x> verst_floor_s=<y> ceiling=<x/y> target=<r>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.e2e_runs import Hyper
from bench.e2e_tasks import BenchTask
from services.common.pb import common_pb2
from services.rollout.engine_protocol import Completion

IDLE_PROBE_S = 2.0
"""Seconds over which the process's CPU use while idle is shown (it would inflate both shares)."""
RACE_TARGETS = {"addition": 2.0, "addition-long": 2.0, "reverse": 2.2, "smollm2": 1.3}
"""Issue 33's targets for the race's tasks (smollm2's: seconds per step)."""


@dataclass(frozen=True, slots=True)
class Floor:
    """CPU seconds of one step's model work on verst's side."""

    engine_s: float
    trainer_s: float
    samples: int
    response_tokens: int

    def step_s(self, cores: int) -> float:
        """The shortest step ``cores`` cores allow: both shares' CPU seconds spread over them."""
        return (self.engine_s + self.trainer_s) / cores


def ceiling(trl_step_s: float, floor_step_s: float) -> float:
    """TRL's seconds per step over verst's floor: the best time-to-target ratio at equal learning."""
    return trl_step_s / floor_step_s if floor_step_s > 0 else float("nan")


def trajectories(
    prompts: Sequence[list[int]],
    completions: Sequence[Sequence[Completion]],
    rewards: Sequence[Sequence[float]],
) -> list[list[common_pb2.Trajectory]]:
    """One group of ``Trajectory`` messages per prompt, as the runner publishes them (version 0)."""
    groups = []
    for g, (prompt, group, scores) in enumerate(zip(prompts, completions, rewards, strict=True)):
        groups.append(
            [
                common_pb2.Trajectory(
                    id=f"g{g}:{c.index}",
                    group_id=f"g{g}",
                    sample_index=c.index,
                    prompt_token_ids=prompt,
                    response_token_ids=c.token_ids,
                    behaviour_logprobs=c.logprobs,
                    loss_mask=[True] * len(c.token_ids),
                    policy_versions=[0] * len(c.token_ids),
                    reward=score,
                )
                for c, score in zip(group, scores, strict=True)
            ]
        )
    return groups


class VerstModelWork:
    """verst's engine and trainer in this process, on the race's job spec and base model."""

    ENGINE_TIMEOUT_S = 600.0
    """Longest wait for one step's generation (a slow host takes a few seconds)."""

    def __init__(self, hp: Hyper, task: BenchTask, work_dir: Path) -> None:
        from transformers import AutoTokenizer

        from bench.e2e_verst import job_spec
        from bench.engine_sides import CPU, EngineSide
        from services.common.config import parse_job_spec
        from services.trainer.policy import Policy, init_distributed

        self.hp, self.task = hp, task
        model_dir = Path(hp.model_dir)
        self.spec = parse_job_spec(job_spec(hp, task, work_dir, max_staleness=1))
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.score = task.example_scorer()
        self.engine = EngineSide(model_dir)
        init_distributed(CPU)
        self.policy = Policy.load(self.spec, model_dir, model_dir, CPU)

    def close(self) -> None:
        self.engine.close()
        self.policy.close()

    def generate(self, prompts: Sequence[list[int]], seed: int) -> list[list[Completion]]:
        """Each prompt's ``group_size`` samples, the whole step in one batch of the engine."""
        from services.rollout.engine_protocol import GenerationRequest
        from services.rollout.sampling import SamplingConfig

        hp = self.hp
        n = hp.group_size
        params = common_pb2.SamplingParams(
            temperature=hp.temperature, top_p=1.0, top_k=0, max_new_tokens=hp.max_new_tokens, n=n
        )
        self.engine.engine.max_batch_size = len(prompts) * n
        groups: list[list[Completion]] = [[] for _ in prompts]
        lock, done = threading.Lock(), threading.Event()
        remaining = [len(prompts) * n]

        def finished(g: int, completion: Completion) -> None:  # on the engine's worker thread
            with lock:
                groups[g].append(completion)
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

        for g, prompt in enumerate(prompts):
            params.seed = seed * 1000 + g
            config = SamplingConfig.from_proto(params)
            self.engine.engine.submit(
                GenerationRequest(f"ceiling-{seed}-{g}", list(prompt), config, lambda c, g=g: finished(g, c))
            )
        if not done.wait(self.ENGINE_TIMEOUT_S):
            raise RuntimeError(f"the engine did not finish the step in {self.ENGINE_TIMEOUT_S:.0f} s")
        for group in groups:
            group.sort(key=lambda c: c.index)
            if bad := [c.error for c in group if c.error]:
                raise RuntimeError(f"the engine failed samples: {bad[:3]}")
        return groups

    def step(self, examples: Sequence[Any], seed: int) -> Floor:
        """One step's model work: the engine's samples of ``examples``, then the trainer on them."""
        from services.trainer.prepare import prepare

        prompts = [self.task.encode(self.tokenizer, e) for e in examples]
        started = time.process_time()
        completions = self.generate(prompts, seed)
        engine_s = time.process_time() - started
        rewards = [
            [self.score(self.tokenizer.decode(c.token_ids, skip_special_tokens=True), e) for c in group]
            for group, e in zip(completions, examples, strict=True)
        ]
        groups = trajectories(prompts, completions, rewards)
        started = time.process_time()
        samples = prepare(groups, self.spec, version=0, policy=self.policy).samples
        self.policy.optimise(samples, seed=seed)
        trainer_s = time.process_time() - started
        tokens = sum(len(c.token_ids) for group in completions for c in group)
        return Floor(engine_s, trainer_s, sum(len(g) for g in completions), tokens)


def trl_seconds_per_step(hp: Hyper, work: Path, repeat: int, threads: int) -> float:
    """Median seconds per step after step 1 of one short TRL run (bench/e2e.py's TRL side)."""
    from bench.e2e import run_trl

    run = run_trl(hp, work / f"trl-{repeat}", repeat, threads)
    return statistics.median(run.step_seconds)


def measure(args: argparse.Namespace) -> tuple[list[float], list[Floor]]:
    """Alternating TRL runs and rounds of verst's model work; TRL's s/step per run, and the floors."""
    import torch

    from bench.e2e_tasks import get_bench_task

    task = get_bench_task(args.task)
    hp = Hyper(task=task.name, model_dir=str(task.model_dir()), seed=args.seed, dtype=args.dtype,
               **{**task.hyper, "max_steps": args.trl_steps, "eval_every": args.trl_steps})  # fmt: skip
    per_step = int(hp.prompts_per_step)
    rounds = args.repeat * args.verst_rounds + 1
    examples = task.train_examples(args.seed, per_step * rounds)
    torch.set_num_threads(1)
    trl, floors = [], []
    with tempfile.TemporaryDirectory(prefix="verst-ceiling-") as scratch:
        verst = VerstModelWork(hp, task, Path(scratch))
        try:
            verst.step(examples[:per_step], seed=0)  # warm-up, not counted
            idle = time.process_time()
            time.sleep(IDLE_PROBE_S)  # what the engine's and DeepSpeed's threads burn doing nothing
            print(f"idle CPU of this process: {(time.process_time() - idle) / IDLE_PROBE_S:.4f} s per s")
            for repeat in range(args.repeat):
                sides = ["trl", "verst"] if repeat % 2 == 0 else ["verst", "trl"]
                for side in sides:
                    if side == "trl":
                        paired = dataclasses.replace(hp, seed=args.seed + repeat)
                        trl.append(trl_seconds_per_step(paired, Path(scratch), repeat + 1, args.threads))
                        print(f"repeat {repeat + 1}: TRL {trl[-1]:.3f} s/step", flush=True)
                        continue
                    for r in range(args.verst_rounds):
                        index = 1 + repeat * args.verst_rounds + r
                        floor = verst.step(examples[index * per_step : (index + 1) * per_step], seed=index)
                        floors.append(floor)
                        print(
                            f"repeat {repeat + 1}: verst engine {floor.engine_s:.3f} + trainer"
                            f" {floor.trainer_s:.3f} CPU s ({floor.samples} samples,"
                            f" {floor.response_tokens} response tokens)",
                            flush=True,
                        )
        finally:
            verst.close()
    return trl, floors


def main(argv: Sequence[str] | None = None) -> None:
    from bench.e2e_tasks import BENCH_TASKS
    from bench.engine_sides import machine_info

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(BENCH_TASKS), default="reverse")
    parser.add_argument("--trl-steps", type=int, default=8, help="steps of each TRL run (%(default)s)")
    parser.add_argument(
        "--repeat", type=int, default=3, help="alternating TRL runs / verst rounds (%(default)s)"
    )
    parser.add_argument("--verst-rounds", type=int, default=4, help="verst steps per repeat (%(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="both sides' (the task's)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="TRL's torch threads")
    parser.add_argument(
        "--cores", type=int, default=os.cpu_count() or 1, help="cores verst's floor spreads over"
    )
    args = parser.parse_args(argv)
    if args.trl_steps < 3 or args.repeat < 1 or args.verst_rounds < 1:
        parser.error("--trl-steps must be >= 3 (step 1 is warm-up), --repeat and --verst-rounds >= 1")
    from bench.e2e_tasks import get_bench_task

    args.dtype = args.dtype or get_bench_task(args.task).dtype
    for key, value in machine_info(args.dtype).items():
        print(f"{key:>8}: {value}")
    trl, floors = measure(args)
    engine = statistics.median(f.engine_s for f in floors)
    trainer = statistics.median(f.trainer_s for f in floors)
    samples = round(statistics.median(f.samples for f in floors))
    tokens = round(statistics.median(f.response_tokens for f in floors))
    floor_s = Floor(engine, trainer, samples, tokens).step_s(args.cores)
    trl_s = statistics.median(trl)
    print(f"TRL s/step: {', '.join(f'{s:.3f}' for s in trl)}")
    print(f"verst CPU s per step, medians: engine {engine:.3f}, trainer {trainer:.3f};"
          f" floor on {args.cores} cores {floor_s:.3f} s")  # fmt: skip
    target = RACE_TARGETS.get(args.task, float("nan"))
    print(
        f"ceiling: task={args.task} trl_step_s={trl_s:.3f} verst_floor_s={floor_s:.3f}"
        f" ceiling={ceiling(trl_s, floor_s):.2f} target={target:g}"
    )


if __name__ == "__main__":
    main()
