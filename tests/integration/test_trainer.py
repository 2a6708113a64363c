"""The trainer: the DeepSpeed policy, and whole jobs through a real Redis (v0, steps, acks after
checkpoints, idempotency, staleness, metrics, status, resume, failures, the Trainer gRPC service).
The collector, the checkpoint store and the schedule are in tests/unit/test_trainer_parts.py."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import random
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from redis.exceptions import ResponseError
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.bus import Bus
from services.common.config import parse_job_spec
from services.common.jobs import CANCELLED, SUCCEEDED, JobStore
from services.common.pb import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.streams import JOBS, JobStreams
from services.tasks.addition_model import build_char_tokenizer
from services.trainer.batching import TrainSample
from services.trainer.checkpoints import CheckpointStore
from services.trainer.config import TrainerSettings
from services.trainer.job import JOB_GROUP, TRAJECTORY_GROUP
from services.trainer.policy import Policy, init_distributed
from services.trainer.server import registrar
from services.trainer.threads import job_threads
from services.trainer.worker import TrainerWorker
from tests.helpers import eventually, lineage_trained_ids, metrics_of, serve, step_metrics, stream_messages
from tests.integration.rollout_helpers import tiny_llama

FAST_SETTINGS: dict[str, Any] = {
    "port": 0,
    "poll_block_ms": 50,
    "keepalive_s": 0.5,
    "job_reclaim_idle_ms": 5000,
    "trajectory_reclaim_idle_ms": 5000,
}
CPU = torch.device("cpu")
DEADLINE_S = 180.0
"""A trainer process imports DeepSpeed before its first checkpoint: a minute or more on a busy 2-core host."""


# -- a tiny model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (hidden 32) with a 99-token character vocabulary."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_char_tokenizer()
    tiny_llama(0, heads=2, max_positions=64, vocab=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def encode(text: str) -> list[int]:
    return [1, *build_char_tokenizer()(text, add_special_tokens=False).input_ids]


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir).float().eval()


def response_logprobs(model_dir: Path, prompt: list[int], response: list[int]) -> list[float]:
    """log p of each response token under the weights in ``model_dir``, computed with plain HF."""
    model = hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + j, token]) for j, token in enumerate(response)]


def job_spec(model_dir: Path, runs: Path, **trainer: Any) -> dict[str, Any]:
    return {
        "name": "tiny",
        "model": {"path": str(model_dir)},
        "algorithm": {"group_size": 2, "max_staleness": 0},
        "rollout": {"prompts_per_step": 2, "max_new_tokens": 8},
        "trainer": {
            "steps": 2,
            "learning_rate": 1e-3,
            "micro_batch_tokens": 32,  # several micro-batches per step
            "checkpoint_dir": str(runs),
            "keep_checkpoints": 1,
            **trainer,
        },
    }


# -- the policy (DeepSpeed, no Redis) --------------------------------------------------------


def fixed_batch(model_dir: Path) -> list[TrainSample]:
    rng = random.Random(0)
    samples = []
    for i in range(6):
        prompt = encode(f"{10 + i}+{20 + i}=")
        response = [rng.randint(4, 98) for _ in range(rng.randint(2, 6))] + [2]
        behaviour = response_logprobs(model_dir, prompt, response)
        samples.append(TrainSample(prompt, response, [True] * len(response), behaviour, 1.0 - 2 * (i % 2)))
    return samples


def load_policy(model_dir: Path, **trainer: Any) -> Policy:
    init_distributed(CPU)
    spec = parse_job_spec(job_spec(model_dir, Path("unused"), **trainer))
    return Policy.load(spec, model_dir, model_dir, CPU)


def test_policy_learns_on_a_fixed_batch(model_dir: Path) -> None:
    samples = fixed_batch(model_dir)
    policy = load_policy(model_dir, learning_rate=3e-3, micro_batch_tokens=24)
    try:
        before = policy.response_logprobs(samples)
        for got, behaviour in zip(before, samples, strict=True):
            assert got == pytest.approx(behaviour.behaviour_logprobs, abs=1e-5)
        losses = [policy.optimise(samples, seed=step).loss for step in range(4)]
        after = policy.response_logprobs(samples)
    finally:
        policy.close()
    assert losses[-1] < losses[0]
    for sample, old, new in zip(samples, before, after, strict=True):
        change = sum(new) - sum(old)
        assert change > 0 if sample.advantage > 0 else change < 0


def test_packing_into_micro_batches_does_not_change_the_step(model_dir: Path) -> None:
    samples = fixed_batch(model_dir)
    results = []
    for budget in (10_000, 16):
        policy = load_policy(model_dir, micro_batch_tokens=budget)
        try:
            stats = policy.optimise(samples, seed=0)
            results.append((stats, policy.response_logprobs(samples)))
        finally:
            policy.close()
    (whole, whole_logprobs), (packed, packed_logprobs) = results
    assert whole.loss == pytest.approx(packed.loss, abs=1e-6)
    assert whole.grad_norm == pytest.approx(packed.grad_norm, rel=1e-5)
    assert whole.grad_norm > 0
    for a, b in zip(whole_logprobs, packed_logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


# -- whole jobs through Redis --------------------------------------------------------------


async def checkpoint(bus: Bus, job_id: str, version: int) -> common_pb2.CheckpointHandle:
    async def newest() -> common_pb2.CheckpointHandle | None:
        handle = await bus.latest(JobStreams(job_id).checkpoints, common_pb2.CheckpointHandle)
        return handle if handle is not None and handle.version >= version else None

    return await eventually(newest, f"checkpoint v{version} of {job_id}", timeout_s=DEADLINE_S)


async def final_status(bus: Bus, job_id: str, nth: int = 1) -> common_pb2.JobStatus:
    """The job's ``nth`` status report, once it is there."""

    async def status() -> common_pb2.JobStatus | None:
        found = await stream_messages(bus, JobStreams(job_id).status, common_pb2.JobStatus)
        return found[nth - 1] if len(found) >= nth else None

    return await eventually(status, f"status of {job_id}", timeout_s=DEADLINE_S)


