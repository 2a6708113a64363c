"""A consumer killed with SIGKILL mid-batch loses nothing: another reclaims its pending entries."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

from services.common.bus import Bus
from services.common.consumer import StreamConsumer
from services.common.pb import common_pb2
from services.common.streams import JobStreams

from .test_bus import trajectory

HERE = Path(__file__).parent


async def test_killed_consumer_loses_nothing(
    bus: Bus, redis_url: str, tmp_path: Path, python: str, python_env: dict[str, str]
) -> None:
    stream, group = JobStreams("job-1").trajectories, "trainer"  # the job of test_bus.trajectory
    await bus.ensure_group(stream, group)
    await bus.publish_many(stream, [trajectory(i) for i in range(100)])
    done_file = tmp_path / "victim.txt"

    victim = subprocess.Popen(
        [python, str(HERE / "crashing_consumer.py"), redis_url, stream, group, str(done_file), "50", "20"],
        env=python_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(victim.stdout.readline), timeout=30)  # type: ignore[union-attr]
        assert line.strip() == "READY 50"
    finally:
        victim.kill()
        victim.wait(timeout=10)
    committed_by_victim = done_file.read_text().split()
    assert len(committed_by_victim) == 20
    assert await bus.pending_count(stream, group) == 30  # taken, not acked, owner dead

    survivor = StreamConsumer(
        bus, stream, group, "survivor", common_pb2.Trajectory, count=16, block_ms=100,
        reclaim_idle_ms=300, reclaim_every_s=0.1,
    )  # fmt: skip
    processed: list[str] = []
    reclaimed_counts: list[int] = []
    async with asyncio.timeout(30):
        while len(committed_by_victim) + len(processed) < 100:
            batch = await survivor.poll()
            processed += [d.message.id for d in batch]
            reclaimed_counts += [d.delivery_count for d in batch if d.delivery_count > 1]
            await survivor.ack(batch)

    everything = committed_by_victim + processed
    assert sorted(everything) == sorted(f"traj-{i}" for i in range(100))  # nothing lost, nothing twice
    assert reclaimed_counts == [2] * 30
    assert await bus.pending_count(stream, group) == 0
