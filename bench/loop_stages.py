"""Where one step of the loop goes: the per-stage times a real job reports as its metrics.

One job on a fresh local stack (the real services, submitted over REST) on a race task
(bench/e2e_tasks.py, the demo's addition task by default); afterwards its metrics stream is read
and the median over its steps (the first ``--skip`` left out: warm-up) of every stage is printed:

- controller ``issue_lag_s``: a new version's handle published -> the batch it lets out issued;
- ``stage_queue_s``: the prompt on its stream until a runner reads it;
- ``stage_generate_s``: the router and engine (version wait, resumes included);
- ``stage_score_s``: the reward service; ``stage_publish_s``: building and publishing trajectories;
- ``stage_deliver_s``: published -> the trainer starts the step (waiting for the step's other groups);
- trainer ``wait_seconds`` (collecting the step's groups), ``optimise_seconds``,
  ``publish_seconds`` (the step's wait for the weights-only handle), ``publish_write_seconds``
  (writing it, beside the next step), ``checkpoint_seconds`` (durable saves);
- rollout ``weight_sync_latency_s``: a handle published -> an engine serves it;
- the wall seconds between consecutive versions;
- CPU seconds per step of each service process (psutil, sampled as the job's step advances):
  on a machine whose cores the services share, the step cannot be shorter than their sum over
  the cores.

    .venv/bin/python bench/loop_stages.py                 # also rewrites its section of bench/RESULTS.md
    .venv/bin/python bench/loop_stages.py --steps 30 --no-results
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import CpuSample, update_results

REPO = Path(__file__).resolve().parent.parent
SECTION_TITLE = "## loop stages (bench/loop_stages.py)"
NOTES_MARKER = (
    "<!-- notes: written by hand; bench/loop_stages.py keeps everything from here to the next section -->"
)
ROWS = (
    ("controller", "issue_lag_s", "controller: new version -> next batch issued"),
    ("trainer", "stage_queue_s", "prompt waits on its stream for a runner"),
    ("trainer", "stage_generate_s", "router + engine: the group's samples"),
    ("trainer", "stage_score_s", "reward service: the group scored"),
    ("trainer", "stage_publish_s", "runner builds and publishes the trajectories"),
    ("trainer", "stage_deliver_s", "published -> trainer starts the step"),
    ("trainer", "wait_seconds", "trainer waits for the step's groups"),
    ("trainer", "optimise_seconds", "trainer optimises (prepare, forward, backward, step)"),
    ("trainer", "publish_seconds", "trainer publishes the weights-only handle (the step's wait)"),
    ("trainer", "publish_write_seconds", "its file and handle, written beside the next step"),
    ("trainer", "checkpoint_seconds", "trainer's durable checkpoints"),
    ("rollout", "weight_sync_latency_s", "handle published -> engine serves it"),
)
"""(metric source, name, what it times), in the order of the loop."""
JOB_POLL_S = 0.5


@dataclass(frozen=True)
class ServiceCpu:
    """CPU seconds of each service process when the job had reached ``step``."""

    step: int
    seconds: dict[str, float]


def service_cpu(stack: Any, step: int) -> ServiceCpu:
    """``ServiceCpu`` of a running ``services.stack.Stack``."""
    import psutil

    seconds = {}
    for child in stack.children:
        if child.process is None:
            continue
        try:
            times = psutil.Process(child.process.pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        seconds[child.name] = times.user + times.system
    return ServiceCpu(step, seconds)


def cpu_per_step(samples: Sequence[ServiceCpu], skip: int, steps: int) -> tuple[dict[str, float], int]:
    """CPU seconds per step of each service between the first sample past step ``skip`` and the
    last before the final step (whose evaluation and checkpoint are no step's); how many steps."""
    counted = [sample for sample in samples if skip < sample.step < steps]
    if len(counted) < 2 or counted[-1].step == counted[0].step:
        return {}, 0
    first, last = counted[0], counted[-1]
    span = last.step - first.step
    per_step = {name: (value - first.seconds.get(name, 0.0)) / span for name, value in last.seconds.items()}
    return dict(sorted(per_step.items(), key=lambda item: -item[1])), span


def run_job(
    task_name: str, steps: int, env: dict[str, str], work: Path, dtype: str = "float32", staleness: int = 1
) -> tuple[list[bytes], str, list[ServiceCpu]]:
    """One job on a fresh stack; its metrics stream entries, final state and the services' CPU
    seconds at each poll."""
    import redis
    import yaml

    from bench.e2e_runs import Hyper
    from bench.e2e_tasks import get_bench_task
    from bench.e2e_verst import job_spec
    from services.client import TERMINAL_STATES, get_job, submit
    from services.common.streams import JobStreams
    from services.stack import Stack, StackConfig

    task = get_bench_task(task_name)
    hp = Hyper(task=task.name, model_dir=str(task.model_dir()), seed=0, dtype=dtype,  # type: ignore[arg-type]
               **{**task.hyper, "max_steps": steps, "eval_every": steps})  # fmt: skip
    spec_path = work / "job.yaml"
    spec_path.write_text(yaml.safe_dump(job_spec(hp, task, work / "checkpoints", max_staleness=staleness)))
    ports = ("api", "router", "engine", "reward", "trainer", "runner", "engine_metrics")
    keep = {"VERST_CONTROLLER_HOUSEKEEPING_S": "0"}  # the metrics stream is read whole after the job
    config = StackConfig(log_dir=work / "logs", extra_env=env | keep, **{f"{p}_port": 0 for p in ports})
    with Stack(config) as stack:
        job_id = submit(stack.api_url, spec_path)["job_id"]
        job: dict[str, Any] = {"state": ""}
        cpu: list[ServiceCpu] = []
        while job["state"] not in TERMINAL_STATES:
            time.sleep(JOB_POLL_S)
            stack.check_alive()
            job = get_job(stack.api_url, job_id)
            cpu.append(service_cpu(stack, int(job.get("step") or 0)))
        client = redis.Redis.from_url(stack.redis_url)
        try:
            entries = [fields[b"d"] for _, fields in client.xrange(JobStreams(job_id).metrics)]
        finally:
            client.close()
    return entries, job["state"], cpu


def stage_medians(entries: list[bytes], skip: int) -> tuple[dict[tuple[str, str], float], float, int]:
    """Median of each (source, metric) over the steps after ``skip``; the median wall seconds
    between consecutive trainer steps; how many steps counted."""
    from services.common.pb import common_pb2

    values: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    step_times: dict[int, float] = {}
    for data in entries:
        metric = common_pb2.Metric.FromString(data)
        if metric.step <= skip:
            continue
        if metric.source == "trainer":
            step_times[metric.step] = metric.time.ToNanoseconds() / 1e9
        for name, value in metric.values.items():
            values[metric.source, name].append(value)
    ordered = sorted(step_times)
    walls = [step_times[b] - step_times[a] for a, b in itertools.pairwise(ordered) if b == a + 1]
    medians = {key: statistics.median(found) for key, found in values.items()}
    return medians, statistics.median(walls) if walls else float("nan"), len(ordered)


def table(medians: dict[tuple[str, str], float], wall: float) -> list[str]:
    lines = ["| stage | metric | median s |", "|---|---|---:|"]
    for source, name, what in ROWS:
        value = medians.get((source, name))
        lines.append(f"| {what} | `{source}.{name}` | {'n/a' if value is None else f'{value:.4f}'} |")
    lines.append(f"| **wall seconds per step** | versions' metric times | **{wall:.4f}** |")
    skipped = medians.get(("trainer", "zero_advantage_skipped"))
    if skipped is not None:  # a share, not seconds: below the table
        lines += ["", f"Samples left out of forward and backward (no nonzero advantage), median share "
                  f"per step: {skipped:.3f} (`trainer.zero_advantage_skipped`)."]  # fmt: skip
    return lines


def cpu_lines(per_step: dict[str, float], span: int) -> list[str]:
    """The services' CPU seconds per step, and their sum over this machine's cores."""
    if not per_step:
        return []
    cores = os.cpu_count() or 1
    total = sum(per_step.values())
    shares = ", ".join(f"{name} {seconds:.3f}" for name, seconds in per_step.items())
    return ["", f"CPU seconds per step by service ({span} steps): {shares}; in all {total:.3f}, "
            f"so on {cores} cores at least {total / cores:.3f} s per step."]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--task", default="addition", help="a bench/e2e_tasks.py task (%(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="steps of the job (%(default)s)")
    parser.add_argument("--skip", type=int, default=3, help="first steps left out (%(default)s)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment of the services (repeatable)")  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="the job's compute precision (bench/e2e.py's --dtype; the task's)")  # fmt: skip
    parser.add_argument("--max-staleness", type=int, default=1, help="the job's algorithm.max_staleness (1)")
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "RESULTS.md")
    parser.add_argument("--no-results", action="store_true", help="leave the results file alone")
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    before = CpuSample.now("")
    from bench.e2e_tasks import get_bench_task

    dtype = args.dtype or get_bench_task(args.task).dtype
    with tempfile.TemporaryDirectory(prefix="verst-stages-") as scratch:
        job = run_job(args.task, args.steps, env, Path(scratch), dtype, args.max_staleness)
    entries, state, cpu = job
    load = CpuSample.now("").other_cores_since(before)
    medians, wall, counted = stage_medians(entries, args.skip)
    lines = table(medians, wall) + cpu_lines(*cpu_per_step(cpu, args.skip, args.steps))
    print("\n".join(lines))
    print(f"job {state}; {counted} steps counted; other processes kept {load:.2f} cores busy")
    if not args.no_results:
        command = shlex.join(
            [".venv/bin/python", "bench/loop_stages.py", *(sys.argv[1:] if argv is None else argv)]
        )
        where = f"task {args.task}, {args.steps} steps, medians after step {args.skip}; other load {load:.2f}"
        text = "\n".join([SECTION_TITLE, "", f"`{command}` ({where} cores)", "", *lines])
        update_results(args.results, SECTION_TITLE, text, NOTES_MARKER)
        print(f"updated {args.results}")


if __name__ == "__main__":
    main()
