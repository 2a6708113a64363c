"""Training tokens/s of verst's trainer step next to a plain torch loop on the same packed batch.

One process, one model directory, one RL batch (see bench/trainer_sides.py), three sides timed
one optimiser step at a time, alternating within each repeat:

- verst: ``Policy.optimise`` as the trainer service runs it: a DeepSpeed engine (ZeRO-1,
  gradient clipping 1.0, torch AdamW), the samples packed end to end into rows and the rows into
  micro-batches of at most ``--micro-batch-tokens`` (``batching.plan_micro_batches``), gradient
  accumulation, the real loss (``objective.micro_batch_loss``: ppo_clip plus the logged
  entropy and statistics);
- torch: a fresh copy of the same weights under plain transformers, the same micro-batches
  (same packed rows, same ``collate``): forward, token logprobs, ``losses.ppo_clip``,
  backward per micro-batch, then ``clip_grad_norm_``, ``AdamW.step``, ``zero_grad``;
- naive: that same plain loop over fixed micro-batches of ``--naive-rows`` samples in arrival
  order, one per row, each padded to its longest sequence (what a loop without packing does).

tokens/s = real (unpadded) tokens, prompts included, / seconds of the step (what the trainer
reports as ``tokens_per_s``). Before the timed steps, both verst and torch take one step from
the same weights: their losses and gradient norms must agree (the same work was done).

    .venv/bin/python bench/trainer.py                  # also rewrites its section of bench/RESULTS.md
    .venv/bin/python bench/trainer.py --no-results --models demo --repeat 3
"""

from __future__ import annotations

import argparse
import gc
import logging
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.engine import wait_for_quiet, with_load
from bench.engine_models import MODELS
from bench.engine_sides import machine_info
from bench.report import BUSY_MACHINE, update_results
from bench.trainer_sides import (
    PlainModel,
    PlainSide,
    Shape,
    StepResult,
    VerstSide,
    describe,
    job_spec,
    naive_packs,
    rl_batch,
    versions,
)
from services.trainer.batching import Pack, TrainSample, padding_waste, plan_micro_batches

SECTION_TITLE = "## trainer (bench/trainer.py)"
NOTES_MARKER = (
    "<!-- notes: written by hand; bench/trainer.py keeps everything from here to the next section -->"
)
MAX_REPEAT = 25
"""Most timed repeats of a model that --min-seconds may ask for."""
WASTE_BUDGETS = (256, 512, 1024, 2048, 4096, 8192)
"""micro_batch_tokens values of the padding-waste table (packing only, not timed)."""
CHECK_TOLERANCE = 1e-4
"""Largest relative difference of loss and gradient norm between verst's and torch's first step."""
DESCRIPTION = """
Training tokens/s of one optimiser step: verst's trainer (`Policy.optimise`: DeepSpeed engine,
ZeRO-1, gradient clipping 1.0, torch AdamW; samples packed end to end into rows as wide as the
longest sample, each with its own position ids, and the rows into micro-batches of
`micro_batch_tokens`, both first-fit decreasing; gradient accumulation; the real loss with its
logged statistics) next to a plain torch loop on a fresh copy of the same weights over the very
same micro-batches (`collate` of the same packed rows): forward, token logprobs,
`losses.ppo_clip`, backward, then `clip_grad_norm_`, `AdamW.step`, `zero_grad`. "naive" is that
plain loop over fixed micro-batches in arrival order, one sample per row, each padded to its
longest row (no packing). All three in one process, the same torch threads, fp32 on the CPU;
within each repeat the sides run one after the other (verst first in odd repeats, last in even).
tokens/s = real (unpadded) tokens, prompts included, / seconds per step, as the trainer reports
`tokens_per_s`; padding waste = padded tokens / tokens computed in the micro-batches.

The batch is an RL batch built the way the trainer builds one: groups of one prompt (the model's
bench prompts) x group-size responses of long-tailed lengths (log-normal around a quarter of
max_new_tokens, cut to 5..max_new_tokens; EOS-terminated unless cut), behaviour logprobs from the
model itself, 0/1 rewards, then `services.trainer.prepare.prepare` (old logprobs, GRPO advantages).
"""


@dataclass(frozen=True, slots=True)
class Settings:
    shapes: dict[str, Shape]
    micro_batch_tokens: int
    naive_rows: int
    learning_rate: float
    threads: int
    repeat: int
    warmup: int
    min_seconds: float
    quiet_wait_s: float
    seed: int


@dataclass(frozen=True, slots=True)
class Timing:
    """One timed step and the cores other processes kept busy meanwhile."""

    step: StepResult
    other: float


