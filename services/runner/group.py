"""One PromptTask rolled out: n samples from the router, scored by the reward service, as Trajectories.

Errors come in two kinds: ``InvalidTaskError`` (the task itself is wrong, e.g.
the engine answered INVALID_ARGUMENT: retrying cannot help, so the runner
dead-letters it) and ``RetryLaterError`` (a service is down or misbehaved: the
task stays pending and is retried when it is reclaimed). Transient gRPC
failures (UNAVAILABLE, "no weights loaded", ...) are first retried here with
backoff for up to ``retry_s``.

Partial rollout: a sample that comes back FINISH_REASON_ABORT (a weight update in
abort mode, an Abort, a Pause that aborts) keeps its tokens, and is resumed on its
own: a Generate of one sample whose prompt is the task prompt plus the partial
response (``resume_offset`` marks where the response starts), with the budget
that is left and the same sampling (a derived seed when the task had one). The
new tokens, logprobs and policy versions are appended, so every token keeps the
version that produced it. Aborted samples of a group resume concurrently, each
at most ``max_resumes`` times; one still aborted after that is published as it
is (finish reason ABORT, its tokens so far are valid training data), because
holding the whole group back would stall the trainer for one sample.

Multi-turn episodes (``episode.py``) reuse these pieces: the group's first Generate, the
resume of an aborted turn, scoring and Trajectory building; a ``Sample`` then also carries
the loss mask, the number of turns and the text the verifier scores.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from services.common.config import RolloutConfig
from services.common.job_tokenizer import decode_texts
from services.common.pb import common_pb2, reward_pb2, reward_pb2_grpc, rollout_pb2, router_pb2_grpc
from services.common.wire import record
from services.runner.batching import CoalescingReward, CoalescingRouter
from services.runner.spliced import (
    SplicedTrajectory,
    lengths,
    merge_token_ids,
    packed_response,
    token_ids,
    unpacked_completion,
)

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
RETRY_WAIT_S = 0.1
"""The wait before the first retry, doubling for each next one (at most 5 s)."""


class InvalidTaskError(ValueError):
    """The task cannot be rolled out as it is; it goes to the dead-letter stream."""


class RetryLaterError(RuntimeError):
    """A service failed; the task stays pending and is retried after it is reclaimed."""


@dataclass(frozen=True, slots=True)
class GroupClients:
    """What rolling out a group needs: the services, the job's tokenizer and deadlines."""

    router: CoalescingRouter | router_pb2_grpc.RouterStub
    """The router; the runner's coalesces the Generate calls of its groups (batching.py)."""
    reward: CoalescingReward | reward_pb2_grpc.RewardStub
    """The reward service; the runner's coalesces the ScoreBatch calls of its groups."""
    tokenizer: Any
    request_timeout_s: float
    reward_timeout_s: float
    retry_s: float
    max_resumes: int
    """Resumes of one aborted sample; 0 publishes it aborted at once."""
    serving: Callable[[], bool]
    """False once the job is no longer served here (it stopped, the runner stops): no more resumes."""
    tools: reward_pb2_grpc.ToolsStub
    """The Tools service that runs the calls of multi-turn episodes."""
    rollout: RolloutConfig
    """The job's rollout section (tool call format, observation template, tool limits...)."""
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """The job's ``data.chat_template_kwargs``: a chat task's tool turns are rendered with them."""


def _is_transient(error: BaseException) -> bool:
    return isinstance(error, grpc.aio.AioRpcError) and error.code() in TRANSIENT_CODES


async def call(service: str, retry_s: float, call: Callable[[], Awaitable[T]]) -> T:
    """``call()`` with transient failures retried for ``retry_s``; errors mapped to the two kinds."""
    started = time.monotonic()
    try:  # the first attempt outside the retry loop, whose set-up costs more than most calls
        return await call()
    except grpc.aio.AioRpcError as err:
        if not _is_transient(err) or retry_s <= 0:
            raise _mapped(service, err) from None
    await asyncio.sleep(min(RETRY_WAIT_S, retry_s))
    try:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(_is_transient),
            stop=stop_after_delay(max(0.0, retry_s - (time.monotonic() - started))),
            wait=wait_exponential(multiplier=2 * RETRY_WAIT_S, max=5.0),  # 0.2 s, 0.4 s...
            reraise=True,
        ):
            with attempt:
                return await call()
    except grpc.aio.AioRpcError as err:
        raise _mapped(service, err) from None
    raise AssertionError("unreachable: AsyncRetrying either returns or raises")


