"""Training prompts of a job as PromptTasks, in a deterministic order.

The feed reads the job's train source (seeded by the job's seed) from the
start, skipping the prompts already issued, so a restarted controller that has
issued ``consumed`` prompts continues with exactly the ones that follow. Regular
batches have ids ``{job_id}:{batch}:{index}``; replacements for groups the
trainer dropped have ids ``{job_id}:extra:{n}``.

Each prompt is encoded by ``services.data.encode_prompt`` in the job's ``data.format``; a chat
prompt's task also carries its messages (``messages_json``), on which a multi-turn episode renders
its tool turns, and every task the row's metadata (``data.metadata_fields``) for the reward.
A multi-turn chat job whose template cannot append a tool turn fails when the feed is made.

Prompts longer than ``data.max_prompt_tokens`` are skipped, but never endlessly: after
``MAX_SKIPPED_IN_A_ROW`` of them in a row the feed raises ``DataError`` (the train source is
endless, so a filter without that bound would spin forever on a data set none of whose prompts fit).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator
from typing import Any

from services.common.config import JobSpec
from services.common.pb import common_pb2
from services.data import (
    DataError,
    PromptExample,
    PromptTooLongError,
    encode_prompt,
    prompt_messages,
    train_prompts,
)
from services.data.chat import ChatTemplateError, check_tool_turns, has_chat_template

log = logging.getLogger(__name__)

MAX_SKIPPED_IN_A_ROW = 1000
"""Too-long training prompts in a row after which the feed gives up (``DataError``)."""


class PromptFeed:
    """Builds a job's PromptTasks. Reading the data source happens (and fails, with
    services.data.DataError) when the feed is made."""

    def __init__(self, spec: JobSpec, job_id: str, tokenizer: Any, *, consumed: int = 0) -> None:
        self.spec = spec
        self.job_id = job_id
        self.tokenizer = tokenizer
        self.sampling = sampling_params(spec)
        self._check_tool_turns()
        encoded = self._encoded(train_prompts(spec.data, spec.seed))
        self._prompts = itertools.islice(encoded, consumed, None)

    def batch(self, index: int) -> list[common_pb2.PromptTask]:
        """The next ``rollout.prompts_per_step`` prompts as batch ``index``."""
        prompts = itertools.islice(self._prompts, self.spec.rollout.prompts_per_step)
        return [
            self._task(f"{self.job_id}:{index}:{i}", example, ids) for i, (example, ids) in enumerate(prompts)
        ]

    def extra(self, first: int, count: int) -> list[common_pb2.PromptTask]:
        """The next ``count`` prompts as replacements number ``first`` on."""
        prompts = itertools.islice(self._prompts, count)
        return [
            self._task(f"{self.job_id}:extra:{first + i}", ex, ids) for i, (ex, ids) in enumerate(prompts)
        ]

    def _check_tool_turns(self) -> None:
        """``DataError`` now, not a dead letter per episode, when a multi-turn job's prompts are
        chat and its template cannot append a tool turn to a model's turn."""
        data, rollout = self.spec.data, self.spec.rollout
        multi_turn = rollout.max_turns > 1 and rollout.strategy in ("auto", "tool_episode")
        chat = data.format == "chat" or (
            data.format == "auto" and has_chat_template(self.tokenizer, data.chat_template_kwargs)
        )
        if multi_turn and chat:
            try:
                check_tool_turns(self.tokenizer, data.chat_template_kwargs)
            except ChatTemplateError as err:
                raise DataError(f"tool turns of a chat job (rollout.max_turns > 1): {err}") from None

    def _encoded(self, examples: Iterator[PromptExample]) -> Iterator[tuple[PromptExample, list[int]]]:
        limit = self.spec.data.max_prompt_tokens
        skipped = 0
        for example in examples:
            try:
                ids = encode_prompt(self.tokenizer, example, settings=self.spec.data, max_tokens=limit)
            except PromptTooLongError as err:
                skipped += 1
                if skipped >= MAX_SKIPPED_IN_A_ROW:
                    message = f"{skipped} training prompts in a row are longer than {limit} tokens"
                    raise DataError(f"{message} (data.max_prompt_tokens)") from None
                if skipped <= 10:  # the first few say which; the rest would only flood the log
                    log.warning("%s: skipped training prompt %s: %s", self.job_id, example.prompt_id, err)
                continue
            skipped = 0
            yield example, ids

    def _task(self, prompt_id: str, example: PromptExample, ids: list[int]) -> common_pb2.PromptTask:
        messages = prompt_messages(self.tokenizer, example, self.spec.data)
        task = common_pb2.PromptTask(
            prompt_id=prompt_id,
            job_id=self.job_id,
            group_id=prompt_id,
            prompt_token_ids=ids,
            prompt_text=example.text,
            n_samples=self.spec.algorithm.group_size,
            sampling=self.sampling,
            answer=example.answer,
            verifier=self.spec.reward.scorer,
            split=common_pb2.SPLIT_TRAIN,
            max_turns=self.spec.rollout.max_turns,
            tools=self.spec.rollout.tools,
            metadata={**example.metadata, "source_prompt_id": example.prompt_id},
            messages_json="" if messages is None else json.dumps(messages, ensure_ascii=False),
        )
        task.created_at.GetCurrentTime()
        return task


def sampling_params(spec: JobSpec) -> common_pb2.SamplingParams:
    """Training rollout sampling of a job (the engine stops at the tokenizer's EOS itself)."""
    rollout = spec.rollout
    return common_pb2.SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens,
        stop=rollout.stop,
        n=spec.algorithm.group_size,
    )
