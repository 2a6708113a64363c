"""The `verst` command table and what every command shares: errors as one line on stderr and a
non-zero status, never a traceback; output into a closed pipe (`verst status | head`) ends quietly."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

import httpx

from services.cli.checkpoints import add_checkpoints
from services.cli.export import add_export
from services.cli.jobs import add_cancel, add_status, add_submit
from services.cli.local import add_demo, add_up
from services.cli.logs import add_logs
from services.cli.options import DEFAULT_API, Subcommands
from services.cli.tracking import add_tensorboard
from services.cli.watch import add_watch
from services.client import ApiError
from services.common.config import JobSpecError

COMMANDS: list[Callable[[Subcommands], None]] = [
    add_up,
    add_submit,
    add_status,
    add_cancel,
    add_watch,
    add_logs,
    add_checkpoints,
    add_export,
    add_tensorboard,
    add_demo,
]
"""Each adds one subcommand (options.new_command); a new command is one more entry here."""

SIGPIPE_STATUS = 141
"""What a shell reports for a process ended by SIGPIPE (128 + 13), as `cat` ends under `head`."""


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="verst", description="RL post-training as services.")
    root.add_argument("-v", "--verbose", action="store_true", help="log what the command does")
    commands = root.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(commands)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        status = int(args.run(args))
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at exit
        return status
    except BrokenPipeError:
        return _stdout_gone()
    except JobSpecError as err:
        print(f"verst: {err}", file=sys.stderr)
        return 2
    except ApiError as err:
        print(f"verst: {err}", file=sys.stderr)
        return 1
    except httpx.TransportError as err:
        api = getattr(args, "api", DEFAULT_API)
        reason = str(err) or type(err).__name__
        print(f"verst: cannot reach the api at {api} ({reason}); is `verst up` running?", file=sys.stderr)
        return 1
    except (FileNotFoundError, IsADirectoryError, PermissionError) as err:  # a spec file, say
        print(f"verst: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _stdout_gone() -> int:
    """The reader of stdout left (`| head`): point stdout at /dev/null so that the interpreter's
    flush at exit finds nothing to complain about, and end with the status SIGPIPE would give.
    SIGPIPE itself stays ignored, as Python sets it: a dead socket must raise, not kill."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return SIGPIPE_STATUS
