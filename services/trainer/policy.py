"""The policy being trained: a Hugging Face causal LM inside a DeepSpeed engine.

All methods block (run them in a thread). One optimiser step packs its samples
into micro-batches by ``trainer.micro_batch_tokens``, runs forward/backward on
each with DeepSpeed's accumulation boundary set on the last one, then steps.
The token weights normalise over the whole step, so the accumulated gradient is
the full-batch gradient however the samples were packed.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from services.common.algorithms import POLICY_LOSSES
from services.common.config import JobSpec, TrainerConfig
from services.common.long_lived import freeze_long_lived_objects, release_long_lived_objects
from services.trainer import adapters, distributed
from services.trainer.batching import (
    MicroBatch,
    TrainSample,
    collate_pack,
    per_response_token,
    plan_step,
    token_logprobs,
)
from services.trainer.checkpoints import TRAINING_STATE_DIR, TRAINING_STATE_FILE, TRAINING_STATE_TAG
from services.trainer.critic import Critic
from services.trainer.extension_locks import extension_build_guard
from services.trainer.layout_checks import packing_works, sharing_works
from services.trainer.losses import sample_token_weights
from services.trainer.objective import (
    ProximalFromForward,
    StepStats,
    Totals,
    combine,
    micro_batch_loss,
    optimiser_step_plan,
    samples_with_gradient,
)
from services.trainer.precision import autocast, check_autocast, keep_head_in_float32

log = logging.getLogger(__name__)

_BATCH_FIELD = "trainer.micro_batch_tokens decides it (micro-batches are packed by tokens)"
RESERVED_DEEPSPEED_KEYS = {
    "train_batch_size": _BATCH_FIELD,
    "train_micro_batch_size_per_gpu": _BATCH_FIELD,
    "gradient_accumulation_steps": _BATCH_FIELD,
    "optimizer": "trainer.learning_rate and trainer.weight_decay set it (a torch AdamW)",
    "scheduler": "trainer.scheduler and trainer.warmup_steps set it",
}
"""Keys of trainer.deepspeed the trainer refuses, with the fields that set them instead."""

MIRRORED_DEEPSPEED_KEYS = {
    ("zero_optimization", "stage"): "trainer.zero_stage",
    ("gradient_clipping",): "trainer.max_grad_norm",
    ("bf16", "enabled"): "model.dtype",
    ("fp16", "enabled"): "model.dtype",
}
"""Keys derived from a typed field: trainer.deepspeed may repeat them, not contradict them."""

DISTRIBUTED_TIMEOUT = timedelta(seconds=60)
"""Default deadline of collective operations (the service sets VERST_TRAINER_DISTRIBUTED_TIMEOUT_S)."""

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
"""trainer.scheduler -> the transformers schedule of that shape (all with linear warm-up)."""


def select_device(setting: str) -> torch.device:
    """``auto``: cuda when available, else cpu."""
    if setting == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the trainer is set to run on cuda, but torch sees no CUDA device")
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def import_deepspeed() -> ModuleType:
    """``import deepspeed``, without importing MLflow along with it.

    DeepSpeed's autotuner module imports mlflow whenever it is installed (about 0.9 s of a
    trainer's 3.7 s start, pandas and fastapi with it), but only the ``deepspeed --autotuning``
    launcher uses it, never a trainer process. Hidden for this one import, mlflow reads as absent
    to the autotuner and stays importable to everything after; one imported before is left be.
    """
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # so `import mlflow` raises ImportError
    try:
        import deepspeed
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


def init_distributed(device: torch.device, timeout: timedelta = DISTRIBUTED_TIMEOUT) -> None:
    """The torch.distributed group DeepSpeed requires; once per process.

    Under a launcher (torchrun, deepspeed: WORLD_SIZE > 1) the group is every trainer
    process, met through the launcher's MASTER_ADDR/MASTER_PORT (services/trainer/
    distributed.py). Alone, it is a one-process group with an in-memory store: one process
    needs no rendezvous port, so none can be taken or shared by mistake, and no MASTER_*
    variables leak to child processes. ``timeout`` bounds every collective operation.
    """
    if device.type == "cpu" and torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    deepspeed = import_deepspeed()

    backend = "nccl" if device.type == "cuda" else "gloo"
    if not torch.distributed.is_initialized():
        world = distributed.world_from_env()
        os.environ.setdefault("LOCAL_RANK", str(world.local_rank))  # the DeepSpeed engine reads it
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        if world.size > 1:
            torch.distributed.init_process_group(backend, timeout=timeout)  # env:// from the launcher
        else:
            torch.distributed.init_process_group(
                backend, store=torch.distributed.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    with extension_build_guard():  # DeepSpeed JIT-loads its CPU communication op here
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def zero_stage(trainer: TrainerConfig) -> int:
    """The ZeRO stage the trainer runs: trainer.zero_stage, or by default 1 with several processes
    and 0 with one (ZeRO partitions over ranks; alone, stage 1 only adds copies of the gradients
    and weights to every step: 2-3 s of a 14 s SmolLM2-135M step on a CPU)."""
    if trainer.zero_stage is not None:
        return trainer.zero_stage
    return 1 if distributed.size() > 1 else 0


def deepspeed_config(trainer: TrainerConfig, dtype: str) -> dict[str, Any]:
    """The DeepSpeed config derived from the trainer section, with ``trainer.deepspeed`` merged over it.

    Precedence: the raw ``trainer.deepspeed`` dict wins, key by key (nested dicts merge
    recursively), over what is derived here, except for RESERVED_DEEPSPEED_KEYS (refused)
    and MIRRORED_DEEPSPEED_KEYS (refused unless equal to the typed field's value). The
    optimiser is always a torch AdamW and the schedule transformers' (``learning_rate_schedule``),
    so nothing is compiled; ``zero_force_ds_cpu_optimizer`` is off, so ZeRO-Offload of the
    optimiser (``zero_optimization.offload_optimizer``) runs that AdamW on the CPU.
    An invalid combination raises ValueError naming the field.
    """
    overrides = trainer.deepspeed or {}
    reserved = sorted(RESERVED_DEEPSPEED_KEYS.keys() & overrides.keys())
    if reserved:
        key = reserved[0]
        owner = RESERVED_DEEPSPEED_KEYS[key]
        raise ValueError(f"trainer.deepspeed.{key}: trainer.deepspeed may not set {key}; {owner}")
    derived: dict[str, Any] = {
        # One backward call per micro-batch. Their number per step varies with the packing, so
        # the trainer marks the accumulation boundary itself and DeepSpeed's counter stays at 1.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": trainer.max_grad_norm or 0.0,
        "zero_optimization": {"stage": zero_stage(trainer)},
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    merged = _merge(derived, overrides)
    for path, field in MIRRORED_DEEPSPEED_KEYS.items():
        ours, theirs = _lookup(derived, path), _lookup(merged, path)
        if theirs != ours:
            name = f"trainer.deepspeed.{'.'.join(path)}"
            raise ValueError(f"{name} is {theirs!r} but {field} makes it {ours!r}: set {field}")
    _check_offload(merged.get("zero_optimization") or {}, zero_stage(trainer))
    return merged


def _lookup(config: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        config = config.get(key) if isinstance(config, dict) else None
    return config


def _check_offload(zero: dict[str, Any], stage: int) -> None:
    """ZeRO-Offload needs a stage that partitions what it offloads (DeepSpeed ignores it otherwise)."""

    def offloads(key: str) -> bool:
        setting = zero.get(key)
        return isinstance(setting, dict) and setting.get("device", "none") != "none"

    name = "trainer.deepspeed.zero_optimization"
    if offloads("offload_param") and stage != 3:
        raise ValueError(f"{name}.offload_param needs trainer.zero_stage 3")
    if offloads("offload_optimizer") and stage == 0:
        raise ValueError(f"{name}.offload_optimizer needs trainer.zero_stage >= 1")


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def learning_rate_schedule(
    optimizer: torch.optim.Optimizer, trainer: TrainerConfig, completed_versions: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """Warm-up then trainer.scheduler's shape, advanced past ``completed_versions`` rollout batches."""
    from transformers import get_scheduler

    steps_per_version = trainer.ppo_epochs * trainer.mini_batches
    schedule = get_scheduler(
        SCHEDULES[trainer.scheduler],
        optimizer,
        num_warmup_steps=trainer.warmup_steps,
        num_training_steps=trainer.steps * steps_per_version,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # stepping before optimizer.step() is the point
        for _ in range(completed_versions * steps_per_version):
            schedule.step()
    return schedule


def _restore_training_state(engine: Any, state: Path, zero_stage: int, frozen_excluded: bool) -> None:
    """Load the optimiser and schedule saved by ``Policy.save`` into a fresh engine, if their
    layout matches this run's (a ZeRO partition belongs to one rank of one world size); with
    ``frozen_excluded`` (LoRA) the saved module state holds the trainable tensors alone."""
    layout = json.loads((state / TRAINING_STATE_FILE).read_text())
    here = {"world_size": distributed.size(), "zero_stage": zero_stage}
    if layout != here:
        log.warning("optimiser state saved with %s, this run has %s: its moments start afresh", layout, here)
        return
    path, _ = engine.load_checkpoint(
        str(state),
        tag=TRAINING_STATE_TAG,
        load_module_strict=not frozen_excluded,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint in {state}")
    log.info("restored the optimiser and schedule from %s", state)


def weights_state(module: Any, *, snapshot: bool = False) -> dict[str, torch.Tensor]:
    """The tensors model.safetensors holds: each once, a tied one under the name transformers
    keeps (its ``_tied_weights_keys`` dropped); with ``snapshot``, CPU copies that later steps do
    not change."""
    tied = set(getattr(module, "_tied_weights_keys", None) or ())
    full = module.state_dict()
    kept: set[str] = set()
    seen: set[tuple[int, tuple[int, ...]]] = set()
    # Names transformers ties (lm_head.weight) after the ones it keeps: a shared tensor goes once.
    for name in sorted(full, key=lambda key: key in tied):
        identity = (full[name].data_ptr(), tuple(full[name].shape))
        if identity not in seen or full[name].numel() == 0:
            seen.add(identity)
            kept.add(name)
    state = {name: tensor.detach() for name, tensor in full.items() if name in kept}
    if snapshot:
        return {name: tensor.to("cpu", copy=True).contiguous() for name, tensor in state.items()}
    return {name: tensor.contiguous() for name, tensor in state.items()}


def write_weights_file(state: dict[str, torch.Tensor], directory: Path) -> None:
    """``directory``/model.safetensors of ``state`` (``weights_state``), as one file whatever
    the size (engines verify its sha256)."""
    from safetensors.torch import save_file

    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def write_snapshot(state: dict[str, torch.Tensor], directory: Path, *, adapter: bool) -> None:
    """Write a ``Policy.weights_snapshot``: the model's weights file, or with ``adapter`` (LoRA)
    the adapter's."""
    if adapter:
        adapters.write_adapter_file(state, directory)
    else:
        write_weights_file(state, directory)


def base_weights_state(module: Any) -> dict[str, torch.Tensor]:
    """The frozen base weights of a LoRA-wrapped model, named as in the unwrapped model."""
    state = weights_state(adapters.base_model(module))
    return {new: tensor for name, tensor in state.items() if (new := adapters.base_name(name)) is not None}


def without_dropout(model: torch.nn.Module) -> None:
    """Turn the model's dropout off (GPT-2's configs have 0.1): the ratio and the mismatch compare the
    trainer's logprobs with the engines', which sample without dropout, so training must not drop."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # Llama-style attention
            module.attention_dropout = 0.0


def checkpoint_activations(model: Any) -> None:
    """trainer.gradient_checkpointing: each layer recomputes its activations in backward. Non-reentrant
    checkpointing, which DeepSpeed, a frozen base under LoRA and the 4D shared-prompt mask all work with."""
    options = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)  # its name from transformers 5.25
    if enable is not None:
        enable(options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def loaded(what: str, path: str | Path, auto: Any, trust_remote_code: bool) -> Any:
    """``auto.from_pretrained(path)``; a failure is a ValueError that says what did not load."""
    try:
        return auto.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:  # corrupt weights, a config transformers cannot read, missing files
        raise ValueError(f"cannot load the {what} from {path}: {type(err).__name__}: {err}") from err


class Policy:
    """A DeepSpeed-wrapped causal LM with its tokenizer."""

    def __init__(
        self, engine: Any, tokenizer: Any, spec: JobSpec, packed: bool = True, shared: bool = False
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.spec = spec
        self.packed = packed
        """Several samples per row (trainer.packing, and the model keeps them apart)."""
        self.shared = shared
        """The samples of one prompt share it in their row (trainer.share_prompts, and the model
        honours the mask)."""
        self.zero_stage = zero_stage(spec.trainer)
        self.lora = spec.model.lora is not None
        """Only a LoRA adapter trains: it is what ``save`` and ``weights_snapshot`` give."""
        self.device = torch.device(engine.device)
        self.loss_fn = POLICY_LOSSES.get(spec.algorithm.policy_loss).fn

    @classmethod
    def load(
        cls,
        spec: JobSpec,
        model_dir: Path,
        tokenizer_dir: Path,
        device: torch.device,
        completed_versions: int = 0,
        training_state: Path | None = None,
        adapter_from: Path | None = None,
    ) -> Policy:
        """Load weights and tokenizer, and build the optimiser, schedule and DeepSpeed engine.

        When a job resumes, ``training_state`` is its checkpoint's DeepSpeed state (optimiser
        moments and step counts, the schedule): restored when it was saved by as many ranks
        with the same ZeRO stage, else the moments start afresh. ``completed_versions``
        (rollout batches trained into these weights) moves the schedule on in that case.
        With ``model.lora`` the model is wrapped in a LoRA adapter (adapters.py), started from
        the adapter saved in ``adapter_from`` when given, and only the adapter trains.
        """
        deepspeed = import_deepspeed()
        from deepspeed.runtime.config import DeepSpeedConfig
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one bar per save is noise in a service's log
        if spec.model.dtype == "float16" and device.type != "cuda":
            raise ValueError("model.dtype float16 needs a GPU; use float32 or bfloat16 on CPU")
        check_autocast(spec.trainer.autocast, device)
        trainer = spec.trainer
        config = deepspeed_config(trainer, spec.model.dtype)
        try:
            DeepSpeedConfig(copy.deepcopy(config))  # fail before loading anything, naming the section
        except (ValueError, AssertionError) as err:
            raise ValueError(f"trainer.deepspeed: DeepSpeed rejects the merged config: {err}") from None
        trust = spec.model.trust_remote_code
        tokenizer = loaded("tokenizer", tokenizer_dir, AutoTokenizer, trust)
        torch.manual_seed(spec.seed)
        # fp32 master weights; DeepSpeed casts the module itself when bf16 or fp16 is on.
        model = loaded("model", model_dir, AutoModelForCausalLM, trust).float()
        model.config.dtype = spec.model.dtype  # what the saved config says: the published weights' dtype
        without_dropout(model)
        packed = trainer.packing and packing_works(model, "policy")
        shared = packed and trainer.share_prompts and sharing_works(model, "policy")
        if trainer.gradient_checkpointing:
            checkpoint_activations(model)
        if trainer.autocast != "off":
            keep_head_in_float32(model)
        if spec.model.lora is not None:
            model = adapters.wrap(model, spec.model.lora, adapter_from)
        trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
        # fused: one kernel over every tensor (CPU: 1.7 -> 0.4 ms a step on the demo's model,
        # 311 -> 61 ms on SmolLM2's), as transformers' Trainer defaults to
        optimizer = torch.optim.AdamW(
            trained, lr=trainer.learning_rate, weight_decay=trainer.weight_decay, fused=True
        )
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=learning_rate_schedule(optimizer, trainer, completed_versions),
            config=config,
        )
        if distributed.size() == 1 and zero_stage(trainer) == 0:
            # One rank: DeepSpeed's all-reduce would flatten every gradient, reduce it with itself
            # and copy it back, each micro-batch (ZeRO's stages keep theirs: it moves their shards).
            engine.enable_backward_allreduce = False
        if training_state is not None:
            _restore_training_state(engine, training_state, zero_stage(trainer), spec.model.lora is not None)
        freeze_long_lived_objects()  # the model, the engine and their modules live for the job
        return cls(engine, tokenizer, spec, packed, shared)

    def optimise(
        self,
        samples: Sequence[TrainSample],
        seed: int,
        critic: Critic | None = None,
        proximal: ProximalFromForward | None = None,
    ) -> StepStats:
        """``ppo_epochs`` passes over the samples, each split into ``mini_batches`` optimiser steps
        (the critic, when given, steps on the same mini-batches).

        PPO's ratio is to each sample's ``old_logprobs``, fixed for all the steps: the
        trainer's own from the start of the step (services/trainer/prepare.py sets them), or,
        with ``proximal`` (one pass; prepare skipped that forward), the training forward's own.
        """
        if not samples:
            raise ValueError("no samples to optimise on")
        trainer = self.spec.trainer
        steps: list[tuple[Totals, float]] = []
        critic_steps = []
        for chunk in optimiser_step_plan(len(samples), trainer.ppo_epochs, trainer.mini_batches, seed):
            part = [samples[i] for i in chunk]
            steps.append(self._optimiser_step(part, proximal))
            if critic is not None:
                critic_steps.append(critic.optimiser_step(part))
        return combine(steps, critic_steps, float(self.engine.get_lr()[0]), proximal)

    def _optimiser_step(
        self, samples: Sequence[TrainSample], proximal: ProximalFromForward | None = None
    ) -> tuple[Totals, float]:
        """One optimiser step over packed micro-batches; returns their totals and the grad norm."""
        algorithm = self.spec.algorithm
        weights = sample_token_weights(
            [s.loss_tokens for s in samples], algorithm.loss_aggregation, self.spec.rollout.max_new_tokens
        )
        count = len(samples)
        if self.spec.trainer.skip_zero_advantage:  # weighed over all, trained on those with a gradient
            kept = samples_with_gradient(samples, algorithm)
            samples, weights = [samples[i] for i in kept], [weights[i] for i in kept]
        # With several ranks each runs its share of the packs (services/trainer/distributed.py).
        plan, shared = plan_step(samples, self.spec.trainer.micro_batch_tokens, self.packed, self.shared)
        packs = distributed.share_of(plan)
        self.engine.train()
        totals = Totals(samples=count, skipped=count - len(samples))
        for index, (pack, real) in enumerate(packs):
            scale = 1.0 if real else 0.0  # a padding pass only keeps the ranks' collectives in step
            batch = collate_pack(samples, [w * scale for w in weights], pack, self.device, shared)
            self.engine.set_gradient_accumulation_boundary(index == len(packs) - 1)
            with autocast(self.spec.trainer.autocast, self.device):
                logits = self.engine(**batch.model_inputs()).logits
            loss = micro_batch_loss(
                logits, batch, algorithm, self.loss_fn, totals if real else Totals(), proximal
            )
            self.engine.backward(loss * distributed.gradient_scale(), scale_wrt_gas=False)
        own_norm = self._gradient_norm() if self.zero_stage == 0 else None
        self.engine.step()
        reported = self.engine.get_global_grad_norm()
        grad_norm = float(reported) if reported is not None else float(own_norm or 0.0)
        return distributed.sum_over_ranks(totals), grad_norm

    def _gradient_norm(self) -> float:
        """The gradient norm before clipping, for ZeRO stage 0 (whose engine does not report it)."""
        norms = [
            p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None
        ]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    @torch.no_grad()
    def response_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """log p of each response token of each sample under the current weights."""
        self.engine.eval()
        budget = self.spec.trainer.micro_batch_tokens
        return per_response_token(
            samples, budget, self.device, self._token_logprobs, self.packed, self.shared
        )

    def _token_logprobs(self, batch: MicroBatch) -> torch.Tensor:
        with autocast(self.spec.trainer.autocast, self.device):
            logits = self.engine(**batch.model_inputs()).logits
        return token_logprobs(logits, batch.input_ids)

    def save(self, directory: Path) -> None:
        """The weights as an HF-loadable directory in the engine's dtype (the module's: DeepSpeed
        casts it to model.dtype): one model.safetensors, config, tokenizer files; with LoRA the
        adapter as peft saves it (adapter_model.safetensors, adapter_config.json).

        With several ranks every rank calls it, on the same (shared) directory: ZeRO-3
        gathers the weights for rank 0 to write.
        """
        self.save_weights(directory)
        if distributed.rank() != 0:
            return
        if self.lora:
            adapters.write_adapter_config(self.engine.module, directory)
        else:
            self._save_model_files(self.engine.module, directory)

    def _save_model_files(self, model: Any, directory: Path) -> None:
        """The files of an HF directory beside the weights: config, generation config, tokenizer."""
        model.config.save_pretrained(directory)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)

    def save_weights(self, directory: Path) -> None:
        """Only the weights file of ``save`` (the other files do not change between steps)."""
        snapshot = self.weights_snapshot()
        if snapshot is not None:
            write_snapshot(snapshot, directory, adapter=self.lora)

    def weights_snapshot(self) -> dict[str, torch.Tensor] | None:
        """A CPU copy of what ``save_weights`` writes (with LoRA, the adapter's tensors), for
        writing while training goes on (rank 0's; None on the others). Call it on every rank:
        ZeRO-3 gathers the shards."""
        import deepspeed

        module = self.engine.module
        gather = self.zero_stage == 3  # ZeRO-3 holds only shards: gather them to save
        wanted = [p for p in module.parameters() if p.requires_grad or not self.lora]
        with deepspeed.zero.GatheredParameters(wanted, enabled=gather):
            if distributed.rank() != 0:
                return None
            if self.lora:
                return adapters.adapter_state(module, snapshot=True)
            return weights_state(module, snapshot=True)

    def save_base(self, directory: Path) -> None:
        """The frozen base model of a LoRA policy as an HF-loadable directory in the engine's
        dtype (model.safetensors, config, tokenizer files): what its adapters apply to. Call it
        on every rank (ZeRO-3 gathers)."""
        import deepspeed

        module = self.engine.module
        gather = self.zero_stage == 3
        with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=gather):
            if distributed.rank() != 0:
                return
            write_weights_file(base_weights_state(module), directory)
            self._save_model_files(adapters.base_model(module), directory)

    def save_training_state(self, directory: Path) -> None:
        """DeepSpeed's checkpoint of the optimiser and schedule in ``directory/training_state``;
        every rank writes its own optimiser partition (call it on every rank)."""
        state = directory / TRAINING_STATE_DIR
        # With LoRA the frozen base stays out: the checkpoint holds the adapter and its moments.
        trainable_only = adapters.trainable_state_only(self.engine.module) if self.lora else nullcontext()
        with trainable_only:
            self.engine.save_checkpoint(
                str(state), tag=TRAINING_STATE_TAG, save_latest=False, exclude_frozen_parameters=self.lora
            )
        if distributed.rank() == 0:
            layout = {"world_size": distributed.size(), "zero_stage": self.zero_stage}
            (state / TRAINING_STATE_FILE).write_text(json.dumps(layout))

    def close(self) -> None:
        """Release the engine's memory before the next job."""
        destroy = getattr(self.engine, "destroy", None)
        if callable(destroy):
            destroy()
        self.engine = None
        release_long_lived_objects()  # load froze the engine: its cycles are freed only now
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
