"""Submission checks against the world (services/api/spec_checks.py): a bad-spec table, each case a
422 naming its field, with a real reward service over gRPC and a real Redis."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from huggingface_hub import constants

from services.api.config import ApiSettings
from services.api.server import create_app
from services.common.pb import reward_pb2_grpc
from services.reward.config import RewardSettings
from services.reward.server import SERVICE_NAME, RewardServicer
from tests.helpers import serve
from tests.unit.test_model_paths import REPO, REVISION, save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A directory that reads as a model: a config.json and the character tokenizer."""
    directory = tmp_path_factory.mktemp("model")
    for item in tokenizer_dir.iterdir():
        (directory / item.name).write_bytes(item.read_bytes())
    (directory / "config.json").write_text("{}")
    return directory


@pytest.fixture
async def reward_address() -> AsyncIterator[str]:
    servicer = RewardServicer(RewardSettings(port=0))
    checks = health.aio.HealthServicer()

    def register(server: Any) -> None:
        reward_pb2_grpc.add_RewardServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)

    server, address = await serve(register)
    await checks.set("", health_pb2.HealthCheckResponse.SERVING)
    await checks.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    yield address
    await server.stop(0)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
async def submit(redis_url: str, reward_address: str) -> AsyncIterator[Any]:
    opened: list[Any] = []

    async def post(spec: dict[str, Any], **settings: Any) -> httpx.Response:
        values = {"REDIS_URL": redis_url, "controller": False, "reward_address": reward_address, **settings}
        app = create_app(ApiSettings.model_validate(values))
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        opened.append(lifespan)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            return await client.post("/v1/jobs", json=spec)

    yield post
    for lifespan in opened:
        await lifespan.__aexit__(None, None, None)


def fields(reply: httpx.Response) -> dict[str, str]:
    assert reply.status_code == 422, reply.text
    return {".".join(map(str, e["loc"][1:])): e["msg"] for e in reply.json()["detail"]}


