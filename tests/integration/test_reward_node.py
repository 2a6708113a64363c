"""A reward server in another language: ``examples/reward_server_node`` (Node.js, grpc-js).

The server is started with ``node`` as its own process on a free loopback port, with the proto
files of this repository loaded at run time. Its ``closeness`` rule is checked through verst's
Python stubs against a computation of the same rule here, in Python, on verst's own number
parser (``services.reward.verifiers.last_number``); per-item errors, CheckVerifier, gRPC
health and a graceful SIGTERM are checked too. Then a real runner, on real Redis, runs a job
whose spec names the Node server in ``reward.address``: its trajectories carry the Node
server's scores, and verst's reward service, at the runner's default address, sees none of it.

Node.js and the server's packages are required, never skipped: ``make setup`` installs the
packages (``npm ci --prefix examples/reward_server_node``) and fails without node and npm.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.bus import Bus
from services.common.grpc_client import channel
from services.common.jobs import JobStore
from services.common.pb import reward_pb2, reward_pb2_grpc, router_pb2_grpc
from services.reward.verifiers import last_number
from services.runner.config import RunnerSettings
from services.runner.server import Runner
from tests.helpers import ROOT, eventually, serve, start_server_process, wait_serving
from tests.integration.fake_services import CountingReward, FakeRouter, running_job, trajectories
from tests.integration.test_services import stop

SERVER_DIR = ROOT / "examples" / "reward_server_node"
SERVICE = "verst.v1.Reward"
RTOL = 0.02
"""The tolerance the tests start the server with (its default is 0.01)."""
CLOSENESS = {"parsed", "within_tolerance", "relative_error"}
"""The components of a response with a number under the ``closeness`` rule."""
INSTALL = (
    "install nodejs (Node.js 18 or newer) and npm, e.g. `apt-get install nodejs npm`, then run "
    "`make setup` or `npm ci --prefix examples/reward_server_node`"
)


def node_executable() -> str:
    """The ``node`` on PATH with the server's packages installed; the test fails without them."""
    node = shutil.which("node")
    if node is None:
        pytest.fail(f"node is not installed, and the Node.js reward server needs it: {INSTALL}")
    if not (SERVER_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail(f"the Node.js reward server's packages are not installed in {SERVER_DIR}: {INSTALL}")
    return node


@contextlib.asynccontextmanager
async def node_server(env: dict[str, str], *flags: str) -> AsyncIterator[tuple[str, list[str]]]:
    """The Node server as a process on a free loopback port, once its health says SERVING; yields
    its address and, filled once it has stopped on SIGTERM (exit status 0 asserted), its lines."""
    proc, address = start_server_process([node_executable(), str(SERVER_DIR / "server.js"), *flags], env)
    lines: list[str] = []
    try:
        await wait_serving(address, SERVICE, proc)
        yield address, lines
    finally:
        code, output = stop(proc)
        lines.extend(output.splitlines())
    assert code == 0, output


@dataclass(frozen=True)
class Expected:
    """What the ``closeness`` rule gives one item, computed here."""

    reward: float
    components: dict[str, float]
    parsed: str


def closeness(response_text: str, answer: str, rtol: float) -> Expected:
    """The rule in Python: full credit within ``rtol`` of the answer (relative to
    max(|answer|, 1)), else 1 minus the relative error, floored at 0. Raises ValueError for an
    answer without a number."""
    want = last_number(answer)
    if want is None:
        raise ValueError("the answer has no number")
    got = last_number(response_text)
    if got is None:
        return Expected(0.0, {"parsed": 0.0, "within_tolerance": 0.0}, "")
    error = abs(got[0] - want[0]) / max(abs(want[0]), 1.0)
    within = error <= rtol
    reward = 1.0 if within else max(0.0, 1.0 - error)
    return Expected(
        reward, {"parsed": 1.0, "within_tolerance": float(within), "relative_error": error}, got[1]
    )


SCORED = [  # (response_text, answer), each with a number in its answer
    ("The answer is 100.", "100"),
    ("101", "100"),  # 1% off: within 2%
    ("105", "100"),  # 5% off: 0.95
    ("250", "200"),  # 25% off: 0.75
    ("1,234.5", "1234"),  # thousands separator
    ("0.3", "0.5"),  # below 1 the error is absolute: 0.2 off, 0.8
    ("-3/4", "0.5"),  # a fraction, 1.25 off: 0
    ("6.02e23", "6e23"),  # 0.33% off
    ("first 12, then 13", "#### 13"),  # the last number of each counts
    ("3 / 4", "0.75"),  # spaces around the slash
    ("I do not know", "42"),  # no number: 0, not an error
    ("v1.5", "1.5"),  # a number glued to a word is not one
]


def assert_scored(reply: reward_pb2.ScoreResponse, response_text: str, answer: str) -> None:
    expected = closeness(response_text, answer, RTOL)
    assert not reply.error, (response_text, answer, reply.error)
    assert reply.reward == pytest.approx(expected.reward, abs=1e-12), (response_text, answer)
    assert dict(reply.components) == pytest.approx(expected.components, abs=1e-12), (response_text, answer)
    assert (reply.info["scorer"], reply.info["parsed"], float(reply.info["rtol"])) == (
        "closeness",
        expected.parsed,
        RTOL,
    )


async def test_scores_equal_the_rule_computed_in_python(python_env: dict[str, str]) -> None:
    assert sorted({closeness(r, a, RTOL).reward for r, a in SCORED}) == pytest.approx(
        [0.0, 0.75, 0.8, 0.95, 1.0]
    ), "the cases cover every branch of the rule"
    bad = [
        reward_pb2.ScoreRequest(response_text="42", answer="no number at all"),
        reward_pb2.ScoreRequest(response_text="42", answer=""),
        reward_pb2.ScoreRequest(response_text="42", answer="42", verifier="addition"),
    ]
    async with node_server(python_env, "--rtol", str(RTOL)) as (address, _), channel(address) as client:
        stub = reward_pb2_grpc.RewardStub(client)
        singles = [
            await stub.Score(reward_pb2.ScoreRequest(response_text=r, answer=a), timeout=5) for r, a in SCORED
        ]
        named = await stub.Score(
            reward_pb2.ScoreRequest(response_text="101", answer="100", verifier="closeness"), timeout=5
        )
        items = [reward_pb2.ScoreRequest(response_text=r, answer=a) for r, a in SCORED]
        items[3:3] = bad  # errors amid the batch: the items after them are still scored, in order
        batch = await stub.ScoreBatch(reward_pb2.ScoreBatchRequest(items=items), timeout=5)

    for reply, (response_text, answer) in zip(singles, SCORED, strict=True):
        assert_scored(reply, response_text, answer)
    assert_scored(named, "101", "100")
    results = list(batch.results)
    assert len(results) == len(SCORED) + len(bad)
    for reply, (response_text, answer) in zip(results[:3] + results[6:], SCORED, strict=True):
        assert_scored(reply, response_text, answer)
    no_number, empty, unknown = results[3:6]
    assert "has no number" in no_number.error and "has no number" in empty.error
    assert "unknown verifier" in unknown.error and "closeness" in unknown.error
    assert all(r.reward == 0.0 and not r.components for r in (no_number, empty, unknown))


async def test_check_verifier_health_and_graceful_stop(python_env: dict[str, str]) -> None:
    async with node_server(python_env) as (address, lines), channel(address) as client:
        stub = reward_pb2_grpc.RewardStub(client)
        default, named, other = [
            await stub.CheckVerifier(reward_pb2.CheckVerifierRequest(verifier=name), timeout=5)
            for name in ("", "closeness", "addition")
        ]
        health = health_pb2_grpc.HealthStub(client)
        overall = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as unknown_service:
            await health.Check(health_pb2.HealthCheckRequest(service="verst.v1.Nothing"), timeout=5)
        default_rtol = await stub.Score(
            reward_pb2.ScoreRequest(response_text="101.5", answer="100"), timeout=5
        )

    assert (default.ok, default.error, list(default.verifiers)) == (True, "", ["closeness"])
    assert (named.ok, named.error) == (True, "")
    assert not other.ok and "unknown verifier" in other.error and "closeness" in other.error
    assert list(other.verifiers) == ["closeness"]
    assert overall.status == health_pb2.HealthCheckResponse.SERVING
    assert unknown_service.value.code() is grpc.StatusCode.NOT_FOUND
    assert default_rtol.reward == pytest.approx(0.985) and default_rtol.info["rtol"] == "0.01"
    assert any("serving verst.v1.Reward" in line for line in lines), lines
    assert any("SIGTERM" in line for line in lines) and lines[-1].endswith("stopped"), lines


def test_bad_flags_exit_2_with_usage(python_env: dict[str, str]) -> None:
    node = node_executable()
    for flags, problem in (
        (["--port", "70000"], "--port must be an integer"),
        (["--rtol=-1"], "--rtol must be a number >= 0"),
        (["--rtol", "1e400"], "--rtol must be a number >= 0"),
        (["--portt", "1"], "Unknown option '--portt'"),
    ):
        result = subprocess.run(
            [node, str(SERVER_DIR / "server.js"), *flags],
            env=python_env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 2 and problem in result.stderr and "usage:" in result.stderr, result


class NearRouter(FakeRouter):
    """The fake router, answering numbers: the sum for even sample indices, the sum + OFF for odd."""

    OFF = 5

    def answer(self, text: str, index: int, greedy: bool) -> str:
        a, b = (int(x) for x in text.rstrip("=").split("+"))
        return str(a + b + self.OFF * (index % 2))


async def test_a_job_scored_by_the_node_server_its_spec_names(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    python_env: dict[str, str],
    builtin_reward: tuple[CountingReward, str],
) -> None:
    builtin, builtin_address = builtin_reward
    router = NearRouter(tokenizer)
    async with node_server(python_env, "--rtol", str(RTOL)) as (address, _):
        router_server, router_address = await serve(
            lambda s: router_pb2_grpc.add_RouterServicer_to_server(router, s)
        )
        store = JobStore(bus.redis)
        job = await running_job(
            bus, store, tokenizer, tokenizer_dir, reward={"address": address, "verifier": "closeness"}
        )
        problems = {"55+45=": "100", "47+85=": "132"}
        for index, (text, answer) in enumerate(problems.items()):
            await bus.publish(job.streams.prompts, job.task(index, text, answer))
        runner = Runner(
            bus,
            store,
            RunnerSettings(
                router_address=router_address, reward_address=builtin_address, jobs_refresh_s=0.05
            ),
        )
        stop_runner = asyncio.Event()
        running = asyncio.create_task(runner.run(stop_runner))
        try:

            async def published() -> bool:
                return len(await trajectories(bus, job.job_id)) == 8

            await eventually(published, timeout_s=30, what="8 trajectories scored by the Node server")
        finally:
            stop_runner.set()
            await asyncio.wait_for(running, 10)
            await router_server.stop(None)

    got = sorted(await trajectories(bus, job.job_id), key=lambda t: (t.prompt_id, t.sample_index))
    assert [t.sample_index for t in got] == [0, 1, 2, 3] * 2
    expected = [
        closeness(router.answer(text, index, greedy=False), answer, RTOL)
        for text, answer in problems.items()
        for index in range(4)
    ]
    assert [t.reward for t in got] == pytest.approx([e.reward for e in expected], abs=1e-12)
    assert [t.reward for t in got] == pytest.approx(
        [1.0, 0.95, 1.0, 0.95, 1.0, 1 - 5 / 132, 1.0, 1 - 5 / 132]
    )
    for trajectory, want in zip(got, expected, strict=True):
        assert not trajectory.reward_error
        assert set(trajectory.reward_components) == CLOSENESS
        assert dict(trajectory.reward_components) == pytest.approx(want.components, abs=1e-12)
    assert builtin.jobs == [], "verst's reward service never saw the job's items"
