"""SGLang's native HTTP API as verst uses it: request bodies, response parsing, errors.

Pure functions, no I/O: ``sglang_backend`` sends what these build and parses what comes back.
The shapes follow SGLang's documented ``/generate`` API (``docs/basic_usage/sampling_params.md``,
``io_struct.py::GenerateReqInput``, ``sampling_params.py::SamplingParams``); see docs/sglang.md for
the sources and what could not be confirmed.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Sequence
from typing import Any

import httpx

from services.common.pb import common_pb2, rollout_pb2
from services.rollout.sampling import SamplingConfig, row_seed

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
"""SGLang's ``meta_info.finish_reason.type`` → verst FinishReason."""
SEED_MODULUS = 2**31 - 1
"""Seeds sent to SGLang stay below 2**31: some releases hold ``sampling_seed`` in an int32 tensor."""
_MAX_MESSAGE = 500


class SGLangError(RuntimeError):
    """A call to an SGLang server failed; names the server, the endpoint and what it said."""

    def __init__(self, url: str, endpoint: str, message: str, status: int | None = None) -> None:
        self.url = url
        self.endpoint = endpoint
        self.message = message
        self.status = status
        where = f"SGLang {url}{endpoint}"
        super().__init__(f"{where}: HTTP {status}: {message}" if status else f"{where}: {message}")


class SGLangHTTPError(SGLangError):
    """The server answered with a non-2xx status."""


class SGLangResponseError(SGLangError):
    """The server answered 2xx with a body that is not what the API documents."""


class SGLangTimeoutError(SGLangError):
    """No answer within the call's timeout."""


class SGLangConnectionError(SGLangError):
    """The server could not be reached (after the retries idempotent calls get)."""


class SGLangWeightsError(SGLangError):
    """``/update_weights_from_disk`` answered ``success: false``."""


def error_message(response: httpx.Response) -> str:
    """The server's own words from an error response: ``error.message``, ``message``, or the text."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:_MAX_MESSAGE]
        if body.get("message"):
            return str(body["message"])[:_MAX_MESSAGE]
        if isinstance(body.get("detail"), str):
            return body["detail"][:_MAX_MESSAGE]
    text = response.text.strip()
    return text[:_MAX_MESSAGE] if text else response.reason_phrase or "(empty body)"


def response_json(response: httpx.Response, url: str, endpoint: str) -> Any:
    """The body as JSON, or SGLangResponseError naming the endpoint."""
    try:
        return response.json()
    except (ValueError, json.JSONDecodeError) as err:
        snippet = response.text[:200]
        raise SGLangResponseError(url, endpoint, f"body is not JSON ({err}): {snippet!r}") from None


def _f32(value: float) -> float:
    """The shortest decimal that is the same float32 (proto floats are float32: 0.7, not 0.699999988)."""
    for digits in range(1, 10):
        short = float(f"{value:.{digits}g}")
        if struct.unpack("f", struct.pack("f", short))[0] == value:
            return short
    return value


def sample_seeds(config: SamplingConfig, n: int, always: bool) -> list[int | None]:
    """One ``sampling_seed`` per sample: derived from the request's seed (as the torch engine
    derives its per-sample streams), random when ``always`` and the request has none, else None.

    SGLang honours ``sampling_seed`` only under ``--enable-deterministic-inference``, where an
    unseeded request gets seed 42: ``always`` keeps the samples of a group from being identical.
    """
    if config.seed is not None:
        return [row_seed(config.seed, i) % SEED_MODULUS for i in range(n)]
    if always:
        return [random.randrange(SEED_MODULUS) for _ in range(n)]
    return [None] * n


def sampling_params(config: SamplingConfig, seed: int | None) -> dict[str, Any]:
    """SGLang ``sampling_params`` for one sample. Every sampling knob is sent explicitly: a server
    started with ``--sampling-defaults model`` would otherwise fill unset ones from the model's
    generation_config, which verst's contract (unset: top_p 1, no top_k, no min_p) does not."""
    params: dict[str, Any] = {
        "temperature": _f32(config.temperature),
        "top_p": _f32(config.top_p),
        "top_k": config.top_k if config.top_k > 0 else -1,
        "min_p": _f32(config.min_p),
        "max_new_tokens": config.max_new_tokens,
        "ignore_eos": config.ignore_eos,
        "no_stop_trim": True,
        "skip_special_tokens": True,  # the text the runner reuses is decoded as it would decode
    }
    if config.stop_token_ids:
        params["stop_token_ids"] = sorted(config.stop_token_ids)
    if config.stop:
        params["stop"] = list(config.stop)
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def generate_body(
    prompt: Sequence[int], config: SamplingConfig, rids: Sequence[str], seeds: Sequence[int | None]
) -> dict[str, Any]:
    """The ``/generate`` body: one request for one sample, an explicit batch of ``len(rids)``
    copies of the prompt for more (each with its own rid and seed, so each can be aborted and
    sampled independently; SGLang documents ``n > 1`` as discouraged)."""
    base = {"return_logprob": True, "logprob_start_len": -1, "stream": False}
    per_sample = [sampling_params(config, seed) for seed in seeds]
    if len(rids) == 1:
        return {"rid": rids[0], "input_ids": list(prompt), "sampling_params": per_sample[0], **base}
    return {
        "rid": list(rids),
        "input_ids": [list(prompt) for _ in rids],
        "sampling_params": per_sample,
        **base,
    }


