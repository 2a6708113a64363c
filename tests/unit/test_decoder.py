"""The slot decoder against transformers' own forward: Llama (GQA), Qwen2 (biases), Qwen3 (head norms)."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from services.rollout.torch.aot import AotStep
from services.rollout.torch.decoder import SlotDecoder, unsupported_reason

SIZES = {
    "vocab_size": 90,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def build(kind: str) -> PreTrainedModel:
    torch.manual_seed(3)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SIZES)).eval()
    if kind == "llama3-rope":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 10000.0}  # fmt: skip
        return LlamaForCausalLM(LlamaConfig(**SIZES, rope_parameters=rope)).eval()
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SIZES)).eval()
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=16)).eval()
    raise ValueError(kind)


def full_logprobs(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0, -1].float(), dim=-1)


@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "qwen2", "qwen3"])
def test_prefill_and_decode_equal_a_full_forward_pass(kind: str) -> None:
    """Two prompts of different lengths, one with two samples, decoded side by side for 12 steps."""
    model = build(kind)
    decoder = SlotDecoder(model, slots=4, max_positions=512)
    decoder.reserve(40)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    logits = decoder.prefill(prompts, [[0, 1], [2]])
    sequences = [list(prompts[0]), list(prompts[0]), list(prompts[1])]
    tokens = torch.stack([logits[0].argmax(), (logits[0].argmax() + 1) % 90, logits[1].argmax()])
    positions = torch.tensor([7, 7, 3])
    assert torch.allclose(logits[0].log_softmax(-1), full_logprobs(model, prompts[0]), atol=1e-5)
    for _ in range(12):
        for sequence, token in zip(sequences, tokens.tolist(), strict=True):
            sequence.append(token)
        logits = decoder.decode(tokens, positions)
        for row, sequence in enumerate(sequences):
            assert torch.allclose(logits[row].log_softmax(-1), full_logprobs(model, sequence), atol=1e-5)
        tokens, positions = logits.argmax(-1), positions + 1


def test_moving_a_slot_and_growing_the_cache_keep_what_it_holds() -> None:
    model = build("llama")
    decoder = SlotDecoder(model, slots=3, max_positions=512)
    decoder.reserve(8)
    first_length = decoder.length
    prompt = list(range(3, 3 + 20))
    decoder.prefill([[1, 2, 3], prompt], [[0], [2]])
    decoder.move([2], [1], len(prompt))  # slot 2 sample now lives in slot 1
    decoder.reserve(first_length + 1)  # doubles the cache, copying it
    assert decoder.length >= 2 * first_length
    token = torch.tensor([0, 7])
    logits = decoder.decode(token, torch.tensor([3, len(prompt)]))
    assert torch.allclose(logits[1].log_softmax(-1), full_logprobs(model, [*prompt, 7]), atol=1e-5)
    assert torch.allclose(logits[0].log_softmax(-1), full_logprobs(model, [1, 2, 3, 0]), atol=1e-5)


def test_unsupported_models_are_named() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert "gpt2" in (unsupported_reason(gpt2) or "")
    windowed = MistralForCausalLM(MistralConfig(**SIZES, sliding_window=16))
    assert "sliding window" in (unsupported_reason(windowed) or "")
    dynamic = LlamaForCausalLM(LlamaConfig(**SIZES, rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
    assert "dynamic" in (unsupported_reason(dynamic) or "")
    assert unsupported_reason(build("qwen3")) is None
    with pytest.raises(ValueError, match="gpt2"):
        SlotDecoder(gpt2, slots=1, max_positions=64)
    with pytest.raises(ValueError, match="exceed"):
        SlotDecoder(build("llama"), slots=1, max_positions=512).reserve(513)


@pytest.mark.slow  # inductor compiles the steps: ~40 s on two cores
def test_the_compiled_prefill_and_decode_steps_match_the_eager_ones() -> None:
    """torch.compile (inductor) of the steps: the same logits and cache, for changing batch sizes
    and lengths."""
    model = build("llama")
    eager = SlotDecoder(model, slots=4, max_positions=512)
    compiled = SlotDecoder(model, slots=4, max_positions=512, compile_step=True)
    for decoder in (eager, compiled):
        decoder.reserve(32)
    first = ([[1, 2], [3, 4, 4, 5, 6]], [[0, 1], [2]])  # one prompt with two samples
    second = ([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18]], [[0], [1], [2]])
    for prompts, slots in (first, second):  # another batch size and width: the same graph
        want, got = eager.prefill(prompts, slots), compiled.prefill(prompts, slots)
        assert torch.allclose(got, want, atol=1e-5)
        for ours, theirs in zip(compiled.keys + compiled.values, eager.keys + eager.values, strict=True):
            assert torch.allclose(ours[:3, :, :7], theirs[:3, :, :7], atol=1e-5)
    assert "_prefill_step" in compiled._compiled  # the prefill ran compiled
    assert gc.get_freeze_count() > 0  # and its graphs were put out of the collector's reach
    tokens, positions = torch.tensor([20, 21, 22]), torch.tensor([7, 3, 4])
    for step in range(6):
        live = 3 - step % 2  # the batch shrinks and grows, as in a continuous batch
        want = eager.decode(tokens[:live], positions[:live])
        got = compiled.decode(tokens[:live], positions[:live])
        assert compiled._compile and compiled._compiled  # it did not fall back to eager
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        tokens[:live], positions[:live] = want.argmax(-1), positions[:live] + 1


def test_a_long_prompt_takes_the_sdpa_prefill_and_still_matches() -> None:
    model = build("qwen2")
    decoder = SlotDecoder(model, slots=2, max_positions=512)
    long_prompt = [(7 * i) % 89 + 1 for i in range(150)]  # past the short-prompt matmul path
    decoder.reserve(160)
    logits = decoder.prefill([long_prompt, [3, 4, 5]], [[0], [1]])
    assert torch.allclose(logits[0].log_softmax(-1), full_logprobs(model, long_prompt), atol=1e-5)
    token = int(logits[0].argmax())
    step = decoder.decode(torch.tensor([token, 9]), torch.tensor([150, 3]))
    assert torch.allclose(step[0].log_softmax(-1), full_logprobs(model, [*long_prompt, token]), atol=1e-5)


def test_bfloat16_weights_decode_close_to_transformers_in_bfloat16() -> None:
    """The dtype is configurable: in bfloat16 the decoder tracks transformers' own bfloat16 forward."""
    model = build("llama").to(torch.bfloat16)
    decoder = SlotDecoder(model, slots=1, max_positions=512)
    assert decoder.dtype == torch.bfloat16
    decoder.reserve(16)
    prompt = [5, 6, 7, 8]
    logits = decoder.prefill([prompt], [[0]])
    assert logits.dtype == torch.float32
    token = int(logits[0].argmax())
    step = decoder.decode(torch.tensor([token]), torch.tensor([len(prompt)]))
    want = full_logprobs(model, [*prompt, token])
    assert (step[0].log_softmax(-1) - want).abs().max() < 0.1  # bfloat16 rounding, not a different model
    assert int(step[0].argmax()) == int(want.argmax())


