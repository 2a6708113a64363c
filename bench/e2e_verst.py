"""The verst side of bench/e2e.py: the real services (``services.stack.Stack``), one job submitted
over REST, its checkpoints caught as the trainer writes them.

Start-up is excluded: the clock of a run starts at checkpoint v1's ``created_at``, the end of the
job's first step, and version k's time is its own ``created_at``. Before v1 come the job's
one-off costs: the trainer loading the model and publishing v0 (the job turns RUNNING on it), the
engines loading v0, the first rollouts' and step's warm-up (``Run.first_step_s`` keeps it). The TRL
side's clock starts at the end of its step 1 too.
The job's own evaluation is off (``data.eval: null``); the race evaluates the caught checkpoints
afterwards with the evaluator the TRL side's go through.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from bench.e2e_runs import Hyper, Point, Run
from bench.e2e_tasks import BenchTask
from bench.report import CpuSample
from services.trainer.checkpoints import WEIGHTS_DIR, WEIGHTS_HANDLE_FILE

WEIGHTS_NAME = re.compile(r"^v(\d{6,})-e(\d+)$")
"""A published version's weights directory: ``v{version:06d}-e{epoch}`` (services/trainer/checkpoints.py)."""
POLL_S = 0.05
"""How often the weights directory is listed (the trainer keeps the newest few versions)."""
JOB_POLL_S = 1.0
"""How often the job's record is read over REST."""
STEP_TIMEOUT_S = 300.0
"""A run fails when no new version appears for this long once v1 is out (a SmolLM2 step takes
10-20 s on two quiet cores, several times that on busy ones)."""
START_TIMEOUT_S = 900.0
"""A run fails when v1 is not out this long after the job's submission: the trainer loading the
model and publishing v0, the engines loading it, and the first step's warm-up."""


def job_spec(hp: Hyper, task: BenchTask, checkpoint_dir: Path, *, max_staleness: int) -> dict[str, Any]:
    """The JobSpec of one run, training with ``hp`` as TRL does (bench/e2e_trl.py's config)."""
    return {
        "name": f"e2e-{task.name}",
        "seed": hp.seed,
        "model": {"path": hp.model_dir, "dtype": "float32"},
        "data": task.data_section(),
        "algorithm": {
            "advantage": "grpo",
            "policy_loss": "ppo_clip",
            "group_size": hp.group_size,
            "clip_low": hp.clip_low,
            "clip_high": hp.clip_high,
            "loss_aggregation": "token_mean",
            "kl_coef": 0.0,
            "entropy_coef": 0.0,
            "max_staleness": max_staleness,
        },
        "rollout": {
            "prompts_per_step": hp.prompts_per_step,
            "max_new_tokens": hp.max_new_tokens,
            "temperature": hp.temperature,
            "top_p": 1.0,
            "top_k": 0,
        },
        "reward": {"verifier": task.verifier},
        "trainer": {
            "steps": hp.max_steps,
            "learning_rate": hp.learning_rate,
            "scheduler": "constant",
            "warmup_steps": 0,
            "weight_decay": 0.0,
            "max_grad_norm": hp.max_grad_norm,
            "ppo_epochs": 1,
            "mini_batches": 1,
            "autocast": "bfloat16" if hp.dtype == "bfloat16" else "off",
            "checkpoint_dir": str(checkpoint_dir),
        },
        "eval": {"at_start": False, "every_steps": 0},
    }


def created_at(directory: Path) -> float:
    """Unix seconds of a published version's CheckpointHandle.created_at."""
    handle = json.loads((directory / WEIGHTS_HANDLE_FILE).read_text())
    stamp = Timestamp()
    stamp.FromJsonString(handle["createdAt"])
    return stamp.ToNanoseconds() / 1e9


def keep_copy(source: Path, target: Path) -> None:
    """Hard links of a published version's files: they outlive verst's pruning."""
    target.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.is_file():
            os.link(entry, target / entry.name)


