"""The torch rollout engine: batched generation with a KV cache on one worker thread.

Requests are split into sample rows (``n`` per request) and queued. The worker takes up to
``max_batch_size`` rows at a time (waiting at most ``batch_wait_s`` for a batch to fill),
left-pads the prompts, prefills, and decodes step by step with the model's KV cache (see
``torch_backend``). Between decode steps it honours aborts, pauses and weight updates: a
same-architecture update is copied into the live model right there, so later tokens carry
the new policy version; a new architecture is swapped in between batches.

All mutable state is guarded by one condition variable. The asyncio side only enqueues,
flags and reads; the model is touched by the worker thread alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.pb import common_pb2, rollout_pb2
from services.rollout.sampling import SamplingConfig, row_seed
from services.rollout.torch_backend import LoadedModel, decode_batch, load_model
from services.rollout.weights import (
    CheckpointError,
    copy_into_model,
    read_config,
    read_verified_state_dict,
    verify_weights,
)

log = logging.getLogger(__name__)

FinishReason = int
"""A common_pb2.FinishReason value."""
_IDLE_WAIT_S = 0.1
"""How long the idle worker sleeps between checks of its stop flag."""


class NoWeightsError(RuntimeError):
    """Generate before the first checkpoint was loaded."""


class EngineStoppedError(RuntimeError):
    """Generate after shutdown began."""


class WrongJobError(RuntimeError):
    """Generate for a job other than the one whose weights the engine serves."""


@dataclass(slots=True)
class Completion:
    """One finished (or aborted) sample of a request."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: FinishReason
    error: str = ""


@dataclass(eq=False)
class GenerationRequest:
    """One Generate call. ``on_completion`` is called on the worker thread per finished sample."""

    request_id: str
    prompt: list[int]
    config: SamplingConfig
    on_completion: Callable[[Completion], None]
    job_id: str = ""
    """When set, the engine must be serving this job's weights."""
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    aborted: bool = False
    unfinished: int = 0


@dataclass(eq=False)
class Row:
    """One sample being generated: the unit the worker batches."""

    request: GenerationRequest
    index: int
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None

    @property
    def seed(self) -> int | None:
        """The seed of this sample's random stream, or None for the engine's shared one."""
        seed = self.request.config.seed
        return None if seed is None else row_seed(seed, self.index)


@dataclass(eq=False)
class WeightUpdate:
    """A verified checkpoint waiting for the worker: a new model, or a state dict to copy."""

    version: int
    job_id: str
    path: Path
    mode: int
    model: LoadedModel | None = None
    state_dict: dict[str, torch.Tensor] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None
    aborted_requests: int = 0


@dataclass(frozen=True, slots=True)
class EngineStatus:
    state: int
    policy_version: int
    job_id: str
    model_dir: str
    running_requests: int
    queued_requests: int
    outstanding_tokens: int


