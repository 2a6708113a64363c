"""What one call between two services costs in gRPC's Python aio API: a unary call against a
message each way on a stream left open, the floor under the control plane's engine calls.

The router sends each engine its share of a step as one unary GenerateBatch; with as many engines
as the step has groups (bench/control_plane.py with 64 engines), that is one call per group. Here
client and server share one process on loopback and do nothing but echo: ``--fanout`` calls at
once (as a step's shares go out together), each a ``--request-bytes`` request answered by a
``--reply-bytes`` reply (a group's request, and its eight 1,000-token samples as bytes), in rounds
until ``--calls``; the CPU of the process (client and server together) per call. Unary and stream
alternate within each repeat, medians over the repeats.

    .venv/bin/python bench/grpc_calls.py                # also rewrites its section of bench/RESULTS.md
    .venv/bin/python bench/grpc_calls.py --calls 640 --repeat 1 --no-results

The last line is ``grpc-calls: unary_us=<n> stream_us=<n> ratio=<unary / stream>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import cpu_model, update_results

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
TITLE = "## gRPC calls (bench/grpc_calls.py)"
NOTES = "<!-- notes: written by hand; bench/grpc_calls.py keeps everything from here to the next section -->"
SERVICE = "bench.Echo"
MODES = ("unary", "stream")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread: gRPC's poller's too
    return usage.ru_utime + usage.ru_stime


def echo_handlers(reply: bytes) -> grpc.GenericRpcHandler:
    """A unary method and a bidirectional stream, both answering every request with ``reply``."""

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return reply

    async def stream(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for _ in requests:
            yield reply

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
        },
    )


async def timed(mode: str, args: argparse.Namespace) -> tuple[float, float]:
    """(CPU microseconds, wall microseconds) per call of ``mode`` over ``args.calls`` calls."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((echo_handlers(b"r" * args.reply_bytes),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(args.fanout)]
    request = b"q" * args.request_bytes
    rounds = max(1, args.calls // args.fanout)
    try:
        if mode == "unary":
            calls = [channel.unary_unary(f"/{SERVICE}/Unary") for channel in channels]
            await asyncio.gather(*(call(request, timeout=args.timeout) for call in calls))  # connected
            started, cpu = time.perf_counter(), cpu_seconds()
            for _ in range(rounds):
                await asyncio.gather(*(call(request, timeout=args.timeout) for call in calls))
        else:
            streams = [channel.stream_stream(f"/{SERVICE}/Stream")() for channel in channels]
            await exchange(streams, request, args.timeout)  # opened
            started, cpu = time.perf_counter(), cpu_seconds()
            for _ in range(rounds):
                await exchange(streams, request, args.timeout)
            for stream in streams:
                await stream.done_writing()
        per_call = 1e6 / (rounds * args.fanout)
        return (cpu_seconds() - cpu) * per_call, (time.perf_counter() - started) * per_call
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))
        await server.stop(None)


async def exchange(streams: Sequence[grpc.aio.StreamStreamCall], request: bytes, timeout: float) -> None:
    """One message each way on every stream, the replies awaited together."""
    for stream in streams:
        await stream.write(request)
    replies = await asyncio.wait_for(asyncio.gather(*(stream.read() for stream in streams)), timeout)
    if any(reply is grpc.aio.EOF for reply in replies):
        raise RuntimeError("a stream ended before its reply")


def each(figures: Sequence[tuple[float, float]]) -> str:
    return ", ".join(f"{cpu:.0f}" for cpu, _ in figures)


def section(args: argparse.Namespace, figures: dict[str, list[tuple[float, float]]]) -> str:
    cpu = {mode: statistics.median(c for c, _ in figures[mode]) for mode in MODES}
    wall = {mode: statistics.median(w for _, w in figures[mode]) for mode in MODES}
    lines = [
        TITLE,
        "",
        "CPU of one process (client and server) per call on loopback, gRPC's Python aio API: a unary",
        "call, and a message each way on a stream left open; medians over the repeats.",
        "",
        f"    .venv/bin/python bench/grpc_calls.py {shlex.join(sys.argv[1:])}".rstrip(),
        "",
        f"- cpu: {cpu_model()}, {os.cpu_count()} cores; python {platform.python_version()},"
        f" grpcio {grpc.__version__}",
        f"- {args.fanout} calls at once, {args.calls} calls a mode, requests of {args.request_bytes:,} bytes,"
        f" replies of {args.reply_bytes:,} bytes, {args.repeat} repeats",
        "",
        "| mode | CPU us/call | wall us/call | each repeat's CPU us/call |",
        "|---|---:|---:|---|",
        *(f"| {mode} | {cpu[mode]:.0f} | {wall[mode]:.0f} | {each(figures[mode])} |" for mode in MODES),
        "",
        f"unary / stream, CPU per call: **{cpu['unary'] / cpu['stream']:.2f}**",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=12_800, help="calls per mode and repeat (%(default)s)")
    parser.add_argument("--fanout", type=int, default=64, help="calls at once (%(default)s)")
    parser.add_argument("--request-bytes", type=int, default=2_000, help="(%(default)s)")
    parser.add_argument("--reply-bytes", type=int, default=65_536, help="(%(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="alternations of the two modes (%(default)s)")
    parser.add_argument("--timeout", type=float, default=30.0, help="deadline of each round, s (%(default)s)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--no-results", action="store_true", help="leave the results file alone")
    args = parser.parse_args(argv)
    for name in ("calls", "fanout", "repeat", "request_bytes", "reply_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    figures: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeat):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            figures[mode].append(asyncio.run(timed(mode, args)))
            cpu, wall = figures[mode][-1]
            print(f"repeat {repeat + 1} {mode}: {cpu:.0f} us CPU, {wall:.0f} us wall a call", flush=True)
    text = section(args, figures)
    print("\n" + text)
    if not args.no_results:
        update_results(args.results, TITLE, text, NOTES)
        print(f"updated {args.results}")
    unary, stream = (statistics.median(c for c, _ in figures[mode]) for mode in MODES)
    print(f"grpc-calls: unary_us={unary:.0f} stream_us={stream:.0f} ratio={unary / stream:.2f}")


if __name__ == "__main__":
    main()
