"""Throughput of 1,000-token trajectories through the bus, next to raw XADD.

The measured pipeline, on one Redis server: a producer publishes pre-built
Trajectory protos in batches with ``Bus.publish_many`` (which serializes them:
that is timed), while a consumer reads them through a consumer group with
``Bus.read`` (XREADGROUP, decoding each entry into a Trajectory) and acks every
batch with ``Bus.ack``. The clock runs from the first publish to the last ack.
Afterwards every trajectory must have been received exactly once, nothing may
be pending and nothing may be left to read, or the benchmark fails.

The baseline is pipelined XADD of the same serialized bytes, with the same
fields and batch size, to a fresh stream on the same server, with no consumer.

The producer and the consumer are two forked processes, as a rollout runner and
a trainer are, each with its own event loop and Redis client; the producer stamps
the start and the consumer the end on the system-wide monotonic clock. (The
``--mode inproc`` variant that bench/RESULTS.md's notes compare, both sides as
coroutines of one event loop, is gone; ``--mode procs`` was this default.)

Each run also reports how many cores other processes kept busy meanwhile, since
figures taken on a shared machine understate the bus. That accounting, the
machine description and the rewrite of RESULTS.md are in bench/report.py.

    .venv/bin/python bench/bus.py                # also rewrites its section of bench/RESULTS.md
    .venv/bin/python bench/bus.py --no-results --trajectories 5000
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing as mp
import os
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.report import BUSY_MACHINE, CpuSample, machine, redact, update_results
from services.common.bus import DATA_FIELD, DEFAULT_MAXLEN, TYPE_FIELD, Bus, connect
from services.common.pb.common_pb2 import FINISH_REASON_STOP, SPLIT_TRAIN, Trajectory
from services.common.redis_server import EmbeddedRedis
from services.common.streams import JobStreams

SECTION_TITLE = "## bus (bench/bus.py)"
DESCRIPTION = """
`Bus.publish_many` (serialization included) -> `Bus.read` (XREADGROUP in a consumer group,
decoding into `Trajectory`) -> `Bus.ack` per batch, timed from the first publish to the last
ack; afterwards every trajectory is checked received exactly once, with nothing pending.
Raw XADD: pipelined XADD of the same serialized bytes (same `t`/`d` fields, same batch size)
to a fresh stream on the same server, with no consumer.
"""
NOTES_MARKER = "<!-- notes: written by hand; bench/bus.py keeps everything from here to the next section -->"
VOCAB = 50_000
GROUP_SIZE = 8
POLICY_VERSION = 3
CONSUMER_GROUP = "bench-trainer"
CONSUMER = "bench-trainer-0"
IDLE_TIMEOUT_S = 30.0
"""The consumer fails if nothing arrives for this long before it has everything."""
CHILD_TIMEOUT_S = 600.0
PRODUCER_AND_CONSUMER = (
    "two processes (forked), each with its own asyncio event loop and Redis client;"
    " the producer stamps the start, the consumer the end, on the system-wide monotonic clock"
)


class BenchError(RuntimeError):
    """The pipeline lost, duplicated or left pending a trajectory, or a side failed."""


INT_OPTIONS = {  # flag: default, minimum, help; the fields of Config
    "--trajectories": (20_000, 1, "per run"),
    "--tokens": (1_000, 1, "response tokens per trajectory"),
    "--prompt-tokens": (128, 0, "prompt tokens per trajectory"),
    "--batch": (100, 1, "publish_many (and raw pipeline) batch size"),
    "--count": (100, 1, "XREADGROUP COUNT"),
    "--block-ms": (1000, 1, "XREADGROUP BLOCK"),
    "--repeat": (3, 1, "measured runs, each on fresh streams"),
    "--warmup": (1, 0, "runs before those, not reported"),
}


@dataclass(frozen=True, slots=True)
class Config:
    trajectories: int
    tokens: int
    prompt_tokens: int
    batch: int
    count: int
    block_ms: int
    repeat: int
    warmup: int


@dataclass(frozen=True, slots=True)
class Pipeline:
    """What one pass of the measured pipeline saw, on the (system-wide) monotonic clock: just
    before the first publish, just after the last publish and the last ack, and how many times
    each trajectory id was received."""

    start: float
    published: float
    end: float
    seen: Counter[str]


@dataclass(frozen=True, slots=True)
class Run:
    """One repetition: the bus pipeline, then the raw XADD baseline."""

    n: int
    bus_s: float
    publish_s: float
    raw_s: float
    bus_other: float
    """CPU cores that processes other than ours (and the local Redis server) used meanwhile."""
    raw_other: float

    @property
    def bus_rate(self) -> float:
        return self.n / self.bus_s

    @property
    def raw_rate(self) -> float:
        return self.n / self.raw_s


# -- payloads -----------------------------------------------------------------


def build_trajectories(
    n: int, tokens: int, prompt_tokens: int, job_id: str, seed: int = 0
) -> list[Trajectory]:
    """Realistic trajectories of ``job_id`` in groups of GROUP_SIZE: token ids below VOCAB, negative
    logprobs. The bus dead-letters a trajectory read from another job's stream, so ``job_id`` must
    be the job whose stream they go to."""
    rng = np.random.default_rng(seed)
    out: list[Trajectory] = []
    for i in range(n):
        group = i // GROUP_SIZE
        traj = Trajectory(
            id=f"traj-{i:08d}",
            job_id=job_id,
            prompt_id=f"prompt-{group:07d}",
            group_id=f"group-{group:07d}",
            sample_index=i % GROUP_SIZE,
            group_size=GROUP_SIZE,
            reward=float(rng.random() < 0.5),
            finish_reason=FINISH_REASON_STOP,
            num_turns=1,
            split=SPLIT_TRAIN,
            engine_id="engine-0",
        )
        traj.prompt_token_ids.extend(rng.integers(0, VOCAB, prompt_tokens).tolist())
        traj.response_token_ids.extend(rng.integers(0, VOCAB, tokens).tolist())
        traj.behaviour_logprobs.extend((-rng.exponential(0.8, tokens)).astype(np.float32).tolist())
        traj.loss_mask.extend([True] * tokens)
        traj.policy_versions.extend([POLICY_VERSION] * tokens)
        traj.reward_components["correct"] = traj.reward
        traj.reward_components["format"] = 1.0
        traj.created_at.FromNanoseconds(1_750_000_000_000_000_000 + i)
        out.append(traj)
    return out


# -- the measured pipeline ------------------------------------------------------


async def produce(
    bus: Bus, stream: str, trajectories: Sequence[Trajectory], batch: int
) -> tuple[float, float]:
    """Publish everything in batches; returns the clock before the first and after the last."""
    start = time.perf_counter()
    for i in range(0, len(trajectories), batch):
        await bus.publish_many(stream, trajectories[i : i + batch])
    return start, time.perf_counter()


async def consume(bus: Bus, stream: str, n: int, cfg: Config) -> tuple[Counter[str], float]:
    """Read, decode and ack until n trajectories arrived; returns the ids seen and the clock."""
    seen: Counter[str] = Counter()
    received = 0
    last_seen = time.perf_counter()
    while received < n:
        deliveries = await bus.read(
            stream, CONSUMER_GROUP, CONSUMER, Trajectory, count=cfg.count, block_ms=cfg.block_ms
        )
        if not deliveries:
            if time.perf_counter() - last_seen > IDLE_TIMEOUT_S:
                raise BenchError(f"consumer starved: {received} of {n} after {IDLE_TIMEOUT_S:.0f}s idle")
            continue
        for delivery in deliveries:
            traj = delivery.message
            if len(traj.response_token_ids) != cfg.tokens or len(traj.behaviour_logprobs) != cfg.tokens:
                raise BenchError(f"trajectory {traj.id} arrived with the wrong number of tokens")
            seen[traj.id] += 1
        await bus.ack(stream, CONSUMER_GROUP, [d.entry_id for d in deliveries])
        received += len(deliveries)
        last_seen = time.perf_counter()
    return seen, time.perf_counter()


def _side(role: str, url: str, conn: Connection, body: Callable[[Bus], Awaitable[object]]) -> None:
    """A forked process: connect, say ready, wait for the go, run ``body``, send its result."""

    async def main() -> object:
        bus = Bus(connect(url))
        try:
            await bus.redis.ping()
            conn.send("ready")
            conn.recv()
            return await body(bus)
        finally:
            await bus.close()

    try:
        conn.send(asyncio.run(main()))
    except Exception as err:
        conn.send(BenchError(f"{role} failed: {type(err).__name__}: {err}"))


def _receive(conn: Connection, timeout_s: float, what: str) -> object:
    if not conn.poll(timeout_s):
        raise BenchError(f"no {what} within {timeout_s:.0f}s")
    value = conn.recv()
    if isinstance(value, Exception):
        raise value
    return value


def run_procs(url: str, stream: str, trajectories: Sequence[Trajectory], cfg: Config) -> Pipeline:
    """Producer and consumer as two forked processes; the producer inherits the built protos."""
    ctx = mp.get_context("fork")
    bodies = {
        "producer": functools.partial(produce, stream=stream, trajectories=trajectories, batch=cfg.batch),
        "consumer": functools.partial(consume, stream=stream, n=len(trajectories), cfg=cfg),
    }
    conns, procs = {}, []
    for role, body in bodies.items():
        conns[role], child_end = ctx.Pipe()
        procs.append(ctx.Process(target=_side, args=(role, url, child_end, body), daemon=True))
        procs[-1].start()
        child_end.close()  # so that a child waiting for the go sees EOF if we fail first
    try:
        for role, conn in conns.items():
            _receive(conn, IDLE_TIMEOUT_S, f"{role} ready")
        for conn in conns.values():
            conn.send("go")
        start, published = _receive(conns["producer"], CHILD_TIMEOUT_S, "producer result")
        seen, end = _receive(conns["consumer"], CHILD_TIMEOUT_S, "consumer result")
    finally:
        for conn in conns.values():
            conn.close()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return Pipeline(start, published, end, seen)


# -- checks and the baseline ------------------------------------------------------


async def verify(url: str, stream: str, expected: Sequence[str], seen: Counter[str]) -> None:
    """Every trajectory exactly once, nothing pending, nothing left to read: else BenchError."""
    dupes = sorted(i for i, c in seen.items() if c > 1)
    missing = sorted(set(expected) - seen.keys())
    extra = sorted(seen.keys() - set(expected))
    bus = Bus(connect(url))
    try:
        pending = await bus.pending_count(stream, CONSUMER_GROUP)
        length = await bus.redis.xlen(stream)
        unread = await bus.read(stream, CONSUMER_GROUP, CONSUMER, Trajectory, count=10, block_ms=50)
    finally:
        await bus.close()
    problems = [
        f"{len(dupes)} received more than once (e.g. {dupes[:3]})" if dupes else "",
        f"{len(missing)} never received (e.g. {missing[:3]})" if missing else "",
        f"{len(extra)} unexpected ids (e.g. {extra[:3]})" if extra else "",
        f"{pending} still pending" if pending else "",
        f"the stream holds {length} entries, not {len(expected)}" if length != len(expected) else "",
        f"{len(unread)} entries never read" if unread else "",
    ]
    if any(problems):
        raise BenchError("the bus lost or duplicated work: " + "; ".join(p for p in problems if p))


async def raw_xadd(url: str, stream: str, payloads: Sequence[bytes], batch: int) -> float:
    """Seconds to XADD the serialized payloads, pipelined in batches, with no consumer."""
    client = connect(url)
    type_name = Trajectory.DESCRIPTOR.full_name.encode()
    try:
        await client.ping()
        start = time.perf_counter()
        for i in range(0, len(payloads), batch):
            pipe = client.pipeline(transaction=False)
            for payload in payloads[i : i + batch]:
                pipe.xadd(stream, {TYPE_FIELD: type_name, DATA_FIELD: payload}, maxlen=DEFAULT_MAXLEN)
            await pipe.execute()
        elapsed = time.perf_counter() - start
        if await client.xlen(stream) != len(payloads):
            raise BenchError("the raw XADD stream has the wrong length")
        return elapsed
    finally:
        await client.aclose()


async def _reset(url: str, *streams: str, group_on: str | None = None) -> None:
    """Delete the streams; then create the consumer group (and its stream) on ``group_on``."""
    client = connect(url)
    try:
        await client.delete(*streams)
        if group_on:
            await Bus(client).ensure_group(group_on, CONSUMER_GROUP, start_id="0")
    finally:
        await client.aclose()


# -- one repetition ---------------------------------------------------------------------


def run_once(url: str, trajectories: Sequence[Trajectory], payloads: Sequence[bytes], cfg: Config) -> Run:
    """One repetition on fresh streams (the trajectories' job's, deleted before and after): the bus
    pipeline and its checks, then raw XADD."""
    streams = JobStreams(trajectories[0].job_id)
    bus_stream, raw_stream = streams.trajectories, f"{streams.trajectories}:raw"
    asyncio.run(_reset(url, bus_stream, raw_stream, group_on=bus_stream))
    try:
        before = CpuSample.now(url)
        result = run_procs(url, bus_stream, trajectories, cfg)
        bus_other = CpuSample.now(url).other_cores_since(before)
        asyncio.run(verify(url, bus_stream, [t.id for t in trajectories], result.seen))
        asyncio.run(_reset(url, bus_stream))  # the baseline reuses the server memory the bus run used
        before = CpuSample.now(url)
        raw_s = asyncio.run(raw_xadd(url, raw_stream, payloads, cfg.batch))
        raw_other = CpuSample.now(url).other_cores_since(before)
    finally:
        asyncio.run(_reset(url, bus_stream, raw_stream))
    bus_s, publish_s = result.end - result.start, result.published - result.start
    return Run(len(trajectories), bus_s, publish_s, raw_s, bus_other, raw_other)


# -- reporting ----------------------------------------------------------------------


def summary(runs: Sequence[Run]) -> tuple[float, float]:
    """Median bus and raw XADD rates."""
    return statistics.median(r.bus_rate for r in runs), statistics.median(r.raw_rate for r in runs)


def section(
    cfg: Config, command: str, host: dict[str, str], sizes: Sequence[int], runs: Sequence[Run]
) -> str:
    """This benchmark's section of RESULTS.md, up to (not including) its notes."""
    bus_rate, raw_rate = summary(runs)
    head = [
        SECTION_TITLE,
        "",
        f"Trajectories of {cfg.tokens:,} response tokens (plus {cfg.prompt_tokens} prompt tokens)"
        " through the bus on one Redis server:",
        *DESCRIPTION.strip("\n").splitlines(),
        f"Producer and consumer: {PRODUCER_AND_CONSUMER}.",
        "",
        f"    {command}",
        "",
        *(f"- {key}: {value}" for key, value in host.items()),
        f"- serialized trajectory: {statistics.mean(sizes):,.0f} bytes on average"
        f" ({min(sizes):,} to {max(sizes):,})",
        f"- per run: {cfg.trajectories:,} trajectories, publish batch {cfg.batch}, XREADGROUP COUNT"
        f" {cfg.count}; {cfg.warmup} uncounted warm-up run(s) first",
        "",
    ]
    table = [
        "| run | bus trajectories/s | bus s | publishing done at s | raw XADD entries/s | bus / raw"
        " | other load, cores (bus / raw) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {k} | {r.bus_rate:,.0f} | {r.bus_s:.2f} | {r.publish_s:.2f} | {r.raw_rate:,.0f}"
            f" | {r.bus_rate / r.raw_rate:.2f} | {r.bus_other:.2f} / {r.raw_other:.2f} |"
            for k, r in enumerate(runs, 1)
        ),
        f"| median | {bus_rate:,.0f} | | | {raw_rate:,.0f} | {bus_rate / raw_rate:.2f} | |",
        "",
        "Other load: CPU cores kept busy by anything but this benchmark and its Redis server (or stolen",
        f"by the hypervisor) while it ran; above {BUSY_MACHINE} the figures understate the bus.",
    ]
    return "\n".join(head + table) + "\n"


