"""The JobSpec: everything a user says about one training job, typed and bounded.

Load it from YAML with ``load_job_spec(path)`` or from a dict with
``JobSpec.model_validate``. Unknown keys and bad values fail with
``JobSpecError``, whose message names each offending field by its dotted path
(``rollout.max_new_tokens: Input should be greater than or equal to 1``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from services.common.algorithm_config import AlgorithmConfig
from services.common.plugins import PLUGIN_PATH, is_plugin_path
from services.common.section import DEEPSPEED_JSON_CHARS, PATH_CHARS, Section, Text
from services.common.tracking_config import TrackingConfig

LORA_MODULE_NAME = r"^[A-Za-z_][A-Za-z0-9_.]{0,255}$"
"""The form of a name in `model.lora.target_modules` (the end of a module's dotted name)."""


class LoraConfig(Section):
    """LoRA with peft: the trainer trains a low-rank adapter of the frozen base model and publishes
    only the adapter; engines merge each version into a copy of the base (docs/trainer.md)."""

    rank: int = Field(16, ge=1, le=4096)
    """Rank r of each adapted matrix's update B·A."""
    alpha: float = Field(32.0, gt=0.0, le=1_000_000.0)
    """Scale of the update: B·A is multiplied by alpha / rank."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training (0 keeps the trainer's logprobs the engines')."""
    target_modules: Literal["all-linear"] | list[str] = Field("all-linear", min_length=1, max_length=256)
    """Modules to adapt: `all-linear` (every linear layer but the LM head), or names, each matching a
    module whose dotted name ends with it (`[q_proj, v_proj]`)."""
    init_from: str | None = Field(None, min_length=1, max_length=PATH_CHARS)
    """A saved adapter to start from (a directory with adapter_config.json and
    adapter_model.safetensors: `verst export --adapter`, peft's save_pretrained) with this rank,
    alpha and targets; null: a fresh adapter (B = 0: the base model's outputs)."""

    @field_validator("target_modules")
    @classmethod
    def _module_names(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list):
            bad = [name for name in value if re.fullmatch(LORA_MODULE_NAME, name) is None]
            if bad:
                raise ValueError(f"{bad[0]!r:.80} is not a module name ({LORA_MODULE_NAME})")
        return value


class ModelConfig(Section):
    """Which model: resolved to a local Hugging Face directory by services/models/, offline."""

    path: str = Field("builtin:addition", min_length=1, max_length=PATH_CHARS)
    """A local Hugging Face model directory, a local `.gguf` file (converted once), a hub id
    (`org/name`) found in the local Hugging Face cache (never downloaded), or `builtin:<name>` for
    a model verst builds."""
    tokenizer: str | None = Field(None, min_length=1, max_length=PATH_CHARS)
    """Tokenizer when it differs from `path`'s, in the same forms."""
    gguf_file: str | None = Field(None, min_length=1, max_length=PATH_CHARS)
    """The `.gguf` file to use inside `path` (a directory or hub id holding GGUF files), as
    transformers' `gguf_file`; null: `path` is the model itself."""

    @field_validator("gguf_file")
    @classmethod
    def _gguf_file_inside_path(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        if not value.lower().endswith(".gguf") or value.startswith(("/", "~")) or ".." in Path(value).parts:
            raise ValueError("must be a .gguf file's path relative to model.path")
        path = str(info.data.get("path", ""))
        if path.startswith("builtin:") or path.lower().endswith(".gguf"):
            raise ValueError(f"needs model.path to be a directory or hub id holding it, not {path!r:.80}")
        return value

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for rollout and training."""
    trust_remote_code: bool = False
    """Allow model code from the model directory (off: only transformers' own classes)."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter of the model instead of all its weights; null: full fine-tuning."""


class DataConfig(Section):
    """Where prompts come from: `source` reads `train` and `eval` (the data-source contract and
    registry are services/data/sources.py's; it imports no JobSpec, so the validators ask it)."""

    source: str = Field("auto", min_length=1, max_length=256)
    """`auto` (each location's form picks its source), a registered data source (`jsonl`,
    `builtin`, …) reading both locations, or a user's `module:function`."""
    train: str = Field("builtin:addition", min_length=1, max_length=PATH_CHARS)
    """Training prompts: a JSONL, Parquet or CSV file, a `datasets` directory (save_to_disk),
    `builtin:<task>` for a toy task, `<source>:<location>`, or what `source` reads."""
    eval: str | None = Field("builtin:addition", min_length=1, max_length=PATH_CHARS)
    """Held-out prompts for evaluation (same forms as `train`); null disables evaluation data."""
    train_split: str | None = Field(None, min_length=1, max_length=256)
    """Split of a `datasets` directory with splits that `train` reads; null: `train`."""
    eval_split: str | None = Field(None, min_length=1, max_length=256)
    """Split of a `datasets` directory with splits that `eval` reads; null: `test`."""
    prompt_field: str = Field("prompt", min_length=1, max_length=256)
    """Key (JSONL, or a source's column) holding the prompt text."""
    messages_field: str = Field("messages", min_length=1, max_length=256)
    """Key (column) holding a row's chat messages (OpenAI format); a row without them has a prompt."""
    answer_field: str = Field("answer", min_length=1, max_length=256)
    """Key (JSONL, or a source's column) holding the reference answer."""
    metadata_fields: list[Text] = Field(default_factory=list, max_length=64)
    """Keys (columns) of each row passed to the reward as the sample's metadata (strings as they
    are, other values as JSON)."""
    format: Literal["auto", "text", "chat"] = "auto"
    """How a prompt becomes tokens: `chat` renders its messages (a prompt string is the user's
    turn) with the tokenizer's chat template, `text` is BOS and its text's tokens, `auto` is chat
    for a row with messages or a tokenizer with a chat template, else text."""
    system_prompt: str | None = Field(None, min_length=1, max_length=65_536)
    """System turn put first in each chat prompt that has none of its own (needs chat format)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the chat template (`apply_chat_template`): `enable_thinking: false`, `tools: [..]`,
    a `chat_template` of the job's own (at most 64 KiB of JSON)."""
    max_prompt_tokens: int = Field(512, ge=1, le=1_048_576)
    """Prompts longer than this (in tokens) are rejected when read."""
    shuffle: bool = True
    """Shuffle a finite source's training prompts each epoch (seeded by the job's seed)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Settings passed as they are to the source (at most 64 KiB of JSON); `reasoning_gym` takes
    its dataset's configuration and its own options (docs/trainer.md)."""

    @field_validator("source")
    @classmethod
    def _source_is_known(cls, value: str) -> str:
        from services.data.sources import source_problem  # imports no JobSpec: no cycle

        problem = source_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("train", "eval")
    @classmethod
    def _location_has_a_source(cls, value: str | None, info: ValidationInfo) -> str | None:
        from services.data.sources import pick_source

        source = info.data.get("source")  # absent when `source` itself was refused
        if value is not None and source is not None:
            pick_source(source, value)  # a ValueError: pydantic names the field
        return value

    @field_validator("options", "chat_template_kwargs")
    @classmethod
    def _options_are_small(cls, value: dict[str, Any]) -> dict[str, Any]:
        from services.data.sources import options_size_problem

        problem = options_size_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs_are_the_templates(cls, value: dict[str, Any]) -> dict[str, Any]:
        from services.data.chat import TEMPLATE_KWARGS_SET_BY_VERST

        taken = sorted(TEMPLATE_KWARGS_SET_BY_VERST & set(value))
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by verst, not by the job")
        return value

    @field_validator("messages_field")
    @classmethod
    def _messages_apart_from_prompt(cls, value: str, info: ValidationInfo) -> str:
        if value == info.data.get("prompt_field"):
            raise ValueError("must differ from prompt_field (a row has messages or a prompt string)")
        return value

    @field_validator("metadata_fields")
    @classmethod
    def _metadata_keys_are_free(cls, value: list[str]) -> list[str]:
        from services.data.prompts import VERST_METADATA_KEYS

        taken = sorted(VERST_METADATA_KEYS & set(value))
        if taken:
            raise ValueError(f"{', '.join(taken)}: verst writes that metadata key itself")
        if len(set(value)) != len(value):
            raise ValueError("names a field twice")
        return value

    @field_validator("system_prompt")
    @classmethod
    def _system_prompt_needs_chat(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("format") == "text":
            raise ValueError("needs the chat format (data.format chat or auto), not text")
        return value


class RolloutConfig(Section):
    prompts_per_step: int = Field(8, ge=1, le=65_536)
    """Prompts (groups) per trainer step."""
    max_new_tokens: int = Field(64, ge=1, le=65_536)
    """Longest response, in tokens, before the engine stops a sample; in a multi-turn episode it
    bounds the whole response, model turns and tool observations together."""
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature for training rollouts (0 is greedy)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0, le=1_000_000)
    """Top-k sampling; 0 disables it."""
    stop: list[Text] = Field(default_factory=list, max_length=64)
    """Stop strings."""
    max_turns: int = Field(1, ge=1, le=256)
    """Model turns per episode; above 1 the runner executes tool calls between turns."""
    tools: list[Text] = Field(default_factory=list, max_length=64)
    """Tools a multi-turn episode may call, by name."""

    @field_validator("tools")
    @classmethod
    def _tools_need_turns(cls, value: list[str], info: ValidationInfo) -> list[str]:
        if value and info.data.get("max_turns", 1) < 2:
            raise ValueError("tools need max_turns >= 2 (a tool result needs a next turn)")
        return value

    strategy: str = Field("auto", min_length=1, max_length=256)
    """How the runner turns a task into its group: `group` (n samples, one turn), `tool_episode`
    (one multi-turn episode with tool calls per sample), a user's agent loop as `module:function`
    (services/runner/strategy.py), or `auto`: tool_episode when max_turns > 1, else group."""

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str, info: ValidationInfo) -> str:
        from services.common.rollout_strategies import check_strategy

        return check_strategy(value, info.data.get("max_turns"))

    tool_call_format: Literal["auto", "hermes", "python_tag", "json"] = "auto"
    """How a turn calls a tool: `hermes` is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    (Hermes/Qwen templates), `python_tag` is `<python>code</python>`, `json` a turn that is one bare
    JSON object `{"name": ..., "arguments": {...}}`; `auto` reads all three."""
    tool_observation: str = Field("<tool_response>\n{output}\n</tool_response>\n", max_length=4096)
    """Text appended after a turn's tool call, `{output}` standing for the tool's output (for a chat
    model, close the assistant turn and open the next one around it)."""
    max_tool_output_tokens: int = Field(512, ge=1, le=65_536)
    """Tool output longer than this many tokens is cut, with a marker, before the model sees it."""
    tool_timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    """Wall time of one tool call (the sandbox's timeout; the call's deadline adds a margin)."""

    @field_validator("tool_observation")
    @classmethod
    def _observation_shows_output(cls, value: str) -> str:
        if "{output}" not in value:
            raise ValueError("must contain {output}, where the tool's output goes")
        return value

    weight_update: Literal["continue", "abort"] | None = None
    """In-flight requests on new weights: keep decoding, or abort and resume (partial rollout);
    null leaves it to each engine's VERST_ENGINE_WEIGHT_UPDATE_MODE."""
    request_timeout_s: float = Field(300.0, gt=0.0, le=86_400.0)
    """Deadline of one Generate call."""


class RewardShapingConfig(Section):
    """One reward shaping: its `type` and, as the other keys, its options."""

    model_config = ConfigDict(extra="allow")
    type: str = Field(min_length=1, max_length=256)
    """A built-in shaping (`overlong_penalty`) or a user's `module:function` (services/common/shaping.py)."""

    @field_validator("type")
    @classmethod
    def _known_shaping(cls, value: str) -> str:
        from services.common.shaping import REWARD_SHAPINGS

        if is_plugin_path(value):
            if PLUGIN_PATH.fullmatch(value) is None:
                raise ValueError(f"{value!r} is not module:function")
            return value
        if value not in REWARD_SHAPINGS:
            try:
                REWARD_SHAPINGS.get(value)
            except ValueError as err:  # names the field and the built-ins
                raise ValueError(f"{err}; or a module:function of your own") from None
        return value

    @model_validator(mode="after")
    def _options_fit(self) -> RewardShapingConfig:
        from services.common.shaping import REWARD_SHAPINGS, check_shaping_options

        options = self.options
        if len(options) > 16:
            raise ValueError(f"has {len(options)} options; at most 16")
        for name, value in options.items():
            if not isinstance(value, str | int | float | bool | None) or len(str(value)) > 1024:
                raise ValueError(f"option {name!r} must be a number, a bool or at most 1024 characters")
        if self.type in REWARD_SHAPINGS:  # a user's options are checked where it runs
            check_shaping_options(REWARD_SHAPINGS.get(self.type), options)
        return self

    @property
    def options(self) -> dict[str, Any]:
        """The keys besides `type`: the shaping's keyword arguments."""
        return dict(self.model_extra or {})


class RewardConfig(Section):
    address: str | None = Field(None, max_length=255, pattern=r"^[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}$")
    """host:port of a Reward service; null means the one verst runs."""
    verifier: str = Field("addition", min_length=1, max_length=256)
    """Verifier name in the reward service."""
    plugin: str | None = Field(None, max_length=256, pattern=r"^[\w.]+:[\w]+$")
    """User reward function as `module:function`, instead of a built-in verifier."""
    timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    """Deadline of one Score call."""
    shaping: list[RewardShapingConfig] = Field(default_factory=list, max_length=16)
    """Applied in order by the runner to each scored group, e.g. `[{type: overlong_penalty,
    buffer_tokens: 64}]`; trajectories keep the verifier's reward in `verifier_reward`."""

    @property
    def scorer(self) -> str:
        """What ScoreRequest.verifier carries: the plugin's `module:function`, else the verifier."""
        return self.plugin or self.verifier


class TrainerConfig(Section):
    steps: int = Field(20, ge=1, le=10_000_000)
    """Optimiser steps (one per rollout batch) before the job succeeds."""
    learning_rate: float = Field(1e-5, gt=0.0, le=1.0)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0.0, le=100.0)
    """AdamW weight decay."""
    warmup_steps: int = Field(0, ge=0, le=10_000_000)
    """Linear warm-up steps of the schedule."""
    scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Gradient clipping norm; null disables clipping."""
    zero_stage: int | None = Field(None, ge=0, le=3)
    """DeepSpeed ZeRO stage; null: 1 with several trainer processes, 0 with one (nothing to partition)."""
    micro_batch_tokens: int = Field(8192, ge=16, le=1 << 30)
    """Token budget of one micro-batch (dynamic batching packs to it)."""
    packing: bool = True
    """Lay several samples end to end in a row (no padding between them); false: one per row."""
    share_prompts: bool = True
    """With packing, compute a prompt once for all its samples (a GRPO group), each sample's
    response attending to it through a 4D mask: the same logits, fewer tokens (steps whose
    samples are all at most 512 tokens long)."""
    skip_zero_advantage: bool = True
    """Leave out of forward and backward the samples with no nonzero advantage when the loss is the
    policy loss alone (no KL loss, no entropy bonus): their gradient is exactly 0, and the step's
    loss aggregation still counts them."""
    autocast: Literal["off", "bfloat16", "float16"] = "off"
    """Mixed precision: the forward's matmuls in this dtype (torch.autocast), the weights, optimiser
    and LM head in float32 (needs model.dtype float32); off: everything in model.dtype."""
    ppo_epochs: int = Field(1, ge=1, le=100)
    """Passes over each rollout batch."""
    mini_batches: int = Field(1, ge=1, le=1024)
    """Optimiser steps per pass over a rollout batch."""
    checkpoint_dir: str = Field("runs", min_length=1, max_length=PATH_CHARS)
    """Where checkpoints are written (a volume shared with the engines)."""
    keep_checkpoints: int = Field(3, ge=1, le=1000)
    """How many recent durable checkpoints to keep (their manifests are the de-duplication window)."""
    checkpoint_every_steps: int = Field(100, ge=1, le=10_000_000)
    """A durable checkpoint (weights, optimiser, schedule, what was consumed) every K steps, besides
    the last step, a stop and SIGTERM; every step publishes weights only. Trained trajectories
    stay unacked until a durable checkpoint covers them."""
    checkpoint_every_seconds: float | None = Field(None, gt=0.0, le=604_800.0)
    """Also a durable checkpoint at the first step this long after the previous one; null: by steps only."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in backward instead of keeping them: less memory for
    about a third more compute, the same loss and gradients."""
    deepspeed: dict[str, Any] | None = None
    """Raw DeepSpeed config merged over the one derived from this section (at most 64 KiB of JSON)."""

    @field_validator("deepspeed")
    @classmethod
    def _deepspeed_is_small(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                size = len(json.dumps(value))
            except (TypeError, ValueError, RecursionError):
                raise ValueError("must be plain JSON (objects, arrays, strings, numbers)") from None
            if size > DEEPSPEED_JSON_CHARS:
                raise ValueError(f"is {size} characters of JSON; at most {DEEPSPEED_JSON_CHARS}")
        return value


EVAL_SET_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""The form of a named eval set's name (it prefixes the set's metrics: `eval/<name>/accuracy`)."""
DEFAULT_EVAL_SET = "default"
"""The name of the set `data.eval` makes (its metrics are unprefixed: `eval/accuracy`)."""


class EvalSetConfig(Section):
    """One named held-out set, read through a data source as `data.eval` is; the other keys of
    `data` (fields, options) are the job's unless given here (services/common/eval_sets.py)."""

    source: str | None = Field(None, min_length=1, max_length=256)
    """The data source reading `location`, as `data.source` takes it; null: `data.source`."""
    location: str = Field(min_length=1, max_length=PATH_CHARS)
    """Where its prompts are, in the forms of `data.eval` (a JSONL file, `builtin:<task>`,
    `<source>:<location>`, or what `source` reads)."""
    split: str | None = Field(None, min_length=1, max_length=256)
    """Split of a `datasets` directory with splits that `location` is; null: `data.eval_split`."""
    num_prompts: int | None = Field(None, ge=1, le=1_000_000)
    """Prompts of this set per evaluation; null: `eval.num_prompts`."""
    prompt_field: str | None = Field(None, min_length=1, max_length=256)
    """Key holding the prompt text; null: `data.prompt_field`."""
    answer_field: str | None = Field(None, min_length=1, max_length=256)
    """Key holding the reference answer; null: `data.answer_field`."""
    options: dict[str, Any] | None = None
    """Settings passed to its source; null: `data.options` when `source` is null, else none."""

    @field_validator("source")
    @classmethod
    def _source_is_known(cls, value: str | None) -> str | None:
        from services.data.sources import source_problem

        problem = None if value is None else source_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("location")
    @classmethod
    def _location_has_a_source(cls, value: str, info: ValidationInfo) -> str:
        from services.data.sources import pick_source

        source = info.data.get("source")  # null: data.source's, checked when the set is read
        if source is not None:
            pick_source(source, value)
        return value

    @field_validator("options")
    @classmethod
    def _options_are_small(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        from services.data.sources import options_size_problem

        problem = None if value is None else options_size_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    def data_config(self, data: DataConfig) -> DataConfig:
        """The job's data section as this set reads it: its source, location (as `data.eval`),
        fields and options in place of the job's (its own source takes no options of the job's)."""
        own = {"source": self.source, "eval_split": self.split}
        own |= {"prompt_field": self.prompt_field, "answer_field": self.answer_field}
        update: dict[str, Any] = {k: v for k, v in own.items() if v is not None} | {"eval": self.location}
        if self.options is not None or self.source is not None:
            update["options"] = self.options or {}
        return data.model_copy(update=update)


class EvalConfig(Section):
    every_steps: int = Field(5, ge=0, le=10_000_000)
    """Held-out evaluation every K steps (0: only at the start and the end)."""
    num_prompts: int = Field(128, ge=1, le=1_000_000)
    """Held-out prompts per evaluation, of each set (a set may say otherwise)."""
    at_start: bool = True
    """Evaluate the base model (version 0) before training."""
    max_new_tokens: int | None = Field(None, ge=1, le=65_536)
    """Response budget for evaluation; null means the rollout's."""
    sets: dict[str, EvalSetConfig] = Field(default_factory=dict, max_length=32)
    """Named held-out sets evaluated beside `data.eval` (metrics `eval/<name>/accuracy`, …;
    `data.eval`'s stay `eval/accuracy`, …), e.g. `{gsm8k: {location: gsm8k_test.jsonl}}`."""
    samples_per_prompt: int = Field(0, ge=0, le=1024)
    """Answers sampled per prompt at `temperature` besides the greedy one, for `mean@n` and
    `pass@k`; 0: greedy accuracy only."""
    temperature: float = Field(1.0, gt=0.0, le=10.0)
    """Sampling temperature of those answers (plain temperature sampling: no top-p, no top-k)."""
    pass_k: list[int] = Field(default_factory=list, max_length=16)
    """The k of each pass@k reported (unbiased estimator, each k <= samples_per_prompt); empty:
    pass@samples_per_prompt alone."""

    @field_validator("sets")
    @classmethod
    def _set_names(cls, value: dict[str, EvalSetConfig]) -> dict[str, EvalSetConfig]:
        for name in value:
            if re.fullmatch(EVAL_SET_NAME, name) is None:
                raise ValueError(f"set name {name!r:.80} must match {EVAL_SET_NAME}")
            if name == DEFAULT_EVAL_SET:
                raise ValueError(f"{name!r} names data.eval's set; call this one otherwise")
        return value

    @field_validator("pass_k")
    @classmethod
    def _k_within_samples(cls, value: list[int], info: ValidationInfo) -> list[int]:
        samples = info.data.get("samples_per_prompt")
        if samples is None:  # samples_per_prompt itself was refused
            return value
        if value and samples == 0:
            raise ValueError("needs samples_per_prompt >= 1 (pass@k counts sampled answers)")
        bad = [k for k in value if not 1 <= k <= samples]
        if bad:
            raise ValueError(f"each k must be in [1, samples_per_prompt={samples}], not {bad}")
        if len(set(value)) != len(value):
            raise ValueError(f"has a k twice: {value}")
        return value

    @property
    def reported_k(self) -> list[int]:
        """The k of every pass@k reported (none without sampled answers)."""
        if not self.samples_per_prompt:
            return []
        return sorted(self.pass_k) or [self.samples_per_prompt]


class JobSpec(Section):
    name: str = Field("job", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Human-readable job name (ASCII letters, digits, `_`, `.`, `-`; starting with a letter or digit)."""
    seed: int = Field(0, ge=0, le=2**63 - 1)
    """Seed for data order, sampling and initialisation."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Which model to train."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Where prompts and reference answers come from."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimator, policy loss and their knobs."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """How responses are sampled."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """How responses are scored."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimisation, DeepSpeed and checkpoints."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation schedule."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Experiment trackers that also record the job's metrics (TensorBoard by default, W&B, MLflow)."""

    @model_validator(mode="after")
    def _autocast_keeps_float32_weights(self) -> JobSpec:
        if self.trainer.autocast != "off" and self.model.dtype != "float32":
            raise ValueError(
                f"trainer.autocast {self.trainer.autocast!r} keeps the weights in float32: it needs"
                f" model.dtype float32, not {self.model.dtype!r} (or set trainer.autocast off)"
            )
        return self


class JobSpecError(ValueError):
    """A JobSpec failed validation; the message lists each field path and what is wrong."""

    def __init__(self, errors: list[tuple[str, str]], source: str = "job spec") -> None:
        self.errors = errors
        lines = "\n".join(f"  {path}: {message}" for path, message in errors)
        super().__init__(f"invalid {source}:\n{lines}")


def _field_path(location: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in location) or "(root)"


def parse_job_spec(data: Any, source: str = "job spec") -> JobSpec:
    """Validate a mapping (from YAML or JSON) as a JobSpec; raises JobSpecError."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise JobSpecError([("(root)", f"expected a mapping, got {type(data).__name__}")], source)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        errors = [(_field_path(e["loc"]), e["msg"]) for e in err.errors()]
        raise JobSpecError(errors, source) from None


def load_job_spec(path: str | Path) -> JobSpec:
    """Read a JobSpec from a YAML file; raises JobSpecError naming each bad field."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise JobSpecError([("(yaml)", str(err))], str(path)) from None
    return parse_job_spec(data, str(path))
