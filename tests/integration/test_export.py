"""`verst export` and POST /v1/jobs/{id}/export: a full fine-tune's and a LoRA job's saved versions
as Hugging Face directories that transformers (or peft, for an unmerged adapter) loads, with the
tokenizer and chat template, answering greedily as the torch engine served that version."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.cli import main
from services.common.bus import Bus
from services.common.checkpoint_layout import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from services.common.config import parse_job_spec
from services.common.export import ExportError, export_version
from services.common.healthcheck import wait_until
from services.common.jobs import JobStore
from services.common.pb import common_pb2
from services.common.streams import JobStreams
from tests.integration.lora_helpers import CHAT_TEMPLATE, build_base, engine_greedy, hf_greedy, lora_spec
from tests.integration.rollout_helpers import start_engine
from tests.integration.test_services import start, stop
from tests.integration.test_trainer import checkpoint, final_status, job_spec, make_group, trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_base(tmp_path_factory.mktemp("tiny-llama"))


async def train(
    bus: Bus, spec: dict[str, Any], model_dir: Path
) -> tuple[str, list[common_pb2.CheckpointHandle]]:
    """A one-step job through the job store and a trainer (running): its id and its v0, v1 handles."""
    spec = spec | {"trainer": spec["trainer"] | {"steps": 1}}
    job_id = (await JobStore(bus.redis).create(parse_job_spec(spec))).job_id
    handles = [await checkpoint(bus, job_id, 0)]
    groups = make_group(job_id, "g0", (1.0, 0.0), 0, model_dir) + make_group(
        job_id, "g1", (0.0, 1.0), 0, model_dir
    )
    await bus.publish_many(JobStreams(job_id).trajectories, groups)
    handles.append(await checkpoint(bus, job_id, 1))
    assert (await final_status(bus, job_id)).state == common_pb2.JOB_STATE_SUCCEEDED
    return job_id, handles


def loads(directory: Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(directory).float().eval()
    assert AutoTokenizer.from_pretrained(directory).chat_template == CHAT_TEMPLATE
    return model


@pytest.mark.usefixtures("one_torch_thread")
async def test_exports_load_with_transformers_or_peft_and_answer_as_the_engine_did(
    bus: Bus, redis_url: str, model_dir: Path, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    async with trainer(bus):
        # A large step, so that one changes the random model's greedy answers.
        full_id, full = await train(bus, job_spec(model_dir, runs, learning_rate=0.1), model_dir)
        lora_id, lora = await train(bus, lora_spec(model_dir, runs, learning_rate=0.1), model_dir)
    engine = await start_engine(redis_url, engine_id="engine-export")
    try:
        served = {name: await engine_greedy(engine, handle) for name, handle in
                  [("full", full[1]), ("lora v1", lora[1]), ("lora v0", lora[0])]}  # fmt: skip
    finally:
        await engine.stop()
    base_answers = hf_greedy(loads(model_dir))
    assert served["full"] != base_answers and served["lora v1"] != base_answers, "training changed nothing"

    done = export_version(runs, full_id, tmp_path / "full")
    assert (done.kind, done.version, done.epoch) == ("full", 1, 1)
    assert hf_greedy(loads(done.directory)) == served["full"]
    with pytest.raises(ExportError, match="full fine-tune"):
        export_version(runs, full_id, tmp_path / "nothing", merge=False)

    merged = export_version(runs, lora_id, tmp_path / "merged")
    assert merged.kind == "merged" and not (merged.directory / ADAPTER_WEIGHTS_FILE).exists()
    assert hf_greedy(loads(merged.directory)) == served["lora v1"]

    adapter = export_version(runs, lora_id, tmp_path / "adapter", merge=False)
    assert adapter.kind == "adapter" and not (adapter.directory / "model.safetensors").exists()
    base = json.loads((adapter.directory / ADAPTER_CONFIG_FILE).read_text())["base_model_name_or_path"]
    assert Path(base) == adapter.base == (runs / lora_id / "base").resolve()
    assert AutoTokenizer.from_pretrained(adapter.directory).chat_template == CHAT_TEMPLATE
    unmerged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter.directory).eval()
    assert hf_greedy(unmerged) == served["lora v1"]

    first = export_version(runs, lora_id, tmp_path / "v0", version=0)
    assert hf_greedy(loads(first.directory)) == served["lora v0"] == base_answers
    with pytest.raises(LookupError, match=r"no saved v7 .*saved: v0 \(epoch 1, weights-only\), v1"):
        export_version(runs, lora_id, tmp_path / "v7", version=7)
    with pytest.raises(ExportError, match="not an empty directory"):
        export_version(runs, lora_id, tmp_path / "v0")


async def test_the_api_and_the_cli_export_a_saved_version(
    bus: Bus,
    redis_url: str,
    model_dir: Path,
    tmp_path: Path,
    python: str,
    python_env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = tmp_path / "root"
    runs = root / "runs"
    async with trainer(bus):
        job_id, _ = await train(bus, lora_spec(model_dir, runs), model_dir)
    env = python_env | {"VERST_API_CONTROLLER": "false", "VERST_CHECKPOINT_ROOT": str(root)}
    proc, port = start(python, env, ["services.api"], "VERST_API_PORT", redis_url)
    api = f"http://127.0.0.1:{port}"
    try:
        assert wait_until("http", f"{api}/healthz", deadline_s=30), "api did not come up"
        url = f"{api}/v1/jobs/{job_id}/export"
        async with httpx.AsyncClient(timeout=120) as client:
            for outside in (str(tmp_path / "outside"), "relative/dir", str(root)):
                refused = await client.post(url, json={"out_dir": outside})
                assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == [
                    "body",
                    "out_dir",
                ]
            made = await client.post(url, json={"out_dir": str(root / "exports" / "a"), "merge": False})
            assert made.status_code == 200, made.text
            assert made.json() | {"out_dir": ""} == {
                "job_id": job_id, "version": 1, "epoch": 1, "kind": "adapter", "out_dir": "",
                "base_dir": str((runs / job_id / "base").resolve()),
            }  # fmt: skip
            assert (root / "exports" / "a" / ADAPTER_WEIGHTS_FILE).is_file()
            again = await client.post(url, json={"out_dir": str(root / "exports" / "a")})
            assert again.status_code == 409 and "not an empty directory" in again.json()["detail"]
            missing = await client.post(url, json={"out_dir": str(root / "exports" / "b"), "version": 9})
            assert missing.status_code == 404 and "no saved v9" in missing.json()["detail"]
            nobody = await client.post(f"{api}/v1/jobs/nobody-1/export", json={"out_dir": str(root / "c")})
            assert nobody.status_code == 404

        # The command: here, with the job's spec from the api; by the api; from a directory alone.
        assert main(["export", job_id, str(tmp_path / "cli"), "--api", api]) == 0
        assert (
            "v1 (epoch 1)" in capsys.readouterr().out and (tmp_path / "cli" / "model.safetensors").is_file()
        )
        assert (
            main(["export", job_id, str(root / "exports" / "d"), "--adapter", "--on-api", "--api", api]) == 0
        )
        assert f"adapter in {root / 'exports' / 'd'}" in capsys.readouterr().out
    finally:
        stop(proc)
    args = ["export", job_id, str(tmp_path / "v0"), "--version", "0", "--checkpoint-dir", str(runs)]
    assert main(args) == 0 and "v0 (epoch 1)" in capsys.readouterr().out
    assert main([*args[:2], str(tmp_path / "v5"), "--version", "5", *args[5:]]) == 1
    assert "no saved v5" in capsys.readouterr().err
