"""Simulated rollout engines for bench/control_plane.py: the Rollout service without a model.

Benchmark-only. Each simulated engine is a gRPC server of ``verst.v1.Rollout`` on a port of its
own that answers at once with canned samples: ``n`` completions of ``--tokens`` tokens each (at
most the request's ``max_new_tokens``), every token with a logprob and the policy version served,
finished by length, with their text (as SGLang sends it, so that the runner does not decode). Apart
from the model it behaves as a real engine does towards the control plane: it heartbeats its
EngineInfo into the engine registry every second (services/common/engine_registry.py), follows the
newest running job's checkpoint handles (a blocking read of the job's checkpoints stream, as
services/rollout/watcher.py), takes a handle at once (no files are read), makes a request that
needs a newer version (``min_policy_version``) wait for it, answers GenerateBatch request by
request in order, and leaves the registry when it stops. Many engines share one process and event
loop, so that 64 engines cost one Python process, whose CPU bench/control_plane.py reports apart
from the control plane's.

    .venv/bin/python bench/engine_simulator.py --redis-url redis://127.0.0.1:6379/0 --engines 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from redis.exceptions import RedisError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.common.bus import Bus, connect
from services.common.engine_registry import EngineRegistry
from services.common.grpc_server import add_servicer, make_server, shutdown_event
from services.common.jobs import JobStore
from services.common.pb import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.streams import JobStreams
from services.common.wire import record

log = logging.getLogger("engine_simulator")

FIRST_DIGIT = 20
"""builtin:addition's token of "0": canned samples are runs of digits, which its verifier reads."""
HEARTBEAT_S = 1.0
"""As a real engine's default VERST_ENGINE_HEARTBEAT_S."""
WEIGHT_POLL_S = 1.0
"""As a real engine's default VERST_ENGINE_WEIGHT_POLL_S."""
VERSION_WAIT_S = 10.0
"""As a real engine's default VERST_ENGINE_VERSION_WAIT_S."""
STOP_GRACE_S = 2.0


class RequestFailed(Exception):
    """One request's failure, as the gRPC status a real engine would give it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


RESPONSE_FIELD = rollout_pb2.GenerateResult.RESPONSE_FIELD_NUMBER
RESULTS_FIELD = rollout_pb2.GenerateBatchResponse.RESULTS_FIELD_NUMBER


class CannedSamples:
    """The completions every engine of the process answers with, built once per (sample index,
    length, version) and copied into each reply."""

    VERSIONS_KEPT = 4
    """Versions whose samples are kept: engines that follow the weights at their own pace serve
    two or three versions at once (max_staleness), and building a version's samples again each
    time another engine's request came in between cost the simulator a tenth of its CPU with 64
    engines."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self._made: dict[int, dict[tuple[int, int], rollout_pb2.Completion]] = {}
        self._wire: dict[int, dict[tuple[int, int], bytes]] = {}

    def _at(
        self, version: int
    ) -> tuple[dict[tuple[int, int], rollout_pb2.Completion], dict[tuple[int, int], bytes]]:
        made = self._made.get(version)
        if made is None:
            while len(self._made) >= self.VERSIONS_KEPT:  # the oldest version is asked for no more
                oldest = min(self._made)
                del self._made[oldest], self._wire[oldest]
            made = self._made[version] = {}
            self._wire[version] = {}
        return made, self._wire[version]

    def completions_wire(self, n: int, length: int, version: int) -> bytes:
        """A GenerateResponse holding only the ``n`` completions, as bytes: the rest of a
        response is merged in by concatenating its own bytes."""
        wire = self._at(version)[1]
        made = wire.get((n, length))
        if made is None:
            response = rollout_pb2.GenerateResponse(
                completions=[self.completion(i, length, version) for i in range(n)]
            )
            made = wire[n, length] = response.SerializeToString()
        return made

    def completion(self, index: int, length: int, version: int) -> rollout_pb2.Completion:
        cached = self._at(version)[0]
        made = cached.get((index, length))
        if made is None:
            digits = [(index + j) % 10 for j in range(length)]
            made = rollout_pb2.Completion(
                index=index,
                token_ids=[FIRST_DIGIT + digit for digit in digits],
                logprobs=[-0.5] * length,
                policy_versions=[version] * length,
                finish_reason=common_pb2.FINISH_REASON_LENGTH,
                text="".join(map(str, digits)),  # as SGLang, which detokenizes on the engine's host
            )
            cached[index, length] = made
        return made


