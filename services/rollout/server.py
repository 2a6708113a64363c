"""The rollout engine's gRPC server: ``verst.v1.Rollout`` over a TorchEngine.

``python -m services.rollout`` runs ``main()``: the Rollout service, a watcher that
loads the newest running job's checkpoints, and a heartbeat into the engine registry.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import redis.asyncio as aioredis
import torch

from services.common.bus import connect
from services.common.engine_registry import EngineRegistry
from services.common.grpc_server import serve
from services.common.pb import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.redis_server import free_port
from services.common.settings import load_settings, require_redis_url, setup_logging
from services.rollout.config import EngineSettings
from services.rollout.engine import (
    Completion,
    EngineStoppedError,
    GenerationRequest,
    NoWeightsError,
    TorchEngine,
    WrongJobError,
)
from services.rollout.metrics import EngineMetrics, serving_metrics
from services.rollout.sampling import SamplingConfig
from services.rollout.torch_backend import DTYPES, resolve_device
from services.rollout.watcher import Heartbeat, LoadReport, WeightLoader, WeightWatcher
from services.rollout.weights import CheckpointError

log = logging.getLogger(__name__)

SERVICE_NAME = "verst.v1.Rollout"


def completion_proto(completion: Completion) -> rollout_pb2.Completion:
    return rollout_pb2.Completion(
        index=completion.index,
        token_ids=completion.token_ids,
        logprobs=completion.logprobs,
        policy_versions=completion.policy_versions,
        finish_reason=completion.finish_reason,  # type: ignore[arg-type]
        error=completion.error,
    )


@dataclass(frozen=True, slots=True)
class TokenIncrement:
    """One new token of one sample of a streaming request."""

    index: int
    token: int
    logprob: float
    version: int


class Delivery:
    """Hands one request's completions from the engine's worker thread to its caller's queue,
    counting them on the event loop (also those whose caller has gone: their tokens were made)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, metrics: EngineMetrics) -> None:
        self.loop = loop
        self.metrics = metrics
        self.queue: asyncio.Queue[Completion | TokenIncrement] = asyncio.Queue()
        self.request: GenerationRequest | None = None
        self._first_token_seen = False

    def __call__(self, completion: Completion) -> None:
        """The engine's on_completion (worker thread)."""
        self.loop.call_soon_threadsafe(self._deliver, completion)

    def token(self, index: int, token: int, logprob: float, version: int) -> None:
        """The engine's on_tokens for streaming requests (worker thread)."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, TokenIncrement(index, token, logprob, version))

    def _deliver(self, completion: Completion) -> None:
        self.metrics.completed(len(completion.token_ids), completion.finish_reason)
        request = self.request
        if not self._first_token_seen and request is not None and request.first_token_at is not None:
            self._first_token_seen = True
            self.metrics.first_token(request.first_token_at - request.submitted_at)
        self.queue.put_nowait(completion)


class MeteredWeightLoader(WeightLoader):
    """A WeightLoader whose loads (the watcher's and LoadWeights') are counted and timed."""

    def __init__(self, engine: TorchEngine, timeout_s: float, metrics: EngineMetrics) -> None:
        super().__init__(engine, timeout_s)
        self.metrics = metrics

    async def load(
        self, handle: common_pb2.CheckpointHandle, mode: int, timeout_s: float | None = None
    ) -> LoadReport:
        return await self.metrics.observe_load(super().load(handle, mode, timeout_s))


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """Generate, GenerateStream, LoadWeights, Abort, Pause, Resume and GetStatus.

    Generate answers FAILED_PRECONDITION before the first checkpoint, and when the request
    names a job (job_id) other than the one whose weights are served. resume_offset is only
    checked: the engine conditions on the whole prompt, and max_new_tokens counts new tokens.
    """

    def __init__(
        self, engine: TorchEngine, loader: WeightLoader, info: EngineInfoSource, metrics: EngineMetrics
    ) -> None:
        self.engine = engine
        self.loader = loader
        self.info = info
        self.metrics = metrics

    async def _submit(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext, *, stream: bool = False
    ) -> tuple[GenerationRequest, asyncio.Queue[Completion | TokenIncrement]]:
        """Validate and queue a request; aborts the call with the right status on bad input."""
        try:
            config = SamplingConfig.from_proto(request.sampling)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if not 0 <= request.resume_offset <= len(request.prompt_token_ids):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"resume_offset {request.resume_offset} is outside the prompt's "
                f"{len(request.prompt_token_ids)} tokens",
            )
        delivery = Delivery(asyncio.get_running_loop(), self.metrics)
        generation = GenerationRequest(
            request_id=request.request_id or f"req-{uuid.uuid4().hex}",
            prompt=list(request.prompt_token_ids),
            config=config,
            on_completion=delivery,
            job_id=request.job_id,
            on_tokens=delivery.token if stream else None,
        )
        delivery.request = generation
        try:
            self.engine.submit(generation)
        except NoWeightsError:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "no weights loaded: the engine serves the newest checkpoint of the newest running job",
            )
        except WrongJobError as err:  # not ready for this job yet: the caller may retry
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except EngineStoppedError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        return generation, delivery.queue

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        generation, queue = await self._submit(request, context)
        completions: list[Completion] = []
        try:
            while len(completions) < generation.config.n:
                item = await queue.get()
                assert isinstance(item, Completion)  # unary requests get no increments
                completions.append(item)
        except asyncio.CancelledError:  # the caller's deadline passed or it went away
            self.engine.cancel(generation)
            raise
        completions.sort(key=lambda completion: completion.index)
        now = time.monotonic()
        first = generation.first_token_at
        return rollout_pb2.GenerateResponse(
            request_id=generation.request_id,
            completions=[completion_proto(c) for c in completions],
            engine_id=self.info.engine_id,
            stats=rollout_pb2.GenerateStats(
                prompt_tokens=len(generation.prompt),
                completion_tokens=sum(len(c.token_ids) for c in completions),
                time_to_first_token_s=(first - generation.submitted_at) if first is not None else 0.0,
                total_s=now - generation.submitted_at,
            ),
        )

    async def GenerateStream(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateChunk]:
        """Streams each sample's new tokens as they are sampled: whatever arrived since the last
        chunk goes out as one chunk per sample; a sample's last chunk carries its finish reason."""
        generation, queue = await self._submit(request, context, stream=True)
        streamed: dict[int, int] = {}
        finished = 0
        try:
            while finished < generation.config.n:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                for chunk in self._chunks(generation.request_id, items, streamed):
                    finished += chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                    yield chunk
        except asyncio.CancelledError:
            self.engine.cancel(generation)
            raise

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
                    request_id=request_id, index=item.index, engine_id=self.info.engine_id
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
        try:
            report = await self.loader.load(request.handle, request.mode, context.time_remaining())
        except CheckpointError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except TimeoutError as err:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
        except EngineStoppedError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        return rollout_pb2.LoadWeightsResponse(
            policy_version=report.update.version,
            load_seconds=report.load_s,
            aborted_requests=report.update.aborted_requests,
        )

    async def Abort(
        self, request: rollout_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.AbortResponse:
        return rollout_pb2.AbortResponse(
            aborted=self.engine.abort(request.request_ids, all_requests=request.all)
        )

    async def Pause(
        self, request: rollout_pb2.PauseRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.PauseResponse:
        return rollout_pb2.PauseResponse(aborted=self.engine.pause(abort_inflight=request.abort_inflight))

    async def Resume(
        self, request: rollout_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ResumeResponse:
        self.engine.resume()
        return rollout_pb2.ResumeResponse()

    async def GetStatus(
        self, request: rollout_pb2.GetEngineStatusRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.EngineInfo:
        return self.info()


def advertised_address(settings: EngineSettings) -> str:
    """Where the router reaches this engine."""
    if settings.advertise_address:
        return settings.advertise_address
    host = socket.gethostname() if settings.host in ("0.0.0.0", "::", "") else settings.host
    return f"{host}:{settings.port}"


class EngineInfoSource:
    """Builds this engine's EngineInfo from its settings and the engine's live status."""

    def __init__(self, settings: EngineSettings, engine: TorchEngine) -> None:
        self.engine = engine
        self.engine_id = settings.engine_id or f"engine-{socket.gethostname()}-{os.getpid()}"
        self.address = advertised_address(settings)

    def __call__(self) -> common_pb2.EngineInfo:
        status = self.engine.status()
        info = common_pb2.EngineInfo(
            engine_id=self.engine_id,
            address=self.address,
            backend="torch",
            model=status.model_dir,
            policy_version=status.policy_version,
            state=status.state,  # type: ignore[arg-type]
            running_requests=status.running_requests,
            queued_requests=status.queued_requests,
            outstanding_tokens=status.outstanding_tokens,
            job_id=status.job_id,
        )
        info.last_heartbeat.GetCurrentTime()
        return info


class EngineApp:
    """One engine process: the TorchEngine, its Rollout servicer and its background work."""

    def __init__(self, settings: EngineSettings, redis: aioredis.Redis) -> None:
        if settings.port == 0 and not settings.advertise_address:
            raise ValueError("an engine needs a fixed port (or advertise_address) to register itself")
        self.settings = settings
        self.engine = TorchEngine(
            device=resolve_device(settings.device),
            dtype=DTYPES[settings.dtype],
            max_batch_size=settings.max_batch_size,
            batch_wait_s=settings.batch_wait_ms / 1000.0,
            max_prefill_tokens=settings.max_prefill_tokens,
            default_update_mode=settings.default_update_mode,
            compile_decode=settings.compile_decode,
        )
        self.info = EngineInfoSource(settings, self.engine)
        self.metrics = EngineMetrics(self.engine.status)
        self.loader = MeteredWeightLoader(self.engine, settings.weight_load_timeout_s, self.metrics)
        self.watcher = WeightWatcher(redis, self.loader, settings.weight_poll_s)
        self.heartbeat = Heartbeat(EngineRegistry(redis), self.info, settings.heartbeat_s)
        self.servicer = RolloutServicer(self.engine, self.loader, self.info, self.metrics)
        self.engine.start()

    @property
    def engine_id(self) -> str:
        return self.info.engine_id

    def register(self, server: grpc.aio.Server) -> list[str]:
        """Add the Rollout servicer to ``server``; returns the service names for health."""
        rollout_pb2_grpc.add_RolloutServicer_to_server(self.servicer, server)
        return [SERVICE_NAME]

    async def run(self, stop: asyncio.Event) -> None:
        """Watch for weights and heartbeat until ``stop``; then leave the registry."""
        log.info("engine %s at %s on %s", self.engine_id, self.info.address, self.engine.device)
        watching = asyncio.create_task(self.watcher.run(stop))
        try:
            await self.heartbeat.run(stop)  # returns after leaving the registry
        finally:
            self.engine.set_draining()
            watching.cancel()  # a load in flight is released when the engine closes
            await asyncio.wait([watching])

    def close(self) -> None:
        """Stop the worker thread (unfinished requests end as ABORT)."""
        self.engine.shutdown()


async def serve_engine(settings: EngineSettings) -> None:
    redis = connect(require_redis_url(settings))
    if settings.backend == "sglang":
        from services.rollout.sglang.engine import serve_sglang_engine

        try:
            await serve_sglang_engine(settings, redis, advertised_address(settings))
        finally:
            await redis.aclose()
        return
    app = EngineApp(settings, redis)
    try:
        with serving_metrics(app.metrics, settings.host, settings.metrics_port, settings.metrics_enabled):
            await serve(settings, app.register, background=app.run)
    finally:
        app.close()
        await redis.aclose()


def main() -> None:
    """``python -m services.rollout``."""
    settings = load_settings(EngineSettings)
    setup_logging(settings.service_name, settings.log_level)
    if settings.backend == "sglang" and not (settings.sglang_urls.strip() or settings.sglang_model_path):
        urls, path = EngineSettings.env_name("sglang_urls"), EngineSettings.env_name("sglang_model_path")
        print(
            f"{settings.service_name}: invalid setting {urls}: set it (attach) or {path} (launch)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    try:
        resolve_device(settings.device)
    except (ValueError, RuntimeError) as err:  # e.g. cuda asked for on a machine without one
        name = EngineSettings.env_name("device")
        print(f"{settings.service_name}: invalid setting {name}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if settings.port == 0:  # the registry needs the real port before the server binds it
        settings = settings.model_copy(update={"port": free_port(settings.host)})
    asyncio.run(serve_engine(settings))
