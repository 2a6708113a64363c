"""`verst demo` from a plain (non-editable) install: the wheel holds the demo's spec as package
data, and the installed command finds it away from the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_wheel_ships_the_demo_spec(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: building in the repository would leave build/ there
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "services", source / "services", ignore=shutil.ignore_patterns("__pycache__"))
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", "dist", "."]
    subprocess.run(build, cwd=source, check=True, capture_output=True, timeout=300)
    (wheel,) = (source / "dist").glob("verst-*.whl")
    assert "services/examples/addition.yaml" in zipfile.ZipFile(wheel).namelist()

    installed = tmp_path / "installed"
    unpack = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(installed), str(wheel)]
    subprocess.run(unpack, check=True, capture_output=True, timeout=300)
    shutil.rmtree(source)  # nothing left to read but the install
    probe = (
        "import sys, services.cli\n"
        "from services.cli.local import spec_file\n"
        "from services.common.config import load_job_spec\n"
        "assert services.cli.__file__.startswith(sys.argv[1]), services.cli.__file__\n"
        "with spec_file('addition') as path: print(load_job_spec(path).name)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(installed)}
    done = subprocess.run(
        [sys.executable, "-c", probe, str(installed)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "addition-grpo\n"