class SimulatedEngine(rollout_pb2_grpc.RolloutServicer):
    """One engine: the Rollout service over canned samples, its heartbeat and weight following."""

    def __init__(
        self,
        engine_id: str,
        address: str,
        redis_url: str,
        samples: CannedSamples,
        version_wait_s: float = VERSION_WAIT_S,
    ) -> None:
        self.engine_id = engine_id
        self.address = address
        self.redis = connect(redis_url)
        self.samples = samples
        self.version_wait_s = version_wait_s
        self.served: common_pb2.CheckpointHandle | None = None
        self.running = 0
        self._loaded = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()

    # -- weights ----------------------------------------------------------------------------

    def serve(self, handle: common_pb2.CheckpointHandle) -> None:
        """Serve ``handle``'s weights now (a real engine verifies and loads its files first)."""
        self.served = handle
        self._loaded.set()
        self._loaded = asyncio.Event()

    def serves(self, job_id: str, epoch: int, version: int) -> bool:
        served = self.served
        if served is None or served.job_id != job_id:
            return False
        if epoch and served.epoch:
            return (served.epoch, served.version) >= (epoch, version)
        return served.version >= version

    async def follow_weights(self, stop: asyncio.Event) -> None:
        """Serve the newest running job's newest handle as soon as it is published; which job
        that is, is read at most every WEIGHT_POLL_S (as the engine's WeightWatcher does)."""
        bus, jobs = Bus(self.redis), JobStore(self.redis)
        job_id, read_at = None, -WEIGHT_POLL_S
        woken: tuple[str, str, common_pb2.CheckpointHandle | None] | None = None
        while not stop.is_set():
            try:
                if job_id is None or time.monotonic() - read_at >= WEIGHT_POLL_S:
                    running, read_at = await jobs.running_job_ids(), time.monotonic()
                    job_id = running[-1] if running else None
                if job_id is None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), WEIGHT_POLL_S)
                    continue
                stream = JobStreams(job_id).checkpoints
                if woken is not None and woken[0] == job_id:  # the wait read it (as the watcher)
                    seen, handle = woken[1], woken[2]
                else:
                    seen, handle = await bus.newest(stream, common_pb2.CheckpointHandle)
                if handle is not None and self._newer(handle):
                    self.serve(handle)
                newest = await bus.wait_newest(
                    stream, seen, common_pb2.CheckpointHandle, block_ms=int(WEIGHT_POLL_S * 1000)
                )
                woken = (job_id, *newest) if newest is not None else None
            except (RedisError, OSError, TypeError) as err:
                log.warning("%s: weight watch failed: %s", self.engine_id, err)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), WEIGHT_POLL_S)

    def _newer(self, handle: common_pb2.CheckpointHandle) -> bool:
        served = self.served
        if served is None or (served.job_id, served.epoch) != (handle.job_id, handle.epoch):
            return True
        return handle.version > served.version

    async def heartbeat(self, stop: asyncio.Event) -> None:
        """Write the EngineInfo into the registry every HEARTBEAT_S; leave it when stopped."""
        registry = EngineRegistry(self.redis)
        while not stop.is_set():
            try:
                await registry.heartbeat(self.info())
            except (RedisError, OSError) as err:
                log.warning("%s: heartbeat failed: %s", self.engine_id, err)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HEARTBEAT_S)
        with contextlib.suppress(RedisError, OSError):
            await registry.remove(self.engine_id)

    def info(self) -> common_pb2.EngineInfo:
        served = self.served
        state = common_pb2.ENGINE_STATE_STARTING if served is None else common_pb2.ENGINE_STATE_SERVING
        if not self._resumed.is_set():
            state = common_pb2.ENGINE_STATE_PAUSED
        info = common_pb2.EngineInfo(
            engine_id=self.engine_id,
            address=self.address,
            backend="simulator",
            model=served.uri if served is not None else "",
            policy_version=served.version if served is not None else 0,
            state=state,
            running_requests=self.running,
            job_id=served.job_id if served is not None else "",
            weight_transports=["filesystem"],
        )
        info.last_heartbeat.GetCurrentTime()
        return info

    # -- generation -------------------------------------------------------------------------

    async def answer(self, request: rollout_pb2.GenerateRequest) -> rollout_pb2.GenerateResponse:
        """The request's completions, or RequestFailed as a real engine would fail it."""
        return rollout_pb2.GenerateResponse.FromString(await self.answer_wire(request))

    async def answer_wire(self, request: rollout_pb2.GenerateRequest) -> bytes:
        """The request's GenerateResponse as bytes: its own fields', then the canned completions'
        (built once: serialising 1,000-token samples for every request cost the simulator more than
        the rest), or RequestFailed as a real engine would fail it."""
        started = time.monotonic()
        if not self._resumed.is_set():
            try:
                await asyncio.wait_for(self._resumed.wait(), self.version_wait_s)
            except TimeoutError:
                raise RequestFailed(grpc.StatusCode.UNAVAILABLE, "paused") from None
        if request.min_policy_version > 0 and request.job_id:
            await self._wait_for_version(request)
        served = self.served
        if served is None:
            raise RequestFailed(grpc.StatusCode.FAILED_PRECONDITION, "no weights loaded yet")
        n = max(1, request.sampling.n)
        budget = request.sampling.max_new_tokens or self.samples.tokens
        length = min(self.samples.tokens, budget)
        own = rollout_pb2.GenerateResponse(request_id=request.request_id, engine_id=self.engine_id)
        stats = own.stats
        stats.prompt_tokens, stats.completion_tokens = len(request.prompt_token_ids), n * length
        stats.total_s = time.monotonic() - started
        return own.SerializeToString() + self.samples.completions_wire(n, length, served.version)

    async def _wait_for_version(self, request: rollout_pb2.GenerateRequest) -> None:
        wanted = (request.min_policy_epoch, request.min_policy_version)
        deadline = time.monotonic() + self.version_wait_s
        while not self.serves(request.job_id, *wanted):
            left = deadline - time.monotonic()
            if left <= 0:
                version = self.served.version if self.served is not None else "none"
                raise RequestFailed(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"needs {request.job_id} v{wanted[1]}; serves v{version} after {self.version_wait_s}s",
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._loaded.wait(), left)

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GenerateResponse:
        self.running += 1
        try:
            return await self.answer(request)
        except RequestFailed as err:
            await context.abort(err.code, err.details)
            raise  # abort raises; this line is for the type checker
        finally:
            self.running -= 1

    async def GenerateBatch(
        self, request: rollout_pb2.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> bytes:
        """The GenerateBatchResponse as bytes (``start_engine`` registers it so): each request's
        result is its response's bytes as field 1 of a GenerateResult, itself one element of the
        reply's ``results``."""
        self.running += len(request.requests)
        results = []
        try:  # one by one: a request waits only for a version, which the batch's others share
            for one in request.requests:
                try:
                    results.append(record(RESPONSE_FIELD, await self.answer_wire(one)))
                except RequestFailed as err:
                    failed = rollout_pb2.GenerateResult(code=err.code.value[0], details=err.details)
                    results.append(failed.SerializeToString())
        finally:
            self.running -= len(request.requests)
        return b"".join(record(RESULTS_FIELD, result) for result in results)

    async def GenerateStream(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateChunk]:
        try:
            response = await self.answer(request)
        except RequestFailed as err:
            await context.abort(err.code, err.details)
            return
        for done in response.completions:
            yield rollout_pb2.GenerateChunk(
                request_id=response.request_id,
                index=done.index,
                token_ids=done.token_ids,
                logprobs=done.logprobs,
                policy_versions=done.policy_versions,
                finish_reason=done.finish_reason,
                engine_id=self.engine_id,
            )

    async def LoadWeights(
        self, request: rollout_pb2.LoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.LoadWeightsResponse:
        self.serve(request.handle)
        return rollout_pb2.LoadWeightsResponse(policy_version=request.handle.version)

    async def Abort(
        self, request: rollout_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.AbortResponse:
        return rollout_pb2.AbortResponse(aborted=0)  # every request is answered as it comes

    async def Pause(
        self, request: rollout_pb2.PauseRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.PauseResponse:
        self._resumed.clear()
        return rollout_pb2.PauseResponse(aborted=0)

    async def Resume(
        self, request: rollout_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ResumeResponse:
        self._resumed.set()
        return rollout_pb2.ResumeResponse()

    async def GetStatus(
        self, request: rollout_pb2.GetEngineStatusRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.EngineInfo:
        return self.info()


async def start_engine(
    engine_id: str, host: str, redis_url: str, samples: CannedSamples
) -> tuple[SimulatedEngine, grpc.aio.Server]:
    """One engine's server on a free port of ``host``, serving (health included)."""
    server = make_server()
    port = server.add_insecure_port(f"{host}:0")
    engine = SimulatedEngine(engine_id, f"{host}:{port}", redis_url, samples)
    add_servicer(
        rollout_pb2_grpc.add_RolloutServicer_to_server, engine, server, wire_responses={"GenerateBatch"}
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return engine, server


async def run(args: argparse.Namespace) -> None:
    """Serve ``args.engines`` engines until SIGTERM or SIGINT."""
    stop = shutdown_event()
    samples = CannedSamples(args.tokens)
    started = [
        await start_engine(f"{args.id_prefix}-{i}", args.host, args.redis_url, samples)
        for i in range(args.engines)
    ]
    work = [
        asyncio.create_task(job(stop))
        for engine, _ in started
        for job in (engine.heartbeat, engine.follow_weights)
    ]
    log.info("%d simulated engines: %s", len(started), ", ".join(e.address for e, _ in started))
    await stop.wait()
    _, late = await asyncio.wait(work, timeout=WEIGHT_POLL_S + STOP_GRACE_S)
    for task in late:  # a blocking read past its stop check
        task.cancel()
    await asyncio.gather(*(server.stop(STOP_GRACE_S) for _, server in started))
    await asyncio.gather(*(engine.redis.aclose() for engine, _ in started))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--engines", type=int, default=1, help="engines in this process (%(default)s)")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens per sample (%(default)s)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--id-prefix", default="sim", help="engine ids are <prefix>-<index> (%(default)s)")
    args = parser.parse_args(argv)
    if args.engines < 1 or args.tokens < 1:
        parser.error("--engines and --tokens must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine_simulator %(levelname)s %(message)s")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
