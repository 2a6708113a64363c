"""Where the engine's time goes in one batch: prefill, decode forwards, sampling, the rest.

Runs ``torch_backend.decode_batch`` (what the engine's worker thread runs for a batch) on
this thread, with the benchmark's prompts and sampling settings (temperature 1, seeded,
ignore_eos), and times its parts by wrapping ``torch_backend._forward`` and
``BatchSampler.sample``; then, with ``--ops``, lists the top torch ops of one more batch.
Not a benchmark: the figures in bench/RESULTS.md come from bench/engine.py.

    .venv/bin/python bench/engine_profile.py --model smollm2 --batch 64 --tokens 16
    .venv/bin/python bench/engine_profile.py --model demo --batch 64 --ops
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
from services.rollout import torch_backend
from services.rollout.engine import GenerationRequest, Row
from services.rollout.sampling import BatchSampler
from services.rollout.torch_backend import LoadedModel, decode_batch, load_model


class Hooks:
    """The engine's side of decode_batch, minus locking: finish rows, nothing between steps."""

    def current_version(self) -> int:
        return 1

    def finish(self, row: Row, reason: int, error: str = "") -> None:
        row.finish = reason

    def after_step(self, live: list[Row]) -> None:
        return None


def make_rows(prompts: Sequence[list[int]], tokens: int, *, seeded: bool) -> list[Row]:
    configs = sampling_configs(len(prompts), tokens, seed=1, greedy=False)
    rows = []
    for i, (prompt, config) in enumerate(zip(prompts, configs, strict=True)):
        request = GenerationRequest(f"profile-{i}", list(prompt), config, lambda _: None)
        row = Row(request, 0, frozenset())
        if not seeded:
            request.config = type(config)(
                **{**{f: getattr(config, f) for f in config.__slots__}, "seed": None}
            )
        rows.append(row)
    return rows


def timed_parts(loaded: LoadedModel, rows: list[Row]) -> dict[str, float]:
    """Seconds in prefill, decode forwards, sampling and everything else, for one batch."""
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def wrap(name: Callable[[int], str], inner: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            key = name(calls["forward"])
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
                calls["forward" if key != "sampling" else "sampling"] += 1

        return timed

    forward, sample = torch_backend._forward, BatchSampler.sample
    torch_backend._forward = wrap(lambda n: "prefill" if n == 0 else "decode forwards", forward)
    BatchSampler.sample = wrap(lambda _: "sampling", sample)  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        decode_batch(loaded, rows, device=CPU, hooks=Hooks())
        total = time.perf_counter() - start
    finally:
        torch_backend._forward, BatchSampler.sample = forward, sample  # type: ignore[method-assign]
    spent["rest (row bookkeeping, cache selection, masks)"] = total - sum(spent.values())
    spent["total"] = total
    return dict(spent)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="demo")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per row (%(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--unseeded", action="store_true", help="rows without seeds (one shared stream)")
    parser.add_argument("--ops", action="store_true", help="also list the top torch ops")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = MODELS[args.model](args.batch)
    loaded = load_model(model.path, device=CPU, dtype=torch.float32)
    prompts = model.prompts[: args.batch]
    decode_batch(loaded, make_rows(prompts, min(args.tokens, 8), seeded=True), device=CPU, hooks=Hooks())
    parts = timed_parts(loaded, make_rows(prompts, args.tokens, seeded=not args.unseeded))
    print(f"{model.name}, batch {args.batch}, {args.tokens} new tokens, {args.threads} threads:")
    for name, seconds in parts.items():
        print(f"  {name:>48}: {seconds * 1e3:9.1f} ms  {seconds / parts['total']:6.1%}")
    steps = args.tokens - 1
    if steps:
        per_step = (parts["decode forwards"] + parts["sampling"]) / steps
        print(f"  {'per decode step (forward + sampling)':>48}: {per_step * 1e3:9.2f} ms")
    if args.ops:
        rows = make_rows(prompts, args.tokens, seeded=not args.unseeded)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            decode_batch(loaded, rows, device=CPU, hooks=Hooks())
        print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
