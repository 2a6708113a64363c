"""Launching SGLang servers, and the Rollout gRPC service over SGLangBackend, against a fake server."""

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import pytest

from services.common.pb import common_pb2, rollout_pb2
from services.common.redis_server import free_port
from services.rollout.metrics import EngineMetrics
from services.rollout.servicer import EngineInfoSource, RolloutServicer
from services.rollout.sglang.backend import SGLangBackend, Timeouts
from services.rollout.sglang.engine import SGLangEngine, SGLangEngineConfig, start_cancellable
from services.rollout.sglang.launch import sglang_command, sglang_env
from services.rollout.sglang.protocol import (
    SGLangError,
    SGLangResponseError,
    SGLangTimeoutError,
    completion_from_output,
    token_versions,
)
from services.rollout.watcher import WeightLoader
from services.rollout.weights import file_sha256
from tests.contract.sglang_fake import params, wait_arrival
from tests.helpers import Aborted, FakeContext

# -- launching ---------------------------------------------------------------------------------


def test_launch_command_line() -> None:
    command = sglang_command(
        "/models/m",
        30000,
        ["--tp", "2"],
        host="0.0.0.0",
        python="/venv/bin/python",
        dtype="bfloat16",
        mem_fraction_static=0.8,
        skip_tokenizer_init=True,
    )
    assert command == [
        "/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/m",
        "--host", "0.0.0.0", "--port", "30000", "--dtype", "bfloat16",
        "--mem-fraction-static", "0.8", "--skip-tokenizer-init", "--tp", "2",
    ]  # fmt: skip
    assert sglang_command("/m", 1)[3:] == ["--model-path", "/m", "--host", "127.0.0.1", "--port", "1"]
    with pytest.raises(ValueError, match="port"):
        sglang_command("/m", 0)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        sglang_command("/m", 1, mem_fraction_static=1.5)
    assert sglang_env()["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert sglang_env({"SGLANG_RETURN_ORIGINAL_LOGPROB": "0"})["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "0"


FAKE_LAUNCH_SERVER = """
import json, os, subprocess, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # like SGLang's scheduler
open(os.environ["FAKE_ARGV"], "w").write(json.dumps({"argv": args, "pid": os.getpid(), "worker": worker.pid,
    "logprob_env": os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB")}))
if os.environ.get("FAKE_FAIL"):
    print("boom: no CUDA device", flush=True)
    sys.exit(3)
calls = []
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        calls.append(self.path)
        self.send_response(503 if len(calls) == 1 else 200)  # starting, then up
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer((args[args.index("--host") + 1], int(args[args.index("--port") + 1])), H).serve_forever()
"""


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper is not)."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def fake_sglang_package(tmp_path: Path) -> dict[str, str]:
    package = tmp_path / "pkgs" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    return {"PYTHONPATH": str(package.parent), "FAKE_ARGV": str(tmp_path / "argv.json")}


async def test_launch_waits_for_health_and_close_stops_the_server(fake_sglang_package, tmp_path) -> None:
    port = free_port("127.0.0.1")
    client = await SGLangBackend.launch(
        "/models/m", port, ["--tp", "1"], env=fake_sglang_package, startup_timeout_s=20, ready_poll_s=0.05
    )
    started = json.loads(Path(fake_sglang_package["FAKE_ARGV"]).read_text())
    assert started["argv"] == sglang_command("/models/m", port, ["--tp", "1"])[3:]
    assert started["logprob_env"] == "1"
    assert client.urls == (f"http://127.0.0.1:{port}",)
    await client.health()
    await client.close()
    assert client.process is not None and client.process.returncode() is not None
    assert not running(started["pid"]) and not running(started["worker"])  # its children too


async def test_launch_reports_a_server_that_exits(fake_sglang_package) -> None:
    env = {**fake_sglang_package, "FAKE_FAIL": "1"}
    with pytest.raises(SGLangError, match=r"exited with status 3:\n.*boom: no CUDA device"):
        await SGLangBackend.launch("/models/m", free_port("127.0.0.1"), env=env, ready_poll_s=0.05)
    started = json.loads(Path(fake_sglang_package["FAKE_ARGV"]).read_text())
    assert not running(started["worker"])  # what it left behind is stopped too


async def test_a_server_that_never_gets_ready_misses_the_deadline() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(503))
    client = SGLangBackend(["http://sglang.test"], transport=transport)
    with pytest.raises(SGLangTimeoutError, match=r"not ready within 0\.2s: .*HTTP 503"):
        await client.wait_ready(0.2, poll_s=0.05)
    await client.close()


def _meta(finish: Any = None, pairs: Any = ()) -> dict[str, Any]:
    return {"finish_reason": finish or {"type": "stop"}, "output_token_logprobs": list(pairs)}


