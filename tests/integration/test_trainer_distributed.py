"""DeepSpeed from the JobSpec (ZeRO 0-3, the optimiser and schedule, the raw ``trainer.deepspeed``
dict and its errors), the optimiser state each checkpoint carries, and data parallel training
over several processes: two ranks under torchrun train exactly as one process does, and run
the trainer service together (rank 0 alone talks to Redis)."""

from __future__ import annotations

import json
import math
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from services.common.bus import Bus
from services.common.config import TrainerConfig, parse_job_spec
from services.common.pb import common_pb2
from services.common.redis_server import free_port
from services.common.streams import JOBS, JobStreams
from services.tasks.addition_model import build_char_tokenizer
from services.trainer import distributed
from services.trainer.batching import plan_micro_batches
from services.trainer.checkpoints import TRAINING_STATE_DIR, TRAINING_STATE_FILE
from services.trainer.job import JOB_GROUP, TRAJECTORY_GROUP
from services.trainer.policy import Policy, deepspeed_config, init_distributed, learning_rate_schedule
from tests.helpers import assert_trained_as_one_process, lineage_trained_ids, stream_messages
from tests.integration.distributed_policy import fixed_batch
from tests.integration.rollout_helpers import tiny_llama
from tests.integration.test_trainer_resume import (
    DEADLINE_S,
    STARTUP_DEADLINE_S,
    checkpoint_ids,
    group,
    optimizer_steps,
    submit,
    trainer_env,
    wait_for_checkpoint,
    wait_for_status,
)

CPU = torch.device("cpu")
SCRIPT = Path(__file__).with_name("distributed_policy.py")
RUN_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_char_tokenizer()
    tiny_llama(0, heads=2, max_positions=64, vocab=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def torchrun(python: str, ranks: int, *args: str) -> list[str]:
    return [
        python,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        f"--master_port={free_port()}",
        *args,
    ]


# -- the DeepSpeed config ----------------------------------------------------------------


def config(**trainer: Any) -> dict[str, Any]:
    return deepspeed_config(TrainerConfig(**trainer), "float32")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_zero_stage_and_clipping_come_from_the_trainer_section(stage: int) -> None:
    derived = config(zero_stage=stage, max_grad_norm=0.5)
    assert derived["zero_optimization"] == {"stage": stage}
    assert derived["gradient_clipping"] == 0.5
    assert (derived["bf16"], derived["fp16"]) == ({"enabled": False}, {"enabled": False})
    assert config(max_grad_norm=None)["gradient_clipping"] == 0.0


def test_the_default_zero_stage_is_0_alone_and_1_with_several_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert TrainerConfig().zero_stage is None
    assert config()["zero_optimization"] == {"stage": 0}
    monkeypatch.setattr(distributed, "size", lambda: 2)
    assert config()["zero_optimization"] == {"stage": 1}
    assert config(zero_stage=2)["zero_optimization"] == {"stage": 2}  # a stage set is kept


def test_the_raw_deepspeed_dict_is_merged_over_the_derived_config() -> None:
    raw = {
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000, "offload_optimizer": {"device": "cpu"}},
        "gradient_clipping": 1.0,  # repeating a derived value is allowed
        "steps_per_print": 10,
        "communication_data_type": "fp32",
    }
    merged = config(zero_stage=2, deepspeed=raw)
    assert merged["zero_optimization"] == raw["zero_optimization"]  # nested dicts merge key by key
    assert (merged["steps_per_print"], merged["communication_data_type"]) == (10, "fp32")
    assert merged["train_micro_batch_size_per_gpu"] == 1 and merged["zero_force_ds_cpu_optimizer"] is False


