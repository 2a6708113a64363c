"""Held-out evaluation of a job's policy: greedy answers through the router, scored by the reward service.

Accuracy is the fraction of eval prompts whose reward is at least 1 (the
verifier's "fully correct"); reward_mean is the plain mean. A prompt that could
not be generated or scored counts as wrong and is counted in ``errors``.

A call whose engine, router or reward service failed or went away (``RETRYABLE``) is made
again, ``attempts`` times in all, after a pause that doubles and, for a Generate, once an
engine serves the version again: the router sends it to a live engine, another one when the
first died. Only when every attempt failed is the evaluation lost (an EvalError, which the
controller logs and counts).

The evaluations of one job, as its driver schedules them (``JobEvals``): each version once, the
results on the job's metrics stream (source ``eval``), every outcome counted. An evaluation that
fails all the same is lost, never silently: an ERROR line and
``verst_controller_evaluations{outcome="failed"}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from services.common.bus import Bus
from services.common.config import JobSpec
from services.common.jobs import JobStore
from services.common.pb import (
    common_pb2,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    router_pb2,
    router_pb2_grpc,
)
from services.controller.config import ControllerSettings
from services.controller.stubs import ServiceStubs
from services.controller.telemetry import ControllerMetrics
from services.data import PromptExample, PromptTooLongError, encode_prompt

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


# --- the evaluations of one job ------------------------------------------------------------------


DUE_VERSION = "due_version"
"""The value of an evaluation's metric row that names the version whose due it was made for."""


def dues_without_result(
    evaluated: Iterable[tuple[int, float | None]], dues: Iterable[int], every: int
) -> list[int]:
    """The ``dues`` no evaluation covers. ``evaluated``: (version evaluated, the due it was made
    for, or None in rows written before dues were recorded). An evaluation made for due ``u`` of
    version ``v`` (v >= u: engines may have moved on) covers every due from ``u`` to ``v``, so one
    evaluation may serve two dues; a row without its due covers the due of its own interval."""
    spans = [
        (int(due), version) if due is not None else (version - version % every, version)
        for version, due in evaluated
    ]
    return [d for d in dues if not any(low <= d <= high for low, high in spans)]


class JobEvals:
    """Evaluates versions of one job on demand (``evaluate``) or as they come due (``due``, ``run``)."""

    def __init__(
        self,
        bus: Bus,
        stubs: ServiceStubs,
        settings: ControllerSettings,
        metrics: ControllerMetrics,
        job_id: str,
        spec: JobSpec,
    ) -> None:
        self.bus, self.stubs, self.settings, self.metrics = bus, stubs, settings, metrics
        self.job_id = job_id
        self.spec = spec
        self.examples: list[PromptExample] = []
        """The held-out prompts (none: no evaluation runs)."""
        self.tokenizer: Any = None
        self.done: set[int] = set()
        """Versions evaluated (labelled by the oldest version among the answers' tokens)."""
        self._due: asyncio.Queue[int] = asyncio.Queue()
        self._running: asyncio.Future[str] | None = None
        """The periodic evaluation in flight, if any."""
        self._closing = False

    def due(self, version: int) -> None:
        """``version`` is due for its periodic evaluation (``run`` makes it)."""
        self._due.put_nowait(version)

    async def catch_up(self, store: JobStore, latest: int) -> None:
        """For a driver taking over a running job: mark what its predecessors evaluated done, and
        make due again each periodic evaluation up to version ``latest`` that has no result in
        its interval (the api died before it ran, or while it ran)."""
        every = self.spec.eval.every_steps
        if not every or not self.examples:
            return
        rows = await store.history(self.job_id, source="eval")
        self.done |= {row.step for row in rows}
        dues = range(every, min(latest, self.spec.trainer.steps - 1) + 1, every)
        for version in dues_without_result([(r.step, r.values.get(DUE_VERSION)) for r in rows], dues, every):
            log.info(
                "%s: the evaluation due at version %d left no result; making it now", self.job_id, version
            )
            self.due(version)

    async def run(self, stopping: asyncio.Event) -> None:
        """Evaluate the versions that come due, one at a time, until ``stopping`` or ``close``."""
        while not (stopping.is_set() or self._closing):
            version = await self._due.get()
            if version in self.done:
                self._covered(version, version)
            elif not self._closing:
                self._running = asyncio.ensure_future(self.evaluate(version))
                try:
                    await self._running
                finally:
                    self._running = None

    async def close(self) -> None:
        """Training ended: let the periodic evaluation in flight finish (its calls have deadlines),
        start none; a version still due cannot be evaluated any more (the engines serve the final
        one), which is said, not dropped silently."""
        self._closing = True
        if self._running is not None:
            await asyncio.wait([self._running])
        while not self._due.empty():
            version = self._due.get_nowait()
            if not any(version <= done for done in self.done):
                self.metrics.evaluations.labels(outcome="missed").inc()
                log.warning(
                    "%s: the evaluation due at version %d did not run before training ended",
                    self.job_id, version,
                )  # fmt: skip

    def _covered(self, due: int, version: int) -> None:
        """The evaluation due at ``due`` is that of ``version``, made already (for an earlier due,
        when the engines had moved on by the time it ran), which covers it too."""
        self.metrics.evaluations.labels(outcome="covered").inc()
        log.info(
            "%s: the evaluation due at version %d is version %d's, made already", self.job_id, due, version
        )

    async def evaluate(self, version: int) -> str:
        """Evaluate the policy once an engine serves ``version``; returns an error text or ""."""
        settings = self.settings
        evaluator = Evaluator(
            self.stubs.router(),
            self.stubs.reward(self.spec),
            self.spec,
            self.job_id,
            concurrency=settings.eval_concurrency,
            attempts=settings.eval_attempts,
            engine_timeout_s=settings.eval_engine_timeout_s,
        )
        try:
            served = await evaluator.wait_for_version(version, settings.eval_engine_timeout_s)
            if served in self.done:
                self._covered(version, served)
                return ""
            result = await evaluator.evaluate(version, self.examples, self.tokenizer)
        except EvalError as err:
            self.metrics.evaluations.labels(outcome="failed").inc()
            log.error("%s: evaluation of version %d lost: %s", self.job_id, version, err)
            return str(err)
        finally:
            self.metrics.evaluation_retries.inc(evaluator.retries)
        self.done.add(result.version)
        self.metrics.evaluations.labels(outcome="ok").inc()
        values = result.metric_values() | {DUE_VERSION: float(version)}
        await self.bus.publish_metric(
            self.job_id, "eval", values, step=result.version, policy_version=result.version
        )
        log.info("%s: eval of version %d: accuracy %.3f", self.job_id, result.version, result.accuracy)
        return ""
