"""`verst up` and `verst demo`: the whole stack on this machine."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from pathlib import Path

from services.cli.options import Subcommands, new_command
from services.examples import example_names, example_spec
from services.stack_ports import MAX_PORT, PortPlanError
from services.supervisor import RestartPolicy


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    from services.stack import Stack, StackConfig

    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the stack in order, like Ctrl-C

    config = StackConfig(
        log_dir=Path(args.log_dir),
        redis_dir=Path(args.redis_dir),
        engines=args.engines,
        trainers=args.trainers,
        separate_controller=args.separate_controller,
        port_base=args.port_base,
        supervise=True,  # a service that ends is restarted with backoff, logged, shown by `verst status`
    )
    progress = sys.stderr if args.json else sys.stdout  # --json: stdout holds the JSON alone
    try:
        stack = Stack(config)
        print(f"starting verst (logs in {config.log_dir}/) ...", file=progress, flush=True)
        stack.start()
    except PortPlanError as err:  # out of range, or taken: one line naming the port
        print(f"verst: {err}", file=sys.stderr)
        return 2
    if args.json:
        where = {"api": stack.api_url, "redis": stack.redis_url, "log_dir": str(config.log_dir)}
        print(json.dumps({**where, "metrics_ports": stack.metrics_ports, "ports": stack.ports}))
        sys.stdout.flush()
    else:
        where = f"api {stack.api_url}  redis {stack.redis_url}"
        print(f"verst is up: {where}  (Ctrl-C stops everything)", flush=True)
    try:
        while True:
            stack.check_alive()
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("\nstopping ...", file=progress, flush=True)
    finally:
        stack.stop()
    return 0


def spec_file(value: str) -> contextlib.AbstractContextManager[Path]:
    """``--spec``: a file, else the name of an example shipped with verst (``addition``)."""
    if Path(value).is_file() or value not in example_names():
        return contextlib.nullcontext(Path(value))
    return example_spec(value)


def cmd_demo(args: argparse.Namespace) -> int:
    from services.demo import run_demo

    # --json: the progress goes to stderr, the summary alone to stdout
    progress = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with spec_file(args.spec) as spec, progress:
        summary = run_demo(spec, Path(args.out), engines=args.engines)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


def _count(value: str) -> int:
    """A whole number of processes, 0 or more (argparse's error names the flag)."""
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {number}")
    return number


def supervision_help(policy: RestartPolicy) -> str:
    """What `verst up --help` says of restarts, from the policy it runs with."""
    return (
        f"A service that ends on its own is restarted after a backoff ({policy.first_delay_s:g} s,"
        f" doubling to {policy.max_delay_s:g} s, starting over once it stays up"
        f" {policy.stable_after_s:g} s), each restart logged here and listed by `verst status`; one"
        f" that ends {policy.crash_loop_restarts} times within {policy.crash_loop_window_s:g} s is"
        f" reported as crash-looping and retried every {policy.max_delay_s:g} s."
    )


def _port(value: str) -> int:
    """A TCP port number, 1 to 65535 (argparse's error names the flag)."""
    number = int(value)
    if not 1 <= number <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be a port from 1 to {MAX_PORT}, not {number}")
    return number


def add_up(commands: Subcommands) -> None:
    up = new_command(
        commands,
        "up",
        "start Redis and every service locally; Ctrl-C stops them",
        cmd_up,
        api=False,
        more=supervision_help(RestartPolicy()),
    )
    up.add_argument("--engines", type=int, default=1, help="rollout engines to start")
    up.add_argument(
        "--trainers",
        type=_count,
        default=1,
        help="trainer processes to start: up to this many jobs train at once, the rest queue in order",
    )
    up.add_argument("--log-dir", default=".verst/logs", help="one log file per service here")
    up.add_argument("--redis-dir", default=".verst/redis", help="embedded Redis persists here")
    up.add_argument(
        "--separate-controller",
        action="store_true",
        help="run the job controller as its own process (python -m services.controller), not in the api",
    )
    up.add_argument(
        "--port-base",
        type=_port,
        default=None,
        metavar="N",
        help="bind every port at N plus a fixed offset: api N, embedded Redis N+1, router N+2, ..."
        " (services/stack_ports.py). A stack takes 10 ports plus 3 per trainer and per engine: stacks"
        " with bases that far apart share a host",
    )


def add_demo(commands: Subcommands) -> None:
    demo = new_command(
        commands, "demo", "run the default job end to end on this machine", cmd_demo, api=False
    )
    demo.add_argument(
        "--spec",
        default="addition",
        help=f"job spec file, or a shipped example: {', '.join(example_names())} (default: addition)",
    )
    demo.add_argument("--out", default="runs/demo", help="where the plot and summary go")
    demo.add_argument("--engines", type=int, default=1, help="rollout engines to start")
