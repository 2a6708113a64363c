"""LoRA jobs (model.lora): the trainer trains and publishes only the adapter, a durable checkpoint
holds the adapter and its optimiser state and a resumed trainer goes on from it, a job starts
from a saved adapter, and an engine serving each adapter version gives the trainer's logprobs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from services.common.bus import Bus
from services.common.checkpoint_layout import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, WEIGHTS_HANDLE_FILE
from services.common.config import parse_job_spec
from services.common.pb import common_pb2, rollout_pb2
from services.common.streams import JobStreams
from services.trainer.batching import TrainSample
from services.trainer.checkpoints import TRAINING_STATE_DIR, CheckpointStore
from services.trainer.policy import Policy, init_distributed
from tests.helpers import eventually, step_metrics
from tests.integration.lora_helpers import LORA, PROMPTS, adapter_logprobs, build_base, handle_dir, lora_spec
from tests.integration.rollout_helpers import RunningEngine, generate_request, start_engine
from tests.integration.test_trainer import (
    DEADLINE_S,
    checkpoint,
    final_status,
    fixed_batch,
    make_group,
    submit,
    trainer,
)

CPU = torch.device("cpu")
MISMATCH_KL_OF_THE_SAME_WEIGHTS = 1e-6
"""mismatch_kl when the behaviour logprobs came from the very weights the trainer holds."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_base(tmp_path_factory.mktemp("tiny-llama"))


def groups_under(
    job_id: str, names: list[str], version: int, base: Path, adapter: Path | None
) -> list[common_pb2.Trajectory]:
    """Groups of two whose behaviour logprobs are those of base + adapter (peft's forward)."""
    found = []
    for name in names:
        for trajectory in make_group(job_id, name, (1.0, 0.0), version, base):
            prompt, response = list(trajectory.prompt_token_ids), list(trajectory.response_token_ids)
            del trajectory.behaviour_logprobs[:]
            trajectory.behaviour_logprobs.extend(adapter_logprobs(base, adapter, prompt, response))
            found.append(trajectory)
    return found


def far_from_base(base: Path, adapter: Path) -> float:
    """How far base + adapter is from the base, in summed |Δ log p| over the groups' tokens: what
    lets a mismatch_kl near 0 tell the adapter's weights from the base's."""
    sample = groups_under("probe", ["p0", "p1"], 0, base, adapter)
    return sum(
        abs(a - b)
        for t in sample
        for a, b in zip(
            t.behaviour_logprobs,
            adapter_logprobs(base, None, list(t.prompt_token_ids), list(t.response_token_ids)),
            strict=True,
        )
    )