# -- main ------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    for flag, (default, _, text) in INT_OPTIONS.items():
        parser.add_argument(flag, type=int, default=default, help=f"{text} (%(default)s)")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL", ""),
        help="default: $REDIS_URL, else an embedded redis-server without persistence",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=Path(__file__).resolve().parent / "RESULTS.md",
        help="file whose bus section to rewrite (bench/RESULTS.md)",
    )
    parser.add_argument("--no-results", action="store_true", help="leave the results file alone")
    args = parser.parse_args(argv)
    for flag, (_, minimum, _) in INT_OPTIONS.items():
        if getattr(args, flag[2:].replace("-", "_")) < minimum:
            parser.error(f"{flag} must be >= {minimum}")
    return args


def measure(url: str, cfg: Config) -> tuple[list[int], list[Run]]:
    """Build the payloads, then run the warm-ups and the measured runs; returns sizes and runs."""
    # One job per process: its streams are this run's alone on a shared Redis server.
    trajectories = build_trajectories(cfg.trajectories, cfg.tokens, cfg.prompt_tokens, f"bench-{os.getpid()}")
    payloads = [t.SerializeToString() for t in trajectories]
    sizes = [len(p) for p in payloads]
    print(
        f"{cfg.trajectories:,} trajectories of {cfg.tokens:,} response + {cfg.prompt_tokens} prompt tokens,"
        f" {statistics.mean(sizes):,.0f} bytes serialized; batch {cfg.batch}, count {cfg.count}"
    )
    runs: list[Run] = []
    for k in range(1 - cfg.warmup, cfg.repeat + 1):
        run = run_once(url, trajectories, payloads, cfg)
        label = f"run {k}" if k > 0 else "warm-up (not counted)"
        print(
            f"{label}: bus {run.bus_rate:,.0f} trajectories/s ({run.bus_s:.2f} s, publishing done at"
            f" {run.publish_s:.2f} s), raw xadd {run.raw_rate:,.0f}/s,"
            f" bus/raw {run.bus_rate / run.raw_rate:.2f}; other load {run.bus_other:.2f}"
            f" / {run.raw_other:.2f} cores"
        )
        if max(run.bus_other, run.raw_other) > BUSY_MACHINE:
            print(f"  warning: other processes were busy during {label}; its figures are low")
        if k > 0:
            runs.append(run)
    return sizes, runs


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = Config(**{f: getattr(args, f) for f in Config.__dataclass_fields__})
    server = None if args.redis_url else EmbeddedRedis()
    url = server.start() if server else args.redis_url
    try:
        host = machine(url, embedded=server is not None)
        for key, value in host.items():
            print(f"{key:>12}: {value}")
        sizes, runs = measure(url, cfg)
    finally:
        if server:
            server.stop()
    if not args.no_results:
        command = shlex.join(
            [".venv/bin/python", "bench/bus.py", *redact(sys.argv[1:] if argv is None else argv)]
        )
        update_results(args.results, SECTION_TITLE, section(cfg, command, host, sizes, runs), NOTES_MARKER)
        print(f"updated {args.results}")
    bus_rate, raw_rate = summary(runs)
    print(f"bus: {round(bus_rate)} trajectories/s (raw xadd {round(raw_rate)}/s)")


if __name__ == "__main__":
    main()
