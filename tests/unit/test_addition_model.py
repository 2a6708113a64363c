"""builtin:addition: its tokenizer, its warm-up labels, and a build with a tiny recipe (in seconds)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from services.data import encode_prompt
from services.models import resolve_model_path
from services.tasks import addition_model, ensure_builtin_model
from services.tasks.addition import AdditionProblem, WarmupRecipe, carry_dropped_answer
from services.tasks.addition_model import build_char_tokenizer
from services.tasks.models import STAMP_FILE, Recipe, cached_model_paths, read_stamp

TINY = WarmupRecipe(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, steps=3, batch_size=8
)
"""Same code path as the real recipe, a thousandth of the work."""


def test_char_tokenizer_round_trips_through_auto_tokenizer(tmp_path: Path) -> None:
    built = build_char_tokenizer()
    built.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == len(built) == 4 + 95
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id, loaded.unk_token_id) == (
        0,
        1,
        2,
        3,
    )
    text = "Hello, world! 47+85=231 ~"
    ids = loaded(text)["input_ids"]
    assert ids == built(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character, no special tokens added
    assert loaded.decode(ids) == text
    assert encode_prompt(loaded, "12+34=") == [1, *(ord(c) - 32 + 4 for c in "12+34=")]
    assert loaded.decode([1, *ids, 2], skip_special_tokens=True) == text
    assert loaded("é")["input_ids"] == [3]  # outside printable ASCII: unknown


def test_carry_dropped_answer() -> None:
    assert carry_dropped_answer(AdditionProblem(47, 85)) == "22"  # correct: "231"
    assert carry_dropped_answer(AdditionProblem(12, 34)) == "64"  # no carry: equals the answer
    assert carry_dropped_answer(AdditionProblem(46, 14)) == "05"


def test_builtin_model_is_built_once_and_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, builtin_recipe: Callable[[str, Recipe], None]
) -> None:
    monkeypatch.setenv("VERST_CACHE", str(tmp_path))
    builtin_recipe("addition", TINY)
    model_dir = resolve_model_path("builtin:addition")
    assert model_dir == cached_model_paths("addition", TINY, tmp_path)[0]
    assert model_dir.name == f"addition-{TINY.digest('addition')}"
    assert {"model.safetensors", "config.json", "tokenizer.json", STAMP_FILE} <= {
        p.name for p in model_dir.iterdir()
    }
    stamp = read_stamp(model_dir)
    assert stamp is not None
    assert stamp["recipe_hash"] == TINY.digest("addition")
    assert stamp["recipe"]["steps"] == 3
    assert 0.0 <= stamp["eval_greedy_accuracy"] <= 1.0
    assert stamp["eval_prompts"] == 1000
    assert stamp["build_seconds"] > 0
    model = LlamaForCausalLM.from_pretrained(model_dir)
    assert model.config.hidden_size == 16
    assert AutoTokenizer.from_pretrained(model_dir).eos_token_id == 2

    # A second call reuses the directory: building again would fail.
    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(addition_model, "build_addition_model", no_build)
    assert resolve_model_path("builtin:addition") == model_dir
    assert list(tmp_path.joinpath("models").glob(".*tmp*")) == []


def test_build_is_deterministic_and_recipe_changes_rebuild(tmp_path: Path) -> None:
    first = ensure_builtin_model("addition", tmp_path / "a", recipe=TINY, progress=False)
    second = ensure_builtin_model("addition", tmp_path / "b", recipe=TINY, progress=False)
    weights_a = load_file(first / "model.safetensors")
    weights_b = load_file(second / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)

    changed = dataclasses.replace(TINY, p_correct=0.5)
    assert changed.digest("addition") != TINY.digest("addition")
    third = ensure_builtin_model("addition", tmp_path / "a", recipe=changed, progress=False)
    assert third != first
    assert sorted(
        p.name for p in (tmp_path / "a" / "models").iterdir() if not p.name.startswith(".")
    ) == sorted([first.name, third.name])


def test_only_the_addition_recipe_builds_here(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no warm-up for task 'multiply'"):
        addition_model.build_addition_model(
            "addition", dataclasses.replace(TINY, task="multiply"), tmp_path, progress=False
        )
