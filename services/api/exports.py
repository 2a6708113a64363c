"""``POST /v1/jobs/{job_id}/export``: a saved version of a job written as a Hugging Face directory
on the api's host (services/common/export.py does the work, in a thread).

The api reads the job's checkpoints where its spec says (``trainer.checkpoint_dir``, relative to
the api's working directory when relative) and writes ``out_dir``, an absolute path inside
VERST_CHECKPOINT_ROOT when that is set.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request, status
from pydantic import BaseModel, ConfigDict, Field

from services.api.config import ApiSettings
from services.api.guard import ErrorBody, JobId, error_responses
from services.common.export import ExportError, export_version
from services.common.jobs import JobNotFoundError, JobStore


class ExportRequest(BaseModel):
    """Which version to export, how, and where."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    out_dir: str = Field(min_length=1, max_length=4096)
    """Absolute directory to write on the api's host: new or empty; inside VERST_CHECKPOINT_ROOT
    when that is set."""
    version: int | None = Field(None, ge=0)
    """The policy version (of the newest lineage that has it); null: the newest saved."""
    merge: bool = True
    """A LoRA job: the base model with the adapter merged in (true), or the adapter alone (false,
    for `PeftModel.from_pretrained`); a full fine-tune takes true only."""


class ExportView(BaseModel):
    """What was written."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    job_id: str
    version: int
    epoch: int
    """The trainer lineage the version belongs to."""
    kind: Literal["full", "merged", "adapter"]
    """`full`: a full fine-tune's model; `merged`: base + adapter; `adapter`: the adapter alone."""
    out_dir: str
    base_dir: str | None
    """The base model an unmerged adapter applies to (its `base_model_name_or_path`)."""


def out_dir_problem(out_dir: str, settings: ApiSettings) -> str | None:
    """Why the api may not write ``out_dir``, or None."""
    if not os.path.isabs(out_dir):
        return f"out_dir {out_dir!r:.200} is not an absolute path"
    root = settings.checkpoint_root_path()
    resolved = Path(os.path.realpath(out_dir))
    if root is not None and not (resolved != root and resolved.is_relative_to(root)):
        return f"out_dir must lie in VERST_CHECKPOINT_ROOT ({root})"
    return None


def add_export_route(app: FastAPI, settings: ApiSettings) -> None:
    responses: dict[int | str, dict[str, Any]] = {
        **error_responses(400, 401, 404, 413, 503),
        409: {"model": ErrorBody, "description": "out_dir is in use, or the job has no adapter to export."},
    }

    @app.post("/v1/jobs/{job_id}/export", tags=["jobs"], responses=responses)
    async def export_job(job_id: JobId, body: ExportRequest, request: Request) -> ExportView:
        """Write a saved version of the job (a durable checkpoint or a weights-only version still
        on disk) as a Hugging Face directory that `AutoModelForCausalLM.from_pretrained` loads,
        with the tokenizer and chat template; with `merge: false`, a LoRA job's adapter for
        `PeftModel.from_pretrained`. 404: no such job or version; 422: an out_dir the api may not
        write."""
        problem = out_dir_problem(body.out_dir, settings)
        if problem is not None:
            detail = [{"type": "out_dir", "loc": ["body", "out_dir"], "msg": problem, "input": body.out_dir}]
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail)
        store: JobStore = request.app.state.store
        try:
            spec = await store.spec(job_id)
        except JobNotFoundError:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}") from None
        try:
            exported = await asyncio.to_thread(
                export_version,
                Path(spec.trainer.checkpoint_dir),
                job_id,
                Path(body.out_dir),
                version=body.version,
                merge=body.merge,
                trust_remote_code=False,  # the api runs no model's own code (`verst export` may)
            )
        except LookupError as err:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from None
        except ExportError as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from None
        return ExportView(
            job_id=exported.job_id,
            version=exported.version,
            epoch=exported.epoch,
            kind=exported.kind,
            out_dir=str(exported.directory),
            base_dir=str(exported.base) if exported.base is not None else None,
        )
