"""The data sources for data as users have it: JSONL, Parquet, CSV and ``datasets`` directories give
the same prompts for the same rows, are recognised by their path, pick a ``datasets`` split, name
the file and row of a bad row, and carry messages and metadata (services/data/)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from services.common.config import DataConfig
from services.common.pb import common_pb2
from services.data import DataError, PromptExample, encode_prompt, eval_prompts, train_prompts
from services.data.sources import pick_source
from tests.chat_tokenizers import CHATML, chat_tokenizer

MESSAGES = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 3*3?"},
]
ROWS: list[dict[str, Any]] = [
    {"prompt": "2+2=", "messages": None, "answer": "4", "level": 1, "topic": "sums"},
    {"prompt": None, "messages": MESSAGES, "answer": "9", "level": 2, "topic": "products"},
    {"prompt": "10-3=", "messages": None, "answer": "7", "level": 3, "topic": "differences"},
]
DATA = {"metadata_fields": ["level", "topic"]}


def write(rows: list[dict[str, Any]], path: Path) -> Path:
    """``rows`` in the format ``path``'s suffix names (a directory: a ``datasets`` DatasetDict)."""
    if path.suffix == ".jsonl":
        path.write_text(
            "".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in rows)
        )
    elif path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".csv":
        with path.open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]))
            writer.writeheader()
            for row in rows:
                writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
    else:
        DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:1])}).save_to_disk(
            path
        )
    return path


def content(examples: list[PromptExample]) -> list[tuple[Any, ...]]:
    return [(e.text, e.answer, e.messages, dict(e.metadata)) for e in examples]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """The same rows in every format."""
    return {
        "jsonl": write(ROWS, tmp_path / "rows.jsonl"),
        "parquet": write(ROWS, tmp_path / "rows.parquet"),
        "csv": write(ROWS, tmp_path / "rows.csv"),
        "datasets": write(ROWS, tmp_path / "rows"),
    }


def test_every_format_gives_the_same_prompts_for_the_same_rows(files: dict[str, Path]) -> None:
    train = {"eval_split": "train"}  # the datasets directory's train split; the files have none
    read = {}
    for name, path in files.items():
        split = train if name == "datasets" else {}
        read[name] = eval_prompts(DataConfig(eval=str(path), **DATA, **split))
    expected = [
        ("2+2=", "4", (), {"level": "1", "topic": "sums"}),
        ("What is 3*3?", "9", tuple(MESSAGES), {"level": "2", "topic": "products"}),
        ("10-3=", "7", (), {"level": "3", "topic": "differences"}),
    ]
    for name, examples in read.items():
        assert content(examples) == expected, name
    assert [e.prompt_id for e in read["parquet"]] == ["rows.parquet:1", "rows.parquet:2", "rows.parquet:3"]
    assert [e.prompt_id for e in read["jsonl"]] == ["rows.jsonl:1", "rows.jsonl:2", "rows.jsonl:3"]
    assert read["datasets"][0].prompt_id == "rows:train:1"


def test_a_location_is_recognised_by_its_suffix_or_its_layout(files: dict[str, Path], tmp_path: Path) -> None:
    for name, path in files.items():
        assert pick_source("auto", str(path)) == (name, str(path))
    Dataset.from_list(ROWS).save_to_disk(tmp_path / "single")
    assert pick_source("auto", str(tmp_path / "single")) == ("datasets", str(tmp_path / "single"))
    assert pick_source("auto", str(files["datasets"] / "train")) == (
        "datasets",
        str(files["datasets"] / "train"),
    )
    assert pick_source("csv", str(files["jsonl"])) == ("csv", str(files["jsonl"])), "data.source overrides"
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="is a directory: verst reads a directory as a datasets directory"):
        eval_prompts(DataConfig(eval=str(tmp_path / "plain")))


def test_a_datasets_directory_gives_the_split_each_side_asks_for(tmp_path: Path) -> None:
    names = ("train", "validation", "test")
    splits = {
        name: Dataset.from_list([{**ROWS[0], "prompt": f"{name} {i}"} for i in range(2)]) for name in names
    }
    DatasetDict(splits).save_to_disk(tmp_path / "ds")
    location = str(tmp_path / "ds")

    def texts(**data: Any) -> tuple[list[str], list[str]]:
        config = DataConfig(train=location, eval=location, **data)
        train = [next(prompts).text for prompts in [train_prompts(config, 0)] for _ in range(2)]
        return sorted(train), [e.text for e in eval_prompts(config)]

    assert texts() == (["train 0", "train 1"], ["test 0", "test 1"])
    assert texts(eval_split="validation", train_split="test") == (
        ["test 0", "test 1"],
        ["validation 0", "validation 1"],
    )
    with pytest.raises(
        DataError, match=r"data.eval_split: .*ds has no split 'dev' \(its splits: train, validation, test\)"
    ):
        eval_prompts(DataConfig(eval=location, eval_split="dev"))
    Dataset.from_list(ROWS).save_to_disk(tmp_path / "single")
    with pytest.raises(DataError, match=r"data.train_split is 'train', but .*single is a single Dataset"):
        train_prompts(DataConfig(train=str(tmp_path / "single"), train_split="train"), 0)
    write(ROWS, tmp_path / "rows.jsonl")
    with pytest.raises(DataError, match=r"data.eval_split is 'test', but .*rows.jsonl is a JSONL file"):
        eval_prompts(DataConfig(eval=str(tmp_path / "rows.jsonl"), eval_split="test"))


