"""How the torch engine takes new weights: a caller's thread reads and verifies them (or brings
tensors received over a weight group) and stages one ``WeightUpdate``; the worker installs it
between decode steps (``_take_update``, ``_apply``), and the caller waits until it serves.
A mixin of ``engine.TorchEngine``, whose lock and fields it shares."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.common.long_lived import freeze_long_lived_objects
from services.common.pb import common_pb2, rollout_pb2
from services.rollout.engine_protocol import EngineStoppedError, GenerationRequest, ServedWeights
from services.rollout.torch.adapters import read_adapter_update
from services.rollout.torch.model import read_update, serial_torch
from services.rollout.torch.requests import LiveRequests, LoadedModel, Row, WeightUpdate
from services.rollout.weights import CheckpointError, copy_into_model


class EngineWeights:
    """Staging and installing weight updates (see the module doc)."""

    receives_state_dicts = True
    device: torch.device
    dtype: torch.dtype | None
    default_update_mode: int
    _cond: threading.Condition
    _live: LiveRequests
    _loaded: LoadedModel | None
    _pending: WeightUpdate | None
    _loading: int
    _stopping: bool
    _version: int
    _job_id: str
    _model_dir: str

    if TYPE_CHECKING:

        def _abort_locked(self, targets: set[GenerationRequest]) -> None: ...

    async def load_weights(
        self, path: Path, *, sha256: str, version: int, job_id: str, mode: int, timeout_s: float
    ) -> ServedWeights:
        """``load_checkpoint`` off the event loop."""
        update = await asyncio.to_thread(
            self.load_checkpoint,
            path,
            sha256=sha256,
            version=version,
            job_id=job_id,
            mode=mode,
            timeout_s=timeout_s,
        )
        return ServedWeights(update.version, update.job_id, update.path, update.mode, update.aborted_requests)

    def load_checkpoint(
        self, path: Path, *, sha256: str, version: int, job_id: str, mode: int, timeout_s: float
    ) -> WeightUpdate:
        """Verify and stage a checkpoint, then wait until the worker serves it (blocking).

        Raises CheckpointError for a bad checkpoint, TimeoutError if the worker did not take
        it within ``timeout_s``. Callers serialize loads.
        """
        update = WeightUpdate(version=version, job_id=job_id, path=path, mode=self._mode(mode))

        def read(current: LoadedModel | None) -> None:
            with serial_torch():  # off the worker: its team of OpenMP threads must stay the only one
                read_update(update, sha256, current=current, device=self.device, dtype=self.dtype)

        return self._install(update, timeout_s, read)

    async def load_adapter(
        self,
        path: Path,
        *,
        sha256: str,
        base: Path,
        base_sha256: str,
        version: int,
        job_id: str,
        mode: int,
        timeout_s: float,
    ) -> ServedWeights:
        """Serve the LoRA adapter in ``path`` applied to the base model in ``base`` (adapters.py:
        merged from the pristine base off the worker, copied in between decode steps)."""
        update = WeightUpdate(version=version, job_id=job_id, path=path, mode=self._mode(mode))

        def read(current: LoadedModel | None) -> None:
            with serial_torch():
                read_adapter_update(
                    update, sha256, base, base_sha256, current=current, device=self.device, dtype=self.dtype
                )

        update = await asyncio.to_thread(self._install, update, timeout_s, read)
        return ServedWeights(update.version, update.job_id, update.path, update.mode, update.aborted_requests)

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
        """Copy tensors received over a weight group into the job's live model, between decode
        steps, as a checkpoint's state dict is (``copy_into_model`` checks every name and shape)."""
        update = WeightUpdate(version=version, job_id=job_id, path=path, mode=self._mode(mode))
        update.state_dict = dict(state)

        def check(current: LoadedModel | None) -> None:
            if current is None or self._job_id != job_id:
                served = self._job_id or "no job"
                raise CheckpointError(f"the engine serves {served}: a state dict needs job {job_id}'s model")

        update = await asyncio.to_thread(self._install, update, timeout_s, check)
        return ServedWeights(update.version, update.job_id, update.path, update.mode, update.aborted_requests)

    def _mode(self, mode: int) -> int:
        return self.default_update_mode if mode == rollout_pb2.WEIGHT_UPDATE_MODE_UNSPECIFIED else mode

    def _install(
        self, update: WeightUpdate, timeout_s: float, prepare: Callable[[LoadedModel | None], None]
    ) -> WeightUpdate:
        """``prepare(current model)`` the update, then wait until the worker serves it (blocking)."""
        with self._cond:
            self._loading += 1
            current = self._loaded
        try:
            prepare(current)
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
                update.done.wait()  # the worker is applying it right now
            if update.error is not None:
                raise update.error
            return update
        finally:
            with self._cond:
                self._loading -= 1

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
                    self._live.finish(row, common_pb2.FINISH_REASON_ABORT)
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
                copy_into_model(self._loaded.model, update.state_dict, partial=update.partial)
                new_model = self._loaded
        except Exception as err:  # whatever went wrong, the waiting caller hears of it
            update.error = (
                err if isinstance(err, CheckpointError) else CheckpointError(f"{type(err).__name__}: {err}")
            )
            update.done.set()
            return
        if update.model is not None:
            freeze_long_lived_objects()  # a new model lives until the next one
        with self._cond:
            self._loaded = new_model
            self._version = update.version
            self._job_id = update.job_id
            self._model_dir = str(update.path)
        update.state_dict = None
        update.done.set()
