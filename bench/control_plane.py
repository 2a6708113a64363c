"""The control plane at scale: groups per second through the real services with free engines.

The real api (with its in-process controller), router, runner and reward service, on one
embedded Redis, run one job submitted over REST (the builtin:addition task and tokenizer, whose
verifier is cheap) while the engines and the trainer cost nothing: bench/engine_simulator.py
answers every Generate at once with canned samples of ``--max-new-tokens`` tokens (n per group)
from simulated engines that register and heartbeat as real ones do, many per process;
bench/trainer_simulator.py claims the job, acks whole groups and publishes one version per step
of ``--prompts-per-step`` groups, so the controller keeps feeding prompts at the pace of its
staleness rule. For each number of engines (``--engines``, one simulator started afresh each
time, the same stack and job throughout) the groups the trainer acked are counted over
``--seconds`` after ``--warmup-seconds``, with the CPU seconds each process spent meanwhile
(psutil): per group, by service. The simulators' CPU is shown apart; "control plane" sums the
api, controller, router, runner, reward service and redis-server. ``--profile runner,router``
also profiles those services' event loops over each window (cProfile; bench/profile_hook/).

    .venv/bin/python bench/control_plane.py              # also rewrites its section of bench/RESULTS.md
    .venv/bin/python bench/control_plane.py --engines 1,2 --seconds 3 --warmup-seconds 2 --no-results
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pstats
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import BUSY_MACHINE, CpuSample, machine, update_results
from bench.trainer_simulator import ACKED_KEY, STAGES
from services.client import auth_headers
from services.common.config import JobSpec
from services.common.streams import ENGINE_HEARTBEATS
from services.stack import Stack, StackConfig

REPO = Path(__file__).resolve().parent.parent
SECTION_TITLE = "## control plane (bench/control_plane.py)"
NOTES_MARKER = (
    "<!-- notes: written by hand; bench/control_plane.py keeps everything from here to the next section -->"
)
CONTROL_PLANE = ("api", "controller", "router", "runner", "reward", "redis-server")
SIMULATORS = ("trainer-sim", "engine-sim")
TARGET_GROUPS_PER_S = 1000.0
POLL_S = 0.25
ENGINE_TTL_S = 5.0
"""The router's default engine ttl: an engine is alive while its heartbeat is younger."""
STOP_TIMEOUT_S = 15.0
STAGE_NAMES = (*STAGES, "stage_deliver_s")
"""The stages of a group's way (services/trainer/report.py's names), in order."""


@dataclass(frozen=True)
class Sizes:
    """What one run measures."""

    engines: tuple[int, ...]
    seconds: float
    warmup_seconds: float
    group_size: int
    prompts_per_step: int
    max_new_tokens: int
    max_staleness: int
    engines_per_process: int
    start_timeout_s: float


@dataclass
class Window:
    """One engine count's measured window."""

    engines: int
    seconds: float
    groups: int
    trajectories: int
    cpu: dict[str, float]
    """CPU seconds of each process (simulators by their kind) over the window."""
    other_load: float
    """Cores other processes kept busy meanwhile."""
    stages: dict[str, float]
    """Mean seconds per group of each stage of the loop (the trainer simulator's sums)."""
    profiles: dict[str, Path] = field(default_factory=dict)
    batches: dict[str, float] = field(default_factory=dict)
    """Mean groups per batch of each of the runner's batched calls over the window."""

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds

    def control_plane_cpu(self) -> float:
        return sum(self.cpu.get(name, 0.0) for name in CONTROL_PLANE)


# -- the job ------------------------------------------------------------------------------


def job_spec(sizes: Sizes) -> dict[str, Any]:
    """A job long enough for every window; no evaluation (it would only add engine work)."""
    spec = {
        "name": "control-plane-bench",
        "model": {"path": "builtin:addition"},
        "data": {"train": "builtin:addition", "eval": None},
        "algorithm": {"group_size": sizes.group_size, "max_staleness": sizes.max_staleness},
        "rollout": {"prompts_per_step": sizes.prompts_per_step, "max_new_tokens": sizes.max_new_tokens},
        "trainer": {"steps": 10_000_000},
        "eval": {"every_steps": 0, "at_start": False},
    }
    return JobSpec.model_validate(spec).model_dump(mode="json")


def submit(api_url: str, spec: dict[str, Any]) -> str:
    response = httpx.post(f"{api_url}/v1/jobs", json=spec, headers=auth_headers(), timeout=60)
    if response.status_code != 201:
        raise RuntimeError(f"submitting the job: {response.status_code} {response.text}")
    return str(response.json()["job_id"])


