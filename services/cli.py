"""The `verst` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verst", description="RL post-training as services.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="run the default job end to end on this machine")
    args = parser.parse_args(argv)
    if args.command == "demo":
        print("verst demo: not yet: the end-to-end loop (services, trainer, engine) is not built yet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
