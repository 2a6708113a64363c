"""The two sides of bench/engine.py (the verst engine and transformers' generate), the greedy
cross-check between them, and the description of the machine they ran on."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import platform
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
import torch
import transformers
from transformers import AutoModelForCausalLM

from services.common.pb import common_pb2, rollout_pb2
from services.rollout.engine_protocol import Completion, GenerationRequest
from services.rollout.sampling import SamplingConfig
from services.rollout.torch.engine import TorchEngine
from services.rollout.weights import WEIGHTS_FILE, file_sha256

CPU = torch.device("cpu")
TIMEOUT_S = 600.0
"""Longest wait for the engine: one batch of the slowest case takes well under a minute."""
BATCH_WAIT_S = 1.0
"""The engine waits at most this long for a batch to fill; the benchmark fills it at once."""


class BenchError(RuntimeError):
    """A side did not produce what it was asked for (wrong token count, a timeout, an error)."""


def sampling_configs(batch: int, new_tokens: int, *, seed: int, greedy: bool) -> list[SamplingConfig]:
    """One request's settings per row: temperature 1 (or greedy), nothing filtered, ignore_eos."""
    return [
        SamplingConfig.from_proto(
            common_pb2.SamplingParams(
                temperature=0.0 if greedy else 1.0,
                max_new_tokens=new_tokens,
                seed=seed + row,
                ignore_eos=True,
            )
        )
        for row in range(batch)
    ]


class EngineSide:
    """A TorchEngine on the CPU serving one model directory, driven in-process."""

    def __init__(
        self, path: Path, *, compile_decode: bool = False, dtype: torch.dtype = torch.float32
    ) -> None:
        self.engine = TorchEngine(
            device=CPU,
            dtype=dtype,
            max_batch_size=1,
            batch_wait_s=BATCH_WAIT_S,
            compile_decode=compile_decode,
        )
        self.engine.start()
        self.engine.load_checkpoint(
            path,
            sha256=file_sha256(path / WEIGHTS_FILE),
            version=1,
            job_id="",
            mode=rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE,
            timeout_s=TIMEOUT_S,
        )
        self.worker_threads: set[int] = set()
        """torch.get_num_threads() as seen on the engine's worker thread."""

    def close(self) -> None:
        self.engine.shutdown()

    def generate(
        self, prompts: Sequence[list[int]], configs: Sequence[SamplingConfig]
    ) -> tuple[list[GenerationRequest], list[Completion], float]:
        """Submit one request per prompt and wait for all; also returns when the last one ended."""
        self.engine.max_batch_size = len(prompts)  # so that exactly these rows form one batch
        done = threading.Event()
        completions: dict[int, Completion] = {}
        ended: list[float] = []

        def on_completion(row: int, completion: Completion) -> None:  # on the worker thread
            completions[row] = completion
            self.worker_threads.add(torch.get_num_threads())
            if len(completions) == len(prompts):
                ended.append(time.monotonic())
                done.set()

        requests = []
        for row, (prompt, config) in enumerate(zip(prompts, configs, strict=True)):
            callback = functools.partial(on_completion, row)
            request = GenerationRequest(f"bench-{row}", list(prompt), config, callback)
            self.engine.submit(request)  # submitted_at was stamped just before
            requests.append(request)
        if not done.wait(TIMEOUT_S):
            raise BenchError(f"the engine did not finish {len(prompts)} requests in {TIMEOUT_S:.0f}s")
        ordered = [completions[row] for row in range(len(prompts))]
        for request, completion in zip(requests, ordered, strict=True):
            expected = request.config.max_new_tokens
            if completion.error or completion.finish_reason != common_pb2.FINISH_REASON_LENGTH:
                raise BenchError(f"engine row ended with {completion.finish_reason}: {completion.error}")
            if len(completion.token_ids) != expected or len(completion.logprobs) != expected:
                raise BenchError(f"engine row has {len(completion.token_ids)} tokens, not {expected}")
        return requests, ordered, ended[0]

    def timed(self, prompts: Sequence[list[int]], configs: Sequence[SamplingConfig]) -> tuple[float, float]:
        """Seconds from the first submit to the last completion, and the largest time to first token."""
        requests, _, ended = self.generate(prompts, configs)
        ttft = max(r.first_token_at - r.submitted_at for r in requests if r.first_token_at is not None)
        return ended - requests[0].submitted_at, ttft


