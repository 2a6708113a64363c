"""The controller writes every metric row it merges to the job's TensorBoard event files, against
real Redis: a restarted controller fills in what its predecessor merged but did not write, and
writes nothing twice. (The test plays the trainer, as test_controller.py's do.)"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from services.common.bus import Bus
from services.common.jobs import RUNNING
from services.common.pb import common_pb2
from services.common.streams import dead_letter_stream
from services.common.tracking_config import TENSORBOARD_DIR
from services.controller.trackers import scalar_events
from tests.helpers import eventually, stream_messages
from tests.integration.test_controller import (  # noqa: F401  (fixtures)
    Controllers,
    Services,
    Trainer,
    controllers,
    services,
    submit,
)


def reward(step: int) -> float:
    return 0.1 * step + 0.01


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    found: dict[str, list[tuple[int, float]]] = {}
    for tag, step, value, _ in scalar_events(directory):
        found.setdefault(tag, []).append((step, value))
    return {tag: sorted(points) for tag, points in found.items()}


async def merged_steps(trainer: Trainer, count: int) -> None:
    async def merged() -> bool:
        return len(await trainer.store.history(trainer.job_id, source="trainer")) >= count

    await eventually(merged, f"{count} trainer rows merged")


async def test_a_restarted_controller_tracks_each_merged_row_once(
    bus: Bus,
    tmp_path: Path,
    tokenizer_dir: Path,
    services: Services,  # noqa: F811
    controllers: Controllers,  # noqa: F811
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    trainer_config = {"steps": 8, "checkpoint_dir": str(runs)}
    evals = {"at_start": False, "every_steps": 0, "num_prompts": 12}
    _, trainer = await submit(bus, tokenizer_dir, services[0], trainer=trainer_config, eval=evals)
    first = await controllers.start(consumer="controller-before")
    await trainer.publish_version(0)
    await trainer.wait_for_state(RUNNING)
    for step in (1, 2):
        await trainer.report_step_metric(step, {"reward_mean": reward(step)})
    await merged_steps(trainer, 2)
    await controllers.stop(first)  # its driver closes the event files
    directory = runs / trainer.job_id / TENSORBOARD_DIR
    assert scalars(directory)["trainer/reward_mean"] == [(s, float(np.float32(reward(s)))) for s in (1, 2)]

    # merged by a controller that died before it wrote them to its trackers
    await trainer.store.merge_metrics(trainer.job_id, {"reward_mean": reward(3)}, step=3, source="trainer")
    second = await controllers.start(consumer="controller-after")
    await trainer.report_step_metric(4, {"reward_mean": reward(4), "kl": math.nan})  # refused whole
    await trainer.report_step_metric(4, {"reward_mean": reward(4)})
    await merged_steps(trainer, 4)
    await controllers.stop(second)

    expected = [(s, float(np.float32(reward(s)))) for s in (1, 2, 3, 4)]
    assert scalars(directory) == {"trainer/reward_mean": expected}, "each step once, the NaN row not at all"
    [letter] = await stream_messages(bus, dead_letter_stream(trainer.streams.metrics), common_pb2.DeadLetter)
    assert "must be finite numbers, not trainer/kl=nan" in letter.reason
    events = await trainer.store.events.read(trainer.job_id)
    assert not [e for e in events if e.kind == "warning"], "the trackers saw no NaN"
