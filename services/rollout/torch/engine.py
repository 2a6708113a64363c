"""The torch rollout engine: continuous batching with a slot KV cache on one worker thread.

Requests are split into sample rows (``n`` per request) and queued. Every iteration of the
worker (see ``_work_until_stopped``) does, in this order: apply a pending weight update if it
may be applied now; finish aborted samples and drop every finished one from the batch; admit
queued samples while they fit (at most ``max_batch_size`` samples, whose KV cache, samples x
the longest prompt + max_new_tokens, stays within ``max_batch_tokens``; one prefill per
request, at most ``max_prefill_tokens`` of prompt per step); run one decode step for every
live sample. An idle engine first waits up to ``batch_wait_s`` for the batch to fill. So
requests join and leave the running batch at every step (``continuous.ContinuousBatch``,
``decoder.SlotDecoder``). A same-architecture weight update is copied into the live model
between steps, so later tokens carry the new policy version; a new architecture waits until
the batch is empty.

Models the slot decoder does not know (see ``decoder.unsupported_reason``) run on
transformers' forward in static batches instead (``model.decode_batch``).

All mutable state is guarded by one condition variable. The asyncio side only enqueues,
flags and reads; the model is touched by the worker thread alone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable

import torch

from services.common.pb import common_pb2, rollout_pb2
from services.rollout.engine_protocol import (
    NO_WEIGHTS,
    EngineStatus,
    EngineStoppedError,
    FinishReason,
    GenerationRequest,
    NoWeightsError,
    check_job,
    engine_state,
)
from services.rollout.torch.continuous import ContinuousBatch
from services.rollout.torch.decoder import unsupported_reason
from services.rollout.torch.engine_weights import EngineWeights
from services.rollout.torch.model import decode_batch, decode_path
from services.rollout.torch.requests import (
    LiveRequests,
    LoadedModel,
    Row,
    WeightUpdate,
    admissible,
    record_tokens,
    validate_request,
)

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.1
"""How long the idle worker sleeps between checks of its stop flag."""
AUTO_BUDGET_SAMPLES = 64
"""max_batch_tokens=0 gives a batch the KV cache of this many samples of the model's full length."""
_UNKNOWN_POSITIONS = 4096
"""The length assumed for that budget when a model's config names no maximum."""
_AUTO_POSITIONS_CAP = 2048
"""The full length counted at most for that budget: a model of 8k or 128k positions would otherwise
let 256 short samples hold tens of GB of KV cache on a laptop (set max_batch_tokens for more)."""