def _mapped(service: str, err: grpc.aio.AioRpcError) -> InvalidTaskError | RetryLaterError:
    text = f"{service}: {err.code().name}: {err.details()}"
    if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidTaskError(text)
    return RetryLaterError(text)


def check_task(task: common_pb2.PromptTask, job_id: str) -> None:
    """Raise InvalidTaskError for a task no service could roll out."""
    if task.job_id != job_id:
        raise InvalidTaskError(f"task of job {task.job_id!r} on the prompts stream of {job_id!r}")
    if not task.prompt_token_ids:
        raise InvalidTaskError("task has no prompt_token_ids")
    if task.n_samples < 1:
        raise InvalidTaskError(f"n_samples is {task.n_samples}; it must be >= 1")


def _check_completions(n_samples: int, reply: rollout_pb2.GenerateResponse) -> None:
    indices = sorted(c.index for c in reply.completions)
    if indices != list(range(n_samples)):
        raise RetryLaterError(f"router returned samples {indices} for n_samples={n_samples}")
    for c in reply.completions:
        if not len(c.token_ids) == len(c.logprobs) == len(c.policy_versions):
            raise RetryLaterError(
                f"sample {c.index}: {len(c.token_ids)} tokens, {len(c.logprobs)} logprobs, "
                f"{len(c.policy_versions)} versions: they must align"
            )


def _check_packed(n_samples: int, reply: rollout_pb2.PackedGenerateResponse) -> None:
    """``_check_completions`` for a packed reply, on its arrays' lengths."""
    indices = sorted(c.index for c in reply.completions)
    if indices != list(range(n_samples)):
        raise RetryLaterError(f"router returned samples {indices} for n_samples={n_samples}")
    for c in reply.completions:
        tokens, logprobs, versions = lengths(c)
        if not tokens == logprobs == versions:
            raise RetryLaterError(
                f"sample {c.index}: {tokens} tokens, {logprobs} logprobs, {versions} versions:"
                " they must align"
            )


@dataclass(slots=True)
class Sample:
    """One sample of a group as it grows across resumes (and, in an episode, turns)."""

    completion: rollout_pb2.Completion
    """Every token so far, with its logprob and policy version; how the last piece ended."""
    engine_id: str
    """The engine that generated the last piece."""
    resumes: int = 0
    loss_mask: list[bool] | None = None
    """Per response token, False for tool output; None when every token is the model's."""
    num_turns: int = 1
    final_text: str | None = None
    """The text the verifier scores (an episode's last turn); None: the whole response."""
    info: dict[str, str] = field(default_factory=dict)
    """Counts worth keeping (tool calls, errors), for the verifier and the trajectory's metadata."""


async def generate(
    request: rollout_pb2.GenerateRequest, clients: GroupClients
) -> rollout_pb2.GenerateResponse:
    n_samples = max(1, request.sampling.n)
    reply = await call(
        "router Generate",
        clients.retry_s,
        lambda: clients.router.Generate(request, timeout=clients.request_timeout_s),
    )
    _check_completions(n_samples, reply)
    return reply


async def generate_packed(
    request: rollout_pb2.GenerateRequest, clients: GroupClients
) -> rollout_pb2.PackedGenerateResponse:
    """``generate``, its completions' arrays left as packed bytes (spliced.py)."""
    packed_call = getattr(clients.router, "GeneratePacked", None)
    if packed_call is None:  # a plain stub: its parsed reply, packed again
        return packed_response(await generate(request, clients))
    reply = await call(
        "router Generate", clients.retry_s, lambda: packed_call(request, timeout=clients.request_timeout_s)
    )
    _check_packed(max(1, request.sampling.n), reply)
    return reply


def group_request(task: common_pb2.PromptTask, stop: list[str] | None = None) -> rollout_pb2.GenerateRequest:
    """The Generate of the task's n samples; ``stop`` adds stop strings to the task's."""
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(task.sampling)
    sampling.n = task.n_samples
    sampling.stop.extend(text for text in stop or [] if text not in sampling.stop)
    return rollout_pb2.GenerateRequest(
        request_id=task.prompt_id,
        prompt_token_ids=task.prompt_token_ids,
        sampling=sampling,
        session_id=task.group_id,
        job_id=task.job_id,
        # the trainer's version when the task was issued: no older weights sample it
        min_policy_version=task.policy_version,
        min_policy_epoch=task.policy_epoch,
    )


