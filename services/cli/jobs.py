"""`verst submit`, `verst status` and `verst cancel`: jobs through the api."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from services.cli.options import Subcommands, emit, new_command
from services.client import cancel_job, cluster, get_job, list_jobs, submit

REWARD = "trainer/reward_mean"
"""The metric `status` shows as the reward: the mean reward of the newest training step."""
ACCURACY = "eval/accuracy"
"""The metric `status` shows as the accuracy: the newest evaluation's, on the held-out set."""
COLUMNS = f"{'job':32} {'state':10} {'version':>7} {'step':>5} {'reward':>7} {'accuracy':>8}"
SERVICE_COLUMNS = f"{'service':16} {'restarts':>8}  {'last exit':20} state"


def state_word(job: dict[str, Any]) -> str:
    """``JOB_STATE_RUNNING`` as ``running``."""
    return str(job["state"]).removeprefix("JOB_STATE_").lower()


def metric(job: dict[str, Any], name: str) -> str:
    """A latest metric of the job to three decimals, ``-`` before it has one."""
    value = job.get("metrics", {}).get(name)
    return "-" if value is None else f"{value:.3f}"


def row(job: dict[str, Any]) -> str:
    return (
        f"{job['job_id']:32} {state_word(job):10} {job.get('policy_version', 0):>7} "
        f"{job.get('step', 0):>5} {metric(job, REWARD):>7} {metric(job, ACCURACY):>8}"
    )


def details(job: dict[str, Any]) -> list[str]:
    """One job for a person: what `status <job>` prints without --json."""
    lines = [
        f"job       {job['job_id']}",
        f"name      {job.get('name', '')}",
        f"state     {state_word(job)}",
        f"version   {job.get('policy_version', 0)} (step {job.get('step', 0)})",
        f"reward    {metric(job, REWARD)}",
        f"accuracy  {metric(job, ACCURACY)}",
        f"updated   {job.get('updated_at', '')}",
    ]
    return [*lines, f"reason    {job['reason']}"] if job.get("reason") else lines


def service_rows(services: list[dict[str, Any]]) -> list[str]:
    """The services `verst up` restarted (GET /v1/cluster's ``services``): nothing when none was."""
    if not services:
        return []
    rows = ["", SERVICE_COLUMNS]
    for row in services:
        state = "crash-loop" if row["crash_loop"] else row["state"]
        rows.append(f"{row['service']:16} {row['restarts']:>8}  {row['last_exit']:20} {state}")
    return rows


def cmd_submit(args: argparse.Namespace) -> int:
    job = submit(args.api, Path(args.spec))
    emit(args, job, [job["job_id"]])
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    if args.job:
        job = get_job(args.api, args.job)
        emit(args, job, details(job))
        return 0
    jobs = list_jobs(args.api)
    # --json stays the job list; the restarts are GET /v1/cluster's, asked only for a person
    restarted = [] if args.json else service_rows(cluster(args.api).get("services", []))
    emit(args, jobs, [COLUMNS, *(row(job) for job in jobs), *restarted])
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    job = cancel_job(args.api, args.job)
    emit(args, job, [f"{job['job_id']}: {state_word(job)}"])
    return 0


def add_submit(commands: Subcommands) -> None:
    command = new_command(
        commands,
        "submit",
        "submit a job spec (YAML) to the api; prints the job id",
        cmd_submit,
        more="Relative paths in the spec (model, tokenizer, data, trainer.checkpoint_dir) are made"
        " absolute against the current directory before it is sent: the api reads them on its host.",
    )
    command.add_argument("spec", help="path to a JobSpec YAML file")


def add_status(commands: Subcommands) -> None:
    command = new_command(
        commands,
        "status",
        "list jobs (state, version, latest reward and accuracy) and the services `verst up` restarted,"
        " or show one job",
        cmd_status,
    )
    command.add_argument("job", nargs="?", help="job id (--json: its whole record, spec included)")


def add_cancel(commands: Subcommands) -> None:
    command = new_command(commands, "cancel", "cancel a queued or running job", cmd_cancel)
    command.add_argument("job", help="job id")
