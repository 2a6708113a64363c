"""What a benchmark in bench/ reports besides its figures: the machine and the Redis server it
ran on, how busy other processes kept the machine meanwhile, the command line, and its own
section of bench/RESULTS.md."""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import google.protobuf
import psutil
import redis
import redis.asyncio.connection
from google.protobuf.internal import api_implementation

RESULTS_HEADER = """# Benchmarks

Each script in `bench/` owns one `## <name> (bench/<script>.py)` section of this
file and rewrites only that section when it runs (pass `--no-results` to leave
the file alone). The figures are from real runs on the machine each section names.
"""
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
BUSY_MACHINE = 0.1
"""Other processes keeping this many cores busy during a run make its figures suspect."""


# -- the machine ------------------------------------------------------------------------


def machine(url: str, *, embedded: bool) -> dict[str, str]:
    """What the figures depend on: CPU, memory, Python, the Redis server and its client."""
    model = cpu_model()
    mem_kb = int((_proc_field("/proc/meminfo", "MemTotal") or "0 kB").split()[0])
    client = redis.Redis.from_url(url)
    try:
        info = {**client.info("server"), **client.info("memory"), **client.info("persistence")}
    finally:
        client.close()
    where = "embedded" if embedded else f"at {urlparse(url).hostname}:{urlparse(url).port}"
    allocator = info.get("mem_allocator", "?")
    aof = "append-only file on" if int(info.get("aof_enabled", 0)) else "no append-only file"
    uses_hiredis = "Hiredis" in redis.asyncio.connection.DefaultParser.__name__
    hiredis = f"in use (hiredis {_version('hiredis')})" if uses_hiredis else "NOT in use"
    return {
        "cpu": f"{model}, {os.cpu_count()} cores",
        "ram": f"{mem_kb / 2**20:.1f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "redis-server": f"{info['redis_version']}, {where}, {aof}, allocator {allocator}",
        "redis-py": f"{redis.__version__}, hiredis parser {hiredis}",
        "protobuf": f"{google.protobuf.__version__} ({api_implementation.Type()} backend)",
    }


def cpu_model() -> str:
    """The CPU's model name."""
    return _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "?"


def _proc_field(path: str, key: str) -> str:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.split(":", 1)[0].strip() == key), "")


def _version(module: str) -> str:
    try:
        return str(__import__(module).__version__)
    except (ImportError, AttributeError):
        return "?"


# -- CPU accounting -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CpuSample:
    """CPU seconds so far: the whole machine's, ours (with our children) and the Redis server's."""

    wall: float
    machine: float
    own: float
    server: float

    @classmethod
    def now(cls, url: str) -> CpuSample:
        process = psutil.Process()
        times = process.cpu_times()
        own = times.user + times.system + times.children_user + times.children_system
        for child in process.children(recursive=True):  # live helpers are ours too
            try:
                child_times = child.cpu_times()
            except psutil.NoSuchProcess:
                continue
            own += child_times.user + child_times.system
        server = 0.0
        if urlparse(url).hostname in LOOPBACK:  # a remote server's CPU is not on this machine anyway
            client = redis.Redis.from_url(url)
            try:
                info = client.info("cpu")
            finally:
                client.close()
            server = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        return cls(time.perf_counter(), _machine_busy_s(), own, server)

    def other_cores_since(self, before: CpuSample) -> float:
        """Average cores that other processes kept busy between ``before`` and this sample."""
        busy = self.machine - before.machine
        ours = (self.own - before.own) + (self.server - before.server)
        return max(0.0, busy - ours) / (self.wall - before.wall)


def _machine_busy_s() -> float:
    """Non-idle CPU seconds of the whole machine since boot (nan where /proc/stat is missing)."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, first[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


# -- RESULTS.md ----------------------------------------------------------------------


def update_results(path: Path, title: str, text: str, notes_marker: str) -> None:
    """Replace the section ``title`` of ``path`` with ``text`` (or append it), leaving the other
    sections, and that section's hand-written notes (from ``notes_marker`` on), alone."""
    old = path.read_text() if path.exists() else RESULTS_HEADER
    lines = old.splitlines()
    if title not in lines:
        path.write_text(old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n")
        return
    begin = lines.index(title)
    end = next((i for i in range(begin + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    notes = next((lines[i:end] for i in range(begin, end) if lines[i] == notes_marker), [])
    parts = [lines[:begin], text.rstrip("\n").splitlines(), notes, lines[end:]]
    path.write_text("\n\n".join("\n".join(p).strip("\n") for p in parts if p) + "\n")


def redact(argv: Sequence[str]) -> list[str]:
    """The command line without the Redis URL's value, which may hold a password."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--redis-url" and i + 1 < len(out):
            out[i + 1] = "URL"
        elif arg.startswith("--redis-url="):
            out[i] = "--redis-url=URL"
    return out
