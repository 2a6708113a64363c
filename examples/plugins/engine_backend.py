"""An engine backend of one's own: Hugging Face transformers' ``model.generate()`` behind verst's
``Engine`` protocol (services/rollout/engine_protocol.py).

    VERST_ENGINE_BACKEND=examples.plugins.engine_backend:open_engine python -m services.rollout

Written as a user would write it, against the contract alone: the protocol and its exceptions,
the request's ``SamplingConfig``, and the checkpoint helpers of services/rollout/weights.py. It
is simpler and slower than verst's torch backend: one request at a time (its ``n`` samples as
one batch of ``generate()``), no continuous batching, no weight groups (checkpoint files only),
and a streaming request gets each sample whole when it ends.

What the contract asks, and how this backend gives it:

- Token in, token out: the prompt's token ids go to ``generate()`` as they are; each sample
  comes back as its new token ids, the stop token included (STOP), or cut at
  ``max_new_tokens`` (LENGTH), or where an abort caught it (ABORT, with the tokens so far).
- Each token's logprob is log-softmax of the *raw* logits (``output_logits=True``: before
  temperature, top-k, top-p or min-p), what the trainer computes for the same weights.
- Every token carries the policy version of the weights that produced it. A checkpoint of the
  same architecture is copied into the live model between two decode steps (a
  ``StoppingCriteria`` is this backend's hook after every step), so the tokens after it carry
  the new version; a new architecture waits until the request in flight ends. Mode ABORT ends
  the request in flight instead, and counts it.
- Weights come only from a verified checkpoint: ``read_verified_state_dict`` hashes and
  decodes the same bytes, ``copy_into_model`` checks every name and shape before it copies.
- ``submit`` raises NoWeightsError, WrongJobError, EngineStoppedError or ValueError (bad
  input), which the Rollout servicer answers as FAILED_PRECONDITION, FAILED_PRECONDITION,
  UNAVAILABLE and INVALID_ARGUMENT; ``load_weights`` raises CheckpointError, TimeoutError or
  EngineStoppedError. A failure inside ``generate()`` ends the request's samples as ERROR.
- Pause holds the request in flight between decode steps (or aborts it); close ends every
  unfinished request as ABORT.

Greedy requests are deterministic; a seeded request is reproducible on this backend (its
samples draw from one generator seeded with the request's seed, not from per-sample streams as
in the torch backend, so the same seed gives other tokens there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)

from services.common.pb import common_pb2, rollout_pb2
from services.common.plugins import traits
from services.rollout.config import EngineSettings
from services.rollout.engine_protocol import (
    NO_WEIGHTS,
    Completion,
    EngineStatus,
    EngineStoppedError,
    FinishReason,
    GenerationRequest,
    NoWeightsError,
    ServedWeights,
    WrongJobError,
    check_job,
    engine_state,
)
from services.rollout.weights import CheckpointError, copy_into_model, read_config, read_verified_state_dict

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1
"""How long the idle worker (or a paused request) sleeps between looks at its flags."""
CLOSE_TIMEOUT_S = 30.0
"""How long ``close`` waits for the worker to end the step in flight and stop."""


@dataclass(eq=False)
class LoadedModel:
    """A model ready to serve and what requests are checked against."""

    model: torch.nn.Module
    config: dict[str, Any]
    """The checkpoint's config.json (``read_config``): equal configs share an architecture."""
    tokenizer: Any | None
    vocab_size: int
    max_positions: int
    eos_token_ids: frozenset[int]
    pad_token_id: int


@dataclass(eq=False)
class WeightUpdate:
    """A verified checkpoint waiting for the worker, which installs it between decode steps."""

    version: int
    job_id: str
    path: Path
    mode: int
    state_dict: dict[str, torch.Tensor]
    config: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None
    aborted_requests: int = 0


@dataclass(eq=False)
class Sample:
    """Where one sample of the request in flight ended: its token count and why (None: running)."""

    length: int = 0
    finish: FinishReason | None = None


def token_ids(value: object) -> set[int]:
    """A config's eos_token_id (None, an int, or a list) as a set."""
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}  # type: ignore[union-attr]