class HfSide:
    """The same model directory under transformers' generate."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32) -> None:
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(CPU).eval()
        # The engine's ignore_eos: without an EOS id, generate stops at max_new_tokens only.
        self.model.generation_config.eos_token_id = None
        pad = self.model.config.pad_token_id
        self.pad = int(pad) if pad is not None else 0  # the engine's rule (rollout/torch/model.load_model)

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def shape(self) -> str:
        c = self.model.config
        return (
            f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads"
            f" ({c.num_key_value_heads} KV), vocab {c.vocab_size}"
        )

    def inputs(self, prompts: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and attention_mask, left-padded with the engine's pad id."""
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        return ids, mask

    @torch.inference_mode()
    def generate(
        self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, *, scores: bool, sample: bool, seed: int
    ) -> tuple[float, torch.Tensor, torch.Tensor | None, object]:
        """Seconds, the new tokens [B, new_tokens], their logprobs (with scores) and generate's output."""
        torch.manual_seed(seed)
        greedy: dict[str, object] = {"do_sample": False}
        sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else greedy
        start = time.monotonic()
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            pad_token_id=self.pad,
            output_scores=scores,
            return_dict_in_generate=scores,
            **sampling,
        )
        logprobs = None
        if scores:
            logprobs = self.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        seconds = time.monotonic() - start
        sequences = out.sequences if scores else out
        new = sequences[:, ids.shape[1] :]
        if new.shape[1] != new_tokens:
            raise BenchError(f"HF generate made {new.shape[1]} new tokens, not {new_tokens}")
        return seconds, new, logprobs, out

    def generate_tensors(
        self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, *, scores: bool, sample: bool, seed: int
    ) -> tuple[float, torch.Tensor, torch.Tensor | None]:
        """generate without its output object (which does not pickle)."""
        seconds, new, logprobs, _ = self.generate(
            ids, mask, new_tokens, scores=scores, sample=sample, seed=seed
        )
        return seconds, new, logprobs

    def timed(
        self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, *, scores: bool, seed: int
    ) -> float:
        seconds, _, _, out = self.generate(ids, mask, new_tokens, scores=scores, sample=True, seed=seed)
        if scores and not all(bool(torch.isfinite(s).all()) for s in out.scores):  # type: ignore[attr-defined]
            raise BenchError("HF filtered the logits (top-k/top-p left -inf): the settings differ")
        return seconds


def _serve_hf(conn: Connection, path: Path, threads: int, dtype: torch.dtype) -> None:
    """The child of HfProcess: an HfSide answering (method, args, kwargs) calls until None."""
    torch.set_num_threads(threads)
    side = HfSide(path, dtype)
    while (call := conn.recv()) is not None:
        method, args, kwargs = call
        try:
            conn.send((True, getattr(side, method)(*args, **kwargs)))
        except Exception as err:  # the parent re-raises it
            conn.send((False, err))


