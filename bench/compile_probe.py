"""What inductor would give a training step: eager against ``torch.compile`` on one fixed batch.

A probe for the trainer's next lever, not the trainer itself: a plain transformers model of a
built-in task (``builtin:addition`` or ``builtin:reverse``), one padded batch of random tokens
(``--rows`` x ``--width``), the step forward, token logprobs, a mean-logprob loss, backward,
gradient clipping, AdamW. Both sides share the weights and the optimiser and alternate within
each repeat; the compiled side's first step (its compile) is reported apart and not timed.

    .venv/bin/python bench/compile_probe.py --task reverse --threads 2
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
from transformers import AutoModelForCausalLM

from bench.e2e_tasks import BENCH_TASKS


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=sorted(BENCH_TASKS), default="reverse")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--rows", type=int, default=128, help="samples in the batch (16 prompts x 8)")
    parser.add_argument("--width", type=int, default=34, help="tokens per sample, prompt and answer")
    parser.add_argument("--repeat", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = BENCH_TASKS[args.task].model_dir()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(4, model.config.vocab_size, (args.rows, args.width))
    sides = {"eager": model, "compiled": torch.compile(model, dynamic=False)}
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
    for name, seconds in times.items():
        print(f"{name}: median {statistics.median(seconds):.4f} s ({', '.join(f'{s:.3f}' for s in seconds)})")
    ratio = statistics.median(times["eager"]) / statistics.median(times["compiled"])
    print(f"compile_probe: task={args.task} threads={args.threads} eager_over_compiled={ratio:.2f}")


if __name__ == "__main__":
    main()
