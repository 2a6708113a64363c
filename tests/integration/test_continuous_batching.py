"""Continuous batching in the torch engine, driven in-process: samples join and leave the running
batch at every step, the n samples of a request share one prefill, logprobs equal the trainer's
own computation, and models the slot decoder does not know fall back to static batches."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from services.common.pb import common_pb2, rollout_pb2
from services.rollout.engine_protocol import Completion, GenerationRequest
from services.rollout.sampling import SamplingConfig
from services.rollout.torch.continuous import ContinuousBatch
from services.rollout.torch.decoder import SlotDecoder
from services.rollout.torch.engine import TorchEngine
from services.rollout.torch.requests import Row
from services.rollout.weights import WEIGHTS_FILE, file_sha256
from services.trainer.batching import TrainSample, collate, token_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")


def gqa_llama() -> LlamaForCausalLM:
    torch.manual_seed(11)
    config = LlamaConfig(
        vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


class Collected:
    """Completions of one request, with the time each arrived."""

    def __init__(self) -> None:
        self.completions: list[Completion] = []
        self.finished_at: list[float] = []
        self.done = threading.Event()
        self.expected = 0

    def __call__(self, completion: Completion) -> None:
        self.completions.append(completion)
        self.finished_at.append(time.monotonic())
        if len(self.completions) == self.expected:
            self.done.set()


def sampling(**fields: object) -> SamplingConfig:
    return SamplingConfig.from_proto(common_pb2.SamplingParams(**fields))  # type: ignore[arg-type]


def submit(engine: TorchEngine, name: str, prompt: list[int], config: SamplingConfig) -> Collected:
    collected = Collected()
    collected.expected = config.n
    engine.submit(GenerationRequest(name, prompt, config, collected))
    return collected


@pytest.fixture
def engine_for(tmp_path: Path) -> Iterator[object]:
    engines: list[TorchEngine] = []

    def start(
        model: PreTrainedModel,
        *,
        max_batch_size: int = 16,
        batch_wait_s: float = 0.0,
        max_batch_tokens: int = 0,
    ) -> TorchEngine:
        path = tmp_path / f"v{len(engines)}"
        model.save_pretrained(path, safe_serialization=True)
        engine = TorchEngine(
            device=CPU, dtype=torch.float32, max_batch_size=max_batch_size, batch_wait_s=batch_wait_s,
            max_batch_tokens=max_batch_tokens,
        )  # fmt: skip
        engine.start()
        engines.append(engine)
        engine.load_checkpoint(
            path, sha256=file_sha256(path / WEIGHTS_FILE), version=0, job_id="job",
            mode=rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE, timeout_s=30,
        )  # fmt: skip
        return engine

    yield start
    for engine in engines:
        engine.shutdown()


def trainer_logprobs(
    model: PreTrainedModel, prompts: list[list[int]], responses: list[list[int]]
) -> list[list[float]]:
    """What the trainer computes: one padded micro-batch through collate + token_logprobs."""
    samples = [
        TrainSample(p, r, loss_mask=[True] * len(r), behaviour_logprobs=[0.0] * len(r), advantage=0.0)
        for p, r in zip(prompts, responses, strict=True)
    ]
    batch = collate(samples, [0.0] * len(samples), CPU)
    with torch.inference_mode():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logprobs = token_logprobs(logits, batch.input_ids)
    return [
        logprobs[i, len(p) - 1 : len(p) - 1 + len(r)].tolist()
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
    ]


def test_logprobs_equal_the_trainers_forward_pass_while_requests_join_the_batch(engine_for) -> None:
    model = gqa_llama()
    engine = engine_for(model)
    prompts = [[1, 5, 6, 7, 8, 9], [1, 20], [1, 30, 31, 32, 33, 34, 35, 36, 37], [1, 40, 41]]
    settings = [
        sampling(temperature=1.0, n=3, max_new_tokens=40, seed=1, ignore_eos=True),
        sampling(temperature=0.7, top_k=20, top_p=0.9, n=2, max_new_tokens=25, seed=2),
        sampling(temperature=1.3, min_p=0.05, max_new_tokens=33, ignore_eos=True),
        sampling(temperature=0, max_new_tokens=17, ignore_eos=True),
    ]
    collected = []
    for index, (prompt, config) in enumerate(zip(prompts, settings, strict=True)):
        collected.append(submit(engine, f"r{index}", prompt, config))
        time.sleep(0.02)  # later requests join a batch that is already decoding
    all_prompts, responses = [], []
    for prompt, result in zip(prompts, collected, strict=True):
        assert result.done.wait(30)
        for completion in result.completions:
            assert len(completion.token_ids) == len(completion.logprobs) == len(completion.policy_versions)
            all_prompts.append(prompt)
            responses.append(completion.token_ids)
    expected = trainer_logprobs(model, all_prompts, responses)
    engine_side = [c.logprobs for result in collected for c in result.completions]
    pairs = zip(engine_side, expected, strict=True)
    worst = max(abs(a - b) for got, want in pairs for a, b in zip(got, want, strict=True))
    assert worst <= 1e-4, worst
    assert sum(len(r) for r in responses) >= 3 * 40 + 33 + 17


def test_a_short_request_joins_and_leaves_while_a_long_one_runs(engine_for) -> None:
    engine = engine_for(gqa_llama(), max_batch_size=8)
    long = submit(
        engine, "long", [1, 5, 6], sampling(temperature=1.0, max_new_tokens=400, ignore_eos=True, seed=3)
    )
    deadline = time.monotonic() + 10
    while engine.status().running_requests < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    short = submit(engine, "short", [1, 7, 8, 9], sampling(temperature=0, max_new_tokens=5, ignore_eos=True))
    assert short.done.wait(10) and long.done.wait(30)
    assert short.finished_at[0] < long.finished_at[0]
    assert len(short.completions[0].token_ids) == 5 and len(long.completions[0].token_ids) == 400


def test_the_samples_of_a_request_share_one_prefill(engine_for, monkeypatch: pytest.MonkeyPatch) -> None:
    prefilled: list[int] = []
    original = SlotDecoder.prefill

    def counting(self: SlotDecoder, prompts: list[list[int]], slots: list[list[int]]) -> torch.Tensor:
        prefilled.append(len(prompts))
        assert sum(len(group) for group in slots) >= len(prompts)
        return original(self, prompts, slots)

    monkeypatch.setattr(SlotDecoder, "prefill", counting)
    engine = engine_for(gqa_llama())
    result = submit(engine, "group", [1, 5, 6, 7], sampling(temperature=1.0, n=8, max_new_tokens=6, seed=5))
    assert result.done.wait(10)
    assert prefilled == [1]
    assert len({tuple(c.token_ids) for c in result.completions}) > 1  # eight samples, not one copied


@pytest.fixture
def admissions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of samples each admission (prefill) of the continuous batch took in."""
    taken: list[int] = []
    original = ContinuousBatch.admit

    def counting(self: ContinuousBatch, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        taken.append(len(rows))
        return original(self, rows)

    monkeypatch.setattr(ContinuousBatch, "admit", counting)
    return taken


def test_requests_arriving_within_the_window_start_as_one_batch(engine_for, admissions: list[int]) -> None:
    engine = engine_for(gqa_llama(), max_batch_size=256, batch_wait_s=2.0)
    config = sampling(temperature=1.0, n=24, max_new_tokens=4, seed=1, ignore_eos=True)
    results = []
    for index in range(3):
        results.append(submit(engine, f"w{index}", [1, 5 + index, 6], config))
        time.sleep(0.05)  # later groups arrive while the idle engine waits for its batch to fill
    assert all(result.done.wait(30) for result in results)
    assert admissions == [72]  # beyond the 64 samples a batch used to be held to


def test_the_token_budget_holds_back_what_does_not_fit_and_changes_no_sample(
    engine_for, admissions: list[int]
) -> None:
    """Requests of 4 samples needing 4 + 12 positions each, under a budget of 8 samples of 16:
    two requests start, the third waits for room; seeded samples are the same as in one batch."""
    model = gqa_llama()
    prompts = [[1, 5, 6, 7], [1, 8, 9, 10], [1, 11, 12, 13]]
    tokens = []
    for budget in (8 * 16, 0):
        engine = engine_for(model, max_batch_size=64, batch_wait_s=2.0, max_batch_tokens=budget)
        configs = [
            sampling(temperature=1.0, n=4, max_new_tokens=12, seed=s, ignore_eos=True) for s in (1, 2, 3)
        ]
        results = [
            submit(engine, f"t{i}", p, c) for i, (p, c) in enumerate(zip(prompts, configs, strict=True))
        ]
        assert all(result.done.wait(30) for result in results)
        tokens.append([sorted(c.token_ids for c in result.completions) for result in results])
        engine.shutdown()
    assert admissions == [8, 4, 12]
    assert tokens[0] == tokens[1]


def test_a_model_the_slot_decoder_does_not_know_runs_in_static_batches(engine_for) -> None:
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=60, n_positions=128)).eval()
    engine = engine_for(gpt2)
    prompts = [[1, 2, 3], [4, 5]]
    configs = [sampling(temperature=1.0, max_new_tokens=8, seed=i, ignore_eos=True) for i in range(2)]
    results = [submit(engine, f"g{i}", p, c) for i, (p, c) in enumerate(zip(prompts, configs, strict=True))]
    for result in results:
        assert result.done.wait(10)
    responses = [r.completions[0].token_ids for r in results]
    expected = trainer_logprobs(gpt2, prompts, responses)
    for result, want in zip(results, expected, strict=True):
        assert result.completions[0].logprobs == pytest.approx(want, abs=1e-4)
    assert engine._batch is None  # the static path served it


