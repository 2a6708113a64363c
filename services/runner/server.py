"""The rollout runner: turns the PromptTasks of every running job into scored Trajectories.

``python -m services.runner``. Every ``jobs_refresh_s`` it reads the
running jobs from the job store and keeps one consumer loop per job on
``verst:job:{id}:prompts`` (group "runners"). Up to ``max_concurrent_groups``
tasks are in flight at once, over all jobs; one read takes as many tasks as there are free
slots. For each task it asks the router for the group's n samples, resumes the samples that
came back aborted (partial rollout, see ``group.py``), scores them in one ScoreBatch,
publishes the group's Trajectories, and only then acks the task. The calls of groups in
flight together are coalesced (``batching.py``: one router GenerateBatch, one reward
ScoreBatch), and so are the publishes and acks of groups that finish together
(``publishing.py``: one Redis round trip for the trajectories, then one for the acks). That is the
``group`` strategy; the job's ``rollout.strategy`` picks another (``tool_episode``: multi-turn
episodes with tool calls between turns; a user's agent loop: strategy.py has the contract), and
its ``reward.shaping`` reshapes each scored group's rewards before it is published (shaping.py).
A task whose service call failed stays pending and is retried after it is reclaimed; a task the
engine refused (INVALID_ARGUMENT), or whose strategy or shaping cannot be loaded or fails, is
dead-lettered.
The process serves gRPC health beside the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from services.common.bus import Bus, Delivery
from services.common.bus_lag import BusLagCollector
from services.common.consumer import StreamConsumer, consumer_name
from services.common.grpc_client import Channels
from services.common.grpc_server import serve
from services.common.job_tokenizer import load_job_tokenizer
from services.common.jobs import JobRecord, JobStore
from services.common.leases import renew_every
from services.common.metrics_http import serving_service_metrics
from services.common.outage import RedisOutageError, wait_until_up
from services.common.pb import common_pb2, reward_pb2_grpc, router_pb2_grpc
from services.common.redis_client import RedisTarget
from services.common.settings import load_settings, redis_target, setup_logging
from services.common.streams import RUNNERS_GROUP, JobStreams
from services.runner.batching import CoalescingReward, CoalescingRouter, joined_score_call, packed_batch_call
from services.runner.config import RunnerSettings
from services.runner.group import (
    GroupClients,
    InvalidTaskError,
    RetryLaterError,
    check_task,
    roll_out_group,
    roll_out_group_spliced,
)
from services.runner.publishing import GroupPublisher
from services.runner.shaping import load_shapings, shape_rewards
from services.runner.spliced import head
from services.runner.strategy import check_trajectories, load_strategy
from services.runner.telemetry import RunnerMetrics

log = logging.getLogger(__name__)

GROUP = RUNNERS_GROUP
POLL_BLOCK_MS = 500
"""How long one read of a prompts stream waits for a task."""
STRATEGY_KEY = "rollout_strategy"
"""Trajectory metadata key naming the rollout strategy that made it."""
KEEPALIVES_PER_RECLAIM = 5
"""Tasks in flight have their idle time reset at least this many times per reclaim_idle_ms."""
MAX_KEEPALIVE_S = 1.0
"""And at least this often."""


@dataclass
class JobLoop:
    """The consumer loop of one job and what it needs."""

    record: JobRecord
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    tokenizer: Any = None
    tokenizer_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One load of the tokenizer, however many tasks need it at once."""


def stamp_stages(
    trajectories: list[common_pb2.Trajectory], task: common_pb2.PromptTask, picked: float
) -> None:
    """Add the stages the runner sees to the trajectories' StageTimes (roll-outs add the rest)."""
    issued = task.created_at.ToNanoseconds() / 1e9 if task.HasField("created_at") else 0.0
    published = time.time()
    for trajectory in map(head, trajectories):
        stages = trajectory.stages
        stages.issued, stages.picked, stages.published = issued, picked, published


