"""The Rollout service over SGLang servers (``VERST_ENGINE_BACKEND=sglang``).

The same gRPC contract, registry heartbeat and checkpoint watching as the torch engine
(``server.py``), with generation, weight loads, aborts and pauses delegated to an
``SGLangBackend``. Weights are verified (sha256) here, then loaded by SGLang from the same path:
the SGLang servers must see the checkpoint directory at the path the handle names.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import redis.asyncio as aioredis

from services.common.engine_registry import EngineRegistry
from services.common.grpc_server import serve
from services.common.pb import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.rollout.engine import EngineStatus, WeightUpdate
from services.rollout.metrics import EngineMetrics, serving_metrics
from services.rollout.sampling import SamplingConfig
from services.rollout.sglang.backend import SGLangBackend, Timeouts
from services.rollout.sglang.protocol import SGLangError, SGLangHTTPError, SGLangWeightsError
from services.rollout.watcher import Heartbeat, LoadReport, WeightWatcher
from services.rollout.weights import CheckpointError, checkpoint_dir, verify_weights

log = logging.getLogger(__name__)

SERVICE_NAME = "verst.v1.Rollout"


@dataclass(frozen=True)
class SGLangEngineConfig:
    """How the engine reaches SGLang: attach to ``urls``, or launch one server for ``model_path``."""

    urls: tuple[str, ...] = ()
    model_path: str = ""
    port: int = 30000
    args: tuple[str, ...] = ()
    startup_timeout_s: float = 900.0
    timeouts: Timeouts = field(default_factory=Timeouts)
    always_seed: bool = False

    @classmethod
    def from_settings(cls, settings: Any) -> SGLangEngineConfig:
        """From EngineSettings' ``sglang_*`` fields (VERST_ENGINE_SGLANG_*)."""
        urls = tuple(url.strip() for url in settings.sglang_urls.split(",") if url.strip())
        if not urls and not settings.sglang_model_path:
            raise ValueError(
                "set VERST_ENGINE_SGLANG_URLS (attach) or VERST_ENGINE_SGLANG_MODEL_PATH (launch)"
            )
        return cls(
            urls=urls,
            model_path=settings.sglang_model_path,
            port=settings.sglang_port,
            args=tuple(shlex.split(settings.sglang_args)),
            startup_timeout_s=settings.sglang_startup_timeout_s,
            timeouts=Timeouts(generate_s=settings.sglang_generate_timeout_s),
            always_seed=settings.sglang_always_seed,
        )

    async def start(self) -> SGLangBackend:
        """Attach and wait until every server answers ``/health_generate``, or launch one."""
        options: dict[str, Any] = {"timeouts": self.timeouts, "always_seed": self.always_seed}
        if not self.urls:
            return await SGLangBackend.launch(
                self.model_path, self.port, self.args, startup_timeout_s=self.startup_timeout_s, **options
            )
        backend = SGLangBackend(self.urls, **options)
        try:
            await backend.wait_ready(self.startup_timeout_s)
        except BaseException:
            await backend.close()
            raise
        return backend


class SGLangEngineView:
    """The engine state the watcher, the heartbeat and the servicer read (``status()``)."""

    def __init__(self, backend: SGLangBackend, model: str = "") -> None:
        self.backend = backend
        self.job_id = ""
        self.model_dir = model
        self.loading = 0
        self.draining = False

    def status(self) -> EngineStatus:
        backend = self.backend.status()
        if backend.policy_version < 0:
            state = common_pb2.ENGINE_STATE_STARTING
        elif self.draining:
            state = common_pb2.ENGINE_STATE_DRAINING
        elif self.loading:
            state = common_pb2.ENGINE_STATE_LOADING_WEIGHTS
        elif backend.paused:
            state = common_pb2.ENGINE_STATE_PAUSED
        else:
            state = common_pb2.ENGINE_STATE_SERVING
        return EngineStatus(
            state=state,
            policy_version=backend.policy_version,
            job_id=self.job_id,
            model_dir=self.model_dir,
            running_requests=backend.running_requests,
            queued_requests=0,
            outstanding_tokens=0,
        )


