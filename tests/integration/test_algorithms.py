"""Every algorithm of the trainer on a tiny random Llama: each improves its objective on a fixed
batch; the KL term pulls the policy toward the reference; behaviour importance weights (TIS,
decoupled PPO) scale the policy gradient; the on-policy fast path measures the engine mismatch;
and a whole job (PPO with a critic, KL, entropy, TIS, staleness downweighting and the
zero-variance filter) trains through Redis, reports its metrics and checkpoints its critic."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from services.common.bus import Bus
from services.common.config import JobSpec, parse_job_spec
from services.common.pb import common_pb2
from services.common.streams import JobStreams
from services.tasks.addition_model import build_char_tokenizer
from services.trainer.critic import CRITIC_DIR, HEAD_FILE, Critic
from services.trainer.job import TRAJECTORY_GROUP
from services.trainer.policy import Policy, init_distributed
from services.trainer.prepare import base_samples, prepare
from services.trainer.reference import ReferenceModel
from services.trainer.regularizers import k3
from tests.helpers import lineage_trained_ids, metrics_of
from tests.integration.rollout_helpers import tiny_llama
from tests.integration.test_trainer import (
    CPU,
    checkpoint,
    encode,
    final_status,
    make_group,
    model_dir,  # noqa: F401 (a fixture)
    response_logprobs,
    submit,
    trainer,
    trainer_signals,
)

Trajectory = common_pb2.Trajectory


def spec_of(model: Path, algorithm: dict[str, Any], **trainer_fields: Any) -> JobSpec:
    return parse_job_spec(
        {
            "model": {"path": str(model)},
            "algorithm": {"group_size": 4, "max_staleness": 0, **algorithm},
            "rollout": {"prompts_per_step": 3, "max_new_tokens": 8},
            "trainer": {"learning_rate": 3e-3, "micro_batch_tokens": 40, **trainer_fields},
        }
    )


def fixed_groups(model: Path, rewards: tuple[float, ...] = (1.0, 0.0, 1.0, 0.0)) -> list[list[Trajectory]]:
    """Three prompts, four random responses each (rewards as given), sampled by ``model`` at v0."""
    rng = random.Random(0)
    groups = []
    for g in range(3):
        prompt = encode(f"{11 + g}+{22 + g}=")
        group = []
        for i, reward in enumerate(rewards):
            response = [rng.randint(4, 98) for _ in range(rng.randint(2, 6))] + [2]
            group.append(
                Trajectory(
                    id=f"g{g}:{i}",
                    group_id=f"g{g}",
                    sample_index=i,
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    behaviour_logprobs=response_logprobs(model, prompt, response),
                    loss_mask=[True] * len(response),
                    policy_versions=[0] * len(response),
                    reward=reward,
                )
            )
        groups.append(group)
    return groups


def load_policy(spec: JobSpec, weights: Path) -> Policy:
    init_distributed(CPU)
    return Policy.load(spec, weights, weights, CPU)


def mean_logprobs(policy: Policy, groups: list[list[Trajectory]]) -> dict[float, float]:
    """The mean per-token logprob of the responses of each reward."""
    members = [t for group in groups for t in group]
    samples = base_samples(groups)
    by_reward: dict[float, list[float]] = {}
    for t, logprobs in zip(members, policy.response_logprobs(samples), strict=True):
        by_reward.setdefault(t.reward, []).append(statistics.fmean(logprobs))
    return {reward: statistics.fmean(values) for reward, values in by_reward.items()}


ALGORITHMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "grpo": ({}, {}),
    "dr_grpo": ({"advantage": "dr_grpo", "loss_aggregation": "constant"}, {}),
    "rloo": ({"advantage": "rloo"}, {}),
    "reinforce_pp": ({"advantage": "reinforce_pp"}, {}),
    "reinforce_pp_baseline": ({"advantage": "reinforce_pp_baseline"}, {}),
    "gspo": ({"policy_loss": "gspo", "loss_aggregation": "sequence_mean"}, {}),
    "ppo_gae": (
        {"advantage": "gae", "gae": {"lambda": 0.95, "critic_learning_rate": 3e-3}},
        {"ppo_epochs": 2, "mini_batches": 2},
    ),
}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_each_algorithm_raises_the_likelihood_of_rewarded_responses(name: str, model_dir: Path) -> None:  # noqa: F811
    algorithm, trainer_fields = ALGORITHMS[name]
    spec = spec_of(model_dir, {"max_staleness": 3, **algorithm}, **trainer_fields)
    groups = fixed_groups(model_dir)
    policy = load_policy(spec, model_dir)
    critic = Critic.load(spec, model_dir, CPU) if algorithm.get("advantage") == "gae" else None
    try:
        before = mean_logprobs(policy, groups)
        runs = []
        for step in range(4):  # each round: old logprobs, values and advantages afresh, then optimise
            prepared = prepare(groups, spec, step, policy, critic=critic)  # the v0 groups age a version
            assert prepared.old_logprobs_skipped == (name != "ppo_gae")  # one pass: the forward's own
            runs.append(
                policy.optimise(prepared.samples, seed=step, critic=critic, proximal=prepared.proximal)
            )
        after = mean_logprobs(policy, groups)
    finally:
        policy.close()
    gap_before, gap_after = before[1.0] - before[0.0], after[1.0] - after[0.0]
    assert gap_after > gap_before + 0.1, (before, after)
    assert after[1.0] > before[1.0] and after[0.0] < before[0.0]
    steps = trainer_fields.get("ppo_epochs", 1) * trainer_fields.get("mini_batches", 1)
    assert all(run.optimizer_steps == steps and math.isfinite(run.loss) for run in runs)
    assert all(0.0 <= run.padding_waste < 1.0 and run.grad_norm > 0 for run in runs)
    if critic is not None:
        assert runs[-1].value_loss < runs[0].value_loss, [run.value_loss for run in runs]
        assert runs[0].critic_steps == steps and runs[-1].approx_kl > 0  # later mini-batches moved


def test_the_kl_term_pulls_the_policy_toward_the_reference(model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    other = tmp_path / "other"
    policy_model = tiny_llama(1, heads=2, max_positions=64, vocab=len(build_char_tokenizer()))
    with torch.no_grad():  # sharper logits than the near-uniform random reference
        policy_model.model.norm.weight.mul_(10.0)
    policy_model.save_pretrained(other)
    build_char_tokenizer().save_pretrained(other)
    # Equal rewards: no advantage, so any change comes from the KL term alone.
    spec = spec_of(model_dir, {"kl_coef": 1.0, "kl_estimator": "k3", "max_staleness": 5})
    groups = fixed_groups(other, rewards=(1.0, 1.0, 1.0, 1.0))
    policy = load_policy(spec, other)
    reference = ReferenceModel.load(spec, model_dir, CPU)

    def kl_to_reference() -> float:
        """The mean k3 over the response tokens: what the KL term minimises."""
        samples = base_samples(groups)
        now = torch.tensor([lp for row in policy.response_logprobs(samples) for lp in row])
        ref = torch.tensor([lp for row in reference.response_logprobs(samples) for lp in row])
        return float(k3(now, ref).mean())

    try:
        before = kl_to_reference()
        for step in range(5):  # the groups were sampled at v0; the policy is at v<step>
            prepared = prepare(groups, spec, step, policy, reference)
            stats = policy.optimise(prepared.samples, seed=step, proximal=prepared.proximal)
            assert stats.kl > 0 and stats.kl_loss > 0 and stats.policy_loss == 0.0
        after = kl_to_reference()
    finally:
        policy.close()
        reference.close()
    assert before > 0.1 and after < 0.7 * before, (before, after)


def shifted_groups(model: Path, factor: float, version: int) -> list[list[Trajectory]]:
    """fixed_groups as if sampled by version ``version`` with probabilities ``factor`` x the model's."""
    groups = fixed_groups(model)
    for t in (t for group in groups for t in group):
        shifted = [lp + math.log(factor) for lp in t.behaviour_logprobs]
        del t.behaviour_logprobs[:]
        t.behaviour_logprobs.extend(shifted)
        t.policy_versions[:] = [version] * len(t.policy_versions)
    return groups


