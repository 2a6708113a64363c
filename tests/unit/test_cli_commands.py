"""Every `verst` command has --help and --json; the demo's spec ships with the package."""

from __future__ import annotations

import argparse

import pytest

from services.cli import main, parser
from services.cli.local import spec_file
from services.common.config import load_job_spec
from services.examples import example_names, example_spec


def command_names() -> list[str]:
    (commands,) = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(commands.choices)


def test_the_commands_of_the_issue_exist() -> None:
    wanted = {"up", "submit", "status", "cancel", "export", "logs", "checkpoints", "demo"}
    assert wanted <= set(command_names())


@pytest.mark.parametrize("name", command_names())
def test_every_command_has_help_and_json(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        main([name, "--help"])
    assert ended.value.code == 0
    assert "--json" in capsys.readouterr().out


def test_the_demo_spec_is_package_data() -> None:
    assert "addition" in example_names()
    with example_spec("addition") as path:
        assert load_job_spec(path).name == "addition-grpo"
    with pytest.raises(LookupError, match="no shipped example 'nope'"):
        example_spec("nope")


def test_demo_spec_is_a_file_or_a_shipped_name() -> None:
    with spec_file("addition") as path:
        assert path.name == "addition.yaml" and path.is_file()
    with spec_file("runs/mine.yaml") as path:  # not shipped: a path, whether it is there or not
        assert str(path) == "runs/mine.yaml"