class TorchEngine(EngineWeights):
    """Batched generation on a worker thread; thread-safe entry points. An ``Engine``."""

    backend = "torch"

    def __init__(
        self,
        *,
        device: torch.device,
        dtype: torch.dtype | None,
        max_batch_size: int,
        batch_wait_s: float,
        max_prefill_tokens: int = 4096,
        default_update_mode: int = rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE,
        compile_decode: bool = False,
        max_batch_tokens: int = 0,
    ) -> None:
        self.device = device
        self.dtype = dtype
        """The dtype it serves weights in; None: each checkpoint's own (``model.load_model``)."""
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        """How long an idle engine waits for its batch to fill once a request is queued."""
        self.max_batch_tokens = max_batch_tokens
        """Most KV positions of a batch (samples x the longest need); 0: ``token_budget``'s default."""
        self.max_prefill_tokens = max_prefill_tokens
        self.compile_decode = compile_decode
        self.threads = torch.get_num_threads()
        """Torch threads of the worker, which alone runs parallel torch ops (see serial_torch)."""
        self._batch: ContinuousBatch | None = None
        """The running batch of the fast path (worker thread only); None when idle or static."""
        self._static_model: LoadedModel | None = None
        """The loaded model known to need the static path."""
        self.default_update_mode = default_update_mode
        self._cond = threading.Condition(threading.RLock())
        self._live = LiveRequests()
        self._running: list[Row] = []
        self._loaded: LoadedModel | None = None
        self._version = -1
        self._job_id = ""
        self._model_dir = ""
        self._pending: WeightUpdate | None = None
        self._loading = 0
        self._paused = False
        self._draining = False
        self._stopping = False
        self._token_counter: Callable[[int], None] | None = None
        """Where each decode step's tokens are counted (``count_tokens``); None: nowhere."""
        self._worker = threading.Thread(target=self._work, name="engine-worker", daemon=True)

    # -- lifecycle ---------------------------------------------------------

    def describe(self) -> str:
        return str(self.device)

    def start(self) -> None:
        self._worker.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the worker; every unfinished request gets its tokens so far, marked ABORT."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._abort_ids((), all_requests=True)
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

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

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
                raise NoWeightsError(NO_WEIGHTS)
            check_job(request, self._job_id)
            validate_request(request, self._loaded)
            stop_ids = request.config.stop_token_ids
            if not request.config.ignore_eos:
                stop_ids = stop_ids | self._loaded.eos_token_ids
            self._live.add(request, stop_ids)
            self._cond.notify_all()

    async def abort(self, request_ids: Iterable[str] = (), *, all_requests: bool = False) -> int:
        """Mark live requests aborted by id (or all of them); returns how many were hit.

        Queued samples finish at once (no tokens); running ones at the next decode step,
        with the tokens they have.
        """
        return self._abort_ids(request_ids, all_requests=all_requests)

    def _abort_ids(self, request_ids: Iterable[str], *, all_requests: bool) -> int:
        with self._cond:
            targets = self._live.matching(request_ids, all_requests=all_requests)
            self._abort_locked(targets)
            return len(targets)

    def cancel(self, request: GenerationRequest) -> None:
        """Abort one request object (its caller went away)."""
        with self._cond:
            if request.unfinished:
                self._abort_locked({request})

    def _abort_locked(self, targets: set[GenerationRequest]) -> None:
        self._live.abort(targets)
        self._cond.notify_all()

    async def pause(self, *, abort_inflight: bool) -> int:
        """Stop starting batches and hold running ones; optionally abort what is in flight."""
        with self._cond:
            self._paused = True
            self._cond.notify_all()
        return self._abort_ids((), all_requests=True) if abort_inflight else 0

    async def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def status(self) -> EngineStatus:
        with self._cond:
            running = [r for r in self._running if r.finish is None]
            running_requests = {id(r.request) for r in running}
            queued_requests = {id(r.request) for r in self._live.queue} - running_requests
            outstanding = sum(r.request.config.max_new_tokens - len(r.tokens) for r in running)
            outstanding += sum(r.request.config.max_new_tokens for r in self._live.queue)
            state = engine_state(
                serving=self._loaded is not None,
                draining=self._draining,
                loading=bool(self._loading) or self._pending is not None,
                paused=self._paused,
            )
            path, reason = decode_path(self._loaded.model) if self._loaded is not None else ("", "")
            return EngineStatus(
                state=state,
                policy_version=self._version,
                job_id=self._job_id,
                model_dir=self._model_dir,
                running_requests=len(running_requests),
                queued_requests=len(queued_requests),
                outstanding_tokens=outstanding,
                decode_path=path,
                decode_path_reason=reason,
            )

    def token_budget(self, loaded: LoadedModel) -> int:
        """The KV positions a batch of ``loaded`` may hold: max_batch_tokens, or when 0 the cache
        of AUTO_BUDGET_SAMPLES samples of the model's full length."""
        if self.max_batch_tokens:
            return self.max_batch_tokens
        return AUTO_BUDGET_SAMPLES * min(loaded.max_positions or _UNKNOWN_POSITIONS, _AUTO_POSITIONS_CAP)

    # -- the worker ----------------------------------------------------------

    def _work(self) -> None:
        torch.set_num_threads(self.threads)
        try:
            self._work_until_stopped()
        except Exception:
            log.exception("the engine worker died")
            raise
        finally:
            with self._cond:
                self._stopping = True
            self._fail_pending()
            self._abort_ids((), all_requests=True)

    def _work_until_stopped(self) -> None:
        while True:
            loaded = self._loaded
            if loaded is not None and self._fast_path(loaded) is None:
                if not self._static_iteration():
                    return
            elif not self._continuous_iteration():
                return

    def _fast_path(self, loaded: LoadedModel) -> ContinuousBatch | None:
        """The continuous batch for ``loaded``, or None when its architecture needs the static path."""
        batch = self._batch
        if batch is not None and (batch.loaded is loaded or batch.rows):
            return batch  # a new model waits for the batch to drain (see _take_update)
        if self._static_model is loaded:
            return None
        if unsupported_reason(loaded.model) is not None:  # load_model logged why
            self._static_model, self._batch = loaded, None
            return None
        self._batch = ContinuousBatch(
            loaded,
            capacity=self.max_batch_size,
            device=self.device,
            compile_step=self.compile_decode,
            max_tokens=self.token_budget(loaded),
        )
        return self._batch

    def _continuous_iteration(self) -> bool:
        """Update, retire, admit, decode once; False when the engine stops."""
        batch = self._batch
        live = batch.rows if batch is not None else []
        update = self._take_update(live)
        if update is not None:
            self._apply(update)
        with self._cond:
            self._live.finish_aborted(live, stopping=self._stopping)
            if self._stopping:
                return False
        if batch is not None:
            batch.retire()
        if batch is not None and not batch.rows and self._limits_changed(batch):
            self._batch = batch = None  # new slots next time
        with self._cond:
            if self._paused or self._loaded is None:
                self._running = list(live)
                self._cond.wait(_IDLE_WAIT_S)
                return True
            if batch is None:
                admitted = self._take_rows(0, self.max_batch_size, 0)
            else:
                longest = batch.longest if self._live.queue else 0  # a walk over the rows: only when needed
                admitted = self._take_rows(len(live), batch.free, longest)
            self._running = list(live) + admitted
        if not admitted and not live:
            return True
        batch = self._fast_path(self._loaded)
        assert batch is not None
        try:
            self._advance(batch, admitted)
        except Exception as err:  # the batch fails; the engine keeps serving
            log.exception("generation failed for a batch of %d samples", len(batch.rows) + len(admitted))
            with self._cond:
                for row in [*batch.rows, *admitted]:
                    self._live.finish(row, common_pb2.FINISH_REASON_ERROR, f"{type(err).__name__}: {err}")
            self._batch = None
        return True

    def _limits_changed(self, batch: ContinuousBatch) -> bool:
        """Whether max_batch_size or the token budget changed since ``batch`` was built."""
        return batch.capacity != self.max_batch_size or batch.max_tokens != self.token_budget(batch.loaded)

    def _advance(self, batch: ContinuousBatch, admitted: list[Row]) -> None:
        """Prefill ``admitted`` into ``batch`` and sample their first tokens, then decode one step."""
        tokenizer = batch.loaded.tokenizer
        version = self._version
        if admitted:
            tokens, logprobs = batch.admit(admitted)
            self.sampled(
                record_tokens(admitted, tokens, logprobs, version=version, tokenizer=tokenizer, hooks=self)
            )
            batch.retire()
        if batch.rows:
            rows = batch.rows
            tokens, logprobs = batch.step()
            self.sampled(
                record_tokens(rows, tokens, logprobs, version=version, tokenizer=tokenizer, hooks=self)
            )

    def _take_rows(self, live: int, free: int, longest: int) -> list[Row]:
        """Queued rows that fit the free slots, the token budget and the prefill budget (under
        the lock); ``longest``: the largest KV need of the ``live`` rows.

        An idle engine waits up to batch_wait_s for the batch to fill (as many samples as fit,
        or more than fit, are queued); a busy one takes what is queued now, so nobody waits for a
        batch to end.
        """
        if self._pending is not None and self._pending.model is not None:
            if not live:
                self._cond.wait(_IDLE_WAIT_S)
            return []  # a new architecture is installed once the batch drains
        assert self._loaded is not None
        budget = self.token_budget(self._loaded)
        if not live:
            if not self._live.queue:
                self._cond.wait(_IDLE_WAIT_S)
                return []
            self._wait_for_a_full_batch(free, budget)
            if self._stopping or self._paused:
                return []
        return self._live.take(free, self.max_prefill_tokens, live=live, longest=longest, max_tokens=budget)

    def _wait_for_a_full_batch(self, free: int, budget: int) -> None:
        """Wait (under the lock) up to batch_wait_s, until the queue fills ``free`` slots or
        ``budget`` KV positions, or the engine stops or pauses."""
        deadline = time.monotonic() + self.batch_wait_s
        while not (self._stopping or self._paused):
            queue = self._live.queue
            fitting = admissible(queue, free, max_tokens=budget)
            left = deadline - time.monotonic()
            if fitting >= free or fitting < len(queue) or left <= 0:
                return
            self._cond.wait(left)

    def _static_iteration(self) -> bool:
        """The static path: one whole batch on transformers' forward; False when stopping."""
        update = self._take_update([])
        if update is not None:
            self._apply(update)
        with self._cond:
            if self._stopping:
                return False
            rows = self._take_batch()
            self._running = rows
        if rows:
            self._run_batch(rows)
            with self._cond:
                self._running = []
        return True

    def _take_batch(self) -> list[Row]:
        """Queued rows that fit max_batch_size and the token budget, once they fill it or
        batch_wait_s has passed."""
        if self._paused or self._loaded is None or not self._live.queue or self._pending is not None:
            self._cond.wait(_IDLE_WAIT_S)
            return []
        budget = self.token_budget(self._loaded)
        self._wait_for_a_full_batch(self.max_batch_size, budget)
        if self._paused or self._stopping or self._pending is not None:
            return []
        count = admissible(self._live.queue, self.max_batch_size, max_tokens=budget)
        return [self._live.queue.popleft() for _ in range(count)]

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
                        self._live.finish(row, common_pb2.FINISH_REASON_ERROR, f"{type(err).__name__}: {err}")

    # -- hooks the backend calls during a batch (worker thread) -----------------

    def current_version(self) -> int:
        """The policy version that the next sampled tokens belong to."""
        return self._version

    def after_step(self, live: list[Row]) -> None:
        """Between decode steps: finish aborted rows, apply weight updates, hold while paused."""
        while True:
            with self._cond:
                self._live.finish_aborted(live, stopping=self._stopping)
            update = self._take_update(live)
            if update is not None:
                self._apply(update)
            with self._cond:
                if not self._paused or self._stopping or all(r.finish is not None for r in live):
                    return
                self._cond.wait(_IDLE_WAIT_S)

    def count_tokens(self, counter: Callable[[int], None]) -> None:
        """Report the tokens of each decode step to ``counter`` (a ``TokenCountingEngine``)."""
        self._token_counter = counter

    def sampled(self, count: int) -> None:
        """``count`` tokens were sampled in one step (worker thread): counted as they are made."""
        counter = self._token_counter
        if counter is not None and count:
            counter(count)

    def finish(self, row: Row, reason: FinishReason, error: str = "") -> None:
        """Complete one sample (thread-safe); called by the backend when a row stops."""
        with self._cond:
            self._live.finish(row, reason, error)
