"""One bounded check of verst on a CUDA machine: each step (bench/gpu_steps.py) in a child process
of its own, timed, with its own time limit, its failure recorded without stopping the rest, and
every figure written to one JSON file (rewritten after each step, so a run cut short keeps what
it measured):

- environment: torch, CUDA, the GPUs, the versions of the packages the steps use;
- model: a random Llama (GPU-sized: 16 layers, hidden 1024) on the addition task's tokenizer;
- torch_engine: the torch rollout engine's generated tokens/s (bfloat16 on CUDA);
- trainer: one optimiser step's seconds (Policy.optimise: DeepSpeed, AdamW) and its tokens/s;
- sglang_engine: the SGLang engine's tokens/s where ``import sglang`` works (else skipped);
- weight_broadcast: the `distributed` weight transport's seconds per round, over NCCL between
  two GPUs (skipped with one: NCCL cannot put two ranks on one GPU), gloo on the CPU;
- demo: ``verst demo`` on a short GRPO job of the addition task, engine and trainer on the device.

    python bench/gpu_check.py                       # on the GPU machine (bench/gpu_check.sh)
    python bench/gpu_check.py --smoke --threads 1   # the same steps, tiny, on the CPU: seconds
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULT_FILE = "gpu_check.json"
STEP_LIMITS_S = {
    "environment": 60,
    "model": 60,
    "torch_engine": 90,
    "trainer": 120,
    "sglang_engine": 150,
    "weight_broadcast": 60,
    "demo": 240,
}
"""Each step's time limit on the GPU machine (the total --budget-s cuts the last ones short), in
the order the steps run (bench/gpu_steps.py's STEPS)."""
NEEDS_MODEL = ("torch_engine", "trainer", "sglang_engine", "demo")
FIGURES = {
    "engine_tokens_per_s": ("torch_engine", "tokens_per_s"),
    "trainer_step_s": ("trainer", "step_s"),
    "trainer_tokens_per_s": ("trainer", "tokens_per_s"),
    "sglang_tokens_per_s": ("sglang_engine", "tokens_per_s"),
    "weight_sync_s": ("weight_broadcast", "best_s"),
    "demo_seconds_per_step": ("demo", "seconds_per_step"),
}
"""The headline figures: name -> (step, field of its figures)."""


def run_step_here(args: argparse.Namespace) -> int:
    """Child mode (--step): run one step, write its outcome to --result."""
    import torch

    from bench.gpu_steps import STEPS, Context, Skipped

    if set(STEPS) != set(STEP_LIMITS_S):
        raise SystemExit(f"gpu_check: STEP_LIMITS_S names {sorted(STEP_LIMITS_S)}, gpu_steps {sorted(STEPS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    ctx = Context(torch.device(args.device), args.smoke, Path(args.work), args.budget_s, args.demo_model)
    try:
        outcome: dict[str, Any] = {"status": "ok", "figures": STEPS[args.step](ctx)}
    except Skipped as why:
        outcome = {"status": "skipped", "reason": str(why)}
    except Exception as err:
        tail = traceback.format_exc().splitlines()[-12:]
        outcome = {"status": "failed", "error": f"{type(err).__name__}: {err}", "traceback": tail}
    Path(args.result).write_text(json.dumps(outcome, default=str))
    return 0


def run_child(command: list[str], env: dict[str, str], limit_s: float, log: Path) -> str | None:
    """Run one step's child within ``limit_s``; its process group is killed past it. Returns why it
    did not finish (None when it did)."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(limit_s)
            return None if proc.returncode == 0 else f"exited {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            return f"timed out after {limit_s:.0f}s"


def run_step(name: str, args: argparse.Namespace, report: dict[str, Any], deadline: float) -> dict[str, Any]:
    """One step in a child process, timed, its outcome (ok, failed or skipped, and why)."""
    if name in NEEDS_MODEL and report["steps"].get("model", {}).get("status") != "ok":
        return {"status": "skipped", "reason": "the model step did not succeed"}
    left = deadline - time.monotonic()
    limit = left if args.smoke else min(STEP_LIMITS_S[name], left)  # smoke: all steps share the budget
    if limit < 10:
        return {"status": "skipped", "reason": f"no time left in --budget-s ({left:.0f}s)"}
    out = Path(args.out)
    result, log = out / f"{name}.result.json", out / f"{name}.log"
    result.unlink(missing_ok=True)
    command = [
        sys.executable,
        __file__,
        "--step",
        name,
        "--device",
        args.device,
        "--work",
        str(out / "work"),
        "--result",
        str(result),
        "--budget-s",
        str(limit),
        "--threads",
        str(args.threads),
        "--demo-model",
        args.demo_model,
        *(["--smoke"] if args.smoke else []),
    ]
    started = time.monotonic()
    trouble = run_child(command, dict(os.environ), limit, log)
    seconds = round(time.monotonic() - started, 2)
    if result.exists():
        outcome = json.loads(result.read_text())
    else:
        tail = log.read_text(errors="replace").splitlines()[-12:] if log.exists() else []
        outcome = {"status": "failed", "error": trouble or "wrote no result", "log_tail": tail}
    return outcome | {"seconds": seconds, "log": str(log)}


def summarise(report: dict[str, Any]) -> None:
    """The headline figures and the lists of steps that ran, failed and were skipped (and why)."""
    steps = report["steps"]
    broadcast = steps.get("weight_broadcast", {}).get("figures", {})
    if broadcast.get("seconds"):
        broadcast["best_s"] = min(broadcast["seconds"])
    report["figures"] = {
        name: steps.get(step, {}).get("figures", {}).get(field) for name, (step, field) in FIGURES.items()
    }
    report["ran"] = [name for name, s in steps.items() if s["status"] == "ok"]
    report["failed"] = {name: s.get("error", "") for name, s in steps.items() if s["status"] == "failed"}
    report["skipped"] = {name: s.get("reason", "") for name, s in steps.items() if s["status"] == "skipped"}


def write_report(report: dict[str, Any], path: Path) -> None:
    """Atomically: a reader (or a cut-short run) sees the last whole report."""
    summarise(report)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=2, default=str))
    partial.replace(path)


def default_device() -> str:
    """cuda when torch sees a GPU; cpu otherwise, also when torch does not import (then every
    step fails saying so, and the report still gets written)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or "runs/gpu_check",
        help="where the JSON report and the logs go ($OUT, else %(default)s)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: seconds")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), help="default: cuda when available (cpu: --smoke)"
    )
    parser.add_argument("--budget-s", type=float, default=540.0, help="all steps together (%(default)s)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per step; 0: torch's default")
    parser.add_argument(
        "--demo-model",
        default="builtin:addition",
        help="the demo job's model: builtin:addition or `random` (--smoke: random)",
    )
    parser.add_argument("--only", default="", help="comma-separated steps to run (default: all)")
    parser.add_argument("--install-report", help="JSON of gpu_check.sh's install, kept as step `install`")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # child mode: the step to run
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error("--budget-s must be above 0")
    if args.smoke and args.demo_model == "builtin:addition":
        args.demo_model = "random"  # building the demo's model takes minutes on a CPU
    args.device = args.device or ("cpu" if args.smoke else default_device())
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.step:
        return run_step_here(args)
    chosen = [name for name in STEP_LIMITS_S if not args.only or name in args.only.split(",")]
    out = Path(args.out)
    (out / "work").mkdir(parents=True, exist_ok=True)
    path = out / RESULT_FILE
    deadline = time.monotonic() + args.budget_s
    report: dict[str, Any] = {
        "device": args.device,
        "smoke": args.smoke,
        "budget_s": args.budget_s,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "steps": {},
    }
    if args.install_report and Path(args.install_report).exists():
        report["steps"]["install"] = json.loads(Path(args.install_report).read_text())
    for name in chosen:
        print(f"gpu_check: {name} ...", flush=True)
        report["steps"][name] = step = run_step(name, args, report, deadline)
        print(
            f"gpu_check: {name} {step['status']} {step.get('seconds', 0)}s "
            f"{step.get('figures') or step.get('reason') or step.get('error', '')}",
            flush=True,
        )
        write_report(report, path)
    report["total_s"] = round(args.budget_s - (deadline - time.monotonic()), 1)
    write_report(report, path)
    print(
        f"gpu_check: device={args.device} ran={len(report['ran'])} failed={len(report['failed'])} "
        f"skipped={len(report['skipped'])} out={path}"
    )
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
