"""One job, from its claim to its last step: the trainer's loop, top-down.

load (or resume) -> publish v0 -> for each step: collect groups -> advantages ->
optimise -> publish the weights -> every few steps a durable checkpoint, then
ack the trajectories it covers -> metrics.

Trajectories are acked only after a durable checkpoint covers them, so a trainer
killed at any moment loses nothing: its successor resumes from the newest durable
checkpoint as a new epoch (lineage.py), skips what that checkpoint's manifest
consumed, and reclaims the unacked entries.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from services.common.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    STALE_POLICIES,
)
from services.common.bus import Bus, Delivery
from services.common.config import JobSpec
from services.common.consumer import StreamConsumer
from services.common.jobs import TERMINAL_STATES, JobStore
from services.common.leases import renew_every, stop_renewing
from services.common.long_lived import freeze_long_lived_objects
from services.common.pb import common_pb2, trainer_pb2
from services.common.streams import JOBS, TRAINER_GROUP, TRAINERS_GROUP, JobStreams
from services.trainer import distributed, leader
from services.trainer.checkpoints import SavedCheckpoint
from services.trainer.collector import Group, GroupCollector, Outcome, Unusable
from services.trainer.config import TrainerSettings
from services.trainer.critic import CRITIC_DIR, Critic
from services.trainer.filters import ChosenFilter, GroupScores, chosen_filters, first_to_drop
from services.trainer.job_control import CheckpointUnavailable, JobControl, JobStopped, StopKind
from services.trainer.lineage import Lineage
from services.trainer.losses import sample_token_weights
from services.trainer.objective import StepStats
from services.trainer.policy import Policy, deepspeed_config, init_distributed, write_snapshot
from services.trainer.prepare import Prepared, prepare
from services.trainer.reference import ReferenceModel
from services.trainer.report import (
    DropCounts,
    Progress,
    StepTimes,
    stage_metric_values,
    step_metric_values,
    tool_use_rate,
)
from services.trainer.telemetry import TrainerMetrics
from services.trainer.threads import ThreadChoice, candidates, job_threads
from services.trainer.transport import WeightTransport

log = logging.getLogger(__name__)

JOB_GROUP = TRAINERS_GROUP
TRAJECTORY_GROUP = TRAINER_GROUP
NO_MIN_VERSION = -(2**63)
"""Under a stale policy that keeps stale samples (``downweight``) no group is too old to train on."""
Trajectory = common_pb2.Trajectory


def check_supported(spec: JobSpec) -> list[ChosenFilter]:
    """Fail fast, with the field's name, on a JobSpec this trainer cannot honour; its group
    filters, resolved (a user's imported here)."""
    algorithm = spec.algorithm
    ADVANTAGE_ESTIMATORS.get(algorithm.advantage)
    POLICY_LOSSES.get(algorithm.policy_loss)
    KL_ESTIMATORS.get(algorithm.kl_estimator)
    STALE_POLICIES.get(algorithm.stale_policy)
    sample_token_weights([1], algorithm.loss_aggregation, spec.rollout.max_new_tokens)
    deepspeed_config(spec.trainer, spec.model.dtype)
    return chosen_filters(algorithm.filters)


def unique_deliveries(groups: Iterable[Group]) -> list[Delivery[Trajectory]]:
    """Each stream entry of the groups once (a reclaimed entry is delivered twice)."""
    seen: dict[str, Delivery[Trajectory]] = {}
    for group in groups:
        for delivery in group.deliveries:
            seen.setdefault(delivery.entry_id, delivery)
    return list(seen.values())


class JobRun:
    """Trains one job; ``run`` returns after its last step or raises JobStopped or an error."""

    def __init__(
        self,
        *,
        bus: Bus,
        jobs: JobStore,
        settings: TrainerSettings,
        consumer: str,
        job_id: str,
        spec: JobSpec,
        submission_entry_id: str,
        control: JobControl,
        progress: Progress,
        device: torch.device,
        transport: WeightTransport | None = None,
        metrics: TrainerMetrics | None = None,
    ) -> None:
        self.bus = bus
        self.metrics = metrics or TrainerMetrics()
        self.jobs = jobs
        self.settings = settings
        self.consumer = consumer
        self.job_id = job_id
        self.spec = spec
        self.submission_entry_id = submission_entry_id
        self.control = control
        self.progress = progress
        self.device = device
        self.streams = JobStreams(job_id)
        self.lineage = Lineage(bus, job_id, spec, transport)
        self.store = self.lineage.store
        self.collector = GroupCollector(job_id, spec.algorithm.group_size, self.lineage.window)
        self.trajectories: StreamConsumer[Trajectory] | None = None
        self.version = 0
        self.policy: Policy | None = None
        self.reference: ReferenceModel | None = None
        """The frozen base model, when the job has a KL term (algorithm.kl_coef > 0)."""
        self.critic: Critic | None = None
        """The value model, when the job uses GAE."""
        self.model_lock = asyncio.Lock()
        self.filters: list[ChosenFilter] = []
        """The job's group filters, in order (algorithm.filters)."""
        self.drops = DropCounts()
        self._in_training: list[Delivery[Trajectory]] = []
        self._reported: asyncio.Future[None] | None = None
        """The last step's report, made once its weights are out (``_settle``)."""
        self.threads: ThreadChoice | None = None
        """The torch threads of each step (set at the first, when the process group is known)."""
        self.step_threads = 0
        """The torch threads the last step optimised on (its ``torch_threads`` metric)."""

    async def run(self) -> None:
        self.filters = check_supported(self.spec)
        self.drops = self._step_drops()
        keepalive_stop = asyncio.Event()
        keepalive = asyncio.create_task(self._keep_alive(keepalive_stop))
        try:
            async with self.model_lock:  # a SaveCheckpoint call meanwhile waits for v0
                self._enter(trainer_pb2.TRAINER_STATE_LOADING)
                resumed = await asyncio.to_thread(self._load)
                self.control.check()
                await self._begin(resumed)
            self.trajectories = consumer = StreamConsumer(
                self.bus,
                self.streams.trajectories,
                TRAJECTORY_GROUP,
                self.consumer,
                Trajectory,
                count=256,
                block_ms=self.settings.poll_block_ms,
                reclaim_idle_ms=self.settings.trajectory_reclaim_idle_ms,
            )
            self.metrics.watch(self.streams.trajectories, TRAJECTORY_GROUP)
            while self.version < self.spec.trainer.steps:
                waited = time.monotonic()
                groups = await self._collect(consumer)
                await self._train_step(consumer, groups, time.monotonic() - waited)
                self.control.check()
            await self._settle()
        except JobStopped as stop:
            if stop.kind is not StopKind.LOST:  # the job is still ours: keep what was trained
                async with self.model_lock:
                    await self._save_durable()
                    await self._settle()
            raise
        finally:
            self.metrics.unwatch(self.streams.trajectories, TRAJECTORY_GROUP)
            if self._reported is not None:
                self._reported.cancel()  # an error ends the job: a report in flight goes with it
            await stop_renewing(keepalive, keepalive_stop, self.settings.keepalive_s)
            # On shutdown a step may still run in its thread; the process exit frees the memory.
            if not self.control.shutdown.is_set():
                await asyncio.to_thread(self._close_models)

    def _close_models(self) -> None:
        for model in (self.policy, self.reference, self.critic):
            if model is not None:
                model.close()

    # -- load and first checkpoint -------------------------------------------------------

    def _load(self) -> SavedCheckpoint | None:
        """Blocking: the newest checkpoint of this job if there is one, else the base model."""
        from services.models import resolve_model_path  # builds or converts a model on demand

        self.store.remove_partial()
        resumed = self.store.latest()
        base_dir = resolve_model_path(self.spec.model.path, self.spec.model.gguf_file)
        if resumed is not None:
            log.info("job %s: resuming from its checkpoint v%d", self.job_id, resumed.handle.version)
        if resumed is not None and self.spec.model.lora is None:
            model_dir = tokenizer_dir = resumed.directory
        else:  # a LoRA job's checkpoints hold its adapter: the model is the base one
            model_dir = base_dir
            tokenizer = self.spec.model.tokenizer
            tokenizer_dir = resolve_model_path(tokenizer) if tokenizer else model_dir
        algorithm = self.spec.algorithm
        estimator = ADVANTAGE_ESTIMATORS.get(algorithm.advantage)
        init_distributed(self.device)
        if distributed.size() > 1 and estimator.needs_critic:
            raise ValueError(
                f"algorithm.advantage {estimator.name!r} needs one trainer process (no sharded critic)"
            )
        # Every rank loads (leader.py); the optimiser and schedule resume with the weights.
        self.policy = leader.load_policy(
            spec=self.spec,
            model_dir=model_dir,
            tokenizer_dir=tokenizer_dir,
            device=self.device,
            completed_versions=int(resumed.handle.version) if resumed else 0,
            training_state=resumed.training_state if resumed else None,
            adapter_from=self._adapter_from(resumed),
        )
        if algorithm.kl_coef > 0:  # the penalty is to the job's base model, also after a resume
            self.reference = ReferenceModel.load(self.spec, base_dir, self.policy.device)
        if estimator.needs_critic:
            saved_critic = resumed.directory / CRITIC_DIR if resumed is not None else None
            critic_dir = saved_critic if saved_critic is not None and saved_critic.is_dir() else base_dir
            self.critic = Critic.load(self.spec, critic_dir, self.policy.device)
        if self.reference is not None or self.critic is not None:
            freeze_long_lived_objects()  # as Policy.load froze the policy: they live for the job
        return resumed

    def _adapter_from(self, resumed: SavedCheckpoint | None) -> Path | None:
        """Where a LoRA job's adapter starts: its durable checkpoint when it resumes, else
        model.lora.init_from; None: a fresh adapter, or no LoRA."""
        lora = self.spec.model.lora
        if lora is None:
            return None
        if resumed is not None:
            return resumed.directory
        return Path(lora.init_from) if lora.init_from is not None else None

    async def _begin(self, resumed: SavedCheckpoint | None) -> None:
        """A new epoch: v0 of the base model published, or the resumed checkpoint's weights again."""
        self._enter(trainer_pb2.TRAINER_STATE_SAVING)
        await self.lineage.begin(resumed, self._write_model, self._write_base)
        if resumed is not None:
            self.version = int(resumed.handle.version)
        self.progress.last_checkpoint = resumed.handle if resumed else self._published_handle()
        self._report_version()
        log.info("job %s: epoch %d begins at v%d", self.job_id, self.lineage.epoch, self.version)

    def _published_handle(self) -> common_pb2.CheckpointHandle | None:
        published = self.lineage.published
        return published.handle if published is not None else None

    def _write_model(self, directory: Path) -> None:
        assert self.policy is not None
        self.policy.save(directory)

    def _write_base(self, directory: Path) -> None:
        """A LoRA job's base model, which its adapters apply to."""
        assert self.policy is not None
        self.policy.save_base(directory)

    def _write_training_state(self, directory: Path) -> None:
        """The optimiser and schedule; the critic, if any, in its ``critic/`` subdirectory."""
        assert self.policy is not None
        self.policy.save_training_state(directory)
        if self.critic is not None:
            self.critic.save(directory / CRITIC_DIR)

    async def _save_durable(self) -> SavedCheckpoint | None:
        """A durable checkpoint of the current weights, then the acks it allows (hold the model lock)."""
        self._enter(trainer_pb2.TRAINER_STATE_SAVING)
        saved = await self.lineage.save_durable(self._write_training_state, self.trajectories)
        if saved is not None:
            self.progress.last_checkpoint = saved.handle
        return saved

    async def latest_checkpoint(self) -> common_pb2.CheckpointHandle:
        """A durable checkpoint of the current weights, once any step in progress has finished
        (written now unless the newest one holds them; at v0, the base model's handle)."""
        async with self.model_lock:
            await self._settle()
            published = self.lineage.published
            if published is None or published.handle.version != self.version:
                raise CheckpointUnavailable(f"job {self.job_id} has no checkpoint of its current weights")
            await self._save_durable()
            durable = self.lineage.durable
            if durable is not None and durable.handle.version == self.version:
                return durable.handle
            return published.handle

    def _enter(self, state: int) -> None:
        """Report the phase the job is in (a requested stop keeps reporting STOPPING)."""
        if not self.control.stopping:
            self.progress.state = state

    def _report_version(self) -> None:
        self.progress.policy_version = self.version
        self.progress.step = self.version

    # -- one step ------------------------------------------------------------------------

    async def _collect(self, consumer: StreamConsumer[Trajectory]) -> list[Group]:
        """Wait for ``prompts_per_step`` complete, fresh, valid groups that the job's filters keep.

        Groups taken but not trained yet are held in ``_in_training`` (the keep-alive renews them).
        A group a filter drops is acked and reported at once, like a stale one, so that the
        controller issues a replacement prompt and the step still fills.
        """
        self._enter(trainer_pb2.TRAINER_STATE_WAITING_FOR_DATA)
        wanted = self.spec.rollout.prompts_per_step
        ready: list[Group] = []
        while True:
            self.control.check()
            unusable = self.collector.discard_unusable(self._min_version(), self._foreign)
            await self._drop(consumer, unusable)
            if self.collector.complete:
                taken = self.collector.take(wanted - len(ready))
                verdicts = [(group, self._dropped_by(group)) for group in taken]
                ready.extend(group for group, by in verdicts if by is None)
                self._in_training = unique_deliveries(ready)
                filtered = [(group, by) for group, by in verdicts if by is not None]
                if filtered:
                    await self._drop_filtered(consumer, filtered)
                if len(ready) >= wanted:
                    return ready
            for delivery in await consumer.poll():
                outcome, reason = self.collector.add(delivery)
                if outcome is Outcome.DONE:
                    self.drops.duplicates += 1
                    await consumer.ack([delivery])
                elif outcome is Outcome.REDELIVERED:
                    self.drops.duplicates += 1
                elif outcome in (Outcome.REJECTED, Outcome.SURPLUS):
                    await consumer.dead_letter(delivery, reason, no_replacement=outcome is Outcome.SURPLUS)

    def _foreign(self, group: Group) -> bool:
        return self.lineage.foreign(group, self.version)

    def _min_version(self) -> int:
        """The oldest token version a group may have (a stale policy that ``drops``; no bound otherwise)."""
        algorithm = self.spec.algorithm
        if not STALE_POLICIES.get(algorithm.stale_policy).drops:
            return NO_MIN_VERSION
        return self.version - algorithm.max_staleness

    def _dropped_by(self, group: Group) -> str | None:
        """The filter that drops the group, or None when the job's filters all keep it."""
        return first_to_drop(self.filters, GroupScores.of(group.ordered())) if self.filters else None

    async def _drop_filtered(
        self, consumer: StreamConsumer[Trajectory], filtered: list[tuple[Group, str]]
    ) -> None:
        """Ack the groups the filters dropped, count them by filter, and report them at once."""
        await consumer.ack(unique_deliveries(group for group, _ in filtered))
        for _, by in filtered:
            self.drops.filtered[by] += 1
        log.info(
            "job %s: filters dropped %s", self.job_id, ", ".join(f"{g.group_id} ({by})" for g, by in filtered)
        )
        await self._report_drops(common_pb2.GroupsDropped(filtered=len(filtered)))

    async def _drop(self, consumer: StreamConsumer[Trajectory], unusable: Unusable) -> None:
        """Ack stale groups; dead-letter invalid ones with their problems as the reason."""
        for group in unusable.stale:
            log.info(
                "job %s: dropped stale group %s (v%s)", self.job_id, group.group_id, group.oldest_version
            )
            await consumer.ack(group.deliveries)
        for group in unusable.foreign:
            log.info(
                "job %s: dropped group %s (v%s..v%s): not sampled by epoch %d's weights at v%d, "
                "or older than its de-duplication window",
                *(self.job_id, group.group_id, group.oldest_version, group.newest_version),
                *(self.lineage.epoch, self.version),
            )
            await consumer.ack(group.deliveries)
        for group in unusable.invalid:
            reason = f"group {group.group_id!r} cannot be trained: " + "; ".join(group.problems)
            log.warning("job %s: %s", self.job_id, reason)
            for delivery in unique_deliveries([group]):  # reported dropped below: no_replacement
                await consumer.dead_letter(delivery, reason, no_replacement=True)
        stale = len(unusable.stale) + len(unusable.foreign)
        self.drops.stale_groups += stale
        if stale or unusable.invalid:
            # Reported at once, not with the next step: the controller replaces dropped
            # groups, and until it does this step may never fill.
            dropped = common_pb2.GroupsDropped(stale=stale, invalid=len(unusable.invalid))
            await self._report_drops(dropped)

    async def _train_step(
        self, consumer: StreamConsumer[Trajectory], groups: list[Group], wait_s: float = 0.0
    ) -> None:
        """Optimise on the groups, publish the weights (written beside the next step's optimise),
        every few steps a durable checkpoint (which acks what it covers), then report the step
        once its weights are out (``wait_s``: collecting the groups)."""
        stages = stage_metric_values(groups, time.time())
        self._in_training = unique_deliveries(groups)
        async with self.model_lock:
            self._enter(trainer_pb2.TRAINER_STATE_TRAINING)
            started = time.monotonic()
            prepared, stats = await asyncio.to_thread(self._optimise, groups)
            optimised, threads = time.monotonic(), self.step_threads
            await self._settle()  # the previous step's weights and report are out: in order
            self.version += 1
            self._enter(trainer_pb2.TRAINER_STATE_SAVING)
            assert self.policy is not None
            snapshot = await asyncio.to_thread(self.policy.weights_snapshot)
            write = functools.partial(write_snapshot, snapshot, adapter=self.spec.model.lora is not None)
            publication = self.lineage.publish_beside(self.version, write)
            self.lineage.hold(self._in_training, [t for group in groups for t in group.trajectories])
            self._in_training = []
            self._report_version()
            published_at = time.monotonic()
            saved = await self._save_durable() if self.lineage.durable_due(self.version) else None
            saved_at = time.monotonic() if saved is not None else published_at
        await asyncio.to_thread(self.store.prune)
        version, epoch, drops, self.drops = self.version, self.lineage.epoch, self.drops, self._step_drops()

        async def report() -> None:
            published, write_s = await publication
            log.info("job %s: published checkpoint v%d (epoch %d, weights only)", self.job_id, version, epoch)
            written = published.bytes_written + (saved.bytes_written if saved is not None else 0)
            publish_s, checkpoint_s = published_at - optimised, saved_at - published_at
            times = StepTimes(optimised - started, publish_s, checkpoint_s, written, wait_s, write_s)
            await self._publish_metrics(stats, prepared, times, groups, stages, version, drops, threads)

        self._reported = asyncio.ensure_future(report())

    async def _settle(self) -> None:
        """Wait until the last step's weights and report are out (raising their error)."""
        if self._reported is not None:
            await self._reported
            self._reported = None

    def _optimise(self, groups: list[Group]) -> tuple[Prepared, StepStats]:
        """Blocking: old logprobs, advantages and weights (prepare.py), then the optimiser steps,
        on the step's torch threads (set in this thread: each thread has its own OpenMP team)."""
        assert self.policy is not None
        if self.threads is None:
            tune = self.settings.thread_tuning and self.device.type == "cpu" and distributed.size() == 1
            self.threads = ThreadChoice(candidates(job_threads(self.settings.torch_threads), tune))
        threads = self.step_threads = self.threads.next()
        torch.set_num_threads(threads)
        started = time.perf_counter()
        members = [group.ordered() for group in groups]
        prepared = prepare(members, self.spec, self.version, self.policy, self.reference, self.critic)
        seed = self.spec.seed * 1_000_003 + self.version
        stats = self.policy.optimise(prepared.samples, seed, self.critic, prepared.proximal)
        self.threads.record(threads, time.perf_counter() - started, stats.padded_tokens)
        return prepared, stats

    def _step_drops(self) -> DropCounts:
        """A step's drop counts, with every filter of the job at 0 (its metric is in every step)."""
        return DropCounts(filtered=dict.fromkeys((f.label for f in self.filters), 0))

    async def _publish_metrics(
        self,
        stats: StepStats,
        prepared: Prepared,
        times: StepTimes,
        groups: list[Group],
        stages: dict[str, float],
        version: int,
        drops: DropCounts,
        threads: int,
    ) -> None:
        """The step's trainer Metric (``threads``: the torch threads it optimised on)."""
        values = step_metric_values(stats, prepared, times, drops) | stages
        values["torch_threads"] = float(threads)
        if self.spec.rollout.max_turns > 1:
            values["tool_use_rate"] = tool_use_rate(groups)
        await self.bus.publish_metric(self.job_id, "trainer", values, step=version, policy_version=version)
        self.progress.consumed_trajectories += len(prepared.rewards)
        self.progress.last_metrics = values
        self.metrics.stepped(values, len(prepared.rewards))
        log.info(
            "job %s: step %d loss %.4f reward %.3f clip %.3f kl %.2e grad %.3f (%.2fs)",
            *(self.job_id, version, stats.loss, values["reward_mean"], stats.clip_fraction),
            *(stats.approx_kl, stats.grad_norm, values["step_seconds"]),
        )

    async def _report_drops(self, dropped: common_pb2.GroupsDropped) -> None:
        """Tell the controller of groups dropped just now, so that it replaces them."""
        signal = common_pb2.TrainerSignal(job_id=self.job_id, policy_version=self.version)
        signal.groups_dropped.CopyFrom(dropped)
        signal.time.GetCurrentTime()
        await self.bus.publish(self.streams.control, signal)

    # -- keep-alive ------------------------------------------------------------------------

    async def _keep_alive(self, stop: asyncio.Event) -> None:
        """Renew the claims on the job and the held trajectories every ``keepalive_s`` (leases.py)
        until ``stop``, so that no other trainer takes them while this one works; let the job go
        once another holds it."""
        try:
            await renew_every(
                self.settings.keepalive_s, self._renew_claims, what=f"job {self.job_id}", stop=stop
            )
        except JobStopped as stopped:
            self.control.stop(stopped)

    async def _renew_claims(self) -> None:
        entry = self.submission_entry_id
        owner = await self.bus.owner(JOBS, JOB_GROUP, entry)
        if owner != self.consumer:
            raise JobStopped(StopKind.LOST, f"the job's claim is now held by {owner or 'nobody'}")
        await self.bus.touch(JOBS, JOB_GROUP, self.consumer, [entry])
        held = (
            self.collector.buffered_entry_ids()
            + [d.entry_id for d in self._in_training]
            + self.lineage.held_entry_ids()
        )
        await self.bus.touch(self.streams.trajectories, TRAJECTORY_GROUP, self.consumer, held)
        state = await self.jobs.state(self.job_id)
        if state in TERMINAL_STATES:  # stop after the step; the claims stay renewed until then
            self.control.stop(JobStopped(StopKind.ENDED_ELSEWHERE, f"the job store has the job {state}"))