@dataclass(slots=True)
class Case:
    """One model's batch, its packing and its timed steps."""

    model: str
    shape: Shape
    about: str
    lengths: list[int]
    responses: list[int]
    packs: int
    waste: float
    naive_packs: int
    naive_waste: float
    check: str
    waste_by_budget: dict[int, tuple[float, float]]
    """micro_batch_tokens -> padding waste packed, and with one sample per row."""
    verst: list[Timing] = field(default_factory=list)
    torch: list[Timing] = field(default_factory=list)
    naive: list[Timing] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def rate(self, runs: Sequence[Timing]) -> float:
        return self.tokens / statistics.median(t.step.seconds for t in runs)

    @property
    def ratio(self) -> float:
        return self.rate(self.verst) / self.rate(self.torch)

    def others(self) -> list[float]:
        return [t.other for runs in (self.verst, self.torch, self.naive) for t in runs]

    def line(self, *, with_model: bool) -> str:
        model = f"model={self.model} " if with_model else ""
        return (
            f"trainer: {model}verst_tok_s={self.rate(self.verst):.1f} torch_tok_s={self.rate(self.torch):.1f}"
            f" ratio={self.ratio:.2f} padding_waste={self.waste:.3f}"
        )


def timed(call: Callable[[], StepResult]) -> Timing:
    step, other = with_load(call)
    return Timing(step, other)


def cross_check(verst: VerstSide, plain: PlainSide, samples: list[TrainSample], packs: list[Pack]) -> str:
    """One step of each from the same weights: same tokens, loss and gradient norm."""
    ours, theirs = verst.step(samples, seed=0), plain.step(samples, packs)

    def gap(a: float, b: float) -> float:
        return abs(a - b) / max(abs(a), abs(b), 1e-12)

    loss_gap, norm_gap = gap(ours.loss, theirs.loss), gap(ours.grad_norm, theirs.grad_norm)
    same_tokens = (ours.tokens, ours.padded_tokens) == (theirs.tokens, theirs.padded_tokens)
    if not (same_tokens and loss_gap < CHECK_TOLERANCE and norm_gap < CHECK_TOLERANCE):
        print(f"  warning: verst and torch did not do the same step: {ours} vs {theirs}")
    return (
        f"first step from the same weights: loss {ours.loss:.6g} vs {theirs.loss:.6g}"
        f" (relative difference {loss_gap:.1e}), grad norm {ours.grad_norm:.6g} vs {theirs.grad_norm:.6g}"
        f" ({norm_gap:.1e}), tokens {'equal' if same_tokens else 'DIFFERENT'}"
    )


def run_repeat(
    verst: VerstSide, plain: PlainSide, samples: list[TrainSample], packs: list[Pack],
    naive: list[Pack], *, verst_first: bool,
) -> tuple[Timing, Timing, Timing]:  # fmt: skip
    """[verst, torch, naive]: verst first in odd repeats, last in even ones (so that a drift in
    machine speed does not always favour the same side)."""
    calls: dict[str, Callable[[], StepResult]] = {
        "verst": lambda: verst.step(samples, seed=0),
        "torch": lambda: plain.step(samples, packs),
        "naive": lambda: plain.step(samples, naive),
    }
    order = ("verst", "torch", "naive") if verst_first else ("naive", "torch", "verst")
    done = {name: timed(calls[name]) for name in order}
    return done["verst"], done["torch"], done["naive"]


def measure(
    case: Case, verst: VerstSide, plain: PlainSide, samples: list[TrainSample],
    packs: list[Pack], naive: list[Pack], cfg: Settings,
) -> None:  # fmt: skip
    """Warm-up steps, then the timed repeats, into ``case``."""
    for _ in range(cfg.warmup):
        verst.step(samples, seed=0)
        plain.step(samples, packs)
        plain.step(samples, naive)
    k = 0
    while k < cfg.repeat or (sum(t.step.seconds for t in case.verst) < cfg.min_seconds and k < MAX_REPEAT):
        k += 1
        waited = wait_for_quiet(cfg.quiet_wait_s) if cfg.quiet_wait_s else 0.0
        runs = run_repeat(verst, plain, samples, packs, naive, verst_first=k % 2 == 1)
        for runs_of, run in zip((case.verst, case.torch, case.naive), runs, strict=True):
            runs_of.append(run)
        v, t, n = (case.tokens / r.step.seconds for r in runs)
        print(
            f"  {case.model} run {k}: verst {v:,.0f} tok/s, torch {t:,.0f} tok/s ({v / t:.2f}),"
            f" naive {n:,.0f} tok/s; other load {max(r.other for r in runs):.2f} cores"
            f" (waited {waited:.0f} s for a quiet machine first)",
            flush=True,
        )
    if statistics.median(case.others()) > BUSY_MACHINE:
        print(f"  warning: other processes were busy during most of {case.model}")


