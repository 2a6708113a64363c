"""A small REST client of the api, shared by the `verst` command and `verst demo`.

When ``VERST_API_TOKEN`` is set, every request carries it as ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from services.common.config import load_job_spec
from services.common.jobs import TERMINAL_STATES

EXPORT_TIMEOUT_S = 3600.0
"""An export merges and writes a whole model: minutes for a large one."""

__all__ = ["TERMINAL_STATES", "auth_headers", "export_job", "get_job", "job_history", "list_jobs", "submit"]


def auth_headers() -> dict[str, str]:
    """The bearer token header from ``VERST_API_TOKEN``; none when it is unset."""
    token = os.environ.get("VERST_API_TOKEN", "").strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def submit(api: str, spec_path: Path) -> dict[str, Any]:
    """Validate a spec locally (errors name the field), then POST it to the api."""
    spec = load_job_spec(spec_path)
    response = httpx.post(
        f"{api}/v1/jobs", json=spec.model_dump(mode="json"), headers=auth_headers(), timeout=30
    )
    if response.status_code != 201:
        raise SystemExit(f"verst submit: {response.status_code} {response.text}")
    return response.json()


def get_job(api: str, job_id: str) -> dict[str, Any]:
    """One job's record; exits with a clear message when there is no such job."""
    response = httpx.get(f"{api}/v1/jobs/{job_id}", headers=auth_headers(), timeout=10)
    if response.status_code == 404:
        raise SystemExit(f"verst: no job {job_id!r}")
    if response.status_code == 401:
        raise SystemExit("verst: the api wants a token: set VERST_API_TOKEN")
    response.raise_for_status()
    return response.json()


def list_jobs(api: str) -> list[dict[str, Any]]:
    """The newest jobs, newest first."""
    response = httpx.get(f"{api}/v1/jobs", headers=auth_headers(), timeout=10)
    response.raise_for_status()
    jobs = response.json()
    return jobs.get("jobs", jobs) if isinstance(jobs, dict) else jobs


def export_job(
    api: str, job_id: str, out_dir: str, *, version: int | None = None, merge: bool = True
) -> dict[str, Any]:
    """Ask the api to write a saved version of the job to ``out_dir`` on its host (POST
    /v1/jobs/{id}/export); exits with the api's reason when it refuses."""
    body = {"out_dir": out_dir, "version": version, "merge": merge}
    response = httpx.post(
        f"{api}/v1/jobs/{job_id}/export", json=body, headers=auth_headers(), timeout=EXPORT_TIMEOUT_S
    )
    if response.status_code != 200:
        raise SystemExit(f"verst export: {response.status_code} {response.text}")
    return response.json()


def job_history(api: str, job_id: str) -> list[dict[str, Any]]:
    """Per-step metric points, oldest first: {"step", "policy_version", "source", "values", "time"}."""
    response = httpx.get(f"{api}/v1/jobs/{job_id}/metrics", headers=auth_headers(), timeout=10)
    response.raise_for_status()
    return response.json()["points"]
