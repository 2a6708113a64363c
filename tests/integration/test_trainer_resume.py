"""Exactly-once training across a crash: a real trainer process is SIGKILLed while it trains
step k+1 (after durable checkpoint k), a new one takes the job over as a new epoch and finishes
it. The versions continue, every acked trajectory is trained into exactly one version, and the
optimiser state comes back from the checkpoint instead of starting afresh."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from services.common.bus import Bus
from services.common.pb import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.redis_server import free_port
from services.common.streams import JOBS, JobStreams
from services.tasks.addition_model import build_char_tokenizer
from services.trainer.checkpoints import MANIFEST_FILE, TRAINING_STATE_DIR
from services.trainer.job import JOB_GROUP, TRAJECTORY_GROUP
from tests.helpers import eventually, lineage_trained_ids, stream_messages
from tests.integration.rollout_helpers import tiny_llama

DEADLINE_S = 120.0
"""A trainer subprocess imports DeepSpeed before its first checkpoint: a minute on a busy 2-core host."""
STARTUP_DEADLINE_S = 180.0
"""For a trainer's first checkpoint: several ranks importing DeepSpeed and meeting over gloo take
well over DEADLINE_S on a slow 2-core host."""
TOKENIZER = build_char_tokenizer()


# -- helpers (test_trainer_distributed.py uses them too) ----------------------------------


def trainer_env(redis_url: str, **settings: Any) -> dict[str, str]:
    """Environment of a `python -m services.trainer` that notices a dead peer within seconds."""
    fast = {
        "port": 0,
        "poll_block_ms": 50,
        "keepalive_s": 0.3,
        "job_reclaim_idle_ms": 1000,
        "trajectory_reclaim_idle_ms": 1000,
        "torch_threads": 1,
    }
    env = {f"VERST_TRAINER_{name.upper()}": str(value) for name, value in (fast | settings).items()}
    return env | {"REDIS_URL": redis_url}


async def submit(bus: Bus, job_id: str, model_dir: Path, runs: Path, **trainer: Any) -> None:
    prompts_per_step = trainer.pop("prompts_per_step", 2)
    spec = {
        "name": "resume",
        "model": {"path": str(model_dir)},
        "algorithm": {"group_size": 2, "max_staleness": 10},
        "rollout": {"prompts_per_step": prompts_per_step, "max_new_tokens": 8},
        "trainer": {
            "learning_rate": 1e-3,
            "micro_batch_tokens": 16,
            "checkpoint_dir": str(runs),
            "keep_checkpoints": 10,
            **trainer,
        },
    }
    await bus.publish(JOBS, common_pb2.JobSubmission(job_id=job_id, spec_json=json.dumps(spec)))


def group(job_id: str, group_id: str, version: int) -> list[common_pb2.Trajectory]:
    """Two samples of one prompt with different rewards (the trainer computes its own old logprobs)."""
    prompt = [1, *TOKENIZER(f"{group_id}=", add_special_tokens=False).input_ids]
    members = []
    for index in range(2):
        response = [*TOKENIZER(f"{index}{group_id}", add_special_tokens=False).input_ids, 2]
        members.append(
            common_pb2.Trajectory(
                id=f"{group_id}:{index}",
                job_id=job_id,
                prompt_id=group_id,
                group_id=group_id,
                sample_index=index,
                group_size=2,
                prompt_token_ids=prompt,
                response_token_ids=response,
                behaviour_logprobs=[-2.0] * len(response),
                loss_mask=[True] * len(response),
                policy_versions=[version] * len(response),
                reward=float(index),
                finish_reason=common_pb2.FINISH_REASON_STOP,
                num_turns=1,
                split=common_pb2.SPLIT_TRAIN,
            )
        )
    return members


async def wait_for_checkpoint(
    bus: Bus, job_id: str, version: int, timeout_s: float = DEADLINE_S
) -> common_pb2.CheckpointHandle:
    async def newest() -> common_pb2.CheckpointHandle | None:
        handle = await bus.latest(JobStreams(job_id).checkpoints, common_pb2.CheckpointHandle)
        return handle if handle is not None and handle.version >= version else None

    return await eventually(newest, f"checkpoint v{version} of {job_id}", timeout_s=timeout_s)


async def wait_for_status(bus: Bus, job_id: str, nth: int = 1) -> common_pb2.JobStatus:
    """The job's ``nth`` status report, once it is there."""

    async def status() -> common_pb2.JobStatus | None:
        found = await stream_messages(bus, JobStreams(job_id).status, common_pb2.JobStatus)
        return found[nth - 1] if len(found) >= nth else None

    return await eventually(status, f"the status of {job_id}", timeout_s=DEADLINE_S)


def checkpoint_ids(directory: Path) -> set[str]:
    """The ids a durable checkpoint's manifest says were trained since the previous one."""
    return set(json.loads((directory / MANIFEST_FILE).read_text())["ids"])


