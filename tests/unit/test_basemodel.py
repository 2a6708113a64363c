"""Builtin models: the tokenizer, path resolution, and the build cache (with a tiny recipe, in seconds)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path

import filelock
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from services.common import basemodel
from services.tasks.basemodel import (
    STAMP_FILE,
    ModelPathError,
    WarmupRecipe,
    build_char_tokenizer,
    cached_model_paths,
    carry_dropped_answer,
    ensure_builtin_model,
    read_stamp,
    resolve_model_path,
)
from services.tasks.catalog import AdditionProblem, encode_prompt

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


def test_resolve_model_path_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelPathError, match=r"unknown builtin model 'nope'; known: builtin:addition"):
        resolve_model_path("builtin:nope")
    with pytest.raises(ModelPathError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelPathError, match="is not a directory"):
        resolve_model_path(str(tmp_path / "file"))
    assert resolve_model_path(str(tmp_path)) == tmp_path.resolve()


def test_builtin_model_is_built_once_and_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERST_CACHE", str(tmp_path))
    monkeypatch.setitem(basemodel.BUILTIN_MODELS, "addition", TINY)
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

    monkeypatch.setattr(basemodel, "build_model", no_build)
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


def test_incomplete_and_leftover_directories_are_replaced(tmp_path: Path) -> None:
    model_dir, _ = cached_model_paths("addition", TINY, tmp_path)
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")  # no verst.json: not a finished build
    leftover = model_dir.parent / f".{model_dir.name}.tmp-99999"
    leftover.mkdir()
    assert ensure_builtin_model("addition", tmp_path, recipe=TINY, progress=False) == model_dir
    assert read_stamp(model_dir) is not None
    assert not leftover.exists()


def test_lock_wait_has_a_deadline(tmp_path: Path) -> None:
    _, lock_path = cached_model_paths("addition", TINY, tmp_path)
    lock_path.parent.mkdir(parents=True)
    with (
        filelock.FileLock(str(lock_path)),
        pytest.raises(TimeoutError, match=r"waited 0\.2s for another process"),
    ):
        ensure_builtin_model("addition", tmp_path, recipe=TINY, progress=False, lock_timeout_s=0.2)


def wait_for_line(proc: subprocess.Popen[str], needle: str, deadline_s: float) -> list[str]:
    """Read ``proc``'s output until a line contains ``needle``; fail at the deadline or at EOF."""
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    pytest.fail(f"no line with {needle!r} within {deadline_s}s:\n{''.join(seen)}")


@pytest.mark.slow
def test_a_second_process_waits_for_the_build_and_reuses_it(
    tmp_path: Path, python: str, python_env: dict[str, str]
) -> None:
    model_dir, lock_path = cached_model_paths("addition", TINY, tmp_path)
    lock_path.parent.mkdir(parents=True)
    code = (
        "import logging, sys\n"
        "from pathlib import Path\n"
        "from services.tasks.basemodel import WarmupRecipe, ensure_builtin_model\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        f"recipe = WarmupRecipe(**{TINY.__dict__!r})\n"
        f"path = ensure_builtin_model('addition', Path({str(tmp_path)!r}), recipe=recipe)\n"
        "print('PATH', path, flush=True)\n"
    )
    lock = filelock.FileLock(str(lock_path))
    lock.acquire()  # this test plays the process that builds first
    proc = subprocess.Popen(
        [python, "-c", code], env=python_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for_line(proc, "waiting up to", deadline_s=60)
        basemodel._build_into_place("addition", TINY, model_dir, progress=False)
        built_at = json.loads((model_dir / STAMP_FILE).read_text())["built_at"]
        lock.release()
        output, _ = proc.communicate(timeout=60)
    finally:
        lock.release()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output
    assert f"PATH {model_dir}" in output
    assert "building builtin model" not in output
    assert json.loads((model_dir / STAMP_FILE).read_text())["built_at"] == built_at
