"""Relative paths of a submitted spec are made absolute on the submitter's side."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import parse_job_spec
from services.common.spec_paths import absolute_paths


def test_relative_local_paths_become_absolute_against_the_base(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    spec = parse_job_spec(
        {
            "model": {"path": "model", "lora": {"init_from": "adapters/a"}},
            "data": {"train": "jsonl:data/train.jsonl", "eval": "data/eval.jsonl"},
            "eval": {"sets": {"hard": {"location": "../shared/hard.jsonl"}}},
            "trainer": {"checkpoint_dir": "runs/mine"},
        }
    )
    done = absolute_paths(spec, tmp_path)
    assert done.model.path == str(tmp_path / "model")
    assert done.model.lora is not None and done.model.lora.init_from == str(tmp_path / "adapters" / "a")
    assert done.data.train == f"jsonl:{tmp_path / 'data' / 'train.jsonl'}"  # the source's prefix stays
    assert done.data.eval == str(tmp_path / "data" / "eval.jsonl")
    assert done.eval.sets["hard"].location == str(tmp_path / ".." / "shared" / "hard.jsonl")
    assert done.trainer.checkpoint_dir == str(tmp_path / "runs" / "mine")


def test_what_is_not_a_relative_local_path_stays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no `org/model` directory here: a hub id
    spec = parse_job_spec(
        {
            "model": {"path": "org/model", "tokenizer": "/abs/tokenizer"},
            "data": {"train": "builtin:addition", "eval": "reasoning_gym:chain_sum"},
        }
    )
    assert absolute_paths(spec, tmp_path) is spec
    default_runs = absolute_paths(parse_job_spec({"data": {"train": "t.jsonl"}}), tmp_path)
    assert default_runs.trainer.checkpoint_dir == "runs"  # not set by the spec: the api's default


def test_home_is_expanded_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    spec = absolute_paths(parse_job_spec({"data": {"train": "~/prompts.jsonl"}}), Path("/elsewhere"))
    assert spec.data.train == str(tmp_path / "prompts.jsonl")


def test_the_default_base_is_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec = absolute_paths(parse_job_spec({"data": {"train": "p.jsonl"}}))
    assert spec.data.train == str(tmp_path / "p.jsonl")
