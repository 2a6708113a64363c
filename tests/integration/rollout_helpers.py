"""Helpers for engine, router and trainer tests: tiny models, checkpoints, running jobs, engines."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import redis.asyncio as aioredis
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.common.bus import Bus, connect
from services.common.engine_registry import EngineRegistry
from services.common.jobs import ACTIVE_JOBS
from services.common.pb import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.redis_server import free_port
from services.common.streams import JOB_INDEX, JobStreams, job_key
from services.rollout.config import EngineSettings
from services.rollout.server import EngineApp
from services.rollout.torch.backend import open_torch_engine
from services.rollout.weights import WEIGHTS_FILE, file_sha256
from services.router.config import RouterSettings
from services.router.server import Router
from tests.helpers import eventually, serve

VOCAB = 100
EOS = 2


def tiny_llama(
    seed: int, *, layers: int = 2, heads: int = 4, max_positions: int = 256, vocab: int = VOCAB
) -> LlamaForCausalLM:
    """A random Llama (hidden 32) small enough to run a hundred steps in a blink (fp32)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def save_checkpoint(model: LlamaForCausalLM, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def handle_for(
    job_id: str, path: Path, version: int, *, sha256: str | None = None
) -> common_pb2.CheckpointHandle:
    handle = common_pb2.CheckpointHandle(
        job_id=job_id,
        version=version,
        uri=path.resolve().as_uri(),
        format="safetensors",
        sha256=sha256 if sha256 is not None else file_sha256(path / WEIGHTS_FILE),
        step=version,
        size_bytes=(path / WEIGHTS_FILE).stat().st_size,
    )
    handle.created_at.GetCurrentTime()
    return handle


async def start_job(redis: aioredis.Redis, job_id: str, *, state: str = "JOB_STATE_RUNNING") -> None:
    """Write the job record the way the api's JobStore does (the fields the engine reads: a
    fixed job id, and no spec, which JobStore.create cannot make)."""
    now = time.time()
    await redis.zadd(JOB_INDEX, {job_id: now})
    await redis.sadd(ACTIVE_JOBS, job_id)
    await redis.hset(
        job_key(job_id), mapping={"state": state, "policy_version": 0, "submitted_at": repr(now)}
    )


async def publish_checkpoint(
    bus: Bus, job_id: str, path: Path, version: int, *, sha256: str | None = None, epoch: int = 0
) -> common_pb2.CheckpointHandle:
    handle = handle_for(job_id, path, version, sha256=sha256)
    handle.epoch = epoch
    await bus.publish(JobStreams(job_id).checkpoints, handle)
    return handle


@dataclass
class RunningEngine:
    """An engine served in this process on a loopback port, with its background work."""

    app: EngineApp
    server: grpc.aio.Server
    channel: grpc.aio.Channel
    stub: rollout_pb2_grpc.RolloutStub
    stop_event: asyncio.Event
    background: asyncio.Task[None]
    address: str
    redis: aioredis.Redis

    @property
    def engine_id(self) -> str:
        return self.app.engine_id

    async def version(self) -> int:
        info = await self.stub.GetStatus(rollout_pb2.GetEngineStatusRequest(), timeout=5)
        return int(info.policy_version)

    async def wait_for_version(self, version: int, timeout_s: float = 15.0) -> None:
        async def serving() -> bool:
            return await self.version() == version

        await eventually(serving, timeout_s=timeout_s, what=f"{self.engine_id} to serve v{version}")

    async def crash(self) -> None:
        """Die without leaving the registry: its last heartbeat stays until it expires."""
        self.background.cancel()
        await asyncio.gather(self.background, return_exceptions=True)
        await self._close()

    async def stop(self) -> None:
        if self.background.done():
            return
        self.stop_event.set()
        await self.background
        await self._close()

    async def _close(self) -> None:
        await self.server.stop(None)
        await self.channel.close()
        await self.app.close()
        await self.redis.aclose()


async def start_engine(redis_url: str, **overrides: object) -> RunningEngine:
    """An engine with a Redis client of its own, as in its own process."""
    port = free_port()
    values: dict[str, object] = {
        "port": port,
        "redis_url": redis_url,
        "device": "cpu",
        "weight_poll_s": 0.05,
        "heartbeat_s": 0.2,
        "batch_wait_ms": 5.0,
        **overrides,
    }
    settings = EngineSettings(**values)  # type: ignore[arg-type]
    redis = connect(redis_url)
    app = EngineApp(settings, redis, await open_torch_engine(settings))
    server, address = await serve(app.register, port)
    stop = asyncio.Event()
    channel = grpc.aio.insecure_channel(address)
    return RunningEngine(
        app=app,
        server=server,
        channel=channel,
        stub=rollout_pb2_grpc.RolloutStub(channel),
        stop_event=stop,
        background=asyncio.create_task(app.run(stop)),
        address=address,
        redis=redis,
    )


@dataclass
class ServedRouter:
    """A router served in this process on a loopback port, with its background work."""

    router: Router
    server: grpc.aio.Server
    address: str
    stop_event: asyncio.Event
    background: asyncio.Task[None]
    redis: aioredis.Redis

    async def stop(self) -> None:
        self.stop_event.set()
        await self.background
        await self.server.stop(None)
        await self.router.close()
        await self.redis.aclose()


async def serve_router(redis_url: str, **overrides: object) -> ServedRouter:
    """A router with a Redis client of its own, as in its own process; it sees engines fast."""
    port = free_port()
    values: dict[str, object] = {
        "port": port,
        "redis_url": redis_url,
        "engine_ttl_s": 1.0,
        "refresh_s": 0.1,
        "default_timeout_s": 20,
        **overrides,
    }
    settings = RouterSettings(**values)  # type: ignore[arg-type]
    redis = connect(redis_url)
    router = Router(settings, EngineRegistry(redis))
    server, address = await serve(router.register, port)
    stop = asyncio.Event()
    return ServedRouter(router, server, address, stop, asyncio.create_task(router.run(stop)), redis)


def generate_request(
    prompt: list[int], *, request_id: str = "r", session_id: str = "", **sampling: object
) -> rollout_pb2.GenerateRequest:
    params = {"max_new_tokens": 8, **sampling}
    return rollout_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(**params),  # type: ignore[arg-type]
        session_id=session_id,
    )


@torch.inference_mode()
def reference_logprobs(model: LlamaForCausalLM, prompt: list[int], response: list[int]) -> list[float]:
    """log_softmax of one full forward pass over prompt + response, at each response token."""
    ids = torch.tensor([prompt + response])
    logprobs = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0]
    return [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(response)]