# -- processes ------------------------------------------------------------------------------


@dataclass
class Simulators:
    """The trainer simulator and the current engine simulators, with their logs."""

    redis_url: str
    log_dir: Path
    trainer: subprocess.Popen[bytes] | None = None
    engines: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def _start(self, name: str, script: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.log_dir / f"{name}.log").open("ab")
        command = [sys.executable, str(REPO / "bench" / script), "--redis-url", self.redis_url, *args]
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def start_trainer(self) -> None:
        self.trainer = self._start("trainer-sim", "trainer_simulator.py")

    def start_engines(self, engines: int, per_process: int, tokens: int) -> None:
        for first in range(0, engines, per_process):
            count = min(per_process, engines - first)
            prefix = f"sim{engines}p{first}"
            self.engines.append(
                self._start(f"engine-sim-{engines}", "engine_simulator.py", "--engines", str(count),
                            "--tokens", str(tokens), "--id-prefix", prefix)
            )  # fmt: skip

    def stop_engines(self) -> None:
        stop_all(self.engines)
        self.engines = []

    def stop(self) -> None:
        self.stop_engines()
        stop_all([self.trainer] if self.trainer else [])
        self.trainer = None

    def check_alive(self) -> None:
        for process in [*self.engines, *([self.trainer] if self.trainer else [])]:
            if process.poll() is not None:
                raise RuntimeError(f"a simulator exited ({process.returncode}); see {self.log_dir}")


