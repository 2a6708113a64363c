"""``verst.v1.Rollout`` over any ``Engine``: requests in, completions and chunks out, one table
from the engine's exceptions to gRPC status codes, and the engine's EngineInfo."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from services.common.pb import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.rollout.engine_protocol import (
    Completion,
    Engine,
    EngineStoppedError,
    GenerationRequest,
    NoWeightsError,
    StaleWeightsError,
    WrongJobError,
)
from services.rollout.metrics import EngineMetrics
from services.rollout.sampling import SamplingConfig
from services.rollout.watcher import WeightLoader

log = logging.getLogger(__name__)

SERVICE_NAME = "verst.v1.Rollout"
ENDED_JOBS_KEPT = 1024
"""Ended jobs an engine remembers (AbortJob), to refuse their late requests; the oldest is forgotten first."""


class JobEndedError(RuntimeError):
    """Generate for a job that AbortJob ended here: its runners are stopping, nothing waits for it."""


STATUS_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (NoWeightsError, grpc.StatusCode.FAILED_PRECONDITION),  # not ready yet: the caller may retry
    (WrongJobError, grpc.StatusCode.FAILED_PRECONDITION),  # not ready for this job yet
    (JobEndedError, grpc.StatusCode.FAILED_PRECONDITION),  # another engine cannot serve it either
    (StaleWeightsError, grpc.StatusCode.FAILED_PRECONDITION),  # the version it needs is not loaded yet
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # bad input; CheckpointError is one too
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (EngineStoppedError, grpc.StatusCode.UNAVAILABLE),
    (ConnectionError, grpc.StatusCode.UNAVAILABLE),  # the backend is unreachable or failing
)
"""The gRPC status of each exception an Engine (or the weight loader) raises, first match wins;
anything else is a bug and reaches the caller as UNKNOWN."""


def status_code(err: Exception) -> grpc.StatusCode | None:
    """The status STATUS_CODES gives ``err``, or None when it names none."""
    return next((code for kind, code in STATUS_CODES if isinstance(err, kind)), None)


@contextlib.asynccontextmanager
async def engine_errors(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Abort the call with the status of an engine exception raised in the block."""
    try:
        yield
    except Exception as err:
        code = status_code(err)
        if code is None:
            raise
        await context.abort(code, str(err) or type(err).__name__)


def completion_proto(completion: Completion) -> rollout_pb2.Completion:
    return rollout_pb2.Completion(
        index=completion.index,
        token_ids=completion.token_ids,
        logprobs=completion.logprobs,
        policy_versions=completion.policy_versions,
        finish_reason=completion.finish_reason,  # type: ignore[arg-type]
        error=completion.error,
        text=completion.text,
    )


def generate_result(outcome: rollout_pb2.GenerateResponse | BaseException) -> rollout_pb2.GenerateResult:
    """One GenerateBatch result: the response, or the status Generate would have aborted with
    (UNKNOWN, logged, for an exception STATUS_CODES does not name)."""
    if isinstance(outcome, rollout_pb2.GenerateResponse):
        return rollout_pb2.GenerateResult(response=outcome)
    if isinstance(outcome, Exception) and (code := status_code(outcome)) is not None:
        return rollout_pb2.GenerateResult(code=code.value[0], details=str(outcome) or type(outcome).__name__)
    if not isinstance(outcome, Exception):  # cancelled: the batch's caller has gone
        raise outcome
    log.error("a request of a batch failed", exc_info=outcome)
    return rollout_pb2.GenerateResult(
        code=grpc.StatusCode.UNKNOWN.value[0], details=f"{type(outcome).__name__}: {outcome}"
    )


@dataclass(frozen=True, slots=True)
class TokenIncrement:
    """One new token of one sample of a streaming request."""

    index: int
    token: int
    logprob: float
    version: int


Delivered = Completion | TokenIncrement | Exception
"""What reaches a request's queue: a sample's new token, a finished sample, or the request's failure."""


