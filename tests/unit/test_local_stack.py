"""The local stack's plan for N trainers (`verst up --trainers N`): names, ports, threads."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import parser
from services.stack import Stack, StackConfig, thread_split


def planned(trainers: int, tmp_path: Path) -> list[tuple[str, dict[str, str]]]:
    stack = Stack(StackConfig(log_dir=tmp_path, trainers=trainers, trainer_port=0, engine_port=0))
    stack.redis_url = "redis://127.0.0.1:1/0"  # planned only: nothing starts
    return [(child.name, child.env) for child in stack._plan()]


def test_each_trainer_has_its_own_name_and_port(tmp_path: Path) -> None:
    children = dict(planned(3, tmp_path))
    trainers = [name for name in children if name.startswith("trainer")]
    assert trainers == ["trainer-0", "trainer-1", "trainer-2"]
    ports = {children[name]["VERST_TRAINER_PORT"] for name in trainers}
    assert len(ports) == 3 and "0" not in ports


def test_no_trainer_leaves_the_jobs_to_another_process(tmp_path: Path) -> None:
    names = [name for name, _ in planned(0, tmp_path)]
    assert not [name for name in names if name.startswith("trainer")]
    assert "api" in names and "engine-0" in names


@pytest.mark.parametrize(
    ("trainers", "cores", "trainer"),
    [(1, 2, 2), (2, 8, 4), (16, 2, 1), (3, 8, 2), (0, 4, 4)],
)
def test_the_trainers_share_the_cores(trainers: int, cores: int, trainer: int) -> None:
    assert thread_split(1, cores, trainers)["VERST_TRAINER_TORCH_THREADS"] == str(trainer)


def test_verst_up_takes_a_trainer_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert parser().parse_args(["up", "--trainers", "16"]).trainers == 16
    assert parser().parse_args(["up"]).trainers == 1
    with pytest.raises(SystemExit):
        parser().parse_args(["up", "--trainers", "-1"])
    assert "must be 0 or more" in capsys.readouterr().err
