"""docs/extending.md stays true: each snippet is its example's own code, each job fragment a
valid JobSpec, each recipe names tests that exist (and that run it)."""

from __future__ import annotations

import ast
import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.config import parse_job_spec

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "extending.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
SOURCE_LINE = re.compile(r"^(?:#|//) ((?:examples|services|tests)/[\w./-]+)\n")
TESTED_BY = re.compile(r"Tested by: (.*?)(?:\n\n|\Z)", re.S)


def recipes() -> list[tuple[str, str]]:
    """(title, text) of each `## ` section of the page."""
    parts = re.split(r"^## ", PAGE.read_text(), flags=re.M)[1:]
    return [(part.split("\n", 1)[0], part) for part in parts]


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(PAGE.read_text()) if lang == language]


def merged(base: dict[str, Any], fragment: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in fragment.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def test_the_page_has_a_recipe_for_each_thing_users_add() -> None:
    titles = [title for title, _ in recipes()]
    for wanted in ("A reward function", "A verifier service in another language", "An advantage estimator",
                   "A policy loss", "A data source", "A rollout strategy", "An engine backend"):  # fmt: skip
        assert wanted in titles


@pytest.mark.parametrize(
    "snippet", blocks("python") + blocks("javascript"), ids=lambda s: s.split("\n", 1)[0]
)
def test_every_snippet_is_its_files_own_code(snippet: str) -> None:
    source = SOURCE_LINE.match(snippet)
    assert source, f"a snippet must start with the file it comes from:\n{snippet}"
    code = snippet[source.end() :]
    assert code.strip() in (ROOT / source.group(1)).read_text(), f"not in {source.group(1)}:\n{code}"


@pytest.mark.parametrize("fragment", blocks("yaml"), ids=lambda s: s.split("\n", 1)[0])
def test_every_job_fragment_is_a_valid_job_spec(fragment: str) -> None:
    base = yaml.safe_load((ROOT / "examples" / "addition.yaml").read_text())
    parse_job_spec(merged(base, yaml.safe_load(fragment)), "docs/extending.md")


def test_no_recipe_is_left_unwritten() -> None:
    assert not re.search(r"\b[A-Z]+_(SNIPPET|TEST)\b", PAGE.read_text())


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


@pytest.mark.parametrize(("title", "text"), recipes(), ids=[title for title, _ in recipes()])
def test_every_recipe_names_tests_that_exist(title: str, text: str) -> None:
    tested = TESTED_BY.search(text)
    assert tested, f"{title}: no 'Tested by:' line"
    names = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", tested.group(1))
    assert names, f"{title}: 'Tested by:' names no test"
    for path, test in names:
        assert test in defined_tests(ROOT / path), f"{title}: {path} has no {test}"