async def generate_group(request: rollout_pb2.GenerateRequest, clients: GroupClients) -> list[Sample]:
    """The samples of a group request, in sample order, not resumed yet."""
    reply = await generate(request, clients)
    return [Sample(c, reply.engine_id) for c in sorted(reply.completions, key=lambda c: c.index)]


async def roll_out_group(task: common_pb2.PromptTask, clients: GroupClients) -> list[common_pb2.Trajectory]:
    """One Trajectory per sample of ``task`` (sample order), aborted samples resumed, with rewards."""
    request = group_request(task)
    samples = await generate_group(request, clients)
    await _resume_aborted(request, samples, clients)
    return await finish_group(task, samples, clients)


async def roll_out_group_spliced(task: common_pb2.PromptTask, clients: GroupClients) -> list[Any]:
    """``roll_out_group`` as the runner runs it for its jobs: the same trajectories, each a
    SplicedTrajectory that passes the engine's arrays on as bytes (spliced.py); a group with an
    aborted sample is resumed and built as ``roll_out_group`` does."""
    request = group_request(task)
    reply = await generate_packed(request, clients)
    packed = sorted(reply.completions, key=lambda c: c.index)
    if any(c.finish_reason == common_pb2.FINISH_REASON_ABORT for c in packed):
        samples = [Sample(unpacked_completion(c), reply.engine_id) for c in packed]
        await _resume_aborted(request, samples, clients)
        return await finish_group(task, samples, clients)
    generated = time.time()
    texts: list[str | None] = [c.text if c.HasField("text") else None for c in packed]
    missing = [i for i, text in enumerate(texts) if text is None]
    if missing:  # an engine that does not detokenize: decoded here, as response_texts does
        decoded = decode_texts(clients.tokenizer, [token_ids(packed[i]) for i in missing])
        for i, text in zip(missing, decoded, strict=True):
            texts[i] = text
    with_ids = not await text_only(clients.reward, task.verifier)
    template = _score_template(task, with_ids)
    batch = reward_pb2.ScoreBatchRequest()
    for c, text in zip(packed, texts, strict=True):
        item = _score_item(batch, template, c.index, text or "")
        if with_ids:
            merge_token_ids(item, c)
    scores = await _score_items(batch, clients)
    template = _group_template(task, common_pb2.StageTimes(generated=generated, scored=time.time()))
    return [
        SplicedTrajectory(_trajectory_head(template, c, reply.engine_id, score), c)
        for c, score in zip(packed, scores, strict=True)
    ]


async def _resume_aborted(
    request: rollout_pb2.GenerateRequest, samples: list[Sample], clients: GroupClients
) -> None:
    aborted = [
        (i, s) for i, s in enumerate(samples) if s.completion.finish_reason == common_pb2.FINISH_REASON_ABORT
    ]
    if aborted:  # most groups have none: no task per sample
        await run_all(
            [resume(request, s, clients, index=i, name=f"{request.request_id}:{i}") for i, s in aborted],
            name=request.request_id,
        )


