"""The generic Registry, and the algorithms module as the one source of the JobSpec's algorithm
names and traits and of the trainer's implementations."""

from __future__ import annotations

import subprocess
import sys
import typing
from collections.abc import Callable
from dataclasses import FrozenInstanceError, dataclass
from typing import Any

import pytest

from services.common import algorithms
from services.common.algorithms import (
    ADVANTAGE_ESTIMATORS,
    GROUP_FILTERS,
    JOBSPEC_REGISTRIES,
    OFF_POLICY_CORRECTIONS,
    STALE_POLICIES,
)
from services.common.config import AlgorithmConfig, JobSpecError, parse_job_spec
from services.common.registry import Entry, Registry


@dataclass(frozen=True, slots=True)
class Shape(Entry[Callable[[float], float]]):
    round: bool = False
    sides: int = 0


def shapes() -> Registry[Shape]:
    registry = Registry(Shape, kind="shape", field="drawing.shape", owner="studio")

    @registry.register("circle", round=True)
    def circle(r: float) -> float:
        return 3.0 * r * r

    registry.register("square", sides=4)(lambda a: a * a)
    registry.register("triangle", sides=3)(lambda a: a * a / 2)
    return registry


def test_register_returns_the_function_and_get_finds_its_entry() -> None:
    registry = shapes()

    def hexagon(a: float) -> float:
        return 2.6 * a * a

    assert registry.register("hexagon", sides=6)(hexagon) is hexagon
    entry = registry.get("hexagon")
    assert entry == Shape(name="hexagon", fn=hexagon, round=False, sides=6)
    assert entry.fn(1.0) == 2.6
    assert "hexagon" in registry and "oval" not in registry
    assert [e.name for e in registry] == ["circle", "square", "triangle", "hexagon"]
    assert len(registry) == 4


def test_traits_are_declared_at_registration_with_defaults() -> None:
    registry = shapes()
    assert registry.traits == {"round", "sides"}
    assert registry.get("circle").round and registry.get("circle").sides == 0
    assert not registry.get("square").round and registry.get("square").sides == 4
    assert registry.where(round=True) == {"circle"}
    assert registry.where(round=False) == {"square", "triangle"}
    assert registry.where(round=False, sides=3) == {"triangle"}
    with pytest.raises(FrozenInstanceError):
        registry.get("circle").round = False  # type: ignore[misc]


def test_unknown_name_names_the_field_and_every_choice() -> None:
    with pytest.raises(ValueError) as error:
        shapes().get("oval")
    assert str(error.value) == (
        "drawing.shape 'oval' is not available in this studio (available: circle, square, triangle)"
    )


def test_a_name_cannot_be_registered_twice_and_the_first_stays() -> None:
    registry = shapes()
    first = registry.get("square")
    with pytest.raises(ValueError, match="shape 'square' is registered twice"):
        registry.register("square", sides=5)(lambda a: a)
    assert registry.get("square") is first
    assert registry.names() == ("circle", "square", "triangle")


def test_unknown_traits_are_refused() -> None:
    with pytest.raises(ValueError, match=r"shape 'blob': unknown traits \['wobbly'\]"):
        shapes().register("blob", wobbly=True)
    with pytest.raises(ValueError, match=r"no traits \['colour'\]"):
        shapes().where(colour="red")
    assert "blob" not in shapes()


def test_a_lazy_entry_is_imported_when_first_got_and_cannot_be_registered_again() -> None:
    registry = shapes()
    registry.register_lazy("hypot", "math:hypot", sides=2)
    assert "hypot" in registry and registry.names() == ("circle", "hypot", "square", "triangle")
    assert registry.where(sides=2) == {"hypot"}  # read from the declaration: nothing imported
    with pytest.raises(ValueError, match="'hypot' is registered twice"):
        registry.register("hypot")(lambda a: a)
    assert registry.get("hypot").fn(3.0, 4.0) == 5.0


def literal_choices(field: str) -> tuple[str, ...]:
    return tuple(sorted(typing.get_args(AlgorithmConfig.model_fields[field].annotation)))


@pytest.mark.parametrize(("field", "registry"), JOBSPEC_REGISTRIES.items(), ids=list(JOBSPEC_REGISTRIES))
def test_the_jobspec_offers_exactly_the_declared_names(field: str, registry: Registry[Entry[Any]]) -> None:
    assert literal_choices(field) == registry.names()
    assert registry.field == f"algorithm.{field}"
    for name in registry.names():
        AlgorithmConfig.model_validate({field: name})  # each choice validates
    with pytest.raises(JobSpecError, match=rf"algorithm.{field}: Input should be"):
        parse_job_spec({"algorithm": {field: "not-declared"}})


