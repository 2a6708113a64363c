"""The trainer's parts that need neither Redis nor a model: the group collector, the checkpoint
store, the learning-rate schedule, per-token collation, the micro-batch objective and the
preparation of a step (old logprobs, importance weights, advantages, staleness) with stand-in
models."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import save_file

from services.common.algorithms import POLICY_LOSSES
from services.common.bus import Bus, Delivery
from services.common.config import AlgorithmConfig, JobSpec, JobSpecError, TrainerConfig, parse_job_spec
from services.common.pb import common_pb2
from services.trainer.batching import TrainSample, collate, token_logprobs
from services.trainer.checkpoints import CheckpointStore
from services.trainer.collector import Group, GroupCollector, Outcome, TrainedWindow
from services.trainer.lineage import Lineage
from services.trainer.objective import StepStats, Totals, micro_batch_loss, optimiser_step_plan
from services.trainer.policy import learning_rate_schedule, weights_state, write_weights_file
from services.trainer.prepare import prepare
from services.trainer.regularizers import token_entropy


def trajectory(group: str, index: int, *, version: int = 0, reward: float = 0.0, **fields: Any) -> Any:
    values: dict[str, Any] = {
        "id": f"{group}:{index}",
        "job_id": "job",
        "prompt_id": group,
        "group_id": group,
        "sample_index": index,
        "group_size": 2,
        "prompt_token_ids": [1, 20, 21],
        "response_token_ids": [22, 2],
        "behaviour_logprobs": [-1.0, -2.0],
        "loss_mask": [True, True],
        "policy_versions": [version, version],
        "reward": reward,
    }
    return common_pb2.Trajectory(**(values | fields))


def delivered(message: common_pb2.Trajectory, entry: int) -> Delivery[common_pb2.Trajectory]:
    return Delivery("stream", f"{entry}-0", message, 1)


def test_collector_completes_groups_and_skips_what_it_has_seen() -> None:
    trained: set[str] = {"old:0"}
    collector = GroupCollector("job", 2, trained)
    assert collector.add(delivered(trajectory("old", 0), 1)) == (Outcome.DONE, "")
    assert collector.add(delivered(trajectory("a", 0), 2))[0] is Outcome.BUFFERED
    assert collector.add(delivered(trajectory("a", 0), 3))[0] is Outcome.REDELIVERED
    assert collector.complete == 0
    assert collector.add(delivered(trajectory("a", 1), 4))[0] is Outcome.BUFFERED
    assert collector.complete == 1
    assert sorted(collector.buffered_entry_ids()) == ["2-0", "3-0", "4-0"]
    [group] = collector.take(1)
    assert [t.id for t in group.ordered()] == ["a:0", "a:1"]
    assert len(group.deliveries) == 3
    late = collector.add(delivered(trajectory("a", 1, id="a:9"), 5))
    assert late[0] is Outcome.SURPLUS and "already had 2 members" in late[1]
    assert collector.add(delivered(trajectory("a", 1), 6))[0] is Outcome.DONE


def test_collector_drops_stale_and_invalid_groups() -> None:
    collector = GroupCollector("job", 2, set())
    for index in range(2):
        collector.add(delivered(trajectory("stale", index, version=3), index))
        collector.add(delivered(trajectory("fresh", index, version=4), 10 + index))
    collector.add(delivered(trajectory("bad", 0, reward_error="verifier timed out"), 20))
    collector.add(delivered(trajectory("bad", 1, loss_mask=[True]), 21))
    unusable = collector.discard_unusable(min_version=4)
    assert [g.group_id for g in unusable.stale] == ["stale"]
    [bad] = unusable.invalid
    assert "scoring failed: verifier timed out" in bad.problems[0]
    assert "2 response tokens but loss_mask has 1" in bad.problems[1]
    assert [g.group_id for g in collector.take(5)] == ["fresh"]
    assert collector.add(delivered(trajectory("", 0, id="x"), 30))[0] is Outcome.REJECTED


def test_checkpoint_store_writes_atomically_and_prunes(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "job", keep=2)

    def write(directory: Path) -> None:
        save_file({"w": torch.arange(4.0)}, str(directory / "model.safetensors"))

    def write_state(directory: Path) -> None:
        (directory / "training_state").mkdir()
        (directory / "training_state" / "optim.pt").write_bytes(b"x" * 100)

    since = 0
    for version in range(1, 6):
        published = store.publish_weights(version, 2, "float32", write)
        assert published.directory == tmp_path.resolve() / "job" / "weights" / f"v{version:06d}-e2"
        assert (published.handle.epoch, published.handle.durable, published.handle.dtype) == (
            2,
            False,
            "float32",
        )
        assert published.bytes_written == sum(p.stat().st_size for p in published.directory.iterdir())
        if version % 2 == 0:
            saved = store.save_durable(published, write_state, [f"t{version}"], since)
            assert saved.directory == tmp_path.resolve() / "job" / f"v{version:06d}"
            assert saved.bytes_written < published.bytes_written + 100 + 1000  # weights hard-linked
            assert (saved.handle.durable, saved.handle.sha256) == (True, published.handle.sha256)
            since = version
    with pytest.raises(FileExistsError):
        store.publish_weights(5, 2, "float32", write)
    store.publish_weights(3, 3, "float32", write)  # a resumed lineage reissues v3
    (store.job_dir / ".v000006.tmp-1").mkdir()
    deleted = store.prune()
    assert store.weights() == [(2, 4), (2, 5), (3, 3)]  # the newest lineage's sorts last
    assert store.versions() == [2, 4] and len(deleted) == 3
    latest = store.latest()
    assert latest is not None and latest.handle.version == 4 and latest.consumed == {"t4"}
    assert latest.since_version == 2 and latest.training_state is None
    digest = hashlib.sha256((latest.directory / "model.safetensors").read_bytes()).hexdigest()
    assert latest.handle.sha256 == digest
    store.remove_partial()
    assert not any(p.name.startswith(".") for p in store.job_dir.iterdir())
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        store.publish_weights(9, 3, "float32", lambda directory: None)
    assert store.weights() == [(2, 4), (2, 5), (3, 3)]


def test_pruning_each_step_goes_by_the_index_and_lists_again_now_and_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prune runs every step: it keeps what a listing would keep without listing the directories
    each time, and a directory another trainer wrote is pruned once it lists them again."""
    from services.trainer import checkpoints

    monkeypatch.setattr(checkpoints, "RESCAN_EVERY", 5)
    store = CheckpointStore(tmp_path, "job", keep=2)
    listings = {"count": 0}
    listed = store.weights

    def counted_weights() -> list[tuple[int, int]]:
        listings["count"] += 1
        return listed()

    monkeypatch.setattr(store, "weights", counted_weights)

    def write(directory: Path) -> None:
        save_file({"w": torch.arange(4.0)}, str(directory / "model.safetensors"))

    def write_state(directory: Path) -> None:
        (directory / "training_state").mkdir()

    (store.job_dir / "weights" / "v000000-e0").mkdir(parents=True)  # an earlier lineage's
    for version in range(1, 9):
        published = store.publish_weights(version, 1, "float32", write)
        if version % 3 == 0:
            store.save_durable(published, write_state, [], 0)
        store.prune()
        expected = [(0, 0), *((1, v) for v in range(1, version + 1))][-checkpoints.KEEP_WEIGHTS :]
        assert checkpoints.weights_versions(store.job_dir) == expected
        assert checkpoints.durable_versions(store.job_dir) == [3, 6][: version // 3][-2:]
    assert listings["count"] == 2  # the first prune and the sixth listed; the others did not
    (store.weights_root / "v000002-e1").mkdir()  # written by a trainer this store does not know of
    for _ in range(2):
        store.prune()
    assert (store.weights_root / "v000002-e1").is_dir()  # not listed yet: left alone
    store.prune()  # the fifth since the last listing lists them again
    assert not (store.weights_root / "v000002-e1").exists() and listings["count"] == 3


def test_a_weights_snapshot_is_what_the_step_made_whatever_comes_after(tmp_path: Path) -> None:
    """Weights are written beside the next step (job.py): from a snapshot, each tensor once."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    snapshot = weights_state(model, snapshot=True)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # the next step
    write_weights_file(snapshot, tmp_path)
    written = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in written, "a tied tensor is written once"
    assert written.keys() == {name for name in before if name != "lm_head.weight"}
    for name, tensor in written.items():
        assert torch.equal(tensor, before[name]), name
    embeddings = "model.embed_tokens.weight"
    assert not torch.equal(weights_state(model)[embeddings], before[embeddings]), "the live weights"


def test_the_trained_window_keeps_the_last_manifests_and_its_floor() -> None:
    window = TrainedWindow(depth=2)
    assert window.floor == 0 and "a" not in window
    window.add(["a", "b"])
    assert "a" in window and window.since_durable() == ["a", "b"]
    window.seal(0)
    window.add(["c"])
    window.seal(4)
    window.add(["d"])
    assert all(i in window for i in "abcd") and window.floor == 0 and window.since_durable() == ["d"]
    window.seal(8)  # the first manifest leaves the window
    assert "a" not in window and "c" in window and "d" in window and window.floor == 4
    resumed = TrainedWindow(depth=2)
    resumed.seal(4, ["c"])
    assert "c" in resumed and resumed.floor == 4 and resumed.since_durable() == []


def test_a_lineage_drops_groups_its_weights_cannot_have_sampled(tmp_path: Path) -> None:
    spec = parse_job_spec({"trainer": {"checkpoint_dir": str(tmp_path)}})
    lineage = Lineage(cast(Bus, None), "job", spec)  # foreign() reads no stream
    lineage.start_version, lineage.start_entry = 5, "2000-0"  # resumed at v5; first handle 2000-0
    lineage.window.seal(3, ["old:0"])  # the window vouches for ids trained above v3

    def group(newest: int, entry: int) -> Group:
        found = Group(f"g{newest}-{entry}")
        member = trajectory(found.group_id, 0, version=newest)
        found.trajectories[member.id] = member
        found.deliveries.append(delivered(member, entry))
        return found

    assert not lineage.foreign(group(5, 1000), 7)  # the version it resumed from: the same weights
    assert not lineage.foreign(group(6, 2001), 7)  # sampled by this epoch's v6
    assert lineage.foreign(group(8, 2001), 7)  # ahead of the trainer: a lost epoch's v8
    assert lineage.foreign(group(6, 1999), 7)  # v6 before this epoch began: the lost epoch's v6
    assert lineage.foreign(group(2, 2001), 7)  # older than the window: maybe trained before it


def test_a_resumed_schedule_carries_on_where_it_was() -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    config = TrainerConfig(steps=10, learning_rate=1.0, warmup_steps=2, scheduler="linear")
    assert learning_rate_schedule(optimizer, config, 3).get_last_lr() == [pytest.approx(7 / 8)]


# -- per-token samples, the micro-batch objective, step preparation ----------------------------


def sample(prompt: list[int], response: list[int], **fields: Any) -> TrainSample:
    values: dict[str, Any] = {
        "loss_mask": [True] * len(response),
        "behaviour_logprobs": [-1.0] * len(response),
        "advantage": 1.0,
    }
    return TrainSample(prompt, response, **(values | fields))


def test_collate_places_every_per_token_field_on_the_response_targets() -> None:
    rich = sample(
        [1, 5], [6, 7, 8],
        advantage=[0.1, 0.2, 0.3], old_logprobs=[-0.5, -0.6, -0.7], ref_logprobs=[-0.4, -0.4, -0.4],
        returns=[1.0, 1.0, 1.0], old_values=[0.2, 0.3, 0.4], is_weights=[1.0, 0.5, 2.0], weight=0.25,
    )  # fmt: skip
    plain = sample([1, 4, 3, 5], [2], advantage=-1.0)
    batch = collate([rich, plain], [0.5, 1.0], "cpu")
    assert batch.advantages[0, 1:4].tolist() == pytest.approx([0.1, 0.2, 0.3])
    assert batch.old_logprobs[0, 1:4].tolist() == pytest.approx([-0.5, -0.6, -0.7])
    assert batch.ref_logprobs[0, 1:4].tolist() == pytest.approx([-0.4] * 3)
    assert batch.old_values[0, 1:4].tolist() == pytest.approx([0.2, 0.3, 0.4])
    assert batch.is_weights[0, 1:4].tolist() == [1.0, 0.5, 2.0]
    assert batch.weights[0].tolist() == [0.0, 0.125, 0.125, 0.125]  # aggregation x sample weight
    # Where a sample has none: old = behaviour, TIS weight 1, the scalar advantage broadcast.
    assert batch.old_logprobs[1, 3] == -1.0 and batch.is_weights[1].tolist() == [1.0] * 4
    assert batch.advantages[1].tolist() == [0.0, 0.0, 0.0, -1.0]
    assert (batch.tokens, batch.padded_tokens) == (10, 10)
    with pytest.raises(ValueError, match="one advantage per response token"):
        collate([sample([1], [2, 3], advantage=[1.0])], [1.0], "cpu")


def test_optimiser_steps_cover_every_sample_once_per_epoch() -> None:
    plan = optimiser_step_plan(7, epochs=3, mini_batches=2, seed=1)
    assert len(plan) == 6
    for epoch in range(3):
        assert sorted(plan[2 * epoch] + plan[2 * epoch + 1]) == list(range(7))
    assert optimiser_step_plan(3, 2, 1, 0) == [[0, 1, 2], [0, 1, 2]]
    assert len(optimiser_step_plan(2, 1, 4, 0)) == 2  # no empty mini-batch


def objective(algorithm: AlgorithmConfig, batch: Any, logits: torch.Tensor) -> tuple[torch.Tensor, Totals]:
    totals = Totals()
    loss = micro_batch_loss(logits, batch, algorithm, POLICY_LOSSES.get(algorithm.policy_loss).fn, totals)
    return loss, totals


def test_the_micro_batch_loss_adds_tis_kl_and_entropy_terms() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen)
    ids = torch.randint(3, 11, (2, 5), generator=gen)
    own = token_logprobs(logits, ids)
    samples = [
        sample(ids[r, :2].tolist(), ids[r, 2:].tolist(), old_logprobs=own[r, 1:].tolist(),
               ref_logprobs=(own[r, 1:] - 0.3).tolist(), advantage=[1.0, -0.5, 2.0])
        for r in range(2)
    ]  # fmt: skip
    batch = collate(samples, [1 / 6, 1 / 6], "cpu")
    plain_loss, plain = objective(AlgorithmConfig(), batch, logits)
    # At ratio 1 the policy loss is -sum(w A): 2 rows x (1 - 0.5 + 2) / 6.
    assert float(plain_loss) == pytest.approx(-2 * 2.5 / 6) and plain.kl_loss == plain.entropy_loss == 0.0
    assert plain.entropy / plain.loss_tokens == pytest.approx(float(token_entropy(logits[:, 1:-1]).mean()))
    halved = collate([dataclasses.replace(s, is_weights=[0.5] * 3) for s in samples], [1 / 6, 1 / 6], "cpu")
    assert float(objective(AlgorithmConfig(), halved, logits)[0]) == pytest.approx(float(plain_loss) / 2)
    with_kl = AlgorithmConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, totals = objective(with_kl, batch, logits)
    assert totals.kl / totals.loss_tokens == pytest.approx(0.3, abs=1e-5)  # k1 = logp - logp_ref
    assert totals.kl_loss == pytest.approx(0.1 * 0.3, abs=1e-6)  # the token weights sum to 1
    assert totals.entropy_loss == pytest.approx(-0.01 * plain.entropy / plain.loss_tokens, rel=1e-5)
    assert float(loss) == pytest.approx(float(plain_loss) + totals.kl_loss + totals.entropy_loss)
    in_reward = AlgorithmConfig(advantage="reinforce_pp", kl_coef=0.1, kl_in_reward=True)
    loss, totals = objective(in_reward, batch, logits)
    assert totals.kl_loss == 0.0 and totals.kl > 0 and float(loss) == pytest.approx(float(plain_loss))


class FixedLogprobs:
    """Stands in for the policy, the reference or the critic: one list per sample."""

    def __init__(self, rows: list[list[float]]) -> None:
        self.rows = rows

    def response_logprobs(self, samples: Any) -> list[list[float]]:
        assert len(samples) == len(self.rows)
        return self.rows

    values = response_logprobs


def groups_of(rewards: list[list[float]], versions: list[list[int]]) -> list[list[Any]]:
    return [
        [trajectory(f"g{g}", i, reward=r, policy_versions=[versions[g][i]] * 2) for i, r in enumerate(row)]
        for g, row in enumerate(rewards)
    ]


def spec_with(**algorithm: Any) -> JobSpec:
    return parse_job_spec({"algorithm": {"group_size": 2, **algorithm}})


def test_prepare_broadcasts_outcome_advantages_and_measures_the_mismatch() -> None:
    groups = groups_of([[1.0, 0.0], [0.0, 0.0]], [[3, 3], [3, 3]])
    # behaviour logprobs are [-1, -2]; the trainer sees -1 + log 3 on the first token of sample 0.
    old = [[-1.0 + math.log(3.0), -2.0], [-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0]]
    prepared = prepare(groups, spec_with(tis={"cap": 2.0}), 3, FixedLogprobs(old), recompute_old=True)
    first = prepared.samples[0]
    assert first.advantage == pytest.approx([0.7071, 0.7071], abs=1e-3)  # grpo, broadcast
    assert first.old_logprobs == old[0] and first.is_weights == pytest.approx([2.0, 1.0])
    assert prepared.importance_capped_fraction == 1 / 8 and not prepared.old_logprobs_skipped
    assert prepared.mismatch_kl == pytest.approx((3 - 1 - math.log(3)) / 8)
    assert prepared.rewards == [1.0, 0.0, 0.0, 0.0] and prepared.lags == [0] * 4
    # Tokens one version old, recomputed: the old logprobs are recomputed whatever the correction.
    stale = groups_of([[1.0, 0.0], [0.0, 0.0]], [[2, 2], [2, 2]])
    off = prepare(stale, spec_with(off_policy_correction="none"), 3, FixedLogprobs(old), recompute_old=True)
    assert off.samples[0].is_weights is None and off.importance_capped_fraction == 0.0
    assert off.mismatch_kl == prepared.mismatch_kl  # measured without a correction too
    decoupled = prepare(stale, spec_with(decoupled={"cap": 2.5}), 3, FixedLogprobs(old), recompute_old=True)
    assert decoupled.samples[0].is_weights == pytest.approx([0.0, 1.0])  # 3 > 2.5: left out
    assert decoupled.importance_capped_fraction == 1 / 8


def test_prepare_downweights_or_drops_stale_samples_and_counts_them() -> None:
    groups = groups_of([[1.0, 0.0], [0.0, 1.0]], [[5, 5], [2, 4]])
    old = [[-1.0, -2.0]] * 4
    down = prepare(
        groups,
        spec_with(max_staleness=1, stale_policy="downweight", downweight={"decay": 0.5}),
        5,
        FixedLogprobs(old),
    )
    assert [s.weight for s in down.samples] == [1.0, 1.0, 0.25, 1.0]  # lag 3 is 2 beyond the bound
    assert (down.stale_downweighted, down.stale_dropped) == (1, 0)
    metrics = down.metrics()
    assert (metrics["staleness_lag_0"], metrics["staleness_lag_1"], metrics["staleness_lag_3"]) == (2, 1, 1)
    assert metrics["staleness_max"] == 3 and metrics["staleness_mean"] == 1.0
    dropped = prepare(groups, spec_with(max_staleness=1), 5, FixedLogprobs(old))
    assert len(dropped.samples) == 3 and dropped.stale_dropped == 1
    assert dropped.metrics()["stale_samples_dropped"] == 1


def test_prepare_folds_the_kl_into_token_rewards_for_reinforce_pp() -> None:
    groups = groups_of([[1.0, 1.0], [1.0, 1.0]], [[0, 0], [0, 0]])
    old = [[-1.0, -2.0]] * 4
    ref = [[-1.0, -2.0], [-1.5, -2.0], [-1.0, -3.0], [-2.0, -3.0]]  # k1 sums: 0, 0.5, 1, 2
    spec = spec_with(advantage="reinforce_pp", kl_coef=0.5, kl_estimator="k1", kl_in_reward=True)
    prepared = prepare(groups, spec, 0, FixedLogprobs(old), reference=FixedLogprobs(ref))  # type: ignore[arg-type]
    first = [s.advantage[0] for s in prepared.samples]  # type: ignore[index]
    assert sorted(range(4), key=lambda i: first[i], reverse=True) == [0, 1, 2, 3]
    assert prepared.samples[1].ref_logprobs == ref[1]
    # Without the KL every return is the same reward: nothing to learn.
    plain = prepare(groups, spec_with(advantage="reinforce_pp"), 0, FixedLogprobs(old))
    assert all(a == 0.0 for s in plain.samples for a in s.advantage)  # type: ignore[union-attr]


def test_prepare_gives_gae_whitened_advantages_and_the_critics_targets() -> None:
    groups = groups_of([[1.0, 0.0]], [[0, 0]])
    values = [[0.5, 0.5], [0.1, 0.2]]
    spec = spec_with(advantage="gae", gamma=1.0, gae={"lambda": 1.0})
    prepared = prepare(groups, spec, 0, FixedLogprobs([[-1.0, -2.0]] * 2), critic=FixedLogprobs(values))  # type: ignore[arg-type]
    first, second = prepared.samples
    assert first.returns == [1.0, 1.0] and second.returns == [0.0, 0.0]  # lambda 1: returns = rewards
    assert first.old_values == values[0]
    advantages = torch.tensor([first.advantage, second.advantage])
    assert float(advantages.mean()) == pytest.approx(0.0, abs=1e-9) and float(
        advantages.std(correction=0)
    ) == pytest.approx(1.0, abs=1e-4)
    assert min(first.advantage) > 0 > max(second.advantage)  # type: ignore[arg-type]


def test_kl_in_reward_needs_a_token_estimator_and_a_coefficient() -> None:
    with pytest.raises(JobSpecError, match=r"algorithm\.kl_in_reward: .*token-level advantage"):
        parse_job_spec({"algorithm": {"kl_coef": 0.1, "kl_in_reward": True}})
    with pytest.raises(JobSpecError, match=r"algorithm\.kl_in_reward: .*kl_coef > 0"):
        parse_job_spec({"algorithm": {"advantage": "reinforce_pp", "kl_in_reward": True}})


def test_step_metrics_cover_every_part_of_the_step() -> None:
    """A step's metrics are statistics only: dropped groups, which the controller replaces, are
    reported as GroupsDropped on the control stream, never as metric values."""
    stats = StepStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1e-3, 1, 10, 12, critic_steps=1)
    prepared = prepare(groups_of([[1.0, 0.0]], [[0, 0]]), spec_with(), 0, FixedLogprobs([[-1.0, -2.0]] * 2))
    names = set(stats.metrics()) | set(prepared.metrics())
    assert {"value_loss", "padding_waste", "mismatch_kl", "staleness_lag_0"} <= names
    assert stats.padding_waste == pytest.approx(1 / 6)
    assert not names & {"stale_dropped", "invalid_dropped", "zero_variance_dropped"}


def test_stage_times_are_the_means_of_the_groups_stamps() -> None:
    from services.trainer.collector import Group
    from services.trainer.report import stage_metric_values

    def group(name: str, issued: float, **stamps: float) -> Group:
        member = trajectory(name, 0)
        member.stages.CopyFrom(common_pb2.StageTimes(issued=issued, **stamps))
        return Group(group_id=name, trajectories={member.id: member})

    both = [
        group("a", 100.0, picked=100.5, generated=101.5, scored=101.75, published=102.0),
        group("b", 200.0, picked=201.5, generated=203.5, scored=204.25, published=204.5),
        group("c", 300.0, picked=301.0),  # stamps missing (an older runner): left out
    ]
    values = stage_metric_values(both, trained_at=205.0)
    assert values == pytest.approx({
        "stage_queue_s": 1.0, "stage_generate_s": 1.5, "stage_score_s": 0.5,
        "stage_publish_s": 0.25, "stage_deliver_s": (103.0 + 0.5) / 2,
    })  # fmt: skip
    assert stage_metric_values(both[2:], trained_at=305.0) == {}


@pytest.mark.parametrize(
    ("engines", "cores", "trainer", "engine"),
    [(1, 2, 2, 1), (1, 8, 8, 4), (2, 8, 8, 2), (3, 2, 2, 1), (1, 1, 1, 1)],
)
def test_the_local_stack_splits_the_cores_between_trainer_and_engines(
    engines: int, cores: int, trainer: int, engine: int
) -> None:
    from services.stack import thread_split

    assert thread_split(engines, cores) == {
        "VERST_TRAINER_TORCH_THREADS": str(trainer),
        "VERST_ENGINE_TORCH_THREADS": str(engine),
    }