BAD_ROWS = [
    ({"prompt": "1+1=", "messages": None, "answer": None}, "missing field 'answer'"),
    ({"prompt": None, "messages": None, "answer": "2"}, "missing field 'prompt' (or 'messages')"),
    ({"prompt": "", "messages": None, "answer": "2"}, "'prompt'"),
    (
        {
            "prompt": None,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
            "answer": "2",
        },
        "the last message is the assistant's",
    ),
]


@pytest.mark.parametrize(("bad", "message"), BAD_ROWS)
@pytest.mark.parametrize("name", ["rows.jsonl", "rows.parquet", "rows.csv", "rows"])
def test_a_bad_row_names_its_file_and_row(
    tmp_path: Path, name: str, bad: dict[str, Any], message: str
) -> None:
    good = {"prompt": "2+2=", "messages": [{"role": "user", "content": "x"}], "answer": "4"}
    path = write([good, bad, good], tmp_path / name)
    row = {"rows.jsonl": f"{path}:2", "rows": f"{path} (split train): row 2"}.get(name, f"{path}: row 2")
    with pytest.raises(DataError) as caught:
        train_prompts(DataConfig(train=str(path)), 0)
    assert str(caught.value).startswith(row) and message in str(caught.value), str(caught.value)


@pytest.mark.parametrize("name", ["rows.parquet", "rows.csv", "rows"])
def test_a_field_that_is_no_column_names_the_file(tmp_path: Path, name: str) -> None:
    path = write([{"question": "2+2=", "answer": "4"}], tmp_path / name)
    with pytest.raises(
        DataError, match=r"no column 'prompt' \(or 'messages'\) \(columns: question, answer\)"
    ):
        train_prompts(DataConfig(train=str(path)), 0)
    with pytest.raises(DataError, match="no column 'level'"):
        train_prompts(DataConfig(train=str(path), prompt_field="question", metadata_fields=["level"]), 0)


def test_a_broken_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"x.parquet: not a Parquet file"):
        eval_prompts(DataConfig(eval=str(tmp_path / "x.parquet")))
    (tmp_path / "x.csv").write_text("prompt,answer\n1+1=,2,3\n")
    with pytest.raises(DataError, match=r"x.csv: row 1 \(line 2\): 3 cells, but the header names 2"):
        eval_prompts(DataConfig(eval=str(tmp_path / "x.csv")))
    with pytest.raises(DataError, match=r"cannot read prompts from .*nope.csv"):
        eval_prompts(DataConfig(eval=str(tmp_path / "nope.csv")))


def test_messages_rows_render_through_the_chat_template(files: dict[str, Path]) -> None:
    tokenizer = chat_tokenizer(CHATML)
    data = DataConfig(train=str(files["parquet"]), system_prompt="Be brief.")
    examples = eval_prompts(data.model_copy(update={"eval": str(files["parquet"])}))
    own = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert encode_prompt(tokenizer, examples[1], settings=data) == list(own)
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    own = tokenizer.apply_chat_template(system, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert encode_prompt(tokenizer, examples[0], settings=data) == list(own)
    with pytest.raises(DataError, match=r"rows.csv: row 2 \(line 3\): missing field 'prompt' \(fields"):
        eval_prompts(DataConfig(format="text", eval=str(files["csv"])))  # text reads prompts alone


def test_the_feed_carries_messages_and_metadata_to_the_task(files: dict[str, Path]) -> None:
    from services.common.config import JobSpec
    from services.controller.feed import PromptFeed

    spec = JobSpec.model_validate(
        {
            "data": {"train": str(files["parquet"]), "eval": None, "shuffle": False, **DATA},
            "rollout": {"prompts_per_step": 3},
        }
    )
    tokenizer = chat_tokenizer(CHATML)
    tasks: list[common_pb2.PromptTask] = PromptFeed(spec, "job", tokenizer).batch(0)
    assert [dict(t.metadata) for t in tasks] == [
        {"level": "1", "topic": "sums", "source_prompt_id": "rows.parquet:1"},
        {"level": "2", "topic": "products", "source_prompt_id": "rows.parquet:2"},
        {"level": "3", "topic": "differences", "source_prompt_id": "rows.parquet:3"},
    ]
    assert json.loads(tasks[1].messages_json) == MESSAGES
    assert json.loads(tasks[0].messages_json) == [{"role": "user", "content": "2+2="}]
    row = eval_prompts(spec.data.model_copy(update={"eval": spec.data.train}))[1]
    assert list(tasks[1].prompt_token_ids) == encode_prompt(tokenizer, row, settings=spec.data)
    with pytest.raises(DataError, match=r"rows.parquet:2 is a chat prompt .* no chat template"):
        PromptFeed(spec, "job", chat_tokenizer(None)).batch(0)
