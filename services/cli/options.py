"""What every `verst` command shares: how it is added to the parser (with ``--json``, and
``--api`` when it talks to the api) and how it prints its result."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

DEFAULT_API = os.environ.get("VERST_API_URL", "http://127.0.0.1:8000")

Subcommands = Any
"""The object ``ArgumentParser.add_subparsers`` returns (argparse does not export its type)."""
Run = Callable[[argparse.Namespace], int]
"""A command: its parsed arguments in, its exit status out."""


def new_command(
    commands: Subcommands, name: str, summary: str, run: Run, *, api: bool = True, more: str = ""
) -> argparse.ArgumentParser:
    """A subcommand that runs ``run``, with ``--json`` and, when ``api``, ``--api``; ``more`` adds
    to the summary in its own --help. The caller adds its arguments to the parser returned."""
    description = f"{summary}. {more}" if more else summary
    command: argparse.ArgumentParser = commands.add_parser(name, help=summary, description=description)
    command.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
    if api:
        command.add_argument("--api", default=DEFAULT_API, help="api base URL (env VERST_API_URL)")
    command.set_defaults(run=run)
    return command


def emit(args: argparse.Namespace, data: Any, lines: Iterable[str]) -> None:
    """``data`` as JSON with ``--json``, else ``lines`` for a person."""
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for line in lines:
            print(line)
