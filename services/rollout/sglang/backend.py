"""The SGLang rollout backend: verst's engine operations over SGLang's native HTTP API.

``SGLangBackend`` attaches to running SGLang servers by URL (or launches one) and offers what
the Rollout service needs: token-in/token-out ``generate`` with per-token logprobs and policy
versions, ``load_weights`` (``/update_weights_from_disk``), ``abort``, ``pause``/``resume``,
``health``, ``flush_cache``. Every call has an explicit timeout; only idempotent calls are
retried, and only on connection errors. Failures raise ``SGLangError`` subclasses that name the
server, the endpoint and the server's own message. See docs/sglang.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.common.pb import common_pb2, rollout_pb2
from services.rollout.sampling import MAX_SAMPLES_PER_REQUEST, SamplingConfig
from services.rollout.sglang.launch import SGLangProcess, sglang_command, sglang_env
from services.rollout.sglang.protocol import (
    SGLangConnectionError,
    SGLangError,
    SGLangHTTPError,
    SGLangTimeoutError,
    SGLangWeightsError,
    completion_from_output,
    error_message,
    generate_body,
    parse_outputs,
    response_json,
    sample_seeds,
)

log = logging.getLogger(__name__)

__all__ = ["SGLangBackend", "SGLangError", "SGLangStatus", "Timeouts"]


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds allowed per call (the whole call: connect, send, wait, read)."""

    connect_s: float = 5.0
    generate_s: float = 600.0
    weights_s: float = 600.0
    control_s: float = 30.0
    """abort, pause, continue, flush_cache, get_model_info."""
    health_s: float = 30.0
    """``/health_generate`` itself waits up to 20 s (SGLANG_HEALTH_CHECK_TIMEOUT) for a token."""


@dataclass(frozen=True, slots=True)
class SGLangStatus:
    policy_version: int
    """The oldest version any server serves (-1 before the first load_weights)."""
    paused: bool
    running_requests: int
    urls: tuple[str, ...]


@dataclass(eq=False)
class _Sent:
    """One generate call in flight: where it went and the SGLang rids of its samples."""

    url: str
    rids: list[str]


