"""The layout's rules, checked on the source: no import cycles, files sized by concept, one owner of
the job store, and no service importing another service's modules.

Imports are read with ``ast`` from every ``services/`` module, function-level and TYPE_CHECKING
imports included: a cycle hidden inside a function is still a cycle.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from services.common.config import JobSpec

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
GENERATED = SERVICES / "common" / "pb"
WARN_LINES = 600
"""A file past this many lines gets a warning: is it still one concept?"""
MAX_LINES = 800
"""A file past this many lines fails: split it by concept."""
JOB_STORE = SERVICES / "common" / "jobs.py"
STREAM_NAMES = SERVICES / "common" / "streams.py"
JOB_STORE_NAMES = frozenset({"job_key", "JOB_INDEX", "ACTIVE_JOBS", "job_history_key"})
"""Names of the job store's keys: only the job store (and streams.py, which spells them) uses them."""


def source_files(*folders: Path) -> list[Path]:
    return sorted(
        path for folder in folders for path in folder.rglob("*.py") if GENERATED not in path.parents
    )


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> Iterator[str]:
    """The services modules ``path`` imports anywhere in its body (the most specific known name)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("services."):
                yield name


def import_graph() -> dict[str, set[str]]:
    files = source_files(SERVICES)
    known = {module_name(path) for path in files}
    graph = {module_name(path): set() for path in files}
    for path in files:
        here = module_name(path)
        graph[here] |= {name for name in imported_modules(path, known) if name != here}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_function_level_imports_are_read(tmp_path: Path) -> None:
    path = SERVICES / "rollout" / "server.py"  # in_process_torch imports the torch model inside
    names = set(imported_modules(path, {module_name(p) for p in source_files(SERVICES)}))
    assert "services.rollout.torch.model" in names


def test_services_have_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def line_counts(folder: Path) -> dict[str, int]:
    return {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in source_files(folder)}


@pytest.mark.parametrize("folder", ["services", "tests", "bench"])
def test_files_are_sized_by_concept(folder: str) -> None:
    """Past WARN_LINES a warning asks whether a file is still one concept; past MAX_LINES it fails."""
    counts = line_counts(ROOT / folder)
    for path, lines in sorted(counts.items()):
        if WARN_LINES < lines <= MAX_LINES:
            warnings.warn(f"{path} has {lines} lines: is it still one concept?", stacklevel=1)
    assert {path: lines for path, lines in counts.items() if lines > MAX_LINES} == {}


SERVICE_PACKAGES = ("api", "controller", "router", "rollout", "runner", "reward", "trainer")
"""Each runs as its own process; shared code lives in common/, data/, tasks/ and models/."""
HOSTED = {("api", "controller")}
"""The api runs the controller in its process unless VERST_API_CONTROLLER=false."""


def test_no_service_imports_another() -> None:
    crossing = sorted(
        (here, there)
        for here, imports in import_graph().items()
        for there in imports
        if (a := here.split(".")[1]) in SERVICE_PACKAGES
        and (b := there.split(".")[1]) in SERVICE_PACKAGES
        and a != b
        and (a, b) not in HOSTED
    )
    assert crossing == []


def names_used(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.alias):
            used.add(node.name.rpartition(".")[2])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value == "spec_json":
            used.add("'spec_json'")
    return used


def test_only_the_job_store_touches_job_keys_and_spec_json() -> None:
    """Job hashes, the active set, the index and the spec JSON belong to common/jobs.py."""
    offenders = {}
    for path in source_files(SERVICES):
        if path in (JOB_STORE, STREAM_NAMES):
            continue
        used = names_used(path)
        bad = (used & JOB_STORE_NAMES) | (used & {"spec_json", "'spec_json'", "model_validate_json"})
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}


def test_the_job_store_rule_would_see_a_raw_read(tmp_path: Path) -> None:
    sample = tmp_path / "raw.py"
    raw_read = "async def f(redis, job_id):\n    return await redis.hget(job_key(job_id), 'spec_json')\n"
    sample.write_text(raw_read)
    assert {"job_key", "'spec_json'"} <= names_used(sample)


def spec_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str]]:
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from spec_fields(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", name


def test_every_job_spec_field_is_read_somewhere() -> None:
    """A field nothing reads (outside the spec's own validators) is a promise verst does not keep."""
    spec_files = ("config.py", "algorithm_config.py", "section.py", "tracking_config.py")
    spec = {SERVICES / "common" / name for name in spec_files}
    text = "\n".join(path.read_text() for path in source_files(SERVICES) if path not in spec)
    unread = [path for path, name in spec_fields(JobSpec) if not re.search(rf"\.{name}\b", text)]
    assert unread == []