async def test_a_lora_job_publishes_only_its_adapter_and_resumes_it(
    bus: Bus, model_dir: Path, tmp_path: Path
) -> None:
    job_id, runs = "lora-0001", tmp_path / "runs"
    streams = JobStreams(job_id)
    base_bytes = (model_dir / "model.safetensors").stat().st_size
    async with trainer(bus):
        await submit(bus, job_id, lora_spec(model_dir, runs, checkpoint_every_steps=2, keep_checkpoints=2))
        h0 = await checkpoint(bus, job_id, 0)
        v0 = handle_dir(h0)
        assert sorted(p.name for p in v0.iterdir()) == [
            ADAPTER_CONFIG_FILE,
            ADAPTER_WEIGHTS_FILE,
            WEIGHTS_HANDLE_FILE,
        ]
        base = Path(h0.adapter.base_uri.removeprefix("file://"))
        assert base == (runs / job_id / "base").resolve()
        base_file = (base / "model.safetensors").read_bytes()
        assert h0.adapter.base_sha256 == hashlib.sha256(base_file).hexdigest()
        original = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        assert all(torch.equal(t, original[k]) for k, t in load_file(base / "model.safetensors").items())
        adapter0 = load_file(v0 / ADAPTER_WEIGHTS_FILE)
        assert all(".lora_" in k for k in adapter0) and all(
            not t.any() for k, t in adapter0.items() if "lora_B" in k
        )

        await bus.publish_many(streams.trajectories, groups_under(job_id, ["g0", "g1"], 0, model_dir, v0))
        h1 = await checkpoint(bus, job_id, 1)
        step1 = await step_metrics(bus, job_id, 1, DEADLINE_S)
        # Only the adapter trained and went out: the handle's bytes are the adapter's.
        adapter1 = load_file(handle_dir(h1) / ADAPTER_WEIGHTS_FILE)
        assert (
            h1.adapter == h0.adapter
            and h1.size_bytes == (handle_dir(h1) / ADAPTER_WEIGHTS_FILE).stat().st_size
        )
        assert h1.size_bytes <= step1["bytes_written"] < 1.1 * h1.size_bytes < base_bytes
        assert adapter1.keys() == adapter0.keys()
        assert any(not torch.equal(adapter1[k], adapter0[k]) for k in adapter0 if "lora_B" in k)

        v1 = handle_dir(h1)
        await bus.publish_many(streams.trajectories, groups_under(job_id, ["g2", "g3"], 1, model_dir, v1))
        h2 = await checkpoint(bus, job_id, 2)
        assert (await final_status(bus, job_id)).state == common_pb2.JOB_STATE_SUCCEEDED
        durable = runs / job_id / "v000002"
        assert (durable / ADAPTER_WEIGHTS_FILE).read_bytes() == (
            handle_dir(h2) / ADAPTER_WEIGHTS_FILE
        ).read_bytes()
        # The optimiser state holds the adapter alone: no tensor of the frozen base.
        [states] = (durable / TRAINING_STATE_DIR).rglob("*model_states.pt")
        module = torch.load(states, map_location="cpu", weights_only=False)["module"]
        assert module and all(".lora_" in key for key in module)
        assert (base / "model.safetensors").read_bytes() == base_file

        # The same job with one more step: a new epoch resumes the adapter from v2.
        assert far_from_base(model_dir, durable) > 1e-2
        await submit(
            bus, job_id, lora_spec(model_dir, runs, steps=3, checkpoint_every_steps=2, keep_checkpoints=2)
        )

        async def resumed() -> common_pb2.CheckpointHandle | None:
            handle = await bus.latest(streams.checkpoints, common_pb2.CheckpointHandle)
            return handle if handle is not None and handle.epoch == 2 else None

        again = await eventually(resumed, "epoch 2", timeout_s=DEADLINE_S)
        assert (again.version, again.sha256, again.adapter) == (2, h2.sha256, h2.adapter)
        await bus.publish_many(
            streams.trajectories, groups_under(job_id, ["g4", "g5"], 2, model_dir, durable)
        )
        await checkpoint(bus, job_id, 3)
        step3 = await step_metrics(bus, job_id, 3, DEADLINE_S)
    # Sampled by v2's adapter, trained by a trainer holding v2's adapter: no mismatch.
    assert step3["mismatch_kl"] < MISMATCH_KL_OF_THE_SAME_WEIGHTS


def save_adapter(model_dir: Path, directory: Path, rank: int = 4) -> Path:
    """An adapter as peft saves it, with B != 0 so that it changes the model."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).float()
    config = LoraConfig(r=rank, lora_alpha=8.0, target_modules="all-linear", task_type="CAUSAL_LM")
    wrapped = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    wrapped.save_pretrained(directory)
    return directory


async def test_a_lora_job_starts_from_a_saved_adapter(bus: Bus, model_dir: Path, tmp_path: Path) -> None:
    saved = save_adapter(model_dir, tmp_path / "saved")
    other_rank = save_adapter(model_dir, tmp_path / "rank8", rank=8)
    assert far_from_base(model_dir, saved) > 1e-2
    async with trainer(bus):
        bad = lora_spec(model_dir, tmp_path / "bad", LORA | {"init_from": str(other_rank)})
        await submit(bus, "lora-bad", bad)
        status = await final_status(bus, "lora-bad")
        assert status.state == common_pb2.JOB_STATE_FAILED
        assert "model.lora.init_from" in status.reason and "rank 8" in status.reason

        job_id = "lora-init"
        spec = lora_spec(model_dir, tmp_path / "runs", LORA | {"init_from": str(saved)}, steps=1)
        await submit(bus, job_id, spec)
        v0 = handle_dir(await checkpoint(bus, job_id, 0))
        published, expected = load_file(v0 / ADAPTER_WEIGHTS_FILE), load_file(saved / ADAPTER_WEIGHTS_FILE)
        assert published.keys() == expected.keys()
        assert all(torch.equal(published[k], expected[k]) for k in expected)
        await bus.publish_many(
            JobStreams(job_id).trajectories, groups_under(job_id, ["g0", "g1"], 0, model_dir, saved)
        )
        step1 = await step_metrics(bus, job_id, 1, DEADLINE_S)
    assert step1["mismatch_kl"] < MISMATCH_KL_OF_THE_SAME_WEIGHTS


def test_a_policy_loads_its_saved_adapter_and_trains_it_alone(model_dir: Path, tmp_path: Path) -> None:
    """What a resumed trainer does when the optimiser state cannot be restored (another world
    size): the adapter comes from the checkpoint's adapter files alone."""
    init_distributed(CPU)
    spec = parse_job_spec(lora_spec(model_dir, tmp_path, learning_rate=3e-2))
    batch = fixed_batch(model_dir)
    trained = Policy.load(spec, model_dir, model_dir, CPU)
    try:
        frozen = {
            n: p.detach().clone() for n, p in trained.engine.module.named_parameters() if not p.requires_grad
        }
        before = trained.response_logprobs(batch)
        trained.optimise(batch, seed=0)
        after = trained.response_logprobs(batch)
        changed = {
            n
            for n, p in trained.engine.module.named_parameters()
            if n in frozen and not torch.equal(p, frozen[n])
        }
        trained.save(tmp_path)
    finally:
        trained.close()
    moved = max(abs(a - b) for x, y in zip(before, after, strict=True) for a, b in zip(x, y, strict=True))
    assert not changed and moved > 1e-3
    loaded = Policy.load(spec, model_dir, model_dir, CPU, adapter_from=tmp_path)
    try:
        again = loaded.response_logprobs(batch)
    finally:
        loaded.close()
    for got, expected in zip(again, after, strict=True):
        assert got == pytest.approx(expected, abs=1e-6)