def write_jsonl(path: Path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return str(path)


BAD_SPECS: list[tuple[str, dict[str, Any], str, str]] = [
    ("unknown verifier", {"reward": {"verifier": "nope"}}, "reward.verifier", "unknown verifier 'nope'"),
    (
        "plugin that does not import",
        {"reward": {"plugin": "tests.no_such:score"}},
        "reward.plugin",
        "cannot import",
    ),
    ("plugin from the stdlib", {"reward": {"plugin": "os:system"}}, "reward.plugin", "may not be a plugin"),
    (
        "model path missing",
        {"model": {"path": "/no/such/model"}},
        "model.path",
        "'/no/such/model' does not exist",
    ),
    (
        "hub id not in the local cache",
        {"model": {"path": "verst-tests/no-such-model"}},
        "model.path",
        "the hub id is not in the local Hugging Face cache",
    ),
    (
        "a GGUF file that is not there",
        {"model": {"path": "/", "gguf_file": "no-such.Q4_0.gguf"}},
        "model.gguf_file",
        "'/' has no GGUF file 'no-such.Q4_0.gguf'",
    ),
    (
        "a directory without config.json",
        {"model": {"path": "/"}},
        "model.path",
        "has no readable config.json",
    ),
    (
        "unknown builtin model",
        {"model": {"path": "builtin:nope"}},
        "model.path",
        "unknown builtin model 'nope'",
    ),
    (
        "tokenizer missing",
        {"model": {"tokenizer": "/no/such/tok"}},
        "model.tokenizer",
        "'/no/such/tok' does not exist",
    ),
    ("train file missing", {"data": {"train": "/no/such.jsonl"}}, "data.train", "cannot read prompts"),
    ("eval file missing", {"data": {"eval": "/no/such.jsonl"}}, "data.eval", "cannot read prompts"),
    (
        "eval set file missing",
        {"eval": {"sets": {"hard": {"location": "/no/such.jsonl"}}}},
        "eval.sets.hard.location",
        "cannot read prompts",
    ),
    (
        "eval set of an unknown builtin task",
        {"eval": {"sets": {"odd": {"location": "builtin:nope"}}}},
        "eval.sets.odd.location",
        "unknown task 'nope'",
    ),
    ("unknown builtin task", {"data": {"train": "builtin:nope"}}, "data.train", "unknown task 'nope'"),
    (
        "a size out of bounds",
        {"rollout": {"max_new_tokens": 10**9}},
        "rollout.max_new_tokens",
        "less than or equal",
    ),
    ("an odd address", {"reward": {"address": "no port"}}, "reward.address", "should match pattern"),
]


@pytest.mark.parametrize(("case", "spec", "field", "message"), BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
async def test_bad_spec_table(submit: Any, case: str, spec: dict[str, Any], field: str, message: str) -> None:
    problems = fields(await submit(spec))
    assert field in problems, problems
    assert message in problems[field]


async def test_an_unreachable_reward_address_is_a_422(submit: Any) -> None:
    problems = fields(await submit({"reward": {"address": f"127.0.0.1:{closed_port()}"}}))
    assert "is unreachable: UNAVAILABLE" in problems["reward.address"]


async def test_the_named_reward_service_is_the_one_asked(submit: Any, reward_address: str) -> None:
    assert (
        await submit({"reward": {"address": reward_address, "verifier": "exact_match"}})
    ).status_code == 201
    problems = fields(await submit({"reward": {"address": reward_address, "verifier": "nope"}}))
    assert "unknown verifier 'nope'" in problems["reward.verifier"]


async def test_every_prompt_too_long_is_a_422(submit: Any, tmp_path: Path, model_dir: Path) -> None:
    train = write_jsonl(tmp_path / "long.jsonl", ["x" * 50, "y" * 60])
    spec = {
        "model": {"path": str(model_dir)},
        "data": {"train": train, "eval": None, "max_prompt_tokens": 20},
    }
    problems = fields(await submit(spec))
    assert problems["data.max_prompt_tokens"].startswith(
        "every one of the first 2 training prompts is longer"
    )
    some_fit = write_jsonl(tmp_path / "mixed.jsonl", ["x" * 50, "short"])
    assert (await submit({**spec, "data": {**spec["data"], "train": some_fit}})).status_code == 201


async def test_a_good_spec_with_local_files_is_queued(submit: Any, tmp_path: Path, model_dir: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", ["1+1=", "2+2="])
    spec = {"model": {"path": str(model_dir)}, "data": {"train": train, "eval": train}}
    reply = await submit(spec)
    assert reply.status_code == 201, reply.text


async def test_paths_are_confined_to_their_roots(submit: Any, tmp_path: Path, model_dir: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    train = write_jsonl(root / "train.jsonl", ["1+1="])
    (root / "escape").symlink_to(model_dir)
    roots = {
        "VERST_DATA_ROOTS": f"{root}{os.pathsep}/nonexistent",
        "VERST_CHECKPOINT_ROOT": str(tmp_path / "ck"),
    }
    inside = {
        "data": {"train": train, "eval": None},
        "trainer": {"checkpoint_dir": str(tmp_path / "ck" / "a")},
    }
    assert (await submit(inside, **roots)).status_code == 201, "builtin model, files inside the roots"
    for field, spec in [
        ("model.path", {"model": {"path": str(model_dir)}}),
        ("model.path", {"model": {"path": str(root / "escape")}}),  # a symlink out of the root
        ("model.tokenizer", {"model": {"tokenizer": f"{root}/../model"}}),
        ("data.eval", {"data": {"train": train, "eval": "/etc/passwd"}}),
        (
            "eval.sets.x.location",
            {"data": {"train": train}, "eval": {"sets": {"x": {"location": "/etc/passwd"}}}},
        ),
        ("trainer.checkpoint_dir", {"trainer": {"checkpoint_dir": str(tmp_path / "ck" / ".." / "x")}}),
        ("trainer.checkpoint_dir", {"trainer": {"checkpoint_dir": "/tmp"}}),
    ]:
        problems = fields(await submit(spec, **roots))
        assert "must lie in VERST_" in problems[field], (field, spec, problems)
    unset = await submit({"model": {"path": str(model_dir)}, "data": {"train": train, "eval": None}})
    assert unset.status_code == 201, "no roots: any readable path"


async def test_checks_off_accepts_what_only_the_world_refuses(submit: Any) -> None:
    assert (await submit({"reward": {"verifier": "nope"}}, check_specs=False)).status_code == 201


async def test_a_user_source_is_confined_by_its_traits(submit: Any, tmp_path: Path) -> None:
    """``reads_path`` (examples/plugins/data_source.py's tsv_rows) confines and checks the location;
    a source without it (arithmetic) names no path; one that cannot be imported is a 422 at once."""
    root = tmp_path / "data"
    root.mkdir()
    inside, outside = root / "qa.tsv", tmp_path / "qa.tsv"
    for path in (inside, outside):
        path.write_text("prompt\tanswer\n1+1=\t2\n")
    roots = {"VERST_DATA_ROOTS": str(root)}
    tsv = {"source": "examples.plugins.data_source:tsv_rows", "eval": None}
    assert (await submit({"data": {**tsv, "train": str(inside)}}, **roots)).status_code == 201
    problems = fields(await submit({"data": {**tsv, "train": str(outside)}}, **roots))
    assert "must lie in VERST_DATA_ROOTS" in problems["data.train"]
    problems = fields(await submit({"data": {**tsv, "train": str(root / "gone.tsv")}}, **roots))
    assert "no such file or directory" in problems["data.train"]
    arithmetic = {"source": "examples.plugins.data_source:arithmetic", "train": "add", "eval": "add"}
    assert (await submit({"data": arithmetic}, **roots)).status_code == 201, "no path to confine"
    problems = fields(await submit({"data": {"source": "tests.no_such:rows", "train": "x"}}, **roots))
    assert "cannot import" in problems["data.source"]


async def test_a_hub_id_in_the_local_cache_is_read_offline(
    submit: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub id resolves to its snapshot in the local Hugging Face cache, whose tokenizer checks the
    prompts; it passes the roots' confinement (nothing outside the cache is read for it)."""
    repo = tmp_path / "hub" / f"models--{REPO.replace('/', '--')}"
    save_tiny_model(repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    root = tmp_path / "data"
    root.mkdir()
    long = write_jsonl(root / "long.jsonl", ["x" * 50, "y" * 60])
    spec = {"model": {"path": REPO}, "data": {"train": long, "eval": None, "max_prompt_tokens": 20}}
    problems = fields(await submit(spec, VERST_DATA_ROOTS=str(root)))
    assert list(problems) == ["data.max_prompt_tokens"], problems  # read with the cached tokenizer
    short = write_jsonl(root / "short.jsonl", ["1+1="])
    reply = await submit({**spec, "data": {**spec["data"], "train": short}}, VERST_DATA_ROOTS=str(root))
    assert reply.status_code == 201, reply.text


async def test_a_lora_init_from_must_be_a_saved_adapter_inside_the_roots(
    submit: Any, tmp_path: Path, model_dir: Path
) -> None:
    root = tmp_path / "data"
    saved = root / "adapter"
    saved.mkdir(parents=True)
    (saved / "adapter_config.json").write_text("{}")
    spec = {"model": {"path": str(model_dir), "lora": {"init_from": str(saved)}}}
    missing = fields(await submit(spec))
    assert "holds no readable adapter_model.safetensors" in missing["model.lora.init_from"]
    (saved / "adapter_model.safetensors").write_bytes(b"")
    assert (await submit(spec)).status_code == 201, "the trainer checks its rank and targets"
    outside = fields(await submit(spec, VERST_DATA_ROOTS=str(tmp_path / "elsewhere")))
    assert "must lie in VERST_DATA_ROOTS" in outside["model.lora.init_from"]


async def test_a_tracker_whose_package_is_not_installed_is_a_422(
    submit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.common.tracking_config import MlflowTracker

    spec = {"tracking": {"trackers": [{"type": "tensorboard"}, {"type": "mlflow"}]}}
    monkeypatch.setattr(MlflowTracker, "package", "verst_no_such_package")
    problems = fields(await submit(spec))
    assert list(problems) == ["tracking.trackers.1.type"]
    assert (
        "mlflow is chosen but its package 'verst_no_such_package' is not installed"
        in problems["tracking.trackers.1.type"]
    )
