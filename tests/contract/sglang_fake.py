"""A fake SGLang server replaying recorded exchanges (sglang_exchange.json), and its fixtures.

Every request the backend sends is checked against the recorded request and against SGLang's
documented /generate fields. SGLang itself needs CUDA and is never run here.
"""

import asyncio
import json
import re
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from services.common.pb import common_pb2
from services.rollout.sglang.backend import SGLangBackend, Timeouts

FIXTURE = json.loads((Path(__file__).parent / "sglang_exchange.json").read_text())
EXCHANGES: dict[str, Any] = FIXTURE["exchanges"]
STOP, LENGTH, ABORT, ERROR = (
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_ABORT,
    common_pb2.FINISH_REASON_ERROR,
)


class FakeSGLang:
    """Replays queued exchanges per path and records every request it gets."""

    def __init__(self) -> None:
        self.queued: dict[str, list[str]] = {}
        self.served: list[tuple[str, dict[str, Any]]] = []
        self.unexpected: list[dict[str, Any]] = []
        self.arrived: dict[str, threading.Event] = {}
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def expect(self, *names: str) -> None:
        with self.lock:
            for name in names:
                self.queued.setdefault(EXCHANGES[name]["request"]["path"], []).append(name)

    def received(self, path: str) -> list[dict[str, Any]]:
        with self.lock:
            return [req for _, req in self.served if req["path"] == path]

    def arrival(self, path: str) -> threading.Event:
        with self.lock:
            return self.arrived.setdefault(path, threading.Event())

    def close(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()

    def _take(self, request: dict[str, Any]) -> dict[str, Any] | None:
        with self.lock:
            queue = self.queued.get(request["path"])
            if not queue:
                self.unexpected.append(request)
                return None
            name = queue.pop(0)
            self.served.append((name, request))
            self.arrived.setdefault(request["path"], threading.Event()).set()
            return EXCHANGES[name]["response"]

    def _respond(self, handler: BaseHTTPRequestHandler, response: dict[str, Any] | None) -> None:
        if response is None:
            status, ctype, data = 599, "text/plain", b"unexpected request"
        else:
            if "hold_until" in response:
                self.arrival(response["hold_until"]).wait(5.0)
            if "delay_s" in response:
                self.stopping.wait(response["delay_s"])
            status = response["status"]
            ctype = response.get("content_type", "application/json")
            raw = response.get("raw_body")
            data = (raw if raw is not None else json.dumps(response["body"])).encode()
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", ctype)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        except OSError:  # the client gave up (timeout tests)
            pass

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                request = {
                    "method": self.command,
                    "path": self.path,
                    "body": json.loads(raw) if raw else None,
                    "content_type": self.headers.get("Content-Type"),
                }
                fake._respond(self, fake._take(request))

            do_GET = do_POST = _serve

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


def matches(expected: Any, actual: Any) -> bool:
    """Recorded value vs sent value; "<any>" and "<rid:X>" placeholders (see the fixture)."""
    if expected == "<any>":
        return True
    if isinstance(expected, str) and expected.startswith("<rid:"):
        prefix = re.escape(expected[5:-1])
        return isinstance(actual, str) and re.fullmatch(prefix + r"\.[0-9a-f]{8}\.\d+", actual) is not None
    if isinstance(expected, dict):
        return (
            isinstance(actual, dict)
            and expected.keys() == actual.keys()
            and all(matches(expected[k], actual[k]) for k in expected)
        )
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(expected) == len(actual)
            and all(matches(e, a) for e, a in zip(expected, actual, strict=True))
        )
    return type(expected) is type(actual) and expected == actual


def assert_documented_generate(body: dict[str, Any]) -> None:
    """The /generate body uses SGLang's documented fields, token ids in and logprobs out."""
    assert set(body) <= set(FIXTURE["documented_generate_fields"]), set(body)
    assert "text" not in body and "input_ids" in body
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1
    samples = (
        body["sampling_params"] if isinstance(body["sampling_params"], list) else [body["sampling_params"]]
    )
    for params in samples:
        assert set(params) <= set(FIXTURE["documented_sampling_params"]), set(params)
        assert "n" not in params  # n > 1 is sent as an explicit batch
    if isinstance(body["rid"], list):
        assert len(body["rid"]) == len(body["input_ids"]) == len(samples)
        assert all(isinstance(ids, list) for ids in body["input_ids"])


def check_served(fake: FakeSGLang) -> None:
    assert not fake.unexpected, f"requests with no recorded exchange: {fake.unexpected}"
    assert not any(fake.queued.values()), f"recorded exchanges never requested: {fake.queued}"
    for name, request in fake.served:
        recorded = EXCHANGES[name]["request"]
        assert request["method"] == recorded["method"], name
        assert matches(recorded["body"], request["body"]), f"{name}: sent {request['body']}"
        if request["body"] is not None:
            assert request["content_type"] == "application/json", name
        if request["path"] == "/generate":
            assert_documented_generate(request["body"])


@pytest.fixture
def fake() -> Iterator[FakeSGLang]:
    server = FakeSGLang()
    try:
        yield server
    finally:
        server.close()
    check_served(server)


@pytest.fixture
async def backend(fake: FakeSGLang) -> AsyncIterator[SGLangBackend]:
    client = SGLangBackend([fake.url], timeouts=Timeouts(generate_s=5.0, control_s=5.0), initial_version=3)
    yield client
    await client.close()


def params(**fields: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"temperature": 1.0, "max_new_tokens": 8, **fields})


async def wait_arrival(fake: FakeSGLang, path: str) -> None:
    assert await asyncio.to_thread(fake.arrival(path).wait, 5.0), f"no request to {path}"
