"""A small REST client of the api, shared by the `verst` command and `verst demo`.

When ``VERST_API_TOKEN`` is set, every request carries it as ``Authorization: Bearer <token>``.
An answer other than success raises ``ApiError``, whose message is one line for a person; a
transport failure (no api there) is httpx's ``TransportError``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from services.common.config import load_job_spec
from services.common.jobs import TERMINAL_STATES
from services.common.spec_paths import absolute_paths

EXPORT_TIMEOUT_S = 3600.0
"""An export merges and writes a whole model: minutes for a large one."""
DOWNLOAD_READ_TIMEOUT_S = 120.0
"""Longest wait for the next bytes of a checkpoint archive."""

__all__ = [
    "TERMINAL_STATES",
    "ApiError",
    "auth_headers",
    "cancel_job",
    "cluster",
    "download_checkpoint",
    "export_job",
    "get_job",
    "job_history",
    "job_logs",
    "list_checkpoints",
    "list_jobs",
    "service_logs",
    "submit",
]


class ApiError(Exception):
    """The api answered with an error; ``str()`` is one line saying what went wrong."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _problems(detail: list[Any]) -> str:
    """FastAPI's validation errors as `field.path: message; …` (the body's fields, unprefixed)."""
    parts = []
    for error in detail:
        loc = [str(part) for part in error.get("loc", [])]
        where = ".".join(loc[1:] if loc[:1] == ["body"] else loc) or "(body)"
        parts.append(f"{where}: {error.get('msg', error)}")
    return "; ".join(parts)


def _checked(response: httpx.Response, what: str) -> Any:
    """The JSON of a successful answer; else an ApiError naming ``what`` was asked, and why."""
    if response.is_success:
        return response.json()
    code = response.status_code
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:  # not JSON: a proxy's page, say
        detail = response.text.strip().splitlines()[0] if response.text.strip() else response.reason_phrase
    if code == 401:
        wanted = "the api wants a token: set VERST_API_TOKEN"
        message = "the api refused VERST_API_TOKEN" if auth_headers() else wanted
    elif code == 422 and isinstance(detail, list):
        message = f"the api refused the request: {_problems(detail)}"
    else:
        message = str(detail)
    raise ApiError(code, f"{what}: {message} (HTTP {code})")


def auth_headers() -> dict[str, str]:
    """The bearer token header from ``VERST_API_TOKEN``; none when it is unset."""
    token = os.environ.get("VERST_API_TOKEN", "").strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def submit(api: str, spec_path: Path) -> dict[str, Any]:
    """Validate a spec locally (errors name the field), make its relative paths absolute against
    the current directory (services/common/spec_paths.py), then POST it to the api."""
    spec = absolute_paths(load_job_spec(spec_path))
    response = httpx.post(
        f"{api}/v1/jobs", json=spec.model_dump(mode="json"), headers=auth_headers(), timeout=30
    )
    return _checked(response, f"submitting {spec_path}")


def get_job(api: str, job_id: str) -> dict[str, Any]:
    """One job's record."""
    response = httpx.get(f"{api}/v1/jobs/{job_id}", headers=auth_headers(), timeout=10)
    return _checked(response, f"job {job_id}")


def cancel_job(api: str, job_id: str) -> dict[str, Any]:
    """Cancel a queued or running job; its record after. A finished job is an ApiError (409)."""
    response = httpx.post(f"{api}/v1/jobs/{job_id}/cancel", headers=auth_headers(), timeout=10)
    return _checked(response, f"cancelling {job_id}")


def list_jobs(api: str) -> list[dict[str, Any]]:
    """The newest jobs, newest first."""
    response = httpx.get(f"{api}/v1/jobs", headers=auth_headers(), timeout=10)
    jobs = _checked(response, "listing jobs")
    return jobs.get("jobs", jobs) if isinstance(jobs, dict) else jobs


def cluster(api: str) -> dict[str, Any]:
    """The engines, trainers and restarted services the api sees (GET /v1/cluster)."""
    response = httpx.get(f"{api}/v1/cluster", headers=auth_headers(), timeout=10)
    return dict(_checked(response, "the cluster"))


def export_job(
    api: str, job_id: str, out_dir: str, *, version: int | None = None, merge: bool = True
) -> dict[str, Any]:
    """Ask the api to write a saved version of the job to ``out_dir`` on its host (POST
    /v1/jobs/{id}/export); an ApiError with its reason when it refuses."""
    body = {"out_dir": out_dir, "version": version, "merge": merge}
    response = httpx.post(
        f"{api}/v1/jobs/{job_id}/export", json=body, headers=auth_headers(), timeout=EXPORT_TIMEOUT_S
    )
    return _checked(response, f"exporting {job_id}")


def list_checkpoints(api: str, job_id: str) -> list[dict[str, Any]]:
    """The job's saved directories (GET /v1/jobs/{id}/checkpoints), base first, oldest first."""
    response = httpx.get(f"{api}/v1/jobs/{job_id}/checkpoints", headers=auth_headers(), timeout=60)
    return list(_checked(response, f"checkpoints of {job_id}")["checkpoints"])


def download_checkpoint(api: str, job_id: str, version: str, out: Path) -> int:
    """Stream one saved directory's tar.gz into the file ``out`` (written under a temporary name,
    renamed when complete); its size in bytes. A download cut short raises, leaving no ``out``."""
    url = f"{api}/v1/jobs/{job_id}/checkpoints/{version}/archive"
    partial = out.with_name(f".{out.name}.part")
    timeout = httpx.Timeout(30.0, read=DOWNLOAD_READ_TIMEOUT_S)
    try:
        with httpx.stream("GET", url, headers=auth_headers(), timeout=timeout) as response:
            if not response.is_success:
                response.read()
                _checked(response, f"checkpoint {version} of {job_id}")
            with partial.open("wb") as file:
                for chunk in response.iter_bytes():
                    file.write(chunk)
        partial.rename(out)
    finally:
        partial.unlink(missing_ok=True)
    return out.stat().st_size


def job_logs(api: str, job_id: str, lines: int, after: str | None = None) -> dict[str, Any]:
    """The job's newest events as log lines (with ``after``, the first ones after that event id):
    {"job_id", "lines", "last_event_id", "finished"}."""
    params: dict[str, Any] = {"lines": lines} | ({"after": after} if after else {})
    response = httpx.get(f"{api}/v1/jobs/{job_id}/logs", params=params, headers=auth_headers(), timeout=10)
    return dict(_checked(response, f"logs of {job_id}"))


def service_logs(api: str, name: str, lines: int, after: int | None = None) -> dict[str, Any]:
    """The end of a service's log (or, with ``after``, its lines since that offset):
    {"service", "lines", "end"}."""
    params: dict[str, int] = {"lines": lines} | ({"after": after} if after is not None else {})
    response = httpx.get(f"{api}/v1/services/{name}/logs", params=params, headers=auth_headers(), timeout=10)
    return dict(_checked(response, f"logs of service {name}"))


def job_history(api: str, job_id: str) -> list[dict[str, Any]]:
    """Per-step metric points, oldest first: {"step", "policy_version", "source", "values", "time"}."""
    response = httpx.get(f"{api}/v1/jobs/{job_id}/metrics", headers=auth_headers(), timeout=10)
    return _checked(response, f"metrics of {job_id}")["points"]
