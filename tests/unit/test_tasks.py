"""Prompt sources: the addition task's splits and verifier, prompt encoding, JSONL files."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from services.common.config import DataConfig
from services.data import (
    DataError,
    PromptExample,
    PromptTooLongError,
    encode_prompt,
    eval_prompts,
    read_jsonl_prompts,
    train_prompts,
)
from services.tasks import TASKS, get_task
from services.tasks.addition import (
    ADDITION_EVAL_SIZE,
    AdditionProblem,
    addition_eval_problems,
    addition_train_problems,
    score_addition,
)
from services.tasks.addition_model import build_char_tokenizer


def test_answer_is_the_sum_least_significant_digit_first() -> None:
    assert AdditionProblem(47, 85).prompt == "47+85="
    assert AdditionProblem(47, 85).answer == "231"
    assert AdditionProblem(10, 10).answer == "02"
    assert AdditionProblem(99, 99).answer == "891"


def test_eval_split_is_fixed_distinct_and_in_range() -> None:
    problems = addition_eval_problems()
    assert len(problems) == ADDITION_EVAL_SIZE == len(set(problems))
    assert all(10 <= p.a <= 99 and 10 <= p.b <= 99 for p in problems)
    examples = eval_prompts(DataConfig())
    assert [e.text for e in examples] == [p.prompt for p in problems]
    assert len({e.prompt_id for e in examples}) == len(examples)
    assert eval_prompts(DataConfig(), limit=5) == examples[:5]


def test_train_split_never_yields_an_eval_problem() -> None:
    held_out = {p.prompt for p in addition_eval_problems()}
    train = [e.text for e in itertools.islice(train_prompts(DataConfig(), seed=0), 100_000)]
    assert held_out.isdisjoint(train)
    # ... and covers all the other 90 x 90 problems.
    assert len(set(train)) == 90 * 90 - ADDITION_EVAL_SIZE


def test_train_split_is_deterministic_per_seed() -> None:
    first = list(itertools.islice(addition_train_problems(3), 500))
    assert first == list(itertools.islice(addition_train_problems(3), 500))
    assert first != list(itertools.islice(addition_train_problems(4), 500))
    example = next(train_prompts(DataConfig(), seed=3))
    assert example == PromptExample("addition:train:0", first[0].prompt, first[0].answer)


@pytest.mark.parametrize(
    ("response", "reward", "fmt"),
    [
        ("231", 1.0, 1.0),
        ("  231\n", 1.0, 1.0),  # surrounding whitespace is not the model's answer
        ("132", 0.0, 1.0),  # the sum written most-significant digit first is wrong
        ("23", 0.0, 1.0),
        ("231x", 0.0, 0.0),
        ("2 31", 0.0, 0.0),
        ("", 0.0, 0.0),
    ],
)
def test_score_addition(response: str, reward: float, fmt: float) -> None:
    assert score_addition(response, "231") == (reward, {"correct": reward, "format": fmt})


def test_task_registry() -> None:
    assert get_task("addition").score is score_addition
    assert {name: (task.name, task.verifier) for name, task in TASKS.items()} == {
        "addition": ("addition", "addition"),
        "multiply": ("multiply", "multiply"),
        "reverse": ("reverse", "reverse"),
    }
    assert all(task.base_model is not None for task in TASKS.values())
    with pytest.raises(
        DataError, match=r"unknown task 'subtraction'; known tasks: addition, multiply, reverse$"
    ):
        get_task("subtraction")
    with pytest.raises(DataError, match="unknown task"):
        next(train_prompts(DataConfig(train="builtin:subtraction"), seed=0))


def test_encode_prompt_prepends_bos_once() -> None:
    tokenizer = build_char_tokenizer()
    ids = encode_prompt(tokenizer, "47+85=")
    assert ids == [tokenizer.bos_token_id, *(tokenizer.convert_tokens_to_ids(list("47+85=")))]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "47+85="
    assert encode_prompt(tokenizer, "47+85=", max_tokens=7) == ids
    with pytest.raises(PromptTooLongError, match="7 tokens, above the limit of 6"):
        encode_prompt(tokenizer, "47+85=", max_tokens=6)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_prompts(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "train.jsonl",
        [
            json.dumps({"q": "1+1=", "a": "2", "extra": [1]}),
            "",
            json.dumps({"q": "2+3=", "a": 5}),  # a JSON number answer is its text
        ],
    )
    examples = read_jsonl_prompts(path, "q", "a")
    assert examples == [
        PromptExample("train.jsonl:1", "1+1=", "2"),
        PromptExample("train.jsonl:3", "2+3=", "5"),
    ]
    data = DataConfig(train=str(path), eval=str(path), prompt_field="q", answer_field="a", shuffle=False)
    assert list(itertools.islice(train_prompts(data, seed=0), 4)) == examples * 2
    assert eval_prompts(data) == examples
    assert eval_prompts(DataConfig(eval=None)) == []


def test_jsonl_shuffle_is_seeded_per_epoch(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "p.jsonl", [json.dumps({"prompt": str(i), "answer": "x"}) for i in range(50)]
    )
    data = DataConfig(train=str(path), shuffle=True)
    first = [e.text for e in itertools.islice(train_prompts(data, seed=1), 100)]
    assert first == [e.text for e in itertools.islice(train_prompts(data, seed=1), 100)]
    assert sorted(first[:50], key=int) == [str(i) for i in range(50)]  # each epoch is a permutation
    assert first[:50] != first[50:]  # reshuffled between epochs


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"bad\.jsonl:2: invalid JSON"),
        ("[1, 2]", r"bad\.jsonl:2: expected a JSON object, got list"),
        ('{"prompt": "1+1="}', r"bad\.jsonl:2: missing field 'answer'"),
        ('{"prompt": "", "answer": "2"}', r"bad\.jsonl:2: field 'prompt' must be a non-empty string"),
        ('{"prompt": "1+1=", "answer": true}', r"bad\.jsonl:2: field 'answer' must be a non-empty string"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"}), line])
    with pytest.raises(DataError, match=message):
        read_jsonl_prompts(path)
    with pytest.raises(DataError, match=message):  # raised on the call, before the first prompt
        train_prompts(DataConfig(train=str(path)), seed=0)


def test_jsonl_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"cannot read prompts from .*nope\.jsonl"):
        read_jsonl_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=r"empty\.jsonl: no prompts"):
        read_jsonl_prompts(write_lines(tmp_path / "empty.jsonl", [""]))
