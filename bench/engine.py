"""Generated tokens/s of the torch rollout engine next to transformers' ``model.generate``.

The engine runs in this process, ``generate`` in a child process (so the two do not share
OpenMP thread pools), on the same model directory, the same prompts and the same sampling
settings, one after the other within each repeat, at batch 1, 16 and 64, for
the builtin demo model and SmolLM2-135M-Instruct (see bench/engine_models.py):

- verst: ``TorchEngine`` as the rollout server drives it: one ``GenerationRequest`` per
  prompt, submitted together, timed from the first submit to the last completion (token ids,
  per-token logprobs and policy versions). Its time to first token is what
  ``GenerateStats.time_to_first_token_s`` reports (``first_token_at - submitted_at``), the
  largest in the batch.
- HF: ``generate(input_ids, attention_mask, do_sample=True, ..., output_scores=True,
  return_dict_in_generate=True)`` on left-padded prompts, then
  ``compute_transition_scores(normalize_logits=True)``, so that it yields per-token logprobs
  too; "HF plain" is the same generate without scores.
  Its time to first token is a whole generate with ``max_new_tokens=1`` at that batch.

Temperature 1.0 sampling (top-p 1, top-k 0, min-p 0), fixed seeds, float32 on the CPU
(``--dtype bfloat16``: both sides' weights and compute in bfloat16), the
same torch thread count for both. Neither stops before ``--max-new-tokens``: the engine gets
``ignore_eos``; the baseline model's generation config has no EOS id. Before the timed cases a
greedy cross-check compares the two (same tokens, logprobs within float error).

    .venv/bin/python bench/engine.py                  # also rewrites its section of bench/RESULTS.md
    .venv/bin/python bench/engine.py --no-results --models demo --batches 1,64
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.engine_models import MODELS, BenchModel
from bench.engine_sides import EngineSide, HfProcess, greedy_check, machine_info, sampling_configs
from bench.report import BUSY_MACHINE, CpuSample, update_results

SECTION_TITLE = "## engine (bench/engine.py)"
NOTES_MARKER = (
    "<!-- notes: written by hand; bench/engine.py keeps everything from here to the next section -->"
)
MAX_REPEAT = 25
"""Most timed repeats of a case that --min-seconds may ask for."""
GREEDY_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25}
"""The largest logprob difference of the greedy cross-check not warned of, per dtype: the two
sides sum in other orders, and bfloat16 keeps 8 bits of mantissa."""
T = TypeVar("T")
DESCRIPTION = """
Generated tokens/s of the torch rollout engine ("verst": `TorchEngine`, driven in-process as the
rollout server drives it) next to transformers' `model.generate` ("HF", in a child process of its
own: in one process the two share OpenMP's thread pools, which slowed both sides 1.5 to 2x), on the
same model directory, the same prompts and the same sampling settings; within each repeat the sides
run one after the other (verst first in odd repeats, last in even ones). The ratio is the median
over the repeats of verst's tok/s over HF's within a repeat.

- verst: one `GenerationRequest` per prompt, submitted together (`max_batch_size` = the batch, so
  they form one batch), timed from the first submit to the last completion (token ids, per-token
  logprobs, policy versions). TTFT: `first_token_at - submitted_at`, what
  `GenerateStats.time_to_first_token_s` reports, the largest in the batch.
- HF: on left-padded prompts, `generate(input_ids, attention_mask, do_sample=True, temperature=1.0,
  top_k=0, top_p=1.0, max_new_tokens, pad_token_id, output_scores=True,
  return_dict_in_generate=True)`, then `compute_transition_scores(normalize_logits=True)` for the
  per-token logprobs (the engine computes them, so a fair baseline must too). "HF plain": the same
  generate without scores. TTFT: a whole generate with `max_new_tokens=1` at that batch (with
  scores).