async def run_all(work: list[Awaitable[T]], name: str) -> list[T]:
    """Run ``work`` concurrently; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(item) for item in work]
    for i, pending in enumerate(tasks):
        pending.set_name(f"{name}:{i}")
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for pending in tasks:
            pending.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def finish_group(
    task: common_pb2.PromptTask, samples: list[Sample], clients: GroupClients
) -> list[common_pb2.Trajectory]:
    """Score the finished samples in one ScoreBatch and build their Trajectories (their stage
    times: generated and scored; the runner adds the others)."""
    generated = time.time()
    texts = response_texts(samples, clients.tokenizer)
    scores = await _score(task, samples, texts, clients)
    template = _group_template(task, common_pb2.StageTimes(generated=generated, scored=time.time()))
    return [_trajectory(template, sample, score) for sample, score in zip(samples, scores, strict=True)]


def response_texts(samples: list[Sample], tokenizer: Any) -> list[str]:
    """Each sample's response text: the engine's where it sent one (SGLang detokenizes anyway),
    else decoded here, in one call for those that need it."""
    texts: list[str | None] = [s.completion.text if s.completion.HasField("text") else None for s in samples]
    missing = [i for i, text in enumerate(texts) if text is None]
    if missing:
        decoded = decode_texts(tokenizer, [samples[i].completion.token_ids for i in missing])
        for i, text in zip(missing, decoded, strict=True):
            texts[i] = text
    return [text or "" for text in texts]


def resume_seed(seed: int, index: int, resume: int) -> int:
    """The seed of resume ``resume`` of sample ``index`` of a task seeded ``seed``: reproducible,
    and distinct from the seeds of the other samples and resumes (a non-negative int64)."""
    digest = hashlib.blake2b(f"{seed}:{index}:{resume}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


async def resume(
    first: rollout_pb2.GenerateRequest, sample: Sample, clients: GroupClients, *, index: int, name: str
) -> None:
    """Continue ``sample``, generated for ``first``, while it comes back aborted, at most
    ``max_resumes`` times. ``index`` is the sample's index in its group (for its seeds) and
    ``name`` the request id its resumes extend (``{name}:resume{k}``)."""
    completion = sample.completion
    while (
        completion.finish_reason == common_pb2.FINISH_REASON_ABORT
        and not completion.error
        and sample.resumes < clients.max_resumes
        and clients.serving()
    ):
        left = first.sampling.max_new_tokens - len(completion.token_ids)
        if left <= 0:  # aborted after its last token: nothing is missing
            completion.finish_reason = common_pb2.FINISH_REASON_LENGTH
            return
        sample.resumes += 1
        reply = await generate(_resume_request(first, sample, left, index, name), clients)
        [more] = reply.completions
        completion.token_ids.extend(more.token_ids)
        completion.logprobs.extend(more.logprobs)
        completion.policy_versions.extend(more.policy_versions)
        completion.finish_reason = more.finish_reason
        completion.error = more.error
        completion.ClearField("text")  # the engine's text was the first piece's: decode the whole
        sample.engine_id = reply.engine_id


def _resume_request(
    first: rollout_pb2.GenerateRequest, sample: Sample, left: int, index: int, name: str
) -> rollout_pb2.GenerateRequest:
    """One sample: the first request's prompt + the partial response, with the budget that is left."""
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(first.sampling)
    sampling.n = 1
    sampling.max_new_tokens = left
    if first.sampling.HasField("seed"):  # the first seed would replay sample 0's stream
        sampling.seed = resume_seed(first.sampling.seed, index, sample.resumes)
    return rollout_pb2.GenerateRequest(
        request_id=f"{name}:resume{sample.resumes}",
        prompt_token_ids=[*first.prompt_token_ids, *sample.completion.token_ids],
        sampling=sampling,
        session_id=first.session_id,  # the same engine likely holds the group's prefix
        job_id=first.job_id,
        resume_offset=len(first.prompt_token_ids),
        min_policy_version=first.min_policy_version,
        min_policy_epoch=first.min_policy_epoch,
    )


def _score_template(task: common_pb2.PromptTask, token_ids: bool) -> reward_pb2.ScoreRequest:
    """What every ScoreRequest of the group shares: the task's prompt, answer, verifier and
    metadata (the row's ``data.metadata_fields``, its source's prompt id), and its prompt's ids
    unless the verifier reads texts alone."""
    template = reward_pb2.ScoreRequest(
        job_id=task.job_id,
        prompt_id=task.prompt_id,
        prompt_text=task.prompt_text,
        answer=task.answer,
        verifier=task.verifier,
        metadata=task.metadata,
    )
    if token_ids:
        template.prompt_token_ids.extend(task.prompt_token_ids)
    return template


def _score_item(
    batch: reward_pb2.ScoreBatchRequest, template: reward_pb2.ScoreRequest, index: int, text: str
) -> reward_pb2.ScoreRequest:
    """A new item of ``batch`` (built in place: a list of items would be copied into it)."""
    request = batch.items.add()
    request.CopyFrom(template)
    request.trajectory_id = f"{template.prompt_id}:{index}"
    request.response_text = text
    request.num_turns = 1
    return request


def _score_request(
    batch: reward_pb2.ScoreBatchRequest,
    template: reward_pb2.ScoreRequest,
    sample: Sample,
    text: str,
    token_ids: bool,
) -> reward_pb2.ScoreRequest:
    """An episode is scored on its last turn's text; its whole response is the transcript."""
    final = text if sample.final_text is None else sample.final_text
    request = _score_item(batch, template, sample.completion.index, final)
    request.num_turns = sample.num_turns
    if token_ids:
        request.response_token_ids.extend(sample.completion.token_ids)
    if sample.info:
        request.metadata.update(sample.info)
    if sample.final_text is not None:
        request.metadata["transcript"] = text
    return request


