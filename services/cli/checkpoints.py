"""`verst checkpoints <job>`: a job's saved directories, and one downloaded as a tar.gz."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from services.cli.options import Subcommands, emit, new_command
from services.client import download_checkpoint, list_checkpoints

COLUMNS = f"{'name':14} {'kind':8} {'version':>7} {'epoch':>5} {'step':>5} {'size':>10}  created"


def size_text(size: int) -> str:
    """Bytes for a person: 512 B, 3.2 MiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def row(entry: dict[str, Any]) -> str:
    kind = f"{entry['kind']}{'+lora' if entry.get('lora_adapter') else ''}"
    return (
        f"{entry['name']:14} {kind:8} {entry['version']:>7} {entry['epoch']:>5} {entry['step']:>5} "
        f"{size_text(entry['size_bytes']):>10}  {entry.get('created_at') or '-'}"
    )


def cmd_checkpoints(args: argparse.Namespace) -> int:
    if args.download is None:
        entries = list_checkpoints(args.api, args.job)
        emit(args, entries, [COLUMNS, *(row(entry) for entry in entries)])
        return 0
    out = Path(args.out or f"{args.job}-{args.download}.tar.gz")
    size = download_checkpoint(args.api, args.job, args.download, out)
    done = {"job_id": args.job, "checkpoint": args.download, "file": str(out), "size_bytes": size}
    emit(args, done, [f"{out} ({size_text(size)})"])
    return 0


def add_checkpoints(commands: Subcommands) -> None:
    command = new_command(
        commands,
        "checkpoints",
        "list a job's durable checkpoints and weight versions, or download one as a tar.gz",
        cmd_checkpoints,
        more="Kinds: durable (resumable: weights and optimiser state), weights (weights-only, the newest"
        " few kept for the engines), base (a LoRA job's base model); +lora: the weights are a LoRA adapter.",
    )
    command.add_argument("job", help="job id")
    command.add_argument(
        "--download",
        metavar="VERSION",
        default=None,
        help="download this one: a version number, or a name as listed (v000003, v000003-e1, base)",
    )
    command.add_argument(
        "-o", "--out", default=None, help="file to write (default: <job>-<VERSION>.tar.gz here)"
    )