- Sampling: temperature 1.0, top-p 1, top-k 0, min-p 0 on both sides (HF's scores are checked free
  of -inf, i.e. unfiltered), fixed seeds (verst: one per request; HF: `torch.manual_seed` before
  each generate). The two draw differently (verst: one uniform per row from its own stream, inverted
  through the row's CDF; HF: `torch.multinomial`), so the sampled tokens differ, but the work does
  not: every row gets exactly max_new_tokens new tokens, verst with `ignore_eos`, HF with no EOS id
  in its generation config.
- Before the timed cases, a greedy cross-check runs the same prompts greedily on both sides: same
  tokens, logprobs equal within float error.
"""


@dataclass(frozen=True, slots=True)
class Settings:
    max_new_tokens: int
    threads: int
    repeat: int
    warmup: int
    warmup_tokens: int
    min_seconds: float
    quiet_wait_s: float
    seed: int
    compile: tuple[str, ...]
    """Models whose engine runs with compile_decode."""
    dtype: str = "float32"
    """Both sides' weights and compute: float32 or bfloat16."""


@dataclass(frozen=True, slots=True)
class Timing:
    """One timed call: wall seconds, time to first token, and the cores others kept busy."""

    seconds: float
    ttft: float
    other: float


@dataclass(slots=True)
class Case:
    """The timed (not warm-up) runs of one model at one batch size."""

    model: str
    batch: int
    tokens: int
    """New tokens per run: batch x max_new_tokens."""
    verst: list[Timing] = field(default_factory=list)
    hf: list[Timing] = field(default_factory=list)
    hf_plain: list[Timing] = field(default_factory=list)
    hf_first: list[Timing] = field(default_factory=list)

    def rate(self, runs: Sequence[Timing]) -> float:
        return self.tokens / statistics.median(t.seconds for t in runs)

    def paired(self, baseline: Sequence[Timing]) -> float:
        """verst's speed over ``baseline``'s: the median over repeats of the two sides' ratio
        within a repeat. The sides of a repeat ran back to back, so the VM's drift in speed
        (up to 2x over tens of seconds) cancels out of each ratio; it does not cancel out of the
        ratio of two medians, which may pair a fast minute of one side with a slow one of the other."""
        return statistics.median(b.seconds / v.seconds for v, b in zip(self.verst, baseline, strict=True))

    @property
    def ratio(self) -> float:
        return self.paired(self.hf)

    @property
    def ratio_of_medians(self) -> float:
        return self.rate(self.verst) / self.rate(self.hf)

    @property
    def verst_ttft(self) -> float:
        return statistics.median(t.ttft for t in self.verst)

    @property
    def hf_ttft(self) -> float:
        return statistics.median(t.seconds for t in self.hf_first)

    def others(self) -> list[float]:
        """Other processes' load during each timed call of the case, in cores."""
        return [t.other for runs in (self.verst, self.hf, self.hf_plain, self.hf_first) for t in runs]

    def line(self) -> str:
        return (
            f"engine: model={self.model} batch={self.batch} verst_tok_s={self.rate(self.verst):.1f}"
            f" hf_tok_s={self.rate(self.hf):.1f} ratio={self.ratio:.2f}"
        )


def with_load(call: Callable[[], T]) -> tuple[T, float]:
    """``call()`` and the cores that other processes kept busy meanwhile."""
    before = CpuSample.now("")  # no Redis server here: only this process counts as ours
    result = call()
    return result, CpuSample.now("").other_cores_since(before)


def wait_for_quiet(limit_s: float, window_s: float = 1.0) -> float:
    """Wait (at most ``limit_s``) until other processes kept under BUSY_MACHINE cores busy for
    ``window_s``; returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        _, other = with_load(lambda: time.sleep(window_s))
        if other < BUSY_MACHINE:
            break
    return time.monotonic() - start


def run_repeat(
    engine: EngineSide,
    hf: HfProcess,
    prompts: list[list[int]],
    new_tokens: int,
    seed: int,
    *,
    verst_first: bool,
) -> list[Timing]:
    """One repeat of a case: [verst, HF with logprobs, HF plain, HF with one new token].

    verst runs first or last (alternate repeats), so that a drift in machine speed does not
    always favour the same side.
    """
    ids, mask = hf.inputs(prompts)
    configs = sampling_configs(len(prompts), new_tokens, seed=seed, greedy=False)

    def verst() -> Timing:
        (seconds, ttft), load = with_load(lambda: engine.timed(prompts, configs))
        return Timing(seconds, ttft, load)

    first = verst() if verst_first else None
    timings = []
    for n, scores in ((new_tokens, True), (new_tokens, False), (1, True)):
        seconds, load = with_load(lambda n=n, s=scores: hf.timed(ids, mask, n, scores=s, seed=seed))
        timings.append(Timing(seconds, seconds, load))
    return [first or verst(), *timings]


def warm_up(engine: EngineSide, hf: HfProcess, prompts: list[list[int]], cfg: Settings) -> None:
    """Uncounted generates at this batch, each side once per warm-up, with fewer new tokens."""
    ids, mask = hf.inputs(prompts)
    for k in range(cfg.warmup):
        engine.timed(prompts, sampling_configs(len(prompts), cfg.warmup_tokens, seed=k, greedy=False))
        hf.timed(ids, mask, cfg.warmup_tokens, scores=True, seed=k)


def measure_case(engine: EngineSide, hf: HfProcess, model: BenchModel, batch: int, cfg: Settings) -> Case:
    case = Case(model.name, batch, batch * cfg.max_new_tokens)
    prompts = model.prompts[:batch]
    warm_up(engine, hf, prompts, cfg)
    k = 0
    while k < cfg.repeat or (sum(t.seconds for t in case.verst) < cfg.min_seconds and k < MAX_REPEAT):
        k += 1
        waited = wait_for_quiet(cfg.quiet_wait_s) if cfg.quiet_wait_s else 0.0
        seed = cfg.seed + 1000 * k
        verst, hf_run, plain, first = run_repeat(
            engine, hf, prompts, cfg.max_new_tokens, seed, verst_first=k % 2 == 1
        )
        print(
            f"  {model.name} batch {batch} run {k}: verst {case.tokens / verst.seconds:,.1f} tok/s"
            f" (ttft {verst.ttft * 1e3:.1f} ms), hf {case.tokens / hf_run.seconds:,.1f} tok/s,"
            f" hf plain {case.tokens / plain.seconds:,.1f} tok/s, hf ttft {first.seconds * 1e3:.1f} ms;"
            f" other load {max(t.other for t in (verst, hf_run, plain, first)):.2f} cores"
            f" (waited {waited:.0f} s for a quiet machine first)",
            flush=True,
        )
        case.verst.append(verst)
        case.hf.append(hf_run)
        case.hf_plain.append(plain)
        case.hf_first.append(first)
    if statistics.median(case.others()) > BUSY_MACHINE:
        print(f"  warning: other processes were busy during most of {model.name} batch {batch}")
    return case


@dataclass(slots=True)
class ModelReport:
    """What the section says about one model besides its cases."""

    model: BenchModel
    parameters: int
    shape: str
    check: str
    worker_threads: set[int]


def measure_model(name: str, batches: Sequence[int], cfg: Settings) -> tuple[ModelReport, list[Case]]:
    model = MODELS[name](max(batches))
    print(f"{model.name}: {model.path}", flush=True)
    dtype = getattr(torch, cfg.dtype)
    engine = EngineSide(model.path, compile_decode=name in cfg.compile, dtype=dtype)
    hf = HfProcess(model.path, cfg.threads, dtype)
    try:
        prompts = model.prompts[: min(4, max(batches))]
        tolerance = GREEDY_TOLERANCE[cfg.dtype]
        check = greedy_check(engine, hf, prompts, new_tokens=16, tolerance=tolerance)
        print(f"  greedy cross-check: {check}", flush=True)
        cases = [measure_case(engine, hf, model, batch, cfg) for batch in batches]
        report = ModelReport(model, hf.parameters(), hf.shape(), check, engine.worker_threads)
    finally:
        engine.close()
        hf.close()
    return report, cases


def section(
    cfg: Settings, command: str, host: dict[str, str], reports: Sequence[ModelReport], cases: Sequence[Case]
) -> str:
    """This benchmark's section of RESULTS.md, up to (not including) its notes."""
    worker = sorted({n for r in reports for n in r.worker_threads})
    head = [
        SECTION_TITLE,
        "",
        *DESCRIPTION.strip("\n").splitlines(),
        "",
        f"    {command}",
        "",
        *(f"- {key}: {value}" for key, value in host.items()),
        f"- torch threads: {cfg.threads} for both (torch.set_num_threads; the engine's worker thread"
        f" ran with {', '.join(map(str, worker))}); each side in a process of its own",
        f"- verst engine: continuous batching; compile_decode (torch.compile of the decode step, its"
        f" one-off compile in the uncounted warm-up) for: {', '.join(cfg.compile) or 'none'}",
        *(
            f"- {r.model.name}: {r.model.path.name}, {r.parameters:,} parameters ({r.shape});"
            f" prompts of {_span(r.model.prompts)} tokens;"
            f" greedy cross-check: {r.check}"
            for r in reports
        ),
        f"- per case: {cfg.max_new_tokens} new tokens per row; first {cfg.warmup} uncounted warm-up"
        f" generate(s) per side at that batch ({cfg.warmup_tokens} new tokens), then {cfg.repeat} timed"
        f" repeats, or more (at most {MAX_REPEAT}) until verst's timed runs add up to {cfg.min_seconds:g} s;"
        f" medians; seeds {cfg.seed} + 1000 x repeat (verst: + the row); before each repeat, a wait of"
        f" up to {cfg.quiet_wait_s:g} s for other processes to keep under {BUSY_MACHINE} cores busy for 1 s",
        "",
    ]
    table = [
        "| model | batch | repeats | verst tok/s | HF tok/s (logprobs) | verst / HF | ratio of the medians"
        " | HF plain tok/s | verst / HF plain | verst TTFT ms | HF TTFT ms"
        " | other load, cores (median / max) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {c.model} | {c.batch} | {len(c.verst)} | {c.rate(c.verst):,.1f} | {c.rate(c.hf):,.1f}"
            f" | {c.ratio:.2f} | {c.ratio_of_medians:.2f} | {c.rate(c.hf_plain):,.1f}"
            f" | {c.paired(c.hf_plain):.2f}"
            f" | {c.verst_ttft * 1e3:.1f} | {c.hf_ttft * 1e3:.1f}"
            f" | {statistics.median(c.others()):.2f} / {max(c.others()):.2f} |"
            for c in cases
        ),
        "",
        "Other load: CPU cores kept busy by other processes (or stolen by the hypervisor) during each",
        f"timed call of the case; above {BUSY_MACHINE} that call's figure is low. The VM's speed also",
        "drifts (up to 2x over minutes, with no other load visible): compare the sides within a row.",
        "verst / HF (and verst / HF plain): the median over the repeats of the ratio of the two sides'",
        "tok/s within a repeat, where they ran back to back; the ratio of the two medians is beside it.",
    ]
    return "\n".join(head + table) + "\n"