def first_step(
    spec: JobSpec, model: Path, groups: list[list[Trajectory]], version: int, *, recompute_old: bool = False
) -> tuple[Any, Any]:
    policy = load_policy(spec, model)
    try:
        prepared = prepare(groups, spec, version, policy, recompute_old=recompute_old)
        return prepared, policy.optimise(prepared.samples, seed=0, proximal=prepared.proximal)
    finally:
        policy.close()


def test_behaviour_importance_weights_scale_the_policy_gradient(model_dir: Path) -> None:  # noqa: F811
    """The engine sampled with probabilities 4x the trainer's, one version ago: the weight p_old /
    p_behaviour is 1/4 on every token; TIS caps it at 0.2, decoupled PPO keeps it (under its cap),
    so the first step's gradient is 0.2 and 0.25 x the uncorrected one."""
    groups = shifted_groups(model_dir, 4.0, version=0)
    norms = {}
    for correction, settings in {
        "none": {"off_policy_correction": "none"},
        "tis": {"tis": {"cap": 0.2}},
        "decoupled": {"off_policy_correction": "decoupled"},
    }.items():
        algorithm = {"max_staleness": 1, **settings}
        spec = spec_of(model_dir, algorithm, zero_stage=0, max_grad_norm=None)
        for recompute in (True, False):  # the old-logprob forward, or the training forward's own
            prepared, stats = first_step(spec, model_dir, groups, version=1, recompute_old=recompute)
            norms[correction, recompute] = stats.grad_norm
            assert prepared.old_logprobs_skipped == (not recompute)
            capped = 1.0 if correction == "tis" else 0.0
            assert stats.mismatch_kl == pytest.approx(0.25 - 1 - math.log(0.25), abs=1e-4)
            if recompute:
                assert prepared.mismatch_kl == pytest.approx(stats.mismatch_kl, abs=1e-4)
                assert prepared.importance_capped_fraction == capped
            else:
                assert stats.importance_capped_fraction == (capped if correction != "none" else 0.0)
    for recompute in (True, False):
        assert norms["tis", recompute] == pytest.approx(norms["none", True] * 0.2, rel=1e-4)
        assert norms["decoupled", recompute] == pytest.approx(norms["none", True] * 0.25, rel=1e-4)
        assert norms["none", recompute] == pytest.approx(norms["none", True], rel=1e-4)


