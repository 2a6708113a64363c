"""`verst demo`: the whole stack, the default job, a live progress bar, a plot and a summary."""

from __future__ import annotations

import itertools
import math
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from services.client import TERMINAL_STATES, get_job, job_history, submit
from services.common.config import load_job_spec
from services.stack import Stack, StackConfig

POLL_S = 0.5
DEMO_TIMEOUT_S = 3600.0


def series(history: list[dict[str, Any]], source: str, name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, last value per step."""
    by_step: dict[int, float] = {}
    for row in history:
        if row["source"] == source and name in row["values"]:
            by_step[int(row["step"])] = float(row["values"][name])
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot(history: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Reward per training step and held-out accuracy per evaluated version, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    steps, reward = series(history, "trainer", "reward_mean")
    ax.plot(steps, reward, marker=".", label="training reward (mean per step)")
    eval_steps, accuracy = series(history, "eval", "accuracy")
    ax.plot(eval_steps, accuracy, marker="o", linewidth=2, label="held-out accuracy (greedy)")
    ax.set_xlabel("policy version (trainer step)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def follow(stack: Stack, job_id: str, steps: int) -> dict[str, Any]:
    """Show a progress bar until the job ends; returns its final record."""
    deadline = time.monotonic() + DEMO_TIMEOUT_S
    with tqdm(total=steps, desc="training", unit="step", dynamic_ncols=True) as bar:
        while True:
            stack.check_alive()
            job = get_job(stack.api_url, job_id)
            bar.update(max(0, min(steps, int(job.get("step", 0))) - bar.n))
            metrics = job.get("metrics", {})
            postfix = {"state": job["state"].removeprefix("JOB_STATE_").lower()}
            if "trainer/reward_mean" in metrics:
                postfix["reward"] = f"{metrics['trainer/reward_mean']:.2f}"
            if "eval/accuracy" in metrics:
                postfix["accuracy"] = f"{metrics['eval/accuracy']:.2f}"
            bar.set_postfix(postfix)
            if job["state"] in TERMINAL_STATES:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} did not finish within {DEMO_TIMEOUT_S:.0f}s")
            time.sleep(POLL_S)


def seconds_per_step(history: list[dict[str, Any]]) -> float:
    """The median wall time between consecutive trainer steps' metrics (nan with fewer than two)."""
    times = sorted(
        datetime.fromisoformat(row["time"]).timestamp() for row in history if row["source"] == "trainer"
    )
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else float("nan")


def prepare_model(model_path: str) -> None:
    """Build a builtin model, or convert a GGUF file, once (or find it cached) before the services
    need it; a hub id is found in the local cache."""
    from services.models import resolve_model_path

    print(f"base model {model_path}: {resolve_model_path(model_path)}", flush=True)


def run_demo(spec_path: Path, out_dir: Path, *, engines: int = 1) -> dict[str, Any]:
    """Run the job of ``spec_path`` on a local stack, printing progress and a summary; returns the
    summary (``ok``: the job succeeded and was evaluated)."""
    started = time.monotonic()
    spec = load_job_spec(spec_path)
    prepare_model(spec.model.path)
    config = StackConfig(log_dir=out_dir / "logs", engines=engines, api_port=0, router_port=0, engine_port=0,
                         reward_port=0, trainer_port=0, runner_port=0, engine_metrics_port=0)  # fmt: skip
    print(f"starting services (logs in {config.log_dir}/) ...", flush=True)
    with Stack(config) as stack:
        job_id = submit(stack.api_url, spec_path)["job_id"]
        print(f"job {job_id}: {spec.trainer.steps} steps of {spec.algorithm.advantage}", flush=True)
        job = follow(stack, job_id, spec.trainer.steps)
        history = job_history(stack.api_url, job_id)
        peaks = stack.peak_memory()
    seconds = time.monotonic() - started
    png = plot(history, out_dir / f"{job_id}.png", f"verst demo: {job_id}")
    versions, accuracy = series(history, "eval", "accuracy")
    for version, value in zip(versions, accuracy, strict=True):
        print(f"  held-out accuracy at version {version:>3}: {value:.3f}")
    print("  peak memory: " + ", ".join(f"{name} {size / 2**20:.0f} MiB" for name, size in peaks.items()))
    print(f"  seconds per step: {seconds_per_step(history):.2f} (median, trainer's metric times)")
    summary = {
        "ok": job["state"] == "JOB_STATE_SUCCEEDED" and bool(accuracy),
        "job_id": job_id, "state": job["state"], "reason": job.get("reason", ""),
        "steps": job.get("step", 0), "seconds": round(seconds, 1), "plot": str(png),
        "accuracy": dict(zip(versions, accuracy, strict=True)),
        "seconds_per_step": pace if math.isfinite(pace := seconds_per_step(history)) else None,
        "peak_memory_mib": {name: round(size / 2**20) for name, size in peaks.items()},
    }  # fmt: skip
    if not summary["ok"]:
        print(f"demo: job {job_id} ended {job['state']}: {job.get('reason', '')}")
        return summary
    print(
        f"demo: accuracy before={accuracy[0]:.3f} after={accuracy[-1]:.3f} "
        f"steps={job.get('step', 0)} seconds={seconds:.0f} plot={png}"
    )
    return summary
