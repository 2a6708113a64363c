"""The `verst` command: up, submit, status, export, demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import httpx

from services.client import export_job, get_job, list_jobs, submit
from services.common.config import JobSpec, JobSpecError

DEFAULT_API = os.environ.get("VERST_API_URL", "http://127.0.0.1:8000")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SPEC = REPO_ROOT / "examples" / "addition.yaml"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    from services.stack import Stack, StackConfig

    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the stack in order, like Ctrl-C

    config = StackConfig(
        log_dir=Path(args.log_dir),
        redis_dir=Path(args.redis_dir),
        engines=args.engines,
        separate_controller=args.separate_controller,
    )
    stack = Stack(config)
    print(f"starting verst (logs in {config.log_dir}/) ...", flush=True)
    stack.start()
    print(f"verst is up: api {stack.api_url}  redis {stack.redis_url}  (Ctrl-C stops everything)", flush=True)
    try:
        while True:
            stack.check_alive()
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
    finally:
        stack.stop()
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    job = submit(args.api, Path(args.spec))
    print(job["job_id"])
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    if args.job:
        print(json.dumps(get_job(args.api, args.job), indent=2))
        return 0
    jobs = list_jobs(args.api)
    print(f"{'job':32} {'state':22} {'version':>7} {'step':>5}")
    for job in jobs:
        print(
            f"{job['job_id']:32} {job['state']:22} {job.get('policy_version', 0):>7} {job.get('step', 0):>5}"
        )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A saved version of a job as a Hugging Face directory, written here (the job's checkpoint
    directory must be readable here) or, with --on-api, by the api on its host."""
    from services.common.export import ExportError, export_version

    merge = not args.adapter
    if args.on_api:
        done = export_job(args.api, args.job, args.out_dir, version=args.version, merge=merge)
        where = f"{done['kind']} in {done['out_dir']}"
        print(f"v{done['version']} (epoch {done['epoch']}) of {done['job_id']}: {where}")
        return 0
    trust = False
    if args.checkpoint_dir is not None:
        root = Path(args.checkpoint_dir)
    else:
        spec = JobSpec.model_validate(get_job(args.api, args.job)["spec"])
        root, trust = Path(spec.trainer.checkpoint_dir), spec.model.trust_remote_code
    try:
        exported = export_version(
            root, args.job, Path(args.out_dir), version=args.version, merge=merge, trust_remote_code=trust
        )
    except (LookupError, ExportError) as err:
        print(f"verst export: {err}", file=sys.stderr)
        return 1
    print(
        f"v{exported.version} (epoch {exported.epoch}) of {args.job}: {exported.kind} in {exported.directory}"
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from services.demo import run_demo

    return run_demo(Path(args.spec), Path(args.out), engines=args.engines)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="verst", description="RL post-training as services.")
    root.add_argument("-v", "--verbose", action="store_true", help="log what the command does")
    commands = root.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start Redis and every service locally; Ctrl-C stops them")
    up.add_argument("--engines", type=int, default=1, help="rollout engines to start")
    up.add_argument("--log-dir", default=".verst/logs", help="one log file per service here")
    up.add_argument("--redis-dir", default=".verst/redis", help="embedded Redis persists here")
    up.add_argument(
        "--separate-controller",
        action="store_true",
        help="run the job controller as its own process (python -m services.controller), not in the api",
    )
    up.set_defaults(run=cmd_up)

    sub = commands.add_parser("submit", help="submit a job spec (YAML) to the api")
    sub.add_argument("spec", help="path to a JobSpec YAML file")
    sub.add_argument("--api", default=DEFAULT_API, help="api base URL (env VERST_API_URL)")
    sub.set_defaults(run=cmd_submit)

    status = commands.add_parser("status", help="list jobs, or show one")
    status.add_argument("job", nargs="?", help="job id")
    status.add_argument("--api", default=DEFAULT_API, help="api base URL (env VERST_API_URL)")
    status.set_defaults(run=cmd_status)

    export = commands.add_parser(
        "export", help="write a saved version of a job as a Hugging Face directory (model or LoRA adapter)"
    )
    export.add_argument("job", help="job id")
    export.add_argument("out_dir", help="directory to write (new or empty)")
    export.add_argument(
        "--version", type=int, default=None, help="policy version (default: the newest saved)"
    )
    how = export.add_mutually_exclusive_group()
    how.add_argument(
        "--merge",
        action="store_true",
        help="LoRA jobs: the base model with the adapter merged in (the default)",
    )
    how.add_argument(
        "--adapter", action="store_true", help="LoRA jobs: the adapter alone, for PeftModel.from_pretrained"
    )
    export.add_argument(
        "--checkpoint-dir", default=None, help="the job's trainer.checkpoint_dir (default: ask the api)"
    )
    export.add_argument(
        "--on-api", action="store_true", help="let the api write it, on its host (out_dir absolute there)"
    )
    export.add_argument("--api", default=DEFAULT_API, help="api base URL (env VERST_API_URL)")
    export.set_defaults(run=cmd_export)

    demo = commands.add_parser("demo", help="run the default job end to end on this machine")
    demo.add_argument("--spec", default=str(DEFAULT_SPEC), help="job spec to run")
    demo.add_argument("--out", default="runs/demo", help="where the plot and summary go")
    demo.add_argument("--engines", type=int, default=1, help="rollout engines to start")
    demo.set_defaults(run=cmd_demo)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return int(args.run(args))
    except JobSpecError as err:
        print(f"verst: {err}", file=sys.stderr)
        return 2
    except httpx.TransportError as err:
        print(f"verst: cannot reach the api ({err}); is `verst up` running?", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
