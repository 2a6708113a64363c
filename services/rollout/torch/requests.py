"""What the torch engine works with: the loaded model, the samples it batches (rows) and how
they grow token by token, and staged weight updates."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from services.common.pb import common_pb2
from services.rollout.engine_protocol import Completion, FinishReason, GenerationRequest
from services.rollout.sampling import row_seed

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LoadedModel:
    """A model ready to serve, with what the engine needs to know about it."""

    model: torch.nn.Module
    vocab_size: int
    max_positions: int
    eos_token_ids: frozenset[int]
    pad_token_id: int
    tokenizer: Any | None
    cache_argument: str
    """``cache`` in recent transformers, ``past_key_values`` before."""
    keeps_last_logits: bool
    """Whether forward takes ``logits_to_keep`` (skip the LM head on the prompt)."""
    config: dict[str, Any] = field(default_factory=dict)
    base_sha256: str = ""
    """Set when the model is a LoRA base with adapters merged in (adapters.py): its sha256."""
    pristine: dict[str, torch.Tensor] = field(default_factory=dict)
    """The base's own copy of every weight an adapter adapted (CPU), to merge each version from."""


@dataclass(eq=False)
class Row:
    """One sample being generated: the unit the worker batches."""

    request: GenerationRequest
    index: int
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None

    @property
    def seed(self) -> int | None:
        """The seed of this sample's random stream, or None for the engine's shared one."""
        seed = self.request.config.seed
        return None if seed is None else row_seed(seed, self.index)


@dataclass(eq=False)
class WeightUpdate:
    """A verified checkpoint waiting for the worker: a new model, or a state dict to copy."""

    version: int
    job_id: str
    path: Path
    mode: int
    model: LoadedModel | None = None
    state_dict: dict[str, torch.Tensor] | None = None
    partial: bool = False
    """The state dict holds some of the model's tensors (merged adapter weights), not all."""
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None
    aborted_requests: int = 0


def kv_need(row: Row) -> int:
    """The cache positions ``row`` may fill: its prompt and every token it may sample."""
    return len(row.request.prompt) + row.request.config.max_new_tokens


def admissible(
    queued: Iterable[Row], free: int, *, live: int = 0, longest: int = 0, max_tokens: int | None = None
) -> int:
    """How many of ``queued`` (from the front, in order) may join a batch of ``live`` rows whose
    longest ``kv_need`` is ``longest``: at most ``free`` rows, and (when ``max_tokens`` is set)
    all the rows times the longest need among them within ``max_tokens``, which is what the slot
    cache holds (every slot is as long as the longest sample). An empty batch takes its first
    row whatever its need, so no request waits for good."""
    count = 0
    for row in queued:
        if count >= free:
            break
        longest = max(longest, kv_need(row))
        if max_tokens is not None and (live + count + 1) * longest > max_tokens and live + count:
            break
        count += 1
    return count


