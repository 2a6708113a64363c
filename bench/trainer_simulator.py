"""A trainer that trains nothing, for bench/control_plane.py: it claims jobs, consumes and acks
their trajectories, and publishes a policy version per step, as a real trainer does towards
the control plane.

Benchmark-only. Like services/trainer (job.py, worker.py) it claims a job from ``verst:jobs``
(group ``trainers``; the submission is acked when the job ends), publishes the weights-only
handle of v0 (the base model's directory, its real sha256: the controller reads the tokenizer
there, the simulated engines take it at once), then for each of ``trainer.steps`` steps waits for
``rollout.prompts_per_step`` whole groups on the job's trajectories stream (group ``trainer``;
an entry delivered twice counts once), acks them, publishes the next version's handle and the
step's Metric (its stage times, as the real trainer's), and at the end the job's SUCCEEDED
status. It optimises nothing, so every step takes only the time its groups take to arrive.
It counts the groups and trajectories it acked, and sums their stage times, in the Redis hash
``ACKED_KEY``, which the benchmark reads.

    .venv/bin/python bench/trainer_simulator.py --redis-url redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.bus import Bus, Delivery, connect
from services.common.config import JobSpec
from services.common.consumer import StreamConsumer, consumer_name
from services.common.grpc_server import shutdown_event
from services.common.jobs import decode_submission
from services.common.pb import common_pb2
from services.common.streams import JOBS, TRAINER_GROUP, TRAINERS_GROUP, JobStreams
from services.models import resolve_model_path

log = logging.getLogger("trainer_simulator")

ACKED_KEY = "bench:control_plane:acked"
"""Hash of counters over every job: ``groups`` and ``trajectories`` acked, and for each of the
step Metric's stage times its sum over the groups (seconds)."""
POLL_BLOCK_MS = 500
STAGES = {
    "stage_queue_s": ("issued", "picked"),
    "stage_generate_s": ("picked", "generated"),
    "stage_score_s": ("generated", "scored"),
    "stage_publish_s": ("scored", "published"),
}
"""The per-stage times of a step's Metric, as services/trainer/report.py names them."""
Trajectory = common_pb2.Trajectory


def weights_handle(job_id: str, spec: JobSpec) -> common_pb2.CheckpointHandle:
    """v0's handle: the base model's directory as the files, its weights' sha256 and size."""
    directory = resolve_model_path(spec.model.path, spec.model.gguf_file)
    weights = (directory / "model.safetensors").read_bytes()
    return common_pb2.CheckpointHandle(
        job_id=job_id,
        uri=directory.as_uri(),
        format="safetensors",
        sha256=hashlib.sha256(weights).hexdigest(),
        size_bytes=len(weights),
        epoch=1,
        dtype=spec.model.dtype,
    )


