"""Every runnable benchmark in bench/ runs end to end at tiny sizes: it exits 0 and its last line of
stdout is the summary line it documents, and bench/RESULTS.md is left as it was. Figures are never
asserted (this machine is shared); only that the scripts have not rotted. A new script in bench/
with a ``__main__`` fails ``test_every_runnable_bench_script_has_a_smoke_run`` until it has one."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
RESULTS = BENCH / "RESULTS.md"
NUMBER = r"(?:[\d,]+(?:\.\d+)?|nan|inf)"
SMOKE_TIMEOUT_S = 540.0
"""One smoke run's limit: a first run may build DeepSpeed's CPU communication op (a minute or more)."""


@dataclass(frozen=True)
class Smoke:
    """A script's tiny run: its arguments (``{tmp}``: a fresh directory) and its last line."""

    args: str
    last_line: str
    """A regular expression that the whole last line of stdout matches."""
    slow: bool = True
    """Longer than a few seconds: left out of ``make test-fast``."""
    report: str = ""
    """A JSON report the run must write (``{tmp}`` as in ``args``), its ``figures`` all numbers."""


SMOKE_RUNS: dict[str, Smoke] = {
    "bench/bus.py": Smoke(
        "--no-results --trajectories 64 --tokens 16 --prompt-tokens 4 --batch 16 --count 16 --repeat 1"
        " --warmup 1",
        r"bus: \d+ trajectories/s \(raw xadd \d+/s\)",
        slow=False,
    ),
    "bench/grpc_calls.py": Smoke(
        "--no-results --calls 64 --fanout 8 --repeat 1 --reply-bytes 1024",
        rf"grpc-calls: unary_us={NUMBER} stream_us={NUMBER} ratio={NUMBER}",
        slow=False,
    ),
    "bench/engine.py": Smoke(
        "--no-results --models demo --batches 1 --max-new-tokens 4 --repeat 1 --warmup 0 --warmup-tokens 1"
        " --min-seconds 0 --quiet-wait 0 --compile none --threads 1",
        rf"engine: model=demo batch=1 verst_tok_s={NUMBER} hf_tok_s={NUMBER} ratio={NUMBER}",
    ),
    "bench/engine_profile.py": Smoke(
        "--model demo --batch 2 --tokens 4 --threads 1",
        rf" +per decode step \(forward \+ sampling\): +{NUMBER} ms",
    ),
    "bench/trainer.py": Smoke(
        "--no-results --models demo --shapes demo=1x2:4 --repeat 1 --warmup 0 --min-seconds 0"
        " --quiet-wait 0 --threads 1",
        rf"trainer: verst_tok_s={NUMBER} torch_tok_s={NUMBER} ratio={NUMBER} padding_waste={NUMBER}",
    ),
    "bench/compile_probe.py": Smoke(
        "--task addition --threads 1 --rows 2 --width 8 --repeat 1 --backend eager",
        rf"compile_probe: task=addition threads=1 backend=eager eager_over_compiled={NUMBER}",
    ),
    "bench/staleness.py": Smoke(
        "--steps 2 --eval-every 2 --eval-prompts 8",
        rf'\{{"task": "addition", "seed": 0, "lag": 1, "settings": \{{\}}, '
        rf'"accuracy": \{{"0": {NUMBER}, "2": {NUMBER}\}}, "seconds": \d+\}}',
    ),
    "bench/loop_stages.py": Smoke(
        "--no-results --steps 3 --skip 0",
        rf"job JOB_STATE_SUCCEEDED; 3 steps counted; other processes kept -?{NUMBER} cores busy",
    ),
    "bench/checkpoint_bytes.py": Smoke(
        "{tmp}/job.yaml --steps 2 --log-dir {tmp}/logs",
        rf"bytes written per step: {NUMBER} \(weights {NUMBER}: {NUMBER}x\)",
    ),
    "bench/e2e.py": Smoke(
        "--no-results --pairs 1 --max-steps 2 --eval-every 2 --group-size 2 --prompts-per-step 2"
        " --max-new-tokens 4 --eval-prompts 4 --quiet-wait 0 --threads 1 --work-dir {tmp}/race",
        rf"e2e: task=addition verst_s={NUMBER} trl_s={NUMBER} ratio={NUMBER}",
    ),
    "bench/ceiling.py": Smoke(
        "--task addition --trl-steps 3 --repeat 1 --verst-rounds 1 --threads 1",
        rf"ceiling: task=addition trl_step_s={NUMBER} verst_floor_s={NUMBER} ceiling={NUMBER}"
        rf" target={NUMBER}",
    ),
    "bench/gpu_check.py": Smoke(
        "--smoke --threads 1 --budget-s 400 --out {tmp}/gpu_check",
        r"gpu_check: device=cpu ran=6 failed=0 skipped=1 out=\S+/gpu_check\.json",
        report="{tmp}/gpu_check/gpu_check.json",
    ),
}
"""The smoke run of each runnable script in bench/, by its path."""


