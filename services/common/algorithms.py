"""Every algorithm a JobSpec may name, with the traits it declares: the one list of them.

Each kind is a ``Registry`` (registry.py) of entries whose traits are fields of the kind's entry
class. The JobSpec (config.py) offers exactly these names and checks its rules by these traits;
the trainer gets an entry by name (``POLICY_LOSSES.get("gspo").fn``) and asks its traits, never
its name. An entry's implementation is named here by its dotted path and imported on first use
(``Registry.register_lazy``), so this module, and the JobSpec with it, stays free of torch:

- advantage estimators: ``services/trainer/advantages.py``;
- policy losses and loss aggregations: ``services/trainer/losses.py``;
- KL estimators, off-policy corrections, stale policies: ``services/trainer/regularizers.py``;
- group filters: ``services/trainer/filters.py`` (a plug-in point: ``GROUP_FILTERS.resolve``
  also takes a user's ``module:function``).

Adding an algorithm is a function in its trainer module and one line here;
tests/unit/test_registry_generic.py imports every entry, so a line without a function fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common.registry import Entry, Registry

ADVANTAGES = "services.trainer.advantages"
LOSSES = "services.trainer.losses"
REGULARIZERS = "services.trainer.regularizers"
FILTERS = "services.trainer.filters"
"""The trainer modules that hold the implementations."""


@dataclass(frozen=True, slots=True)
class AdvantageEstimator(Entry[Callable[..., Any]]):
    """An estimator and what it asks of the job; ``fn`` is an ``AdvantageFn`` (outcome) or a
    ``TokenAdvantageFn`` (``token_level``) of advantages.py."""

    token_level: bool = False
    """Per token (a ``TokenAdvantageFn``): it can take the KL penalty as per-token rewards."""
    needs_groups: bool = False
    """Compares the samples of a group, so needs algorithm.group_size >= 2."""
    needs_critic: bool = False
    """Needs the critic's values: the job trains a critic beside the policy."""
    whiten: bool = False
    """The trainer whitens its advantages over the batch (its returns, the critic's targets, stay raw)."""


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    AdvantageEstimator, kind="advantage estimator", field="algorithm.advantage"
)
"""Every estimator by the name ``algorithm.advantage`` uses."""
ADVANTAGE_ESTIMATORS.register_lazy("grpo", f"{ADVANTAGES}:grpo", needs_groups=True)
ADVANTAGE_ESTIMATORS.register_lazy("dr_grpo", f"{ADVANTAGES}:dr_grpo", needs_groups=True)
ADVANTAGE_ESTIMATORS.register_lazy("rloo", f"{ADVANTAGES}:rloo", needs_groups=True)
ADVANTAGE_ESTIMATORS.register_lazy("reinforce_pp", f"{ADVANTAGES}:reinforce_pp", token_level=True)
ADVANTAGE_ESTIMATORS.register_lazy(
    "reinforce_pp_baseline", f"{ADVANTAGES}:reinforce_pp_baseline", token_level=True, needs_groups=True
)
ADVANTAGE_ESTIMATORS.register_lazy(
    "gae", f"{ADVANTAGES}:gae", token_level=True, needs_critic=True, whiten=True
)


@dataclass(frozen=True, slots=True)
class PolicyLoss(Entry[Callable[..., Any]]):
    """A policy loss (a losses.py ``PolicyLossFn``) and what the trainer may assume of it."""

    vanishes_at_zero_advantage: bool = True
    """A token whose advantage is 0 adds exactly 0 to the loss and its gradient, whatever its
    ratio: the trainer may leave a sample with no nonzero advantage out of forward and backward."""


POLICY_LOSSES: Registry[PolicyLoss] = Registry(PolicyLoss, kind="policy loss", field="algorithm.policy_loss")
"""Every policy loss by the name ``algorithm.policy_loss`` uses."""
POLICY_LOSSES.register_lazy("ppo_clip", f"{LOSSES}:ppo_clip")
POLICY_LOSSES.register_lazy("gspo", f"{LOSSES}:gspo")

LOSS_AGGREGATIONS: Registry[Entry[Callable[..., Any]]] = Registry(
    Entry, kind="loss aggregation", field="algorithm.loss_aggregation"
)
"""How token losses combine (losses.py ``AggregationFn``: each sample's weight per loss token)."""
LOSS_AGGREGATIONS.register_lazy("token_mean", f"{LOSSES}:token_mean")
LOSS_AGGREGATIONS.register_lazy("sequence_mean", f"{LOSSES}:sequence_mean")
LOSS_AGGREGATIONS.register_lazy("constant", f"{LOSSES}:constant_normaliser")

