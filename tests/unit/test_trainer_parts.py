"""The trainer's parts that need neither Redis nor a model: the group collector, the checkpoint
store and the learning-rate schedule."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from services.common.bus import Delivery
from services.common.config import TrainerConfig
from services.common.pb import common_pb2
from services.trainer.checkpoints import CheckpointStore
from services.trainer.collector import GroupCollector, Outcome
from services.trainer.policy import learning_rate_schedule


def trajectory(group: str, index: int, *, version: int = 0, reward: float = 0.0, **fields: Any) -> Any:
    values: dict[str, Any] = {
        "id": f"{group}:{index}",
        "job_id": "job",
        "prompt_id": group,
        "group_id": group,
        "sample_index": index,
        "group_size": 2,
        "prompt_token_ids": [1, 20, 21],
        "response_token_ids": [22, 2],
        "behaviour_logprobs": [-1.0, -2.0],
        "loss_mask": [True, True],
        "policy_versions": [version, version],
        "reward": reward,
    }
    return common_pb2.Trajectory(**(values | fields))


def delivered(message: common_pb2.Trajectory, entry: int) -> Delivery[common_pb2.Trajectory]:
    return Delivery("stream", f"{entry}-0", message, 1)


def test_collector_completes_groups_and_skips_what_it_has_seen() -> None:
    trained: set[str] = {"old:0"}
    collector = GroupCollector("job", 2, trained)
    assert collector.add(delivered(trajectory("old", 0), 1)) == (Outcome.DONE, "")
    assert collector.add(delivered(trajectory("a", 0), 2))[0] is Outcome.BUFFERED
    assert collector.add(delivered(trajectory("a", 0), 3))[0] is Outcome.REDELIVERED
    assert collector.complete == 0
    assert collector.add(delivered(trajectory("a", 1), 4))[0] is Outcome.BUFFERED
    assert collector.complete == 1
    assert sorted(collector.buffered_entry_ids()) == ["2-0", "3-0", "4-0"]
    [group] = collector.take(1)
    assert [t.id for t in group.ordered()] == ["a:0", "a:1"]
    assert len(group.deliveries) == 3
    late = collector.add(delivered(trajectory("a", 1, id="a:9"), 5))
    assert late[0] is Outcome.REJECTED and "already had 2 members" in late[1]
    assert collector.add(delivered(trajectory("a", 1), 6))[0] is Outcome.DONE


def test_collector_drops_stale_and_invalid_groups() -> None:
    collector = GroupCollector("job", 2, set())
    for index in range(2):
        collector.add(delivered(trajectory("stale", index, version=3), index))
        collector.add(delivered(trajectory("fresh", index, version=4), 10 + index))
    collector.add(delivered(trajectory("bad", 0, reward_error="verifier timed out"), 20))
    collector.add(delivered(trajectory("bad", 1, loss_mask=[True]), 21))
    unusable = collector.discard_unusable(min_version=4)
    assert [g.group_id for g in unusable.stale] == ["stale"]
    [bad] = unusable.invalid
    assert "scoring failed: verifier timed out" in bad.problems[0]
    assert "2 response tokens but loss_mask has 1" in bad.problems[1]
    assert [g.group_id for g in collector.take(5)] == ["fresh"]
    assert collector.add(delivered(trajectory("", 0, id="x"), 30))[0] is Outcome.REJECTED


def test_checkpoint_store_writes_atomically_and_prunes(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "job", keep=2)

    def write(directory: Path) -> None:
        save_file({"w": torch.arange(4.0)}, str(directory / "model.safetensors"))

    for version in range(5):
        saved = store.save(version, version, write, {f"t{version}"})
        assert saved.directory == tmp_path.resolve() / "job" / f"v{version:06d}"
    with pytest.raises(FileExistsError):
        store.save(4, 4, write, [])
    (store.job_dir / ".v000005.tmp-1").mkdir()
    assert store.prune() == [1, 2]
    assert store.versions() == [0, 3, 4]
    latest = store.latest()
    assert latest is not None and latest.handle.version == 4 and latest.trained_ids == {"t4"}
    digest = hashlib.sha256((latest.directory / "model.safetensors").read_bytes()).hexdigest()
    assert latest.handle.sha256 == digest
    store.remove_partial()
    assert not any(p.name.startswith(".") for p in store.job_dir.iterdir())
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        store.save(9, 9, lambda directory: None, [])
    assert store.versions() == [0, 3, 4]


def test_a_resumed_schedule_carries_on_where_it_was() -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    config = TrainerConfig(steps=10, learning_rate=1.0, warmup_steps=2, scheduler="linear")
    assert learning_rate_schedule(optimizer, config, 3).get_last_lr() == [pytest.approx(7 / 8)]