def _span(prompts: Sequence[list[int]]) -> str:
    low, high = min(map(len, prompts)), max(map(len, prompts))
    return str(low) if low == high else f"{low} to {high}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", default="demo,smollm2", help=f"of {', '.join(MODELS)} (%(default)s)")
    parser.add_argument("--batches", default="1,16,64", help="batch sizes (%(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per row (%(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for both (%(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="timed repeats per case (%(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted generates per side (%(default)s)")
    parser.add_argument("--warmup-tokens", type=int, default=8, help="new tokens in those (%(default)s)")
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=5.0,
        help=f"repeat short cases (up to {MAX_REPEAT} times) until verst ran this long (%(default)s)",
    )
    parser.add_argument(
        "--quiet-wait",
        dest="quiet_wait_s",
        type=float,
        default=120.0,
        help="before each repeat, wait up to this long for other processes to go quiet (%(default)s s)",
    )
    parser.add_argument("--seed", type=int, default=1234, help="base seed (%(default)s)")
    parser.add_argument(
        "--dtype", choices=tuple(GREEDY_TOLERANCE), default="float32", help="both sides' (%(default)s)"
    )
    parser.add_argument(
        "--compile",
        default="demo",
        help="models whose engine compiles its decode step (compile_decode; 'none' for none) (%(default)s)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=Path(__file__).resolve().parent / "RESULTS.md",
        help="file whose engine section to rewrite (bench/RESULTS.md)",
    )
    parser.add_argument("--no-results", action="store_true", help="leave the results file alone")
    args = parser.parse_args(argv)
    args.model_names = [m for m in args.models.split(",") if m]
    args.batch_sizes = [int(b) for b in args.batches.split(",") if b]
    args.compile = tuple(m for m in args.compile.split(",") if m and m != "none")
    if unknown := [m for m in args.compile if m not in MODELS]:
        parser.error(f"--compile: unknown models {unknown}; known: {', '.join(MODELS)}")
    if unknown := [m for m in args.model_names if m not in MODELS]:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    if args.quiet_wait_s < 0:
        parser.error("--quiet-wait must be >= 0")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error("--batches must list sizes >= 1")
    for flag, minimum in (
        ("max_new_tokens", 1),
        ("threads", 1),
        ("repeat", 1),
        ("warmup", 0),
        ("warmup_tokens", 1),
    ):
        if getattr(args, flag) < minimum:
            parser.error(f"--{flag.replace('_', '-')} must be >= {minimum}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = Settings(**{name: getattr(args, name) for name in Settings.__dataclass_fields__})
    torch.set_num_threads(cfg.threads)
    host = machine_info(cfg.dtype)
    for key, value in host.items():
        print(f"{key:>12}: {value}")
    reports, cases = [], []
    for name in args.model_names:
        report, model_cases = measure_model(name, args.batch_sizes, cfg)
        reports.append(report)
        cases.extend(model_cases)
    if not args.no_results:
        command = shlex.join(
            [".venv/bin/python", "bench/engine.py", *(sys.argv[1:] if argv is None else argv)]
        )
        update_results(args.results, SECTION_TITLE, section(cfg, command, host, reports, cases), NOTES_MARKER)
        print(f"updated {args.results}")
    for case in cases:
        print(case.line())


if __name__ == "__main__":
    main()