class LoopHandoff:
    """Calls from the engine's thread to run on the event loop, in the order they came, with one
    wake-up of the loop for all that come before it runs them: a wake-up for each finished sample
    (a write to the loop's self-pipe, then a turn of the loop) cost the engine more than the
    sample's delivery."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], None], Any]] = []

    def post(self, call: Callable[[Any], None], argument: Any) -> None:
        """Run ``call(argument)`` on the loop soon (any thread); raises RuntimeError once the loop
        is closed, as ``call_soon_threadsafe`` does."""
        with self._lock:
            self._pending.append((call, argument))
            if len(self._pending) > 1:  # a wake-up is already on its way and will run this too
                return
        try:
            self.loop.call_soon_threadsafe(self._run_pending)
        except RuntimeError:
            with self._lock:
                self._pending.clear()
            raise

    def _run_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for call, argument in pending:
            try:
                call(argument)
            except Exception:  # one delivery's bug must not drop the others'
                log.exception("a handed-off call failed")


class Delivery:
    """Hands one request's completions from the engine (any thread) to its caller's queue,
    counting them on the event loop (also those whose caller has gone: their tokens were made)."""

    def __init__(self, handoff: LoopHandoff, metrics: EngineMetrics) -> None:
        self.handoff = handoff
        self.metrics = metrics
        self.queue: asyncio.Queue[Delivered] = asyncio.Queue()
        self.request: GenerationRequest | None = None
        self._first_token_seen = False

    def __call__(self, completion: Completion) -> None:
        """The request's on_completion."""
        self.handoff.post(self._deliver, completion)

    def token(self, index: int, token: int, logprob: float, version: int) -> None:
        """The request's on_tokens, for streaming requests."""
        self.handoff.post(self.queue.put_nowait, TokenIncrement(index, token, logprob, version))

    def fail(self, err: Exception) -> None:
        """The request's on_error."""
        self.handoff.post(self.queue.put_nowait, err)

    def _deliver(self, completion: Completion) -> None:
        self.metrics.completed(len(completion.token_ids), completion.finish_reason)
        request = self.request
        if not self._first_token_seen and request is not None and request.first_token_at is not None:
            self._first_token_seen = True
            self.metrics.first_token(request.first_token_at - request.submitted_at)
        self.queue.put_nowait(completion)


