"""`verst logs <job>` and `verst logs --service NAME`: the end of a job's or a service's log.

A job's log is its events, one line each (services/api/logs.py says why); a service's log is the
file `verst up` writes for it. ``--follow`` asks the api for what came since (``-n`` lines at a
time), every POLL_S, until the job ends (a job's), ``--for-s`` seconds pass, or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from services.cli.options import Subcommands, new_command
from services.client import job_logs, service_logs

POLL_S = 1.0
"""How often `--follow` asks for new lines."""
MAX_LINES = 10_000
"""Most lines `-n` takes (the api's default VERST_API_LOG_LINES_LIMIT); `--follow` asks for `-n` at
a time."""


def line_count(text: str) -> int:
    """An argparse type: a whole number of lines from 1 to MAX_LINES."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of lines: {text!r}") from None
    if not 1 <= count <= MAX_LINES:
        raise argparse.ArgumentTypeError(f"lines must be from 1 to {MAX_LINES}, not {count}")
    return count


def _print(args: argparse.Namespace, line: str, key: str, name: str) -> None:
    print(json.dumps({key: name, "line": line}) if args.json else line, flush=True)


def _pause(deadline: float, full: bool) -> bool:
    """Wait for the next poll (none after a full page: more is waiting); False once ``deadline``
    (monotonic) has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    if not full:
        time.sleep(min(POLL_S, left))
    return True


def job_log(args: argparse.Namespace, deadline: float) -> int:
    shown = job_logs(args.api, args.job, args.lines)
    while True:
        for line in shown["lines"]:
            _print(args, line, "job_id", args.job)
        full = len(shown["lines"]) >= args.lines
        if not args.follow or (shown["finished"] and not full) or not _pause(deadline, full):
            return 0
        shown = job_logs(args.api, args.job, args.lines, after=shown["last_event_id"])


def service_log(args: argparse.Namespace, deadline: float) -> int:
    shown = service_logs(args.api, args.service, args.lines)
    while True:
        for line in shown["lines"]:
            _print(args, line, "service", args.service)
        full = len(shown["lines"]) >= args.lines
        if not args.follow or not _pause(deadline, full):
            return 0
        shown = service_logs(args.api, args.service, args.lines, after=shown["end"])


def cmd_logs(args: argparse.Namespace) -> int:
    if (args.job is None) == (args.service is None):
        print("verst logs: name a job or --service NAME (one of them)", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.for_s if args.for_s is not None else float("inf")
    return job_log(args, deadline) if args.job is not None else service_log(args, deadline)


def add_logs(commands: Subcommands) -> None:
    command = new_command(
        commands,
        "logs",
        "print the end of a job's log (its events) or of a service's log (--service)",
        cmd_logs,
        more="A job's log is its events, one line each: state changes, metrics, evaluations, warnings"
        " and dead letters. A service's log is the file `verst up` writes for it (api, trainer, engine-0,"
        " router, runner, reward). With --json, one JSON object per line.",
    )
    command.add_argument("job", nargs="?", default=None, help="job id")
    command.add_argument("--service", metavar="NAME", default=None, help="a service's log instead")
    command.add_argument(
        "-n", "--lines", type=line_count, default=50, help=f"how many lines from the end (1 to {MAX_LINES})"
    )
    command.add_argument(
        "-f", "--follow", action="store_true", help=f"print new lines as they come (polls every {POLL_S:g}s)"
    )
    command.add_argument(
        "--for-s",
        type=float,
        default=None,
        help="stop following after this many seconds (default: a"
        " job's until it ends, a service's until Ctrl-C)",
    )