@pytest.mark.parametrize(
    ("trainer", "named"),
    [
        (
            {"deepspeed": {"optimizer": {"type": "Adam"}}},
            ["trainer.deepspeed.optimizer", "trainer.learning_rate"],
        ),
        (
            {"deepspeed": {"scheduler": {"type": "WarmupLR"}}},
            ["trainer.deepspeed.scheduler", "trainer.scheduler"],
        ),
        (
            {"deepspeed": {"train_batch_size": 8}},
            ["trainer.deepspeed.train_batch_size", "micro_batch_tokens"],
        ),
        (
            {"zero_stage": 1, "deepspeed": {"zero_optimization": {"stage": 3}}},
            ["trainer.deepspeed.zero_optimization.stage", "trainer.zero_stage"],
        ),
        (
            {"deepspeed": {"gradient_clipping": 0.5}},
            ["trainer.deepspeed.gradient_clipping", "trainer.max_grad_norm"],
        ),
        ({"deepspeed": {"bf16": {"enabled": True}}}, ["trainer.deepspeed.bf16.enabled", "model.dtype"]),
        (
            {"zero_stage": 2, "deepspeed": {"zero_optimization": {"offload_param": {"device": "cpu"}}}},
            ["trainer.deepspeed.zero_optimization.offload_param", "trainer.zero_stage 3"],
        ),
        (
            {"zero_stage": 0, "deepspeed": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}},
            ["trainer.deepspeed.zero_optimization.offload_optimizer", "trainer.zero_stage"],
        ),
    ],
)
def test_invalid_combinations_name_the_field(trainer: dict[str, Any], named: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        config(**trainer)
    for name in named:
        assert name in str(err.value)


@pytest.mark.parametrize(
    ("scheduler", "expected"),
    [
        ("constant", [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.0, 0.5, 1.0, 7 / 8, 6 / 8, 5 / 8]),
        ("cosine", [0.0, 0.5, *(0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(4))]),
    ],
)
def test_schedules_warm_up_then_take_their_shape(scheduler: str, expected: list[float]) -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    trainer = TrainerConfig(steps=10, learning_rate=1.0, warmup_steps=2, scheduler=scheduler)
    rates = [learning_rate_schedule(optimizer, trainer, done).get_last_lr()[0] for done in range(6)]
    assert rates == pytest.approx(expected)


def test_deepspeed_rejections_of_the_merged_config_name_the_section(model_dir: Path) -> None:
    init_distributed(CPU)
    spec = spec_for(model_dir, 2, deepspeed={"zero_optimization": {"stagee": 1}})
    with pytest.raises(ValueError, match=r"(?s)trainer\.deepspeed: DeepSpeed rejects .*stagee"):
        Policy.load(spec, model_dir, model_dir, CPU)


# -- ZeRO 0-3 in one process, and the optimiser state of a checkpoint -----------------------


def spec_for(model_dir: Path, stage: int, **trainer: Any) -> Any:
    return parse_job_spec(
        {
            "model": {"path": str(model_dir)},
            "algorithm": {"group_size": 2},
            "rollout": {"max_new_tokens": 16},
            "trainer": {"steps": 10, "learning_rate": 3e-3, "zero_stage": stage, "micro_batch_tokens": 28}
            | trainer,
        }
    )


def adam_state(policy: Policy) -> tuple[int, float]:
    """The AdamW step count and the total |exp_avg| under the engine's wrapper (if any)."""
    optimizer = policy.engine.optimizer
    base = getattr(optimizer, "optimizer", optimizer)
    states = [state for state in base.state.values() if "step" in state]
    assert states, "the optimiser has no state"
    steps = {int(state["step"]) for state in states}
    assert len(steps) == 1
    return steps.pop(), sum(float(state["exp_avg"].abs().sum()) for state in states)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_zero_stage_trains_and_resumes_its_optimiser_exactly(
    model_dir: Path, tmp_path: Path, stage: int, one_torch_thread: None
) -> None:
    init_distributed(CPU)
    spec = spec_for(model_dir, stage, warmup_steps=3, scheduler="linear")
    samples = fixed_batch()
    first = Policy.load(spec, model_dir, model_dir, CPU)
    try:
        first.optimise(samples, seed=0)
        first.save(tmp_path)
        first.save_training_state(tmp_path)
        state = tmp_path / TRAINING_STATE_DIR
        assert json.loads((state / TRAINING_STATE_FILE).read_text()) == {"world_size": 1, "zero_stage": stage}
        assert adam_state(first)[0] == 1
        uninterrupted = first.optimise(samples, seed=1)
        expected = first.response_logprobs(samples)
    finally:
        first.close()
    resumed = Policy.load(spec, tmp_path, tmp_path, CPU, completed_versions=1, training_state=state)
    try:
        steps, moments = adam_state(resumed)
        assert steps == 1 and moments > 0  # the moments came back, not a fresh optimiser
        continued = resumed.optimise(samples, seed=1)
        got = resumed.response_logprobs(samples)
    finally:
        resumed.close()
    assert continued.loss == pytest.approx(uninterrupted.loss, abs=1e-7)
    assert continued.learning_rate == pytest.approx(uninterrupted.learning_rate)
    for a, b in zip(got, expected, strict=True):
        assert a == pytest.approx(b, abs=1e-6)


def test_a_state_of_another_layout_is_not_loaded(
    model_dir: Path, tmp_path: Path, one_torch_thread: None
) -> None:
    init_distributed(CPU)
    spec = spec_for(model_dir, 2)
    policy = Policy.load(spec, model_dir, model_dir, CPU)
    try:
        policy.optimise(fixed_batch(), seed=0)
        policy.save(tmp_path)
        policy.save_training_state(tmp_path)
    finally:
        policy.close()
    state = tmp_path / TRAINING_STATE_DIR
    (state / TRAINING_STATE_FILE).write_text(json.dumps({"world_size": 2, "zero_stage": 2}))
    fresh = Policy.load(spec, tmp_path, tmp_path, CPU, completed_versions=1, training_state=state)
    try:
        base = fresh.engine.optimizer.optimizer
        assert not any(base.state.values())  # moments start afresh, as the log says
    finally:
        fresh.close()


def test_share_of_gives_each_rank_its_packs_and_equal_pass_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    packs = [[0], [1, 2], [3], [4], [5]]
    monkeypatch.setattr(distributed, "size", lambda: 2)
    shares = {}
    for rank in (0, 1):
        monkeypatch.setattr(distributed, "rank", lambda rank=rank: rank)
        shares[rank] = distributed.share_of(packs)
    assert shares[0] == [([0], True), ([3], True), ([5], True)]
    assert shares[1] == [([1, 2], True), ([4], True), ([4], False)]  # padded to three passes
    monkeypatch.setattr(distributed, "size", lambda: 8)
    assert [real for _, real in distributed.share_of(packs)] == [True]  # rank 1 of 8: one pack
    monkeypatch.setattr(distributed, "rank", lambda: 6)
    assert distributed.share_of(packs) == [([5], False)]


# -- several processes -------------------------------------------------------------------


def test_two_ranks_of_zero_2_train_as_one_process_does(
    model_dir: Path, tmp_path: Path, python: str, python_env: dict[str, str]
) -> None:
    lengths = [sample.length for sample in fixed_batch()]
    assert len(plan_micro_batches(lengths, 28)) % 2 == 1  # so one rank runs a padding pass
    script = [str(SCRIPT), "--model", str(model_dir), "--zero-stage", "2", "--steps", "2"]
    runs = {
        1: subprocess.Popen([python, *script, "--out", str(tmp_path / "one.json")], **pipes(python_env)),
        2: subprocess.Popen(
            torchrun(python, 2, *script, "--out", str(tmp_path / "two.json")), **pipes(python_env)
        ),
    }
    for ranks, proc in runs.items():
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        assert proc.returncode == 0, f"{ranks} rank(s):\n{output}"
    one, two = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "two"))
    assert_trained_as_one_process(one, two, world=2)
    assert two["learning_rates"] == pytest.approx(one["learning_rates"])
    weights = [load_file(str(Path(run["checkpoint"]) / "model.safetensors")) for run in (one, two)]
    base = load_file(str(model_dir / "model.safetensors"))
    assert max(float((weights[0][k] - base[k]).abs().max()) for k in base) > 1e-3
    for name, tensor in weights[0].items():
        # The summation order differs; Adam's m / sqrt(v) magnifies that on gradients near 0,
        # still 100x below the 3e-3 that one step moves a weight.
        torch.testing.assert_close(weights[1][name], tensor, atol=3e-5, rtol=0)
    partitions = sorted(
        p.name for p in (Path(two["checkpoint"]) / TRAINING_STATE_DIR).rglob("zero_pp_rank_*")
    )
    assert partitions == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]


