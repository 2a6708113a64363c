"""One PromptTask rolled out: n samples from the router, scored by the reward service, as Trajectories.

Errors come in two kinds: ``InvalidTaskError`` (the task itself is wrong, e.g.
the engine answered INVALID_ARGUMENT: retrying cannot help, so the runner
dead-letters it) and ``RetryLaterError`` (a service is down or misbehaved: the
task stays pending and is retried when it is reclaimed). Transient gRPC
failures (UNAVAILABLE, "no weights loaded", ...) are first retried here with
backoff for up to ``retry_s``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from services.common.pb import common_pb2, reward_pb2, reward_pb2_grpc, rollout_pb2, router_pb2_grpc

T = TypeVar("T")

TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.FAILED_PRECONDITION,  # e.g. the engines have not loaded weights yet
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    }
)
"""Codes worth an immediate retry: they come back fast and usually pass."""


class InvalidTaskError(ValueError):
    """The task cannot be rolled out as it is; it goes to the dead-letter stream."""


class RetryLaterError(RuntimeError):
    """A service failed; the task stays pending and is retried after it is reclaimed."""


@dataclass(frozen=True, slots=True)
class GroupClients:
    """What rolling out a group needs: the services, the job's tokenizer and deadlines."""

    router: router_pb2_grpc.RouterStub
    reward: reward_pb2_grpc.RewardStub
    tokenizer: Any
    request_timeout_s: float
    reward_timeout_s: float
    retry_s: float


def _is_transient(error: BaseException) -> bool:
    return isinstance(error, grpc.aio.AioRpcError) and error.code() in TRANSIENT_CODES


async def _call(service: str, retry_s: float, call: Callable[[], Awaitable[T]]) -> T:
    """``call()`` with transient failures retried for ``retry_s``; errors mapped to the two kinds."""
    try:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(_is_transient),
            stop=stop_after_delay(retry_s),
            wait=wait_exponential(multiplier=0.1, max=5.0),
            reraise=True,
        ):
            with attempt:
                return await call()
    except grpc.aio.AioRpcError as err:
        text = f"{service}: {err.code().name}: {err.details()}"
        if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidTaskError(text) from None
        raise RetryLaterError(text) from None
    raise AssertionError("unreachable: AsyncRetrying either returns or raises")


def check_task(task: common_pb2.PromptTask, job_id: str) -> None:
    """Raise InvalidTaskError for a task no service could roll out."""
    if task.job_id != job_id:
        raise InvalidTaskError(f"task of job {task.job_id!r} on the prompts stream of {job_id!r}")
    if not task.prompt_token_ids:
        raise InvalidTaskError("task has no prompt_token_ids")
    if task.n_samples < 1:
        raise InvalidTaskError(f"n_samples is {task.n_samples}; it must be >= 1")


def _check_completions(task: common_pb2.PromptTask, reply: rollout_pb2.GenerateResponse) -> None:
    indices = sorted(c.index for c in reply.completions)
    if indices != list(range(task.n_samples)):
        raise RetryLaterError(f"router returned samples {indices} for n_samples={task.n_samples}")
    for c in reply.completions:
        if not len(c.token_ids) == len(c.logprobs) == len(c.policy_versions):
            raise RetryLaterError(
                f"sample {c.index}: {len(c.token_ids)} tokens, {len(c.logprobs)} logprobs, "
                f"{len(c.policy_versions)} versions: they must align"
            )


async def roll_out_group(task: common_pb2.PromptTask, clients: GroupClients) -> list[common_pb2.Trajectory]:
    """One Trajectory per sample of ``task`` (sample order), with rewards."""
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(task.sampling)
    sampling.n = task.n_samples
    request = rollout_pb2.GenerateRequest(
        request_id=task.prompt_id,
        prompt_token_ids=task.prompt_token_ids,
        sampling=sampling,
        session_id=task.group_id,
        job_id=task.job_id,
    )
    reply = await _call(
        "router Generate",
        clients.retry_s,
        lambda: clients.router.Generate(request, timeout=clients.request_timeout_s),
    )
    _check_completions(task, reply)
    completions = sorted(reply.completions, key=lambda c: c.index)
    texts = [clients.tokenizer.decode(list(c.token_ids), skip_special_tokens=True) for c in completions]
    scores = await _score(task, completions, texts, clients)
    return [
        _trajectory(task, completion, score, reply.engine_id)
        for completion, score in zip(completions, scores, strict=True)
    ]


async def _score(
    task: common_pb2.PromptTask,
    completions: list[rollout_pb2.Completion],
    texts: list[str],
    clients: GroupClients,
) -> list[reward_pb2.ScoreResponse]:
    items = [
        reward_pb2.ScoreRequest(
            trajectory_id=f"{task.prompt_id}:{completion.index}",
            job_id=task.job_id,
            prompt_id=task.prompt_id,
            prompt_text=task.prompt_text,
            response_text=text,
            prompt_token_ids=task.prompt_token_ids,
            response_token_ids=completion.token_ids,
            answer=task.answer,
            verifier=task.verifier,
            num_turns=1,
        )
        for completion, text in zip(completions, texts, strict=True)
    ]
    batch = reward_pb2.ScoreBatchRequest(items=items)
    reply = await _call(
        "reward ScoreBatch",
        clients.retry_s,
        lambda: clients.reward.ScoreBatch(batch, timeout=clients.reward_timeout_s),
    )
    if len(reply.results) != len(items):
        raise RetryLaterError(
            f"reward ScoreBatch returned {len(reply.results)} results for {len(items)} items"
        )
    return list(reply.results)


def _trajectory(
    task: common_pb2.PromptTask,
    completion: rollout_pb2.Completion,
    score: reward_pb2.ScoreResponse,
    engine_id: str,
) -> common_pb2.Trajectory:
    error = f"generation failed: {completion.error}" if completion.error else score.error
    trajectory = common_pb2.Trajectory(
        id=f"{task.prompt_id}:{completion.index}",
        job_id=task.job_id,
        prompt_id=task.prompt_id,
        group_id=task.group_id,
        sample_index=completion.index,
        group_size=task.n_samples,
        prompt_token_ids=task.prompt_token_ids,
        response_token_ids=completion.token_ids,
        behaviour_logprobs=completion.logprobs,
        loss_mask=[True] * len(completion.token_ids),
        policy_versions=completion.policy_versions,
        reward=0.0 if error else score.reward,
        reward_components=score.components,
        reward_error=error,
        finish_reason=completion.finish_reason,
        num_turns=1,
        split=task.split or common_pb2.SPLIT_TRAIN,
        engine_id=engine_id,
        metadata={"task_policy_version": str(task.policy_version)},
    )
    trajectory.created_at.GetCurrentTime()
    return trajectory
