"""What inductor would give a training step: eager against ``torch.compile``.

A probe for the trainer's next lever, measured, not built into the trainer. Two modes:

- default: a plain transformers model of a built-in task (``builtin:addition`` or
  ``builtin:reverse``), one padded batch of random tokens (``--rows`` x ``--width``), the step
  forward, token logprobs, a mean-logprob loss, backward, gradient clipping, AdamW. Both sides
  share the weights and the optimiser; the compiled side has static shapes.
- ``--trainer``: verst's own ``Policy.optimise`` (DeepSpeed engine, packed rows, a group's prompt
  shared, the real loss) on the task's race batches: its training prompts, ``prompts_per_step``
  x ``group_size`` responses as long as each prompt's answer plus EOS, prepared by the trainer's
  ``prepare``; the batches differ in shape, so the compiled side's model forward is compiled
  with dynamic shapes, as the trainer would have to.

The sides alternate within each repeat; each side's first step (the compile) is reported apart
and not timed.

    .venv/bin/python bench/compile_probe.py --task reverse --threads 2
    .venv/bin/python bench/compile_probe.py --task reverse --threads 2 --trainer --repeat 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.e2e_tasks import BENCH_TASKS, BenchTask, encode_prompt
from bench.trainer_sides import CPU, PlainModel, Shape, job_spec, rl_batch
from services.common.config import JobSpec, TrainerConfig
from services.trainer.batching import TrainSample
from services.trainer.policy import Policy, init_distributed


def train_step(
    model: Callable[..., object],
    params: list[torch.nn.Parameter],
    opt: torch.optim.Optimizer,
    ids: torch.Tensor,
) -> float:
    """One optimiser step of ``model`` on ``ids``; returns its seconds."""
    start = time.perf_counter()
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits  # type: ignore[attr-defined]
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (-logprobs.mean()).backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def race_batches(task: BenchTask, batches: int) -> tuple[JobSpec, list[list[TrainSample]]]:
    """The job spec and ``batches`` prepared batches of the task's race (see the module's doc)."""
    model_dir = task.model_dir()
    hyper = task.hyper
    shape = Shape(int(hyper["prompts_per_step"]), int(hyper["group_size"]), int(hyper["max_new_tokens"]))
    spec = job_spec(model_dir, shape, TrainerConfig().micro_batch_tokens, hyper["learning_rate"])
    spec = spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"share_prompts": True})})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    plain = PlainModel(model_dir, spec)
    prepared = []
    for b in range(batches):
        examples = task.train_examples(b, shape.groups)
        prompts = [encode_prompt(tokenizer, e.text) for e in examples]
        answer = [
            min(len(tokenizer(e.answer, add_special_tokens=False).input_ids) + 1, shape.max_new_tokens)
            for e in examples
        ]
        lengths = [answer[g] for g in range(shape.groups) for _ in range(shape.group_size)]
        prepared.append(rl_batch(plain, prompts, shape, spec, model_dir, seed=b, lengths=lengths))
    return spec, prepared


def probe_trainer(task: BenchTask, repeat: int, backend: str) -> dict[str, list[float]]:
    """Seconds of ``Policy.optimise`` per step, eager and compiled, on the task's race batches."""
    spec, batches = race_batches(task, 4)
    model_dir = task.model_dir()
    init_distributed(CPU)
    sides = {
        "eager": Policy.load(spec, model_dir, model_dir, CPU),
        "compiled": Policy.load(spec, model_dir, model_dir, CPU),
    }
    module = sides["compiled"].engine.module
    module.forward = torch.compile(module.forward, dynamic=True, backend=backend)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for step in range(repeat + 1):
        order = list(sides) if step % 2 == 0 else list(reversed(sides))
        for name in order:
            start = time.perf_counter()
            sides[name].optimise(batches[step % len(batches)], seed=step)
            times[name].append(time.perf_counter() - start)
    tokens = [sum(s.length for s in batch) for batch in batches]
    print(
        f"model {model_dir}: race batches of {min(tokens)}-{max(tokens)} tokens (prompts counted per sample)"
    )
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=sorted(BENCH_TASKS), default="reverse")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--rows", type=int, default=128, help="samples in the batch (16 prompts x 8)")
    parser.add_argument("--width", type=int, default=34, help="tokens per sample, prompt and answer")
    parser.add_argument("--repeat", type=int, default=6)
    parser.add_argument("--trainer", action="store_true", help="time verst's Policy.optimise on race batches")
    parser.add_argument("--backend", choices=("inductor", "aot_eager", "eager"), default="inductor",
                        help="torch.compile's backend (%(default)s); the others skip code generation,"
                        " to check in seconds that the probe runs")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.trainer:
        times = probe_trainer(BENCH_TASKS[args.task], args.repeat, args.backend)
        first = {name: seconds.pop(0) for name, seconds in times.items()}
        print(
            f"threads {args.threads}; first steps:"
            f" eager {first['eager']:.2f} s, compiled {first['compiled']:.2f} s"
        )
        report(args, times)
        return
    model_dir = BENCH_TASKS[args.task].model_dir()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(4, model.config.vocab_size, (args.rows, args.width))
    sides = {"eager": model, "compiled": torch.compile(model, dynamic=False, backend=args.backend)}
    first = {name: train_step(side, params, opt, ids) for name, side in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(args.repeat):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for name in order:
            times[name].append(train_step(sides[name], params, opt, ids))
    print(
        f"model {model_dir}: {sum(p.numel() for p in params):,} parameters;"
        f" batch {args.rows} x {args.width};"
        f" threads {args.threads};"
        f" first steps: eager {first['eager']:.2f} s, compiled {first['compiled']:.2f} s"
    )
    report(args, times)


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    for name, seconds in times.items():
        print(f"{name}: median {statistics.median(seconds):.4f} s ({', '.join(f'{s:.3f}' for s in seconds)})")
    ratio = statistics.median(times["eager"]) / statistics.median(times["compiled"])
    mode = " trainer" if args.trainer else ""
    backend = "" if args.backend == "inductor" else f" backend={args.backend}"
    print(
        f"compile_probe:{mode} task={args.task} threads={args.threads}{backend}"
        f" eager_over_compiled={ratio:.2f}"
    )


if __name__ == "__main__":
    main()
