"""A tiny job in bfloat16 on the CPU whose model.path is a hub id found in a local Hugging Face cache
(offline): the trainer resolves and trains it in bfloat16 and publishes bfloat16 weights, and an
engine with VERST_ENGINE_DTYPE=auto (the default) serves them in bfloat16, its samples the next
step's trajectories."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from safetensors import safe_open

from services.common.bus import Bus
from services.common.pb import common_pb2, rollout_pb2
from services.common.streams import JobStreams
from services.rollout.config import EngineSettings
from services.rollout.torch.backend import open_torch_engine
from services.rollout.torch.engine import TorchEngine
from services.tasks.addition_model import build_char_tokenizer
from tests.helpers import metrics_of
from tests.integration.rollout_helpers import tiny_llama
from tests.integration.test_continuous_batching import sampling
from tests.integration.test_continuous_batching import submit as submit_request
from tests.integration.test_trainer import checkpoint, encode, final_status, submit, trainer

REPO = "verst-tests/tiny-llama-bf16"
REVISION = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny Llama as REPO in a Hugging Face cache laid out as huggingface_hub lays it out."""
    repo = tmp_path / "hub" / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    tokenizer = build_char_tokenizer()
    tiny_llama(0, heads=2, max_positions=64, vocab=len(tokenizer)).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return snapshot


def weight_dtypes(directory: Path) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as weights:
        return {weights.get_slice(name).get_dtype() for name in weights.keys()}  # noqa: SIM118


async def serve(engine: TorchEngine, handle: common_pb2.CheckpointHandle) -> None:
    await engine.load_weights(
        Path(handle.uri.removeprefix("file://")), sha256=handle.sha256, version=handle.version,
        job_id=handle.job_id, mode=rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE, timeout_s=30,
    )  # fmt: skip


async def sampled_groups(engine: TorchEngine, job_id: str, version: int) -> list[common_pb2.Trajectory]:
    """Two groups of two samples from the engine, rewarded +1 for the first sample, 0 for the other."""
    trajectories = []
    for group in (f"{10 + version}+2", f"{30 + version}+4"):
        prompt = encode(f"{group}=")
        config = sampling(n=2, temperature=1.0, max_new_tokens=6, seed=version, ignore_eos=True)
        result = submit_request(engine, f"{job_id}-{group}", prompt, config)
        assert await asyncio.to_thread(result.done.wait, 30)
        for completion in result.completions:
            trajectories.append(
                common_pb2.Trajectory(
                    id=f"{group}:{completion.index}", job_id=job_id, prompt_id=group, group_id=group,
                    sample_index=completion.index, group_size=2, prompt_token_ids=prompt,
                    response_token_ids=completion.token_ids, behaviour_logprobs=completion.logprobs,
                    loss_mask=[True] * len(completion.token_ids), policy_versions=completion.policy_versions,
                    reward=1.0 - completion.index, finish_reason=common_pb2.FINISH_REASON_LENGTH,
                    num_turns=1, split=common_pb2.SPLIT_TRAIN,
                )
            )  # fmt: skip
    return trajectories


async def test_a_bfloat16_job_from_a_hub_id_trains_and_is_served_in_bfloat16(
    bus: Bus, hub_cache: Path, tmp_path: Path
) -> None:
    job_id, streams = "bf16-0001", JobStreams("bf16-0001")
    spec = {
        "name": "bf16",
        "model": {"path": REPO, "dtype": "bfloat16"},
        "algorithm": {"group_size": 2, "max_staleness": 0},
        "rollout": {"prompts_per_step": 2, "max_new_tokens": 6},
        "trainer": {"steps": 2, "learning_rate": 1e-2, "checkpoint_dir": str(tmp_path / "runs")},
    }
    engine = await open_torch_engine(EngineSettings(max_batch_size=8, batch_wait_ms=0))
    assert engine.dtype is None  # auto: each checkpoint's own
    try:
        async with trainer(bus):
            await submit(bus, job_id, spec)
            handles = [await checkpoint(bus, job_id, 0)]
            for version in (0, 1):
                await serve(engine, handles[-1])
                assert engine._loaded is not None and engine._loaded.model.dtype == torch.bfloat16
                await bus.publish_many(streams.trajectories, await sampled_groups(engine, job_id, version))
                handles.append(await checkpoint(bus, job_id, version + 1))
            status = await final_status(bus, job_id)
    finally:
        await engine.close()
    assert status.state == common_pb2.JOB_STATE_SUCCEEDED, status
    directories = [Path(h.uri.removeprefix("file://")) for h in handles]
    assert [h.dtype for h in handles] == ["bfloat16"] * 3
    for directory in directories:
        assert weight_dtypes(directory) == {"BF16"}
        assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    metrics = await metrics_of(bus, job_id)
    assert all(metrics[step]["grad_norm"] > 0 for step in (1, 2)), metrics
    assert metrics[1]["mismatch_kl"] < 1e-3  # bfloat16 on both sides: the engine's logprobs are the trainer's
    assert handles[0].sha256 != handles[2].sha256  # it trained