class CheckpointCatcher:
    """Follows a job's published weights: every version's time, and a copy at the eval steps."""

    def __init__(self, job_dir: Path, out_dir: Path, eval_steps: list[int]) -> None:
        self.job_dir = job_dir
        self.out_dir = out_dir
        self.eval_steps = set(eval_steps)
        self.times: dict[int, float] = {}
        self.copies: dict[int, Path] = {}
        self.last_new = time.monotonic()

    def poll(self) -> None:
        """Record the versions that appeared since the last poll; a version at an eval step that is
        already pruned (missed) raises."""
        weights = self.job_dir / WEIGHTS_DIR
        if not weights.is_dir():
            return
        for entry in sorted(weights.iterdir()):
            match = WEIGHTS_NAME.match(entry.name)
            if match is None:
                continue  # a staging directory
            version = int(match.group(1))
            if version in self.times:
                continue
            self.times[version] = created_at(entry)
            self.last_new = time.monotonic()
            if version in self.eval_steps and version > 0:
                self.copies[version] = self.out_dir / f"v{version:06d}"
                keep_copy(entry, self.copies[version])
        missed = [v for v in self.eval_steps if 0 < v < max(self.times, default=0) and v not in self.times]
        if missed:
            raise RuntimeError(f"checkpoints {missed} were pruned before they could be kept")

    def run_of(self, pair: int) -> Run:
        if 0 not in self.times or 1 not in self.times:
            raise RuntimeError(
                f"the job published no checkpoint v0 or v1 (versions seen: {sorted(self.times)})"
            )
        start = self.times[1]
        versions = [v for v in sorted(self.times) if v >= 1]
        run = Run(side="verst", pair=pair, first_step_s=start - self.times[0])
        run.points.append(Point(step=0, seconds=0.0))
        run.points += [
            Point(v, self.times[v] - start, checkpoint=str(self.copies[v])) for v in sorted(self.copies)
        ]
        run.step_seconds = [self.times[b] - self.times[a] for a, b in itertools.pairwise(versions)]
        return run


def run_verst(
    hp: Hyper, task: BenchTask, run_dir: Path, pair: int, *, max_staleness: int, env: Mapping[str, str]
) -> Run:
    """One job on a fresh stack; returns its run with the kept checkpoints (not yet evaluated)."""
    import yaml

    from services.client import TERMINAL_STATES, get_job, submit
    from services.stack import Stack, StackConfig

    checkpoints = run_dir / "checkpoints"
    spec_path = run_dir / "job.yaml"
    spec_path.write_text(yaml.safe_dump(job_spec(hp, task, checkpoints, max_staleness=max_staleness)))
    ports = ("api", "router", "engine", "reward", "trainer", "runner", "engine_metrics")
    config = StackConfig(
        log_dir=run_dir / "logs",
        extra_env=dict(env),
        ready_timeout_s=START_TIMEOUT_S,  # a trainer may first build DeepSpeed's CPU op, slow on busy cores
        **{f"{p}_port": 0 for p in ports},
    )
    started = time.monotonic()
    with Stack(config) as stack:
        job_id = submit(stack.api_url, spec_path)["job_id"]
        catcher = CheckpointCatcher(checkpoints / job_id, run_dir, hp.eval_steps())
        job, load_from, checked = {"state": ""}, None, 0.0
        while job["state"] not in TERMINAL_STATES:
            catcher.poll()
            if load_from is None and 0 in catcher.times:
                load_from = CpuSample.now("")
            if time.monotonic() - checked > JOB_POLL_S:
                stack.check_alive()
                job, checked = get_job(stack.api_url, job_id), time.monotonic()
            timeout = STEP_TIMEOUT_S if 1 in catcher.times else START_TIMEOUT_S
            if time.monotonic() - catcher.last_new > timeout:
                raise RuntimeError(f"job {job_id}: no new checkpoint in {timeout:.0f} s")
            time.sleep(POLL_S)
        catcher.poll()
        load = CpuSample.now("").other_cores_since(load_from) if load_from is not None else float("nan")
    ended = f"job {job_id} ended {job['state']}: {job.get('reason', '')} (logs in {config.log_dir})"
    if 1 not in catcher.times:
        raise RuntimeError(ended)
    run = catcher.run_of(pair)
    run.other_load, run.wall_s = load, time.monotonic() - started
    if job["state"] != "JOB_STATE_SUCCEEDED":
        run.note = ended
    shutil.rmtree(checkpoints, ignore_errors=True)
    return run
