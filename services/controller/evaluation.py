"""Held-out evaluation of a job's policy through the router, scored by the reward service.

A job's held-out sets (services/common/eval_sets.py) are ``data.eval`` and the named sets of
``eval.sets``, each read through its data source and encoded once, when the job starts, by the
one prompt encoding the training prompts use (``services.data.encode_prompt`` with the job's
``data`` section: the same chat rendering). An evaluation answers every prompt of every set
greedily, and with ``eval.samples_per_prompt`` = n also samples n answers at
``eval.temperature`` (one Generate of n), then scores the prompt's answers in one ScoreBatch.
What it reports of each set (accuracy, reward_mean, mean@n, pass@k, errors) is eval_scores.py's;
an answer that could not be generated or scored counts as wrong and is counted in ``errors``.

Every Generate of an evaluation names the version it evaluates (``min_policy_version``: the
version the engines serve as it starts), so an engine still on an older one waits for it or
refuses and the router asks another: one evaluation is not a mixture of a lagging engine's old
weights and the new ones. It is labelled with the oldest policy version among its answers'
tokens, as the engines report them (``served_version``, also the row's step; the newest is
``served_version_max``, above it only when a newer version loaded while it ran): the version
that actually answered, never the one the controller expected.

A call whose engine, router or reward service failed or went away (``RETRYABLE``) is made
again, ``attempts`` times in all and then for up to ``retry_s`` from its first attempt, after a
pause that doubles and, for a Generate, once an engine serves the version again: the router sends
it to a live engine, another one when the first died. Only when every attempt failed is the
evaluation lost (an EvalError, which the controller logs and counts).

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
from services.common.config import DEFAULT_EVAL_SET, JobSpec
from services.common.eval_sets import eval_set_sources, metric_prefix, read_eval_set
from services.common.events import EventLog, warning_event
from services.common.job_tokenizer import decode_texts
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
from services.controller.eval_scores import RIGHT, PromptOutcome, SetScores, set_scores
from services.controller.stubs import ServiceStubs
from services.controller.telemetry import ControllerMetrics
from services.data import DataError, PromptExample, PromptTooLongError, encode_prompt

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
RETRY_PAUSE_MAX_S = 2.0
"""The longest pause between two attempts of a call."""
ENGINE_POLL_S = 0.2
"""How often the router is asked which versions its engines serve."""
LIST_ENGINES_TIMEOUT_S = 5.0
"""Deadline of one ListEngines call."""
SERVED_VERSION = "served_version"
"""The value of an evaluation's metric row: the oldest policy version among its answers' tokens
(also the row's step)."""
SERVED_VERSION_MAX = "served_version_max"
"""The value of an evaluation's metric row: the newest policy version among its answers' tokens
(above ``served_version`` when the engines loaded a new version while it ran)."""


class EvalError(RuntimeError):
    """An evaluation could not run; the message says why."""


@dataclass(frozen=True, slots=True)
class EvalSet:
    """One held-out set, read and encoded: what an evaluation answers."""

    name: str
    """``default`` (``data.eval``) or its key in ``eval.sets``."""
    examples: tuple[PromptExample, ...]
    prompts: tuple[tuple[int, ...], ...]
    """Each example's token ids, as the training prompts are encoded."""


def encode_eval_set(name: str, examples: Sequence[PromptExample], spec: JobSpec, tokenizer: Any) -> EvalSet:
    """The set's prompts encoded as training encodes its own (the job's ``data`` section decides
    the format and the chat template); a ``DataError`` naming the set and the prompt that is too
    long or cannot be rendered: no evaluation of it could ever run."""
    prompts = []
    for example in examples:
        try:
            ids = encode_prompt(
                tokenizer, example, settings=spec.data, max_tokens=spec.data.max_prompt_tokens
            )
        except (PromptTooLongError, DataError) as err:
            raise DataError(f"eval set {name!r}: prompt {example.prompt_id}: {err}") from None
        prompts.append(tuple(ids))
    return EvalSet(name, tuple(examples), tuple(prompts))


def prepare_eval_sets(spec: JobSpec, tokenizer: Any) -> list[EvalSet]:
    """Every held-out set of the job, read through its data source and encoded (blocking: run it
    in a thread); ``DataError`` naming the set when one cannot be."""
    sets = []
    for source in eval_set_sources(spec):
        try:
            examples = read_eval_set(source)
        except DataError as err:
            if source.name == DEFAULT_EVAL_SET:
                raise  # data.eval's errors name its file and row, as they always have
            raise DataError(f"eval set {source.name!r} ({'.'.join(source.field)}): {err}") from None
        sets.append(encode_eval_set(source.name, examples, spec, tokenizer))
    return sets


@dataclass(frozen=True, slots=True)
class EvalResult:
    """One evaluation of one policy version."""

    version: int
    """The oldest policy version that produced a token of the answers (the evaluation's label)."""
    newest_version: int
    """The newest policy version that produced a token of the answers."""
    sets: dict[str, SetScores]
    """Each set's scores, by name."""

    def metric_values(self) -> dict[str, float]:
        """The job's metric row: each set's values (a named set's under ``<name>/``), and the versions
        that served it."""
        values = {SERVED_VERSION: float(self.version), SERVED_VERSION_MAX: float(self.newest_version)}
        for name, scores in self.sets.items():
            values |= scores.metric_values(metric_prefix(name))
        return values


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
        retry_s: float = 0.0,
        engine_timeout_s: float = 300.0,
    ) -> None:
        self.router = router
        self.reward = reward
        self.spec = spec
        self.job_id = job_id
        self.concurrency = concurrency
        self.attempts = attempts
        self.retry_s = retry_s
        """After its ``attempts``, a failed call is made again while this long has not passed since
        its first attempt: an engine that was killed takes seconds to come back, and the router
        lists it as live until its heartbeat is older than the ttl."""
        self.engine_timeout_s = engine_timeout_s
        """How long a retry of a Generate waits for an engine to serve the version again."""
        self.retries = 0
        """Calls made again after a failure, over this evaluator's life."""
        self._slots = asyncio.Semaphore(concurrency)
        """Calls (Generate, ScoreBatch) in flight at once."""

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

    async def evaluate(
        self, version: int, sets: Sequence[EvalSet], tokenizer: Any, *, served: int | None = None
    ) -> EvalResult:
        """Answers to every prompt of ``sets`` by engines serving ``version`` or newer, scored.
        ``served``: the version the engines serve as it starts, which names its requests and is
        the version each of them needs (else ``version``)."""
        needed = version if served is None else served
        label = f"v{needed}"
        try:
            async with asyncio.TaskGroup() as group:
                tasks = {
                    s.name: [
                        group.create_task(self._answer(s, index, label, needed, tokenizer))
                        for index in range(len(s.examples))
                    ]
                    for s in sets
                }
        except* EvalError as errors:
            raise errors.exceptions[0] from None
        answered = {name: [task.result() for task in found] for name, found in tasks.items()}
        versions = [v for found in answered.values() for _, low_high in found for v in low_high]
        if not versions:
            raise EvalError("the engines returned no tokens for any eval prompt")
        pass_k = self.spec.eval.reported_k
        return EvalResult(
            version=min(versions),
            newest_version=max(versions),
            sets={name: set_scores([o for o, _ in found], pass_k) for name, found in answered.items()},
        )

    async def _answer(
        self, eval_set: EvalSet, index: int, label: str, version: int, tokenizer: Any
    ) -> tuple[PromptOutcome, tuple[int, ...]]:
        """One prompt's greedy answer and sampled answers, scored; with the lowest and highest
        policy version among their tokens (none when no answer has a token)."""
        named = "" if eval_set.name == DEFAULT_EVAL_SET else f"{eval_set.name}:"
        first_id = f"{self.job_id}:eval:{named}{label}:{index}"
        prompt = eval_set.prompts[index]
        completions = await self._generate(first_id, prompt, self._sampling(greedy=True), version)
        samples = self.spec.eval.samples_per_prompt
        if samples:
            sampling = self._sampling(greedy=False)
            completions += await self._generate(f"{first_id}:sampled", prompt, sampling, version)
        ids = [first_id] + [f"{first_id}:sampled:{j}" for j in range(samples)]
        texts = decode_texts(tokenizer, [c.token_ids for c in completions])
        scores = await self._score(first_id, eval_set.examples[index], prompt, ids, completions, texts)
        failed = [bool(s.error or c.error) for s, c in zip(scores, completions, strict=True)]
        rewards = [0.0 if bad else s.reward for s, bad in zip(scores, failed, strict=True)]
        outcome = PromptOutcome(
            greedy_reward=rewards[0],
            samples=samples,
            samples_right=sum(1 for reward in rewards[1:] if reward >= RIGHT),
            failed=sum(failed),
        )
        versions = [v for c in completions for v in c.policy_versions]
        return outcome, (min(versions), max(versions)) if versions else ()

    def _sampling(self, *, greedy: bool) -> common_pb2.SamplingParams:
        """Greedy (one answer), or plain temperature sampling of ``samples_per_prompt`` answers."""
        rollout, evals = self.spec.rollout, self.spec.eval
        max_new_tokens = evals.max_new_tokens or rollout.max_new_tokens
        if greedy:
            return common_pb2.SamplingParams(
                temperature=0.0, max_new_tokens=max_new_tokens, n=1, stop=rollout.stop
            )
        return common_pb2.SamplingParams(
            temperature=evals.temperature,
            max_new_tokens=max_new_tokens,
            n=evals.samples_per_prompt,
            stop=rollout.stop,
        )

    async def _generate(
        self, first_id: str, prompt: Sequence[int], sampling: common_pb2.SamplingParams, version: int
    ) -> list[rollout_pb2.Completion]:
        """The ``sampling.n`` completions of one Generate, made again after a RETRYABLE failure."""

        async def attempt(number: int) -> rollout_pb2.GenerateResponse:
            request_id = first_id if number == 1 else f"{first_id}:retry{number - 1}"
            request = rollout_pb2.GenerateRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=sampling,
                session_id=request_id,  # a new session: no affinity to an engine that failed
                job_id=self.job_id,
                min_policy_version=version,  # an engine still on older weights waits, or refuses
            )
            async with self._slots:
                return await self.router.Generate(request, timeout=self.spec.rollout.request_timeout_s)

        try:
            reply = await self._call(f"Generate {first_id}", attempt, version)
        except grpc.aio.AioRpcError as err:
            raise EvalError(f"Generate failed: {err.code().name}: {err.details()}") from None
        if len(reply.completions) != sampling.n:
            raise EvalError(f"{first_id}: expected {sampling.n} completions, got {len(reply.completions)}")
        return list(reply.completions)

    async def _score(
        self,
        first_id: str,
        example: PromptExample,
        prompt: Sequence[int],
        ids: Sequence[str],
        completions: Sequence[rollout_pb2.Completion],
        texts: Sequence[str],
    ) -> list[reward_pb2.ScoreResponse]:
        """One prompt's answers scored in one ScoreBatch, as the runner scores a group."""
        items = [
            reward_pb2.ScoreRequest(
                trajectory_id=trajectory_id,
                job_id=self.job_id,
                prompt_id=example.prompt_id,
                prompt_text=example.text,
                response_text=text,
                prompt_token_ids=prompt,
                response_token_ids=completion.token_ids,
                answer=example.answer,
                verifier=self.spec.reward.scorer,
                metadata={**example.metadata, "source_prompt_id": example.prompt_id},  # as in training
                num_turns=1,
            )
            for trajectory_id, completion, text in zip(ids, completions, texts, strict=True)
        ]
        request = reward_pb2.ScoreBatchRequest(items=items)

        async def attempt(_: int) -> reward_pb2.ScoreBatchResponse:
            async with self._slots:
                return await self.reward.ScoreBatch(request, timeout=self.spec.reward.timeout_s)

        try:
            reply = await self._call(f"ScoreBatch of {first_id}", attempt)
        except grpc.aio.AioRpcError as err:
            raise EvalError(f"ScoreBatch failed: {err.code().name}: {err.details()}") from None
        if len(reply.results) != len(items):
            raise EvalError(f"ScoreBatch returned {len(reply.results)} results for {len(items)} items")
        return list(reply.results)

    async def _call(self, what: str, call: Callable[[int], Awaitable[T]], version: int | None = None) -> T:
        """``call(attempt number)``, made again after a RETRYABLE failure: ``attempts`` times in
        all, and then while ``retry_s`` has not passed since the first attempt; before each retry
        a doubling pause (at most RETRY_PAUSE_MAX_S) and (``version``) an engine serving it."""
        until = time.monotonic() + self.retry_s
        number = 1
        while True:
            try:
                return await call(number)
            except grpc.aio.AioRpcError as err:
                if err.code() not in RETRYABLE or (number >= self.attempts and time.monotonic() >= until):
                    raise
                self.retries += 1
                log.warning(
                    "%s: %s failed (%s: %s); trying again (attempt %d, at least %d, for up to %.0f s)",
                    *(self.job_id, what, err.code().name, err.details(), number + 1, self.attempts),
                    self.retry_s,
                )
            await asyncio.sleep(min(RETRY_PAUSE_MAX_S, RETRY_PAUSE_S * 2 ** (number - 1)))
            if version is not None:
                await self.wait_for_version(version, self.engine_timeout_s)
            number += 1


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
        self.sets: list[EvalSet] = []
        """The held-out sets, read and encoded by the driver (none: no evaluation runs)."""
        self.tokenizer: Any = None
        self.done: set[int] = set()
        """Versions evaluated (labelled by the oldest version among the answers' tokens)."""
        self._due: asyncio.Queue[int] = asyncio.Queue()
        self._running: asyncio.Future[str] | None = None
        """The periodic evaluation in flight, if any."""
        self._closing = False
        self.events: EventLog | None = None
        """The job's event log, where what went wrong is told (set by the driver); None: logged only."""

    def due(self, version: int) -> None:
        """``version`` is due for its periodic evaluation (``run`` makes it)."""
        self._due.put_nowait(version)

    async def catch_up(self, store: JobStore, latest: int) -> None:
        """For a driver taking over a running job: mark what its predecessors evaluated done, and
        make due again each periodic evaluation up to version ``latest`` that has no result in
        its interval (the api died before it ran, or while it ran)."""
        every = self.spec.eval.every_steps
        if not every or not self.sets:
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
                await self._warn(f"the evaluation due at version {version} did not run before training ended")

    async def _warn(self, text: str) -> None:
        """Log ``text`` and tell it on the job's event log."""
        log.warning("%s: %s", self.job_id, text)
        if self.events is not None:
            await self.events.append(warning_event(self.job_id, text))

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
            retry_s=settings.eval_retry_s,
            engine_timeout_s=settings.eval_engine_timeout_s,
        )
        try:
            served = await evaluator.wait_for_version(version, settings.eval_engine_timeout_s)
            if served in self.done:
                self._covered(version, served)
                return ""
            result = await evaluator.evaluate(version, self.sets, self.tokenizer, served=served)
        except EvalError as err:
            self.metrics.evaluations.labels(outcome="failed").inc()
            await self._warn(f"evaluation of version {version} lost: {err}")
            return str(err)
        finally:
            self.metrics.evaluation_retries.inc(evaluator.retries)
        self.done.add(result.version)
        self.metrics.evaluations.labels(outcome="ok").inc()
        values = result.metric_values() | {DUE_VERSION: float(version)}
        await self.bus.publish_metric(
            self.job_id, "eval", values, step=result.version, policy_version=result.version
        )
        for name, scores in result.sets.items():
            log.info(
                "%s: eval of version %d, set %s: accuracy %.3f%s", self.job_id, result.version, name,
                scores.accuracy, "".join(f", pass@{k} {v:.3f}" for k, v in scores.pass_at.items()),
            )  # fmt: skip
        return ""