def resolve_device(name: str) -> torch.device:
    """VERST_ENGINE_DEVICE: ``auto`` is the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_model(
    path: Path, update: WeightUpdate, *, device: torch.device, dtype: torch.dtype | None
) -> LoadedModel:
    """A model of the checkpoint's architecture holding the verified tensors of ``update``, in
    ``dtype`` (None: the dtype the checkpoint's weights were saved in)."""
    if dtype is None:
        floating = (t.dtype for t in (update.state_dict or {}).values() if t.is_floating_point())
        dtype = next(floating, torch.float32)
    try:
        config = AutoConfig.from_pretrained(path)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"cannot build a model from {path}: {err}") from err
    copy_into_model(model, update.state_dict)
    model = model.to(device).eval()
    eos = token_ids(config.eos_token_id)
    with contextlib.suppress(OSError):  # OSError: no generation_config.json
        eos |= token_ids(GenerationConfig.from_pretrained(path).eos_token_id)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        tokenizer = None  # token in, token out needs none; stop strings do
    # generate() fills what a request leaves unset from the model's generation config: start
    # from a neutral one, so every sampling setting comes from the request.
    model.generation_config = GenerationConfig()
    pad = getattr(config, "pad_token_id", None)
    return LoadedModel(
        model=model,
        config=update.config,
        tokenizer=tokenizer,
        vocab_size=int(model.get_input_embeddings().num_embeddings),
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
        eos_token_ids=frozenset(eos),
        pad_token_id=int(pad if pad is not None else min(eos, default=0)),
    )


def validate(request: GenerationRequest, loaded: LoadedModel) -> None:
    """Raise ValueError (INVALID_ARGUMENT) for a request ``loaded`` cannot serve."""
    prompt, config = request.prompt, request.config
    if not prompt:
        raise ValueError("prompt_token_ids is empty")
    bad = [t for t in [*prompt, *config.stop_token_ids] if not 0 <= t < loaded.vocab_size]
    if bad:
        raise ValueError(f"token ids outside the vocabulary [0, {loaded.vocab_size}): {bad[:5]}")
    total = len(prompt) + config.max_new_tokens
    if loaded.max_positions and total > loaded.max_positions:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({config.max_new_tokens}) = {total} "
            f"exceeds the model's {loaded.max_positions} positions"
        )
    if config.stop and loaded.tokenizer is None:
        raise ValueError("stop strings need a tokenizer in the checkpoint; use stop_token_ids")


def generation_config(request: GenerationRequest, loaded: LoadedModel) -> GenerationConfig:
    """The request's sampling as generate() takes it. Stops are this backend's own (``StepHook``):
    generate() gets no eos token, and stops a sample when the hook says so."""
    config = request.config
    settings: dict[str, Any] = {
        "max_new_tokens": config.max_new_tokens,
        "pad_token_id": loaded.pad_token_id,
        "eos_token_id": None,
        "output_logits": True,  # the raw logits of every step, before any warper
        "return_dict_in_generate": True,
        "use_cache": True,
    }
    if config.greedy:
        return GenerationConfig(do_sample=False, **settings)
    return GenerationConfig(
        do_sample=True,
        temperature=config.temperature,
        top_k=config.top_k,  # 0: off
        top_p=config.top_p,
        min_p=config.min_p or None,
        **settings,
    )


class StepHook(StoppingCriteria):
    """Called by generate() after every decode step: records which version made the step's
    tokens and where each sample stops, then lets the engine act between steps (weights,
    pause, abort). Returns, per sample, whether it is done."""

    def __init__(self, engine: GenerateEngine, request: GenerationRequest, loaded: LoadedModel) -> None:
        self.engine = engine
        self.request = request
        self.loaded = loaded
        self.prompt_length = len(request.prompt)
        config = request.config
        self.stop_ids = config.stop_token_ids | (frozenset() if config.ignore_eos else loaded.eos_token_ids)
        self.tail = 2 * max(map(len, config.stop)) + 8 if config.stop else 1
        """Tokens enough to hold any stop string: a stop can only end in the newest token."""
        self.samples = [Sample() for _ in range(config.n)]
        self.versions: list[int] = []
        """The policy version of each step's tokens."""

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        step = input_ids.shape[1] - self.prompt_length
        self.versions.append(self.engine.current_version())
        if step == 1:
            self.request.first_token_at = time.monotonic()
        tails = input_ids[:, -min(self.tail, step) :].tolist()
        for sample, tail in zip(self.samples, tails, strict=True):
            if sample.finish is None:
                reason = self._finish_reason(tail, step)
                if reason is not None:
                    sample.length, sample.finish = step, reason
        if self.engine.between_steps(self.request, step):  # aborted, or the engine stops
            for sample in self.samples:
                if sample.finish is None:
                    sample.length, sample.finish = step, common_pb2.FINISH_REASON_ABORT
        done = [sample.finish is not None for sample in self.samples]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]

    def _finish_reason(self, tail: list[int], step: int) -> FinishReason | None:
        """STOP, LENGTH or None (keep going) for a sample whose newest tokens are ``tail``."""
        config = self.request.config
        if tail[-1] in self.stop_ids:
            return common_pb2.FINISH_REASON_STOP
        if config.stop and self.loaded.tokenizer is not None:
            text = self.loaded.tokenizer.decode(tail)
            if any(stop in text for stop in config.stop):
                return common_pb2.FINISH_REASON_STOP
        if step >= config.max_new_tokens:
            return common_pb2.FINISH_REASON_LENGTH
        return None