def measure_model(name: str, cfg: Settings) -> Case:
    shape = cfg.shapes[name]
    bench_model = MODELS[name](shape.groups)
    path = bench_model.path
    print(f"{bench_model.name}: {path}", flush=True)
    spec = job_spec(path, shape, cfg.micro_batch_tokens, cfg.learning_rate)
    model = PlainModel(path, spec)
    samples = rl_batch(model, bench_model.prompts, shape, spec, path, cfg.seed)
    lengths = [s.length for s in samples]
    packs = plan_micro_batches(lengths, cfg.micro_batch_tokens)
    naive = naive_packs(len(samples), cfg.naive_rows)
    verst = VerstSide(path, spec)
    try:
        plain = PlainSide(model, spec)
        check = cross_check(verst, plain, samples, packs)
        print(f"  cross-check: {check}", flush=True)
        case = Case(
            model=bench_model.name,
            shape=shape,
            about=describe(model),
            lengths=lengths,
            responses=[len(s.response_token_ids) for s in samples],
            packs=len(packs),
            waste=padding_waste(lengths, packs),
            naive_packs=len(naive),
            naive_waste=padding_waste(lengths, naive),
            check=check,
            waste_by_budget={
                b: (
                    padding_waste(lengths, plan_micro_batches(lengths, b)),
                    padding_waste(lengths, plan_micro_batches(lengths, b, packed=False)),
                )
                for b in WASTE_BUDGETS
            },
        )
        measure(case, verst, plain, samples, packs, naive, cfg)
    finally:
        verst.close()
    return case


def section(cfg: Settings, command: str, host: dict[str, str], cases: Sequence[Case]) -> str:
    """This benchmark's section of RESULTS.md, up to (not including) its notes."""
    head = [
        SECTION_TITLE,
        "",
        *DESCRIPTION.strip("\n").splitlines(),
        "",
        f"    {command}",
        "",
        *(f"- {key}: {value}" for key, value in host.items()),
        f"- torch threads: {cfg.threads}; {versions()}; learning rate {cfg.learning_rate:g}",
        f"- micro_batch_tokens {cfg.micro_batch_tokens} (verst and torch); naive: {cfg.naive_rows} rows"
        f" per micro-batch",
        *(
            f"- {c.model}: {c.about}; {c.shape.groups} groups x {c.shape.group_size} = {c.shape.samples}"
            f" samples, max_new_tokens {c.shape.max_new_tokens}; prompts {_span(c.lengths, c.responses)},"
            f" responses {min(c.responses)} / {statistics.median(c.responses):g} / {max(c.responses)}"
            f" tokens (min / median / max); {c.tokens:,} tokens in all; {c.check}"
            for c in cases
        ),
        f"- per model: {cfg.warmup} uncounted warm-up step(s) per side, then {cfg.repeat} timed repeats"
        + (
            f", or more (at most {MAX_REPEAT}) until verst's timed steps add up to {cfg.min_seconds:g} s"
            if cfg.min_seconds > 0
            else ""
        )
        + f"; medians; before each repeat, a wait of up to {cfg.quiet_wait_s:g} s for other processes"
        f" to keep under {BUSY_MACHINE} cores busy for 1 s; seed {cfg.seed}",
        "",
    ]
    table = [
        "| model | tokens | micro-batches (verst / naive) | padding waste (verst / naive) | repeats"
        " | verst tok/s | torch tok/s | verst / torch | naive tok/s | verst / naive"
        " | other load, cores (median / max) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {c.model} | {c.tokens:,} | {c.packs} / {c.naive_packs} | {c.waste:.1%} / {c.naive_waste:.1%}"
            f" | {len(c.verst)} | {c.rate(c.verst):,.0f} | {c.rate(c.torch):,.0f} | {c.ratio:.2f}"
            f" | {c.rate(c.naive):,.0f} | {c.rate(c.verst) / c.rate(c.naive):.2f}"
            f" | {statistics.median(c.others()):.2f} / {max(c.others()):.2f} |"
            for c in cases
        ),
        "",
        "Padding waste of verst's plan for the same batch at other micro_batch_tokens, packed rows"
        " (`trainer.packing`, the default) / one sample per row (not timed):",
        "",
        "| model | " + " | ".join(str(b) for b in WASTE_BUDGETS) + " |",
        "|---|" + "---:|" * len(WASTE_BUDGETS),
        *(
            f"| {c.model} | " + " | ".join(f"{p:.1%} / {o:.1%}" for p, o in c.waste_by_budget.values()) + " |"
            for c in cases
        ),
        "",
        "Other load: CPU cores kept busy by other processes (or stolen by the hypervisor) during each",
        f"timed step; above {BUSY_MACHINE} that step's figure is low. The VM's speed also drifts:",
        "compare the sides within a row.",
    ]
    return "\n".join(head + table) + "\n"


