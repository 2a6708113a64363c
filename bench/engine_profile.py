"""Where the engine's time goes: prefill, decode steps, sampling, the rest.

Drives a ``continuous.ContinuousBatch`` on this thread the way the engine's worker does (admit
every prompt, then decode step by step, recording tokens and retiring finished samples), with
the benchmark's prompts and sampling settings (temperature 1, seeded, ignore_eos), and times
its parts by wrapping ``SlotDecoder.prefill``, ``SlotDecoder.decode`` and ``BatchSampler.sample``;
then, with ``--ops``, lists the top torch ops of one more run. Not a benchmark: the figures in
bench/RESULTS.md come from bench/engine.py.

    .venv/bin/python bench/engine_profile.py --model smollm2 --batch 64 --tokens 16
    .venv/bin/python bench/engine_profile.py --model demo --batch 64 --compile --ops
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.engine_models import MODELS
from bench.engine_sides import CPU, sampling_configs
from services.rollout.engine_protocol import GenerationRequest
from services.rollout.torch.continuous import ContinuousBatch
from services.rollout.torch.decoder import SlotDecoder
from services.rollout.torch.model import load_model
from services.rollout.torch.requests import Row, record_tokens
from services.rollout.torch.sampler import BatchSampler


class Finisher:
    """The engine's side of record_tokens, minus locking: mark the row finished."""

    def finish(self, row: Row, reason: int, error: str = "") -> None:
        row.finish = reason


def make_rows(prompts: Sequence[list[int]], tokens: int) -> list[Row]:
    configs = sampling_configs(len(prompts), tokens, seed=1, greedy=False)
    return [
        Row(GenerationRequest(f"profile-{i}", list(prompt), config, lambda _: None), 0, frozenset())
        for i, (prompt, config) in enumerate(zip(prompts, configs, strict=True))
    ]


def run(batch: ContinuousBatch, rows: list[Row]) -> None:
    """Admit ``rows`` and decode until all have finished, as the engine's worker does."""
    tokenizer = batch.loaded.tokenizer
    tokens, logprobs = batch.admit(rows)
    record_tokens(rows, tokens, logprobs, version=1, tokenizer=tokenizer, hooks=Finisher())
    batch.retire()
    while batch.rows:
        live = batch.rows
        tokens, logprobs = batch.step()
        record_tokens(live, tokens, logprobs, version=1, tokenizer=tokenizer, hooks=Finisher())
        batch.retire()


def timed_parts(batch: ContinuousBatch, rows: list[Row]) -> dict[str, float]:
    """Seconds in prefill, decode forwards, sampling and everything else, for one run."""
    spent: dict[str, float] = defaultdict(float)
    originals = {
        (SlotDecoder, "prefill"): "prefill",
        (SlotDecoder, "decode"): "decode forwards",
        (SlotDecoder, "decode_and_sample"): "decode forwards + sampling (one step)",
        (BatchSampler, "sample"): "sampling",
    }

    def wrap(name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return timed

    saved = {key: getattr(*key) for key in originals}
    for (owner, method), name in originals.items():
        setattr(owner, method, wrap(name, saved[(owner, method)]))
    try:
        start = time.perf_counter()
        run(batch, rows)
        total = time.perf_counter() - start
    finally:
        for (owner, method), inner in saved.items():
            setattr(owner, method, inner)
    spent["rest (recording tokens, retiring, slots)"] = total - sum(spent.values())
    spent["total"] = total
    return dict(spent)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="demo")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per row (%(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="compile the decode step (compile_decode)")
    parser.add_argument("--ops", action="store_true", help="also list the top torch ops")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = MODELS[args.model](args.batch)
    loaded = load_model(model.path, device=CPU, dtype=torch.float32)
    batch = ContinuousBatch(loaded, capacity=args.batch, device=CPU, compile_step=args.compile)
    prompts = model.prompts[: args.batch]
    run(batch, make_rows(prompts, min(args.tokens, 8)))  # warm-up (and the compile, if any)
    parts = timed_parts(batch, make_rows(prompts, args.tokens))
    print(f"{model.name}, batch {args.batch}, {args.tokens} new tokens, {args.threads} threads:")
    for name, seconds in parts.items():
        print(f"  {name:>48}: {seconds * 1e3:9.1f} ms  {seconds / parts['total']:6.1%}")
    steps = args.tokens - 1
    if steps:
        stepping = ("decode forwards", "decode forwards + sampling (one step)", "sampling")
        per_step = sum(parts.get(name, 0.0) for name in stepping) / steps
        print(f"  {'per decode step (forward + sampling)':>48}: {per_step * 1e3:9.2f} ms")
    if args.ops:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            run(batch, make_rows(prompts, args.tokens))
        print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
