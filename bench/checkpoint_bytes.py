"""What publishing weights and checkpointing cost a job: share of the trainer's step time, bytes per step.

Runs one job (default examples/grpo.yaml) on a local stack, like `verst demo`, and sums the
trainer's per-step metrics: ``publish_seconds`` (what each step waits for its weights-only
version: the snapshot), ``publish_write_seconds`` (writing and announcing it, beside the next
step), ``checkpoint_seconds`` (durable checkpoints), ``step_seconds`` and ``bytes_written``; the
weights' size is the published handles' ``size_bytes`` (a LoRA job's: its adapter's, examples/lora.yaml).

    .venv/bin/python bench/checkpoint_bytes.py [spec.yaml]
    .venv/bin/python bench/checkpoint_bytes.py examples/lora.yaml --steps 10

The last line is ``bytes written per step: <n> (weights <size>: <ratio>x)``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml

from services.client import job_history, submit
from services.common.checkpoint_layout import SavedVersions
from services.common.config import JobSpec, load_job_spec
from services.demo import follow
from services.stack import Stack, StackConfig

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("spec", type=Path, nargs="?", default=ROOT / "examples" / "grpo.yaml",
                        help="the job (examples/grpo.yaml)")  # fmt: skip
    parser.add_argument("--steps", type=int, help="the job's trainer.steps (the spec's)")
    parser.add_argument("--log-dir", type=Path, default=Path("runs/checkpoint_bytes/logs"),
                        help="the services' logs (%(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="verst-checkpoint-bytes-") as scratch:
        spec_path = args.spec
        if args.steps is not None:  # submit a copy of the spec with its steps overridden
            data = yaml.safe_load(args.spec.read_text())
            data.setdefault("trainer", {})["steps"] = args.steps
            spec_path = Path(scratch) / args.spec.name
            spec_path.write_text(yaml.safe_dump(data))
        spec = load_job_spec(spec_path)
        config = StackConfig(log_dir=args.log_dir, engines=1, api_port=0, router_port=0, engine_port=0,
                             reward_port=0, trainer_port=0, runner_port=0, engine_metrics_port=0)  # fmt: skip
        with Stack(config) as stack:
            job_id = submit(stack.api_url, spec_path)["job_id"]
            job = follow(stack, job_id, spec.trainer.steps)
            history = job_history(stack.api_url, job_id)
    rows = [row for row in history if row["source"] == "trainer" and "step_seconds" in row["values"]]
    steps = [row["values"] for row in rows]
    if job["state"] != "JOB_STATE_SUCCEEDED" or not steps:
        print(f"checkpoint_bytes: job {job_id} ended {job['state']}: {job.get('reason', '')}")
        return 1
    total = {name: sum(step.get(name, 0.0) for step in steps) for name in steps[0]}
    saving = total["publish_seconds"] + total["checkpoint_seconds"]
    weights = weights_size(spec, job_id)
    print(f"steps {len(steps)}: step_seconds {total['step_seconds']:.3f}, "
          f"publish {total['publish_seconds']:.3f} (written beside the next step: "
          f"{total.get('publish_write_seconds', 0.0):.3f}), "
          f"durable {total['checkpoint_seconds']:.3f}")  # fmt: skip
    worst = max(range(len(steps)), key=lambda i: steps[i]["saving_share"])
    print(f"saving share of the trainer's step time: {saving / total['step_seconds']:.4f} over the job, "
          f"per-step mean {statistics.fmean(s['saving_share'] for s in steps):.4f}, "
          f"max {steps[worst]['saving_share']:.4f} (step {worst + 1}: publish"
          f" {steps[worst]['publish_seconds']:.4f} s, durable {steps[worst]['checkpoint_seconds']:.4f} s"
          f" of {steps[worst]['step_seconds']:.4f} s)")  # fmt: skip
    span = datetime.fromisoformat(rows[-1]["time"]) - datetime.fromisoformat(rows[0]["time"])
    wall = span.total_seconds() / max(len(rows) - 1, 1)
    # rows merged into the job record together share one time (a job of a few steps): no wall figure
    share = f"{saving / len(steps) / wall:.4f}" if wall > 0 else "n/a"
    print(f"wall seconds per step (step 1 to the last): {wall:.3f}; saving per step "
          f"{saving / len(steps):.4f} s = {share} of it")  # fmt: skip
    per_step = total["bytes_written"] / len(steps)
    print(f"bytes written per step: {per_step:,.0f} (weights {weights:,.0f}: {per_step / weights:.3f}x)")
    return 0


def weights_size(spec: JobSpec, job_id: str) -> float:
    """The size of the newest version the job published (its handle's ``size_bytes``): every
    version of the model, or of a LoRA job's adapter, has it."""
    return float(SavedVersions(Path(spec.trainer.checkpoint_dir), job_id).find().handle.size_bytes)


if __name__ == "__main__":
    sys.exit(main())