def _span(lengths: Sequence[int], responses: Sequence[int]) -> str:
    prompts = [total - response for total, response in zip(lengths, responses, strict=True)]
    low, high = min(prompts), max(prompts)
    return f"{low} tokens" if low == high else f"{low} to {high} tokens"


def parse_shapes(text: str) -> dict[str, Shape]:
    """``demo=8x8:64,smollm2=2x8:128`` -> {name: Shape(groups, group_size, max_new_tokens)}."""
    shapes = {}
    for item in filter(None, text.split(",")):
        name, _, rest = item.partition("=")
        sizes, _, new_tokens = rest.partition(":")
        groups, _, size = sizes.partition("x")
        shapes[name] = Shape(int(groups), int(size), int(new_tokens))
    return shapes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", default="demo,smollm2", help=f"of {', '.join(MODELS)} (%(default)s)")
    parser.add_argument(
        "--shapes",
        default="demo=8x8:64,smollm2=2x8:128",
        help="per model: groups x group size : max_new_tokens (%(default)s)",
    )
    parser.add_argument("--micro-batch-tokens", type=int, default=1024, help="packing budget (%(default)s)")
    parser.add_argument("--naive-rows", type=int, default=8, help="rows per naive micro-batch (%(default)s)")
    parser.add_argument("--learning-rate", type=float, default=1e-5, help="both sides (%(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (%(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="timed repeats per model (%(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted steps per side (%(default)s)")
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=5.0,
        help=f"repeat (up to {MAX_REPEAT} times) until verst's steps ran this long (%(default)s)",
    )
    parser.add_argument(
        "--quiet-wait",
        dest="quiet_wait_s",
        type=float,
        default=120.0,
        help="before each repeat, wait up to this long for other processes to go quiet (%(default)s s)",
    )
    parser.add_argument("--seed", type=int, default=1234, help="the batch's seed (%(default)s)")
    parser.add_argument(
        "--results",
        type=Path,
        default=Path(__file__).resolve().parent / "RESULTS.md",
        help="file whose trainer section to rewrite (bench/RESULTS.md)",
    )
    parser.add_argument("--no-results", action="store_true", help="leave the results file alone")
    args = parser.parse_args(argv)
    args.model_names = [m for m in args.models.split(",") if m]
    try:
        args.shapes = parse_shapes(args.shapes)
    except ValueError:
        parser.error("--shapes: write name=GROUPSxSIZE:MAX_NEW_TOKENS,...")
    if unknown := [m for m in args.model_names if m not in MODELS]:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    if missing := [m for m in args.model_names if m not in args.shapes]:
        parser.error(f"--shapes has no shape for {missing}")
    if any(min(s.groups, s.group_size, s.max_new_tokens) < 1 for s in args.shapes.values()):
        parser.error("--shapes: every size must be >= 1")
    for flag, minimum in (("micro_batch_tokens", 16), ("naive_rows", 1), ("threads", 1), ("repeat", 1)):
        if getattr(args, flag) < minimum:
            parser.error(f"--{flag.replace('_', '-')} must be >= {minimum}")
    if args.warmup < 0 or args.quiet_wait_s < 0 or args.learning_rate <= 0:
        parser.error("--warmup and --quiet-wait must be >= 0, --learning-rate > 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = Settings(**{name: getattr(args, name) for name in Settings.__dataclass_fields__})
    torch.set_num_threads(cfg.threads)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    host = machine_info()
    for key, value in host.items():
        print(f"{key:>13}: {value}")
    cases = []
    for name in args.model_names:
        cases.append(measure_model(name, cfg))
        gc.collect()  # the last model's copies, before the next one loads
    if not args.no_results:
        command = shlex.join(
            [".venv/bin/python", "bench/trainer.py", *(sys.argv[1:] if argv is None else argv)]
        )
        update_results(args.results, SECTION_TITLE, section(cfg, command, host, cases), NOTES_MARKER)
        print(f"updated {args.results}")
    for case in cases:
        print(case.line(with_model=True))
    print(cases[0].line(with_model=False))  # the headline: the first model's


if __name__ == "__main__":
    main()
