"""The JobSpec's ``algorithm`` section: the common knobs flat, each algorithm's own settings nested
under its name (``gae``, ``gspo``, ``tis``, ``decoupled``, ``downweight``), and the group filters.

The names it offers are services/common/algorithms.py's; config.py puts the section in the JobSpec.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import (
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from services.common.algorithms import (
    ADVANTAGE_ESTIMATORS,
    GROUP_FILTERS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
    STALE_POLICIES,
)
from services.common.plugins import PLUGIN_PATH, is_plugin_path
from services.common.section import Section

# The algorithm names are services/common/algorithms.py's registries': the `algorithm` fields
# that name one offer exactly those, and its validators ask their declared traits.
AdvantageName = Literal[ADVANTAGE_ESTIMATORS.names()]
PolicyLossName = Literal[POLICY_LOSSES.names()]
LossAggregationName = Literal[LOSS_AGGREGATIONS.names()]
KLEstimatorName = Literal[KL_ESTIMATORS.names()]
OffPolicyCorrectionName = Literal[OFF_POLICY_CORRECTIONS.names()]
StalePolicyName = Literal[STALE_POLICIES.names()]


class GaeConfig(Section):
    """GAE's settings, and its critic's (``algorithm.advantage: gae``)."""

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)
    lambda_: float = Field(1.0, ge=0.0, le=1.0, alias="lambda")
    """GAE's lambda, the bias/variance trade-off of the advantage (1: returns minus values)."""
    value_clip: float | None = Field(0.2, gt=0.0, le=1e6)
    """Clip range of the critic's value update around the old values; null disables it."""
    critic_learning_rate: float = Field(1e-5, gt=0.0, le=1.0)
    """Learning rate of the critic's AdamW (constant; trainer.weight_decay applies)."""


class GspoConfig(Section):
    """GSPO's settings (``algorithm.policy_loss: gspo``)."""

    clip_low: float = Field(3e-4, ge=0.0, lt=1.0)
    """The sequence ratio is clipped below at 1 - clip_low (the paper's 3e-4: a sequence ratio
    moves far less than a token ratio, so PPO's 0.2 would rarely clip)."""
    clip_high: float = Field(4e-4, ge=0.0, le=10.0)
    """The sequence ratio is clipped above at 1 + clip_high (the paper's 4e-4)."""


class TisConfig(Section):
    """Truncated importance sampling's settings (``algorithm.off_policy_correction: tis``)."""

    cap: float | None = Field(None, gt=0.0, le=1e6)
    """Cap of the weight p_old / p_behaviour (null: 2.0); setting it selects off_policy_correction `tis`."""


class DecoupledConfig(Section):
    """Decoupled PPO's settings (``algorithm.off_policy_correction: decoupled``)."""

    cap: float = Field(5.0, gt=1.0, le=1e6)
    """Tokens whose weight p_old / p_behaviour exceeds it are left out of the loss (AReaL's
    behav_imp_weight_cap)."""


class DownweightConfig(Section):
    """The `downweight` stale policy's settings (``algorithm.stale_policy: downweight``)."""

    decay: float = Field(0.5, gt=0.0, le=1.0)
    """A sample's loss weight is decay ** (versions beyond max_staleness)."""


FilterOption = str | int | float | bool | None
"""The value of a group filter's option: a JSON scalar."""


class GroupFilterConfig(Section):
    """One group filter: `type` picks it; its other keys are its options (keyword arguments)."""

    model_config = ConfigDict(extra="allow")
    type: str = Field(min_length=1, max_length=256)
    """A built-in group filter (services/common/algorithms.py, GROUP_FILTERS) or a user's
    `module:function`."""

    @field_validator("type")
    @classmethod
    def _known_filter(cls, value: str) -> str:
        if is_plugin_path(value) and PLUGIN_PATH.fullmatch(value) is None:
            raise ValueError(f"{value!r} is not module:function")
        if not GROUP_FILTERS.accepts(value):
            raise ValueError(
                f"must be one of {', '.join(GROUP_FILTERS.names())}, or a user's module:function"
            )
        return value

    @model_validator(mode="after")
    def _options_are_scalars_it_takes(self) -> GroupFilterConfig:
        options = self.options
        if len(options) > 16:
            raise ValueError(f"has {len(options)} options; at most 16")
        for name, value in options.items():
            if not isinstance(value, FilterOption) or (isinstance(value, str) and len(value) > 1024):
                raise ValueError(
                    f"option {name!r} must be a string (at most 1024 characters), number or bool"
                )
        if self.type in GROUP_FILTERS:  # a user's filter has its options checked where it runs
            takes = GROUP_FILTERS.declared(self.type)["options"]  # declared: nothing is imported
            unknown = sorted(set(options) - set(takes))
            if unknown:
                its = ", ".join(takes) or "none"
                raise ValueError(f"{self.type} takes no option {', '.join(unknown)} (its options: {its})")
        return self

    @property
    def options(self) -> dict[str, FilterOption]:
        """Every key but `type`: the filter's keyword arguments."""
        return dict(self.model_extra or {})


MOVED_ALGORITHM_KEYS = {
    "gae_lambda": "gae.lambda",
    "value_clip": "gae.value_clip",
    "critic_learning_rate": "gae.critic_learning_rate",
    "gspo_clip_low": "gspo.clip_low",
    "gspo_clip_high": "gspo.clip_high",
    "tis_cap": "tis.cap",
    "behaviour_weight_cap": "decoupled.cap",
    "stale_decay": "downweight.decay",
    "filter_zero_variance_groups": "filters: [{type: zero_variance}]",
}
"""Keys of the `algorithm` section that moved, and where to: each is refused, naming its new place."""


