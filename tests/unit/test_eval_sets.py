"""A job's held-out sets (services/common/eval_sets.py and EvalConfig): `data.eval` as the default
set with unprefixed metrics, named sets read through the data-source registry with the job's data
section as their defaults, and the bounds of samples_per_prompt and pass_k."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.common.config import DEFAULT_EVAL_SET, DataConfig, JobSpecError, parse_job_spec
from services.common.eval_sets import eval_set_sources, metric_prefix, read_eval_set
from services.data import DataError, eval_prompts


def spec(**eval_section: Any) -> Any:
    return parse_job_spec({"eval": eval_section})


def jsonl(path: Path, rows: list[dict[str, str]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_job_that_names_no_set_evaluates_data_eval_as_the_default() -> None:
    job = spec(num_prompts=7)
    [default] = eval_set_sources(job)
    assert (default.name, default.field, default.num_prompts) == (DEFAULT_EVAL_SET, ("data", "eval"), 7)
    assert metric_prefix(default.name) == "" and default.data == job.data
    assert read_eval_set(default) == eval_prompts(job.data, 7)


def test_named_sets_come_after_the_default_one_with_their_own_counts(tmp_path: Path) -> None:
    held = jsonl(tmp_path / "held.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    job = spec(
        num_prompts=5,
        sets={"file": {"location": held}, "mul": {"location": "builtin:multiply", "num_prompts": 2}},
    )
    names = [(s.name, s.num_prompts, metric_prefix(s.name)) for s in eval_set_sources(job)]
    assert names == [(DEFAULT_EVAL_SET, 5, ""), ("file", 5, "file/"), ("mul", 2, "mul/")]
    file_set, mul_set = eval_set_sources(job)[1:]
    assert [e.text for e in read_eval_set(file_set)] == ["1+1="], "a file of one row gives one row"
    assert [e.prompt_id for e in read_eval_set(mul_set)] == ["multiply:eval:0", "multiply:eval:1"]
    assert file_set.field == ("eval", "sets", "file", "location")


def test_data_eval_null_leaves_only_the_named_sets() -> None:
    job = parse_job_spec({"data": {"eval": None}, "eval": {"sets": {"a": {"location": "builtin:addition"}}}})
    assert [s.name for s in eval_set_sources(job)] == ["a"]
    assert eval_set_sources(parse_job_spec({"data": {"eval": None}})) == []


def test_a_set_reads_with_the_jobs_data_section_unless_it_says_otherwise(tmp_path: Path) -> None:
    data = DataConfig(source="jsonl", prompt_field="q", answer_field="a", options={})
    job = parse_job_spec(
        {
            "data": data.model_dump(),
            "eval": {
                "sets": {
                    "same": {"location": "x.jsonl"},
                    "fields": {"location": "y.jsonl", "prompt_field": "question", "answer_field": "gold"},
                    "other": {"source": "builtin", "location": "reverse"},
                }
            },
        }
    )
    same, fields, other = (s.data for s in eval_set_sources(job)[1:])
    assert (same.source, same.eval, same.prompt_field, same.answer_field) == ("jsonl", "x.jsonl", "q", "a")
    assert (fields.prompt_field, fields.answer_field) == ("question", "gold")
    assert (other.source, other.eval, other.options) == ("builtin", "reverse", {})
    assert same.train == data.train and same.max_prompt_tokens == data.max_prompt_tokens


def test_options_follow_the_source() -> None:
    job = parse_job_spec(
        {
            "data": {"options": {"k": 1}, "source": "my_pkg.data:rows", "eval": None},
            "eval": {
                "sets": {
                    "inherits": {"location": "a"},
                    "own": {"source": "jsonl", "location": "b.jsonl"},
                    "given": {"source": "jsonl", "location": "c.jsonl", "options": {"z": 2}},
                }
            },
        }
    )
    inherits, own, given = (s.data for s in eval_set_sources(job))
    assert inherits.options == {"k": 1}, "the job's source: the job's options"
    assert own.options == {}, "another source takes none of the job's source's options"
    assert given.options == {"z": 2}


def test_a_sets_split_is_the_split_of_its_datasets_directory(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    rows = {name: [{"prompt": f"{name} {i}", "answer": str(i)} for i in range(3)] for name in ("test", "dev")}
    DatasetDict({name: Dataset.from_list(found) for name, found in rows.items()}).save_to_disk(
        tmp_path / "ds"
    )
    job = parse_job_spec(
        {
            "data": {"eval": str(tmp_path / "ds")},
            "eval": {"sets": {"dev": {"location": str(tmp_path / "ds"), "split": "dev", "num_prompts": 2}}},
        }
    )
    default, dev = eval_set_sources(job)
    assert (default.data.eval_split, dev.data.eval_split) == (None, "dev")
    assert [e.text for e in read_eval_set(default)] == ["test 0", "test 1", "test 2"], "data.eval_split: test"
    assert [e.text for e in read_eval_set(dev)] == ["dev 0", "dev 1"]
    wrong = eval_set_sources(
        parse_job_spec({"eval": {"sets": {"x": {"location": str(tmp_path / "ds"), "split": "nope"}}}})
    )
    with pytest.raises(DataError, match="has no split 'nope'"):
        read_eval_set(wrong[1])


def test_a_set_whose_file_is_missing_says_so() -> None:
    missing = eval_set_sources(spec(sets={"gone": {"location": "/no/such.jsonl"}}))[1]
    with pytest.raises(DataError, match=r"cannot read prompts from /no/such\.jsonl"):
        read_eval_set(missing)


@pytest.mark.parametrize(
    ("section", "path", "says"),
    [
        ({"sets": {"default": {"location": "builtin:addition"}}}, "eval.sets", "names data.eval's set"),
        ({"sets": {"a/b": {"location": "builtin:addition"}}}, "eval.sets", "must match"),
        ({"sets": {"a": {}}}, "eval.sets.a.location", "Field required"),
        ({"sets": {"a": {"location": "nosuch:x"}, "b": {"location": "x", "source": "nosuch"}}},
         "eval.sets.b.source", "must be auto"),
        ({"sets": {"a": {"location": "x", "split": ""}}}, "eval.sets.a.split", "at least 1 character"),
        ({"sets": {"a": {"location": "x", "options": {"k": object()}}}}, "eval.sets.a.options", "plain JSON"),
        ({"pass_k": [1]}, "eval.pass_k", "needs samples_per_prompt >= 1"),
        ({"samples_per_prompt": 4, "pass_k": [1, 5]}, "eval.pass_k", r"samples_per_prompt=4\], not \[5\]"),
        ({"samples_per_prompt": 4, "pass_k": [0]}, "eval.pass_k", "not \\[0\\]"),
        ({"samples_per_prompt": 4, "pass_k": [2, 2]}, "eval.pass_k", "a k twice"),
        ({"samples_per_prompt": 1025}, "eval.samples_per_prompt", "less than or equal to 1024"),
        ({"temperature": 0}, "eval.temperature", "greater than 0"),
    ],
)  # fmt: skip
def test_eval_errors_name_the_field(section: dict[str, Any], path: str, says: str) -> None:
    with pytest.raises(JobSpecError, match=rf"{path}: .*{says}"):
        parse_job_spec({"eval": section})


def test_a_prefixed_location_names_a_registered_source() -> None:
    with pytest.raises(JobSpecError, match=r"eval\.sets\.a\.location: .*names no data source 'nosuch'"):
        parse_job_spec({"eval": {"sets": {"a": {"source": "auto", "location": "nosuch:x"}}}})


def test_the_reported_k() -> None:
    assert spec().eval.reported_k == [], "greedy only by default"
    assert spec(samples_per_prompt=8).eval.reported_k == [8], "pass@n when no k is named"
    assert spec(samples_per_prompt=8, pass_k=[4, 1]).eval.reported_k == [1, 4]