def pipes(env: dict[str, str]) -> dict[str, Any]:
    return {"env": env, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}


async def test_the_trainer_service_runs_as_two_ranks_of_zero_3(
    bus: Bus, redis_url: str, model_dir: Path, tmp_path: Path, python: str, python_env: dict[str, str]
) -> None:
    job_id, runs = "ranks-0001", tmp_path / "runs"
    streams = JobStreams(job_id)
    env = python_env | trainer_env(redis_url)
    proc = subprocess.Popen(torchrun(python, 2, "-m", "services.trainer"), **pipes(env))
    try:
        await submit(bus, job_id, model_dir, runs, steps=2, zero_stage=3, checkpoint_every_steps=1)
        for version in (0, 1):
            deadline_s = STARTUP_DEADLINE_S if version == 0 else DEADLINE_S
            await wait_for_checkpoint(bus, job_id, version, deadline_s)
            await bus.publish_many(streams.trajectories, steps_groups(job_id, version))
        assert (await wait_for_status(bus, job_id)).state == common_pb2.JOB_STATE_SUCCEEDED
        # The same job with one more step: both ranks resume v2, their optimiser partitions too.
        await submit(bus, job_id, model_dir, runs, steps=3, zero_stage=3, checkpoint_every_steps=1)
        await bus.publish_many(streams.trajectories, steps_groups(job_id, 2))
        assert (await wait_for_status(bus, job_id, nth=2)).state == common_pb2.JOB_STATE_SUCCEEDED
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            pytest.fail(f"torchrun did not stop within 60s of SIGTERM:\n{output}")
    assert "trainer[1]" in output and "following rank 0" in output, output
    assert "rank 0 says exit" in output, output  # the follower left when rank 0 did
    assert output.count("restored the optimiser and schedule") == 2, output  # once per rank
    v3 = runs / job_id / "v000003"
    trained = lineage_trained_ids(runs / job_id)
    published = {f"s{v}{g}:{i}" for v in range(3) for g in "ab" for i in (0, 1)}
    assert len(trained) == 12 and set(trained) == published
    assert checkpoint_ids(v3) == {f"s2{g}:{i}" for g in "ab" for i in (0, 1)}
    AutoModelForCausalLM.from_pretrained(v3)  # ZeRO-3's shards were gathered into one model
    partitions = sorted(p.name for p in (v3 / TRAINING_STATE_DIR).rglob("zero_pp_rank_*optim_states.pt"))
    assert partitions == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    assert [optimizer_steps(runs / job_id / f"v{v:06d}") for v in (1, 2, 3)] == [1, 2, 3]
    handles = await stream_messages(bus, streams.checkpoints, common_pb2.CheckpointHandle)
    assert [(h.epoch, h.version) for h in handles] == [(1, 0), (1, 1), (1, 2), (2, 2), (2, 3)]
    assert await bus.pending_count(streams.trajectories, TRAJECTORY_GROUP) == 0
    assert await bus.pending_count(JOBS, JOB_GROUP) == 0


def steps_groups(job_id: str, version: int) -> list[common_pb2.Trajectory]:
    """Two groups sampled by ``version``, for the step that makes version + 1."""
    return [*group(job_id, f"s{version}a", version), *group(job_id, f"s{version}b", version)]