class GenerateEngine:
    """An ``Engine`` over ``model.generate()`` on one worker thread; the entry points are
    thread-safe and return at once. State is guarded by one condition variable; the model is
    touched by the worker alone."""

    backend = "hf_generate"
    receives_state_dicts = False

    def __init__(self, *, device: torch.device, dtype: torch.dtype | None, default_update_mode: int) -> None:
        self.device = device
        self.dtype = dtype
        self.default_update_mode = default_update_mode
        self.threads = torch.get_num_threads()
        self._cond = threading.Condition(threading.RLock())
        self._queue: deque[GenerationRequest] = deque()
        self._running: GenerationRequest | None = None
        self._running_steps = 0
        self._loaded: LoadedModel | None = None
        self._version = -1
        self._job_id = ""
        self._model_dir = ""
        self._pending: WeightUpdate | None = None
        self._loading = 0
        self._paused = False
        self._draining = False
        self._stopping = False
        self._worker = threading.Thread(target=self._work, name="generate-worker", daemon=True)

    # -- lifecycle -----------------------------------------------------------------------

    def describe(self) -> str:
        return f"transformers generate() on {self.device}"

    def start(self) -> None:
        self._worker.start()

    def set_draining(self) -> None:
        with self._cond:
            self._draining = True

    async def close(self) -> None:
        """End every unfinished request as ABORT and stop the worker (within CLOSE_TIMEOUT_S)."""
        with self._cond:
            self._stopping = True
            self._abort_locked(set(self._queue) | ({self._running} if self._running else set()))
            self._cond.notify_all()
        if self._worker.is_alive():
            await asyncio.to_thread(self._worker.join, CLOSE_TIMEOUT_S)
            if self._worker.is_alive():
                log.warning("the generate worker did not stop within %.0fs", CLOSE_TIMEOUT_S)
        self._fail_pending(EngineStoppedError("engine is shutting down"))

    def status(self) -> EngineStatus:
        with self._cond:
            running = self._running
            outstanding = sum(r.config.n * r.config.max_new_tokens for r in self._queue)
            if running is not None:
                outstanding += running.config.n * (running.config.max_new_tokens - self._running_steps)
            return EngineStatus(
                state=engine_state(
                    serving=self._loaded is not None,
                    draining=self._draining,
                    loading=bool(self._loading) or self._pending is not None,
                    paused=self._paused,
                ),
                policy_version=self._version,
                job_id=self._job_id,
                model_dir=self._model_dir,
                running_requests=int(running is not None),
                queued_requests=len(self._queue),
                outstanding_tokens=outstanding,
            )

    # -- requests ------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request. Raises EngineStoppedError, NoWeightsError, WrongJobError or ValueError."""
        with self._cond:
            if self._stopping:
                raise EngineStoppedError("engine is shutting down")
            if self._loaded is None:
                raise NoWeightsError(NO_WEIGHTS)
            check_job(request, self._job_id)
            validate(request, self._loaded)
            request.unfinished = request.config.n
            self._queue.append(request)
            self._cond.notify_all()

    def cancel(self, request: GenerationRequest) -> None:
        with self._cond:
            self._abort_locked({request})

    async def abort(self, request_ids: Sequence[str] = (), *, all_requests: bool = False) -> int:
        """Abort requests by id (or all): queued ones end now, without tokens; the one in flight
        at its next decode step, with the tokens it has."""
        with self._cond:
            live = [*self._queue, *([self._running] if self._running else [])]
            wanted = set(request_ids)
            targets = {r for r in live if all_requests or r.request_id in wanted}
            self._abort_locked(targets)
            return len(targets)

    async def pause(self, *, abort_inflight: bool) -> int:
        """Start no request and hold the one in flight between decode steps; or abort them all."""
        with self._cond:
            self._paused = True
            self._cond.notify_all()
        return await self.abort(all_requests=True) if abort_inflight else 0

    async def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def _abort_locked(self, targets: set[GenerationRequest]) -> None:
        for request in targets:
            request.aborted = True
        queued = [r for r in self._queue if r.aborted]
        self._queue = deque(r for r in self._queue if not r.aborted)
        for request in queued:
            for index in range(request.config.n):
                self._deliver(request, Completion(index, [], [], [], common_pb2.FINISH_REASON_ABORT))
        self._cond.notify_all()

    def _deliver(self, request: GenerationRequest, completion: Completion) -> None:
        request.unfinished -= 1
        try:
            request.on_completion(completion)
        except Exception:  # a closed event loop must not kill the worker
            log.exception("could not deliver a completion of request %s", request.request_id)

    # -- weights -------------------------------------------------------------------------

    async def load_weights(
        self, path: Path, *, sha256: str, version: int, job_id: str, mode: int, timeout_s: float
    ) -> ServedWeights:
        """Verify and read the checkpoint, then wait until the worker serves it. Raises
        CheckpointError, TimeoutError or EngineStoppedError."""
        if mode == rollout_pb2.WEIGHT_UPDATE_MODE_UNSPECIFIED:
            mode = self.default_update_mode
        with self._cond:
            self._loading += 1
        try:
            state_dict, config = await asyncio.to_thread(self._read, path, sha256)
            update = WeightUpdate(version, job_id, path, mode, state_dict, config)
            await asyncio.to_thread(self._stage_and_wait, update, timeout_s)
        finally:
            with self._cond:
                self._loading -= 1
        return ServedWeights(version, job_id, path, mode, update.aborted_requests)

    @staticmethod
    def _read(path: Path, sha256: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return read_verified_state_dict(path, sha256), read_config(path)

    def _stage_and_wait(self, update: WeightUpdate, timeout_s: float) -> None:
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
                    raise TimeoutError(
                        f"the engine did not take weights v{update.version} within {timeout_s}s"
                    )
            if not update.done.wait(timeout_s):  # the worker is installing it right now
                raise TimeoutError(f"installing weights v{update.version} took over {timeout_s}s")
        if update.error is not None:
            raise update.error

    def _fail_pending(self, error: Exception) -> None:
        with self._cond:
            update, self._pending = self._pending, None
        if update is not None:
            update.error = error
            update.done.set()

    def _take_update(self, *, between_requests: bool) -> WeightUpdate | None:
        """The pending update if the worker may install it now (under the lock): between two
        requests any; between two steps of a request only one of the same architecture."""
        update = self._pending
        if update is None:
            return None
        same_architecture = self._loaded is not None and update.config == self._loaded.config
        if not (between_requests or same_architecture):
            return None
        self._pending = None
        return update

    def _install(self, update: WeightUpdate) -> None:
        """Serve ``update`` (worker thread): copied into the live model when the architecture is
        the same, else a model of its own."""
        current = self._loaded
        try:
            if current is not None and current.config == update.config:
                copy_into_model(current.model, update.state_dict)
                loaded = current
            else:
                loaded = build_model(update.path, update, device=self.device, dtype=self.dtype)
        except Exception as err:  # whatever went wrong, the waiting caller hears of it
            if not isinstance(err, CheckpointError):
                err = CheckpointError(f"{type(err).__name__}: {err}")
            update.error = err
            update.done.set()
            return
        with self._cond:
            self._loaded = loaded
            self._version = update.version
            self._job_id = update.job_id
            self._model_dir = str(update.path)
        update.state_dict = {}
        update.done.set()

    # -- the worker ----------------------------------------------------------------------

    def current_version(self) -> int:
        """The policy version of the weights that make the next tokens."""
        return self._version

    def between_steps(self, request: GenerationRequest, step: int) -> bool:
        """After decode step ``step`` of ``request``: install a same-architecture update (mode
        ABORT ends the request instead), hold while paused. True when the request must end now."""
        with self._cond:
            self._running_steps = step
        while True:
            with self._cond:
                update = self._pending
                if update is not None and update.mode == rollout_pb2.WEIGHT_UPDATE_MODE_ABORT:
                    if not request.aborted:
                        request.aborted = True
                        update.aborted_requests += 1
                    return True  # the update is installed once the request has ended
                if request.aborted or self._stopping:
                    return True
                update = self._take_update(between_requests=False)
            if update is not None:
                self._install(update)
            with self._cond:
                if not self._paused or self._stopping or request.aborted:
                    return request.aborted or self._stopping
                self._cond.wait(IDLE_WAIT_S)

    def _work(self) -> None:
        torch.set_num_threads(self.threads)
        try:
            while (request := self._next_request()) is not None:
                self._generate(request)
        except Exception:
            log.exception("the generate worker died")
            raise
        finally:
            with self._cond:
                self._stopping = True
                self._abort_locked(set(self._queue))
            self._fail_pending(EngineStoppedError("engine is shutting down"))

    def _next_request(self) -> GenerationRequest | None:
        """The next request to generate, installing updates while none runs; None: stop."""
        while True:
            with self._cond:
                if self._stopping:
                    return None
                update = self._take_update(between_requests=True)
                if update is None:
                    if self._queue and not self._paused:
                        self._running, self._running_steps = self._queue.popleft(), 0
                        return self._running
                    self._cond.wait(IDLE_WAIT_S)
                    continue
            self._install(update)

    def _generate(self, request: GenerationRequest) -> None:
        """Run one request to its end and deliver its samples."""
        loaded = self._loaded
        assert loaded is not None
        try:
            check_job(request, self._job_id)  # the engine may have changed jobs while it was queued
        except WrongJobError as err:
            self._fail(request, err)
            return
        hook = StepHook(self, request, loaded)
        try:
            ids = torch.tensor([request.prompt] * request.config.n, dtype=torch.long, device=self.device)
            with torch.inference_mode(), seeded(request.config.seed, self.device):
                out = loaded.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    generation_config=generation_config(request, loaded),
                    stopping_criteria=StoppingCriteriaList([hook]),
                )
            completions = self._completions(request, hook, out)
        except Exception as err:  # the request fails; the engine keeps serving
            log.exception("generation failed for request %s", request.request_id)
            completions = errored(request, f"{type(err).__name__}: {err}")
        with self._cond:
            self._running = None
            for completion in completions:
                self._deliver(request, completion)

    def _fail(self, request: GenerationRequest, err: Exception) -> None:
        """End a request as a whole: its caller gets ``err`` (the servicer maps it to a status),
        or, without on_error, every sample ends as ERROR."""
        with self._cond:
            self._running = None
            if request.on_error is not None:
                request.unfinished = 0
                request.on_error(err)
                return
            for completion in errored(request, str(err)):
                self._deliver(request, completion)

    def _completions(self, request: GenerationRequest, hook: StepHook, out: Any) -> list[Completion]:
        """Each sample's tokens up to where it ended, their raw logprobs and versions."""
        generated = out.sequences[:, len(request.prompt) :]
        logprobs = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)  # [n, steps, vocab]
        chosen = logprobs.gather(2, generated[:, : logprobs.shape[1]].unsqueeze(-1)).squeeze(-1)
        completions = []
        for index, sample in enumerate(hook.samples):
            length, finish = sample.length, sample.finish
            if finish is None:  # generate() ended without the hook's word: only at max_new_tokens
                length, finish = generated.shape[1], common_pb2.FINISH_REASON_LENGTH
            completions.append(
                Completion(
                    index=index,
                    token_ids=generated[index, :length].tolist(),
                    logprobs=chosen[index, :length].tolist(),
                    policy_versions=hook.versions[:length],
                    finish_reason=finish,
                )
            )
        return completions

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
        """Not supported: this backend takes weights from checkpoint files only."""
        raise CheckpointError("the hf_generate backend loads weights from checkpoint files only")


def errored(request: GenerationRequest, error: str) -> list[Completion]:
    """Every sample of ``request`` ended as ERROR, without tokens."""
    return [Completion(i, [], [], [], common_pb2.FINISH_REASON_ERROR, error) for i in range(request.config.n)]


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Within the block, torch's random numbers come from ``seed`` (None: the shared stream); the
    generator state outside it is left as it was."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


@traits(in_process=True)  # VERST_ENGINE_DEVICE and VERST_ENGINE_TORCH_THREADS apply
async def open_engine(settings: EngineSettings) -> GenerateEngine:
    """``VERST_ENGINE_BACKEND=examples.plugins.engine_backend:open_engine``: a started engine on
    the settings' device and dtype, weights to come from the checkpoints it is given."""
    engine = GenerateEngine(
        device=resolve_device(settings.device),
        dtype=None if settings.dtype == "auto" else getattr(torch, settings.dtype),
        default_update_mode=settings.default_update_mode,
    )
    engine.start()
    return engine
