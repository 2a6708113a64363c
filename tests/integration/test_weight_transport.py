"""The distributed weight transport between a real trainer and a real torch engine, over gloo on
127.0.0.1: the engine serves the trained versions received over the group; when the group
cannot form (an engine in the registry that never joins) the engine loads the handle's files
and says so; the next version forms a new group and is broadcast again; the one after it
comes over that same group."""

from __future__ import annotations

import time
from pathlib import Path

from safetensors.torch import load_file

from services.common.bus import Bus
from services.common.engine_registry import EngineRegistry
from services.common.pb import common_pb2
from services.common.streams import JobStreams
from tests.helpers import eventually
from tests.integration.rollout_helpers import RunningEngine, start_engine, start_job
from tests.integration.test_trainer import (
    checkpoint,
    job_spec,
    make_group,
    model_dir,  # noqa: F401 (a fixture)
    submit,
    trainer,
)

ENGINE = "engine-t"
GHOST = "engine-ghost"
DEADLINE_S = 4.0
"""The rounds' deadline: how long the failing case waits for the ghost."""


def loads(engine: RunningEngine, transport: str) -> float:
    value = engine.app.metrics.registry.get_sample_value(
        "verst_engine_weight_transport_loads_total", {"transport": transport}
    )
    return value or 0.0


def fallbacks(engine: RunningEngine) -> float:
    registry = engine.app.metrics.registry
    return registry.get_sample_value("verst_engine_weight_transport_fallbacks_total") or 0.0


async def loads_come_to(engine: RunningEngine, distributed: int, filesystem: int, fallback: int) -> None:
    """The engine's load counters reach these counts (a load is counted just after its version
    is served, so a status read can see the version first)."""

    async def counted() -> bool:
        return (loads(engine, "distributed"), loads(engine, "filesystem"), fallbacks(engine)) == (
            distributed,
            filesystem,
            fallback,
        )

    await eventually(counted, timeout_s=5, what=f"loads {(distributed, filesystem, fallback)}")


def served_weights_equal_the_files(engine: RunningEngine, handle: common_pb2.CheckpointHandle) -> bool:
    loaded = engine.app.engine._loaded  # the worker is idle: nothing is generating
    assert loaded is not None
    served = loaded.model.state_dict()
    files = load_file(str(Path(handle.uri.removeprefix("file://")) / "model.safetensors"))
    return all(served[name].equal(tensor) for name, tensor in files.items())


async def train_one_step(bus: Bus, job_id: str, version: int, weights: Path) -> common_pb2.CheckpointHandle:
    """Two groups sampled by ``version`` (its ``weights``): the trainer publishes version + 1."""
    groups = [make_group(job_id, f"s{version}g{i}", (1.0, 0.0), version, weights) for i in range(2)]
    await bus.publish_many(JobStreams(job_id).trajectories, [t for group in groups for t in group])
    return await checkpoint(bus, job_id, version + 1)


def directory(handle: common_pb2.CheckpointHandle) -> Path:
    return Path(handle.uri.removeprefix("file://"))


async def test_versions_come_over_the_group_and_a_failed_group_falls_back_to_the_files(
    bus: Bus,
    redis_url: str,
    model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    job_id = "transport-0001"
    registry = EngineRegistry(bus.redis)
    engine = await start_engine(redis_url, engine_id=ENGINE, weight_transport_host="127.0.0.1")
    settings = {
        "weight_transport": "distributed",
        "weight_transport_host": "127.0.0.1",
        "weight_transport_deadline_s": DEADLINE_S,
        "weight_transport_bucket_bytes": 8192,  # several buckets per version
    }
    try:
        await start_job(bus.redis, job_id)
        async with trainer(bus, **settings) as _:
            await submit(bus, job_id, job_spec(model_dir, tmp_path / "runs", steps=4))
            v0 = await checkpoint(bus, job_id, 0)
            assert not v0.HasField("broadcast")  # a new model for the engines: files only
            await engine.wait_for_version(0, timeout_s=60)

            async def serving_the_job() -> bool:
                info = await registry.get(ENGINE)
                return info is not None and info.job_id == job_id and "distributed" in info.weight_transports

            await eventually(serving_the_job, "the engine's heartbeat with the job")

            # v1 over the group.
            v1 = await train_one_step(bus, job_id, 0, directory(v0))
            assert list(v1.broadcast.engine_ids) == [ENGINE] and v1.broadcast.backend == "gloo"
            await engine.wait_for_version(1, timeout_s=30)
            await loads_come_to(engine, 1, 1, 0)
            assert served_weights_equal_the_files(engine, v1)

            # An engine the registry lists that never joins: the group cannot form by its deadline.
            ghost = common_pb2.EngineInfo(engine_id=GHOST, job_id=job_id, weight_transports=["distributed"])
            await registry.heartbeat(ghost, now=time.time() + 60)
            started = time.monotonic()
            v2 = await train_one_step(bus, job_id, 1, directory(v1))
            assert list(v2.broadcast.engine_ids) == [GHOST, ENGINE]
            assert v2.broadcast.group_name != v1.broadcast.group_name
            await engine.wait_for_version(2, timeout_s=30)
            assert time.monotonic() - started >= DEADLINE_S * 0.9  # it waited for the round first
            await loads_come_to(engine, 1, 2, 1)
            assert served_weights_equal_the_files(engine, v2)

            # The ghost is gone: v3 forms a new group of the engine alone and comes over it.
            await registry.remove(GHOST)
            v3 = await train_one_step(bus, job_id, 2, directory(v2))
            assert list(v3.broadcast.engine_ids) == [ENGINE]
            assert v3.broadcast.group_name not in (v1.broadcast.group_name, v2.broadcast.group_name)
            await engine.wait_for_version(3, timeout_s=30)
            await loads_come_to(engine, 2, 2, 1)
            assert served_weights_equal_the_files(engine, v3)

            # Same members, no failure: v4 comes over the same group, which the engine kept.
            joined = engine.app.receiver and engine.app.receiver._group
            v4 = await train_one_step(bus, job_id, 3, directory(v3))
            assert v4.broadcast.group_name == v3.broadcast.group_name
            await engine.wait_for_version(4, timeout_s=30)
            await loads_come_to(engine, 3, 2, 1)
            assert engine.app.receiver is not None and engine.app.receiver._group is joined
            assert served_weights_equal_the_files(engine, v4)
    finally:
        await engine.stop()