class SGLangBackend:
    """One or more SGLang servers serving the same model, driven over HTTP."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeouts: Timeouts | None = None,
        retries: int = 3,
        backoff_s: float = 0.2,
        always_seed: bool = False,
        initial_version: int = -1,
        transport: httpx.AsyncBaseTransport | None = None,
        process: SGLangProcess | None = None,
    ) -> None:
        """``always_seed``: send a ``sampling_seed`` with every sample (random when the request has
        none) — needed for servers started with ``--enable-deterministic-inference``."""
        if not urls:
            raise ValueError("SGLangBackend needs at least one server URL")
        self.urls = tuple(url.rstrip("/") for url in urls)
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"duplicate SGLang URLs: {list(urls)}")
        self.timeouts = timeouts or Timeouts()
        self.retries = retries
        self.backoff_s = backoff_s
        self.always_seed = always_seed
        self.process = process
        self._client = httpx.AsyncClient(transport=transport, trust_env=False)
        self._versions = dict.fromkeys(self.urls, initial_version)
        self._inflight = dict.fromkeys(self.urls, 0)
        self._loads_idle = {url: asyncio.Event() for url in self.urls}
        for event in self._loads_idle.values():
            event.set()
        self._sent: dict[str, list[_Sent]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._pause_mode: str | None = None
        self._next = 0

    # -- lifecycle -------------------------------------------------------------

    @classmethod
    async def launch(
        cls,
        model_path: str | os.PathLike[str],
        port: int,
        extra_args: Sequence[str] = (),
        *,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 900.0,
        ready_poll_s: float = 1.0,
        env: Mapping[str, str] | None = None,
        log_path: os.PathLike[str] | None = None,
        dtype: str | None = None,
        mem_fraction_static: float | None = None,
        skip_tokenizer_init: bool = False,
        **options: Any,
    ) -> SGLangBackend:
        """Start ``python -m sglang.launch_server`` for ``model_path`` on ``host:port``, wait until
        ``/health_generate`` answers 200 (at most ``startup_timeout_s``), and attach to it.
        The server is stopped by ``close()``, or at once if it does not come up."""
        command = sglang_command(
            model_path,
            port,
            extra_args,
            host=host,
            dtype=dtype,
            mem_fraction_static=mem_fraction_static,
            skip_tokenizer_init=skip_tokenizer_init,
        )
        process = SGLangProcess(command, sglang_env(env), None if log_path is None else Path(log_path))
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        backend = cls([f"http://{connect_host}:{port}"], process=process, **options)
        try:
            await backend.wait_ready(startup_timeout_s, ready_poll_s)
        except BaseException:
            await backend.close()
            raise
        return backend

    async def wait_ready(self, timeout_s: float, poll_s: float = 1.0) -> None:
        """Poll ``/health_generate`` on every server until all answer 200, or raise
        SGLangTimeoutError (or SGLangError if a launched server exits first)."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            self._check_process()
            left = max(deadline - time.monotonic(), 0.001)
            try:
                await self._all("GET", "/health_generate", min(self.timeouts.health_s, left), retry=False)
                return
            except SGLangError as err:
                last = str(err)
            left = deadline - time.monotonic()
            if left <= 0:
                raise SGLangTimeoutError(
                    self.urls[0], "/health_generate", f"not ready within {timeout_s}s: {last}"
                )
            await asyncio.sleep(min(poll_s, left))

    def _check_process(self) -> None:
        if self.process is not None and (code := self.process.returncode()) is not None:
            tail = self.process.log_tail()
            raise SGLangError(self.urls[0], "", f"the launched server exited with status {code}:\n{tail}")

    async def close(self) -> None:
        """Finish pending best-effort aborts, close the HTTP client, stop a launched server."""
        if self._background:
            await asyncio.wait(self._background, timeout=self.timeouts.control_s)
        await self._client.aclose()
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)

    # -- HTTP ------------------------------------------------------------------------

    async def _call(
        self,
        url: str,
        method: str,
        endpoint: str,
        timeout_s: float,
        json: Any = None,
        idempotent: bool = False,
    ) -> httpx.Response:
        """One HTTP call with a deadline; connection errors of idempotent calls are retried with
        exponential backoff. Non-2xx → SGLangHTTPError with the server's message."""
        attempts = 1 + (self.retries if idempotent else 0)
        timeout = httpx.Timeout(timeout_s, connect=min(self.timeouts.connect_s, timeout_s))
        for attempt in range(attempts):
            try:
                async with asyncio.timeout(timeout_s):
                    response = await self._client.request(method, url + endpoint, json=json, timeout=timeout)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                if attempt + 1 == attempts:
                    raise SGLangConnectionError(url, endpoint, f"cannot connect ({err!r})") from None
                await asyncio.sleep(self.backoff_s * 2**attempt)
            except (TimeoutError, httpx.TimeoutException):
                raise SGLangTimeoutError(url, endpoint, f"no answer within {timeout_s}s") from None
            except httpx.HTTPError as err:
                raise SGLangConnectionError(url, endpoint, f"transport error ({err!r})") from None
        if not response.is_success:
            raise SGLangHTTPError(url, endpoint, error_message(response), response.status_code)
        return response

    async def _all(
        self, method: str, endpoint: str, timeout_s: float, json: Any = None, retry: bool = True
    ) -> None:
        """The same idempotent call on every server; the first failure is raised."""
        calls = [self._call(url, method, endpoint, timeout_s, json, idempotent=retry) for url in self.urls]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result

    # -- generation --------------------------------------------------------------------

    def _pick(self) -> str:
        """The server with the fewest samples in flight (round robin among equals)."""
        order = self.urls[self._next :] + self.urls[: self._next]
        self._next = (self._next + 1) % len(self.urls)
        return min(order, key=lambda url: self._inflight[url])

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: common_pb2.SamplingParams,
        request_id: str,
        n: int | None = None,
    ) -> list[rollout_pb2.Completion]:
        """Sample ``n`` (default ``sampling.n``, 0 meaning 1) responses to the prompt.

        Raises ValueError for bad input (as the torch engine does), SGLangError subclasses for
        server failures. If the call times out or is cancelled, its samples are aborted on the
        server (best effort)."""
        config = SamplingConfig.from_proto(sampling)
        return await self.generate_from_config(
            prompt_token_ids, config, request_id, config.n if n is None else n
        )

    async def generate_from_config(
        self, prompt_token_ids: Sequence[int], config: SamplingConfig, request_id: str, count: int
    ) -> list[rollout_pb2.Completion]:
        """``generate`` with validated settings: ``count`` samples under ``config``."""
        if not 1 <= count <= MAX_SAMPLES_PER_REQUEST:
            raise ValueError(f"n must be in [1, {MAX_SAMPLES_PER_REQUEST}], got {count}")
        if not prompt_token_ids or any(t < 0 for t in prompt_token_ids):
            raise ValueError("prompt_token_ids must be non-empty and non-negative")
        url = self._pick()
        await self._loads_idle[url].wait()  # a request sent during a load would run after it
        version = self._versions[url]
        nonce = uuid.uuid4().hex[:8]
        sent = _Sent(url, [f"{request_id}.{nonce}.{i}" for i in range(count)])
        body = generate_body(
            prompt_token_ids, config, sent.rids, sample_seeds(config, count, self.always_seed)
        )
        self._sent.setdefault(request_id, []).append(sent)
        self._inflight[url] += count
        try:
            response = await self._call(url, "POST", "/generate", self.timeouts.generate_s, body)
        except (asyncio.CancelledError, SGLangTimeoutError):
            self._abort_in_background(sent)
            raise
        finally:
            self._inflight[url] -= count
            self._forget(request_id, sent)
        outputs = parse_outputs(response_json(response, url, "/generate"), count, url, "/generate")
        return [completion_from_output(i, out, version, url, "/generate") for i, out in enumerate(outputs)]

    def _forget(self, request_id: str, sent: _Sent) -> None:
        group = self._sent.get(request_id, [])
        if sent in group:
            group.remove(sent)
        if not group:
            self._sent.pop(request_id, None)

    def _abort_in_background(self, sent: _Sent) -> None:
        task = asyncio.get_running_loop().create_task(self._abort_rids(sent.url, sent.rids, quiet=True))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_rids(self, url: str, rids: Sequence[str], quiet: bool = False) -> None:
        """``/abort_request`` for each rid; the first failure is raised, or logged when ``quiet``."""
        calls = [
            self._call(url, "POST", "/abort_request", self.timeouts.control_s, {"rid": rid}, idempotent=True)
            for rid in rids
        ]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, Exception):
                if not quiet:
                    raise result
                log.warning("could not abort a request on %s: %s", url, result)

    async def abort(self, request_id: str) -> int:
        """Abort the samples of a request in flight (``/abort_request`` per SGLang rid); the pending
        ``generate`` returns what was generated so far, marked ABORT. Returns how many requests
        were hit (0 if none with that id is in flight)."""
        group = list(self._sent.get(request_id, ()))
        for sent in group:
            await self._abort_rids(sent.url, sent.rids)
        return len(group)

    async def abort_all(self) -> int:
        """Abort every request on every server (``{"abort_all": true}``); returns how many of this
        backend's requests were in flight."""
        count = sum(len(group) for group in self._sent.values())
        await self._all("POST", "/abort_request", self.timeouts.control_s, {"abort_all": True})
        return count

    # -- control -------------------------------------------------------------------

    async def load_weights(
        self,
        path: str | os.PathLike[str],
        version: int,
        *,
        abort_inflight: bool = False,
        load_format: str | None = None,
    ) -> str:
        """Load an HF checkpoint directory (visible to the servers at ``path``) on every server via
        ``/update_weights_from_disk``, labelled ``weight_version=str(version)``; returns the first
        server's message. SGLang lets requests in flight finish under the old weights first, or
        aborts them (``abort_inflight``: ``abort_all_requests``). Raises SGLangWeightsError naming
        the server on ``success: false``; a server whose load succeeded serves ``version`` even
        if another one failed."""
        if self._pause_mode == "in_place" and self._sent and not abort_inflight:
            raise SGLangError(
                self.urls[0],
                "/update_weights_from_disk",
                "requests are held by an in-place pause; SGLang's weight update would wait for them "
                "forever: resume first, or load with abort_inflight",
            )
        body: dict[str, Any] = {"model_path": os.fspath(path), "weight_version": str(version)}
        if abort_inflight:
            body["abort_all_requests"] = True
        if load_format is not None:
            body["load_format"] = load_format
        results = await asyncio.gather(
            *(self._load_one(url, body, version) for url in self.urls), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return str(results[0])

    async def _load_one(self, url: str, body: dict[str, Any], version: int) -> str:
        endpoint = "/update_weights_from_disk"
        idle = self._loads_idle[url]
        idle.clear()
        try:
            try:
                response = await self._call(url, "POST", endpoint, self.timeouts.weights_s, body)
                reply = response_json(response, url, endpoint)
            except SGLangHTTPError as err:
                raise SGLangWeightsError(url, endpoint, err.message, err.status) from None
            if not isinstance(reply, dict) or reply.get("success") is not True:
                message = reply.get("message") if isinstance(reply, dict) else reply
                raise SGLangWeightsError(url, endpoint, f"success is not true: {message!r:.300}")
            self._versions[url] = version
            return str(reply.get("message", ""))
        finally:
            idle.set()

    async def pause(self, abort_inflight: bool = False) -> int:
        """Stop generation on every server (``/pause_generation``). ``abort_inflight``: mode
        "abort" (requests in flight return now, marked ABORT); else "in_place" (they are held with
        their KV cache until ``resume``). Returns how many requests were aborted."""
        aborted = sum(len(group) for group in self._sent.values()) if abort_inflight else 0
        mode = "abort" if abort_inflight else "in_place"
        await self._all("POST", "/pause_generation", self.timeouts.control_s, {"mode": mode})
        self._pause_mode = mode
        return aborted

    async def resume(self) -> None:
        """Continue generation on every server (``/continue_generation``)."""
        await self._all("POST", "/continue_generation", self.timeouts.control_s, {})
        self._pause_mode = None

    async def health(self) -> None:
        """``/health_generate`` on every server (it generates one token); raises on failure."""
        await self._all("GET", "/health_generate", self.timeouts.health_s)

    async def flush_cache(self) -> None:
        """Empty the radix (prefix) cache of every server; SGLang refuses (400) while requests run."""
        await self._all("POST", "/flush_cache", self.timeouts.control_s)

    async def model_info(self) -> dict[str, Any]:
        """``/get_model_info`` of each server, by URL."""
        endpoint = "/get_model_info"
        info: dict[str, Any] = {}
        for url in self.urls:
            response = await self._call(url, "GET", endpoint, self.timeouts.control_s, idempotent=True)
            info[url] = response_json(response, url, endpoint)
        return info

    # -- state -----------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The oldest version any server serves (-1 before the first ``load_weights``)."""
        return min(self._versions.values())

    def status(self) -> SGLangStatus:
        return SGLangStatus(
            policy_version=self.policy_version,
            paused=self._pause_mode is not None,
            running_requests=sum(len(group) for group in self._sent.values()),
            urls=self.urls,
        )

    async def __aenter__(self) -> SGLangBackend:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
