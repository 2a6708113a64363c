"""The prompt feed: too-long prompts are skipped, but a source with none that fits is an error, not a spin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.common.config import parse_job_spec
from services.controller import feed as job_feed
from services.controller.feed import PromptFeed
from services.data import DataError


class CharTokenizer:
    """One id per character, no BOS: a prompt's length in tokens is its length in characters."""

    bos_token_id = None

    def __call__(self, text: str, *, add_special_tokens: bool) -> dict[str, Any]:
        return {"input_ids": [ord(c) % 1000 for c in text]}


def feed_of(tmp_path: Path, prompts: list[str], max_prompt_tokens: int) -> PromptFeed:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    spec = parse_job_spec(
        {
            "data": {
                "train": str(path),
                "eval": None,
                "shuffle": False,
                "max_prompt_tokens": max_prompt_tokens,
            },
            "rollout": {"prompts_per_step": 2},
        }
    )
    return PromptFeed(spec, "job-1", CharTokenizer())


def test_long_prompts_are_skipped_and_the_rest_issued(tmp_path: Path) -> None:
    feed = feed_of(tmp_path, ["short", "x" * 50, "tiny"], max_prompt_tokens=10)
    assert [task.prompt_text for task in feed.batch(0)] == ["short", "tiny"]


def test_a_source_where_no_prompt_fits_raises_instead_of_spinning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_feed, "MAX_SKIPPED_IN_A_ROW", 50)
    feed = feed_of(tmp_path, ["x" * 20, "y" * 30], max_prompt_tokens=10)  # an endless cycle of two
    with pytest.raises(DataError, match="50 training prompts in a row are longer than 10 tokens"):
        feed.batch(0)


def test_the_bound_counts_a_run_not_a_total(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job_feed, "MAX_SKIPPED_IN_A_ROW", 3)
    feed = feed_of(tmp_path, ["x" * 20, "y" * 20, "ok"], max_prompt_tokens=10)  # 2 long, 1 fits, repeat
    assert [task.prompt_text for _ in range(5) for task in feed.batch(0)] == ["ok"] * 10
