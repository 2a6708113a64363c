"""The data-source plug-in point: how a location picks its source, what the JobSpec refuses, the
traits' meaning, and the example user sources (examples/plugins/data_source.py) read through
``train_prompts`` / ``eval_prompts``."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.common.config import DataConfig, JobSpecError, parse_job_spec
from services.common.plugins import traits
from services.common.registry import Registry
from services.data import DATA_SOURCES, DataError, PromptExample, SourceRequest, eval_prompts, train_prompts
from services.data import sources as data_sources
from services.data.sources import DataSource, pick_source

ROOT = Path(__file__).resolve().parents[2]
ARITHMETIC = "examples.plugins.data_source:arithmetic"
TSV = "examples.plugins.data_source:tsv_rows"


def spec_errors(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec({"data": data})
    return dict(caught.value.errors)


# --- which source reads a location --------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "location", "picked"),
    [
        ("auto", "builtin:addition", ("builtin", "addition")),
        ("auto", "/data/train.jsonl", ("jsonl", "/data/train.jsonl")),
        ("auto", "/etc/passwd", ("jsonl", "/etc/passwd")),  # any other path: JSONL, as always
        ("auto", "jsonl:/data/rows.txt", ("jsonl", "/data/rows.txt")),
        ("auto", "/data/a:b.jsonl", ("jsonl", "/data/a:b.jsonl")),  # a colon in a path is no prefix
        ("jsonl", "/data/rows.txt", ("jsonl", "/data/rows.txt")),
        ("builtin", "addition", ("builtin", "addition")),
        ("builtin", "builtin:addition", ("builtin", "addition")),
        (ARITHMETIC, "subtract", (ARITHMETIC, "subtract")),
    ],
)
def test_a_location_picks_its_source(source: str, location: str, picked: tuple[str, str]) -> None:
    assert pick_source(source, location) == picked


def test_a_registered_suffix_is_read_by_its_source(monkeypatch: pytest.MonkeyPatch) -> None:
    registry: Registry[DataSource] = Registry(DataSource, kind="data source", field="data.source")
    registry.register("parquet", reads_path=True, suffixes=(".parquet",))(lambda request: [])
    registry.register_lazy("jsonl", "services.data.jsonl:jsonl_source", suffixes=(".jsonl",))
    monkeypatch.setattr(data_sources, "DATA_SOURCES", registry)
    assert pick_source("auto", "/d/rows.parquet") == ("parquet", "/d/rows.parquet")
    assert pick_source("auto", "/d/rows.csv") == ("jsonl", "/d/rows.csv")


def test_explicit_source_overrides_the_form_of_the_location() -> None:
    explicit = DataConfig(source="builtin", train="addition", eval="addition")
    assert list(itertools.islice(train_prompts(explicit, 5), 20)) == list(
        itertools.islice(train_prompts(DataConfig(), 5), 20)
    )
    assert eval_prompts(explicit, 10) == eval_prompts(DataConfig(), 10)


def test_the_job_spec_refuses_an_unknown_source_naming_the_field() -> None:
    errors = spec_errors({"source": "excel"})
    assert list(errors) == ["data.source"]
    assert f"one of {', '.join(DATA_SOURCES.names())}, or a user's module:function" in errors["data.source"]
    assert "is a location" in spec_errors({"source": "builtin:addition"})["data.source"]
    assert "standard library" in spec_errors({"source": "os:system"})["data.source"]
    errors = spec_errors({"train": "hf:openai/gsm8k", "eval": None})
    assert "names no data source 'hf'" in errors["data.train"] and "./hf:openai/gsm8k" in errors["data.train"]
    assert "at most 65536" in spec_errors({"options": {"rows": "x" * 70_000}})["data.options"]
    parse_job_spec({"data": {"source": ARITHMETIC, "train": "add", "options": {"digits": 3}}})


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("tests.no_such_module:rows", "cannot import 'tests.no_such_module'"),
        ("examples.plugins.data_source:nothing", "has no 'nothing'"),
        ("tests.unit.test_data_sources:odd_traits", "declares unknown traits ['streaming']"),
    ],
)
def test_a_bad_user_path_fails_clearly(source: str, message: str) -> None:
    data = DataConfig(source=source, train="x", eval=None)  # its form is fine: the JobSpec takes it
    with pytest.raises(DataError, match=f"^data.source .*{re.escape(source)}.*{re.escape(message)}"):
        train_prompts(data, 0)


# --- the traits and the rules of the contract ---------------------------------------------------


def test_the_built_ins_declare_their_traits() -> None:
    assert {"builtin", "csv", "datasets", "jsonl", "parquet"} <= set(DATA_SOURCES.names())
    plain = {"endless": False, "reads_path": True, "suffixes": (), "markers": ()}
    assert DATA_SOURCES.declared("builtin") == {**plain, "endless": True, "reads_path": False}
    assert DATA_SOURCES.declared("jsonl") == {**plain, "suffixes": (".jsonl",)}
    assert DATA_SOURCES.declared("parquet") == {**plain, "suffixes": (".parquet",)}
    assert DATA_SOURCES.declared("csv") == {**plain, "suffixes": (".csv",)}
    assert DATA_SOURCES.declared("datasets") == {**plain, "markers": ("dataset_dict.json", "state.json")}
    arithmetic, tsv = DATA_SOURCES.resolve(ARITHMETIC), DATA_SOURCES.resolve(TSV)
    assert (arithmetic.endless, arithmetic.reads_path) == (True, False)
    assert (tsv.endless, tsv.reads_path) == (False, True)


def test_the_data_package_never_imports_the_tasks() -> None:
    code = "import sys, services.data, services.common.config; print('services.tasks' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "False", run.stderr


@traits(streaming=True)
def odd_traits(request: SourceRequest) -> list[PromptExample]:
    return []


def three_rows(request: SourceRequest) -> list[PromptExample]:
    return [PromptExample(f"r:{i}", f"{request.split} {i}", str(i)) for i in range(3)]


@traits(endless=True)
def ends(request: SourceRequest) -> Iterator[PromptExample]:
    yield from three_rows(request)


def dicts(request: SourceRequest) -> list[dict[str, str]]:
    return [{"prompt": "1+1=", "answer": "2"}]


def broken(request: SourceRequest) -> list[PromptExample]:
    return [PromptExample("a", "b", "c")] + {}["missing"]


def user(function: str, **data: Any) -> DataConfig:
    return DataConfig(source=f"tests.unit.test_data_sources:{function}", train="t", **data)


def test_a_finite_source_repeats_its_rows_shuffled_per_epoch() -> None:
    ordered = [e.text for e in itertools.islice(train_prompts(user("three_rows", shuffle=False), 0), 6)]
    assert ordered == ["train 0", "train 1", "train 2"] * 2
    shuffled = [e.text for e in itertools.islice(train_prompts(user("three_rows"), 7), 30)]
    epochs = [shuffled[i : i + 3] for i in range(0, 30, 3)]
    assert all(sorted(epoch) == ordered[:3] for epoch in epochs) and len({tuple(e) for e in epochs}) > 1
    assert [e.text for e in eval_prompts(user("three_rows", eval="e"), 2)] == ["eval 0", "eval 1"]


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("ends", "declares endless=True but its train rows ended"),
        ("dicts", "gave a dict in its train rows, not a PromptExample"),
        ("broken", r"\(train split of 't'\) failed: KeyError: 'missing'"),
    ],
)
def test_what_a_source_does_wrong_is_a_data_error_naming_it(function: str, message: str) -> None:
    with pytest.raises(DataError, match=f"data source 'tests.unit.test_data_sources:{function}'.*{message}"):
        list(itertools.islice(train_prompts(user(function), 0), 10))


def test_the_built_ins_take_no_options(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.options: the builtin source takes no x \(its options: none\)"):
        train_prompts(DataConfig(options={"x": 1}), 0)
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(DataError, match="the jsonl source takes no x"):
        eval_prompts(DataConfig(train=str(path), eval=str(path), options={"x": 1}))


# --- the example user sources -------------------------------------------------------------------


def arithmetic(train: str = "subtract", eval: str | None = "subtract", **options: Any) -> DataConfig:
    return DataConfig(source=ARITHMETIC, train=train, eval=eval, options=options)


def test_arithmetic_is_seeded_right_and_never_trains_on_a_held_out_problem() -> None:
    data = arithmetic(digits=1, eval_size=30)
    held_out = eval_prompts(data)
    assert len(held_out) == len({e.text for e in held_out}) == 30
    assert held_out == eval_prompts(arithmetic(digits=1, eval_size=30))  # the same for every job
    train = list(itertools.islice(train_prompts(data, 3), 5000))
    assert train[:50] == list(itertools.islice(train_prompts(data, 3), 50))
    assert train[:50] != list(itertools.islice(train_prompts(data, 4), 50))
    texts = {e.text for e in train}
    assert texts.isdisjoint(e.text for e in held_out) and len(texts) == 81 - 30  # all the others
    for example in train[:100] + held_out:
        a, b = example.text.rstrip("=").split("-")
        assert example.answer == str(int(a) - int(b))
    assert train[0].prompt_id == "subtract:train:0" and held_out[0].prompt_id == "subtract:eval:0"
    product = eval_prompts(arithmetic(eval="multiply", digits=3), 1)[0]
    a, b = product.text.rstrip("=").split("*")
    assert len(a) == len(b) == 3 and product.answer == str(int(a) * int(b))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (arithmetic(train="divide"), "unknown operation 'divide'"),
        (arithmetic(digits=7), r"data.options.digits: must be an integer in \[1, 6\], got 7"),
        (arithmetic(digits=1, eval_size=41), r"eval_size: must be an integer in \[1, 40\]"),
        (arithmetic(base=2), "the arithmetic source takes no base"),
    ],
)
def test_arithmetic_refuses_bad_settings_on_the_call(data: DataConfig, message: str) -> None:
    with pytest.raises(DataError, match=message):
        train_prompts(data, 0)


def test_tsv_rows_reads_the_columns_the_job_names(tmp_path: Path) -> None:
    path = tmp_path / "qa.tsv"
    path.write_text("id\tquestion\tanswer\n1\t2+2=\t4\n\n2\t3+4=\t7\n")
    data = DataConfig(source=TSV, train=str(path), eval=str(path), prompt_field="question", shuffle=False)
    rows = [PromptExample("qa.tsv:2", "2+2=", "4"), PromptExample("qa.tsv:4", "3+4=", "7")]
    assert eval_prompts(data) == rows
    assert list(itertools.islice(train_prompts(data, 0), 4)) == rows * 2
    path.write_text("id\tquestion\tanswer\n1\t2+2=\n")
    with pytest.raises(DataError, match=r"qa\.tsv:2: 2 cells, the header has 3"):
        train_prompts(data, 0)
    with pytest.raises(DataError, match=r"qa\.tsv:1: no column 'prompt' \(columns: id, question, answer\)"):
        train_prompts(DataConfig(source=TSV, train=str(path)), 0)
