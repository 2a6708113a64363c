"""Helpers of the LoRA and export tests: a tiny base model, LoRA job specs, logprobs and greedy
tokens under an adapter computed with peft itself, and an engine's view of a handle."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from services.common.pb import common_pb2, rollout_pb2
from services.tasks.addition_model import build_char_tokenizer
from tests.integration.rollout_helpers import RunningEngine, generate_request, tiny_llama
from tests.integration.test_trainer import job_spec

LORA = {"rank": 4, "alpha": 8.0}
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}={% endfor %}"
"""The base model's chat template: exports keep it."""
PROMPTS = [[1, 5, 6, 7, 8], [1, 20, 21], [1, 30, 31, 32, 33, 34], [1, 40]]


def build_base(directory: Path) -> Path:
    """A random 2-layer Llama (hidden 32) with the 99-token character vocabulary, saved."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tiny_llama(0, heads=2, max_positions=64, vocab=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def lora_spec(
    model_dir: Path, runs: Path, lora: dict[str, Any] | None = None, **trainer: Any
) -> dict[str, Any]:
    """test_trainer's tiny job with a LoRA adapter (``lora`` None: LORA)."""
    spec = job_spec(model_dir, runs, **({"learning_rate": 1e-2} | trainer))
    spec["model"]["lora"] = LORA if lora is None else lora
    return spec


def handle_dir(handle: common_pb2.CheckpointHandle) -> Path:
    return Path(handle.uri.removeprefix("file://"))


@functools.lru_cache(maxsize=16)
def peft_model(base: Path, adapter: Path | None) -> Any:
    """The base model with the adapter in ``adapter`` (None: none) as peft runs it, fp32, eval."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base).float().eval()
    return model if adapter is None else PeftModel.from_pretrained(model, adapter).eval()


@torch.no_grad()
def adapter_logprobs(base: Path, adapter: Path | None, prompt: list[int], response: list[int]) -> list[float]:
    """log p of each response token under base + adapter, with peft's LoRA layers."""
    logits = peft_model(base, adapter)(torch.tensor([prompt + response])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + j, token]) for j, token in enumerate(response)]


async def engine_greedy(
    engine: RunningEngine, handle: common_pb2.CheckpointHandle, tokens: int = 12
) -> list[list[int]]:
    """The engine's greedy answer to each of PROMPTS once it serves ``handle`` (LoadWeights)."""
    await engine.stub.LoadWeights(rollout_pb2.LoadWeightsRequest(handle=handle), timeout=60)
    answers = []
    for prompt in PROMPTS:
        request = generate_request(prompt, temperature=0, max_new_tokens=tokens, ignore_eos=True)
        reply = await engine.stub.Generate(request, timeout=30)
        answers.append(list(reply.completions[0].token_ids))
    return answers


@torch.no_grad()
def hf_greedy(model: Any, tokens: int = 12) -> list[list[int]]:
    """Greedy answers to PROMPTS by full forward passes of ``model`` (a transformers or peft model),
    EOS no stop, like the engine's with ignore_eos."""
    answers = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(tokens):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        answers.append(ids[len(prompt) :])
    return answers