async def submit(bus: Bus, job_id: str, spec: dict[str, Any] | str) -> None:
    spec_json = spec if isinstance(spec, str) else json.dumps(spec)
    await bus.publish(JOBS, common_pb2.JobSubmission(job_id=job_id, spec_json=spec_json))


@contextlib.asynccontextmanager
async def trainer(
    bus: Bus, **overrides: Any
) -> AsyncIterator[tuple[TrainerWorker, trainer_pb2_grpc.TrainerStub]]:
    """A trainer worker in this process, with its gRPC service on a free port."""
    settings = TrainerSettings(**(FAST_SETTINGS | overrides))
    worker = TrainerWorker(bus, settings, CPU)
    server, address = await serve(registrar(worker))
    shutdown = asyncio.Event()
    task = asyncio.create_task(worker.run(shutdown))
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield worker, trainer_pb2_grpc.TrainerStub(channel)
    finally:
        shutdown.set()
        await asyncio.wait_for(task, timeout=30)
        await server.stop(0)


def make_group(
    job_id: str, group: str, rewards: tuple[float, float], version: int, model: Path
) -> list[common_pb2.Trajectory]:
    """Two samples of one prompt, with behaviour logprobs from the weights in ``model``."""
    prompt = encode(f"{group}=")
    result = []
    for index, reward in enumerate(rewards):
        response = [*encode(f"{index}{group[-1]}")[1:], 2]
        result.append(
            common_pb2.Trajectory(
                id=f"{group}:{index}",
                job_id=job_id,
                prompt_id=group,
                group_id=group,
                sample_index=index,
                group_size=2,
                prompt_token_ids=prompt,
                response_token_ids=response,
                behaviour_logprobs=response_logprobs(model, prompt, response),
                loss_mask=[True] * len(response),
                policy_versions=[version] * len(response),
                reward=reward,
                finish_reason=common_pb2.FINISH_REASON_STOP,
                num_turns=1,
                split=common_pb2.SPLIT_TRAIN,
            )
        )
    return result


