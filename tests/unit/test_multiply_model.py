"""builtin:multiply: its tokenizer, its warm-up transcripts (as the runner parses and renders
them), the determinism of its recipe, its cache, and a model that learns to emit a call."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from services.common.config import RolloutConfig
from services.data import encode_prompt
from services.models import resolve_model_path
from services.runner.episode import render_observation
from services.runner.toolcalls import formats_of, parse_tool_calls
from services.tasks import ensure_builtin_model, multiply_model
from services.tasks.models import STAMP_FILE, Recipe, read_stamp
from services.tasks.multiply import (
    MultiplyProblem,
    ToolRecipe,
    encode_transcript,
    guess_transcript,
    multiply_eval_problems,
    python_code_of,
    tool_transcript,
    warmup_transcripts,
)
from services.tasks.multiply_model import END_OF_CALL, build_tool_tokenizer, tool_llama_config, warm_up_tools
from services.tasks.tiny_llama import generate_texts

TINY = ToolRecipe(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    steps=2,
    batch_size=4,
    check_prompts=2,
)
"""Same code path as the real recipe, a tiny fraction of the work."""
PROBLEM = MultiplyProblem(347, 829)
OBSERVATION = RolloutConfig().tool_observation


def test_tokenizer_covers_every_transcript_character(tmp_path: Path) -> None:
    built = build_tool_tokenizer()
    built.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == len(built) == 4 + 96
    segments = tool_transcript(PROBLEM, OBSERVATION)
    text = PROBLEM.prompt + "".join(piece for piece, _ in segments)
    assert "\n" in text and '{"name": "python"' in text
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert loaded.unk_token_id not in ids
    assert len(ids) == len(text)  # one token per character
    assert loaded.decode(ids) == text  # decoded exactly: no space clean-up, newlines kept
    assert loaded.decode([1, *ids, 2], skip_special_tokens=True) == text
    assert loaded("é", add_special_tokens=False)["input_ids"] == [loaded.unk_token_id]


def test_tool_transcript_is_what_the_runner_parses_and_renders() -> None:
    call, observation, answer = tool_transcript(PROBLEM, OBSERVATION)
    assert call == (
        '<tool_call>{"name": "python", "arguments": {"code": "print(347*829)"}}</tool_call>',
        True,
    )
    for fmt in ("hermes", "auto"):
        [parsed] = parse_tool_calls(call[0], formats_of(fmt))
        assert (parsed.name, parsed.arguments, parsed.error) == ("python", {"code": "print(347*829)"}, "")
    assert observation == (render_observation(OBSERVATION, "287663\n"), False)
    assert observation[0] == "<tool_response>\n287663\n\n</tool_response>\n"
    assert answer == ("287663", True)
    assert python_code_of(call[0]) == "print(347*829)"


def test_guesses_are_wrong_answers_that_call_nothing() -> None:
    assert guess_transcript(PROBLEM) == [("347829", True)]
    for problem in multiply_eval_problems():
        [(guess, model)] = guess_transcript(problem)
        assert model and guess.isdigit() and guess != problem.answer
        assert parse_tool_calls(guess, formats_of("auto")) == []
        assert python_code_of(guess) is None


def test_encoded_transcript_puts_only_model_tokens_in_the_loss() -> None:
    tokenizer = build_tool_tokenizer()
    segments = tool_transcript(PROBLEM, OBSERVATION)
    ids, in_loss = encode_transcript(tokenizer, PROBLEM.prompt, segments)
    call, observation, answer = (piece for piece, _ in segments)
    prompt_ids = encode_prompt(tokenizer, PROBLEM.prompt)
    assert ids[: len(prompt_ids)] == prompt_ids and ids[-1] == tokenizer.eos_token_id
    model_text = "".join(tokenizer.decode([i]) for i, keep in zip(ids, in_loss, strict=True) if keep)
    assert model_text == call + answer + "</s>"
    hidden = tokenizer.decode(
        [i for i, keep in zip(ids[len(prompt_ids) :], in_loss[len(prompt_ids) :], strict=True) if not keep]
    )
    assert hidden == observation


def test_warmup_data_is_deterministic_and_mixes_tool_use_at_p_tool() -> None:
    tokenizer = build_tool_tokenizer()
    first = list(itertools.islice(warmup_transcripts(ToolRecipe(), tokenizer), 400))
    again = list(itertools.islice(warmup_transcripts(ToolRecipe(), tokenizer), 400))
    assert first == again
    other = list(itertools.islice(warmup_transcripts(ToolRecipe(label_seed=9), tokenizer), 400))
    assert other != first
    tool_rows = sum(
        1 for ids, in_loss in first if not all(in_loss[len(encode_prompt(tokenizer, "What is 100*100?")) :])
    )
    assert 0.33 <= tool_rows / len(first) <= 0.47  # p_tool = 0.4


def test_recipe_digest_names_the_recipe() -> None:
    assert ToolRecipe().digest("multiply") == ToolRecipe().digest("multiply")
    assert dataclasses.replace(ToolRecipe(), p_tool=0.5).digest("multiply") != ToolRecipe().digest("multiply")
    assert ToolRecipe().digest("multiply") != ToolRecipe().digest("other")


def test_build_is_cached_deterministic_and_resolves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, builtin_recipe: Callable[[str, Recipe], None]
) -> None:
    first = ensure_builtin_model("multiply", tmp_path / "a", recipe=TINY, progress=False)
    second = ensure_builtin_model("multiply", tmp_path / "b", recipe=TINY, progress=False)
    weights_a, weights_b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert first.name == f"multiply-{TINY.digest('multiply')}"
    stamp = read_stamp(first)
    assert stamp is not None and stamp["recipe_hash"] == TINY.digest("multiply")
    for rate in ("sampled_tool_call_rate", "correct_call_rate", "copy_accuracy", "simulated_reward"):
        assert 0.0 <= stamp[rate] <= 1.0
    assert {"model.safetensors", "tokenizer.json", STAMP_FILE} <= {p.name for p in first.iterdir()}
    assert AutoTokenizer.from_pretrained(first)("\n", add_special_tokens=False)["input_ids"] == [4]

    # builtin:multiply resolves through the task catalog to this cache, without building again.
    monkeypatch.setenv("VERST_CACHE", str(tmp_path / "a"))
    builtin_recipe("multiply", TINY)
    monkeypatch.setattr(
        multiply_model, "build_tool_model", lambda *a, **k: pytest.fail("rebuilt a cached model")
    )
    assert resolve_model_path("builtin:multiply") == first


def test_a_short_warm_up_emits_parseable_tool_calls() -> None:
    """Only tool-use transcripts, a small model, 80 steps (a few seconds): greedy first turns
    are calls the runner's parser reads, with python code."""
    recipe = ToolRecipe(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, steps=80, batch_size=8, p_tool=1.0
    )
    tokenizer = build_tool_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(tool_llama_config(recipe, tokenizer))
        warm_up_tools(model, tokenizer, recipe, progress=False)
        problems = multiply_eval_problems()[:8]
        prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
        turns = generate_texts(model, tokenizer, prompts, 90, sample=False, cut_after=END_OF_CALL)
    calls = [parse_tool_calls(turn, formats_of("hermes")) for turn in turns]
    well_formed = [c for c in calls if len(c) == 1 and not c[0].error and c[0].name == "python"]
    assert len(well_formed) >= 6, turns
    assert all(isinstance(c[0].arguments.get("code"), str) for c in well_formed)