@pytest.mark.slow  # AOTInductor compiles decode + sampling: ~25 s on two cores
def test_decode_and_sample_compiled_ahead_of_time_draws_what_eager_draws() -> None:
    """One AOTInductor step serves every batch size (down to 1), a span as long as the cache, a
    grown cache and an in-place weight update: the weights and caches are its inputs, not
    constants compiled into it."""
    model = build("qwen2")
    eager = SlotDecoder(model, slots=3, max_positions=512)
    compiled = SlotDecoder(model, slots=3, max_positions=512, compile_step=True)
    for decoder in (eager, compiled):
        decoder.reserve(32)
        decoder.prefill([[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[0], [1], [2]])
    tokens, positions = torch.tensor([20, 21, 22]), torch.tensor([3, 2, 4])
    temperature = torch.tensor([[1.0], [0.7], [1.0]])
    greedy = torch.tensor([False, False, True])

    def both(live: int, seed: int) -> torch.Tensor:
        uniform = torch.rand(live, generator=torch.Generator().manual_seed(seed))
        draw = (temperature[:live], uniform, greedy[:live])
        span = int(positions[:live].max()) + 1
        want = eager.decode_and_sample(tokens[:live], positions[:live], span, draw)
        got = compiled.decode_and_sample(tokens[:live], positions[:live], span, draw)
        assert compiled._compile, "the compiled step fell back to eager"
        assert torch.equal(got[0], want[0])
        assert torch.allclose(got[1], want[1], atol=1e-5), (got[1] - want[1]).abs().max()
        return want[0]

    for step, live in enumerate((3, 3, 2, 1)):
        tokens[:live] = both(live, step)
        positions[:live] += 1
    assert isinstance(compiled._compiled["_decode_sample_step"], AotStep)
    positions[0] = compiled.length - 1  # the span reaches the end of the cache
    both(1, 10)
    for decoder in (eager, compiled):
        decoder.reserve(compiled.length + 1)  # a new, longer cache: new tensors in the frame
    positions[:3] = torch.tensor([300, 5, 6])
    both(3, 11)
    draw = (temperature, torch.full((3,), 0.5), greedy)
    before = eager.decode_and_sample(tokens, positions, 301, draw)[1]
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(3.0)  # what a weight load does: in place
    after = eager.decode_and_sample(tokens, positions, 301, draw)[1]
    assert not torch.allclose(before, after, atol=1e-3)  # the update changes what the model says
    both(3, 12)  # and the compiled step says it too


@pytest.mark.slow  # AOTInductor compiles decode + sampling: ~20 s on two cores
def test_a_one_slot_decoder_compiles_its_step_too() -> None:
    """With one slot the batch dim cannot be dynamic (export's Dim needs min < max): it is fixed."""
    model = build("llama")
    eager = SlotDecoder(model, slots=1, max_positions=512)
    compiled = SlotDecoder(model, slots=1, max_positions=512, compile_step=True)
    draw = (torch.ones(1, 1), torch.tensor([0.3]), torch.tensor([False]))
    results = []
    for decoder in (eager, compiled):
        decoder.reserve(16)
        decoder.prefill([[5, 6, 7]], [[0]])
        results.append(decoder.decode_and_sample(torch.tensor([9]), torch.tensor([3]), 4, draw))
    assert isinstance(compiled._compiled.get("_decode_sample_step"), AotStep)
    assert torch.equal(results[1][0], results[0][0])
    assert torch.allclose(results[1][1], results[0][1], atol=1e-5)


def test_the_cache_grows_to_the_samples_it_holds_within_its_budget() -> None:
    """Slots are allocated as samples join (doubling, up to ``slots``); past ``max_tokens`` the
    cache grows to no more than is asked, shorter if it must, and keeps what it holds."""
    model = build("llama")
    decoder = SlotDecoder(model, slots=40, max_positions=512, max_tokens=40 * 64)
    decoder.reserve(20, rows=3)
    assert (decoder.allocated, decoder.length) == (16, 160)  # 16 x 256 would pass 2,560 positions
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    decoder.prefill(prompts, [[0], [1], [2]])
    decoder.reserve(20, rows=17)  # 32 slots: 80 positions each fit the budget
    assert (decoder.allocated, decoder.length) == (32, 80)
    decoder.reserve(20, rows=40)
    assert (decoder.allocated, decoder.length) == (40, 64)
    assert decoder.keys[0].shape[0] == 40
    logits = decoder.decode(torch.tensor([30, 31, 32]), torch.tensor([3, 5, 2]))
    for row, prompt in enumerate(prompts):
        want = full_logprobs(model, [*prompt, 30 + row])
        assert torch.allclose(logits[row].log_softmax(-1), want, atol=1e-5)
    with pytest.raises(ValueError, match="slots"):
        decoder.reserve(20, rows=41)


@pytest.mark.slow  # AOTInductor compiles decode + sampling: ~25 s on two cores
def test_the_ahead_of_time_step_serves_a_cache_grown_to_more_slots() -> None:
    """The cache's slots are a dynamic dim of the exported step: samples that join after it was
    compiled, into new slots, decode as they do eagerly."""
    model = build("llama")
    decoders = [SlotDecoder(model, slots=64, max_positions=512, compile_step=c) for c in (False, True)]
    prompts = [[5 + i, 6, 7 + i % 3] for i in range(24)]
    tokens, positions = torch.arange(40, 64), torch.full((24,), 3)
    draw = (torch.ones(24, 1), torch.linspace(0.05, 0.95, 24), torch.zeros(24, dtype=torch.bool))
    results = []
    for decoder in decoders:
        decoder.reserve(16, rows=2)
        decoder.prefill(prompts[:2], [[0], [1]])
        first = decoder.decode_and_sample(tokens[:2], positions[:2], 4, tuple(d[:2] for d in draw))
        decoder.reserve(16, rows=24)  # 16 slots, then 32: a new cache with more slots
        decoder.prefill(prompts[2:], [[slot] for slot in range(2, 24)])
        results.append((first, decoder.decode_and_sample(tokens, positions, 4, draw)))
    assert decoders[1]._compile and isinstance(decoders[1]._compiled["_decode_sample_step"], AotStep)
    assert decoders[1].allocated == 32
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(compiled[0], eager[0])
        assert torch.allclose(compiled[1], eager[1], atol=1e-5)