def test_every_field_naming_an_algorithm_has_its_registry() -> None:
    naming = {
        name
        for name, field in AlgorithmConfig.model_fields.items()
        if typing.get_origin(field.annotation) is typing.Literal
    }
    assert naming == set(JOBSPEC_REGISTRIES)


def test_the_jobspec_accepts_exactly_the_declared_filters() -> None:
    for name in GROUP_FILTERS.names():
        parse_job_spec({"algorithm": {"filters": [{"type": name}]}})
    parse_job_spec({"algorithm": {"filters": [{"type": "mine.filters:keep_hard", "above": 0.5}]}})
    with pytest.raises(JobSpecError, match=r"algorithm\.filters\.0\.type: .*dynamic_sampling, zero_variance"):
        parse_job_spec({"algorithm": {"filters": [{"type": "dapo"}]}})


REGISTRIES = [*JOBSPEC_REGISTRIES.values(), GROUP_FILTERS]
IMPLEMENTED_IN = {
    "advantage estimator": "services.trainer.advantages",
    "policy loss": "services.trainer.losses",
    "loss aggregation": "services.trainer.losses",
    "KL estimator": "services.trainer.regularizers",
    "off-policy correction": "services.trainer.regularizers",
    "stale policy": "services.trainer.regularizers",
    "group filter": "services.trainer.filters",
}


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.kind)
def test_every_declared_name_has_its_own_trainer_implementation(registry: Registry[Entry[Any]]) -> None:
    """The traits are the declaration's (there is no second place for them); the functions are
    the trainer's, one per name."""
    functions = set()
    for entry in registry:  # imports each implementation: a declared name without one fails here
        assert callable(entry.fn) and entry.fn.__module__ == IMPLEMENTED_IN[registry.kind], entry.name
        functions.add(entry.fn)
    assert len(functions) == len(registry), "two names share one implementation"


def test_the_jobspec_and_the_algorithms_module_import_no_torch() -> None:
    code = "import sys, services.common.config as c; c.parse_job_spec({}); print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        == "False\n"
    )


def test_the_jobspec_checks_follow_the_traits() -> None:
    for name in ADVANTAGE_ESTIMATORS.names():
        estimator = ADVANTAGE_ESTIMATORS.get(name)
        if estimator.needs_groups:
            with pytest.raises(
                JobSpecError, match=rf"algorithm.group_size: .*must be >= 2 for the '{name}' estimator"
            ):
                parse_job_spec({"algorithm": {"advantage": name, "group_size": 1}})
        else:
            parse_job_spec({"algorithm": {"advantage": name, "group_size": 1}})
        kl_in_reward = {"advantage": name, "kl_coef": 0.1, "kl_in_reward": True}
        if estimator.token_level:
            parse_job_spec({"algorithm": kl_in_reward})
        else:
            with pytest.raises(JobSpecError, match="needs a token-level advantage"):
                parse_job_spec({"algorithm": kl_in_reward})


def test_the_estimators_declare_their_traits() -> None:
    assert ADVANTAGE_ESTIMATORS.where(needs_critic=True) == {"gae"}
    assert ADVANTAGE_ESTIMATORS.where(whiten=True) == {"gae"}
    assert ADVANTAGE_ESTIMATORS.where(needs_groups=True) == {
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_pp_baseline",
    }
    assert ADVANTAGE_ESTIMATORS.where(token_level=True) == {"reinforce_pp", "reinforce_pp_baseline", "gae"}
    assert STALE_POLICIES.where(drops=True) == {"drop"}
    assert OFF_POLICY_CORRECTIONS.where(corrects_engine=True) == {"tis"}
    algorithm = AlgorithmConfig(tis={"cap": 3.0}, off_policy_correction="tis")
    caps = {c.name: c.cap_of(algorithm) for c in OFF_POLICY_CORRECTIONS}
    assert caps == {"none": None, "tis": 3.0, "decoupled": AlgorithmConfig().decoupled.cap}
    assert OFF_POLICY_CORRECTIONS.get("tis").default_cap == algorithms.TIS_DEFAULT_CAP == 2.0
    assert GROUP_FILTERS.get("dynamic_sampling").options == ("accuracy",)
    assert GROUP_FILTERS.get("zero_variance").options == ()
