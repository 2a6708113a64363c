"""The policy loss against a per-token reference, the aggregation weights, micro-batch packing
and collation, and that accumulating over micro-batches gives the full-batch gradient."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from services.common.algorithm_config import GspoConfig
from services.common.algorithms import POLICY_LOSSES
from services.common.config import AlgorithmConfig
from services.trainer.batching import TrainSample, collate, pack_micro_batches, token_logprobs
from services.trainer.losses import (
    PolicyLossInputs,
    ValueLossInputs,
    gspo_token,
    sample_token_weights,
    value_loss,
)


def random_inputs(seed: int, rows: int = 4, cols: int = 9) -> PolicyLossInputs:
    gen = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 3
    # Log-ratios up to +-0.6 so both clip bounds are crossed.
    logprobs = behaviour + (torch.rand(rows, cols, generator=gen, dtype=torch.float64) - 0.5) * 1.2
    advantages = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    mask = torch.rand(rows, cols, generator=gen) > 0.3
    mask[0, 0] = True
    # Garbage where the mask is off must not matter (padding can hold anything).
    logprobs = torch.where(mask, logprobs, torch.full_like(logprobs, 1e4))
    weights = mask.double() / mask.sum()
    return PolicyLossInputs(logprobs, behaviour, advantages, mask, weights)


def reference(inputs: PolicyLossInputs, low: float, high: float, dual: float | None) -> tuple[float, ...]:
    """The PPO-clip token mean, clip fraction and k3 KL, token by token in plain Python."""
    losses, clipped, kls = [], 0, []
    rows, cols = inputs.mask.shape
    for i in range(rows):
        for j in range(cols):
            if not inputs.mask[i, j]:
                continue
            log_ratio = float(inputs.logprobs[i, j] - inputs.behaviour_logprobs[i, j])
            ratio, adv = math.exp(log_ratio), float(inputs.advantages[i, j])
            bounded = min(max(ratio, 1 - low), 1 + high)
            loss = -min(ratio * adv, bounded * adv)
            if dual is not None and adv < 0:
                loss = min(loss, -dual * adv)
            losses.append(loss)
            clipped += int(-bounded * adv > -ratio * adv)
            kls.append(ratio - 1 - log_ratio)
    n = len(losses)
    return sum(losses) / n, clipped / n, sum(kls) / n


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize(("low", "high", "dual"), [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
def test_ppo_clip_matches_the_formula(seed: int, low: float, high: float, dual: float | None) -> None:
    inputs = random_inputs(seed)
    algorithm = AlgorithmConfig(clip_low=low, clip_high=high, dual_clip=dual)
    out = POLICY_LOSSES.get("ppo_clip").fn(inputs, algorithm)
    loss, clip_fraction, approx_kl = reference(inputs, low, high, dual)
    assert float(out.loss) == pytest.approx(loss, abs=1e-6)
    assert out.clip_fraction == pytest.approx(clip_fraction, abs=1e-6)
    assert out.approx_kl == pytest.approx(approx_kl, abs=1e-6)
    assert out.tokens == int(inputs.mask.sum())
    assert 0 < out.clip_fraction < 1  # the inputs exercise both branches


def test_ppo_clip_gradient_flows_only_through_unclipped_masked_tokens() -> None:
    inputs = random_inputs(7)
    logprobs = inputs.logprobs.clone().requires_grad_(True)
    params = {f: getattr(inputs, f) for f in ("behaviour_logprobs", "advantages", "mask", "weights")}
    out = POLICY_LOSSES.get("ppo_clip").fn(PolicyLossInputs(logprobs=logprobs, **params), AlgorithmConfig())
    out.loss.backward()
    assert logprobs.grad is not None
    assert torch.all(logprobs.grad[~inputs.mask] == 0)
    ratio = torch.exp(inputs.logprobs - inputs.behaviour_logprobs)
    inside = inputs.mask & (ratio > 0.8 + 1e-9) & (ratio < 1.2 - 1e-9)
    assert torch.all(logprobs.grad[inside] != 0)


def test_with_ratio_one_the_loss_is_minus_the_mean_advantage() -> None:
    inputs = random_inputs(3)
    same = PolicyLossInputs(
        inputs.behaviour_logprobs, inputs.behaviour_logprobs, inputs.advantages, inputs.mask, inputs.weights
    )
    out = POLICY_LOSSES.get("ppo_clip").fn(same, AlgorithmConfig())
    assert float(out.loss) == pytest.approx(-float(inputs.advantages[inputs.mask].mean()), abs=1e-9)
    assert out.clip_fraction == 0.0 and out.approx_kl == pytest.approx(0.0, abs=1e-12)


def test_unknown_policy_loss_names_the_available_ones() -> None:
    with pytest.raises(ValueError, match=r"'cispo' is not available.*gspo, ppo_clip"):
        POLICY_LOSSES.get("cispo")


def test_sample_token_weights_aggregate_as_named() -> None:
    tokens = [3, 1, 4, 0]
    token_mean = sample_token_weights(tokens, "token_mean", 10)
    assert sum(w * n for w, n in zip(token_mean, tokens, strict=True)) == pytest.approx(1.0)
    sequence_mean = sample_token_weights(tokens, "sequence_mean", 10)
    assert sequence_mean == pytest.approx([1 / 12, 1 / 4, 1 / 16, 0.0])
    assert sample_token_weights(tokens, "constant", 10) == pytest.approx([1 / 40] * 4)
    with pytest.raises(ValueError, match="not available"):
        sample_token_weights(tokens, "median", 10)


@pytest.mark.parametrize("seed", range(5))
def test_packing_respects_the_budget_and_loses_nothing(seed: int) -> None:
    rng = random.Random(seed)
    budget = rng.choice([16, 64, 100])
    lengths = [rng.randint(1, budget) for _ in range(rng.randint(1, 60))]
    groups = pack_micro_batches(lengths, budget)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        assert len(group) * max(lengths[i] for i in group) <= budget


def test_a_sequence_longer_than_the_budget_gets_its_own_micro_batch() -> None:
    assert sorted(map(sorted, pack_micro_batches([50, 3, 4], 16))) == [[0], [1, 2]]


def sample(prompt: list[int], response: list[int], advantage: float = 1.0) -> TrainSample:
    mask = [True] * len(response)
    if len(response) > 1:
        mask[1] = False
    logprobs = [-0.1 * (i + 1) for i in range(len(response))]
    return TrainSample(prompt, response, mask, logprobs, advantage)


def test_collate_aligns_response_tokens_with_their_targets() -> None:
    samples = [sample([1, 5, 6], [7, 8, 9], 0.5), sample([1, 4], [2], -1.0)]
    batch = collate(samples, [0.25, 0.5], "cpu")
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 8, 9], [1, 4, 2, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]
    # Column t scores input_ids[t + 1]: the first response token of row 0 is scored at column 2.
    assert batch.mask.tolist() == [[False, False, True, False, True], [False, True, False, False, False]]
    assert batch.behaviour_logprobs[0, 2:5].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert batch.advantages[1, 1] == -1.0 and batch.advantages[1, 0] == 0.0
    assert batch.weights.tolist()[0] == [0.0, 0.0, 0.25, 0.0, 0.25]
    assert batch.tokens == 9


def test_token_logprobs_are_the_log_softmax_at_the_next_token() -> None:
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, ids), expected)


class TinyLM(torch.nn.Module):
    """Per-position logits; enough to check that weighting is independent of the packing."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(20, 8)
        self.head = torch.nn.Linear(8, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_micro_batch_gradients_add_up_to_the_full_batch_gradient(aggregation: str) -> None:
    rng = random.Random(4)
    samples = [
        sample([1, *[rng.randint(3, 19) for _ in range(rng.randint(1, 5))]],
               [rng.randint(3, 19) for _ in range(rng.randint(1, 7))], rng.uniform(-1, 1))
        for _ in range(9)
    ]  # fmt: skip
    weights = sample_token_weights([s.loss_tokens for s in samples], aggregation, 8)
    loss_fn = POLICY_LOSSES.get("ppo_clip").fn

    def gradient(budget: int) -> tuple[list[torch.Tensor], float]:
        model = TinyLM()
        total = 0.0
        for pack in pack_micro_batches([s.length for s in samples], budget):
            batch = collate([samples[i] for i in pack], [weights[i] for i in pack], "cpu")
            logprobs = token_logprobs(model(batch.input_ids), batch.input_ids)
            inputs = PolicyLossInputs(
                logprobs, batch.behaviour_logprobs, batch.advantages, batch.mask, batch.weights
            )
            out = loss_fn(inputs, AlgorithmConfig())
            out.loss.backward()
            total += float(out.loss.detach())
        return [p.grad.clone() for p in model.parameters() if p.grad is not None], total

    full, full_loss = gradient(10_000)
    packed, packed_loss = gradient(16)
    assert len(pack_micro_batches([s.length for s in samples], 16)) > 3
    assert packed_loss == pytest.approx(full_loss, abs=1e-6)
    for a, b in zip(full, packed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# --- GSPO ---------------------------------------------------------------------------------------


def sequence_inputs(
    seed: int, spread: float, aggregation: str, rows: int = 6, cols: int = 10
) -> PolicyLossInputs:
    """Ragged rows with holes, one advantage per sample, per-sample weights of ``aggregation``."""
    rng = random.Random(seed)
    mask_rows = []
    for _ in range(rows):
        length = rng.randint(1, cols)
        mask_rows.append([j < length and (j == 0 or rng.random() > 0.2) for j in range(cols)])
    mask = torch.tensor(mask_rows)
    behaviour = torch.tensor([[-rng.uniform(0.1, 3.0) for _ in range(cols)] for _ in range(rows)])
    # A per-sample drift plus per-token noise, so some sequence ratios leave the clip range.
    drift = [rng.uniform(-spread, spread) for _ in range(rows)]
    shift = torch.tensor([[d + rng.uniform(-spread, spread) for _ in range(cols)] for d in drift])
    logprobs = torch.where(mask, behaviour.double() + shift.double(), torch.tensor(1e4, dtype=torch.float64))
    per_sample = [rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 2.0) for _ in range(rows)]
    advantages = torch.tensor(per_sample, dtype=torch.float64)[:, None].expand(rows, cols).clone()
    sample_weights = sample_token_weights([sum(r) for r in mask_rows], aggregation, cols)
    weights = torch.tensor(sample_weights, dtype=torch.float64)[:, None] * mask.double()
    return PolicyLossInputs(logprobs, behaviour.double(), advantages, mask, weights)


def gspo_reference(inputs: PolicyLossInputs, low: float, high: float) -> tuple[float, float]:
    """sum_i W_i * -min(s_i A_i, clip(s_i) A_i), s_i = exp(mean log-ratio), and the clipped token share."""
    total, clipped_tokens, tokens = 0.0, 0, 0
    for i in range(inputs.mask.shape[0]):
        steps = [j for j in range(inputs.mask.shape[1]) if inputs.mask[i, j]]
        log_ratios = [float(inputs.logprobs[i, j] - inputs.behaviour_logprobs[i, j]) for j in steps]
        s = math.exp(sum(log_ratios) / len(steps))
        adv = float(inputs.advantages[i, steps[0]])
        bounded = min(max(s, 1 - low), 1 + high)
        total += sum(float(inputs.weights[i, j]) for j in steps) * -min(s * adv, bounded * adv)
        clipped_tokens += len(steps) * int(-bounded * adv > -s * adv)
        tokens += len(steps)
    return total, clipped_tokens / tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
@pytest.mark.parametrize(
    ("low", "high", "spread"), [(0.2, 0.28, 0.8), (GspoConfig().clip_low, GspoConfig().clip_high, 2e-3)]
)
def test_gspo_matches_the_sequence_level_formula(
    seed: int, aggregation: str, low: float, high: float, spread: float
) -> None:
    inputs = sequence_inputs(seed, spread, aggregation)
    out = gspo_token(inputs, low, high)
    loss, clip_fraction = gspo_reference(inputs, low, high)
    assert float(out.loss) == pytest.approx(loss, abs=1e-6)
    assert out.clip_fraction == pytest.approx(clip_fraction, abs=1e-6)
    assert out.tokens == int(inputs.mask.sum())
    assert 0 < out.clip_fraction < 1  # some sequences clip, some do not


def test_registered_gspo_uses_the_papers_clip_ranges() -> None:
    inputs = sequence_inputs(4, 2e-3, "sequence_mean")
    out = POLICY_LOSSES.get("gspo").fn(inputs, AlgorithmConfig(clip_low=0.2, clip_high=0.2))
    assert float(out.loss) == pytest.approx(gspo_reference(inputs, 3e-4, 4e-4)[0], abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_gspo_token_gradient_equals_the_sequence_objectives(seed: int, aggregation: str) -> None:
    inputs = sequence_inputs(seed, 0.8, aggregation)
    low, high = 0.2, 0.28
    token_lp = inputs.logprobs.clone().requires_grad_(True)
    out = gspo_token(
        PolicyLossInputs(token_lp, inputs.behaviour_logprobs, inputs.advantages, inputs.mask, inputs.weights),
        low,
        high,
    )
    out.loss.backward()
    # The sequence-level objective, differentiated through s_i = exp(mean_t log-ratio) directly.
    seq_lp = inputs.logprobs.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(inputs.mask.shape[0]):
        steps = inputs.mask[i].nonzero().flatten()
        s = torch.exp((seq_lp[i, steps] - inputs.behaviour_logprobs[i, steps]).mean())
        adv = inputs.advantages[i, steps[0]]
        term = -torch.minimum(s * adv, torch.clamp(s, 1 - low, 1 + high) * adv)
        total = total + inputs.weights[i, steps].sum() * term
    total.backward()
    assert token_lp.grad is not None and seq_lp.grad is not None
    assert seq_lp.grad.abs().sum() > 0  # not every sequence clipped
    torch.testing.assert_close(token_lp.grad, seq_lp.grad, rtol=0, atol=1e-9)


# --- value loss ---------------------------------------------------------------------------------


def value_inputs(seed: int) -> ValueLossInputs:
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    values = old + (torch.rand(4, 8, generator=gen, dtype=torch.float64) - 0.5)
    returns = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, 8, generator=gen) > 0.3
    mask[0, 0] = True
    values = torch.where(mask, values, torch.tensor(float("nan"), dtype=torch.float64))
    return ValueLossInputs(values, old, returns, mask, mask.double() / mask.sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip_range", [None, 0.2, 0.05])
def test_value_loss_matches_the_clipped_formula(seed: int, clip_range: float | None) -> None:
    inputs = value_inputs(seed)
    out = value_loss(inputs, clip_range)
    losses, clipped = [], 0
    for i in range(4):
        for j in range(8):
            if not inputs.mask[i, j]:
                continue
            v, old, ret = (float(x[i, j]) for x in (inputs.values, inputs.old_values, inputs.returns))
            unclipped = (v - ret) ** 2
            bounded = (
                (old + min(max(v - old, -clip_range), clip_range) - ret) ** 2 if clip_range else unclipped
            )
            losses.append(0.5 * max(unclipped, bounded))
            clipped += int(bounded > unclipped)
    assert float(out.loss) == pytest.approx(sum(losses) / len(losses), abs=1e-6)
    assert out.clip_fraction == pytest.approx(clipped / len(losses), abs=1e-6)
    assert (out.clip_fraction > 0) == (clip_range is not None)


# --- each loss improves its objective under a few SGD steps ------------------------------------


def sgd_losses(loss_of: object, param: torch.Tensor, steps: int = 5, lr: float = 0.5) -> list[float]:
    param.requires_grad_(True)
    optimiser = torch.optim.SGD([param], lr=lr)
    seen = []
    for _ in range(steps + 1):
        optimiser.zero_grad()
        loss = loss_of(param)  # type: ignore[operator]
        seen.append(float(loss.detach()))
        loss.backward()
        optimiser.step()
    return seen


@pytest.mark.parametrize("loss_name", ["ppo_clip", "gspo", "gspo_wide"])
def test_policy_losses_improve_their_objective(loss_name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 5, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, 5, (4, 6), generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.2
    advantages = torch.tensor([1.0, -0.5, 0.8, -1.2], dtype=torch.float64)[:, None].expand(4, 6)
    weights = mask.double() / mask.sum()

    def logprobs_of(param: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(param, -1).gather(-1, tokens[..., None]).squeeze(-1)

    behaviour = logprobs_of(logits).detach()

    def objective(param: torch.Tensor) -> torch.Tensor:
        inputs = PolicyLossInputs(logprobs_of(param), behaviour, advantages, mask, weights)
        if loss_name == "gspo_wide":
            return gspo_token(inputs, 0.2, 0.2).loss
        return POLICY_LOSSES.get(loss_name).fn(inputs, AlgorithmConfig()).loss

    seen = sgd_losses(objective, logits.clone())
    assert seen[-1] < seen[0]
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(seen))


def test_value_loss_improves_its_objective() -> None:
    inputs = value_inputs(1)
    old = inputs.old_values.clone()

    def objective(param: torch.Tensor) -> torch.Tensor:
        return value_loss(ValueLossInputs(param, old, inputs.returns, inputs.mask, inputs.weights), 0.2).loss

    seen = sgd_losses(objective, torch.where(inputs.mask, inputs.values, 0.0), lr=2.0)
    assert seen[-1] < 0.8 * seen[0]