class Steps:
    """Whole groups as they arrive: a group is whole with ``group_size`` distinct samples."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self._open: dict[str, dict[int, Delivery[Trajectory]]] = {}
        self._whole: list[dict[int, Delivery[Trajectory]]] = []
        self.extra: list[Delivery[Trajectory]] = []
        """Entries delivered twice (or a sample already had): acked with the next step."""

    def add(self, delivery: Delivery[Trajectory]) -> None:
        sample = delivery.message
        group = self._open.setdefault(sample.group_id, {})
        if sample.sample_index in group:
            self.extra.append(delivery)
            return
        group[sample.sample_index] = delivery
        if len(group) == self.group_size:
            self._whole.append(self._open.pop(sample.group_id))

    def take(self, groups: int) -> list[list[Delivery[Trajectory]]] | None:
        """``groups`` whole groups, oldest first, or None while fewer are whole."""
        if len(self._whole) < groups:
            return None
        taken, self._whole = self._whole[:groups], self._whole[groups:]
        return [list(group.values()) for group in taken]


def stage_values(groups: list[list[Delivery[Trajectory]]], now: float) -> dict[str, float]:
    """Mean seconds of each stage over the step's groups (their first sample's stamps)."""
    stamps = [group[0].message.stages for group in groups]
    stamps = [s for s in stamps if s.issued > 0 and s.published > 0]
    if not stamps:
        return {}
    values = {
        name: statistics.fmean(getattr(s, end) - getattr(s, start) for s in stamps)
        for name, (start, end) in STAGES.items()
    }
    values["stage_deliver_s"] = statistics.fmean(now - s.published for s in stamps)
    return values


async def train_job(bus: Bus, name: str, job_id: str, spec: JobSpec, stop: asyncio.Event) -> bool:
    """Run the job's steps; True when it reached ``trainer.steps``."""
    streams = JobStreams(job_id)
    handle = await asyncio.to_thread(weights_handle, job_id, spec)
    handle.created_at.GetCurrentTime()
    await bus.publish(streams.checkpoints, handle)
    log.info("job %s: published v0", job_id)
    consumer = StreamConsumer(
        bus, streams.trajectories, TRAINER_GROUP, name, Trajectory, count=256, block_ms=POLL_BLOCK_MS
    )
    steps = Steps(spec.algorithm.group_size)
    version, waited = 0, time.monotonic()
    while version < spec.trainer.steps:
        if stop.is_set():
            return False
        for delivery in await consumer.poll():
            steps.add(delivery)
        while version < spec.trainer.steps and (groups := steps.take(spec.rollout.prompts_per_step)):
            version += 1
            await step(bus, consumer, handle, version, groups, steps, time.monotonic() - waited)
            waited = time.monotonic()
    return True


async def step(
    bus: Bus,
    consumer: StreamConsumer[Trajectory],
    handle: common_pb2.CheckpointHandle,
    version: int,
    groups: list[list[Delivery[Trajectory]]],
    steps: Steps,
    wait_s: float,
) -> None:
    """Ack the step's groups, publish ``version``'s handle, count the groups, report the step."""
    deliveries = [d for group in groups for d in group] + steps.extra
    steps.extra = []
    stages = stage_values(groups, time.time())
    await consumer.ack(deliveries)
    handle.version, handle.step = version, version
    handle.created_at.GetCurrentTime()
    await bus.publish(JobStreams(handle.job_id).checkpoints, handle)
    pipe = bus.redis.pipeline(transaction=False)
    pipe.hincrby(ACKED_KEY, "groups", len(groups))
    pipe.hincrby(ACKED_KEY, "trajectories", len(deliveries))
    for name, mean in stages.items():  # sums over groups: the benchmark's means over its window
        pipe.hincrbyfloat(ACKED_KEY, name, mean * len(groups))
    await pipe.execute()
    values = {"wait_seconds": wait_s, "groups": float(len(groups)), **stages}
    await bus.publish_metric(handle.job_id, "trainer", values, step=version, policy_version=version)


async def finish(bus: Bus, job_id: str, steps: int) -> None:
    status = common_pb2.JobStatus(
        job_id=job_id, state=common_pb2.JOB_STATE_SUCCEEDED, policy_version=steps, step=steps
    )
    status.updated_at.GetCurrentTime()
    await bus.publish(JobStreams(job_id).status, status)


async def run(redis_url: str) -> None:
    """Claim and run jobs until SIGTERM or SIGINT."""
    stop = shutdown_event()
    redis = connect(redis_url)
    bus = Bus(redis)
    name = consumer_name("trainer-simulator")
    jobs = StreamConsumer(bus, JOBS, TRAINERS_GROUP, name, common_pb2.JobSubmission, count=1, block_ms=500)
    try:
        while not stop.is_set():
            for delivery in await jobs.poll():
                job_id, spec = decode_submission(delivery.message)
                log.info("claimed job %s", job_id)
                if await train_job(bus, name, job_id, spec, stop):
                    await finish(bus, job_id, spec.trainer.steps)
                    await jobs.ack([delivery])
    finally:
        await redis.aclose()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--redis-url", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer_simulator %(levelname)s %(message)s")
    asyncio.run(run(args.redis_url))


if __name__ == "__main__":
    main()