class AlgorithmConfig(Section):
    advantage: AdvantageName = "grpo"
    """Advantage estimator."""
    policy_loss: PolicyLossName = "ppo_clip"
    """Policy loss: token-level clipped ratio, or GSPO's sequence-level ratio."""
    group_size: int = Field(8, ge=1, le=1024)
    """Responses sampled per prompt (the GRPO group, n)."""
    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower clip range: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0.0, le=10.0)
    """Upper clip range: the ratio is clipped above at 1 + clip_high (clip-higher when > clip_low)."""
    dual_clip: float | None = Field(None, gt=1.0, le=1e6)
    """Dual-clip bound c on negative-advantage tokens; null disables it."""
    loss_aggregation: LossAggregationName = "token_mean"
    """How token losses combine: over all tokens, per sequence then mean, or Dr.GRPO's constant."""
    kl_coef: float = Field(0.0, ge=0.0, le=1000.0)
    """Weight of the KL penalty to the frozen reference model; 0 disables the reference."""
    kl_estimator: KLEstimatorName = "k3"
    """KL estimator (k3 is the low-variance one)."""
    kl_in_reward: bool = False
    """Fold the KL penalty into each token's reward (REINFORCE++ style) instead of the loss."""
    entropy_coef: float = Field(0.0, ge=0.0, le=1000.0)
    """Weight of the entropy bonus."""
    off_policy_correction: OffPolicyCorrectionName = "decoupled"
    """How the policy loss corrects for the weights that sampled each token: `decoupled` (decoupled
    PPO: weight p_old / p_behaviour, tokens above decoupled.cap left out), `tis` (weight
    min(p_old / p_behaviour, tis.cap)) or `none`."""
    max_staleness: int = Field(1, ge=0, le=1000)
    """How many policy versions a token may lag the trainer and still be trained on."""
    stale_policy: StalePolicyName = "drop"
    """What happens to samples older than max_staleness."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount per action token of the token-level estimators (REINFORCE++, GAE)."""
    filters: list[GroupFilterConfig] = Field(default_factory=list, max_length=16)
    """Group filters, applied in order to each complete group: a group one drops is not trained on,
    and the controller replaces it."""
    oversample: float = Field(0.0, ge=0.0, le=10.0)
    """Extra prompts kept in flight, as a share of one step's (0.5: half a batch more), so that a
    group the filters drop is covered by one already generated instead of its replacement; near
    the share the filters drop over the share they keep."""
    gae: GaeConfig = Field(default_factory=GaeConfig)
    """GAE's lambda and its critic."""
    gspo: GspoConfig = Field(default_factory=GspoConfig)
    """GSPO's clip ranges."""
    tis: TisConfig = Field(default_factory=TisConfig)
    """Truncated importance sampling's cap."""
    decoupled: DecoupledConfig = Field(default_factory=DecoupledConfig)
    """Decoupled PPO's cap."""
    downweight: DownweightConfig = Field(default_factory=DownweightConfig)
    """The `downweight` stale policy's decay."""

    @model_validator(mode="wrap")
    @classmethod
    def _moved_keys_name_their_place(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        moved = [key for key in MOVED_ALGORITHM_KEYS if isinstance(data, dict) and key in data]
        if not moved:
            return handler(data)
        errors = [
            InitErrorDetails(
                type=PydanticCustomError("moved", "moved: use algorithm.{place}", {"place": place}),
                loc=(key,),
                input=data[key],
            )
            for key in moved
            for place in [MOVED_ALGORITHM_KEYS[key]]
        ]
        try:  # the section's other errors too, in one report
            handler({key: value for key, value in data.items() if key not in MOVED_ALGORITHM_KEYS})
        except ValidationError as err:
            errors += cast(list[InitErrorDetails], err.errors())
        raise ValidationError.from_exception_data(cls.__name__, errors)

    @model_validator(mode="before")
    @classmethod
    def _tis_cap_selects_tis(cls, data: Any) -> Any:
        tis = data.get("tis") if isinstance(data, dict) else None
        if isinstance(tis, dict) and tis.get("cap") is not None and "off_policy_correction" not in data:
            return {**data, "off_policy_correction": "tis"}
        return data

    @model_validator(mode="after")
    def _tis_cap_is_for_tis(self) -> AlgorithmConfig:
        if self.tis.cap is not None and self.off_policy_correction != "tis":
            raise ValueError(
                f"tis.cap is the cap of off_policy_correction 'tis', not {self.off_policy_correction!r}"
            )
        return self

    @field_validator("group_size")
    @classmethod
    def _group_estimators_need_groups(cls, value: int, info: ValidationInfo) -> int:
        advantage = info.data.get("advantage")
        if advantage in ADVANTAGE_ESTIMATORS.where(needs_groups=True) and value < 2:
            raise ValueError(f"must be >= 2 for the {advantage!r} estimator")
        return value

    @field_validator("kl_in_reward")
    @classmethod
    def _kl_reward_needs_a_token_estimator(cls, value: bool, info: ValidationInfo) -> bool:
        advantage = info.data.get("advantage")
        token_level = ADVANTAGE_ESTIMATORS.where(token_level=True)
        if value and advantage not in token_level:
            names = ", ".join(sorted(token_level))
            raise ValueError(f"needs a token-level advantage ({names}), not {advantage!r}")
        if value and not info.data.get("kl_coef"):
            raise ValueError("needs kl_coef > 0")
        return value

    @field_validator("oversample")
    @classmethod
    def _oversample_covers_filters(cls, value: float, info: ValidationInfo) -> float:
        if value > 0 and not info.data.get("filters"):
            raise ValueError("covers the groups algorithm.filters drop: set filters, or leave it 0")
        return value