def small_job(tmp: Path) -> None:
    """checkpoint_bytes' job: examples/grpo.yaml, its checkpoints under ``tmp``, a short evaluation."""
    import yaml

    spec = yaml.safe_load((REPO / "examples" / "grpo.yaml").read_text())
    spec["trainer"]["checkpoint_dir"] = str(tmp / "checkpoints")
    spec["eval"] = {"every_steps": 2, "num_prompts": 8}
    (tmp / "job.yaml").write_text(yaml.safe_dump(spec))


def results_digest() -> str:
    return hashlib.sha256(RESULTS.read_bytes()).hexdigest()


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
@pytest.mark.parametrize(
    "script",
    [
        pytest.param(path, marks=[pytest.mark.slow] if smoke.slow else [])
        for path, smoke in SMOKE_RUNS.items()
    ],
)
def test_the_script_runs_at_tiny_sizes(script: str, tmp_path: Path) -> None:
    smoke = SMOKE_RUNS[script]
    small_job(tmp_path)
    before = results_digest()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # each script its own Redis server
    done = subprocess.run(
        [sys.executable, script, *shlex.split(smoke.args.format(tmp=tmp_path))],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, check=False,
    )  # fmt: skip
    tail = f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, tail
    lines = done.stdout.rstrip("\n").splitlines()
    assert lines and re.fullmatch(smoke.last_line, lines[-1]), tail
    assert results_digest() == before, f"{script} rewrote {RESULTS}"
    if smoke.report:
        figures = json.loads(Path(smoke.report.format(tmp=tmp_path)).read_text())["figures"]
        measured = {name: value for name, value in figures.items() if isinstance(value, int | float)}
        assert measured and set(measured) | {"sglang_tokens_per_s"} == set(figures), figures


def strings_of(path: Path) -> set[str]:
    """The string constants of a Python file, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    }


def runnable_scripts() -> set[str]:
    """bench/*.py files with an ``if __name__ == "__main__":`` block."""
    found = set()
    for path in BENCH.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                found.add(f"bench/{path.name}")
    return found


def smoke_runs_declared_in_tests() -> set[str]:
    """Scripts that some test runs: the keys of SMOKE_RUNS, and any other test file's script named
    as ``"bench/<name>.py"`` (or ``"<name>.py"`` beside ``"bench"``) in a string, or whose ``main``
    it imports."""
    declared = set(SMOKE_RUNS)
    for path in (REPO / "tests").rglob("*.py"):
        if path.resolve() == Path(__file__).resolve():
            continue  # here only SMOKE_RUNS counts, not the names in the checks
        strings = strings_of(path)
        declared |= {s for s in strings if re.fullmatch(r"bench/\w+\.py", s)}
        if "bench" in strings:
            declared |= {f"bench/{s}" for s in strings if re.fullmatch(r"\w+\.py", s)}
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("bench.")
                and any(alias.name == "main" for alias in node.names)
            ):
                declared.add(f"bench/{(node.module or '').removeprefix('bench.')}.py")
    return declared


def children_of(scripts: set[str]) -> set[str]:
    """Scripts that these start as child processes (e.g. bench/e2e.py's ``bench.e2e_trl``), named
    in their code as ``<name>.py``, ``bench/<name>.py`` or ``bench.<name>``: their runs run them."""
    children = set()
    for script in scripts:
        for text in strings_of(REPO / script):
            name = re.fullmatch(r"(?:bench/)?(\w+)\.py|bench\.(\w+)", text)
            if name and (BENCH / f"{name[1] or name[2]}.py").exists():
                children.add(f"bench/{name[1] or name[2]}.py")
    return children - scripts


def test_every_runnable_bench_script_has_a_smoke_run() -> None:
    runnable = runnable_scripts()
    assert {"bench/bus.py", "bench/e2e.py", "bench/e2e_trl.py"} <= runnable  # the scan finds scripts
    smoked = smoke_runs_declared_in_tests() & runnable
    assert "bench/e2e_trl.py" in children_of({"bench/e2e.py"})
    missing = sorted(runnable - smoked - children_of(smoked))
    assert not missing, (
        f"no smoke run for {missing}: add a tiny run to SMOKE_RUNS in {Path(__file__).name}"
        " (or run the script by its path in a test of its own)"
    )
    stale = sorted(set(SMOKE_RUNS) - runnable)
    assert not stale, f"SMOKE_RUNS names scripts that are gone or not runnable: {stale}"