def parse_outputs(body: Any, n: int, url: str, endpoint: str) -> list[dict[str, Any]]:
    """``/generate``'s answer as a list of ``n`` per-sample outputs (a dict for one, a list for a batch)."""
    outputs = [body] if isinstance(body, dict) else body
    if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
        raise SGLangResponseError(
            url, endpoint, f"expected an object or a list of objects, got {body!r:.200}"
        )
    if len(outputs) != n:
        raise SGLangResponseError(url, endpoint, f"expected {n} outputs, got {len(outputs)}")
    return outputs


def _token_logprobs(meta: dict[str, Any], fail: Any) -> tuple[list[int], list[float]]:
    pairs = meta.get("output_token_logprobs")
    if not isinstance(pairs, list):
        raise fail("meta_info.output_token_logprobs is missing (return_logprob not honoured?)")
    tokens: list[int] = []
    logprobs: list[float] = []
    for i, pair in enumerate(pairs):
        ok = isinstance(pair, list | tuple) and len(pair) >= 2
        if not ok or not isinstance(pair[1], int) or not isinstance(pair[0], int | float):
            raise fail(f"output_token_logprobs[{i}] is not [logprob, token_id, ...]: {pair!r:.100}")
        tokens.append(pair[1])
        logprobs.append(float(pair[0]))
    return tokens, logprobs


def _check_output_ids(output: dict[str, Any], tokens: list[int], fail: Any) -> None:
    """``output_ids`` (``token_ids`` in old releases), when present, must agree with the logprob
    pairs; it may lack a trailing stop token that a release trimmed."""
    ids = output.get("output_ids", output.get("token_ids"))
    if ids is None:
        return
    if not isinstance(ids, list) or ids != tokens[: len(ids)] or len(tokens) - len(ids) > 1:
        raise fail(f"output_ids {ids!r:.100} disagree with output_token_logprobs tokens {tokens!r:.100}")


def _finish(meta: dict[str, Any], fail: Any) -> tuple[int, str]:
    """The verst finish reason and error text of ``meta_info.finish_reason``."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else None
    if kind not in FINISH_REASONS:
        raise fail(f"meta_info.finish_reason {reason!r:.100} is not stop, length or abort")
    assert isinstance(reason, dict)
    status = reason.get("status_code")
    if kind == "abort" and isinstance(status, int) and status >= 400:  # a failure, not a user abort
        return common_pb2.FINISH_REASON_ERROR, str(reason.get("message") or f"aborted with {status}")
    return FINISH_REASONS[kind], ""


def token_versions(meta: dict[str, Any], count: int, fallback: int) -> list[int]:
    """The policy version of each of ``count`` tokens: from ``meta_info.weight_versions`` spans
    (``[{version, start, end}]``, newer releases), else ``meta_info.weight_version``, when they
    hold integers (verst loads weights with ``weight_version=str(version)``), else ``fallback``."""
    spans = meta.get("weight_versions")
    if isinstance(spans, list) and spans:
        versions: list[int] = []
        try:
            for span in spans:
                start, end, version = int(span["start"]), int(span["end"]), int(span["version"])
                if start != len(versions) or end < start:
                    raise ValueError("spans are not contiguous")
                versions.extend([version] * (end - start))
        except (TypeError, KeyError, ValueError):
            versions = []
        if len(versions) == count:
            return versions
    try:
        return [int(meta["weight_version"])] * count
    except (KeyError, TypeError, ValueError):
        return [fallback] * count


def completion_from_output(
    index: int, output: dict[str, Any], fallback_version: int, url: str, endpoint: str
) -> rollout_pb2.Completion:
    """One verst Completion from one SGLang output; SGLangResponseError if it is malformed."""

    def fail(message: str) -> SGLangResponseError:
        return SGLangResponseError(url, endpoint, f"output {index}: {message}")

    meta = output.get("meta_info")
    if not isinstance(meta, dict):
        raise fail("has no meta_info object")
    tokens, logprobs = _token_logprobs(meta, fail)
    _check_output_ids(output, tokens, fail)
    finish, error = _finish(meta, fail)
    text = output.get("text")
    return rollout_pb2.Completion(
        index=index,
        token_ids=tokens,
        logprobs=logprobs,
        policy_versions=token_versions(meta, len(tokens), fallback_version),
        finish_reason=finish,  # type: ignore[arg-type]
        error=error,
        # SGLang's detokenizer decodes every output token without special tokens (no_stop_trim
        # keeps a matched stop string), which is what the runner would decode: it is reused
        text=text if isinstance(text, str) else None,
    )
