"""The cache of builtin models: path resolution, the registered recipes' hashes, incomplete builds,
the build lock (exercised with a tiny addition recipe, in seconds)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path

import filelock
import pytest

from services.models import resolve_model_path
from services.tasks import ModelPathError, builtin_model, ensure_builtin_model
from services.tasks.addition import WarmupRecipe
from services.tasks.models import STAMP_FILE, build_into_place, cached_model_paths, read_stamp
from services.tasks.multiply import ToolRecipe
from services.tasks.reverse import ReverseRecipe

TINY = WarmupRecipe(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, steps=3, batch_size=8
)
"""Same code path as the real addition recipe, a thousandth of the work."""


def test_registered_recipe_hashes_are_pinned() -> None:
    """Each hash names a cached model directory: changing one rebuilds every cached copy, so it
    must be deliberate (raise FORMAT_VERSION when the build code changes what it produces)."""
    addition, multiply = builtin_model("addition").recipe, builtin_model("multiply").recipe
    reverse = builtin_model("reverse").recipe
    assert addition == WarmupRecipe() and multiply == ToolRecipe() and reverse == ReverseRecipe()
    assert addition.digest("addition") == "914c47e75114"
    assert multiply.digest("multiply") == "b613914fdeac"
    assert reverse.digest("reverse") == "bd851c686c39"


def test_resolve_model_path_errors(tmp_path: Path) -> None:
    known = r"known: builtin:addition, builtin:multiply, builtin:reverse$"
    with pytest.raises(ModelPathError, match=rf"unknown builtin model 'nope'; {known}"):
        resolve_model_path("builtin:nope")
    with pytest.raises(ModelPathError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelPathError, match=r"is a file: a model path is a directory or a \.gguf file"):
        resolve_model_path(str(tmp_path / "file"))
    assert resolve_model_path(str(tmp_path)) == tmp_path.resolve()


def test_the_public_api_imports_no_torch(python: str, python_env: dict[str, str]) -> None:
    """The api and reward services read prompts and scorers without loading torch."""
    code = (
        "import sys, services.tasks, services.tasks.addition, services.tasks.multiply\n"
        "import services.tasks.reverse\n"
        "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))\n"
    )
    result = subprocess.run([python, "-c", code], env=python_env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


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
        "from services.tasks import ensure_builtin_model\n"
        "from services.tasks.addition import WarmupRecipe\n"
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
        tiny_model = dataclasses.replace(builtin_model("addition"), recipe=TINY)
        build_into_place("addition", tiny_model, model_dir, progress=False)
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
