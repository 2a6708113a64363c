"""The `verst` command against a real api process on a real Redis."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli import main
from services.common.healthcheck import wait_until
from tests.integration.test_services import start, stop

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def api(python: str, python_env: dict[str, str], redis_url: str) -> Iterator[str]:
    proc, port = start(python, python_env, ["services.api"], "VERST_API_PORT", redis_url)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until("http", f"{url}/healthz", deadline_s=30), "api did not come up"
        yield url
    finally:
        stop(proc)


def test_submit_then_status(api: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["submit", str(ROOT / "examples" / "addition.yaml"), "--api", api]) == 0
    job_id = capsys.readouterr().out.strip()
    assert job_id.startswith("addition-grpo-")

    assert main(["status", "--api", api]) == 0
    listing = capsys.readouterr().out
    assert job_id in listing and "JOB_STATE_QUEUED" in listing

    assert main(["status", job_id, "--api", api]) == 0
    assert f'"job_id": "{job_id}"' in capsys.readouterr().out


def test_a_bad_spec_is_refused_before_it_is_sent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  max_new_tokns: 8\n")
    assert main(["submit", str(bad), "--api", "http://127.0.0.1:9"]) == 2
    assert "rollout.max_new_tokns: Extra inputs are not permitted" in capsys.readouterr().err


def test_an_unreachable_api_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--api", "http://127.0.0.1:9"]) == 1
    assert "cannot reach the api" in capsys.readouterr().err


def test_unknown_job_is_reported(api: str) -> None:
    with pytest.raises(SystemExit, match="no job 'nope-00000000'"):
        main(["status", "nope-00000000", "--api", api])


def test_the_client_sends_verst_api_token(
    python: str, python_env: dict[str, str], redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = "cli-token-0123456789"
    env = {**python_env, "VERST_API_TOKEN": token, "VERST_API_CHECK_SPECS": "false"}
    proc, port = start(python, env, ["services.api"], "VERST_API_PORT", redis_url)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until("http", f"{url}/healthz", deadline_s=30), "api did not come up"
        monkeypatch.delenv("VERST_API_TOKEN", raising=False)
        with pytest.raises(SystemExit, match="set VERST_API_TOKEN"):
            main(["status", "nope-00000000", "--api", url])
        monkeypatch.setenv("VERST_API_TOKEN", token)
        assert main(["submit", str(ROOT / "examples" / "addition.yaml"), "--api", url]) == 0
        with pytest.raises(SystemExit, match="no job 'nope-00000000'"):
            main(["status", "nope-00000000", "--api", url])
    finally:
        stop(proc)


def test_console_script_is_installed() -> None:
    verst = Path(sys.executable).parent / "verst"
    result = subprocess.run([str(verst), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for command in ("up", "submit", "status", "demo"):
        assert command in result.stdout