def test_the_one_pass_path_measures_the_mismatch_in_the_training_forward(model_dir: Path) -> None:  # noqa: F811
    """Fresh tokens and one optimiser pass: no old-logprob forward; an engine off by 4x shows in the
    mismatch the training forward measures."""
    spec = spec_of(model_dir, {}, zero_stage=0, max_grad_norm=None)
    prepared, stats = first_step(spec, model_dir, shifted_groups(model_dir, 4.0, version=0), version=0)
    assert prepared.old_logprobs_skipped and prepared.mismatch_kl is None
    assert stats.mismatch_kl == pytest.approx(0.25 - 1 - math.log(0.25), abs=1e-4)
    exact, exact_stats = first_step(spec, model_dir, shifted_groups(model_dir, 1.0, version=0), version=0)
    assert exact.old_logprobs_skipped and exact_stats.mismatch_kl < 1e-6 and exact_stats.grad_norm > 0


async def test_a_ppo_job_with_every_regulariser_trains_and_reports(
    bus: Bus,
    model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    job_id, runs = "ppo-0001", tmp_path / "runs"
    streams = JobStreams(job_id)
    spec = {
        "name": "ppo",
        "model": {"path": str(model_dir)},
        "algorithm": {
            "advantage": "gae", "group_size": 2, "max_staleness": 0, "stale_policy": "downweight",
            "downweight": {"decay": 0.5}, "filters": [{"type": "zero_variance"}], "kl_coef": 0.05,
            "entropy_coef": 0.01, "tis": {"cap": 2.0}, "gae": {"critic_learning_rate": 1e-3},
        },
        "rollout": {"prompts_per_step": 2, "max_new_tokens": 8},
        "trainer": {"steps": 2, "learning_rate": 1e-3, "micro_batch_tokens": 32, "ppo_epochs": 2,
                    "checkpoint_dir": str(runs), "keep_checkpoints": 1},
    }  # fmt: skip
    async with trainer(bus):
        await submit(bus, job_id, spec)
        v0 = Path((await checkpoint(bus, job_id, 0)).uri.removeprefix("file://"))
        # Step 1: a group without reward variance is filtered, reported at once, and the step
        # waits for a second group with a signal (the controller's replacement).
        await bus.publish_many(
            streams.trajectories,
            make_group(job_id, "g0", (1.0, 0.0), 0, v0) + make_group(job_id, "flat", (1.0, 1.0), 0, v0),
        )
        await bus.publish_many(streams.trajectories, make_group(job_id, "g1", (0.0, 1.0), 0, v0))
        v1 = Path((await checkpoint(bus, job_id, 1)).uri.removeprefix("file://"))
        # Step 2: a group one version too old is downweighted, not dropped.
        await bus.publish_many(
            streams.trajectories,
            make_group(job_id, "gs", (1.0, 0.0), 0, v0) + make_group(job_id, "g2", (0.0, 1.0), 1, v1),
        )
        await checkpoint(bus, job_id, 2)
        assert (await final_status(bus, job_id)).state == common_pb2.JOB_STATE_SUCCEEDED
    assert (runs / job_id / "v000002" / CRITIC_DIR / HEAD_FILE).is_file()  # the durable checkpoint
    assert await bus.pending_count(streams.trajectories, TRAJECTORY_GROUP) == 0
    trained = lineage_trained_ids(runs / job_id)
    assert sorted(trained) == sorted(f"{g}:{i}" for g in ("g0", "g1", "gs", "g2") for i in range(2))

    metrics = await metrics_of(bus, job_id)
    [dropped] = await trainer_signals(bus, job_id)  # reported before step 1, for replacement
    assert dropped.policy_version == 0 and dropped.groups_dropped == common_pb2.GroupsDropped(filtered=1)
    assert sorted(metrics) == [1, 2]  # the metrics stream carries only the steps' metrics
    assert metrics[1]["groups_filtered"] == metrics[1]["groups_filtered/zero_variance"] == 1
    assert metrics[2]["groups_filtered/zero_variance"] == 0
    assert metrics[1]["response_tokens"] == 12  # two full groups of 2 x 3 tokens
    for step in (1, 2):
        values = metrics[step]
        assert values["kl"] > 0 and values["kl_loss"] > 0 and values["entropy"] > 0
        assert values["entropy_loss"] < 0 and values["value_loss"] > 0 and values["critic_grad_norm"] > 0
        assert values["optimizer_steps"] == 2 and values["tokens_per_s"] > 0
        assert 0 <= values["padding_waste"] < 1
    # Step 1's behaviour logprobs come from the trainer's weights; step 2's stale group from v0's.
    assert metrics[1]["mismatch_kl"] < 1e-6 and metrics[1]["importance_capped_fraction"] == 0.0
    assert metrics[2]["mismatch_kl"] > 1e-6
    assert (metrics[1]["stale_downweighted"], metrics[1]["staleness_max"]) == (0, 0)
    assert metrics[2]["stale_downweighted"] == 2 and metrics[2]["staleness_max"] == 1
    assert (metrics[2]["staleness_lag_0"], metrics[2]["staleness_lag_1"]) == (2, 2)

    # The critic was trained and checkpointed: v2's head is not the initial one, and it loads back.
    v2 = runs / job_id / "v000002"
    saved = load_file(str(v2 / CRITIC_DIR / HEAD_FILE))
    initial = Critic.load(parse_job_spec(spec), model_dir, CPU).head.weight.detach()  # the seeded head
    assert not torch.equal(saved["weight"], initial)
    critic = Critic.load(parse_job_spec(spec), v2 / CRITIC_DIR, CPU)
    assert torch.equal(critic.head.weight.detach(), saved["weight"])


def test_one_rank_skips_deepspeeds_all_reduce_and_trains_the_same_weights(model_dir: Path) -> None:  # noqa: F811
    """With one rank and no ZeRO the engine's all-reduce is off; forced back on, the same steps
    (several micro-batches each) give the very same weights."""
    spec = spec_of(model_dir, {"max_staleness": 3})
    groups = fixed_groups(model_dir)
    trained = []
    for all_reduce in (False, True):
        policy = load_policy(spec, model_dir)
        try:
            assert policy.engine.enable_backward_allreduce is False
            policy.engine.enable_backward_allreduce = all_reduce
            for step in range(2):
                prepared = prepare(groups, spec, step, policy)
                policy.optimise(prepared.samples, seed=step, proximal=prepared.proximal)
            trained.append({k: v.detach().clone() for k, v in policy.engine.module.state_dict().items()})
        finally:
            policy.close()
    without, with_all_reduce = trained
    assert without.keys() == with_all_reduce.keys()
    assert all(torch.equal(without[k], with_all_reduce[k]) for k in without)