@pytest.mark.parametrize(
    ("output", "problem"),
    [
        ({"output_ids": [5, 9], "meta_info": _meta(pairs=[[-1.0, 5, None], [-1.0, 6, None]])}, "disagree"),
        ({"meta_info": _meta(pairs=[[None, 5, None]])}, r"not \[logprob, token_id"),
        ({"meta_info": _meta({"type": "eos"})}, "not stop, length or abort"),
        ({"meta_info": {**_meta(), "finish_reason": None}}, "not stop, length or abort"),
        ({"text": "no meta"}, "no meta_info"),
    ],
)
def test_malformed_outputs_are_named(output: dict[str, Any], problem: str) -> None:
    with pytest.raises(SGLangResponseError, match=problem):
        completion_from_output(0, output, 1, "http://s", "/generate")


def test_output_ids_may_lack_a_trimmed_stop_token_and_versions_fall_back() -> None:
    pairs = [[-1.0, 5, None], [-2.0, 2, None]]
    meta = {"finish_reason": {"type": "stop", "matched": 2}, "output_token_logprobs": pairs}
    completion = completion_from_output(0, {"output_ids": [5], "meta_info": meta}, 7, "http://s", "/generate")
    assert list(completion.token_ids) == [5, 2] and list(completion.policy_versions) == [7, 7]
    assert not completion.HasField("text")  # no text from the server: the runner decodes
    bad_spans = {**meta, "weight_versions": [{"version": "1", "start": 1, "end": 2}], "weight_version": "2"}
    assert token_versions(bad_spans, 2, 7) == [2, 2]  # spans not from 0: use weight_version


# -- the Rollout service over SGLangEngine -----------------------------------------------------


def checkpoint(tmp_path: Path, sha256: str | None = None) -> common_pb2.CheckpointHandle:
    directory = tmp_path / "v4"
    directory.mkdir(exist_ok=True)
    (directory / "model.safetensors").write_bytes(b"weights of v4")
    (directory / "config.json").write_text("{}")
    digest = sha256 or file_sha256(directory / "model.safetensors")
    return common_pb2.CheckpointHandle(job_id="job-1", version=4, uri=directory.as_uri(), sha256=digest)


def sglang_servicer(engine: SGLangEngine) -> RolloutServicer:
    info = EngineInfoSource(engine, "engine-sg", "node:50052")
    return RolloutServicer(engine, WeightLoader(engine, 5.0), info, EngineMetrics(engine.status))


async def test_rollout_service_over_sglang(fake, tmp_path) -> None:
    fake.expect("health_generate", "update_weights_checkpoint", "generate_stop")
    backend = await SGLangEngineConfig(urls=(fake.url,), startup_timeout_s=2.0).start()
    servicer = sglang_servicer(SGLangEngine(backend))
    generate = rollout_pb2.GenerateRequest(
        request_id="req-stop", prompt_token_ids=[11, 12, 13], sampling=params(), job_id="job-1"
    )
    with pytest.raises(Aborted) as refused:
        await servicer.Generate(generate, FakeContext())
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION  # no weights loaded yet
    bad = rollout_pb2.LoadWeightsRequest(handle=checkpoint(tmp_path, "0" * 64))
    with pytest.raises(Aborted, match="sha256 mismatch") as mismatch:
        await servicer.LoadWeights(bad, FakeContext())  # refused before SGLang hears of it
    assert mismatch.value.code == grpc.StatusCode.INVALID_ARGUMENT
    loaded = await servicer.LoadWeights(
        rollout_pb2.LoadWeightsRequest(handle=checkpoint(tmp_path)), FakeContext()
    )
    assert loaded.policy_version == 4
    status = await servicer.GetStatus(rollout_pb2.GetEngineStatusRequest(), FakeContext())
    assert (status.backend, status.policy_version, status.job_id) == ("sglang", 4, "job-1")
    assert status.state == common_pb2.ENGINE_STATE_SERVING
    reply = await servicer.Generate(generate, FakeContext())
    assert (reply.request_id, reply.engine_id, reply.stats.completion_tokens) == ("req-stop", "engine-sg", 3)
    assert list(reply.completions[0].token_ids) == [21, 22, 2]
    assert reply.completions[0].text == "ab"  # through the engine's Completion to the proto
    generate.job_id = "job-2"
    with pytest.raises(Aborted, match="not 'job-2'"):
        await servicer.Generate(generate, FakeContext())
    await backend.close()


def test_engine_config_from_settings() -> None:
    settings = SimpleNamespace(
        sglang_urls=" http://a:30000, http://b:30000 ,",
        sglang_model_path="",
        sglang_port=30000,
        sglang_args="--dtype bfloat16 --mem-fraction-static 0.8",
        sglang_startup_timeout_s=60.0,
        sglang_generate_timeout_s=120.0,
        sglang_always_seed=True,
    )
    config = SGLangEngineConfig.from_settings(settings)
    assert config.urls == ("http://a:30000", "http://b:30000") and config.timeouts.generate_s == 120.0
    assert config.args == ("--dtype", "bfloat16", "--mem-fraction-static", "0.8")
    settings.sglang_urls = ""
    with pytest.raises(ValueError, match="VERST_ENGINE_SGLANG_URLS"):
        SGLangEngineConfig.from_settings(settings)


