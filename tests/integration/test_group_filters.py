"""A job's group filters in a real trainer through Redis: a user's filter, named by its dotted path,
and a built-in drop groups in order; each drop is reported to the controller at once and counted
per filter in the step's metrics, and the replacements the pacing rule issues fill the steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.common.bus import Bus
from services.common.pb import common_pb2
from services.common.streams import JobStreams
from services.controller.pacing import plan_issue
from services.trainer.job import TRAJECTORY_GROUP
from tests.helpers import eventually, lineage_trained_ids, metrics_of
from tests.integration.test_trainer import (
    checkpoint,
    final_status,
    make_group,
    model_dir,  # noqa: F401 (a fixture)
    submit,
    trainer,
    trainer_signals,
)

PLUGIN = "tests.plugins.filters:keep_rewarded"


def filtered_job(model: Path, runs: Path, filters: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": "filtered",
        "model": {"path": str(model)},
        "algorithm": {"group_size": 2, "max_staleness": 0, "filters": filters},
        "rollout": {"prompts_per_step": 2, "max_new_tokens": 8},
        "trainer": {"steps": 2, "learning_rate": 1e-3, "micro_batch_tokens": 32,
                    "checkpoint_dir": str(runs), "keep_checkpoints": 1},
    }  # fmt: skip


async def filtered_so_far(bus: Bus, job_id: str, at_least: int) -> int | None:
    dropped = sum(s.groups_dropped.filtered for s in await trainer_signals(bus, job_id))
    return dropped if dropped >= at_least else None


async def test_a_users_filter_drops_groups_that_are_reported_and_replaced(
    bus: Bus,
    model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    job_id, runs, streams = "filtered-0001", tmp_path / "runs", JobStreams("filtered-0001")
    filters = [{"type": PLUGIN, "at_least": 0.5}, {"type": "zero_variance"}]
    async with trainer(bus):
        await submit(bus, job_id, filtered_job(model_dir, runs, filters))
        v0 = Path((await checkpoint(bus, job_id, 0)).uri.removeprefix("file://"))
        # Step 1 takes its groups in order: "cold" is never rewarded (the user's filter drops it),
        # "flat" always (zero_variance drops it), so it trains g0 and g1.
        groups = {"g0": (1.0, 0.0), "cold": (0.0, 0.0), "flat": (1.0, 1.0), "g1": (0.0, 1.0)}
        for group, rewards in groups.items():
            await bus.publish_many(streams.trajectories, make_group(job_id, group, rewards, 0, v0))
        dropped = await eventually(lambda: filtered_so_far(bus, job_id, 2), "two filtered groups reported")
        plan = plan_issue(issued_batches=2, issued_extra=0, dropped=dropped, trainer_version=1,
                          max_staleness=0, steps=2, prompts_per_step=2, oversample=0.0)  # fmt: skip
        assert plan.replacements == 2
        v1 = Path((await checkpoint(bus, job_id, 1)).uri.removeprefix("file://"))
        for group, rewards in {"r0": (1.0, 0.0), "r1": (0.0, 1.0)}.items():
            await bus.publish_many(streams.trajectories, make_group(job_id, group, rewards, 1, v1))
        await checkpoint(bus, job_id, 2)
        assert (await final_status(bus, job_id)).state == common_pb2.JOB_STATE_SUCCEEDED
    trained = lineage_trained_ids(runs / job_id)
    assert sorted(trained) == sorted(f"{g}:{i}" for g in ("g0", "g1", "r0", "r1") for i in range(2))
    assert await bus.pending_count(streams.trajectories, TRAJECTORY_GROUP) == 0  # dropped ones acked
    metrics = await metrics_of(bus, job_id)
    assert metrics[1][f"groups_filtered/{PLUGIN}"] == metrics[1]["groups_filtered/zero_variance"] == 1
    assert metrics[1]["groups_filtered"] == 2 and metrics[2]["groups_filtered"] == 0
    assert metrics[2][f"groups_filtered/{PLUGIN}"] == 0  # every step reports every filter


async def test_a_filter_that_cannot_run_fails_its_job_with_the_reason(
    bus: Bus,
    model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    bad = {
        "no-module": ([{"type": "tests.plugins.nothing:keep"}], "cannot import 'tests.plugins.nothing'"),
        "no-option": (
            [{"type": PLUGIN, "most": 1}],
            "algorithm.filters.0 (tests.plugins.filters:keep_rewarded)",
        ),
    }
    async with trainer(bus):
        for job_id, (filters, _) in bad.items():
            await submit(bus, job_id, filtered_job(model_dir, tmp_path / "runs", filters))
        for job_id, (_, reason) in bad.items():
            status = await final_status(bus, job_id)
            assert status.state == common_pb2.JOB_STATE_FAILED and reason in status.reason, status.reason