KL_ESTIMATORS: Registry[Entry[Callable[..., Any]]] = Registry(
    Entry, kind="KL estimator", field="algorithm.kl_estimator"
)
"""Every KL estimator (regularizers.py ``KLEstimatorFn``) by the name ``algorithm.kl_estimator`` uses."""
KL_ESTIMATORS.register_lazy("k1", f"{REGULARIZERS}:k1")
KL_ESTIMATORS.register_lazy("k2", f"{REGULARIZERS}:k2")
KL_ESTIMATORS.register_lazy("k3", f"{REGULARIZERS}:k3")

TIS_DEFAULT_CAP = 2.0
"""TIS's cap when ``algorithm.tis.cap`` is null (ms-swift's default importance sampling threshold)."""


@dataclass(frozen=True, slots=True)
class OffPolicyCorrection(Entry[Callable[..., Any]]):
    """How the policy loss corrects for the behaviour policy (a regularizers.py
    ``BehaviourWeightFn``), and what the trainer may assume of it."""

    reweights: bool = True
    """Its weights multiply the policy loss (False: every weight is 1, only the mismatch is measured)."""
    cap_of: Callable[[Any], float | None] = lambda algorithm: None
    """Its cap, read from the ``algorithm`` section (None: ``default_cap``)."""
    default_cap: float = math.inf
    """Its cap when ``cap_of`` gives None."""
    corrects_engine: bool = False
    """It corrects the engine/trainer mismatch, which tokens of the current version have too: the
    old logprobs are recomputed even when every token is fresh (no on-policy fast path)."""


OFF_POLICY_CORRECTIONS: Registry[OffPolicyCorrection] = Registry(
    OffPolicyCorrection, kind="off-policy correction", field="algorithm.off_policy_correction"
)
"""Every off-policy correction by the name ``algorithm.off_policy_correction`` uses."""
OFF_POLICY_CORRECTIONS.register_lazy("none", f"{REGULARIZERS}:unit_importance_weights", reweights=False)
OFF_POLICY_CORRECTIONS.register_lazy(
    "tis",
    f"{REGULARIZERS}:truncated_importance_weights",
    cap_of=lambda algorithm: algorithm.tis.cap,
    default_cap=TIS_DEFAULT_CAP,
    corrects_engine=True,
)
OFF_POLICY_CORRECTIONS.register_lazy(
    "decoupled",
    f"{REGULARIZERS}:decoupled_importance_weights",
    cap_of=lambda algorithm: algorithm.decoupled.cap,
)


@dataclass(frozen=True, slots=True)
class StalePolicy(Entry[Callable[..., Any]]):
    """A stale policy (a regularizers.py ``StalenessFn``) and what the trainer may assume of it."""

    drops: bool = False
    """Samples beyond max_staleness are never trained on, so older groups need not be collected."""


STALE_POLICIES: Registry[StalePolicy] = Registry(
    StalePolicy, kind="stale policy", field="algorithm.stale_policy"
)
"""Every stale policy by the name ``algorithm.stale_policy`` uses."""
STALE_POLICIES.register_lazy("drop", f"{REGULARIZERS}:drop_stale", drops=True)
STALE_POLICIES.register_lazy("downweight", f"{REGULARIZERS}:downweight_stale")


@dataclass(frozen=True, slots=True)
class GroupFilter(Entry[Callable[..., bool]]):
    """A group filter (a filters.py ``GroupFilterFn``: keep the group or not) and its options."""

    options: tuple[str, ...] = ()
    """The options an ``algorithm.filters`` entry of this type may set besides ``type``, each a
    keyword argument of the function."""


GROUP_FILTERS: Registry[GroupFilter] = Registry(
    GroupFilter, kind="group filter", field="algorithm.filters.type"
)
"""Every built-in group filter by the name an ``algorithm.filters`` entry's ``type`` uses; a
user's filter is named by its ``module:function`` (``GROUP_FILTERS.resolve``)."""
GROUP_FILTERS.register_lazy("zero_variance", f"{FILTERS}:zero_variance")
GROUP_FILTERS.register_lazy("dynamic_sampling", f"{FILTERS}:dynamic_sampling", options=("accuracy",))

JOBSPEC_REGISTRIES: dict[str, Registry[Any]] = {
    "advantage": ADVANTAGE_ESTIMATORS,
    "policy_loss": POLICY_LOSSES,
    "loss_aggregation": LOSS_AGGREGATIONS,
    "kl_estimator": KL_ESTIMATORS,
    "off_policy_correction": OFF_POLICY_CORRECTIONS,
    "stale_policy": STALE_POLICIES,
}
"""The ``algorithm`` fields that name one entry, and the registry each names it from."""