def optimizer_steps(directory: Path) -> int:
    """AdamW's step count in a checkpoint's DeepSpeed state (ZeRO 0: in the model states file;
    1-2: ``base_optimizer_state``; 3: a nested ``optimizer_state_dict``), the same for every tensor."""
    state = directory / TRAINING_STATE_DIR
    files = sorted(state.rglob("*optim_states.pt")) or sorted(state.rglob("mp_rank_00_model_states.pt"))
    saved = torch.load(files[0], map_location="cpu", weights_only=False)
    found = saved.get("optimizer_state_dict") or saved["optimizer"]
    found = found.get("base_optimizer_state") or found.get("optimizer_state_dict") or found
    steps = {int(entry["step"]) for entry in found["state"].values()}
    assert len(steps) == 1 and all(
        float(entry["exp_avg"].abs().sum()) > 0 for entry in found["state"].values()
    )
    return steps.pop()


def start_trainer(python: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [python, "-m", "services.trainer"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


# -- the crash ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(0, heads=2, max_positions=64, vocab=len(TOKENIZER)).save_pretrained(directory)
    TOKENIZER.save_pretrained(directory)
    return directory


async def training(port: int, version: int) -> bool:
    """Whether the trainer on ``port`` is optimising the step after ``version`` right now."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            status = await trainer_pb2_grpc.TrainerStub(channel).GetStatus(
                trainer_pb2.GetTrainerStatusRequest(), timeout=2
            )
        except grpc.aio.AioRpcError:
            return False  # still starting
    return status.state == trainer_pb2.TRAINER_STATE_TRAINING and status.policy_version == version


async def test_a_trainer_killed_mid_step_resumes_exactly_once(
    bus: Bus, redis_url: str, model_dir: Path, tmp_path: Path, python: str, python_env: dict[str, str]
) -> None:
    job_id, runs, port = "resume-0001", tmp_path / "runs", free_port()
    streams = JobStreams(job_id)
    env = python_env | trainer_env(redis_url, port=port)
    epochs = 12  # optimiser steps per version: long enough a step to be caught in the act
    victim = start_trainer(python, env)
    try:
        await submit(
            bus, job_id, model_dir, runs, steps=3, ppo_epochs=epochs, warmup_steps=5, checkpoint_every_steps=1
        )
        await wait_for_checkpoint(bus, job_id, 0)
        await bus.publish_many(streams.trajectories, group(job_id, "a", 0) + group(job_id, "b", 0))
        await wait_for_checkpoint(bus, job_id, 1)
        await bus.publish_many(streams.trajectories, group(job_id, "c", 1) + group(job_id, "d", 1))
        await eventually(lambda: training(port, 1), "the trainer in step 2", timeout_s=DEADLINE_S)
    finally:
        victim.kill()
        output, _ = victim.communicate(timeout=30)
    assert "published checkpoint v1" in output and "published checkpoint v2" not in output, output
    assert not (runs / job_id / "v000002").exists()
    assert await bus.pending_count(streams.trajectories, TRAJECTORY_GROUP) == 4  # c and d, unacked

    survivor = start_trainer(python, env)
    try:
        # A runner's retry re-sends a trained trajectory; then the last step's groups.
        resent = group(job_id, "a", 0)[:1]
        await bus.publish_many(streams.trajectories, resent + group(job_id, "e", 1) + group(job_id, "f", 1))
        status = await wait_for_status(bus, job_id)
    finally:
        survivor.send_signal(signal.SIGTERM)
        output, _ = survivor.communicate(timeout=30)
    assert (status.state, status.policy_version) == (common_pb2.JOB_STATE_SUCCEEDED, 3), output
    assert "resuming from its checkpoint v1" in output and "restored the optimiser" in output, output

    handles = await stream_messages(bus, streams.checkpoints, common_pb2.CheckpointHandle)
    # Continued from v1, republished as the first handle of epoch 2.
    assert [(h.epoch, h.version) for h in handles] == [(1, 0), (1, 1), (2, 1), (2, 2), (2, 3)]
    trained = [checkpoint_ids(runs / job_id / f"v{v:06d}") for v in (1, 2, 3)]
    assert trained[0] == {"a:0", "a:1", "b:0", "b:1"}
    assert all(len(ids) == 4 for ids in trained)  # each step trained 4 trajectories
    published = {f"{g}:{i}" for g in "abcdef" for i in (0, 1)}
    chain = lineage_trained_ids(runs / job_id)
    assert len(chain) == 12 and set(chain) == published  # 12 distinct ids: none twice, none lost
    assert await bus.pending_count(streams.trajectories, TRAJECTORY_GROUP) == 0  # all acked
    assert await bus.pending_count(JOBS, JOB_GROUP) == 0
    # The optimiser carried on: a fresh one after the crash would count `epochs` steps in v2.
    assert [optimizer_steps(runs / job_id / f"v{v:06d}") for v in (1, 2, 3)] == [
        epochs,
        2 * epochs,
        3 * epochs,
    ]
