"""Causal-LM families other than Llama through the torch engine and the trainer: GPT-2 (absolute
position embeddings; the general decode path, transformers' forward), Qwen2 and Qwen3 (the fast
path, the slot decoder). The engine says which path it runs (EngineInfo.decode_path), its
logprobs equal an independent forward pass, the trainer's packed and shared-prompt layouts give
the engine's logprobs back, and a trainer step on trajectories sampled by the general path is the
step on those sampled by the fast path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from services.common.config import parse_job_spec
from services.common.pb import rollout_pb2
from services.rollout.servicer import EngineInfoSource
from services.rollout.torch import engine as torch_engine
from services.rollout.torch import model as torch_model
from services.rollout.torch.engine import TorchEngine
from services.rollout.weights import WEIGHTS_FILE, file_sha256
from services.tasks.addition_model import build_char_tokenizer
from services.trainer.batching import TrainSample
from services.trainer.policy import Policy, init_distributed
from tests.integration.test_continuous_batching import sampling, submit

CPU = torch.device("cpu")
VOCAB = 100
PROMPTS = [[1, 20, 21, 22, 23, 24], [1, 30, 31], [1, 40, 41, 42, 43, 44, 45, 46, 47]]
SAMPLES = 3
"""Samples per prompt: the trainer lays them out with their prompt shared."""
SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # fmt: skip


def build(kind: str) -> PreTrainedModel:
    torch.manual_seed(7)
    if kind == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
        return GPT2LMHeadModel(config).eval()
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SIZES)).eval()
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=16)).eval()
    raise ValueError(kind)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family as a checkpoint directory, with the character tokenizer the trainer loads."""
    dirs = {}
    for kind in ("gpt2", "qwen2", "qwen3"):
        directory = tmp_path_factory.mktemp(kind)
        build(kind).save_pretrained(directory)
        build_char_tokenizer().save_pretrained(directory)
        dirs[kind] = directory
    return dirs


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Start an engine on a directory; ``general=True`` forces the general decode path."""
    engines: list[TorchEngine] = []

    def start(path: Path, *, general: bool = False) -> TorchEngine:
        if general:
            forced = lambda model: "forced by the test"  # noqa: E731
            monkeypatch.setattr(torch_engine, "unsupported_reason", forced)
            monkeypatch.setattr(torch_model, "unsupported_reason", forced)
        engine = TorchEngine(device=CPU, dtype=None, max_batch_size=16, batch_wait_s=0.0)
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


def generate(engine: TorchEngine, **settings: object) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, tokens, logprobs) of SAMPLES samples of every prompt."""
    config = sampling(n=SAMPLES, max_new_tokens=12, ignore_eos=True, **settings)
    results = [submit(engine, f"r{i}", prompt, config) for i, prompt in enumerate(PROMPTS)]
    found = []
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.done.wait(60)
        for completion in sorted(result.completions, key=lambda c: c.index):
            found.append((prompt, list(completion.token_ids), list(completion.logprobs)))
    return found


def forward_logprobs(path: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    """log p of ``tokens`` after ``prompt``, from one plain transformers forward pass."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + j, token]) for j, token in enumerate(tokens)]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(("kind", "path"), [("gpt2", "general"), ("qwen2", "fast"), ("qwen3", "fast")])
def test_the_engine_says_its_path_and_samples_with_true_logprobs(
    serve, model_dirs: dict[str, Path], kind: str, path: str
) -> None:
    engine = serve(model_dirs[kind])
    info = EngineInfoSource(engine, "engine-a", "node:1")()
    assert (info.decode_path, bool(info.decode_path_reason)) == (path, path == "general")
    if kind == "gpt2":
        assert "model_type 'gpt2'" in info.decode_path_reason
    samples = generate(engine, temperature=1.0, seed=3)
    worst = max(
        abs(got - want)
        for prompt, tokens, logprobs in samples
        for got, want in zip(logprobs, forward_logprobs(model_dirs[kind], prompt, tokens), strict=True)
    )
    assert worst <= 1e-4, worst


def train_steps(path: Path, samples: list[tuple[list[int], list[int], list[float]]]) -> tuple[Policy, list]:
    """Three trainer steps on engine samples (advantage +1 for the first of each prompt's, -1 for
    the others), samples packed with their prompt shared; the policy and each step's stats."""
    init_distributed(CPU)
    spec = parse_job_spec(
        {
            "model": {"path": str(path)},
            "algorithm": {"group_size": SAMPLES},
            "trainer": {"learning_rate": 3e-3, "micro_batch_tokens": 64, "max_grad_norm": None},
        }
    )
    policy = Policy.load(spec, path, path, CPU)
    batch = [
        TrainSample(prompt, tokens, [True] * len(tokens), logprobs, 1.0 if i % SAMPLES == 0 else -1.0)
        for i, (prompt, tokens, logprobs) in enumerate(samples)
    ]
    return policy, [policy.optimise(batch, seed=step) for step in range(3)]


@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
def test_the_trainer_learns_on_engine_samples_in_its_packed_shared_layout(
    serve, model_dirs: dict[str, Path], kind: str
) -> None:
    samples = generate(serve(model_dirs[kind]), temperature=1.0, seed=5)
    policy, stats = train_steps(model_dirs[kind], samples)
    try:
        assert policy.packed and policy.shared  # GPT-2's absolute positions restart per sample too
        assert stats[0].mismatch_kl <= 1e-6  # the trainer's logprobs are the engine's
        batch = [TrainSample(p, t, [True] * len(t), lp, 0.0) for p, t, lp in samples]
        after = policy.response_logprobs(batch)
    finally:
        policy.close()
    assert stats[-1].loss < stats[0].loss
    for i, ((_, _, before), now) in enumerate(zip(samples, after, strict=True)):
        change = sum(now) - sum(before)
        assert change > 0 if i % SAMPLES == 0 else change < 0


def test_a_step_on_the_general_paths_samples_is_the_step_on_the_fast_paths(
    serve, model_dirs: dict[str, Path]
) -> None:
    """Qwen2 greedy on both paths: the same tokens, logprobs within 1e-4, and trainer steps on
    either set of trajectories with the same losses and the same weights after."""
    fast = generate(serve(model_dirs["qwen2"]), temperature=0.0)
    general_engine = serve(model_dirs["qwen2"], general=True)
    assert general_engine.status().decode_path == "general"
    general = generate(general_engine, temperature=0.0)
    assert [tokens for _, tokens, _ in general] == [tokens for _, tokens, _ in fast]
    for (_, _, a), (_, _, b) in zip(fast, general, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4
    results = []
    for samples in (fast, general):
        policy, stats = train_steps(model_dirs["qwen2"], samples)
        try:
            weights = {name: p.detach().clone() for name, p in policy.engine.module.named_parameters()}
        finally:
            policy.close()
        results.append(([s.loss for s in stats], weights))
    (fast_losses, fast_weights), (general_losses, general_weights) = results
    assert general_losses == pytest.approx(fast_losses, abs=1e-4)
    for name, weight in fast_weights.items():
        torch.testing.assert_close(general_weights[name], weight, rtol=0, atol=1e-4)