class SGLangWeightLoader:
    """Verifies a checkpoint and has SGLang load it; one load at a time (a WeightLoader twin)."""

    def __init__(
        self,
        engine: SGLangEngineView,
        timeout_s: float,
        metrics: EngineMetrics | None = None,
        default_mode: int = rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE,
    ) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.metrics = metrics or EngineMetrics(engine.status)
        self.default_mode = default_mode
        """What a load that names no mode does to requests in flight (VERST_ENGINE_WEIGHT_UPDATE_MODE)."""
        self._lock = asyncio.Lock()

    async def load(
        self, handle: common_pb2.CheckpointHandle, mode: int, timeout_s: float | None = None
    ) -> LoadReport:
        """Raises CheckpointError (bad uri, files, sha256, or refused by SGLang), TimeoutError,
        or ConnectionError (SGLang unreachable or failing)."""
        return await self.metrics.observe_load(self._load(handle, mode, timeout_s))

    async def _load(
        self, handle: common_pb2.CheckpointHandle, mode: int, timeout_s: float | None
    ) -> LoadReport:
        if mode == rollout_pb2.WEIGHT_UPDATE_MODE_UNSPECIFIED:
            mode = self.default_mode
        abort = mode == rollout_pb2.WEIGHT_UPDATE_MODE_ABORT
        async with self._lock:
            started = time.monotonic()
            path = checkpoint_dir(handle.uri)
            await asyncio.to_thread(verify_weights, path, handle.sha256)
            aborted = self.engine.backend.status().running_requests if abort else 0
            self.engine.loading += 1
            try:
                async with asyncio.timeout(timeout_s or self.timeout_s):
                    await self.engine.backend.load_weights(path, handle.version, abort_inflight=abort)
            except SGLangWeightsError as err:  # SGLang refused this checkpoint: do not retry it
                raise CheckpointError(str(err)) from None
            except SGLangError as err:  # unreachable or failing: the watcher retries, logged once
                raise ConnectionError(str(err)) from None
            finally:
                self.engine.loading -= 1
            self.engine.job_id, self.engine.model_dir = handle.job_id, str(path)
            seconds = time.monotonic() - started
        update = WeightUpdate(handle.version, handle.job_id, path, mode, aborted_requests=aborted)
        update.done.set()
        latency = None
        if handle.HasField("created_at") and handle.created_at.seconds:
            latency = time.time() - handle.created_at.ToNanoseconds() / 1e9
        log.info("SGLang serves %s v%d from %s (%.3fs)", handle.job_id, handle.version, path, seconds)
        return LoadReport(update, seconds, latency)


async def _abort_call(context: grpc.aio.ServicerContext, err: Exception) -> None:
    """The gRPC status of a backend failure: bad input, or the engine is unavailable."""
    if isinstance(err, ValueError) or (isinstance(err, SGLangHTTPError) and err.status == 400):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))


class SGLangRolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """``verst.v1.Rollout`` over an SGLangBackend; the same statuses as the torch servicer."""

    def __init__(self, view: SGLangEngineView, loader: SGLangWeightLoader, info: SGLangInfoSource) -> None:
        self.view = view
        self.backend = view.backend
        self.loader = loader
        self.info = info
        self.metrics = loader.metrics

    async def _generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[str, list[rollout_pb2.Completion]]:
        """The request id and the completions; aborts the call with the torch servicer's statuses."""
        try:
            SamplingConfig.from_proto(request.sampling)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if not 0 <= request.resume_offset <= len(request.prompt_token_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "resume_offset is outside the prompt")
        status = self.view.status()
        if status.policy_version < 0:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no weights loaded")
        if request.job_id and request.job_id != status.job_id:
            message = f"engine serves job {status.job_id!r}, not {request.job_id!r}"
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)
        if self.view.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is shutting down")
        request_id = request.request_id or f"req-{os.urandom(8).hex()}"
        try:
            completions = await self.backend.generate(request.prompt_token_ids, request.sampling, request_id)
        except (ValueError, SGLangError) as err:
            await _abort_call(context, err)
            raise  # unreachable: abort raises
        for completion in completions:  # no time to first token: SGLang answers once, at the end
            self.metrics.completed(len(completion.token_ids), completion.finish_reason)
        return request_id, completions

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        started = time.monotonic()
        request_id, completions = await self._generate(request, context)
        return rollout_pb2.GenerateResponse(
            request_id=request_id,
            completions=completions,
            engine_id=self.info.engine_id,
            stats=rollout_pb2.GenerateStats(
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=sum(len(c.token_ids) for c in completions),
                total_s=time.monotonic() - started,
            ),
        )

    async def GenerateStream(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateChunk]:
        """One chunk per sample, all once the request is done (SGLang streaming is a later step)."""
        request_id, completions = await self._generate(request, context)
        for c in completions:
            yield rollout_pb2.GenerateChunk(
                request_id=request_id,
                index=c.index,
                token_ids=c.token_ids,
                logprobs=c.logprobs,
                policy_versions=c.policy_versions,
                finish_reason=c.finish_reason,
                engine_id=self.info.engine_id,
                error=c.error,
            )

    async def LoadWeights(
        self, request: rollout_pb2.LoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.LoadWeightsResponse:
        try:
            report = await self.loader.load(request.handle, request.mode, context.time_remaining())
        except CheckpointError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except TimeoutError as err:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err) or "weight load timed out")
        except ConnectionError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        return rollout_pb2.LoadWeightsResponse(
            policy_version=report.update.version,
            load_seconds=report.load_s,
            aborted_requests=report.update.aborted_requests,
        )

    async def Abort(
        self, request: rollout_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.AbortResponse:
        try:
            if request.all:
                return rollout_pb2.AbortResponse(aborted=await self.backend.abort_all())
            counts = [await self.backend.abort(rid) for rid in request.request_ids]
        except SGLangError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        return rollout_pb2.AbortResponse(aborted=sum(counts))

    async def Pause(
        self, request: rollout_pb2.PauseRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.PauseResponse:
        try:
            aborted = await self.backend.pause(abort_inflight=request.abort_inflight)
        except SGLangError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        return rollout_pb2.PauseResponse(aborted=aborted)

    async def Resume(
        self, request: rollout_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ResumeResponse:
        try:
            await self.backend.resume()
        except SGLangError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        return rollout_pb2.ResumeResponse()

    async def GetStatus(
        self, request: rollout_pb2.GetEngineStatusRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.EngineInfo:
        return self.info()


class SGLangInfoSource:
    """This engine's EngineInfo (backend "sglang")."""

    def __init__(self, engine_id: str, address: str, view: SGLangEngineView) -> None:
        self.engine_id = engine_id or f"engine-{socket.gethostname()}-{os.getpid()}"
        self.address = address
        self.view = view

    def __call__(self) -> common_pb2.EngineInfo:
        status = self.view.status()
        info = common_pb2.EngineInfo(
            engine_id=self.engine_id,
            address=self.address,
            backend="sglang",
            model=status.model_dir,
            policy_version=status.policy_version,
            state=status.state,  # type: ignore[arg-type]
            running_requests=status.running_requests,
            job_id=status.job_id,
        )
        info.last_heartbeat.GetCurrentTime()
        return info


class SGLangEngineApp:
    """One engine process over SGLang: the servicer, the checkpoint watcher and the heartbeat."""

    def __init__(self, settings: Any, redis: aioredis.Redis, backend: SGLangBackend, address: str) -> None:
        self.backend = backend
        self.view = SGLangEngineView(backend)
        self.info = SGLangInfoSource(settings.engine_id, address, self.view)
        self.metrics = EngineMetrics(self.view.status)
        self.loader = SGLangWeightLoader(
            self.view, settings.weight_load_timeout_s, self.metrics, settings.default_update_mode
        )
        self.watcher = WeightWatcher(redis, self.loader, settings.weight_poll_s)  # type: ignore[arg-type]
        self.heartbeat = Heartbeat(EngineRegistry(redis), self.info, settings.heartbeat_s)
        self.servicer = SGLangRolloutServicer(self.view, self.loader, self.info)

    @property
    def engine_id(self) -> str:
        return self.info.engine_id

    def register(self, server: grpc.aio.Server) -> list[str]:
        rollout_pb2_grpc.add_RolloutServicer_to_server(self.servicer, server)
        return [SERVICE_NAME]

    async def run(self, stop: asyncio.Event) -> None:
        """Watch for weights and heartbeat until ``stop``; then leave the registry."""
        log.info("engine %s at %s on SGLang %s", self.engine_id, self.info.address, list(self.backend.urls))
        watching = asyncio.create_task(self.watcher.run(stop))
        try:
            await self.heartbeat.run(stop)
        finally:
            self.view.draining = True
            watching.cancel()
            await asyncio.wait([watching])

    async def close(self) -> None:
        """Close the HTTP client; stop the SGLang server if this engine launched it."""
        await self.backend.close()


async def start_cancellable(config: SGLangEngineConfig) -> SGLangBackend:
    """``config.start()``, abandoned on SIGTERM/SIGINT (a launched server is stopped, not orphaned:
    it runs in its own session, out of reach of signals sent to this process)."""
    loop = asyncio.get_running_loop()
    starting = asyncio.ensure_future(config.start())
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, starting.cancel)
    try:
        return await starting
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def serve_sglang_engine(settings: Any, redis: aioredis.Redis, address: str) -> None:
    """The engine process with ``VERST_ENGINE_BACKEND=sglang``: start or attach, then serve."""
    logging.getLogger("httpx").setLevel(max(logging.WARNING, log.getEffectiveLevel()))  # a line per call
    try:
        backend = await start_cancellable(SGLangEngineConfig.from_settings(settings))
    except asyncio.CancelledError:
        log.info("stopped while SGLang was starting")
        return
    app = SGLangEngineApp(settings, redis, backend, address)
    try:
        with serving_metrics(app.metrics, settings.host, settings.metrics_port, settings.metrics_enabled):
            await serve(settings, app.register, background=app.run)
    finally:
        await app.close()
