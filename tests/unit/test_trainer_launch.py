"""services/trainer/launch.py: a StatefulSet pod's ordinal and the VERST_TRAINER_* launch
settings make the right torchrun command (or the trainer alone), and bad settings exit naming
the variable. Two launches that really train together: tests/integration/test_trainer_launch.py."""

from __future__ import annotations

import pytest

from services.trainer.launch import (
    DEFAULT_TARGET,
    LaunchSettings,
    describe,
    launch_argv,
    load_launch_settings,
    placement,
    target_of,
)

PY = "/usr/bin/python3"
TEMPLATE = "verst-trainer-{index}.verst-trainer-headless"


def settings(**values: object) -> LaunchSettings:
    return LaunchSettings.model_validate(values)


@pytest.mark.parametrize(
    ("index", "nodes", "expected"),
    [
        (0, 1, (0, 0, "verst-trainer-0.verst-trainer-headless")),
        (3, 1, (3, 0, "verst-trainer-3.verst-trainer-headless")),
        (0, 2, (0, 0, "verst-trainer-0.verst-trainer-headless")),
        (1, 2, (0, 1, "verst-trainer-0.verst-trainer-headless")),
        (2, 2, (1, 0, "verst-trainer-2.verst-trainer-headless")),
        (5, 2, (2, 1, "verst-trainer-4.verst-trainer-headless")),
        (7, 4, (1, 3, "verst-trainer-4.verst-trainer-headless")),
        (8, 4, (2, 0, "verst-trainer-8.verst-trainer-headless")),
    ],
)
def test_the_ordinal_gives_the_group_the_node_rank_and_the_first_pod(
    index: int, nodes: int, expected: tuple[int, int, str]
) -> None:
    place = placement(settings(pod_index=index, nodes=nodes, rendezvous_host_template=TEMPLATE))
    assert (place.group, place.node_rank, place.master_host) == expected


def test_one_node_of_one_process_runs_the_trainer_itself() -> None:
    alone = settings()
    assert launch_argv(alone, DEFAULT_TARGET, PY) == [PY, "-m", "services.trainer"]
    assert launch_argv(settings(pod_index=4), ["job.py", "--x"], PY) == [PY, "job.py", "--x"]


def test_one_node_of_several_processes_is_a_standalone_torchrun() -> None:
    argv = launch_argv(settings(procs_per_node=4), DEFAULT_TARGET, PY)
    assert argv == [
        PY, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc_per_node=4",
        "-m", "services.trainer",
    ]  # fmt: skip


def test_several_nodes_meet_at_their_groups_first_pod() -> None:
    pod = settings(
        pod_index=5, nodes=2, procs_per_node=8, rendezvous_host_template=TEMPLATE, rendezvous_port=29600
    )
    assert launch_argv(pod, DEFAULT_TARGET, PY) == [
        PY, "-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1", "--nproc_per_node=8",
        "--master_addr=verst-trainer-4.verst-trainer-headless", "--master_port=29600",
        "--rdzv_conf=timeout=900", "-m", "services.trainer",
    ]  # fmt: skip
    assert "node 1 of 2 in trainer group 2" in describe(pod, [PY])
    fixed = settings(pod_index=1, nodes=2, rendezvous_host_template="10.0.0.7")  # no {index}: one host
    assert "--master_addr=10.0.0.7" in launch_argv(fixed, DEFAULT_TARGET, PY)


def test_the_target_is_the_command_line_or_the_trainer() -> None:
    assert target_of([]) == ["-m", "services.trainer"]
    assert target_of(["--"]) == ["-m", "services.trainer"]
    assert target_of(["--", "-m", "pkg.mod", "--flag"]) == ["-m", "pkg.mod", "--flag"]
    assert target_of(["script.py", "a"]) == ["script.py", "a"]
    with pytest.raises(SystemExit, match="needs a module"):
        target_of(["-m"])


def test_settings_come_from_the_variables_the_chart_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "VERST_TRAINER_POD_INDEX": "3",
        "VERST_TRAINER_NODES": "2",
        "VERST_TRAINER_PROCS_PER_NODE": "4",
        "VERST_TRAINER_RENDEZVOUS_HOST_TEMPLATE": TEMPLATE,
        "VERST_TRAINER_RENDEZVOUS_PORT": "29501",
    }.items():
        monkeypatch.setenv(name, value)
    loaded = load_launch_settings()
    assert (loaded.pod_index, loaded.nodes, loaded.procs_per_node) == (3, 2, 4)
    assert (loaded.rendezvous_host_template, loaded.rendezvous_port) == (TEMPLATE, 29501)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        (
            {"VERST_TRAINER_NODES": "2", "VERST_TRAINER_RENDEZVOUS_HOST_TEMPLATE": "h"},
            "VERST_TRAINER_POD_INDEX",
        ),
        (
            {"VERST_TRAINER_NODES": "2", "VERST_TRAINER_POD_INDEX": "1"},
            "VERST_TRAINER_RENDEZVOUS_HOST_TEMPLATE",
        ),
        ({"VERST_TRAINER_NODES": "0"}, "VERST_TRAINER_NODES"),
        ({"VERST_TRAINER_POD_INDEX": "-1"}, "VERST_TRAINER_POD_INDEX"),
        ({"VERST_TRAINER_POD_INDEX": "web-3"}, "VERST_TRAINER_POD_INDEX"),
        ({"VERST_TRAINER_PROCS_PER_NODE": "0"}, "VERST_TRAINER_PROCS_PER_NODE"),
        ({"VERST_TRAINER_RENDEZVOUS_PORT": "70000"}, "VERST_TRAINER_RENDEZVOUS_PORT"),
        (
            {"VERST_TRAINER_RENDEZVOUS_HOST_TEMPLATE": "t-{ordinal}.svc"},
            "VERST_TRAINER_RENDEZVOUS_HOST_TEMPLATE",
        ),
        ({"VERST_TRAINER_RENDEZVOUS_HOST_TEMPLATE": "a b"}, "VERST_TRAINER_RENDEZVOUS_HOST_TEMPLATE"),
    ],
)
def test_a_bad_setting_exits_naming_its_variable(
    env: dict[str, str], named: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        load_launch_settings()
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