class LiveRequests:
    """The torch engine's unfinished requests and their queued samples; the engine holds its
    lock around every call."""

    def __init__(self) -> None:
        self.queue: deque[Row] = deque()
        """Samples waiting for a slot, in arrival order."""
        self._by_id: dict[str, set[GenerationRequest]] = {}

    def add(self, request: GenerationRequest, stop_ids: frozenset[int]) -> None:
        """Queue the request's ``n`` samples."""
        request.unfinished = request.config.n
        self._by_id.setdefault(request.request_id, set()).add(request)
        self.queue.extend(Row(request, i, stop_ids) for i in range(request.config.n))

    def matching(self, request_ids: Iterable[str], *, all_requests: bool) -> set[GenerationRequest]:
        if all_requests:
            return {r for group in self._by_id.values() for r in group}
        return {r for rid in request_ids for r in self._by_id.get(rid, ())}

    def abort(self, targets: set[GenerationRequest]) -> None:
        """Mark ``targets`` aborted: their queued samples finish now (no tokens), running ones at
        the worker's next look (``finish_aborted``)."""
        for request in targets:
            request.aborted = True
        kept: deque[Row] = deque()
        for row in self.queue:
            if row.request.aborted:
                self.finish(row, common_pb2.FINISH_REASON_ABORT)
            else:
                kept.append(row)
        self.queue = kept

    def finish_aborted(self, rows: list[Row], *, stopping: bool) -> None:
        """End the unfinished ``rows`` of aborted requests (all of them when ``stopping``) as ABORT."""
        for row in rows:
            if row.finish is None and (row.request.aborted or stopping):
                self.finish(row, common_pb2.FINISH_REASON_ABORT)

    def take(
        self,
        free: int,
        prefill_budget: int,
        *,
        live: int = 0,
        longest: int = 0,
        max_tokens: int | None = None,
    ) -> list[Row]:
        """The queued samples that may join (``admissible``) whose requests' prompts fit
        ``prefill_budget`` tokens together (the first request is taken whatever its length)."""
        count = admissible(self.queue, free, live=live, longest=longest, max_tokens=max_tokens)
        rows: list[Row] = []
        prefill: set[int] = set()
        while self.queue and len(rows) < count:
            request = self.queue[0].request
            if id(request) not in prefill:
                if prefill and len(request.prompt) > prefill_budget:
                    break
                prefill.add(id(request))
                prefill_budget -= len(request.prompt)
            rows.append(self.queue.popleft())
        return rows

    def finish(self, row: Row, reason: FinishReason, error: str = "") -> None:
        """Complete one sample (once) and hand it to its request's caller."""
        if row.finish is not None:
            return
        row.finish = reason
        request = row.request
        request.unfinished -= 1
        if request.unfinished == 0:
            group = self._by_id.get(request.request_id)
            if group is not None:
                group.discard(request)
                if not group:
                    del self._by_id[request.request_id]
        completion = Completion(row.index, row.tokens, row.logprobs, row.versions, reason, error)
        try:
            request.on_completion(completion)
        except Exception:  # a closed event loop must not kill the worker
            log.exception("could not deliver a completion of request %s", request.request_id)


class FinishHook(Protocol):
    def finish(self, row: Row, reason: int, error: str = "") -> None: ...


def finish_reason(row: Row, tokenizer: object | None) -> int | None:
    """STOP, LENGTH or None (keep going) after the row's latest token."""
    config = row.request.config
    if row.tokens[-1] in row.stop_ids:
        return common_pb2.FINISH_REASON_STOP
    if config.stop and tokenizer is not None:
        # Checked after every token, so a stop can only end in the newest one: decode a tail
        # long enough to hold any stop string, not the whole response (quadratic otherwise).
        tail = row.tokens[-(2 * max(map(len, config.stop)) + 8) :]
        text = tokenizer.decode(tail)  # type: ignore[attr-defined]
        if any(stop in text for stop in config.stop):
            return common_pb2.FINISH_REASON_STOP
    if len(row.tokens) >= config.max_new_tokens:
        return common_pb2.FINISH_REASON_LENGTH
    return None


def record_tokens(
    rows: list[Row],
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    *,
    version: int,
    tokenizer: object | None,
    hooks: FinishHook,
) -> int:
    """Append each unfinished row's sampled token, logprob and policy version; finish rows that
    stop. Returns how many tokens were appended (the engine counts them as they are made)."""
    now = time.monotonic()
    appended = 0
    for row, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
        if row.finish is not None:
            continue
        appended += 1
        row.tokens.append(token)
        row.logprobs.append(logprob)
        row.versions.append(version)
        request = row.request
        if request.first_token_at is None:
            request.first_token_at = now
        if request.on_tokens is not None:
            request.on_tokens(row.index, token, logprob, version)
        reason = finish_reason(row, tokenizer)
        if reason is not None:
            hooks.finish(row, reason)
    return appended


def validate_request(request: GenerationRequest, loaded: LoadedModel) -> None:
    """Raise ValueError (fit for INVALID_ARGUMENT) for a request ``loaded`` cannot serve."""
    prompt, config = request.prompt, request.config
    if not prompt:
        raise ValueError("prompt_token_ids is empty")
    bad = [t for t in prompt if not 0 <= t < loaded.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids outside the vocabulary [0, {loaded.vocab_size}): {bad[:5]}")
    bad = [t for t in config.stop_token_ids if not 0 <= t < loaded.vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids outside the vocabulary [0, {loaded.vocab_size}): {bad[:5]}")
    total = len(prompt) + config.max_new_tokens
    if loaded.max_positions and total > loaded.max_positions:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({config.max_new_tokens}) = {total} "
            f"exceeds the model's {loaded.max_positions} positions"
        )
    if config.stop and loaded.tokenizer is None:
        raise ValueError("stop strings need a tokenizer in the checkpoint; use stop_token_ids")
