"""`verst tensorboard`: where a job's TensorBoard event files are, and the command that shows them."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from services.cli.options import Subcommands, emit, new_command
from services.client import get_job
from services.common.config import JobSpec
from services.common.tracking_config import DEFAULT_TRACKING_DIR, TENSORBOARD_DIR, tracking_root


def cmd_tensorboard(args: argparse.Namespace) -> int:
    """The event files' directory as the controller chose it (tracking_config.tracking_root),
    seen from here: the job's checkpoint directory when it is a directory here, else the
    tracking directory."""
    spec = JobSpec.model_validate(get_job(args.api, args.job)["spec"])
    kinds = [tracker.type for tracker in spec.tracking.trackers]
    if "tensorboard" not in kinds:
        chosen = ", ".join(kinds) or "none"
        print(
            f"verst tensorboard: job {args.job} has no TensorBoard tracker (chosen: {chosen})",
            file=sys.stderr,
        )
        return 1
    checkpoint_dir = args.checkpoint_dir or spec.trainer.checkpoint_dir
    logdir = tracking_root(checkpoint_dir, args.job, args.tracking_dir) / TENSORBOARD_DIR
    found = logdir.is_dir()
    command = f"tensorboard --logdir {shlex.quote(str(logdir))}"
    data = {"job_id": args.job, "logdir": str(logdir), "exists": found, "command": command}
    note = "" if found else "  (not here yet: no metrics written, or on the controller's host)"
    emit(args, data, [f"event files  {logdir}{note}", f"open with    {command}"])
    return 0


def add_tensorboard(commands: Subcommands) -> None:
    command = new_command(
        commands,
        "tensorboard",
        "print where a job's TensorBoard event files are and the `tensorboard --logdir` command",
        cmd_tensorboard,
        more="The controller writes them in the job's checkpoint directory's tensorboard/ when it sees"
        " that directory, else in {VERST_CONTROLLER_TRACKING_DIR}/{job}/tensorboard/.",
    )
    command.add_argument("job", help="job id")
    command.add_argument(
        "--checkpoint-dir", default=None, help="the job's trainer.checkpoint_dir (default: ask the api)"
    )
    command.add_argument(
        "--tracking-dir",
        default=os.environ.get("VERST_CONTROLLER_TRACKING_DIR", DEFAULT_TRACKING_DIR),
        help="the controller's tracking directory (env VERST_CONTROLLER_TRACKING_DIR)",
    )