def stop_all(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM, then SIGKILL whatever is left after STOP_TIMEOUT_S."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)


def process_ids(stack: Stack, sims: Simulators) -> dict[str, list[int]]:
    """The pids of every process by name (each simulator kind's together)."""
    pids = {c.name: [c.process.pid] for c in stack.children if c.process is not None}
    if stack.redis is not None and stack.redis.process is not None:
        pids["redis-server"] = [stack.redis.process.pid]
    if sims.trainer is not None:
        pids["trainer-sim"] = [sims.trainer.pid]
    pids["engine-sim"] = [p.pid for p in sims.engines]
    return pids


def cpu_seconds(pids: dict[str, list[int]]) -> dict[str, float]:
    """User + system CPU seconds so far of each name's processes, their children's included (a
    worker pool's, say)."""
    seconds: dict[str, float] = {}
    for name, ids in pids.items():
        for pid in ids:
            with contextlib.suppress(psutil.NoSuchProcess):
                process = psutil.Process(pid)
                times = process.cpu_times()
                total = times.user + times.system + times.children_user + times.children_system
                for child in process.children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child_times = child.cpu_times()
                        total += child_times.user + child_times.system
                seconds[name] = seconds.get(name, 0.0) + total
    return seconds


def signal_all(pids: Sequence[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


# -- one window ------------------------------------------------------------------------------


def acked(client: redis.Redis) -> dict[str, float]:
    """The trainer simulator's counts so far: groups, trajectories and stage-time sums."""
    return {key.decode(): float(value) for key, value in client.hgetall(ACKED_KEY).items()}


def acked_groups(client: redis.Redis) -> float:
    return acked(client).get("groups", 0.0)


def alive_engines(client: redis.Redis) -> int:
    return int(client.zcount(ENGINE_HEARTBEATS, f"({time.time() - ENGINE_TTL_S}", "+inf"))


def wait_until(what: str, ready: Callable[[], bool], timeout_s: float, check: Callable[[], None]) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(POLL_S)


def sleep_checking(seconds: float, check: Callable[[], None]) -> None:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        check()
        time.sleep(min(POLL_S, left))


def measure(
    stack: Stack, sims: Simulators, client: redis.Redis, engines: int, sizes: Sizes, profile: list[str]
) -> Window:
    """Start ``engines`` simulated engines, wait for acks, warm up, measure, stop them."""

    def check() -> None:
        stack.check_alive()
        sims.check_alive()

    sims.start_engines(engines, sizes.engines_per_process, sizes.max_new_tokens)
    try:
        wait_until(f"{engines} engines registered", lambda: alive_engines(client) >= engines,
                   sizes.start_timeout_s, check)  # fmt: skip
        start = acked_groups(client)
        wait_until("groups acked", lambda: acked_groups(client) > start, sizes.start_timeout_s, check)
        sleep_checking(sizes.warmup_seconds, check)
        pids = process_ids(stack, sims)
        profiled = [pid for name in profile for pid in pids.get(name, [])]
        signal_all(profiled, signal.SIGUSR1)
        batches_before = runner_batches(stack)
        before, cpu_before, load_before = acked(client), cpu_seconds(pids), CpuSample.now("")
        began = time.perf_counter()
        sleep_checking(sizes.seconds, check)
        after, cpu_after, load_after = acked(client), cpu_seconds(pids), CpuSample.now("")
        batches = mean_batches(batches_before, runner_batches(stack))
        seconds = time.perf_counter() - began
        signal_all(profiled, signal.SIGUSR2)
    finally:
        sims.stop_engines()
    wait_until(
        "engines left the registry", lambda: alive_engines(client) == 0, ENGINE_TTL_S * 3, stack.check_alive
    )
    cpu = {name: cpu_after[name] - cpu_before.get(name, 0.0) for name in cpu_after}
    counted = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    groups = int(counted.get("groups", 0))
    stages = {name: counted.get(name, 0.0) / max(1, groups) for name in STAGE_NAMES}
    other = load_after.other_cores_since(load_before)
    trajectories = int(counted.get("trajectories", 0))
    return Window(engines, seconds, groups, trajectories, cpu, other, stages, batches=batches)


BATCH_CALLS = ("read", "generate", "score", "publish")
"""The runner's batched calls (its verst_runner_batch_groups series), in a group's order."""


def runner_batches(stack: Stack) -> dict[str, tuple[float, float]]:
    """The runner's batch histograms now: (groups, batches) by call, from its /metrics."""
    port = stack.metrics_ports.get("runner")
    if not port:
        return {}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
    sums: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "verst_runner_batch_groups":
            continue
        for sample in family.samples:
            call = sample.labels.get("call", "")
            groups, batches = sums.get(call, (0.0, 0.0))
            if sample.name.endswith("_sum"):
                sums[call] = (sample.value, batches)
            elif sample.name.endswith("_count"):
                sums[call] = (groups, sample.value)
    return sums


def mean_batches(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean groups per batch of each call between two readings of ``runner_batches``."""
    means: dict[str, float] = {}
    for call, (groups, batches) in after.items():
        groups_before, batches_before = before.get(call, (0.0, 0.0))
        if batches > batches_before:
            means[call] = (groups - groups_before) / (batches - batches_before)
    return means


# -- the run ----------------------------------------------------------------------------------


def run(
    sizes: Sizes, env: dict[str, str], profile: list[str], work: Path, separate: bool
) -> tuple[list[Window], dict[str, str]]:
    """A stack without engines or trainer, the simulators, one job, a window per engine count;
    the windows and the machine's description."""
    profile_dir = work / "profiles"
    profile_dir.mkdir()
    if profile:
        hook = str(REPO / "bench" / "profile_hook")
        path = os.pathsep.join(p for p in (hook, os.environ.get("PYTHONPATH", "")) if p)
        env = env | {"PYTHONPATH": path, "VERST_BENCH_PROFILE": ",".join(profile),
                     "VERST_BENCH_PROFILE_DIR": str(profile_dir)}  # fmt: skip
    ports = {
        f"{name}_port": 0
        for name in ("api", "router", "reward", "runner", "controller", "controller_metrics")
    }
    config = StackConfig(log_dir=work / "logs", engines=0, trainers=0, separate_controller=separate,
                         extra_env=env, **ports)  # fmt: skip
    windows: list[Window] = []
    with Stack(config) as stack:
        host = machine(stack.redis_url, embedded=True)
        sims = Simulators(stack.redis_url, work / "logs")
        client = redis.Redis.from_url(stack.redis_url)
        try:
            sims.start_trainer()
            submit(stack.api_url, job_spec(sizes))
            # the columns of the final table: the controller's only when it runs apart
            live = [name for name in CONTROL_PLANE if separate or name != "controller"]
            print("\n".join(header(live)), flush=True)
            for engines in sizes.engines:
                window = measure(stack, sims, client, engines, sizes, profile)
                window.profiles = {name: profile_dir / f"{name}-{len(windows) + 1}.prof" for name in profile}
                windows.append(window)
                print(row(window, live), flush=True)
        finally:
            client.close()
            sims.stop()
    return windows, host


# -- the report --------------------------------------------------------------------------------


def header(names: Sequence[str]) -> list[str]:
    columns = ["engines", "groups/s", "trajectories/s", *(f"{n} ms/group" for n in names),
               "control plane ms/group", "control plane cores", *(f"{n} ms/group" for n in SIMULATORS),
               "other load, cores"]  # fmt: skip
    return ["| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]


def service_names(windows: Sequence[Window]) -> list[str]:
    seen = {name for window in windows for name in window.cpu}
    return [name for name in CONTROL_PLANE if name in seen]


def row(window: Window, names: Sequence[str] = CONTROL_PLANE) -> str:
    groups = max(1, window.groups)

    def per_group(name: str) -> str:
        return f"{1000 * window.cpu.get(name, 0.0) / groups:.2f}"

    cells = [
        str(window.engines),
        f"{window.groups_per_s:,.0f}",
        f"{window.trajectories / window.seconds:,.0f}",
        *(per_group(n) for n in names),
        f"**{1000 * window.control_plane_cpu() / groups:.2f}**",
        f"{window.control_plane_cpu() / window.seconds:.2f}",
        *(per_group(n) for n in SIMULATORS),
        f"{window.other_load:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


def table(windows: Sequence[Window]) -> list[str]:
    names = service_names(windows)
    return [*header(names), *(row(window, names) for window in windows)]


def stage_table(windows: Sequence[Window]) -> list[str]:
    """Mean milliseconds per group of each stage: where a group's time goes (not CPU)."""
    names = [name.removeprefix("stage_").removesuffix("_s") for name in STAGE_NAMES]
    lines = ["| engines | " + " | ".join(f"{n} ms" for n in names) + " |", "|" + "---:|" * (len(names) + 1)]
    for w in windows:
        lines.append(
            f"| {w.engines} | " + " | ".join(f"{1000 * w.stages[n]:.1f}" for n in STAGE_NAMES) + " |"
        )
    return lines


def batch_table(windows: Sequence[Window]) -> list[str]:
    """Mean groups per batch of the runner's batched calls: how well its calls coalesce."""
    lines = ["| engines | " + " | ".join(f"{c} groups/batch" for c in BATCH_CALLS) + " |"]
    lines.append("|" + "---:|" * (len(BATCH_CALLS) + 1))
    for w in windows:
        cells = [f"{w.batches[c]:.1f}" if c in w.batches else "-" for c in BATCH_CALLS]
        lines.append(f"| {w.engines} | " + " | ".join(cells) + " |")
    return lines


def dearest(windows: Sequence[Window]) -> str:
    """Which service takes the most control-plane CPU per group, over all windows."""
    totals = {name: sum(w.cpu.get(name, 0.0) for w in windows) for name in CONTROL_PLANE}
    whole = sum(totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda item: -item[1])
    return ", ".join(f"{name} {100 * value / whole:.0f}%" for name, value in ranked if value > 0)


def profile_lines(windows: Sequence[Window], top: int) -> list[str]:
    """The ``top`` functions by own time of each profiled service, for its last window."""
    lines: list[str] = []
    for name, path in (windows[-1].profiles if windows else {}).items():
        if not path.exists():
            lines.append(f"(no profile of {name}: {path} was not written)")
            continue
        stats = pstats.Stats(str(path))
        total = stats.total_tt or 1.0  # type: ignore[attr-defined]
        lines.append(f"profile of {name} ({windows[-1].engines} engines), main thread, by own time:")
        ranked = sorted(stats.stats.items(), key=lambda item: -item[1][2])  # type: ignore[attr-defined]
        for (file, line, function), (_, calls, own, cumulative, _) in ranked[:top]:
            where = f"{Path(file).name}:{line}({function})"
            lines.append(
                f"  {100 * own / total:5.1f}% own {own:7.3f}s cum {cumulative:7.3f}s {calls:>9} {where}"
            )
    return lines


def summary_line(windows: Sequence[Window]) -> str:
    first, last = windows[0], windows[-1]
    return (f"control-plane: engines={first.engines} groups_per_s={first.groups_per_s:.0f} "
            f"engines={last.engines} groups_per_s={last.groups_per_s:.0f}")  # fmt: skip


def section(sizes: Sizes, command: str, host: dict[str, str], windows: Sequence[Window]) -> str:
    """This benchmark's section of RESULTS.md, up to (not including) its notes."""
    busy = max(w.other_load for w in windows)
    lines = [
        SECTION_TITLE,
        "",
        "Groups per second through the real api + controller, router, runner, reward service and Redis,",
        "with simulated engines (canned samples at once) and a trainer that only acks and publishes",
        f"versions; target >= {TARGET_GROUPS_PER_S:,.0f} groups/s, flat in the engines. CPU in ms per",
        "group of each process over the window (psutil), the simulators' apart; the api's includes the",
        "controller's unless the controller has a column of its own (--separate-controller).",
        "",
        f"    {command}",
        "",
        *(f"- {key}: {value}" for key, value in host.items()),
        f"- job: groups of {sizes.group_size} samples of {sizes.max_new_tokens} tokens, "
        f"{sizes.prompts_per_step} groups per step, max_staleness {sizes.max_staleness}; "
        f"{sizes.warmup_seconds:g} s warm-up, then {sizes.seconds:g} s measured per engine count",
        "",
        *table(windows),
        "",
        f"Control-plane CPU by service, all windows: {dearest(windows)}.",
        "",
        "Where a group's time goes, mean ms per group (the trainer's stage times: issued -> picked by a",
        "runner -> generated -> scored -> published -> taken by the trainer, the wait for the step's",
        "other groups included):",
        "",
        *stage_table(windows),
        "",
        "Groups per batch of the runner's batched calls (its verst_runner_batch_groups histograms):",
        "",
        *batch_table(windows),
    ]
    if busy > BUSY_MACHINE:
        lines += [
            "",
            f"Other processes kept up to {busy:.2f} cores busy: the figures understate the services.",
        ]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add = parser.add_argument
    add("--engines", default="1,4,16,64", help="engine counts, one window each (%(default)s)")
    add("--seconds", type=float, default=20.0, help="measured seconds per engine count (%(default)s)")
    add("--warmup-seconds", type=float, default=8.0, help="seconds before each window (%(default)s)")
    add("--group-size", type=int, default=8, help="samples per group (%(default)s)")
    add("--prompts-per-step", type=int, default=64, help="groups per trainer step (%(default)s)")
    add("--max-new-tokens", type=int, default=1000, help="tokens per sample (%(default)s)")
    add("--max-staleness", type=int, default=2, help="the job's algorithm.max_staleness (%(default)s)")
    add("--engines-per-process", type=int, default=64, help="simulated engines per process (%(default)s)")
    add("--start-timeout", type=float, default=180.0, help="longest wait for engines and first acks")
    add("--separate-controller", action="store_true", help="run the controller apart from the api")
    add("--profile", default="", help="services to cProfile over each window, e.g. runner,router")
    add("--profile-top", type=int, default=25, help="functions shown per profile (%(default)s)")
    add("--env", action="append", default=[], metavar="KEY=VALUE", help="services' environment (repeatable)")
    add("--results", type=Path, default=REPO / "bench" / "RESULTS.md")
    add("--no-results", action="store_true", help="leave the results file alone")
    args = parser.parse_args(argv)
    try:
        args.engine_counts = tuple(int(n) for n in args.engines.split(","))
    except ValueError:
        parser.error("--engines takes comma-separated integers")
    if min(args.engine_counts) < 1 or args.seconds <= 0 or args.warmup_seconds < 0:
        parser.error("engine counts must be >= 1, --seconds > 0 and --warmup-seconds >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = Sizes(
        engines=args.engine_counts,
        seconds=args.seconds,
        warmup_seconds=args.warmup_seconds,
        group_size=args.group_size,
        prompts_per_step=args.prompts_per_step,
        max_new_tokens=args.max_new_tokens,
        max_staleness=args.max_staleness,
        engines_per_process=args.engines_per_process,
        start_timeout_s=args.start_timeout,
    )
    env = dict(item.split("=", 1) for item in args.env)
    profile = [name for name in args.profile.split(",") if name]
    with tempfile.TemporaryDirectory(prefix="verst-control-plane-") as scratch:
        windows, host = run(sizes, env, profile, Path(scratch), args.separate_controller)
        extra = profile_lines(windows, args.profile_top)
    lines = [*table(windows), "", *stage_table(windows), "", *batch_table(windows)]
    print("\n".join(["", *lines, "", f"control-plane CPU by service: {dearest(windows)}", *extra]))
    if not args.no_results:
        command = shlex.join(
            [".venv/bin/python", "bench/control_plane.py", *(sys.argv[1:] if argv is None else argv)]
        )
        update_results(args.results, SECTION_TITLE, section(sizes, command, host, windows), NOTES_MARKER)
        print(f"updated {args.results}")
    print(summary_line(windows))


if __name__ == "__main__":
    main()