async def acked_only_after(bus: Bus, stream: str, directory: Path) -> None:
    """Watch the trainer's pending entries: once taken (pending) and then acked, the
    checkpoint directory must already exist."""
    taken = False
    while True:
        try:
            pending = await bus.pending_count(stream, TRAJECTORY_GROUP)
        except ResponseError:  # the trainer has not created its group yet
            pending = 0
        if pending:
            taken = True
        elif taken:
            assert directory.is_dir(), "trajectories were acked before their checkpoint existed"
            return
        await asyncio.sleep(0.005)


def assert_hf_checkpoint(handle: common_pb2.CheckpointHandle, job_id: str, version: int) -> Path:
    directory = Path(handle.uri.removeprefix("file://"))
    assert handle.uri.startswith("file:///") and directory.is_absolute()
    assert (handle.job_id, handle.version, handle.step) == (job_id, version, version)
    assert handle.format == "safetensors"
    weights = (directory / "model.safetensors").read_bytes()
    assert handle.sha256 == hashlib.sha256(weights).hexdigest()
    assert handle.size_bytes == len(weights)
    assert handle.created_at.seconds > 0
    AutoTokenizer.from_pretrained(directory)
    return directory


def same_weights(a: Path, b: Path) -> bool:
    left, right = (AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (a, b))
    return all(torch.equal(left[k], right[k]) for k in left)


async def trainer_signals(bus: Bus, job_id: str) -> list[common_pb2.TrainerSignal]:
    """The trainer's signals to the controller (groups it dropped), oldest first."""
    return await stream_messages(bus, JobStreams(job_id).control, common_pb2.TrainerSignal)


async def submission_acked(bus: Bus) -> bool:
    """Whether no job submission is left pending in the trainers' group."""
    return await bus.pending_count(JOBS, JOB_GROUP) == 0


async def test_a_job_trains_checkpoints_acks_and_resumes(bus: Bus, model_dir: Path, tmp_path: Path) -> None:
    job_id, runs = "tiny-0001", tmp_path / "runs"
    streams = JobStreams(job_id)
    spec = job_spec(model_dir, runs, checkpoint_every_steps=1, keep_checkpoints=2)
    async with trainer(bus) as (worker, stub):
        await submit(bus, job_id, spec)
        v0 = assert_hf_checkpoint(await checkpoint(bus, job_id, 0), job_id, 0)
        assert same_weights(v0, model_dir)

        # Step 1: two groups sampled by v0, one trajectory delivered twice.
        step1 = make_group(job_id, "g0", (1.0, 0.0), 0, v0) + make_group(job_id, "g1", (0.0, 1.0), 0, v0)
        watcher = asyncio.create_task(acked_only_after(bus, streams.trajectories, runs / job_id / "v000001"))
        await bus.publish_many(streams.trajectories, [step1[0], *step1])
        v1 = assert_hf_checkpoint(await checkpoint(bus, job_id, 1), job_id, 1)
        await asyncio.wait_for(watcher, DEADLINE_S)
        assert not same_weights(v1, v0)
        status = await stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=10)
        assert (status.job_id, status.policy_version, status.last_checkpoint.version) == (job_id, 1, 1)
        assert worker.metrics.registry.get_sample_value("verst_trainer_policy_version") == 1
        saved = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(job_id=job_id), timeout=10)
        assert (saved.handle.version, saved.handle.durable) == (1, True)
        assert saved.handle.uri == (runs / job_id / "v000001").resolve().as_uri()
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(job_id="other"), timeout=10)
        assert wrong.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        # Step 2: a stale group (v0 < 1 - max_staleness), a re-sent trained id, two fresh groups.
        stale = make_group(job_id, "gs", (1.0, 0.0), 0, v0)
        fresh = make_group(job_id, "g2", (1.0, 0.0), 1, v1) + make_group(job_id, "g3", (0.0, 1.0), 1, v1)
        await bus.publish_many(streams.trajectories, [*stale, step1[1], *fresh])
        assert_hf_checkpoint(await checkpoint(bus, job_id, 2), job_id, 2)
        assert (await final_status(bus, job_id)).state == common_pb2.JOB_STATE_SUCCEEDED
        steps = worker.metrics.registry.get_sample_value
        assert steps("verst_trainer_steps_total") == 2
        assert steps("verst_trainer_step_stage_seconds_count", {"stage": "optimise"}) == 2
        # The trainer reports the job's end first and acks its submission right after.
        await eventually(lambda: submission_acked(bus), "the job's submission acked", timeout_s=DEADLINE_S)
        assert await bus.pending_count(streams.trajectories, TRAJECTORY_GROUP) == 0
        idle = await stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=10)
        assert idle.state == trainer_pb2.TRAINER_STATE_IDLE

        trained = {f"g{g}:{i}" for g in range(4) for i in range(2)}
        assert sorted(lineage_trained_ids(runs / job_id)) == sorted(trained)
        assert sorted(p.name for p in (runs / job_id).iterdir()) == ["v000001", "v000002", "weights"]
        metrics = await metrics_of(bus, job_id)
        assert sorted(metrics) == [1, 2]
        assert metrics[1]["clip_fraction"] == 0.0 and abs(metrics[1]["approx_kl"]) < 1e-6
        assert metrics[1]["reward_mean"] == 0.5 and metrics[1]["reward_std"] == 0.5
        assert metrics[1]["response_tokens"] == sum(len(t.response_token_ids) for t in step1)
        [dropped] = await trainer_signals(bus, job_id)  # reported at once, while still at version 1
        assert dropped.policy_version == 1 and dropped.groups_dropped == common_pb2.GroupsDropped(stale=1)
        assert metrics[2]["stale_groups_dropped"] == 1 and metrics[1]["stale_groups_dropped"] == 0
        assert metrics[1]["duplicates_skipped"] + metrics[2]["duplicates_skipped"] == 2
        assert all(m["grad_norm"] > 0 and m["tokens_per_s"] > 0 for m in metrics.values())
        first_threads = job_threads(worker.settings.torch_threads)  # steps 1-2 warm up on it
        assert [m["torch_threads"] for m in metrics.values()] == [float(first_threads)] * 2

        # The same job again with one more step: it resumes from v2 and trains nothing twice.
        await resume_for_one_more_step(bus, job_id, runs, model_dir, trained, resent=step1[2])