class HfProcess:
    """An HfSide in a process of its own, with the same torch thread count.

    In one process the two sides would share OpenMP's thread pools: after ``generate`` ran on
    the main thread, the engine's worker thread (which has a pool of its own) was measured
    1.5 to 2x slower, which no deployment sees (an engine process runs nothing else).
    """

    def __init__(self, path: Path, threads: int, dtype: torch.dtype = torch.float32) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve_hf, args=(child, path, threads, dtype), daemon=True)
        self._process.start()
        child.close()
        self.pad = self._call("__getattribute__", "pad")

    def _call(self, method: str, *args: object, **kwargs: object) -> Any:
        self._conn.send((method, args, kwargs))
        if not self._conn.poll(TIMEOUT_S):
            raise BenchError(f"the HF process did not answer {method} within {TIMEOUT_S:.0f}s")
        ok, value = self._conn.recv()
        if not ok:
            raise value
        return value

    def parameters(self) -> int:
        return int(self._call("parameters"))

    def shape(self) -> str:
        return str(self._call("shape"))

    def inputs(self, prompts: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return HfSide.inputs(self, prompts)  # type: ignore[arg-type]  # needs only self.pad

    def generate(
        self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, *, scores: bool, sample: bool, seed: int
    ) -> tuple[float, torch.Tensor, torch.Tensor | None, object]:
        call = ("generate_tensors", ids, mask, new_tokens)
        seconds, new, logprobs = self._call(*call, scores=scores, sample=sample, seed=seed)
        return seconds, new, logprobs, None

    def timed(
        self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, *, scores: bool, seed: int
    ) -> float:
        return float(self._call("timed", ids, mask, new_tokens, scores=scores, seed=seed))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()


def greedy_check(
    engine: EngineSide,
    hf: HfSide | HfProcess,
    prompts: Sequence[list[int]],
    new_tokens: int,
    tolerance: float = 1e-3,
) -> str:
    """Greedy tokens and logprobs of both sides on a small batch, compared (a difference in
    logprobs above ``tolerance`` is warned of: float32's error is far below 1e-3, bfloat16's not)."""
    _, completions, _ = engine.generate(
        prompts, sampling_configs(len(prompts), new_tokens, seed=0, greedy=True)
    )
    ids, mask = hf.inputs(prompts)
    _, tokens, logprobs, _ = hf.generate(ids, mask, new_tokens, scores=True, sample=False, seed=0)
    assert logprobs is not None
    same = sum(c.token_ids == row for c, row in zip(completions, tokens.tolist(), strict=True))
    gap = max(
        abs(a - b)
        for c, row in zip(completions, logprobs.tolist(), strict=True)
        for a, b in zip(c.logprobs, row, strict=True)
    )
    if same < len(prompts) or not gap < tolerance:
        print(
            f"  warning: greedy outputs differ between the engine and HF ({same}/{len(prompts)} rows equal)"
        )
    return (
        f"batch {len(prompts)}, {new_tokens} tokens: {same}/{len(prompts)} rows identical,"
        f" largest logprob difference {gap:.1e}"
    )


def machine_info(dtype: str = "float32") -> dict[str, str]:
    """What the figures depend on: CPU, memory, Python, torch and transformers."""
    model = _cpuinfo("model name") or platform.processor() or "?"
    backend = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in torch.__config__.parallel_info().splitlines()
            if "backend" in ln
        ),
        "?",
    )
    return {
        "cpu": f"{model}, {os.cpu_count()} cores, {matmul_isa(_cpuinfo('flags'))}",
        "ram": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": f"{torch.__version__} (parallel backend {backend}, MKL {torch.backends.mkl.is_available()},"
        f" oneDNN {torch.backends.mkldnn.is_available()})",
        "transformers": transformers.__version__,
        "device, dtype": f"cpu, {dtype}",
    }


MATMUL_ISA = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The CPU features that set float32 and bfloat16 matmul speed: hosts of one model name differ."""


def matmul_isa(flags: str) -> str:
    """Which of MATMUL_ISA a /proc/cpuinfo flags line has, e.g. ``avx2 avx512f`` (or ``none of ...``)."""
    have = set(flags.split())
    found = [name for name in MATMUL_ISA if name in have]
    return " ".join(found) if found else f"none of {' '.join(MATMUL_ISA)}"


def _cpuinfo(key: str) -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.split(":", 1)[0].strip() == key), "")