def test_weights_load_on_one_thread_and_the_worker_keeps_its_own(
    engine_for, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Torch work off the worker (reading a checkpoint) runs on one core, so that the worker's
    OpenMP team stays the only one (see torch/model.serial_torch); the worker keeps the
    thread count the engine was made with."""
    import services.rollout.torch.model as torch_backend

    threads_seen: dict[str, int] = {}
    for name in ("load_model", "read_verified_state_dict"):
        original = getattr(torch_backend, name)

        def recording(*args: object, _original=original, _name=name, **kwargs: object) -> object:
            threads_seen[_name] = torch.get_num_threads()
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch_backend, name, recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = gqa_llama()
        engine = engine_for(model)  # a new architecture: load_model
        assert engine.threads == 2
        path = tmp_path / "same"
        model.save_pretrained(path, safe_serialization=True)
        engine.load_checkpoint(
            path, sha256=file_sha256(path / WEIGHTS_FILE), version=1, job_id="job",
            mode=rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE, timeout_s=30,
        )  # fmt: skip
        assert torch.get_num_threads() == 2  # the caller's count came back
        config = sampling(temperature=1.0, max_new_tokens=3, seed=1, ignore_eos=True)
        worker_threads: list[int] = []
        collected = Collected()
        collected.expected = 1

        def on_completion(completion: Completion) -> None:
            worker_threads.append(torch.get_num_threads())
            collected(completion)

        engine.submit(GenerationRequest("threads", [1, 5, 6], config, on_completion))
        assert collected.done.wait(10)
    finally:
        torch.set_num_threads(before)
    assert threads_seen == {"load_model": 1, "read_verified_state_dict": 1}
    assert worker_threads == [2]
