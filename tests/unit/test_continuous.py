"""The continuous batch: rows leave in any order, the survivors move into the freed slots and
carry on exactly as if nothing had moved (greedy tokens and logprobs of a full forward pass)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.common.pb import common_pb2
from services.rollout.engine_protocol import GenerationRequest
from services.rollout.sampling import SamplingConfig
from services.rollout.torch.continuous import ContinuousBatch
from services.rollout.torch.requests import LoadedModel, Row, admissible, kv_need

CPU = torch.device("cpu")


def loaded_llama() -> LoadedModel:
    torch.manual_seed(5)
    config = LlamaConfig(
        vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=300,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    return LoadedModel(model, 80, 300, frozenset(), 0, None, "past_key_values", True)


def greedy_row(prompt: list[int], index: int, max_new_tokens: int = 50) -> Row:
    config = SamplingConfig.from_proto(common_pb2.SamplingParams(max_new_tokens=max_new_tokens))
    return Row(GenerationRequest(f"r{index}", prompt, config, lambda _: None), 0, frozenset())


def append(rows: list[Row], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    for row, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
        row.tokens.append(token)
        row.logprobs.append(logprob)


def test_rows_leaving_in_any_order_leave_the_others_untouched() -> None:
    loaded = loaded_llama()
    batch = ContinuousBatch(loaded, capacity=8, device=CPU)
    rows = [greedy_row([1, 2 + i, 3 + 2 * i, 4][: 2 + i % 3], i) for i in range(6)]
    append(rows[:4], *batch.admit(rows[:4]))
    for _ in range(3):
        append(batch.rows, *batch.step())
    append(rows[4:], *batch.admit(rows[4:]))  # two join a running batch
    for _ in range(2):
        append(list(batch.rows), *batch.step())
    for gone in (rows[0], rows[2], rows[3]):
        gone.finish = common_pb2.FINISH_REASON_STOP
    batch.retire()
    assert batch.rows == [rows[4], rows[1], rows[5]]  # the live rows past the end filled the holes
    for _ in range(6):
        append(list(batch.rows), *batch.step())
    for row in (rows[1], rows[4], rows[5]):
        ids = torch.tensor([row.request.prompt + row.tokens])
        with torch.inference_mode():
            logprobs = torch.log_softmax(loaded.model(input_ids=ids).logits[0].float(), dim=-1)
        start = len(row.request.prompt) - 1
        expected = [float(logprobs[start + i, token]) for i, token in enumerate(row.tokens)]
        assert row.logprobs == pytest.approx(expected, abs=1e-5)
        assert row.tokens == [int(logprobs[start + i].argmax()) for i in range(len(row.tokens))]
    assert batch.free == 5


def test_admission_stops_at_the_free_slots_or_the_token_budget() -> None:
    """Rows join in order while the batch's slots x its longest need fits the budget; an empty
    batch takes its first row whatever its need."""
    short, long = greedy_row([1, 2, 3, 4], 0, max_new_tokens=12), greedy_row([1] * 10, 1, max_new_tokens=30)
    assert kv_need(short) == 16 and kv_need(long) == 40
    queue = [short] * 5 + [long] * 2
    assert admissible(queue, 64) == 7
    assert admissible(queue, 3) == 3
    assert admissible(queue, 64, max_tokens=80) == 5  # a sixth short one needs 96
    assert admissible(queue, 64, max_tokens=200) == 5  # 6 rows x 40 = 240: the long one waits
    assert admissible(queue, 64, live=4, longest=16, max_tokens=80) == 1
    assert admissible(queue, 64, live=5, longest=16, max_tokens=80) == 0
    assert admissible([long, short], 64, max_tokens=10) == 1  # alone it may pass the budget
    assert admissible([], 64, max_tokens=10) == 0
