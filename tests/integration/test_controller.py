"""The job controller against real Redis and real gRPC servers standing in for the router and reward.

The test plays the trainer: it publishes checkpoint handles, metrics and status
reports on the job's streams, and watches what the controller does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.common.bus import Bus
from services.common.config import JobSpec
from services.common.jobs import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, JobStore
from services.common.pb import common_pb2
from services.common.streams import CONTROLLER_GROUP, RUNNERS_GROUP, JobStreams
from services.controller.config import ControllerSettings
from services.controller.controller import Controller
from services.controller.telemetry import ControllerMetrics
from services.data import encode_prompt, eval_prompts
from tests.helpers import eventually, stream_messages
from tests.integration.fake_services import (
    FakeReward,
    FakeRouter,
    checkpoint,
)

Services = tuple[FakeRouter, str, FakeReward, str]


def knows(a: int, b: int, version: int) -> bool:
    """What the fake engine answers right when greedy: more problems at later versions."""
    return (a + b) % 4 < version


def expected_accuracy(spec: JobSpec, version: int) -> float:
    examples = eval_prompts(spec.data, spec.eval.num_prompts)
    right = [knows(*(int(x) for x in ex.text.rstrip("=").split("+")), version) for ex in examples]
    return sum(right) / len(right)


@pytest.fixture
def services(router: tuple[FakeRouter, str], reward: tuple[FakeReward, str]) -> Services:
    router[0].correct_at_version = knows
    return router[0], router[1], reward[0], reward[1]


class Controllers:
    """Starts controllers (as the api's lifespan does) and stops them."""

    def __init__(self, bus: Bus, services: Services) -> None:
        self.bus = bus
        self.services = services
        self.running: dict[int, tuple[asyncio.Event, asyncio.Task[None]]] = {}

    async def start(self, consumer: str = "", **overrides: Any) -> Controller:
        settings = ControllerSettings.model_validate(
            {
                "router_address": self.services[1],
                "reward_address": self.services[3],
                "poll_interval_s": 0.05,
                "eval_engine_timeout_s": 5.0,
                "reclaim_idle_ms": 200,
                **overrides,
            }
        )
        controller = Controller(
            self.bus, JobStore(self.bus.redis), settings, ControllerMetrics(), consumer=consumer
        )
        stop = asyncio.Event()
        self.running[id(controller)] = (stop, asyncio.create_task(controller.run(stop)))
        return controller

    async def stop(self, controller: Controller) -> None:
        stop, task = self.running.pop(id(controller))
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.fixture
async def controllers(bus: Bus, services: Services) -> AsyncIterator[Controllers]:
    controllers = Controllers(bus, services)
    yield controllers
    for controller_id in list(controllers.running):
        stop, task = controllers.running.pop(controller_id)
        stop.set()
        await asyncio.wait_for(task, 10)


class Trainer:
    """The test's stand-in for the trainer of one job."""

    def __init__(self, bus: Bus, store: JobStore, job_id: str, directory: Path) -> None:
        self.bus, self.store, self.job_id, self.directory = bus, store, job_id, directory
        self.streams = JobStreams(job_id)

    async def publish_version(self, version: int, epoch: int = 0) -> None:
        handle = checkpoint(self.job_id, version, self.directory)
        handle.epoch = epoch
        await self.bus.publish(self.streams.checkpoints, handle)

    async def report(self, state: int, version: int, reason: str = "") -> None:
        status = common_pb2.JobStatus(job_id=self.job_id, state=state, policy_version=version, reason=reason)
        await self.bus.publish(self.streams.status, status)

    async def report_drops(
        self, version: int, *, stale: int = 0, invalid: int = 0, zero_variance: int = 0, filtered: int = 0
    ) -> str:
        """A GroupsDropped signal on the control stream; returns its entry id."""
        signal = common_pb2.TrainerSignal(job_id=self.job_id, policy_version=version)
        signal.groups_dropped.CopyFrom(
            common_pb2.GroupsDropped(
                stale=stale, invalid=invalid, zero_variance=zero_variance, filtered=filtered
            )
        )
        return await self.bus.publish(self.streams.control, signal)

    async def report_step_metric(self, step: int, values: dict[str, float]) -> None:
        metric = common_pb2.Metric(job_id=self.job_id, step=step, source="trainer", values=values)
        await self.bus.publish(self.streams.metrics, metric)

    async def prompts(self) -> list[common_pb2.PromptTask]:
        return await stream_messages(self.bus, self.streams.prompts, common_pb2.PromptTask)

    async def state(self) -> str:
        return (await self.store.get(self.job_id)).state

    async def wait_for_state(self, state: str, timeout_s: float = 10.0) -> None:
        async def reached() -> bool:
            return await self.state() == state

        await eventually(reached, f"state {state}", timeout_s)

    async def wait_for_prompts(self, count: int) -> list[common_pb2.PromptTask]:
        async def issued() -> bool:
            return len(await self.prompts()) >= count

        await eventually(issued, f"{count} prompts")
        await asyncio.sleep(0.3)  # time for the controller to overshoot, if it would
        return await self.prompts()


async def submit(bus: Bus, directory: Path, engine: FakeRouter, **spec: Any) -> tuple[JobSpec, Trainer]:
    """A job whose engine (the fake router's) serves it."""
    job_spec = JobSpec.model_validate(
        {
            "name": "addition",
            "algorithm": {"group_size": 2, "max_staleness": 1},
            "rollout": {"prompts_per_step": 2, "max_new_tokens": 6, "temperature": 0.9},
            "trainer": {"steps": 4},
            "eval": {"every_steps": 2, "num_prompts": 12},
            **spec,
        }
    )
    store = JobStore(bus.redis)
    record = await store.create(job_spec)
    engine.job_id = record.job_id
    return job_spec, Trainer(bus, store, record.job_id, directory)


async def eval_points(store: JobStore, job_id: str) -> dict[int, float]:
    return {row.step: row.values["accuracy"] for row in await store.history(job_id, source="eval")}


async def test_paced_prompts_evals_and_success(
    bus: Bus,
    tokenizer_dir: Path,
    tokenizer: Any,
    services: Services,
    controllers: Controllers,
) -> None:
    fake_router = services[0]
    spec, trainer = await submit(bus, tokenizer_dir, services[0])
    await controllers.start()
    await asyncio.sleep(0.3)
    assert await trainer.state() == QUEUED and await trainer.prompts() == []

    await trainer.publish_version(0)
    await trainer.wait_for_state(RUNNING)
    # Version 0 is evaluated first; then batches 0 and 1 (k <= 0 + max_staleness), and no more.
    prompts = await trainer.wait_for_prompts(4)
    assert len(prompts) == 4
    assert (await eval_points(trainer.store, trainer.job_id)).keys() == {0}
    assert len(fake_router.requests) == 12 and all(r.sampling.temperature == 0 for r in fake_router.requests)
    first = prompts[0]
    assert (first.prompt_id, first.group_id) == (f"{trainer.job_id}:0:0", f"{trainer.job_id}:0:0")
    assert list(first.prompt_token_ids) == encode_prompt(tokenizer, first.prompt_text)
    assert first.answer == str(sum(int(x) for x in first.prompt_text.rstrip("=").split("+")))[::-1]
    assert (first.n_samples, first.sampling.n, first.sampling.max_new_tokens) == (2, 2, 6)
    assert first.sampling.temperature == pytest.approx(0.9) and first.split == common_pb2.SPLIT_TRAIN
    assert [p.prompt_id.split(":", 1)[1] for p in prompts] == ["0:0", "0:1", "1:0", "1:1"]

    # Batch 2 goes out as soon as the trainer publishes version 1, whatever the engines serve:
    # it names version 1 as the oldest that may sample it (the engines wait for it themselves).
    await trainer.publish_version(1)
    prompts = await trainer.wait_for_prompts(6)
    assert len(prompts) == 6 and [p.policy_version for p in prompts[4:]] == [1, 1]
    assert fake_router.version == 0, "issued while the engines still serve version 0"
    for version, issued in ((2, 8), (3, 8)):
        fake_router.version = version
        await trainer.publish_version(version)
        prompts = await trainer.wait_for_prompts(issued)
        assert len(prompts) == issued, f"at version {version}: never more than max_staleness ahead"
        assert prompts[-1].policy_version == min(version, 2)
    await asyncio.sleep(0.3)
    assert len(await trainer.prompts()) == 8, "trainer.steps batches in all"
    await trainer.bus.publish(
        trainer.streams.metrics,
        common_pb2.Metric(job_id=trainer.job_id, step=3, source="trainer", values={"loss": 0.125}),
    )
    await trainer.publish_version(4)
    await trainer.report(common_pb2.JOB_STATE_SUCCEEDED, 4)
    await asyncio.sleep(0.5)
    assert await trainer.state() == RUNNING, "the final eval waits for an engine serving version 4"
    fake_router.version = 4
    await trainer.wait_for_state(SUCCEEDED)

    record = await trainer.store.get(trainer.job_id)
    points = await eval_points(trainer.store, trainer.job_id)
    assert points == {v: pytest.approx(expected_accuracy(spec, v)) for v in (0, 2, 4)}
    assert 0.0 == points[0] < points[2] < points[4] == 1.0
    assert record.metrics["eval/accuracy"] == 1.0 and record.metrics["trainer/loss"] == 0.125
    assert (record.policy_version, record.reason) == (4, "")


async def test_a_trainer_failure_fails_the_job_and_stops_the_prompts(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    _, trainer = await submit(bus, tokenizer_dir, services[0], eval={"at_start": False})
    controller = await controllers.start()
    await trainer.publish_version(0)
    await trainer.wait_for_prompts(4)
    await trainer.report(common_pb2.JOB_STATE_FAILED, 0, "CUDA out of memory")
    await trainer.wait_for_state(FAILED)
    assert "CUDA out of memory" in (await trainer.store.get(trainer.job_id)).reason
    await trainer.publish_version(1)
    await asyncio.sleep(0.3)
    assert len(await trainer.prompts()) == 4, "no prompts for a failed job"
    assert controller.driven_jobs == []


async def test_a_trainer_failure_before_v0_fails_the_queued_job(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    _, trainer = await submit(bus, tokenizer_dir, services[0])
    await controllers.start()
    await trainer.report(common_pb2.JOB_STATE_FAILED, 0, "model path 'nope' does not exist")
    await trainer.wait_for_state(FAILED)
    assert "does not exist" in (await trainer.store.get(trainer.job_id)).reason


async def test_a_stalled_trainer_fails_the_job(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    _, trainer = await submit(bus, tokenizer_dir, services[0], eval={"at_start": False})
    await controllers.start(stall_timeout_s=1.0, stall_startup_s=1.0)
    await trainer.publish_version(0)
    await trainer.wait_for_state(RUNNING)
    await trainer.wait_for_state(FAILED, timeout_s=5.0)
    reason = (await trainer.store.get(trainer.job_id)).reason
    assert "no new policy version" in reason and "after version 0" in reason


async def test_reissued_versions_of_a_resumed_trainer_are_progress_and_resumes_alone_are_not(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    _, trainer = await submit(bus, tokenizer_dir, services[0], eval={"at_start": False})
    await controllers.start(stall_timeout_s=1.5, stall_startup_s=1.5, stall_step_factor=1.0)
    for version in (0, 1, 2):
        await trainer.publish_version(version, epoch=1)
    await trainer.wait_for_state(RUNNING)
    # Resumed from v1 as epoch 2: v1 again, then v2 again (other weights) is a new version.
    for version in (1, 2):
        await asyncio.sleep(0.7)
        await trainer.publish_version(version, epoch=2)
    await asyncio.sleep(0.9)  # 2.3s after the last new number, 0.9s after epoch 2's v2
    assert await trainer.state() == RUNNING
    # A trainer that dies right after each resume begins epochs without new versions: a stall.
    for epoch in (3, 4, 5):
        await trainer.publish_version(1, epoch=epoch)
        await asyncio.sleep(0.4)
    await trainer.wait_for_state(FAILED, timeout_s=5.0)
    assert "no new policy version" in (await trainer.store.get(trainer.job_id)).reason


async def test_a_slow_but_steady_job_runs_on_and_fails_once_it_stalls(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    """Steps of 1.5s against a 1s floor: the bound follows the job's pace (2 x its slowest step),
    so it runs on, and fails 2 x 1.5s after its last version, not 1s."""
    _, trainer = await submit(bus, tokenizer_dir, services[0], eval={"at_start": False, "every_steps": 0})
    await controllers.start(stall_timeout_s=1.0, stall_step_factor=2.0, stall_startup_s=3.0)
    await trainer.publish_version(0)
    await trainer.wait_for_state(RUNNING)
    for version in (1, 2, 3):
        await asyncio.sleep(1.5)  # past the floor: a fixed bound would have failed the job
        assert await trainer.state() == RUNNING, (await trainer.store.get(trainer.job_id)).reason
        await trainer.publish_version(version)
    last_version_at = asyncio.get_running_loop().time()
    await trainer.wait_for_state(FAILED, timeout_s=10.0)
    waited = asyncio.get_running_loop().time() - last_version_at
    assert waited > 2.2, f"failed {waited:.1f}s after the last version: the floor, not the pace"
    reason = (await trainer.store.get(trainer.job_id)).reason
    assert "no new policy version" in reason and "after version 3" in reason, reason
    assert "slowest recent step" in reason and "x 2" in reason, reason


async def test_prompts_issued_after_a_resume_name_the_new_lineage_and_its_version(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    """A trainer resumed from durable v1 after v2 publishes epoch 2's v1: a replacement prompt
    must ask for epoch 2's v1 or newer, not v2, which that lineage has not reached."""
    _, trainer = await submit(bus, tokenizer_dir, services[0], eval={"at_start": False})
    await controllers.start()
    for version in (0, 1, 2):
        await trainer.publish_version(version, epoch=1)
    issued = await trainer.wait_for_prompts(8)
    assert [(p.policy_epoch, p.policy_version) for p in issued][-2:] == [(1, 2), (1, 2)]
    await trainer.publish_version(1, epoch=2)
    await asyncio.sleep(0.3)
    await trainer.report_drops(1, stale=1)
    replacement = (await trainer.wait_for_prompts(9))[-1]
    assert replacement.attempt > 0 or "extra" in replacement.prompt_id
    assert (replacement.policy_epoch, replacement.policy_version) == (2, 1)


async def test_a_job_without_a_trainer_times_out_in_the_queue(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    _, trainer = await submit(bus, tokenizer_dir, services[0])
    controller = await controllers.start(queue_timeout_s=1.0)
    await trainer.wait_for_state(FAILED, timeout_s=5.0)
    assert "no checkpoint v0 within 1s (queue_timeout_s)" in (await trainer.store.get(trainer.job_id)).reason
    assert controller.driven_jobs == []


async def test_a_queued_job_gets_a_driver_only_once_its_trainer_speaks(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    _, trainer = await submit(bus, tokenizer_dir, services[0], eval={"at_start": False})
    _, silent = await submit(bus, tokenizer_dir, services[0])
    controller = await controllers.start()
    await asyncio.sleep(0.4)  # eight polls
    assert controller.driven_jobs == [] and await trainer.state() == QUEUED
    for job_id in (trainer.job_id, silent.job_id):  # no reads at all: no consumer group was made
        assert not await bus.redis.exists(
            *(getattr(JobStreams(job_id), kind) for kind in ("checkpoints", "status"))
        )
    await trainer.publish_version(0)
    await trainer.wait_for_state(RUNNING)
    assert controller.driven_jobs == [trainer.job_id] and await silent.state() == QUEUED


async def test_cancel_stops_the_prompts(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    _, trainer = await submit(bus, tokenizer_dir, services[0], eval={"at_start": False})
    controller = await controllers.start()
    await trainer.publish_version(0)
    await trainer.wait_for_prompts(4)
    assert await trainer.store.set_state(trainer.job_id, CANCELLED, "user") is True
    await eventually(lambda: _true(controller.driven_jobs == []), what="the driver to stop")
    await eventually(lambda: _true(services[0].aborted_jobs == [trainer.job_id]), what="its requests aborted")
    await trainer.publish_version(1)
    await asyncio.sleep(0.3)
    assert len(await trainer.prompts()) == 4
    assert await trainer.state() == CANCELLED
    assert services[0].aborted_jobs == [trainer.job_id], "once"


async def test_a_restarted_controller_carries_on_where_the_last_one_stopped(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    fake_router = services[0]
    _, trainer = await submit(bus, tokenizer_dir, services[0])
    first = await controllers.start(consumer="controller-before")
    await trainer.publish_version(0)
    await trainer.wait_for_prompts(4)
    await trainer.report_drops(0, stale=1)
    await trainer.wait_for_prompts(5)
    await controllers.stop(first)  # the api process goes away
    assert (await trainer.store.get(trainer.job_id)).dropped_groups == 1
    assert fake_router.aborted_jobs == [], "the job goes on: its requests are not aborted"

    await controllers.start(consumer="controller-after")
    fake_router.version = 1
    await trainer.publish_version(1)
    prompts = await trainer.wait_for_prompts(7)
    ids = [p.prompt_id.split(":", 1)[1] for p in prompts]
    assert ids == ["0:0", "0:1", "1:0", "1:1", "extra:0", "2:0", "2:1"], "nothing issued twice"
    assert len(fake_router.requests) == 12, "version 0 is not evaluated twice"
    assert len({p.prompt_text for p in prompts}) == 7, "the prompt sequence continues, not restarts"
    record = await trainer.store.get(trainer.job_id)
    assert (record.state, record.dropped_groups, record.issued_extra) == (RUNNING, 1, 1)


async def _true(value: bool) -> bool:
    return value


async def test_groups_the_trainer_dropped_are_replaced(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    _, trainer = await submit(bus, tokenizer_dir, services[0], eval={"at_start": False})
    await controllers.start()
    await trainer.publish_version(0)
    await trainer.wait_for_prompts(4)
    await trainer.report_drops(0, stale=2, invalid=1)
    prompts = await trainer.wait_for_prompts(7)
    assert len(prompts) == 7, "one replacement per dropped group, beyond the paced batches"
    assert [p.prompt_id for p in prompts[4:]] == [f"{trainer.job_id}:extra:{i}" for i in range(3)]
    assert all(p.n_samples == 2 and p.group_id == p.prompt_id for p in prompts[4:])
    assert len({p.prompt_text for p in prompts}) == 7
    await trainer.report_drops(1)
    await trainer.report_step_metric(1, {"loss": 0.5, "stale_groups_dropped": 2.0})  # a statistic only
    await asyncio.sleep(0.3)
    assert len(await trainer.prompts()) == 7
    record = await trainer.store.get(trainer.job_id)
    assert (record.issued_extra, record.dropped_groups) == (3, 3)
    await trainer.report_drops(1, zero_variance=1)  # an older trainer's count of its one filter
    assert len(await trainer.wait_for_prompts(8)) == 8
    await trainer.report_drops(1, filtered=2)  # what algorithm.filters dropped
    assert len(await trainer.wait_for_prompts(10)) == 10


async def test_an_oversampled_job_keeps_a_cushion_that_drops_refill(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    algorithm = {
        "group_size": 2,
        "max_staleness": 1,
        "filters": [{"type": "dynamic_sampling"}],
        "oversample": 0.5,
    }
    _, trainer = await submit(bus, tokenizer_dir, services[0], algorithm=algorithm, eval={"at_start": False})
    await controllers.start()
    await trainer.publish_version(0)
    prompts = await trainer.wait_for_prompts(5)  # two batches of 2, and half a batch more
    assert sorted(p.prompt_id.split(":", 1)[1] for p in prompts) == ["0:0", "0:1", "1:0", "1:1", "extra:0"]
    await trainer.report_drops(0, filtered=1)  # covered by the cushion; its replacement refills it
    assert len(await trainer.wait_for_prompts(6)) == 6
    await trainer.publish_version(1)
    assert len(await trainer.wait_for_prompts(8)) == 8  # batch 2
    await asyncio.sleep(0.3)
    assert len(await trainer.prompts()) == 8, "the cushion does not grow with the steps"


async def test_a_controller_that_died_before_acking_a_drop_replaces_it_once(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    """Of two GroupsDropped entries delivered to a controller that then died, it had counted
    (and so acked) one; its successor reclaims the other, and each group is replaced once."""
    _, trainer = await submit(bus, tokenizer_dir, services[0], eval={"at_start": False})
    first = await controllers.start(consumer="controller-before")
    await trainer.publish_version(0)
    await trainer.wait_for_prompts(4)
    await controllers.stop(first)
    # Two drops delivered to the old controller's consumer; it counts the first, then dies.
    streams = JobStreams(trainer.job_id)
    counted = await trainer.report_drops(0, stale=1)
    await trainer.report_drops(0, invalid=2)
    dead = await bus.read(streams.control, CONTROLLER_GROUP, "controller-before", common_pb2.TrainerSignal)
    assert len(dead) == 2
    assert await trainer.store.count_dropped(trainer.job_id, counted, 1) == 1

    await controllers.start(consumer="controller-after")  # reclaims after reclaim_idle_ms
    prompts = await trainer.wait_for_prompts(7)
    assert [p.prompt_id.split(":", 1)[1] for p in prompts[4:]] == ["extra:0", "extra:1", "extra:2"]
    record = await trainer.store.get(trainer.job_id)
    assert (record.dropped_groups, record.issued_extra) == (3, 3)
    assert await bus.pending_count(streams.control, CONTROLLER_GROUP) == 0


async def test_a_trainer_cancel_cancels_the_job(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    _, trainer = await submit(bus, tokenizer_dir, services[0], eval={"at_start": False})
    await controllers.start()
    await trainer.publish_version(0)
    await trainer.wait_for_state(RUNNING)
    await trainer.report(common_pb2.JOB_STATE_CANCELLED, 0, "stopped through Trainer.Stop")
    await trainer.wait_for_state(CANCELLED)
    assert "Trainer.Stop" in (await trainer.store.get(trainer.job_id)).reason


async def test_a_rejected_prompt_task_is_replaced_and_the_job_runs_on(
    bus: Bus,
    tokenizer_dir: Path,
    services: Services,
    controllers: Controllers,
) -> None:
    """One task the rollout side rejects is one prompt's worth of work lost: it is re-issued
    (another prompt of the feed), counted once, and the job is not failed for it."""
    _, trainer = await submit(bus, tokenizer_dir, services[0], eval={"at_start": False})
    await controllers.start()
    await trainer.publish_version(0)
    await trainer.wait_for_prompts(4)
    streams = JobStreams(trainer.job_id)
    await bus.ensure_group(streams.prompts, RUNNERS_GROUP)
    (delivery, *_) = await bus.read(
        streams.prompts, RUNNERS_GROUP, "r", common_pb2.PromptTask, count=1, block_ms=1000
    )
    reason = "invalid task: prompt (7 tokens) + max_new_tokens (64) = 71 exceeds the model's 32 positions"
    await bus.dead_letter(streams.prompts, RUNNERS_GROUP, "r", delivery, reason)
    prompts = await trainer.wait_for_prompts(5)
    assert [p.prompt_id for p in prompts[4:]] == [f"{trainer.job_id}:extra:0"]
    record = await trainer.store.get(trainer.job_id)
    assert (record.state, record.dropped_groups, record.issued_extra) == (RUNNING, 1, 1)
    assert await bus.pending_count(streams.dead, CONTROLLER_GROUP) == 0
    # the job's event log tells of it, without the entry's bytes
    [letter] = [e for e in await trainer.store.events.read(trainer.job_id) if e.kind == "dead_letter"]
    assert letter.data()["reason"] == reason and letter.message.dead_letter.payload == b""