async def resume_for_one_more_step(
    bus: Bus, job_id: str, runs: Path, model_dir: Path, trained: set[str], resent: common_pb2.Trajectory
) -> None:
    streams = JobStreams(job_id)
    await submit(
        bus, job_id, job_spec(model_dir, runs, steps=3, checkpoint_every_steps=1, keep_checkpoints=2)
    )
    v2 = runs / job_id / "v000002"
    extra = make_group(job_id, "g4", (0.0, 1.0), 2, v2) + make_group(job_id, "g5", (1.0, 0.0), 2, v2)
    await bus.publish_many(streams.trajectories, [resent, *extra])
    assert_hf_checkpoint(await checkpoint(bus, job_id, 3), job_id, 3)
    status = await final_status(bus, job_id, nth=2)  # the last step's durable checkpoint comes first
    assert (status.state, status.policy_version) == (common_pb2.JOB_STATE_SUCCEEDED, 3)
    assert CheckpointStore(runs, job_id, 1).load(3).consumed == {"g4:0", "g4:1", "g5:0", "g5:1"}
    assert (await metrics_of(bus, job_id))[3]["duplicates_skipped"] == 1
    handles = await stream_messages(bus, streams.checkpoints, common_pb2.CheckpointHandle)
    # The resume republished v2 as the first handle of a new epoch (its uri: the durable v2).
    assert [(h.epoch, h.version) for h in handles] == [(1, 0), (1, 1), (1, 2), (2, 2), (2, 3)]
    assert handles[3].sha256 == handles[2].sha256 and handles[3].uri == v2.resolve().as_uri()
    assert not any(h.durable for h in handles)


async def test_bad_jobs_fail_with_the_reason_and_the_trainer_carries_on(
    bus: Bus, model_dir: Path, tmp_path: Path
) -> None:
    bad_jobs = {
        "no-model": (job_spec(tmp_path / "missing", tmp_path), "does not exist"),
        "bad-spec": (json.dumps({"trainer": {"stepz": 3}}), "trainer.stepz"),
        "not-json": ("{", "invalid spec of job not-json:\n  (json): Expecting property name"),
        "own-optimiser": (
            job_spec(model_dir, tmp_path, deepspeed={"optimizer": {"type": "Adam"}}),
            "trainer.deepspeed may not set optimizer",
        ),
    }
    async with trainer(bus):
        for job_id, (spec, _) in bad_jobs.items():
            await submit(bus, job_id, spec)
        for job_id, (_, reason) in bad_jobs.items():
            status = await final_status(bus, job_id)
            assert status.state == common_pb2.JOB_STATE_FAILED
            assert reason in status.reason
    assert await bus.pending_count(JOBS, JOB_GROUP) == 0


