"""verst.v1.Tools over real gRPC: the python tool, its errors as data, sessions, concurrency,
deadlines, and the reward process serving it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_client import channel
from services.common.pb import reward_pb2, reward_pb2_grpc
from services.reward import server as reward_server
from services.reward.config import RewardSettings
from services.reward.tools import SERVICE_NAME, ToolsServicer
from tests.helpers import eventually, serve
from tests.integration.test_services import start, stop
from tests.unit.test_sandbox import sandbox_uids_in_use

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 20.0
SETTINGS = RewardSettings(
    port=0,
    sandbox_timeout_s=3.0,
    sandbox_max_timeout_s=4.0,
    sandbox_memory_mb=256,
    sandbox_output_bytes=2048,
    sandbox_concurrency=2,
    sandbox_max_sessions=2,
    sandbox_session_idle_s=60.0,
)


@pytest.fixture
async def servicer() -> AsyncIterator[ToolsServicer]:
    servicer = ToolsServicer(SETTINGS)
    yield servicer
    await servicer.aclose()
    assert sandbox_uids_in_use(servicer.sandboxes) == set()


@pytest.fixture
async def stub(servicer: ToolsServicer) -> AsyncIterator[reward_pb2_grpc.ToolsStub]:
    server, address = await serve(lambda s: reward_pb2_grpc.add_ToolsServicer_to_server(servicer, s))
    try:
        async with channel(address) as client:
            yield reward_pb2_grpc.ToolsStub(client)
    finally:
        await server.stop(0)


def run_python(
    code: str, session_id: str = "", call_id: str = "", timeout_s: float = 0.0
) -> reward_pb2.ExecuteRequest:
    return reward_pb2.ExecuteRequest(
        tool="python",
        arguments_json=json.dumps({"code": code}),
        session_id=session_id,
        call_id=call_id,
        timeout_s=timeout_s,
    )


async def test_list_tools_describes_python(stub: reward_pb2_grpc.ToolsStub) -> None:
    reply = await stub.ListTools(reward_pb2.ListToolsRequest(), timeout=DEADLINE_S)
    assert [tool.name for tool in reply.tools] == ["python"]
    schema = json.loads(reply.tools[0].parameters_json_schema)
    assert schema["required"] == ["code"] and schema["properties"]["code"]["type"] == "string"
    assert schema["additionalProperties"] is False and "session" in reply.tools[0].description


async def test_execute_python(stub: reward_pb2_grpc.ToolsStub) -> None:
    reply = await stub.Execute(
        run_python("import sys\nprint(2 ** 10)\nprint('warn', file=sys.stderr)", call_id="c1"),
        timeout=DEADLINE_S,
    )
    assert (reply.call_id, reply.ok, reply.output, reply.error, reply.exit_code) == (
        "c1",
        True,
        "1024\nwarn\n",
        "",
        0,
    )
    assert not reply.timed_out and not reply.truncated and 0 < reply.wall_s < 3


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (
            reward_pb2.ExecuteRequest(tool="bash", arguments_json="{}"),
            "unknown_tool: unknown tool 'bash'; tools: python",
        ),
        (
            reward_pb2.ExecuteRequest(tool="python", arguments_json="print(1)"),
            "invalid_arguments: arguments are not JSON",
        ),
        (
            reward_pb2.ExecuteRequest(tool="python", arguments_json='{"source": "1"}'),
            "invalid_arguments: expected an object",
        ),
        (
            reward_pb2.ExecuteRequest(tool="python", arguments_json='{"code": "1", "timeout": 3}'),
            "invalid_arguments: unexpected argument(s): timeout",
        ),
        (
            run_python("1", session_id="s" * 300),
            "invalid_arguments: session_id is longer than 256 characters",
        ),
    ],
)
async def test_bad_calls_are_errors_not_transport_failures(
    stub: reward_pb2_grpc.ToolsStub, request_: reward_pb2.ExecuteRequest, error: str
) -> None:
    reply = await stub.Execute(request_, timeout=DEADLINE_S)
    assert not reply.ok and reply.error.startswith(error), reply.error


async def test_failing_code_shows_its_traceback(stub: reward_pb2_grpc.ToolsStub) -> None:
    reply = await stub.Execute(run_python("print('partial')\n[][1]"), timeout=DEADLINE_S)
    assert (reply.ok, reply.exit_code, reply.error) == (
        False,
        1,
        "exception: IndexError: list index out of range",
    )
    assert (
        reply.output.startswith("partial\nTraceback (most recent call last):")
        and "IndexError" in reply.output
    )


async def test_huge_output_is_truncated_with_a_marker(stub: reward_pb2_grpc.ToolsStub) -> None:
    reply = await stub.Execute(run_python("print('y' * 10 ** 6)"), timeout=DEADLINE_S)
    assert reply.truncated and not reply.ok and reply.error.startswith("output_limit:")
    assert reply.output == "y" * 2048 + "\n[output truncated: more than 2048 bytes]"


async def test_a_session_keeps_variables_and_sessions_are_apart(stub: reward_pb2_grpc.ToolsStub) -> None:
    assert (await stub.Execute(run_python("x = 20", session_id="a"), timeout=DEADLINE_S)).ok
    assert (await stub.Execute(run_python("x = 1", session_id="b"), timeout=DEADLINE_S)).ok
    reply = await stub.Execute(run_python("x += 22\nprint(x)", session_id="a"), timeout=DEADLINE_S)
    assert (reply.ok, reply.output) == (True, "42\n")
    assert (await stub.Execute(run_python("print(x)", session_id="b"), timeout=DEADLINE_S)).output == "1\n"
    one_shot = await stub.Execute(run_python("print(x)"), timeout=DEADLINE_S)
    assert one_shot.error == "exception: NameError: name 'x' is not defined"


async def test_a_session_killed_by_a_timeout_says_its_state_was_lost(stub: reward_pb2_grpc.ToolsStub) -> None:
    assert (await stub.Execute(run_python("x = 1", session_id="a"), timeout=DEADLINE_S)).ok
    reply = await stub.Execute(
        run_python("while True: pass", session_id="a", timeout_s=0.5), timeout=DEADLINE_S
    )
    assert reply.timed_out and reply.error == (
        "timeout: the code ran longer than 0.5s and was stopped; the session's state was lost"
    )
    again = await stub.Execute(run_python("print('x' in globals())", session_id="a"), timeout=DEADLINE_S)
    assert (again.ok, again.output) == (True, "False\n")


async def test_the_least_recently_used_idle_session_makes_room(stub: reward_pb2_grpc.ToolsStub) -> None:
    for name in ("a", "b"):
        assert (await stub.Execute(run_python(f"name = {name!r}", session_id=name), timeout=DEADLINE_S)).ok
    assert (await stub.Execute(run_python("print(name)", session_id="a"), timeout=DEADLINE_S)).output == "a\n"
    assert (await stub.Execute(run_python("name = 'c'", session_id="c"), timeout=DEADLINE_S)).ok  # ends b
    assert (await stub.Execute(run_python("print(name)", session_id="a"), timeout=DEADLINE_S)).output == "a\n"
    reply = await stub.Execute(run_python("print(name)", session_id="b"), timeout=DEADLINE_S)
    assert reply.error == "exception: NameError: name 'name' is not defined"


async def test_calls_on_one_session_take_turns_and_busy_sessions_are_not_evicted(
    stub: reward_pb2_grpc.ToolsStub,
) -> None:
    started = time.monotonic()
    sleepers = [
        stub.Execute(run_python(f"import time; time.sleep(0.5); n = {i}", session_id=sid), timeout=DEADLINE_S)
        for i, sid in enumerate(["a", "a", "b"])
    ]
    running = asyncio.gather(*sleepers)
    await asyncio.sleep(0.2)
    refused = await stub.Execute(run_python("1", session_id="c"), timeout=DEADLINE_S)
    assert refused.error == "busy: all 2 sessions are in use"
    assert all(reply.ok for reply in await running)
    assert time.monotonic() - started >= 1.0  # the two calls on "a" ran one after the other
    reply = await stub.Execute(run_python("print(n)", session_id="a"), timeout=DEADLINE_S)
    assert reply.output in ("0\n", "1\n")


async def test_idle_sessions_end() -> None:
    servicer = ToolsServicer(SETTINGS.model_copy(update={"sandbox_session_idle_s": 0.3}))
    server, address = await serve(lambda s: reward_pb2_grpc.add_ToolsServicer_to_server(servicer, s))
    try:
        async with channel(address) as client:
            stub = reward_pb2_grpc.ToolsStub(client)
            assert (await stub.Execute(run_python("x = 1", session_id="a"), timeout=DEADLINE_S)).ok
            ended = lambda: asyncio.sleep(0, not servicer.session_count)  # noqa: E731
            await eventually(ended, "the idle session to end", 5.0)
            reply = await stub.Execute(run_python("print(x)", session_id="a"), timeout=DEADLINE_S)
            assert reply.error == "exception: NameError: name 'x' is not defined"
    finally:
        await servicer.aclose()
        await server.stop(0)


async def test_calls_run_concurrently_up_to_the_bound(stub: reward_pb2_grpc.ToolsStub) -> None:
    started = time.monotonic()
    calls = [
        stub.Execute(run_python(f"import time; time.sleep(1); print({i})"), timeout=DEADLINE_S)
        for i in range(4)
    ]
    replies = await asyncio.gather(*calls)
    took = time.monotonic() - started
    assert [r.output for r in replies] == [f"{i}\n" for i in range(4)]
    assert 2.0 <= took < 3.8  # two at a time: two rounds of one second, not one, not four


async def test_the_grpc_deadline_stops_the_code_and_answers_in_time(
    stub: reward_pb2_grpc.ToolsStub, servicer: ToolsServicer
) -> None:
    started = time.monotonic()
    reply = await stub.Execute(run_python("print('begun')\nimport time; time.sleep(30)"), timeout=1.5)
    assert time.monotonic() - started < 1.5
    assert reply.timed_out and reply.error.startswith("timeout: the code ran longer than")
    assert reply.output == "begun\n"
    assert sandbox_uids_in_use(servicer.sandboxes) == set()


async def test_a_deadline_too_short_to_run_is_a_timeout(stub: reward_pb2_grpc.ToolsStub) -> None:
    try:
        reply = await stub.Execute(run_python("print(1)"), timeout=0.3)
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        assert reply.timed_out and reply.error.startswith("timeout:")


async def test_a_cancelled_call_kills_its_sandbox(
    stub: reward_pb2_grpc.ToolsStub, servicer: ToolsServicer
) -> None:
    call = asyncio.ensure_future(stub.Execute(run_python("import time; time.sleep(30)"), timeout=DEADLINE_S))

    async def running() -> bool:
        return bool(sandbox_uids_in_use(servicer.sandboxes))

    await eventually(running, "the sandbox to start", 5.0)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call

    async def gone() -> bool:
        return not sandbox_uids_in_use(servicer.sandboxes)

    await eventually(gone, "the cancelled call's sandbox to be killed", 5.0)
    reply = await stub.Execute(run_python("print('next')"), timeout=DEADLINE_S)
    assert reply.ok and reply.output == "next\n"


async def test_register_adds_tools_beside_reward() -> None:
    server = grpc.aio.server()
    names = reward_server.register(server, RewardSettings(port=0))
    assert names == [reward_server.SERVICE_NAME, SERVICE_NAME] == ["verst.v1.Reward", "verst.v1.Tools"]
    assert reward_server.register(grpc.aio.server(), RewardSettings(port=0, tools_enabled=False)) == [
        "verst.v1.Reward"
    ]


async def test_the_reward_process_serves_tools(
    python: str, python_env: dict[str, str], redis_url: str
) -> None:
    proc, port = start(python, python_env, ["services.reward"], "VERST_REWARD_PORT", redis_url)
    try:
        async with channel(f"127.0.0.1:{port}") as client:
            health = health_pb2_grpc.HealthStub(client)
            check = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            status = await health.Check(check, timeout=30, wait_for_ready=True)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            stub = reward_pb2_grpc.ToolsStub(client)
            assert (await stub.Execute(run_python("y = 6", session_id="s"), timeout=DEADLINE_S)).ok
            reply = await stub.Execute(run_python("print(y * 7)", session_id="s"), timeout=DEADLINE_S)
    finally:
        code, output = stop(proc)
    assert (reply.ok, reply.output) == (True, "42\n"), reply.error
    assert code == 0, output
