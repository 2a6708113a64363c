"""The generic Registry, and the JobSpec's algorithm names and traits held equal to the trainer's
registries (the JobSpec cannot import them: they need torch)."""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import FrozenInstanceError, dataclass

import pytest

from services.common.config import (
    GROUP_ESTIMATORS,
    TOKEN_ESTIMATORS,
    AlgorithmConfig,
    JobSpecError,
    parse_job_spec,
)
from services.common.registry import Entry, Registry
from services.trainer.advantages import ADVANTAGE_ESTIMATORS
from services.trainer.losses import POLICY_LOSSES
from services.trainer.regularizers import KL_ESTIMATORS, OFF_POLICY_CORRECTIONS, STALE_POLICIES


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


def literal_choices(field: str) -> tuple[str, ...]:
    return tuple(sorted(typing.get_args(AlgorithmConfig.model_fields[field].annotation)))


@pytest.mark.parametrize(
    ("field", "registry"),
    [
        ("advantage", ADVANTAGE_ESTIMATORS),
        ("policy_loss", POLICY_LOSSES),
        ("kl_estimator", KL_ESTIMATORS),
        ("stale_policy", STALE_POLICIES),
        ("off_policy_correction", OFF_POLICY_CORRECTIONS),
    ],
)
def test_the_jobspec_offers_exactly_the_registered_names(
    field: str, registry: Registry[Entry[object]]
) -> None:
    assert literal_choices(field) == registry.names()
    assert registry.field == f"algorithm.{field}"
    for name in registry.names():
        AlgorithmConfig.model_validate({field: name})  # each choice validates and is served
        assert registry.get(name).name == name


def test_the_jobspec_trait_sets_are_the_registered_traits() -> None:
    assert ADVANTAGE_ESTIMATORS.where(needs_groups=True) == GROUP_ESTIMATORS
    assert ADVANTAGE_ESTIMATORS.where(token_level=True) == TOKEN_ESTIMATORS


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
    caps = {c.name: c.cap_of(AlgorithmConfig(tis_cap=3.0)) for c in OFF_POLICY_CORRECTIONS}
    assert caps == {"none": None, "tis": 3.0, "decoupled": AlgorithmConfig().behaviour_weight_cap}