async def test_stop_cancels_the_running_job(bus: Bus, model_dir: Path, tmp_path: Path) -> None:
    async with trainer(bus) as (_, stub):
        with pytest.raises(grpc.aio.AioRpcError) as idle:
            await stub.Stop(trainer_pb2.StopTrainerRequest(), timeout=10)
        assert idle.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        await submit(bus, "stopped", job_spec(model_dir, tmp_path, steps=5))
        v0 = Path((await checkpoint(bus, "stopped", 0)).uri.removeprefix("file://"))
        groups = [
            *make_group("stopped", "g0", (1.0, 0.0), 0, v0),
            *make_group("stopped", "g1", (0.0, 1.0), 0, v0),
        ]
        await bus.publish_many(JobStreams("stopped").trajectories, groups)
        v1 = await checkpoint(bus, "stopped", 1)  # weights only: the step's trajectories stay unacked
        assert not (tmp_path / "stopped" / "v000001").exists()
        step = await step_metrics(bus, "stopped", 1, DEADLINE_S)
        assert step["checkpoint_seconds"] == 0 and 0 < step["publish_seconds"] < step["step_seconds"]
        assert step["publish_write_seconds"] > 0, "written beside the next step, and timed"
        # The config and tokenizer files are linked from v0: the step wrote little but the weights.
        assert v1.size_bytes <= step["bytes_written"] < 1.05 * v1.size_bytes
        reply = await stub.Stop(trainer_pb2.StopTrainerRequest(reason="enough"), timeout=30)
        # The stop wrote a durable checkpoint of v1 and acked what it covers.
        assert (reply.last_checkpoint.version, reply.last_checkpoint.durable) == (1, True)
        assert CheckpointStore(tmp_path, "stopped", 1).load(1).consumed == {t.id for t in groups}
        status = await final_status(bus, "stopped")
        assert (status.state, status.reason) == (common_pb2.JOB_STATE_CANCELLED, "enough")
    assert await bus.pending_count(JOBS, JOB_GROUP) == 0
    assert await bus.pending_count(JobStreams("stopped").trajectories, TRAJECTORY_GROUP) == 0


