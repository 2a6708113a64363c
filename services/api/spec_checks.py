"""Checks of a submitted JobSpec against the world, so that a spec which cannot run is a 422 now
rather than a job that fails (or spins) later.

``SpecChecker.check`` returns every problem as (field path, message):

- paths: model.path, model.tokenizer, model.lora.init_from, and data.train, data.eval and each
  eval.sets location where their data source ``reads_path``, inside VERST_DATA_ROOTS;
  trainer.checkpoint_dir inside VERST_CHECKPOINT_ROOT
  (when set; ``builtin:`` models, hub ids read from the local Hugging Face cache and sources that
  read no path always pass); a data.source that
  names a user's function which cannot be imported (the api runs the controller, which runs it);
- readable: a model directory with a config.json, a tokenizer directory, a GGUF file, a hub id
  in the local Hugging Face cache (services/models/ resolves them all), a saved LoRA adapter's
  files in model.lora.init_from, the paths data sources
  read exist, the data reads (as the controller will read it), ``builtin:`` names that exist;
- prompts: of the first ``check_prompts`` training prompts, encoded in the job's ``data.format``,
  at least one fits ``data.max_prompt_tokens`` under the job's tokenizer (skipped when no
  tokenizer is at hand: a builtin model not built yet, a GGUF file not converted yet, or
  ``trust_remote_code``, whose code the api does not run);
- reward: a ``reward.address`` the spec names answers gRPC health within ``check_timeout_s``; the
  reward service that will score the job (that one, else the api's) knows ``reward.verifier`` or
  can import ``reward.plugin`` (``Reward.CheckVerifier``: only the scoring process knows its
  registry and its plugins' import path; a server without that RPC is taken at its word);
- tracking: each tracker in tracking.trackers has its package installed here, where the
  controller that writes it runs (tracking_config.tracker_problems).

A check that cannot finish within ``check_timeout_s`` is skipped with a log line: slowness is no
proof of a bad spec, and the job's own deadlines still apply.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api.config import ApiSettings
from services.common.checkpoint_layout import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from services.common.config import JobSpec
from services.common.eval_sets import eval_set_sources, read_eval_set
from services.common.grpc_client import channel
from services.common.pb import reward_pb2, reward_pb2_grpc
from services.common.spec_paths import data_paths, local_paths
from services.common.tracking_config import tracker_problems
from services.data import DataError, PromptExample, encode_prompt, train_prompts
from services.models import ModelPathError, locate, prepared_model_path, readable_problem

log = logging.getLogger(__name__)

ADAPTER_FILES = (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)
"""What a saved LoRA adapter directory holds (`model.lora.init_from`)."""

Problem = tuple[tuple[str, ...], str]
"""(field path, what is wrong)."""
_TOKENIZERS: dict[str, Any] = {}
_TOKENIZER_LOCK = threading.Lock()


def _inside(value: str, roots: list[Path]) -> bool:
    resolved = Path(os.path.realpath(value))
    return any(resolved == root or resolved.is_relative_to(root) for root in roots)


def confinement_problems(spec: JobSpec, settings: ApiSettings) -> list[Problem]:
    """Paths outside the configured roots, and a data source that cannot be had."""
    try:
        paths = local_paths(spec)
    except DataError as err:  # a user's source that does not import: nothing to confine
        return [(("data", "source"), str(err))]
    problems: list[Problem] = []
    roots = settings.data_root_paths()
    if roots:
        shown = os.pathsep.join(str(root) for root in roots)
        for path, value in paths:
            if not _inside(value, roots):
                problems.append((path, f"must lie in VERST_DATA_ROOTS ({shown})"))
    root = settings.checkpoint_root_path()
    if root is not None and not _inside(spec.trainer.checkpoint_dir, [root]):
        problems.append((("trainer", "checkpoint_dir"), f"must lie in VERST_CHECKPOINT_ROOT ({root})"))
    return problems


def readability_problems(spec: JobSpec) -> list[Problem]:
    """Model, tokenizer and data that cannot be read (blocking: run it in a thread)."""
    model = spec.model
    if model.gguf_file is None:
        problems = _model_problems(("model", "path"), model.path)
    else:  # a directory (or hub id) holding the GGUF file: no config.json of its own
        problems = _model_problems(("model", "path"), model.path, need=None)
        if not problems:
            problems = _model_problems(("model", "gguf_file"), model.path, model.gguf_file)
    if model.tokenizer is not None:
        problems += _model_problems(("model", "tokenizer"), model.tokenizer, need=None)
    if model.lora is not None and model.lora.init_from is not None:
        problems += _adapter_problems(model.lora.init_from)
    return problems + _data_problems(spec)


def _adapter_problems(path: str) -> list[Problem]:
    """Why ``model.lora.init_from`` names no saved adapter (its rank and targets the trainer checks)."""
    missing = [name for name in ADAPTER_FILES if not os.access(Path(path) / name, os.R_OK)]
    if not missing:
        return []
    return [
        (("model", "lora", "init_from"), f"{path!r:.200} holds no readable {missing[0]}: not a saved adapter")
    ]


def _model_problems(
    field: tuple[str, ...], path: str, gguf_file: str | None = None, need: str | None = "config.json"
) -> list[Problem]:
    """Why ``path`` names no readable model (``need`` in its directory) or tokenizer (None)."""
    try:
        source = locate(path, gguf_file)
    except ModelPathError as err:
        return [(field, str(err))]
    problem = readable_problem(source, need)
    return [] if problem is None else [(field, problem)]


def _data_problems(spec: JobSpec) -> list[Problem]:
    """Data that cannot be read: a path a source reads that does not exist, else what reading says."""
    try:
        paths = data_paths(spec)
    except DataError as err:
        return [(("data", "source"), str(err))]
    missing = {
        field: f"cannot read prompts from {path!r:.200}: no such file or directory"
        for field, path in paths
        if not os.path.exists(path)
    }
    readers: list[tuple[tuple[str, ...], Callable[[], object]]] = [
        (("data", "train"), lambda: next(train_prompts(spec.data, spec.seed))),
    ]
    readers += [(held.field, functools.partial(read_eval_set, held, 1)) for held in eval_set_sources(spec)]
    problems: list[Problem] = []
    for field, read in readers:
        if field in missing:
            problems.append((field, missing[field]))
            continue
        try:
            read()
        except DataError as err:
            problems.append((field, str(err)))
    return problems


def tokenizer_path(spec: JobSpec) -> str | None:
    """Where the job's tokenizer is now, or None when the api should not or cannot load it (a
    builtin model not built, a GGUF file not converted: the trainer does that, not the api)."""
    if spec.model.trust_remote_code:
        return None
    try:
        if spec.model.tokenizer is not None:
            found = prepared_model_path(spec.model.tokenizer)
        else:
            found = prepared_model_path(spec.model.path, spec.model.gguf_file)
    except ModelPathError:
        return None  # readability_problems names it
    return None if found is None else str(found)


def _load_tokenizer(path: str) -> Any:
    with _TOKENIZER_LOCK:  # transformers' lazy imports are not thread-safe
        if path not in _TOKENIZERS:
            from transformers import AutoTokenizer  # slow; only when a spec is checked

            if len(_TOKENIZERS) >= 8:
                _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
            _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        return _TOKENIZERS[path]


def prompt_problems(spec: JobSpec, count: int) -> list[Problem]:
    """A problem when none of the first ``count`` training prompts fits (blocking)."""
    path = tokenizer_path(spec)
    if path is None:
        return []
    field = ("model", "tokenizer") if spec.model.tokenizer is not None else ("model", "path")
    try:
        tokenizer = _load_tokenizer(path)
    except (OSError, ValueError) as err:
        return [(field, f"cannot load a tokenizer from {path!r:.200}: {err}")]
    try:
        sample = _first_prompts(train_prompts(spec.data, spec.seed), count)
    except DataError:
        return []  # readability_problems names it
    limit = spec.data.max_prompt_tokens
    try:
        lengths = [len(encode_prompt(tokenizer, example, settings=spec.data)) for example in sample]
    except DataError as err:  # e.g. chat messages, or a system prompt, and no chat template
        return [(("data", "format"), str(err))]
    if lengths and min(lengths) > limit:
        return [
            (
                ("data", "max_prompt_tokens"),
                f"every one of the first {len(lengths)} training prompts is longer than {limit} tokens "
                f"(the shortest has {min(lengths)})",
            )
        ]
    return []


def _first_prompts(prompts: Iterator[PromptExample], count: int) -> list[PromptExample]:
    """Up to ``count`` prompts, stopping where the (endless) source comes round to one it gave."""
    seen: set[str] = set()
    sample = []
    for example in itertools.islice(prompts, count):
        if example.prompt_id in seen:
            break
        seen.add(example.prompt_id)
        sample.append(example)
    return sample


class SpecChecker:
    """The submission checks of the module docstring, with the api's settings."""

    def __init__(self, settings: ApiSettings) -> None:
        self.settings = settings

    async def check(self, spec: JobSpec) -> list[Problem]:
        """Every problem found; empty when the spec may be queued."""
        problems = confinement_problems(spec, self.settings)
        if problems:  # do not touch paths the spec may not name
            return problems
        problems += await self._in_thread("reading the model and data", readability_problems, spec)
        if not problems:
            count = self.settings.check_prompts
            problems += await self._in_thread("checking prompt lengths", prompt_problems, spec, count)
        return problems + tracker_problems(spec.tracking) + await self._reward_problems(spec)

    async def _in_thread(self, what: str, check: Callable[..., list[Problem]], *args: Any) -> list[Problem]:
        try:
            return await asyncio.wait_for(asyncio.to_thread(check, *args), self.settings.check_timeout_s)
        except TimeoutError:
            log.warning("spec check skipped: %s took longer than %.3gs", what, self.settings.check_timeout_s)
            return []

    async def _reward_problems(self, spec: JobSpec) -> list[Problem]:
        address = spec.reward.address or self.settings.reward_address
        field = ("reward", "plugin") if spec.reward.plugin else ("reward", "verifier")
        timeout = self.settings.check_timeout_s
        async with channel(address) as chan:
            if spec.reward.address is not None:
                problem = await _health_problem(chan, address, timeout)
                if problem:
                    return [(("reward", "address"), problem)]
            request = reward_pb2.CheckVerifierRequest(verifier=spec.reward.scorer)
            try:
                reply = await reward_pb2_grpc.RewardStub(chan).CheckVerifier(request, timeout=timeout)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("spec check skipped: CheckVerifier at %s: %s", address, err.code().name)
                return []
        return [] if reply.ok else [(field, reply.error)]


async def _health_problem(chan: grpc.aio.Channel, address: str, timeout: float) -> str:
    """Why ``address`` cannot serve, or "" (a server without the health service passes)."""
    try:
        reply = await health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.UNIMPLEMENTED:
            return ""
        return f"the reward service at {address!r} is unreachable: {err.code().name}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"the reward service at {address!r} is not serving"
    return ""
