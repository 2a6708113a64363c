"""`verst export`: a saved version of a job as a Hugging Face directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.cli.options import Subcommands, emit, new_command
from services.client import export_job, get_job
from services.common.config import JobSpec


def cmd_export(args: argparse.Namespace) -> int:
    """Written here (the job's checkpoint directory must be readable here) or, with --on-api, by
    the api on its host."""
    from services.common.export import ExportError, export_version

    merge = not args.adapter
    if args.on_api:
        done = export_job(args.api, args.job, args.out_dir, version=args.version, merge=merge)
        where = f"{done['kind']} in {done['out_dir']}"
        emit(args, done, [f"v{done['version']} (epoch {done['epoch']}) of {done['job_id']}: {where}"])
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
    done = {
        "job_id": args.job,
        "version": exported.version,
        "epoch": exported.epoch,
        "kind": exported.kind,
        "out_dir": str(exported.directory),
    }
    where = f"{exported.kind} in {exported.directory}"
    emit(args, done, [f"v{exported.version} (epoch {exported.epoch}) of {args.job}: {where}"])
    return 0


def add_export(commands: Subcommands) -> None:
    export = new_command(
        commands,
        "export",
        "write a saved version of a job as a Hugging Face directory (model or LoRA adapter)",
        cmd_export,
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
