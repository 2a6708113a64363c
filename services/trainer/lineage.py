"""One trainer's line of weights for a job: its epoch, the weights-only handles it publishes
for the engines, its durable checkpoints, and the trajectories those hold unacked.

The invariant (docs/architecture.md, "Weights, checkpoints, exactly once"): a trajectory is
acked only once a durable checkpoint covers it; a trainer starting on a job resumes from the
newest durable checkpoint (or the base model) as a new epoch, so weights it publishes are
named by (epoch, version) even when it reissues a version number; trajectories whose tokens
can only come from a lost lineage are dropped (``foreign``), never trained as if sampled by
this lineage's weights of the same number.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from services.common.bus import Bus, Delivery
from services.common.config import JobSpec
from services.common.consumer import StreamConsumer
from services.common.pb import common_pb2
from services.common.streams import JobStreams
from services.trainer.checkpoints import BaseWeights, CheckpointStore, PublishedWeights, SavedCheckpoint
from services.trainer.collector import Group, TrainedWindow
from services.trainer.transport import FilesystemTransport, WeightTransport

log = logging.getLogger(__name__)

Trajectory = common_pb2.Trajectory
CheckpointHandle = common_pb2.CheckpointHandle


def entry_order(entry_id: str) -> tuple[int, int]:
    """A Redis stream entry id (``ms-seq``) as a sortable pair: the order entries were added."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Lineage:
    """Publishes, checkpoints and acks for one JobRun (blocking writes run in threads)."""

    def __init__(
        self, bus: Bus, job_id: str, spec: JobSpec, transport: WeightTransport | None = None
    ) -> None:
        trainer = spec.trainer
        self.bus = bus
        self.transport = transport or FilesystemTransport()
        self.streams = JobStreams(job_id)
        self.store = CheckpointStore(Path(trainer.checkpoint_dir), job_id, trainer.keep_checkpoints)
        self.spec = spec
        self.epoch = 0
        self.start_version = 0
        """The version this epoch began at (its durable checkpoint's, or 0)."""
        self.start_entry = "0-0"
        """The checkpoints-stream entry of this epoch's first handle."""
        self.window = TrainedWindow(trainer.keep_checkpoints)
        self.published: PublishedWeights | None = None
        self.durable: SavedCheckpoint | None = None
        self.base: BaseWeights | None = None
        """A LoRA job's base model: every handle it publishes is an adapter of it."""
        self._held: list[Delivery[Trajectory]] = []
        """Trained since the newest durable checkpoint: unacked until the next one."""
        self._durable_at = time.monotonic()
        self._last_entry = "0-0"
        self._publishing: asyncio.Future[tuple[PublishedWeights, float]] | None = None
        """The publication written beside training (``publish_beside``), until ``flush``."""

    @property
    def durable_version(self) -> int:
        return int(self.durable.handle.version) if self.durable is not None else 0

    async def begin(
        self,
        resumed: SavedCheckpoint | None,
        write_model: Callable[[Path], None],
        write_base: Callable[[Path], None] | None = None,
    ) -> None:
        """Start a new epoch: at ``resumed`` (its handle republished under the new epoch), or at
        v0 of the base model (``write_model`` writes it). A LoRA job's base model is written
        first (``write_base``) unless an earlier epoch wrote it."""
        newest = await self.bus.latest(self.streams.checkpoints, CheckpointHandle)
        earlier = max(newest.epoch if newest else 0, resumed.handle.epoch if resumed else 0)
        self.epoch = earlier + 1
        if self.spec.model.lora is not None:
            if write_base is None:
                raise ValueError("a LoRA job needs its base model written")
            self.base = await asyncio.to_thread(self.store.ensure_base, self.spec.model.dtype, write_base)
        if resumed is None:
            await self.publish(0, write_model, write_model)
            self.start_entry = self._last_entry
            return
        self.durable = resumed
        self.start_version = int(resumed.handle.version)
        for saved in self.store.durable_checkpoints()[-self.store.keep :]:
            self.window.seal(saved.since_version, saved.consumed)
        handle = CheckpointHandle()
        handle.CopyFrom(resumed.handle)
        handle.durable, handle.epoch = False, self.epoch
        if self.base is not None:
            handle.adapter.CopyFrom(self.base.to_proto())
        handle.created_at.GetCurrentTime()
        self.published = PublishedWeights(handle, resumed.directory, 0)
        self.start_entry = await self.bus.publish(self.streams.checkpoints, handle)

    async def publish(
        self, version: int, write_model: Callable[[Path], None], write_weights: Callable[[Path], None]
    ) -> PublishedWeights:
        """Write weights-only ``version`` and announce its handle to the engines: the whole HF
        directory at first, then ``write_weights``' model.safetensors beside the previous files."""
        dtype, previous = self.spec.model.dtype, self.published
        like = previous.directory if previous is not None else None
        write = write_weights if like is not None else write_model
        published = await asyncio.to_thread(
            self.store.publish_weights, version, self.epoch, dtype, write, like, self.base
        )
        # A first version is a new model for the engines: only its files will do. An adapter's
        # few bytes go as files too (an engine merges them into its copy of the base).
        broadcast = like is not None and self.base is None
        announced = await self.transport.announce(published) if broadcast else published.handle
        self._last_entry = await self.bus.publish(self.streams.checkpoints, announced)
        self.transport.deliver(announced)
        self.published = published
        return published

    def publish_beside(
        self, version: int, write_weights: Callable[[Path], None]
    ) -> asyncio.Future[tuple[PublishedWeights, float]]:
        """``publish`` while the trainer goes on (``write_weights`` writes a snapshot, not the
        live weights); the previous publication must be out (``flush``), so handles go out in
        order and each version's files are linked from the one before. The future gives the
        publication and its seconds."""
        if self._publishing is not None and not self._publishing.done():
            raise RuntimeError(f"publication of v{version} started before the previous one was out")
        if self.published is None:
            raise RuntimeError(f"v{version} has no earlier version to link its model files from")

        async def timed() -> tuple[PublishedWeights, float]:
            started = time.monotonic()
            published = await self.publish(version, write_weights, write_weights)
            return published, time.monotonic() - started

        self._publishing = asyncio.ensure_future(timed())
        return self._publishing

    async def flush(self) -> None:
        """Wait for the publication written beside training, if any (its error is raised here)."""
        if self._publishing is not None:
            await self._publishing
            self._publishing = None

    def hold(self, deliveries: Sequence[Delivery[Trajectory]], trained_ids: Sequence[str]) -> None:
        """The step's trajectories are trained: keep them unacked until a durable checkpoint."""
        self._held.extend(deliveries)
        self.window.add(trained_ids)

    def held_entry_ids(self) -> list[str]:
        return [delivery.entry_id for delivery in self._held]

    def durable_due(self, version: int) -> bool:
        """Whether the step that made ``version`` ends with a durable checkpoint."""
        trainer = self.spec.trainer
        seconds = trainer.checkpoint_every_seconds
        return (
            version >= trainer.steps
            or version % trainer.checkpoint_every_steps == 0
            or (seconds is not None and time.monotonic() - self._durable_at >= seconds)
        )

    async def save_durable(
        self, write_state: Callable[[Path], None], consumer: StreamConsumer[Trajectory] | None
    ) -> SavedCheckpoint | None:
        """A durable checkpoint of the published weights, then the acks of what it covers;
        None when the newest durable checkpoint (or the base model) already holds them."""
        await self.flush()  # the durable checkpoint links the published version's files
        published = self.published
        if published is None or (published.handle.version == self.durable_version and not self._held):
            return None  # still loading, or nothing trained since
        since = self.durable_version
        saved = await asyncio.to_thread(
            self.store.save_durable, published, write_state, self.window.since_durable(), since
        )
        self.durable = saved
        self.window.seal(since)
        if consumer is not None:
            await consumer.ack(self._held)
        self._held = []
        self._durable_at = time.monotonic()
        log.info(
            "job %s: durable checkpoint v%d (epoch %d, %d trajectories since v%d) in %s",
            *(self.store.job_id, published.handle.version, self.epoch, len(saved.consumed), since),
            saved.directory,
        )
        return saved

    def foreign(self, group: Group, version: int) -> bool:
        """Whether ``group`` cannot have been sampled by this lineage's weights, or is older
        than the de-duplication window (collector.TrainedWindow says why that is safe)."""
        newest = group.newest_version
        if newest is None:
            return False
        if newest > version:
            return True  # ahead of this trainer: a lost lineage's version number
        if newest < self.window.floor:
            return True  # could be a copy of a trajectory trained before the window
        # Added before this epoch began, with a version this epoch reissues: the lost lineage's.
        start = entry_order(self.start_entry)
        added_before = any(entry_order(d.entry_id) < start for d in group.deliveries)
        return newest > self.start_version and added_before
