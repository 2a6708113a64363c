"""Sampling settings and the batched sampler: validation, filters, seeds, raw logprobs."""

from __future__ import annotations

import pytest
import torch

from services.common.pb import common_pb2
from services.rollout.sampling import SamplingConfig, row_seed
from services.rollout.torch.sampler import BatchSampler

CPU = torch.device("cpu")


def config(**fields: object) -> SamplingConfig:
    params = {"max_new_tokens": 4, **fields}
    return SamplingConfig.from_proto(common_pb2.SamplingParams(**params))  # type: ignore[arg-type]


def test_defaults() -> None:
    c = config()
    assert (c.temperature, c.top_p, c.top_k, c.min_p, c.n, c.seed) == (0.0, 1.0, 0, 0.0, 1, None)
    assert c.greedy
    c = config(temperature=0.7, top_p=0.5, seed=0, n=3, stop_token_ids=[5, 6])
    assert (c.top_p, c.seed, c.n, c.stop_token_ids, c.greedy) == (0.5, 0, 3, frozenset({5, 6}), False)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.0}, "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"n": -2}, "n must be"),
        ({"n": 100_000}, "n must be"),
        ({"stop": [""]}, "stop strings"),
    ],
)
def test_bad_settings_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(**fields)


def logits_batch(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * 2.0


def test_logprobs_are_of_the_raw_logits_whatever_the_filters() -> None:
    logits = logits_batch(4)
    configs = [
        config(),
        config(temperature=0.5, top_k=3),
        config(temperature=2.0, top_p=0.3),
        config(temperature=1.0, min_p=0.2),
    ]
    sampler = BatchSampler(configs, [None, 1, 2, 3], CPU)
    tokens, logprobs = sampler.sample(logits, [True] * 4)
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(logprobs, raw.gather(1, tokens.unsqueeze(1)).squeeze(1))
    assert int(tokens[0]) == int(logits[0].argmax())  # greedy row


def test_filters_keep_only_allowed_tokens() -> None:
    logits = logits_batch(1).repeat(4, 1)
    order = logits[0].argsort(descending=True).tolist()
    configs = [
        config(temperature=5.0, top_k=3),
        config(temperature=5.0, top_p=1e-6),
        config(temperature=5.0, min_p=0.999),
        config(temperature=5.0),
    ]
    sampler = BatchSampler(configs, [10, 11, 12, 13], CPU)
    seen: list[set[int]] = [set(), set(), set(), set()]
    for _ in range(300):
        tokens, _ = sampler.sample(logits, [True] * 4)
        for row, token in enumerate(tokens.tolist()):
            seen[row].add(token)
    assert seen[0] == set(order[:3])
    assert seen[1] == seen[2] == {order[0]}
    assert len(seen[3]) > 10  # a hot, unfiltered row wanders


def test_samples_follow_the_tempered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    sampler = BatchSampler([config(temperature=0.7)] * 4000, [row_seed(7, i) for i in range(4000)], CPU)
    tokens, _ = sampler.sample(logits, [True] * 4000)
    frequencies = torch.bincount(tokens, minlength=4).float() / 4000
    expected = torch.softmax(logits[0] / 0.7, dim=-1)
    assert torch.allclose(frequencies, expected, atol=0.03), (frequencies, expected)


def test_seeded_rows_do_not_depend_on_their_neighbours() -> None:
    logits = logits_batch(2)
    hot = [config(temperature=3.0), config(temperature=3.0)]
    both = BatchSampler(hot, [row_seed(5, 0), row_seed(9, 0)], CPU)
    first_idle = BatchSampler(hot, [row_seed(5, 0), row_seed(9, 0)], CPU)
    run_both = [both.sample(logits, [True, True])[0][0].item() for _ in range(20)]
    run_other = [first_idle.sample(logits, [True, step % 2 == 0])[0][0].item() for step in range(20)]
    assert run_both == run_other
    again = BatchSampler(hot, [row_seed(5, 0), row_seed(9, 0)], CPU)
    assert [again.sample(logits, [True, True])[0][0].item() for _ in range(20)] == run_both
    assert row_seed(5, 0) != row_seed(5, 1)


def test_select_keeps_each_rows_settings() -> None:
    logits = logits_batch(3)
    sampler = BatchSampler([config(), config(temperature=5.0, top_k=1), config()], [None, 4, None], CPU)
    sampler.select(torch.tensor([1, 2]))
    tokens, _ = sampler.sample(logits[1:], [True, True])
    assert tokens.tolist() == [int(logits[1].argmax()), int(logits[2].argmax())]


def test_the_inverted_cdf_lands_on_a_token_with_mass_at_both_ends() -> None:
    from services.rollout.torch.sampler import _invert_cdf

    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0], [0.0, 0.0, 1e-30, 0.0, 0.5, 0.0]])
    for u in (0.0, 1e-9, 0.2999, 0.3, 0.5, 0.999999, 1.0):  # 1.0 stands for a uniform rounded up
        tokens = _invert_cdf(probs, torch.tensor([u, u]))
        assert all(float(probs[row, token]) > 0 for row, token in enumerate(tokens.tolist())), (u, tokens)
    assert _invert_cdf(probs, torch.tensor([0.0, 0.0])).tolist() == [1, 2]
    assert _invert_cdf(probs, torch.tensor([1.0, 1.0])).tolist() == [3, 4]