@pytest.mark.usefixtures("one_torch_thread")
async def test_an_engine_serves_each_adapter_version_with_the_trainers_logprobs(
    bus: Bus, redis_url: str, model_dir: Path, tmp_path: Path
) -> None:
    """The engine merges each version into its copy of the base; the trainer runs peft's LoRA
    layers: the same logprobs, and a version loaded again is merged from the base afresh."""
    init_distributed(CPU)
    spec = parse_job_spec(lora_spec(model_dir, tmp_path, learning_rate=3e-2))
    policy = Policy.load(spec, model_dir, model_dir, CPU)
    store = CheckpointStore(tmp_path, "lora-engine", keep=3)
    base = store.ensure_base("float32", policy.save_base)
    engine = await start_engine(redis_url, engine_id="engine-lora")
    batch = fixed_batch(model_dir)
    answers: dict[int, list[tuple[list[int], list[float]]]] = {}
    handles = []
    try:
        for version in range(3):
            if version:
                policy.optimise(batch, seed=version)
            published = store.publish_weights(version, 1, "float32", policy.save, None, base)
            handles.append(published.handle)
            answers[version] = await sampled(engine, published.handle)
            samples = [TrainSample(p, t, [True] * len(t), [0.0] * len(t), 0.0) for p, (t, _) in zip(
                [p for p in PROMPTS for _ in range(2)], answers[version], strict=True)]  # fmt: skip
            trainer_logprobs = policy.response_logprobs(samples)
            for (_, engine_logprobs), expected in zip(answers[version], trainer_logprobs, strict=True):
                assert engine_logprobs == pytest.approx(expected, abs=1e-4)
        first = [lp for _, lps in answers[0] for lp in lps]
        last = [lp for _, lps in answers[2] for lp in lps]
        assert answers[2] != answers[0] and max(abs(a - b) for a, b in zip(first, last, strict=False)) > 1e-2
        # v1 again, as a resumed trainer's new epoch reissues it: v1's answers, not v1 on top of v2.
        again = common_pb2.CheckpointHandle()
        again.CopyFrom(handles[1])
        again.epoch = 2
        repeated = await sampled(engine, again)
        assert [tokens for tokens, _ in repeated] == [tokens for tokens, _ in answers[1]]
        for (_, now), (_, before) in zip(repeated, answers[1], strict=True):
            assert now == pytest.approx(before, abs=1e-5)
    finally:
        await engine.stop()
        policy.close()


async def sampled(
    engine: RunningEngine, handle: common_pb2.CheckpointHandle
) -> list[tuple[list[int], list[float]]]:
    """Two seeded samples per prompt from the engine once it serves ``handle``: (tokens, logprobs)."""
    stub = engine.stub
    await stub.LoadWeights(rollout_pb2.LoadWeightsRequest(handle=handle), timeout=60)
    found = []
    for index, prompt in enumerate(PROMPTS):
        request = generate_request(prompt, temperature=1.0, n=2, max_new_tokens=8, seed=index)
        reply = await stub.Generate(request, timeout=30)
        found += [(list(c.token_ids), list(c.logprobs)) for c in reply.completions]
    return found