async def test_a_killed_trainers_job_is_resumed_by_another(
    bus: Bus, redis_url: str, model_dir: Path, tmp_path: Path, python: str, python_env: dict[str, str]
) -> None:
    job_id, runs = "crash-0001", tmp_path / "runs"
    streams = JobStreams(job_id)
    env = {f"VERST_TRAINER_{name.upper()}": str(value) for name, value in FAST_SETTINGS.items()}
    victim = subprocess.Popen(
        [python, "-m", "services.trainer"],
        env={**python_env, **env, "REDIS_URL": redis_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        await submit(bus, job_id, job_spec(model_dir, runs))
        v0 = Path((await checkpoint(bus, job_id, 0)).uri.removeprefix("file://"))
        await bus.publish_many(
            streams.trajectories,
            make_group(job_id, "g0", (1.0, 0.0), 0, v0) + make_group(job_id, "g1", (0.0, 1.0), 0, v0),
        )
        v1 = Path((await checkpoint(bus, job_id, 1)).uri.removeprefix("file://"))
        # Half of step 2 arrives; the victim holds it unacked when it dies.
        await bus.publish_many(streams.trajectories, make_group(job_id, "g2", (1.0, 0.0), 1, v1))
        await eventually(
            lambda: bus.pending_count(streams.trajectories, TRAJECTORY_GROUP),
            "g2 taken",
            timeout_s=DEADLINE_S,
        )
    finally:
        victim.kill()
        output, _ = victim.communicate(timeout=30)
    assert "published checkpoint v1" in output, output
    assert not (runs / job_id / "v000001").exists()  # weights only: g0 and g1 stay unacked

    async with trainer(bus, keepalive_s=0.3, job_reclaim_idle_ms=1000, trajectory_reclaim_idle_ms=1000):
        # No durable checkpoint survived the kill: the job begins again from the base model as
        # epoch 2, and g2, sampled by the lost epoch's v1, is dropped; g0 and g1 are trained again.
        async def epoch_2_v1() -> common_pb2.CheckpointHandle | None:
            handle = await bus.latest(streams.checkpoints, common_pb2.CheckpointHandle)
            return handle if handle is not None and (handle.epoch, handle.version) == (2, 1) else None

        handle = await eventually(epoch_2_v1, "epoch 2's v1", timeout_s=DEADLINE_S)
        await eventually(lambda: trainer_signals(bus, job_id), "g2 dropped", timeout_s=DEADLINE_S)
        v1 = Path(handle.uri.removeprefix("file://"))
        fresh = make_group(job_id, "g3", (0.0, 1.0), 1, v1) + make_group(job_id, "g4", (1.0, 0.0), 1, v1)
        await bus.publish_many(streams.trajectories, fresh)
        assert (await final_status(bus, job_id)).state == common_pb2.JOB_STATE_SUCCEEDED
    trained = sorted(f"g{g}:{i}" for g in (0, 1, 3, 4) for i in range(2))
    assert sorted(lineage_trained_ids(runs / job_id)) == trained
    assert [s.groups_dropped.stale for s in await trainer_signals(bus, job_id)] == [1]
    handles = await stream_messages(bus, streams.checkpoints, common_pb2.CheckpointHandle)
    assert [(h.epoch, h.version) for h in handles] == [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    assert await bus.pending_count(streams.trajectories, TRAJECTORY_GROUP) == 0
    assert await bus.pending_count(JOBS, JOB_GROUP) == 0


async def test_jobs_over_in_the_job_store_are_left_alone(bus: Bus, model_dir: Path, tmp_path: Path) -> None:
    store = JobStore(bus.redis)
    spec = parse_job_spec(job_spec(model_dir, tmp_path))
    done = (await store.create(spec)).job_id  # submitted on verst:jobs, like every job
    await store.set_state(done, SUCCEEDED)
    async with trainer(bus) as (_, stub):
        live = (await store.create(spec)).job_id
        await checkpoint(bus, live, 0)  # "done" was skipped: "live" is trained
        await store.set_state(live, CANCELLED, "user")  # the api cancels it
        await eventually(lambda: idle(stub), "the trainer lets the cancelled job go", timeout_s=DEADLINE_S)
    assert await bus.pending_count(JOBS, JOB_GROUP) == 0
    for job_id in (done, live):
        assert await stream_messages(bus, JobStreams(job_id).status, common_pb2.JobStatus) == []
    assert await bus.latest(JobStreams(done).checkpoints, common_pb2.CheckpointHandle) is None


async def test_a_trainer_whose_job_was_taken_over_lets_it_go(
    bus: Bus, model_dir: Path, tmp_path: Path
) -> None:
    async with trainer(bus) as (worker, stub):
        await submit(bus, "taken", job_spec(model_dir, tmp_path))
        await checkpoint(bus, "taken", 0)
        [row] = await bus.redis.xpending_range(JOBS, JOB_GROUP, "-", "+", 10)
        assert row["consumer"].decode() == worker.name
        await bus.redis.xclaim(JOBS, JOB_GROUP, "other-trainer", 0, [row["message_id"]], justid=True)
        await eventually(lambda: idle(stub), "the trainer lets the job go", timeout_s=DEADLINE_S)
        [row] = await bus.redis.xpending_range(JOBS, JOB_GROUP, "-", "+", 10)
        assert row["consumer"] == b"other-trainer"  # still pending, for its new owner
    assert await stream_messages(bus, JobStreams("taken").status, common_pb2.JobStatus) == []


async def idle(stub: trainer_pb2_grpc.TrainerStub) -> bool:
    status = await stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=10)
    return status.state == trainer_pb2.TRAINER_STATE_IDLE and not status.job_id
