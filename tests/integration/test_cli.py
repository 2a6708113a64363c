"""The `verst` command against a real api process on a real Redis."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli import main
from services.common.bus import connect
from services.common.config import DataConfig
from services.common.healthcheck import wait_until
from services.common.jobs import JobStore
from services.data import train_prompts
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
    header, line = capsys.readouterr().out.splitlines()
    assert header.split() == ["job", "state", "version", "step", "reward", "accuracy"]
    assert line.split() == [job_id, "queued", "0", "0", "-", "-"]

    assert main(["status", job_id, "--api", api]) == 0
    assert f"job       {job_id}" in capsys.readouterr().out
    assert main(["status", job_id, "--api", api, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["name"] == "addition-grpo"


def test_a_bad_spec_is_refused_before_it_is_sent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  max_new_tokns: 8\n")
    assert main(["submit", str(bad), "--api", "http://127.0.0.1:9"]) == 2
    assert "rollout.max_new_tokns: Extra inputs are not permitted" in capsys.readouterr().err


def test_an_unreachable_api_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--api", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("verst: cannot reach the api at http://127.0.0.1:9 (") and err.count("\n") == 1


def test_unknown_job_is_reported(api: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "nope-00000000", "--api", api]) == 1
    assert capsys.readouterr().err == "verst: job nope-00000000: no job 'nope-00000000' (HTTP 404)\n"


def test_the_client_sends_verst_api_token(
    python: str,
    python_env: dict[str, str],
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    token = "cli-token-0123456789"
    env = {**python_env, "VERST_API_TOKEN": token, "VERST_API_CHECK_SPECS": "false"}
    proc, port = start(python, env, ["services.api"], "VERST_API_PORT", redis_url)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until("http", f"{url}/healthz", deadline_s=30), "api did not come up"
        monkeypatch.delenv("VERST_API_TOKEN", raising=False)
        assert main(["status", "nope-00000000", "--api", url]) == 1
        wanted = "verst: job nope-00000000: the api wants a token: set VERST_API_TOKEN (HTTP 401)\n"
        assert capsys.readouterr().err == wanted
        monkeypatch.setenv("VERST_API_TOKEN", "wrong-token-0123456789")
        assert main(["status", "--api", url]) == 1
        assert capsys.readouterr().err == "verst: listing jobs: the api refused VERST_API_TOKEN (HTTP 401)\n"
        monkeypatch.setenv("VERST_API_TOKEN", token)
        assert main(["submit", str(ROOT / "examples" / "addition.yaml"), "--api", url]) == 0
        assert main(["status", "nope-00000000", "--api", url]) == 1
        assert "no job 'nope-00000000' (HTTP 404)" in capsys.readouterr().err
    finally:
        stop(proc)


def test_console_script_is_installed() -> None:
    verst = Path(sys.executable).parent / "verst"
    result = subprocess.run([str(verst), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for command in ("up", "submit", "status", "cancel", "export", "demo"):
        assert command in result.stdout


def test_cancel(api: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["submit", str(ROOT / "examples" / "addition.yaml"), "--api", api, "--json"]) == 0
    job_id = json.loads(capsys.readouterr().out)["job_id"]
    assert main(["cancel", job_id, "--api", api]) == 0
    assert capsys.readouterr().out == f"{job_id}: cancelled\n"
    assert main(["cancel", job_id, "--api", api]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"verst: cancelling {job_id}: job {job_id!r} already finished: JOB_STATE_CANCELLED (HTTP 409)\n"
    )
    assert main(["status", job_id, "--api", api, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "JOB_STATE_CANCELLED"


def test_status_shows_the_latest_reward_and_accuracy(
    api: str, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["submit", str(ROOT / "examples" / "addition.yaml"), "--api", api]) == 0
    job_id = capsys.readouterr().out.strip()

    async def report() -> None:
        redis = connect(redis_url)
        store = JobStore(redis)
        await store.merge_metrics(job_id, {"reward_mean": 0.25}, step=1, source="trainer")
        await store.merge_metrics(job_id, {"reward_mean": 0.625}, step=2, source="trainer")
        await store.merge_metrics(job_id, {"accuracy": 0.5}, step=2, source="eval")
        await redis.aclose()

    asyncio.run(report())
    assert main(["status", "--api", api]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[-2:] == ["0.625", "0.500"]
    assert main(["status", job_id, "--api", api]) == 0
    shown = capsys.readouterr().out
    assert "reward    0.625\n" in shown and "accuracy  0.500\n" in shown
    assert main(["status", "--api", api, "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["metrics"] == {"trainer/reward_mean": 0.625, "eval/accuracy": 0.5}


def write_prompts(path: Path) -> None:
    rows = itertools.islice(train_prompts(DataConfig(), 0), 8)
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps({"prompt": row.text, "answer": row.answer}) + "\n" for row in rows))


def test_relative_paths_are_the_submitters(
    api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The api runs in another directory: a relative data path reaches it absolute, against the
    directory `verst submit` ran in; one that is not there is the api's 422, on one line."""
    write_prompts(tmp_path / "prompts" / "train.jsonl")
    spec = tmp_path / "specs" / "job.yaml"
    spec.parent.mkdir()
    spec.write_text("name: relative\ndata:\n  train: prompts/train.jsonl\n  eval: null\n")
    monkeypatch.chdir(tmp_path)
    assert main(["submit", str(spec), "--api", api, "--json"]) == 0
    sent = json.loads(capsys.readouterr().out)["spec"]["data"]
    assert sent["train"] == str(tmp_path / "prompts" / "train.jsonl")

    spec.write_text("name: relative\ndata:\n  train: jsonl:missing.jsonl\n  eval: null\n")
    assert main(["submit", str(spec), "--api", api]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"verst: submitting {spec}: the api refused the request: data.train: ")
    assert str(tmp_path / "missing.jsonl") in err and err.endswith("(HTTP 422)\n") and err.count("\n") == 1


def test_output_into_a_closed_pipe_ends_quietly(api: str) -> None:
    """`verst status | head`: the reader is gone before verst writes; no traceback, SIGPIPE's status."""
    verst = Path(sys.executable).parent / "verst"
    proc = subprocess.Popen(
        [str(verst), "status", "--api", api], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    proc.stdout.close()  # before the interpreter has even started: every write meets a closed pipe
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (141, "")