async def next_delivered(queue: asyncio.Queue[Delivered]) -> list[Completion | TokenIncrement]:
    """What is in the queue, waiting for the first item; raises the request's failure."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    delivered: list[Completion | TokenIncrement] = []
    for item in items:
        if isinstance(item, Exception):
            raise item
        delivered.append(item)
    return delivered


class JobRequests:
    """The requests in flight by job, and the jobs that ended here (event loop only)."""

    def __init__(self, kept: int = ENDED_JOBS_KEPT) -> None:
        self._by_job: dict[str, set[GenerationRequest]] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self.kept = kept

    def check(self, job_id: str) -> None:
        """Raise JobEndedError when ``job_id`` ended here."""
        if job_id and job_id in self._ended:
            raise JobEndedError(f"job {job_id!r} ended: its requests are refused")

    def add(self, request: GenerationRequest) -> None:
        if request.job_id:
            self._by_job.setdefault(request.job_id, set()).add(request)

    def discard(self, request: GenerationRequest) -> None:
        requests = self._by_job.get(request.job_id)
        if requests is not None:
            requests.discard(request)
            if not requests:
                del self._by_job[request.job_id]

    def end(self, job_id: str) -> list[str]:
        """Mark ``job_id`` ended; the ids of its requests in flight."""
        self._ended[job_id] = None
        self._ended.move_to_end(job_id)
        while len(self._ended) > self.kept:
            self._ended.popitem(last=False)
        return sorted({request.request_id for request in self._by_job.get(job_id, ())})


class EngineInfoSource:
    """Builds this engine's EngineInfo (GetStatus, the registry heartbeat) from its live status."""

    def __init__(self, engine: Engine, engine_id: str, address: str) -> None:
        self.engine = engine
        self.engine_id = engine_id
        self.address = address
        self.weight_transports: tuple[str, ...] = ("filesystem",)
        """How it takes weights (EngineInfo.weight_transports): the trainer picks its group by it."""

    def __call__(self) -> common_pb2.EngineInfo:
        status = self.engine.status()
        info = common_pb2.EngineInfo(
            engine_id=self.engine_id,
            address=self.address,
            backend=self.engine.backend,
            model=status.model_dir,
            policy_version=status.policy_version,
            state=status.state,  # type: ignore[arg-type]
            running_requests=status.running_requests,
            queued_requests=status.queued_requests,
            outstanding_tokens=status.outstanding_tokens,
            job_id=status.job_id,
            weight_transports=self.weight_transports,
            decode_path=status.decode_path,
            decode_path_reason=status.decode_path_reason,
        )
        info.last_heartbeat.GetCurrentTime()
        return info


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """Generate, GenerateBatch, GenerateStream, LoadWeights, Abort, AbortJob, Pause, Resume and
    GetStatus over an Engine.

    Generate answers FAILED_PRECONDITION before the first checkpoint, when the request
    names a job (job_id) other than the one whose weights are served, and when it needs a newer
    version (min_policy_version) than loads within ``version_wait_s``. resume_offset is only
    checked: the engine conditions on the whole prompt, and max_new_tokens counts new tokens.
    After AbortJob it answers FAILED_PRECONDITION to the job's requests.
    """

    def __init__(
        self,
        engine: Engine,
        loader: WeightLoader,
        info: EngineInfoSource,
        metrics: EngineMetrics,
        *,
        version_wait_s: float = 10.0,
        max_pause_s: float = 300.0,
    ) -> None:
        self.engine = engine
        self.version_wait_s = version_wait_s
        self.max_pause_s = max_pause_s
        self._pause_expiry: asyncio.Task[None] | None = None
        """Resumes the engine ``max_pause_s`` after the newest Pause unless a Resume came first."""
        self.loader = loader
        self.info = info
        self.metrics = metrics
        self.engine_id = info.engine_id
        self.jobs = JobRequests()
        self._handoff: LoopHandoff | None = None

    def _loop_handoff(self) -> LoopHandoff:
        """The running loop's handoff, made on first use (the servicer is built before the loop)."""
        loop = asyncio.get_running_loop()
        if self._handoff is None or self._handoff.loop is not loop:
            self._handoff = LoopHandoff(loop)
        return self._handoff

    async def _submit(
        self, request: rollout_pb2.GenerateRequest, *, stream: bool = False
    ) -> tuple[GenerationRequest, asyncio.Queue[Delivered]]:
        """Validate and queue a request; raises what the engine raises (see STATUS_CODES)."""
        generation, queue = await self._prepare(request, stream=stream)
        self._submit_now(generation)
        return generation, queue

    def _submit_now(self, generation: GenerationRequest) -> None:
        """Hand a prepared request to the engine, unless its job ended (checked again: the
        request may have waited for its version); tracked by job until its caller is answered."""
        self.jobs.check(generation.job_id)
        self.engine.submit(generation)
        self.jobs.add(generation)

    async def _prepare(
        self, request: rollout_pb2.GenerateRequest, *, stream: bool = False
    ) -> tuple[GenerationRequest, asyncio.Queue[Delivered]]:
        """Validate a request and wait for the version it needs; raises ValueError or
        StaleWeightsError. The request is not submitted yet."""
        config = SamplingConfig.from_proto(request.sampling)
        self.jobs.check(request.job_id)
        if not 0 <= request.resume_offset <= len(request.prompt_token_ids):
            raise ValueError(
                f"resume_offset {request.resume_offset} is outside the prompt's "
                f"{len(request.prompt_token_ids)} tokens"
            )
        if request.min_policy_version > 0 and request.job_id:
            version = (request.min_policy_epoch, request.min_policy_version)
            await self.loader.wait_for_version(request.job_id, version, self.version_wait_s)
        delivery = Delivery(self._loop_handoff(), self.metrics)
        generation = GenerationRequest(
            request_id=request.request_id or f"req-{uuid.uuid4().hex}",
            prompt=list(request.prompt_token_ids),
            config=config,
            on_completion=delivery,
            job_id=request.job_id,
            on_tokens=delivery.token if stream else None,
            on_error=delivery.fail,
        )
        delivery.request = generation
        return generation, delivery.queue

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        async with engine_errors(context):
            generation, queue = await self._submit(request)
            return await self._collect(generation, queue)

    async def GenerateBatch(
        self, request: rollout_pb2.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateBatchResponse:
        """Every request validated (and its version waited for), then all submitted in one go so
        that the engine batches them; each result carries its own status, as Generate's."""
        prepared = await asyncio.gather(
            *(self._prepare(item) for item in request.requests), return_exceptions=True
        )
        started = [self._start(item) for item in prepared]  # no await between the submits
        outcomes = await asyncio.gather(*started, return_exceptions=True)
        return rollout_pb2.GenerateBatchResponse(results=[generate_result(o) for o in outcomes])

    def _start(
        self, prepared: tuple[GenerationRequest, asyncio.Queue[Delivered]] | BaseException
    ) -> Awaitable[rollout_pb2.GenerateResponse]:
        """Submit a prepared request now; returns its response to await, or its failure."""
        try:
            if isinstance(prepared, BaseException):
                raise prepared
            self._submit_now(prepared[0])
        except Exception as err:
            failed: asyncio.Future[rollout_pb2.GenerateResponse] = asyncio.get_running_loop().create_future()
            failed.set_exception(err)
            return failed
        return self._collect(*prepared)

    async def _collect(
        self, generation: GenerationRequest, queue: asyncio.Queue[Delivered]
    ) -> rollout_pb2.GenerateResponse:
        """Every sample of a submitted request; cancels it when the caller goes away."""
        completions: list[Completion] = []
        try:
            while len(completions) < generation.config.n:
                for item in await next_delivered(queue):
                    assert isinstance(item, Completion)  # unary requests get no increments
                    completions.append(item)
        except asyncio.CancelledError:  # the caller's deadline passed or it went away
            self.engine.cancel(generation)
            raise
        finally:
            self.jobs.discard(generation)
        completions.sort(key=lambda completion: completion.index)
        first = generation.first_token_at
        return rollout_pb2.GenerateResponse(
            request_id=generation.request_id,
            completions=[completion_proto(c) for c in completions],
            engine_id=self.engine_id,
            stats=rollout_pb2.GenerateStats(
                prompt_tokens=len(generation.prompt),
                completion_tokens=sum(len(c.token_ids) for c in completions),
                time_to_first_token_s=(first - generation.submitted_at) if first is not None else 0.0,
                total_s=time.monotonic() - generation.submitted_at,
            ),
        )

    async def GenerateStream(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateChunk]:
        """Streams each sample's new tokens as they are sampled: whatever arrived since the last
        chunk goes out as one chunk per sample; a sample's last chunk carries its finish reason."""
        async with engine_errors(context):
            generation, queue = await self._submit(request, stream=True)
            streamed: dict[int, int] = {}
            finished = 0
            try:
                while finished < generation.config.n:
                    items = await next_delivered(queue)
                    for chunk in self._chunks(generation.request_id, items, streamed):
                        finished += chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                        yield chunk
            except asyncio.CancelledError:
                self.engine.cancel(generation)
                raise
            finally:
                self.jobs.discard(generation)

    def _chunks(
        self, request_id: str, items: list[Completion | TokenIncrement], streamed: dict[int, int]
    ) -> list[rollout_pb2.GenerateChunk]:
        """Chunks for a run of increments and completions, in order, one open chunk per sample."""
        chunks: list[rollout_pb2.GenerateChunk] = []
        open_chunks: dict[int, rollout_pb2.GenerateChunk] = {}
        for item in items:
            chunk = open_chunks.get(item.index)
            if chunk is None:
                chunk = rollout_pb2.GenerateChunk(
                    request_id=request_id, index=item.index, engine_id=self.engine_id
                )
                open_chunks[item.index] = chunk
                chunks.append(chunk)
            if isinstance(item, TokenIncrement):
                chunk.token_ids.append(item.token)
                chunk.logprobs.append(item.logprob)
                chunk.policy_versions.append(item.version)
                streamed[item.index] = streamed.get(item.index, 0) + 1
                continue
            done = streamed.get(item.index, 0)  # tokens the increments did not carry (none, usually)
            chunk.token_ids.extend(item.token_ids[done:])
            chunk.logprobs.extend(item.logprobs[done:])
            chunk.policy_versions.extend(item.policy_versions[done:])
            chunk.finish_reason = item.finish_reason  # type: ignore[assignment]
            chunk.error = item.error
            del open_chunks[item.index]
        return chunks

    async def LoadWeights(
        self, request: rollout_pb2.LoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.LoadWeightsResponse:
        async with engine_errors(context):
            report = await self.loader.load(request.handle, request.mode, context.time_remaining())
        return rollout_pb2.LoadWeightsResponse(
            policy_version=report.update.version,
            load_seconds=report.load_s,
            aborted_requests=report.update.aborted_requests,
        )

    async def Abort(
        self, request: rollout_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.AbortResponse:
        async with engine_errors(context):
            aborted = await self.engine.abort(request.request_ids, all_requests=request.all)
        return rollout_pb2.AbortResponse(aborted=aborted)

    async def AbortJob(
        self, request: rollout_pb2.AbortJobRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.AbortJobResponse:
        """The job ended: abort its requests in flight here (queued ones end at once, running ones
        at the next decode step, with their tokens) and refuse its new ones."""
        if not request.job_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id is empty")
        request_ids = self.jobs.end(request.job_id)
        async with engine_errors(context):
            aborted = await self.engine.abort(request_ids) if request_ids else 0
        if aborted:
            log.info("engine %s: job %s ended; aborted %d requests", self.engine_id, request.job_id, aborted)
        return rollout_pb2.AbortJobResponse(aborted=aborted)

    async def Pause(
        self, request: rollout_pb2.PauseRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.PauseResponse:
        async with engine_errors(context):
            aborted = await self.engine.pause(abort_inflight=request.abort_inflight)
        self._cancel_pause_expiry()
        self._pause_expiry = asyncio.create_task(self._expire_pause(), name="pause expiry")
        return rollout_pb2.PauseResponse(aborted=aborted)

    async def Resume(
        self, request: rollout_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ResumeResponse:
        self._cancel_pause_expiry()
        async with engine_errors(context):
            await self.engine.resume()
        return rollout_pb2.ResumeResponse()

    def _cancel_pause_expiry(self) -> None:
        if self._pause_expiry is not None:
            self._pause_expiry.cancel()
            self._pause_expiry = None

    async def _expire_pause(self) -> None:
        await asyncio.sleep(self.max_pause_s)
        log.warning(
            "engine %s: paused for %.0fs without a Resume; resuming", self.engine_id, self.max_pause_s
        )
        self._pause_expiry = None
        await self.engine.resume()

    async def GetStatus(
        self, request: rollout_pb2.GetEngineStatusRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.EngineInfo:
        return self.info()