class TorchEngine:
    """Batched generation on a worker thread; thread-safe entry points for the server."""

    def __init__(
        self,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_batch_size: int,
        batch_wait_s: float,
        default_update_mode: int = rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.default_update_mode = default_update_mode
        self._cond = threading.Condition(threading.RLock())
        self._queue: deque[Row] = deque()
        self._running: list[Row] = []
        self._requests: dict[str, set[GenerationRequest]] = {}
        self._loaded: LoadedModel | None = None
        self._version = -1
        self._job_id = ""
        self._model_dir = ""
        self._pending: WeightUpdate | None = None
        self._loading = 0
        self._paused = False
        self._draining = False
        self._stopping = False
        self._worker = threading.Thread(target=self._work, name="engine-worker", daemon=True)

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        self._worker.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the worker; every unfinished request gets its tokens so far, marked ABORT."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.abort(all_requests=True)
        if self._worker.is_alive():
            self._worker.join(timeout_s)
        self._fail_pending()

    def _fail_pending(self) -> None:
        """Release a caller waiting for weights the stopped worker will never take."""
        with self._cond:
            update, self._pending = self._pending, None
        if update is not None:
            update.error = EngineStoppedError("engine is shutting down")
            update.done.set()

    def set_draining(self) -> None:
        with self._cond:
            self._draining = True

    # -- requests ----------------------------------------------------------

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request's samples.

        Raises NoWeightsError, WrongJobError, EngineStoppedError or ValueError (bad input).
        """
        with self._cond:
            if self._stopping:
                raise EngineStoppedError("engine is shutting down")
            if self._loaded is None:
                raise NoWeightsError("no weights loaded")
            if request.job_id and request.job_id != self._job_id:
                raise WrongJobError(f"engine serves job {self._job_id!r}, not {request.job_id!r}")
            self._validate(request, self._loaded)
            stop_ids = request.config.stop_token_ids
            if not request.config.ignore_eos:
                stop_ids = stop_ids | self._loaded.eos_token_ids
            request.unfinished = request.config.n
            self._requests.setdefault(request.request_id, set()).add(request)
            self._queue.extend(Row(request, i, stop_ids) for i in range(request.config.n))
            self._cond.notify_all()

    @staticmethod
    def _validate(request: GenerationRequest, loaded: LoadedModel) -> None:
        prompt, config = request.prompt, request.config
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        bad = [t for t in prompt if not 0 <= t < loaded.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary [0, {loaded.vocab_size}): {bad[:5]}")
        bad = [t for t in config.stop_token_ids if not 0 <= t < loaded.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids outside the vocabulary [0, {loaded.vocab_size}): {bad[:5]}")
        total = len(prompt) + config.max_new_tokens
        if loaded.max_positions and total > loaded.max_positions:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({config.max_new_tokens}) = {total} "
                f"exceeds the model's {loaded.max_positions} positions"
            )
        if config.stop and loaded.tokenizer is None:
            raise ValueError("stop strings need a tokenizer in the checkpoint; use stop_token_ids")

    def abort(self, request_ids: Iterable[str] = (), *, all_requests: bool = False) -> int:
        """Mark live requests aborted by id (or all of them); returns how many were hit.

        Queued samples finish at once (no tokens); running ones at the next decode step,
        with the tokens they have.
        """
        with self._cond:
            if all_requests:
                targets = {r for group in self._requests.values() for r in group}
            else:
                targets = {r for rid in request_ids for r in self._requests.get(rid, ())}
            self._abort_locked(targets)
            return len(targets)

    def cancel(self, request: GenerationRequest) -> None:
        """Abort one request object (its caller went away)."""
        with self._cond:
            if request.unfinished:
                self._abort_locked({request})

    def _abort_locked(self, targets: set[GenerationRequest]) -> None:
        for request in targets:
            request.aborted = True
        kept: deque[Row] = deque()
        for row in self._queue:
            if row.request.aborted:
                self._finish(row, common_pb2.FINISH_REASON_ABORT)
            else:
                kept.append(row)
        self._queue = kept
        self._cond.notify_all()

    def pause(self, *, abort_inflight: bool) -> int:
        """Stop starting batches and hold running ones; optionally abort what is in flight."""
        with self._cond:
            self._paused = True
            self._cond.notify_all()
        return self.abort(all_requests=True) if abort_inflight else 0

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def status(self) -> EngineStatus:
        with self._cond:
            running = [r for r in self._running if r.finish is None]
            running_requests = {id(r.request) for r in running}
            queued_requests = {id(r.request) for r in self._queue} - running_requests
            outstanding = sum(r.request.config.max_new_tokens - len(r.tokens) for r in running)
            outstanding += sum(r.request.config.max_new_tokens for r in self._queue)
            if self._loaded is None:
                state = common_pb2.ENGINE_STATE_STARTING
            elif self._draining:
                state = common_pb2.ENGINE_STATE_DRAINING
            elif self._loading or self._pending is not None:
                state = common_pb2.ENGINE_STATE_LOADING_WEIGHTS
            elif self._paused:
                state = common_pb2.ENGINE_STATE_PAUSED
            else:
                state = common_pb2.ENGINE_STATE_SERVING
            return EngineStatus(
                state=state,
                policy_version=self._version,
                job_id=self._job_id,
                model_dir=self._model_dir,
                running_requests=len(running_requests),
                queued_requests=len(queued_requests),
                outstanding_tokens=outstanding,
            )

    # -- weights -----------------------------------------------------------

    def load_checkpoint(
        self, path: Path, *, sha256: str, version: int, job_id: str, mode: int, timeout_s: float
    ) -> WeightUpdate:
        """Verify and stage a checkpoint, then wait until the worker serves it (blocking).

        Raises CheckpointError for a bad checkpoint, TimeoutError if the worker did not take
        it within ``timeout_s``. Callers serialize loads.
        """
        with self._cond:
            self._loading += 1
        try:
            update = self._prepare(path, sha256=sha256, version=version, job_id=job_id, mode=mode)
            with self._cond:
                if self._stopping:
                    raise EngineStoppedError("engine is shutting down")
                if self._pending is not None:
                    raise RuntimeError("another weight load is in progress")
                self._pending = update
                self._cond.notify_all()
            if not update.done.wait(timeout_s):
                with self._cond:
                    if self._pending is update:
                        self._pending = None
                        raise TimeoutError(f"the engine did not take weights v{version} within {timeout_s}s")
                update.done.wait()  # the worker is applying it right now
            if update.error is not None:
                raise update.error
            return update
        finally:
            with self._cond:
                self._loading -= 1

    def _prepare(self, path: Path, *, sha256: str, version: int, job_id: str, mode: int) -> WeightUpdate:
        if mode == rollout_pb2.WEIGHT_UPDATE_MODE_UNSPECIFIED:
            mode = self.default_update_mode
        config = read_config(path)
        with self._cond:
            same_architecture = self._loaded is not None and self._loaded.config == config
        update = WeightUpdate(version=version, job_id=job_id, path=path, mode=mode)
        if same_architecture:
            update.state_dict = read_verified_state_dict(path, sha256)
        else:
            verify_weights(path, sha256)
            try:
                update.model = load_model(path, device=self.device, dtype=self.dtype)
            except (OSError, ValueError, RuntimeError, NotImplementedError) as err:
                raise CheckpointError(f"cannot load a model from {path}: {err}") from err
            update.model.config = config
        return update

    def _take_update(self, live: list[Row]) -> WeightUpdate | None:
        """The pending update if it may be applied now (called by the worker, between steps)."""
        with self._cond:
            update = self._pending
            if update is None:
                return None
            unfinished = [row for row in live if row.finish is None]
            if update.mode == rollout_pb2.WEIGHT_UPDATE_MODE_ABORT and unfinished:
                requests = {row.request for row in unfinished}
                self._abort_locked(requests)
                update.aborted_requests += len(requests)
                for row in unfinished:
                    self._finish(row, common_pb2.FINISH_REASON_ABORT)
                unfinished = []
            if update.model is not None and unfinished:
                return None  # a new architecture waits for the batch to end
            self._pending = None
            return update

    def _apply(self, update: WeightUpdate) -> None:
        """Install an update (worker thread only), then publish its version."""
        try:
            if update.model is not None:
                new_model = update.model
            else:
                assert self._loaded is not None and update.state_dict is not None
                copy_into_model(self._loaded.model, update.state_dict)
                new_model = self._loaded
        except Exception as err:  # whatever went wrong, the waiting caller hears of it
            update.error = (
                err if isinstance(err, CheckpointError) else CheckpointError(f"{type(err).__name__}: {err}")
            )
            update.done.set()
            return
        with self._cond:
            self._loaded = new_model
            self._version = update.version
            self._job_id = update.job_id
            self._model_dir = str(update.path)
        update.state_dict = None
        update.done.set()

    # -- the worker ----------------------------------------------------------

    def _work(self) -> None:
        try:
            self._work_until_stopped()
        except Exception:
            log.exception("the engine worker died")
            raise
        finally:
            with self._cond:
                self._stopping = True
            self._fail_pending()
            self.abort(all_requests=True)

    def _work_until_stopped(self) -> None:
        while True:
            update = self._take_update([])
            if update is not None:
                self._apply(update)
            with self._cond:
                if self._stopping:
                    return
                rows = self._take_batch()
                self._running = rows
            if rows:
                self._run_batch(rows)
                with self._cond:
                    self._running = []

    def _take_batch(self) -> list[Row]:
        """Up to max_batch_size queued rows, once a batch is full or batch_wait_s has passed."""
        if self._paused or self._loaded is None or not self._queue or self._pending is not None:
            self._cond.wait(_IDLE_WAIT_S)
            return []
        deadline = time.monotonic() + self.batch_wait_s
        while len(self._queue) < self.max_batch_size:
            left = deadline - time.monotonic()
            if left <= 0 or self._stopping or self._paused or self._pending is not None:
                break
            self._cond.wait(left)
        if self._paused or self._stopping or self._pending is not None:
            return []
        count = min(self.max_batch_size, len(self._queue))
        return [self._queue.popleft() for _ in range(count)]

    def _run_batch(self, rows: list[Row]) -> None:
        loaded = self._loaded
        assert loaded is not None
        try:
            decode_batch(loaded, rows, device=self.device, hooks=self)
        except Exception as err:  # the batch fails; the engine keeps serving
            log.exception("generation failed for a batch of %d samples", len(rows))
            with self._cond:
                for row in rows:
                    if row.finish is None:
                        self._finish(row, common_pb2.FINISH_REASON_ERROR, f"{type(err).__name__}: {err}")

    # -- hooks the backend calls during a batch (worker thread) -----------------

    def current_version(self) -> int:
        """The policy version that the next sampled tokens belong to."""
        return self._version

    def after_step(self, live: list[Row]) -> None:
        """Between decode steps: finish aborted rows, apply weight updates, hold while paused."""
        while True:
            with self._cond:
                for row in live:
                    if row.finish is None and (row.request.aborted or self._stopping):
                        self._finish(row, common_pb2.FINISH_REASON_ABORT)
            update = self._take_update(live)
            if update is not None:
                self._apply(update)
            with self._cond:
                if not self._paused or self._stopping or all(r.finish is not None for r in live):
                    return
                self._cond.wait(_IDLE_WAIT_S)

    def finish(self, row: Row, reason: FinishReason, error: str = "") -> None:
        """Complete one sample (thread-safe); called by the backend when a row stops."""
        with self._cond:
            self._finish(row, reason, error)

    def _finish(self, row: Row, reason: FinishReason, error: str = "") -> None:
        if row.finish is not None:
            return
        row.finish = reason
        request = row.request
        request.unfinished -= 1
        if request.unfinished == 0:
            group = self._requests.get(request.request_id)
            if group is not None:
                group.discard(request)
                if not group:
                    del self._requests[request.request_id]
        completion = Completion(row.index, row.tokens, row.logprobs, row.versions, reason, error)
        try:
            request.on_completion(completion)
        except Exception:  # a closed event loop must not kill the worker
            log.exception("could not deliver a completion of request %s", request.request_id)
