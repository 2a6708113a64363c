"""A job's checkpoints and logs over REST, and `verst checkpoints` / `verst logs`, against a real
api process on a real Redis.

The checkpoint directories are written here as the trainer lays them out (the names and handle
files of services/common/checkpoint_layout.py), with traps beside them: a symbolic link to a file
outside, a linked directory posing as a checkpoint, a staging directory. The api runs without its
controller; the test moves jobs through the job store, the owner of their state and events."""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from google.protobuf import json_format

from services.cli import main
from services.common.bus import Bus
from services.common.checkpoint_layout import (
    BASE_DIR,
    HANDLE_FILE,
    WEIGHTS_DIR,
    WEIGHTS_HANDLE_FILE,
    durable_name,
    weights_name,
)
from services.common.config import JobSpec
from services.common.events import warning_event
from services.common.jobs import RUNNING, SUCCEEDED, JobStore, MetricRow
from services.common.pb import common_pb2
from tests.integration.api_process import ApiProcess, serving
from tests.integration.cli_thread import ended, run_cli

TOKEN = "artefacts-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LINES_LIMIT = 500
DEADLINE_S = 30.0


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "logs"
    directory.mkdir()
    return directory


@pytest.fixture
def api(
    python: str, python_env: dict[str, str], redis_url: str, root: Path, log_dir: Path
) -> Iterator[ApiProcess]:
    settings = {
        "TOKEN": TOKEN,
        "CHECK_SPECS": "false",
        "CONTROLLER": "false",
        "LOG_DIR": str(log_dir),
        "LOG_LINES_LIMIT": str(LINES_LIMIT),
    }
    env = python_env | {"VERST_CHECKPOINT_ROOT": str(root)}
    with serving(python, env, redis_url, **settings) as process:
        yield process


@pytest.fixture
async def client(api: ApiProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=api.url, headers=AUTH, timeout=30) as client:
        yield client


async def submit(client: httpx.AsyncClient, checkpoint_dir: Path) -> str:
    spec = JobSpec.model_validate({"name": "addition", "trainer": {"checkpoint_dir": str(checkpoint_dir)}})
    response = await client.post("/v1/jobs", json=spec.model_dump(mode="json"))
    assert response.status_code == 201, response.text
    return str(response.json()["job_id"])


def write_dir(
    directory: Path, files: dict[str, bytes], handle_file: str, handle: common_pb2.CheckpointHandle
) -> None:
    for name, data in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    handle.uri = directory.as_uri()
    handle.created_at.GetCurrentTime()
    (directory / handle_file).write_text(json_format.MessageToJson(handle))


def lay_out(job_dir: Path, outside: Path) -> dict[str, dict[str, bytes]]:
    """Weights-only v1 and v2, durable v1 (a real checkpoint's shapes, small), and traps; the
    files each listed directory holds."""
    weights = os.urandom(3 * (1 << 20) + 17)  # more than one chunk of the archive
    model = {"model.safetensors": weights, "config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}"}
    layout: dict[str, dict[str, bytes]] = {}
    for version in (1, 2):
        name = weights_name(version, 1)
        handle = common_pb2.CheckpointHandle(job_id=job_dir.name, version=version, step=version, epoch=1)
        write_dir(job_dir / WEIGHTS_DIR / name, model, WEIGHTS_HANDLE_FILE, handle)
        layout[name] = {
            **model,
            WEIGHTS_HANDLE_FILE: (job_dir / WEIGHTS_DIR / name / WEIGHTS_HANDLE_FILE).read_bytes(),
        }
    durable = {**model, "training_state/state/mp_rank_00_model_states.pt": b"state", "consumed.json": b"{}"}
    handle = common_pb2.CheckpointHandle(job_id=job_dir.name, version=1, step=1, epoch=1, durable=True)
    write_dir(job_dir / durable_name(1), durable, HANDLE_FILE, handle)
    layout[durable_name(1)] = {**durable, HANDLE_FILE: (job_dir / durable_name(1) / HANDLE_FILE).read_bytes()}
    # traps: a link to a secret, a linked directory posing as v9, a staging directory
    (outside / "secret").write_text("not yours")
    (job_dir / durable_name(1) / "secret-link").symlink_to(outside / "secret")
    write_dir(
        outside / "v9", {"model.safetensors": b"x"}, HANDLE_FILE, common_pb2.CheckpointHandle(version=9)
    )
    (job_dir / durable_name(9)).symlink_to(outside / "v9", target_is_directory=True)
    staging = job_dir / f".{durable_name(3)}.tmp-1"
    write_dir(staging, model, HANDLE_FILE, common_pb2.CheckpointHandle(version=3, durable=True))
    return layout