async def _score(
    task: common_pb2.PromptTask, samples: list[Sample], texts: list[str], clients: GroupClients
) -> list[reward_pb2.ScoreResponse]:
    token_ids = not await text_only(clients.reward, task.verifier)
    template = _score_template(task, token_ids)
    batch = reward_pb2.ScoreBatchRequest()
    for sample, text in zip(samples, texts, strict=True):
        _score_request(batch, template, sample, text, token_ids)
    return await _score_items(batch, clients)


async def _score_items(
    batch: reward_pb2.ScoreBatchRequest, clients: GroupClients
) -> list[reward_pb2.ScoreResponse]:
    reply = await call(
        "reward ScoreBatch",
        clients.retry_s,
        lambda: clients.reward.ScoreBatch(batch, timeout=clients.reward_timeout_s),
    )
    if len(reply.results) != len(batch.items):
        raise RetryLaterError(
            f"reward ScoreBatch returned {len(reply.results)} results for {len(batch.items)} items"
        )
    return list(reply.results)


async def text_only(reward: Any, verifier: str) -> bool:
    """Whether the reward service says ``verifier`` reads texts alone (a coalescing client asks
    it once); False for any other client."""
    ask = getattr(reward, "text_only", None)
    return bool(await ask(verifier)) if ask is not None else False


def _group_template(task: common_pb2.PromptTask, stages: common_pb2.StageTimes) -> common_pb2.Trajectory:
    """What every Trajectory of the group shares: each sample's is a copy (one C call) with its
    own fields set, rather than the task's fields and prompt converted again eight times."""
    template = common_pb2.Trajectory(
        job_id=task.job_id,
        prompt_id=task.prompt_id,
        group_id=task.group_id,
        group_size=task.n_samples,
        split=task.split or common_pb2.SPLIT_TRAIN,
        stages=stages,
    )
    # extend copies a message's repeated field in C; the constructor iterates it in Python
    template.prompt_token_ids.extend(task.prompt_token_ids)
    template.metadata["task_policy_version"] = str(task.policy_version)
    template.metadata["resumes"] = "0"  # a resumed sample's trajectory sets its own count
    seconds, nanos = divmod(time.time_ns(), 1_000_000_000)
    template.created_at.seconds, template.created_at.nanos = seconds, nanos
    return template


def _trajectory(
    template: common_pb2.Trajectory,
    sample: Sample,
    score: reward_pb2.ScoreResponse,
) -> common_pb2.Trajectory:
    completion = sample.completion
    trajectory = _trajectory_head(template, completion, sample.engine_id, score)
    trajectory.num_turns = sample.num_turns
    metadata = trajectory.metadata
    metadata["resumes"] = str(sample.resumes)
    if sample.info:
        metadata.update(sample.info)
    trajectory.response_token_ids.extend(completion.token_ids)
    trajectory.behaviour_logprobs.extend(completion.logprobs)
    trajectory.policy_versions.extend(completion.policy_versions)
    if sample.loss_mask is not None:
        trajectory.loss_mask.extend(sample.loss_mask)
    else:
        set_all_true_mask(trajectory, len(completion.token_ids))
    return trajectory


def _trajectory_head(
    template: common_pb2.Trajectory,
    completion: rollout_pb2.Completion | rollout_pb2.PackedCompletion,
    engine_id: str,
    score: reward_pb2.ScoreResponse,
) -> common_pb2.Trajectory:
    """The sample's Trajectory but its arrays: a one-turn sample, never resumed."""
    error = f"generation failed: {completion.error}" if completion.error else score.error
    trajectory = common_pb2.Trajectory()
    trajectory.CopyFrom(template)
    trajectory.id = f"{template.prompt_id}:{completion.index}"
    trajectory.sample_index = completion.index
    trajectory.reward = 0.0 if error else score.reward
    trajectory.reward_error = error
    trajectory.finish_reason = completion.finish_reason
    trajectory.num_turns = 1
    trajectory.engine_id = engine_id
    if score.components:  # key by key: a map's update() runs MutableMapping's Python code
        components, scored = trajectory.reward_components, score.components
        for name in scored:
            components[name] = scored[name]
    return trajectory


def set_all_true_mask(trajectory: common_pb2.Trajectory, tokens: int) -> None:
    """Append ``tokens`` trues to ``loss_mask``, merged from their packed encoding: the model's
    own tokens all count, and parsing them costs a fraction of converting as many Python bools."""
    trajectory.MergeFromString(record(common_pb2.Trajectory.LOSS_MASK_FIELD_NUMBER, b"\x01" * tokens))
