"""The ``Engine`` over SGLang servers (``VERST_ENGINE_BACKEND=sglang``).

``SGLangEngine`` sends generation, weight loads, aborts and pauses to an ``SGLangBackend``
and turns its failures into the exceptions the Rollout servicer maps to gRPC statuses.
Weights are verified (sha256) here, then loaded by SGLang from the same path: the SGLang
servers must see the checkpoint directory at the path the handle names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import signal
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.pb import common_pb2, rollout_pb2
from services.rollout.config import EngineSettings
from services.rollout.engine_protocol import (
    NO_WEIGHTS,
    Completion,
    EngineStatus,
    EngineStoppedError,
    EngineUnavailableError,
    GenerationRequest,
    NoWeightsError,
    ServedWeights,
    check_job,
    engine_state,
)
from services.rollout.sglang.backend import SGLangBackend, Timeouts
from services.rollout.sglang.protocol import SGLangError, SGLangHTTPError, SGLangWeightsError
from services.rollout.weights import CheckpointError, verify_weights

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


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


def generation_error(err: Exception) -> Exception:
    """What a failed generate call means to the servicer: SGLang refused the input (HTTP 400) is
    a ValueError, any other SGLang failure EngineUnavailableError; the rest stays as it is."""
    if isinstance(err, SGLangHTTPError) and err.status == 400:
        return ValueError(str(err))
    if isinstance(err, SGLangError):
        return EngineUnavailableError(str(err))
    return err


@contextlib.contextmanager
def unavailable_on_sglang_errors() -> Iterator[None]:
    """Control calls (abort, pause, resume): any SGLang failure is EngineUnavailableError."""
    try:
        yield
    except SGLangError as err:
        raise EngineUnavailableError(str(err)) from None


class SGLangEngine:
    """An ``Engine`` whose generation runs on SGLang servers, driven through ``client``."""

    backend = "sglang"

    def __init__(
        self, client: SGLangBackend, default_mode: int = rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE
    ) -> None:
        self.client = client
        self.default_mode = default_mode
        """What a load that names no mode does to requests in flight (VERST_ENGINE_WEIGHT_UPDATE_MODE)."""
        self.job_id = ""
        self.model_dir = ""
        self.loading = 0
        self.draining = False
        self._generating: dict[GenerationRequest, asyncio.Task[None]] = {}

    def describe(self) -> str:
        return f"SGLang {list(self.client.urls)}"

    def status(self) -> EngineStatus:
        client = self.client.status()
        return EngineStatus(
            state=engine_state(
                serving=client.policy_version >= 0,
                draining=self.draining,
                loading=bool(self.loading),
                paused=client.paused,
            ),
            policy_version=client.policy_version,
            job_id=self.job_id,
            model_dir=self.model_dir,
            running_requests=client.running_requests,
            queued_requests=0,
            outstanding_tokens=0,
        )

    # -- requests ----------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> None:
        """Start the request's ``/generate`` call; its samples arrive together when it returns."""
        if self.client.policy_version < 0:
            raise NoWeightsError(NO_WEIGHTS)
        check_job(request, self.job_id)
        if self.draining:
            raise EngineStoppedError("engine is shutting down")
        task = asyncio.get_running_loop().create_task(self._generate(request))
        self._generating[request] = task
        task.add_done_callback(lambda _: self._generating.pop(request, None))

    async def _generate(self, request: GenerationRequest) -> None:
        try:
            outputs = await self.client.generate_from_config(
                request.prompt, request.config, request.request_id, request.config.n
            )
        except Exception as err:  # the caller hears of every failure, known or not
            self._fail(request, generation_error(err))
            return
        for out in outputs:  # no time to first token: SGLang answers once, at the end
            completion = Completion(
                out.index, list(out.token_ids), list(out.logprobs), list(out.policy_versions),
                out.finish_reason, out.error, out.text if out.HasField("text") else None,
            )  # fmt: skip
            request.on_completion(completion)

    @staticmethod
    def _fail(request: GenerationRequest, err: Exception) -> None:
        if request.on_error is not None:
            request.on_error(err)
            return
        for index in range(request.config.n):
            request.on_completion(Completion(index, [], [], [], common_pb2.FINISH_REASON_ERROR, str(err)))

    def cancel(self, request: GenerationRequest) -> None:
        """Cancel the request's call: its samples are aborted on the server (best effort)."""
        task = self._generating.get(request)
        if task is not None:
            task.cancel()

    async def abort(self, request_ids: Sequence[str] = (), *, all_requests: bool = False) -> int:
        with unavailable_on_sglang_errors():
            if all_requests:
                return await self.client.abort_all()
            return sum([await self.client.abort(request_id) for request_id in request_ids])

    async def pause(self, *, abort_inflight: bool) -> int:
        with unavailable_on_sglang_errors():
            return await self.client.pause(abort_inflight=abort_inflight)

    async def resume(self) -> None:
        with unavailable_on_sglang_errors():
            await self.client.resume()

    # -- weights ---------------------------------------------------------------------

    async def load_weights(
        self, path: Path, *, sha256: str, version: int, job_id: str, mode: int, timeout_s: float
    ) -> ServedWeights:
        """Verify the checkpoint, then have every server load it. Raises CheckpointError (bad files
        or sha256, or refused by SGLang), TimeoutError, or EngineUnavailableError (SGLang
        unreachable or failing: the watcher retries, logged once)."""
        if mode == rollout_pb2.WEIGHT_UPDATE_MODE_UNSPECIFIED:
            mode = self.default_mode
        abort = mode == rollout_pb2.WEIGHT_UPDATE_MODE_ABORT
        await asyncio.to_thread(verify_weights, path, sha256)
        aborted = self.client.status().running_requests if abort else 0
        self.loading += 1
        try:
            async with asyncio.timeout(timeout_s):
                await self.client.load_weights(path, version, abort_inflight=abort)
        except SGLangWeightsError as err:  # SGLang refused this checkpoint: do not retry it
            raise CheckpointError(str(err)) from None
        except SGLangError as err:
            raise EngineUnavailableError(str(err)) from None
        except TimeoutError:
            raise TimeoutError(f"SGLang did not load weights v{version} within {timeout_s}s") from None
        finally:
            self.loading -= 1
        self.job_id, self.model_dir = job_id, str(path)
        return ServedWeights(version, job_id, path, mode, aborted_requests=aborted)

    receives_state_dicts = False

    async def load_state_dict(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        path: Path,
        version: int,
        job_id: str,
        mode: int,
        timeout_s: float,
    ) -> ServedWeights:
        """Not mapped (SGLang's /update_weights_from_distributed would be): files only."""
        raise CheckpointError("the sglang backend loads weights from their files only")

    # -- lifecycle -------------------------------------------------------------------

    def set_draining(self) -> None:
        self.draining = True

    async def close(self) -> None:
        """Cancel the calls in flight, close the HTTP client, and stop the SGLang server if this
        engine launched it."""
        calls = list(self._generating.values())
        for call in calls:
            call.cancel()
        if calls:
            await asyncio.wait(calls, timeout=self.client.timeouts.control_s)
        await self.client.close()


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


async def open_sglang_engine(settings: EngineSettings) -> SGLangEngine | None:
    """Attach to (or launch) the SGLang servers ``settings`` name; None if a signal stopped the start."""
    logging.getLogger("httpx").setLevel(max(logging.WARNING, log.getEffectiveLevel()))  # a line per call
    try:
        client = await start_cancellable(SGLangEngineConfig.from_settings(settings))
    except asyncio.CancelledError:
        log.info("stopped while SGLang was starting")
        return None
    return SGLangEngine(client, settings.default_update_mode)