class Runner:
    """Consumes the prompts of every running job."""

    def __init__(
        self, bus: Bus, store: JobStore, settings: RunnerSettings, metrics: RunnerMetrics | None = None
    ) -> None:
        self.bus = bus
        self.store = store
        self.settings = settings
        self.metrics = metrics or RunnerMetrics()
        self.consumer = consumer_name("runner")
        self._slots = asyncio.Semaphore(settings.max_concurrent_groups)
        self._busy = 0
        """Slots held now: by tasks in flight, and by a loop about to read."""
        self._observe_read = self.metrics.batch_observer("read")
        self._jobs: dict[str, JobLoop] = {}
        self._inflight: set[asyncio.Task[None]] = set()
        self._held: dict[str, set[str]] = {}
        """Entry ids of the tasks in flight, by prompts stream: kept alive against reclaim."""
        self._channels = Channels()
        self._routers: dict[str, CoalescingRouter] = {}
        self._rewards: dict[str, CoalescingReward] = {}
        self._tools: dict[str, reward_pb2_grpc.ToolsStub] = {}
        """One coalescing client per address, shared by every job's groups."""
        self._publisher = GroupPublisher(
            bus,
            GROUP,
            window_s=settings.batch_window_s,
            max_calls=settings.batch_max_calls,
            observe=self.metrics.batch_observer("publish"),
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the running jobs until ``stop``; then finish the tasks in flight."""
        keepalive = asyncio.create_task(self._keep_alive(stop))
        try:
            while not stop.is_set():
                try:
                    await self.refresh_jobs()
                except RedisOutageError:  # the client logs the outage
                    await wait_until_up(self.bus.redis, stop)
                except Exception:  # a Redis outage must not end the runner: try again later
                    log.exception("runner: reading the running jobs failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.settings.jobs_refresh_s)
        finally:
            await self._stop_loops(list(self._jobs))
            await asyncio.gather(*self._inflight, return_exceptions=True)
            await asyncio.wait([keepalive], timeout=self.settings.reclaim_idle_ms / 1000)
            for client in [*self._routers.values(), *self._rewards.values(), self._publisher]:
                await client.close()
            await self._channels.close()

    async def refresh_jobs(self) -> None:
        """Start a loop for each newly running job; stop the loops of jobs that stopped running."""
        running = {record.job_id: record for record in await self.store.running_jobs()}
        await self._stop_loops([job_id for job_id in self._jobs if job_id not in running])
        for job_id, record in running.items():
            loop = self._jobs.get(job_id)
            if loop is not None and loop.task is not None and loop.task.done():
                log.error("loop of %s ended: %r; restarting it", job_id, loop.task.exception())
                loop = None
            if loop is None:
                loop = JobLoop(record)
                loop.task = asyncio.create_task(self._consume(loop), name=f"runner {job_id}")
                self._jobs[job_id] = loop
                self.metrics.watch(JobStreams(job_id).prompts, GROUP)
                log.info("consuming the prompts of %s", job_id)

    async def _stop_loops(self, job_ids: list[str]) -> None:
        loops = [self._jobs.pop(job_id) for job_id in job_ids]
        for loop in loops:
            loop.stop.set()
            self.metrics.unwatch(JobStreams(loop.record.job_id).prompts, GROUP)
        await asyncio.gather(*(loop.task for loop in loops if loop.task), return_exceptions=True)

    def _prompt_consumer(self, job_id: str) -> StreamConsumer[common_pb2.PromptTask]:
        return StreamConsumer(
            self.bus,
            JobStreams(job_id).prompts,
            GROUP,
            self.consumer,
            common_pb2.PromptTask,
            count=1,  # each poll names its count: the free slots
            block_ms=POLL_BLOCK_MS,
            reclaim_idle_ms=self.settings.reclaim_idle_ms,
        )

    async def _consume(self, loop: JobLoop) -> None:
        consumer = self._prompt_consumer(loop.record.job_id)
        await self._prepare(loop)
        while await self._take_slot(loop.stop):
            await self._gather_slots()
            try:  # as many tasks as there are free slots (this one and those free now)
                deliveries = await consumer.poll(count=1 + self._free_slots())
            except RedisOutageError:  # the client logs the outage: wait for Redis, quietly
                self._release_slot()
                await wait_until_up(self.bus.redis, loop.stop)
                continue
            except Exception:
                self._release_slot()
                log.exception("%s: reading prompts failed; retrying", loop.record.job_id)
                await asyncio.sleep(1.0)
                continue
            if not deliveries:
                self._release_slot()
                continue
            self._observe_read(len(deliveries))
            await self._start(loop, consumer, deliveries)

    async def _gather_slots(self) -> None:
        """Wait one batch window when other groups are in flight and few slots are free: groups
        that finish together free their slots within it, and are then replaced by one read, whose
        groups call the router and the reward service together again (batching.py). Without it a
        busy runner reads one task per freed slot and its batches shrink to a group or two."""
        if self._busy > 1 and self._free_slots() < self.settings.batch_max_calls:
            await asyncio.sleep(self.settings.batch_window_s)

    def _free_slots(self) -> int:
        """Slots no task holds now, beside the one the reading loop holds (other jobs' loops may
        take them first: the read's extra tasks wait for theirs)."""
        return max(0, self.settings.max_concurrent_groups - self._busy)

    def _release_slot(self) -> None:
        self._busy -= 1
        self._slots.release()

    async def _start(
        self,
        loop: JobLoop,
        consumer: StreamConsumer[common_pb2.PromptTask],
        deliveries: list[Delivery[common_pb2.PromptTask]],
    ) -> None:
        """Start a task per delivery, the first in the slot held, the others each in one more
        (free, usually); those left when the loop stops stay pending, for a reclaim."""
        held = self._held.setdefault(consumer.stream, set())
        held.update(delivery.entry_id for delivery in deliveries)  # kept alive from the read on
        for i, delivery in enumerate(deliveries):
            if i > 0 and not await self._take_slot(loop.stop):
                held.difference_update(d.entry_id for d in deliveries[i:])
                return
            task = asyncio.create_task(self._process(loop, consumer, delivery))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _take_slot(self, stop: asyncio.Event) -> bool:
        """Wait for a free slot (True) or for ``stop`` (False, holding no slot). A free slot is
        taken without yielding to the event loop, so that the tasks of one read start together
        (and their calls go out in one batch)."""
        if stop.is_set():
            return False
        if not self._slots.locked():
            await self._slots.acquire()  # returns at once: a slot is free
            self._busy += 1
            return True
        acquiring = asyncio.ensure_future(self._slots.acquire())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not acquiring.done():
            acquiring.cancel()
        await asyncio.wait({acquiring})
        if acquiring.cancelled():
            return False
        self._busy += 1
        if stop.is_set():
            self._release_slot()
            return False
        return True

    async def _prepare(self, loop: JobLoop) -> None:
        """Load the job's tokenizer (and transformers, a slow import) before its first task, so
        that a task taken over from a runner that died is not kept waiting for it."""
        try:
            await self._clients(loop)
        except Exception as err:  # the first task tries again
            log.warning("%s: not ready for its tasks yet: %s", loop.record.job_id, err)

    async def _process(
        self,
        loop: JobLoop,
        consumer: StreamConsumer[common_pb2.PromptTask],
        delivery: Delivery[common_pb2.PromptTask],
    ) -> None:
        """Roll out one task; publish its trajectories, then ack. Holds one slot."""
        task = delivery.message
        job_id = loop.record.job_id
        picked = time.time()
        held = self._held.setdefault(delivery.stream, set())
        held.add(delivery.entry_id)
        self.metrics.in_flight.inc()
        try:
            trajectories = await self._roll_out(loop, task)
            self.metrics.rolled_out(trajectories, picked)
            stamp_stages(trajectories, task, picked)
            publishing = time.monotonic()
            await self._publisher.publish_and_ack(JobStreams(job_id).trajectories, trajectories, delivery)
            self.metrics.published(time.monotonic() - publishing)
            log.debug("%s: %d trajectories", task.prompt_id, len(trajectories))
        except InvalidTaskError as err:
            self.metrics.groups_failed.labels("invalid").inc()
            await consumer.dead_letter(delivery, f"invalid task: {err}")
        except RetryLaterError as err:
            self.metrics.groups_failed.labels("retry").inc()
            log.warning("%s left for a retry (delivery %d): %s", task.prompt_id, delivery.delivery_count, err)
        except Exception:
            self.metrics.groups_failed.labels("error").inc()
            log.exception(
                "%s failed (delivery %d); left for a retry", task.prompt_id, delivery.delivery_count
            )
        finally:
            self.metrics.in_flight.dec()
            held.discard(delivery.entry_id)
            self._release_slot()

    async def _roll_out(self, loop: JobLoop, task: common_pb2.PromptTask) -> list[common_pb2.Trajectory]:
        """The task's group by the job's strategy, its rewards shaped; InvalidTaskError when the
        task, the strategy or a shaping is wrong (before anything is generated when it can tell)."""
        check_task(task, loop.record.job_id)
        spec = loop.record.spec
        strategy = load_strategy(spec.rollout)
        shapings = load_shapings(spec.reward.shaping)
        clients = await self._clients(loop)
        # the builtin strategy's trajectories pass the engine's arrays on as bytes (spliced.py)
        roll_out = roll_out_group_spliced if strategy.fn is roll_out_group else strategy.fn
        trajectories = await roll_out(task, clients)
        check_trajectories(strategy.name, task, trajectories)
        for trajectory in map(head, trajectories):  # provenance: which strategy made it
            trajectory.metadata[STRATEGY_KEY] = strategy.name
        budget = task.sampling.max_new_tokens or spec.rollout.max_new_tokens
        shape_rewards(trajectories, shapings, task, max_new_tokens=budget, tokenizer=clients.tokenizer)
        return trajectories

    async def _keep_alive(self, stop: asyncio.Event) -> None:
        """Reset the idle time of the tasks in flight (XCLAIM JUSTID, which counts no delivery)
        every fifth of reclaim_idle_ms, at most a second apart (leases.py), so that only the tasks
        of a runner that died, or that failed, are reclaimed."""
        period_s = min(MAX_KEEPALIVE_S, self.settings.reclaim_idle_ms / 1000 / KEEPALIVES_PER_RECLAIM)
        await renew_every(period_s, self._renew, what="runner tasks in flight", stop=stop)

    async def _renew(self) -> None:
        for stream, entry_ids in list(self._held.items()):
            if entry_ids:
                await self.bus.touch(stream, GROUP, self.consumer, list(entry_ids))

    async def _clients(self, loop: JobLoop) -> GroupClients:
        spec = loop.record.spec
        async with loop.tokenizer_lock:
            if loop.tokenizer is None:
                loop.tokenizer = await self._load_tokenizer(loop)
        reward_address = spec.reward.address or self.settings.reward_address
        return GroupClients(
            router=self._router(self.settings.router_address),
            reward=self._reward(reward_address),
            tokenizer=loop.tokenizer,
            request_timeout_s=spec.rollout.request_timeout_s,
            reward_timeout_s=spec.reward.timeout_s,
            retry_s=self.settings.retry_s,
            max_resumes=self.settings.max_resumes,
            serving=lambda: not loop.stop.is_set(),
            tools=self._tools_stub(self.settings.tools_address or reward_address),
            rollout=spec.rollout,
            chat_template_kwargs=spec.data.chat_template_kwargs,
        )

    def _router(self, address: str) -> CoalescingRouter:
        if address not in self._routers:
            channel = self._channels.get(address)
            self._routers[address] = CoalescingRouter(
                router_pb2_grpc.RouterStub(channel),
                batch_call=packed_batch_call(channel),
                window_s=self.settings.batch_window_s,
                max_calls=self.settings.batch_max_calls,
                observe=self.metrics.batch_observer("generate"),
            )
        return self._routers[address]

    def _tools_stub(self, address: str) -> reward_pb2_grpc.ToolsStub:
        """One stub per address: a stub builds a callable per method (a group's worth of work)."""
        if address not in self._tools:
            self._tools[address] = reward_pb2_grpc.ToolsStub(self._channels.get(address))
        return self._tools[address]

    def _reward(self, address: str) -> CoalescingReward:
        if address not in self._rewards:
            channel = self._channels.get(address)
            self._rewards[address] = CoalescingReward(
                reward_pb2_grpc.RewardStub(channel),
                joined_call=joined_score_call(channel),
                window_s=self.settings.batch_window_s,
                max_calls=self.settings.batch_max_calls,
                observe=self.metrics.batch_observer("score"),
            )
        return self._rewards[address]

    async def _load_tokenizer(self, loop: JobLoop) -> Any:
        """The job's tokenizer, from its newest checkpoint unless the spec names one."""
        spec = loop.record.spec
        handle = await self.bus.latest(
            JobStreams(loop.record.job_id).checkpoints, common_pb2.CheckpointHandle
        )
        if handle is None and spec.model.tokenizer is None:
            raise RetryLaterError("the job has no checkpoint yet to take its tokenizer from")
        try:
            return await asyncio.to_thread(load_job_tokenizer, spec, handle or common_pb2.CheckpointHandle())
        except (OSError, ValueError) as err:
            raise RetryLaterError(f"cannot load the job's tokenizer: {err}") from None


async def _consume_until(
    settings: RunnerSettings, redis_url: RedisTarget, metrics: RunnerMetrics, stop: asyncio.Event
) -> None:
    bus = Bus.from_url(
        redis_url,
        outage_s=settings.redis_outage_s,
        max_connections=settings.redis_max_connections,
        max_deliveries=settings.max_deliveries,
    )
    try:
        await Runner(bus, JobStore(bus.redis), settings, metrics).run(stop)
    finally:
        await bus.close()


def main() -> None:
    """``python -m services.runner``: settings from the environment, health, the loop."""
    settings = load_settings(RunnerSettings)
    setup_logging(settings.service_name, settings.log_level)
    redis_url = redis_target(settings)
    metrics = RunnerMetrics(BusLagCollector(redis_url))
    try:
        with serving_service_metrics(metrics.registry, settings):
            consume = functools.partial(_consume_until, settings, redis_url, metrics)
            asyncio.run(serve(settings, background=consume, registry=metrics.registry))
    finally:
        metrics.close()
