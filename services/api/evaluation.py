"""Held-out evaluation of a job's policy: greedy answers through the router, scored by the reward service.

Accuracy is the fraction of eval prompts whose reward is at least 1 (the
verifier's "fully correct"); reward_mean is the plain mean. A prompt that could
not be generated or scored counts as wrong and is counted in ``errors``.

A call whose engine, router or reward service failed or went away (``RETRYABLE``) is made
again, ``attempts`` times in all, after a pause that doubles and, for a Generate, once an
engine serves the version again: the router sends it to a live engine, another one when the
first died. Only when every attempt failed is the evaluation lost (an EvalError, which the
controller logs and counts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from services.common.config import JobSpec
from services.common.pb import (
    common_pb2,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    router_pb2,
    router_pb2_grpc,
)
from services.tasks import PromptExample, PromptTooLongError, encode_prompt

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)
"""Codes of a call that may succeed elsewhere or later: the peer died, hung, restarted or was busy."""
RETRY_PAUSE_S = 0.5
"""The pause before the second attempt of a call; it doubles with each further one."""
ENGINE_POLL_S = 0.2
"""How often the router is asked which versions its engines serve."""
LIST_ENGINES_TIMEOUT_S = 5.0
"""Deadline of one ListEngines call."""


class EvalError(RuntimeError):
    """An evaluation could not run; the message says why."""


@dataclass(frozen=True, slots=True)
class EvalResult:
    """One evaluation of one policy version."""

    version: int
    """The oldest policy version that produced a token of the eval answers."""
    accuracy: float
    reward_mean: float
    num_prompts: int
    errors: int

    def metric_values(self) -> dict[str, float]:
        return {
            "accuracy": self.accuracy,
            "reward_mean": self.reward_mean,
            "num_prompts": float(self.num_prompts),
            "errors": float(self.errors),
        }


class Evaluator:
    """Evaluates one job's policy through a Router and a Reward service."""

    def __init__(
        self,
        router: router_pb2_grpc.RouterStub,
        reward: reward_pb2_grpc.RewardStub,
        spec: JobSpec,
        job_id: str,
        *,
        concurrency: int,
        attempts: int = 3,
        engine_timeout_s: float = 300.0,
    ) -> None:
        self.router = router
        self.reward = reward
        self.spec = spec
        self.job_id = job_id
        self.concurrency = concurrency
        self.attempts = attempts
        self.engine_timeout_s = engine_timeout_s
        """How long a retry of a Generate waits for an engine to serve the version again."""
        self.retries = 0
        """Calls made again after a failure, over this evaluator's life."""

    async def wait_for_version(self, version: int, timeout_s: float) -> int:
        """The newest version an engine of this job serves, once it is >= ``version``."""
        deadline = time.monotonic() + timeout_s
        seen = "no engine of this job"
        while True:
            try:
                reply = await self.router.ListEngines(
                    router_pb2.ListEnginesRequest(), timeout=LIST_ENGINES_TIMEOUT_S
                )
                served = [e.policy_version for e in reply.engines if e.job_id == self.job_id]
                if served and max(served) >= version:
                    return max(served)
                if served:
                    seen = f"engines serve versions {sorted(set(served))}"
            except grpc.aio.AioRpcError as err:
                seen = f"router: {err.code().name}: {err.details()}"
            if time.monotonic() >= deadline:
                raise EvalError(f"no engine served version {version} within {timeout_s:.0f}s ({seen})")
            await asyncio.sleep(ENGINE_POLL_S)

    async def evaluate(self, version: int, examples: Sequence[PromptExample], tokenizer: Any) -> EvalResult:
        """Greedy answers to ``examples`` by engines serving ``version`` or newer, scored."""
        label = f"v{version}"
        try:
            prompts = [
                encode_prompt(tokenizer, ex.text, max_tokens=self.spec.data.max_prompt_tokens)
                for ex in examples
            ]
        except PromptTooLongError as err:
            raise EvalError(f"eval prompt: {err}") from None
        completions = await self._generate_all(label, prompts, version)
        texts = [tokenizer.decode(list(c.token_ids), skip_special_tokens=True) for c in completions]
        scores = await self._score(label, examples, prompts, completions, texts)
        rewards = [
            0.0 if (s.error or c.error) else s.reward for s, c in zip(scores, completions, strict=True)
        ]
        errors = sum(1 for s, c in zip(scores, completions, strict=True) if s.error or c.error)
        versions = [v for c in completions for v in c.policy_versions]
        if not versions:
            raise EvalError("the engines returned no tokens for any eval prompt")
        return EvalResult(
            version=int(min(versions)),
            accuracy=sum(1 for r in rewards if r >= 1.0) / len(rewards),
            reward_mean=sum(rewards) / len(rewards),
            num_prompts=len(rewards),
            errors=errors,
        )

    def _sampling(self) -> common_pb2.SamplingParams:
        rollout = self.spec.rollout
        max_new_tokens = self.spec.eval.max_new_tokens or rollout.max_new_tokens
        return common_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=max_new_tokens, n=1, stop=rollout.stop
        )

    async def _generate_all(
        self, label: str, prompts: list[list[int]], version: int
    ) -> list[rollout_pb2.Completion]:
        slots = asyncio.Semaphore(self.concurrency)
        sampling = self._sampling()

        async def generate(index: int, prompt: list[int]) -> rollout_pb2.Completion:
            first_id = f"{self.job_id}:eval:{label}:{index}"

            async def attempt(number: int) -> rollout_pb2.GenerateResponse:
                request_id = first_id if number == 1 else f"{first_id}:retry{number - 1}"
                request = rollout_pb2.GenerateRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    session_id=request_id,  # a new session: no affinity to an engine that failed
                    job_id=self.job_id,
                )
                async with slots:
                    return await self.router.Generate(request, timeout=self.spec.rollout.request_timeout_s)

            reply = await self._call(f"Generate {first_id}", attempt, version)
            if len(reply.completions) != 1:
                raise EvalError(f"{first_id}: expected 1 completion, got {len(reply.completions)}")
            return reply.completions[0]

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(generate(i, p)) for i, p in enumerate(prompts)]
        except* grpc.aio.AioRpcError as errors:
            first = errors.exceptions[0]
            assert isinstance(first, grpc.aio.AioRpcError)
            raise EvalError(f"Generate failed: {first.code().name}: {first.details()}") from None
        except* EvalError as errors:
            raise errors.exceptions[0] from None
        return [task.result() for task in tasks]

    async def _score(
        self,
        label: str,
        examples: Sequence[PromptExample],
        prompts: list[list[int]],
        completions: list[rollout_pb2.Completion],
        texts: list[str],
    ) -> list[reward_pb2.ScoreResponse]:
        items = [
            reward_pb2.ScoreRequest(
                trajectory_id=f"{self.job_id}:eval:{label}:{index}",
                job_id=self.job_id,
                prompt_id=example.prompt_id,
                prompt_text=example.text,
                response_text=text,
                prompt_token_ids=prompt,
                response_token_ids=completion.token_ids,
                answer=example.answer,
                verifier=self.spec.reward.scorer,
                num_turns=1,
            )
            for index, (example, prompt, completion, text) in enumerate(
                zip(examples, prompts, completions, texts, strict=True)
            )
        ]
        request = reward_pb2.ScoreBatchRequest(items=items)
        try:
            reply = await self._call(
                f"ScoreBatch of {label}",
                lambda _: self.reward.ScoreBatch(request, timeout=self.spec.reward.timeout_s),
            )
        except grpc.aio.AioRpcError as err:
            raise EvalError(f"ScoreBatch failed: {err.code().name}: {err.details()}") from None
        if len(reply.results) != len(items):
            raise EvalError(f"ScoreBatch returned {len(reply.results)} results for {len(items)} items")
        return list(reply.results)

    async def _call(self, what: str, call: Callable[[int], Awaitable[T]], version: int | None = None) -> T:
        """``call(attempt number)``, made again after a RETRYABLE failure, ``attempts`` times in
        all; before each retry a doubling pause and (``version``) an engine serving it."""
        for number in range(1, self.attempts):
            try:
                return await call(number)
            except grpc.aio.AioRpcError as err:
                if err.code() not in RETRYABLE:
                    raise
                self.retries += 1
                log.warning(
                    "%s: %s failed (%s: %s); trying again (attempt %d of %d)",
                    *(self.job_id, what, err.code().name, err.details(), number + 1, self.attempts),
                )
            await asyncio.sleep(RETRY_PAUSE_S * 2 ** (number - 1))
            if version is not None:
                await self.wait_for_version(version, self.engine_timeout_s)
        return await call(self.attempts)