async def test_a_signal_during_startup_abandons_it(monkeypatch: pytest.MonkeyPatch) -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(503))  # never ready
    closed: list[bool] = []

    async def start(self: SGLangEngineConfig) -> SGLangBackend:
        backend = SGLangBackend(self.urls, transport=transport)
        try:
            await backend.wait_ready(self.startup_timeout_s, poll_s=0.02)
        finally:
            await backend.close()
            closed.append(True)
        return backend

    monkeypatch.setattr(SGLangEngineConfig, "start", start)
    asyncio.get_running_loop().call_later(0.1, os.kill, os.getpid(), signal.SIGINT)
    started = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await start_cancellable(SGLangEngineConfig(urls=("http://sglang.test",), startup_timeout_s=30.0))
    assert time.monotonic() - started < 5.0 and closed == [True]


async def test_a_load_naming_no_mode_uses_the_configured_default(tmp_path: Path) -> None:
    """VERST_ENGINE_WEIGHT_UPDATE_MODE=abort: the watcher's loads (mode unspecified) abort in flight."""
    calls: list[bool] = []

    async def load_weights(path: Path, version: int, *, abort_inflight: bool) -> None:
        calls.append(abort_inflight)

    client = SimpleNamespace(load_weights=load_weights, status=lambda: SimpleNamespace(running_requests=3))
    abort = rollout_pb2.WEIGHT_UPDATE_MODE_ABORT
    loader = WeightLoader(SGLangEngine(client, default_mode=abort), 5.0)  # type: ignore[arg-type]
    report = await loader.load(checkpoint(tmp_path), rollout_pb2.WEIGHT_UPDATE_MODE_UNSPECIFIED)
    assert (calls, report.update.mode, report.update.aborted_requests) == ([True], abort, 3)
    keep = await loader.load(checkpoint(tmp_path), rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE)
    assert calls == [True, False] and keep.update.aborted_requests == 0


async def test_generate_failures_and_streams_over_sglang(fake, backend) -> None:
    """SGLang failing is UNAVAILABLE, SGLang refusing the input INVALID_ARGUMENT; a stream is one
    chunk per sample, sent when SGLang answers."""
    fake.expect("generate_500", "generate_400", "generate_stop")
    servicer = sglang_servicer(SGLangEngine(backend))  # the backend serves v3 from the start
    for request_id, code in (
        ("req-500", grpc.StatusCode.UNAVAILABLE),
        ("req-400", grpc.StatusCode.INVALID_ARGUMENT),
    ):
        request = rollout_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[11], sampling=params())
        with pytest.raises(Aborted) as failed:
            await servicer.Generate(request, FakeContext())
        assert failed.value.code == code, request_id
    request = rollout_pb2.GenerateRequest(
        request_id="req-stop", prompt_token_ids=[11, 12, 13], sampling=params()
    )
    chunks = [chunk async for chunk in servicer.GenerateStream(request, FakeContext())]
    assert [(c.request_id, c.index, list(c.token_ids), c.finish_reason, c.engine_id) for c in chunks] == [
        ("req-stop", 0, [21, 22, 2], common_pb2.FINISH_REASON_STOP, "engine-sg")
    ]
    samples = servicer.metrics.registry.get_sample_value(
        "verst_engine_completions_total", {"finish_reason": "stop"}
    )
    assert samples == 1


async def test_a_cancelled_generate_aborts_its_samples_on_sglang(fake) -> None:
    fake.expect("generate_slow", "abort_request_slow_rid")
    client = SGLangBackend([fake.url], timeouts=Timeouts(generate_s=10.0, control_s=2.0), initial_version=1)
    engine = SGLangEngine(client)
    request = rollout_pb2.GenerateRequest(request_id="req-slow", prompt_token_ids=[11], sampling=params())
    call = asyncio.create_task(sglang_servicer(engine).Generate(request, FakeContext()))
    await wait_arrival(fake, "/generate")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await engine.close()  # waits for the best-effort abort
    [abort] = fake.received("/abort_request")
    assert abort["body"]["rid"] == fake.received("/generate")[0]["body"]["rid"]


async def test_control_calls_to_a_failing_sglang_are_unavailable() -> None:
    client = SGLangBackend(
        ["http://sglang.test"], transport=httpx.MockTransport(lambda request: httpx.Response(503))
    )
    servicer = sglang_servicer(SGLangEngine(client))
    calls = [
        servicer.Abort(rollout_pb2.AbortRequest(all=True), FakeContext()),
        servicer.Pause(rollout_pb2.PauseRequest(), FakeContext()),
        servicer.Resume(rollout_pb2.ResumeRequest(), FakeContext()),
    ]
    for call in calls:
        with pytest.raises(Aborted) as failed:
            await call
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE
    assert (await servicer.Abort(rollout_pb2.AbortRequest(request_ids=["gone"]), FakeContext())).aborted == 0
    await client.close()