def members(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        found = {}
        for member in tar.getmembers():
            assert member.isfile(), member.name  # files only: no links, no directories
            extracted = tar.extractfile(member)
            assert extracted is not None
            found[member.name] = extracted.read()
        return found


@pytest.fixture
async def saved_job(
    client: httpx.AsyncClient, root: Path, tmp_path: Path
) -> tuple[str, dict[str, dict[str, bytes]]]:
    job_id = await submit(client, root / "runs")
    outside = tmp_path / "outside"
    outside.mkdir()
    return job_id, lay_out(root / "runs" / job_id, outside)


async def test_checkpoints_are_listed_and_each_archive_holds_exactly_its_files(
    client: httpx.AsyncClient, saved_job: tuple[str, dict[str, dict[str, bytes]]], root: Path
) -> None:
    job_id, layout = saved_job
    listed = await client.get(f"/v1/jobs/{job_id}/checkpoints")
    assert listed.status_code == 200, listed.text
    entries = listed.json()["checkpoints"]
    assert [(e["name"], e["kind"], e["version"], e["epoch"]) for e in entries] == [
        ("v000001-e1", "weights", 1, 1), ("v000001", "durable", 1, 1), ("v000002-e1", "weights", 2, 1),
    ]  # fmt: skip
    for entry in entries:
        assert entry["size_bytes"] == sum(len(data) for data in layout[entry["name"]].values())
        assert entry["lora_adapter"] is False and entry["created_at"] is not None
        directory = (
            root / "runs" / job_id / ("" if entry["kind"] == "durable" else WEIGHTS_DIR) / entry["name"]
        )
        assert entry["uri"] == directory.resolve().as_uri()

    for ref, name in [
        ("v000001", "v000001"),
        ("1", "v000001"),
        ("2", "v000002-e1"),
        ("v000001-e1", "v000001-e1"),
    ]:
        response = await client.get(f"/v1/jobs/{job_id}/checkpoints/{ref}/archive")
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/gzip"
        assert f'filename="{job_id}-{name}.tar.gz"' in response.headers["content-disposition"]
        prefix = f"{job_id}-{name}/"
        assert members(response.content) == {prefix + path: data for path, data in layout[name].items()}


async def test_a_lora_jobs_base_and_adapters_are_listed(client: httpx.AsyncClient, root: Path) -> None:
    job_id = await submit(client, root / "runs")
    job_dir = root / "runs" / job_id
    base = {"model.safetensors": b"base weights", "config.json": b"{}"}
    write_dir(job_dir / BASE_DIR, base, WEIGHTS_HANDLE_FILE, common_pb2.CheckpointHandle(job_id=job_id))
    adapter = {"adapter_model.safetensors": b"lora", "adapter_config.json": b"{}"}
    handle = common_pb2.CheckpointHandle(job_id=job_id, version=1, step=1, epoch=1)
    handle.adapter.base_uri = (job_dir / BASE_DIR).as_uri()
    write_dir(job_dir / WEIGHTS_DIR / weights_name(1, 1), adapter, WEIGHTS_HANDLE_FILE, handle)

    entries = (await client.get(f"/v1/jobs/{job_id}/checkpoints")).json()["checkpoints"]
    assert [(e["name"], e["kind"], e["lora_adapter"]) for e in entries] == [
        ("base", "base", False), ("v000001-e1", "weights", True),
    ]  # fmt: skip
    archive = await client.get(f"/v1/jobs/{job_id}/checkpoints/base/archive")
    assert set(members(archive.content)) == {f"{job_id}-base/{name}" for name in [*base, WEIGHTS_HANDLE_FILE]}


async def test_archive_requests_outside_the_checkpoints_are_refused(
    client: httpx.AsyncClient,
    api: ApiProcess,
    saved_job: tuple[str, dict[str, dict[str, bytes]]],
    tmp_path: Path,
) -> None:
    job_id, _ = saved_job
    base = f"/v1/jobs/{job_id}/checkpoints"
    for ref in ["..", "%2E%2E", "..%2F..%2Foutside", "v000001%2F..%2F..", "v000001-e1%2F..",
                "%2Fetc%2Fpasswd", "base%2F..%2F..", "v1", "v000001-e", "-1", "v000001;ls"]:  # fmt: skip
        response = await client.get(f"{base}/{ref}/archive")
        assert response.status_code in (404, 422), (ref, response.status_code)
        assert response.headers["content-type"] == "application/json"
    response = await client.get(f"{base}/../../../../etc/passwd/archive")  # the client resolves dots
    assert response.status_code == 404
    for ref in ("v000009", "9", "v000003", "3", "v000007"):  # a linked directory, a staging one, none
        response = await client.get(f"{base}/{ref}/archive")
        assert response.status_code == 404, ref
        assert response.json()["detail"].startswith(f"job {job_id} has no"), ref
    named = (await client.get(f"{base}/v000009/archive")).json()["detail"]
    assert named.endswith("(saved: v000001-e1, v000001, v000002-e1)")

    missing = await client.get("/v1/jobs/nobody-00000000/checkpoints")
    assert missing.status_code == 404 and missing.json()["detail"] == "no job 'nobody-00000000'"
    assert (await client.get("/v1/jobs/nobody-00000000/checkpoints/1/archive")).status_code == 404
    elsewhere = await submit(client, tmp_path / "elsewhere")  # outside VERST_CHECKPOINT_ROOT
    refused = await client.get(f"/v1/jobs/{elsewhere}/checkpoints")
    assert refused.status_code == 404 and "outside VERST_CHECKPOINT_ROOT" in refused.json()["detail"]
    async with httpx.AsyncClient(base_url=api.url, timeout=10) as anonymous:
        assert (await anonymous.get(base)).status_code == 401
        assert (await anonymous.get(f"{base}/1/archive")).status_code == 401


async def step(store: JobStore, job_id: str, number: int) -> None:
    values = {"reward_mean": number / 10, "loss": 0.5}
    await store.merge_metric_rows(job_id, [MetricRow(number, number, "trainer", values, time.time())])


async def test_a_jobs_log_is_its_events_as_lines(client: httpx.AsyncClient, bus: Bus, root: Path) -> None:
    store = JobStore(bus.redis)
    job_id = await submit(client, root / "runs")
    assert await store.set_state(job_id, RUNNING)
    for number in (1, 2, 3):
        await step(store, job_id, number)
    await store.events.append(warning_event(job_id, "an evaluation was missed"))

    logs = (await client.get(f"/v1/jobs/{job_id}/logs", params={"lines": 2})).json()
    assert [line.split(" ", 1)[1] for line in logs["lines"]] == [
        "metrics trainer step 3 v3: loss=0.5 reward_mean=0.3",
        "warning an evaluation was missed",
    ]
    assert logs["lines"][0][:4].isdigit() and logs["finished"] is False  # a time first
    everything = (await client.get(f"/v1/jobs/{job_id}/logs")).json()["lines"]
    assert [line.split(" ")[1:3] for line in everything[:2]] == [["state", "queued"], ["state", "running"]]
    assert len(everything) == 6

    assert await store.set_state(job_id, SUCCEEDED, "all steps done")
    after = (await client.get(f"/v1/jobs/{job_id}/logs", params={"after": logs["last_event_id"]})).json()
    assert [line.split(" ", 1)[1] for line in after["lines"]] == ["state succeeded: all steps done"]
    assert after["finished"] is True

    too_many = await client.get(f"/v1/jobs/{job_id}/logs", params={"lines": LINES_LIMIT + 1})
    assert too_many.status_code == 422 and too_many.json()["detail"][0]["loc"] == ["query", "lines"]
    bad_id = await client.get(f"/v1/jobs/{job_id}/logs", params={"after": "$"})
    assert bad_id.status_code == 422
    assert (await client.get("/v1/jobs/nobody-00000000/logs")).status_code == 404


async def test_a_services_log_file_is_tailed_and_followed(client: httpx.AsyncClient, log_dir: Path) -> None:
    log = log_dir / "trainer.log"
    log.write_text("".join(f"line {number}\n" for number in range(1000)) + "half a li")
    tail = (await client.get("/v1/services/trainer/logs", params={"lines": 3})).json()
    assert tail["lines"] == ["line 997", "line 998", "line 999"]
    with log.open("a") as file:
        file.write("ne\nlast\n")
    more = (await client.get("/v1/services/trainer/logs", params={"after": tail["end"]})).json()
    assert more["lines"] == ["half a line", "last"] and more["end"] == log.stat().st_size

    missing = await client.get("/v1/services/router/logs")
    assert missing.status_code == 404 and "services with logs: trainer" in missing.json()["detail"]
    (log_dir.parent / "secret.log").write_text("not a service's\n")
    for name in ["..%2Fsecret", "%2E%2E", "Trainer", "trainer.log", "-x"]:
        response = await client.get(f"/v1/services/{name}/logs")
        assert response.status_code in (404, 422), name
        assert "not a service's" not in response.text
    too_many = await client.get("/v1/services/trainer/logs", params={"lines": LINES_LIMIT + 1})
    assert too_many.status_code == 422


async def test_verst_checkpoints_lists_and_downloads(
    api: ApiProcess,
    saved_job: tuple[str, dict[str, dict[str, bytes]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("VERST_API_TOKEN", TOKEN)
    job_id, layout = saved_job
    assert main(["checkpoints", job_id, "--api", api.url]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split()[:3] == ["name", "kind", "version"]
    assert [row.split()[:2] for row in rows[1:]] == [["v000001-e1", "weights"], ["v000001", "durable"],
                                                     ["v000002-e1", "weights"]]  # fmt: skip
    assert main(["checkpoints", job_id, "--json", "--api", api.url]) == 0
    assert [entry["name"] for entry in json.loads(capsys.readouterr().out)] == [
        "v000001-e1",
        "v000001",
        "v000002-e1",
    ]

    out = tmp_path / "v1.tar.gz"
    assert main(["checkpoints", job_id, "--download", "1", "-o", str(out), "--json", "--api", api.url]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done == {"job_id": job_id, "checkpoint": "1", "file": str(out), "size_bytes": out.stat().st_size}
    expected = {f"{job_id}-v000001/{path}": data for path, data in layout["v000001"].items()}
    assert members(out.read_bytes()) == expected

    assert (
        main(["checkpoints", job_id, "--download", "v000007", "-o", str(tmp_path / "x"), "--api", api.url])
        == 1
    )
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "has no checkpoint v000007" in err and "(HTTP 404)" in err
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.part"))
    assert main(["checkpoints", "nobody-00000000", "--api", api.url]) == 1
    assert capsys.readouterr().err.strip().endswith("no job 'nobody-00000000' (HTTP 404)")


async def test_verst_logs_tails_and_follows(
    api: ApiProcess,
    client: httpx.AsyncClient,
    bus: Bus,
    root: Path,
    log_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("VERST_API_TOKEN", TOKEN)
    store = JobStore(bus.redis)
    job_id = await submit(client, root / "runs")
    assert await store.set_state(job_id, RUNNING)
    await step(store, job_id, 1)
    assert main(["logs", job_id, "-n", "1", "--api", api.url]) == 0
    assert capsys.readouterr().out.split(" ", 1)[1] == "metrics trainer step 1 v1: loss=0.5 reward_mean=0.1\n"

    thread, outcome = run_cli(["logs", job_id, "-n", "1", "--follow", "--json", "--api", api.url])
    await asyncio.sleep(1.5)
    assert thread.is_alive()  # the job runs on: so does the follow
    await step(store, job_id, 2)
    assert await store.set_state(job_id, SUCCEEDED, "done")
    assert await ended(thread), "verst logs --follow did not end with the job"
    assert outcome["status"] == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["line"].split(" ", 2)[1] for line in lines] == ["metrics", "metrics", "state"]
    assert lines[-1]["line"].endswith("state succeeded: done") and lines[-1]["job_id"] == job_id

    (log_dir / "engine-0.log").write_text("loading\nserving\n")
    thread, outcome = run_cli(
        ["logs", "--service", "engine-0", "-n", "1", "-f", "--for-s", "3", "--api", api.url]
    )
    await asyncio.sleep(1.0)
    with (log_dir / "engine-0.log").open("a") as file:
        file.write("generating\n")
    assert await ended(thread) and outcome["status"] == 0
    assert capsys.readouterr().out.splitlines() == ["serving", "generating"]

    assert main(["logs", "--service", "router", "--api", api.url]) == 1
    assert "no log of service 'router'" in capsys.readouterr().err
    assert main(["logs", "--api", api.url]) == 2
    assert "name a job or --service" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["logs", job_id, "-n", "0"])
    assert "lines must be from 1" in capsys.readouterr().err


async def test_a_download_abandoned_midway_leaves_the_api_serving(
    client: httpx.AsyncClient, saved_job: tuple[str, dict[str, dict[str, bytes]]]
) -> None:
    job_id, layout = saved_job
    for _ in range(3):
        async with client.stream("GET", f"/v1/jobs/{job_id}/checkpoints/v000001/archive") as response:
            assert response.status_code == 200
            async for _chunk in response.aiter_raw():
                break  # the client goes away with most of the archive unsent
    whole = await client.get(f"/v1/jobs/{job_id}/checkpoints/v000001/archive")
    assert set(members(whole.content)) == {f"{job_id}-v000001/{path}" for path in layout["v000001"]}
