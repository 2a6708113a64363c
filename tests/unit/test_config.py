"""JobSpec: defaults are valid, YAML loads, and every error names its field path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from services.common.algorithm_config import MOVED_ALGORITHM_KEYS
from services.common.config import (
    AlgorithmConfig,
    JobSpec,
    JobSpecError,
    load_job_spec,
    parse_job_spec,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def errors_of(data: object) -> dict[str, str]:
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(data)
    return dict(caught.value.errors)


def test_defaults_and_empty_spec_are_valid() -> None:
    assert parse_job_spec({}) == JobSpec()
    assert parse_job_spec(None) == JobSpec()


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_load(path: Path) -> None:
    spec = load_job_spec(path)
    assert spec.name


def test_yaml_values_reach_the_model() -> None:
    spec = load_job_spec(EXAMPLES / "addition.yaml")
    assert spec.algorithm.clip_high == 0.28
    assert spec.rollout.prompts_per_step == 16
    assert spec.trainer.learning_rate == 1e-4


@pytest.mark.parametrize(
    ("data", "path", "says"),
    [
        ({"rollout": {"max_new_tokns": 8}}, "rollout.max_new_tokns", "Extra inputs are not permitted"),
        ({"colour": "red"}, "colour", "Extra inputs are not permitted"),
        ({"rollout": {"max_new_tokens": 0}}, "rollout.max_new_tokens", "greater than or equal to 1"),
        ({"trainer": {"zero_stage": 4}}, "trainer.zero_stage", "less than or equal to 3"),
        ({"algorithm": {"advantage": "magic"}}, "algorithm.advantage", "'grpo'"),
        ({"algorithm": {"group_size": 1}}, "algorithm.group_size", "must be >= 2 for the 'grpo'"),
        ({"algorithm": {"clip_low": 1.5}}, "algorithm.clip_low", "less than 1"),
        ({"rollout": {"tools": ["python"]}}, "rollout.tools", "max_turns >= 2"),
        ({"reward": {"plugin": "no colon"}}, "reward.plugin", "should match pattern"),
        ({"name": "has space"}, "name", "should match pattern"),
        ({"trainer": {"steps": "many"}}, "trainer.steps", "valid integer"),
        ({"model": "a string"}, "model", "valid dictionary"),
        ([1, 2], "(root)", "expected a mapping"),
    ],
)
def test_errors_name_the_field(data: object, path: str, says: str) -> None:
    errors = errors_of(data)
    assert path in errors, errors
    assert says in errors[path]


def test_all_errors_are_reported_at_once() -> None:
    errors = errors_of({"seed": -1, "trainer": {"steps": 0}, "eval": {"typo": 1}})
    assert set(errors) == {"seed", "trainer.steps", "eval.typo"}


def test_group_size_one_is_fine_for_non_group_estimators() -> None:
    spec = parse_job_spec({"algorithm": {"advantage": "reinforce_pp", "group_size": 1}})
    assert spec.algorithm.group_size == 1


def test_yaml_file_errors_name_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  learning_rate: -1\n")
    with pytest.raises(
        JobSpecError, match=r"bad\.yaml(.|\n)*trainer\.learning_rate: Input should be greater"
    ):
        load_job_spec(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer: [unclosed\n")
    with pytest.raises(JobSpecError, match=r"\(yaml\)"):
        load_job_spec(broken)


def test_assignment_is_validated_too() -> None:
    spec = JobSpec()
    with pytest.raises(ValueError, match="max_new_tokens"):
        spec.rollout.max_new_tokens = -3


def _sections(model: type[BaseModel]) -> list[type[BaseModel]]:
    found = [model]
    for field in model.model_fields.values():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += _sections(annotation)
    return found


@pytest.mark.parametrize("section", _sections(JobSpec), ids=lambda s: s.__name__)
def test_every_field_is_documented(section: type[BaseModel]) -> None:
    """The docstring under each field is its documentation (and the OpenAPI description)."""
    undocumented = [name for name, field in section.model_fields.items() if not field.description]
    assert not undocumented


def test_json_round_trip_is_lossless() -> None:
    spec = load_job_spec(EXAMPLES / "addition.yaml")
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


@pytest.mark.parametrize(("old", "new"), MOVED_ALGORITHM_KEYS.items())
def test_a_moved_algorithm_key_names_its_new_place(old: str, new: str) -> None:
    errors = errors_of({"algorithm": {old: 1.0, "group_size": 4}})
    assert errors == {f"algorithm.{old}": f"moved: use algorithm.{new}"}


def test_every_moved_key_has_a_home_and_two_are_reported_together() -> None:
    for new in MOVED_ALGORITHM_KEYS.values():
        section, _, field = new.partition(".")
        if field:  # `filters: [...]` is a list of sections
            model = AlgorithmConfig.model_fields[section].annotation
            assert any(f.alias == field or name == field for name, f in model.model_fields.items()), new
    assert set(errors_of({"algorithm": {"gae_lambda": 0.9, "gspo_clip_low": 0.1, "group_size": 1}})) == {
        "algorithm.gae_lambda",
        "algorithm.gspo_clip_low",
        "algorithm.group_size",  # the section's other errors come in the same report
    }


def test_nested_algorithm_settings_round_trip_through_json() -> None:
    """`gae.lambda` is a Python keyword: the field is `lambda_`, read and written as `lambda`."""
    filters = [{"type": "dynamic_sampling", "accuracy": "exact"}]
    data = {"algorithm": {"advantage": "gae", "gae": {"lambda": 0.9, "value_clip": None},
                          "gspo": {"clip_low": 0.01}, "filters": filters, "oversample": 0.5,
                          "stale_policy": "downweight", "downweight": {"decay": 0.25}}}  # fmt: skip
    spec = parse_job_spec(data)
    assert (spec.algorithm.gae.lambda_, spec.algorithm.gae.value_clip) == (0.9, None)
    text = spec.model_dump_json()
    assert '"lambda":0.9' in text and "lambda_" not in text
    assert parse_job_spec(json.loads(text)) == spec == JobSpec.model_validate_json(text)
    assert parse_job_spec({"algorithm": {"gae": {"lambda_": 0.9}}}).algorithm.gae.lambda_ == 0.9
    assert errors_of({"algorithm": {"gae": {"lambda": 2}}}) == {
        "algorithm.gae.lambda": "Input should be less than or equal to 1"
    }
