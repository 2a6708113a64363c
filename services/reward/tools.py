"""``verst.v1.Tools``: tools a policy calls during a rollout; today ``python``, a sandboxed
interpreter (``sandbox.py``).

A tool's failure is data, as a verifier's is: unknown tool, malformed arguments, code that
raises, runs too long, writes too much or crashes all give an ExecuteResponse with ``ok``
false and ``error`` = ``"<kind>: <what happened>"`` (kinds: ``sandbox.ErrorKind`` plus
``unknown_tool``, ``invalid_arguments``, ``busy``), and the model sees ``output`` as the
observation. A gRPC error means the service itself failed.

Sandboxes run on threads, at most ``sandbox_concurrency`` at once; a call waits for a free
one within its own deadline, and the deadline also bounds the code's wall time (less
``DEADLINE_MARGIN_S`` to start, clean up and answer). With a ``session_id`` the call goes to
that session's long-lived sandbox, whose globals persist; a session ends after
``sandbox_session_idle_s`` without calls, when a new session needs room past
``sandbox_max_sessions`` (the least recently used idle one goes), or when a call kills its
process (timeout, crash...: the error says the state was lost; the next call starts afresh).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import math
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from services.common.pb import reward_pb2, reward_pb2_grpc
from services.reward.config import RewardSettings
from services.reward.sandbox import (
    CLOSE_TIMEOUT_S,
    RunResult,
    SandboxConfig,
    SandboxError,
    Sandboxes,
    SandboxLimits,
    SandboxProcess,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["Tools"].full_name
"""``"verst.v1.Tools"``, as health checks name it."""
DEADLINE_MARGIN_S = 0.5
"""Time kept back from a call's gRPC deadline to start and clean up its sandbox and to answer."""
CODE_MAX_BYTES = 1 << 20
"""Longest source one call may send."""
SESSION_ID_MAX = 256
"""Longest session id."""


@dataclass(frozen=True)
class Tool:
    """What ListTools says about a tool: its name, what it does, its arguments' JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]

    def spec(self) -> reward_pb2.ToolSpec:
        return reward_pb2.ToolSpec(
            name=self.name,
            description=self.description,
            parameters_json_schema=json.dumps(self.parameters, sort_keys=True),
        )


PYTHON = Tool(
    name="python",
    description=(
        "Run Python 3 code in a sandbox and return what it prints (stdout, then stderr). No "
        "network; files only in the working directory; limited time, memory and output. Calls "
        "with the same session id share one interpreter, so variables persist between them."
    ),
    parameters={
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "Python source to run, as a script."},
        },
        "required": ["code"],
        "additionalProperties": False,
    },
)
TOOLS: dict[str, Tool] = {PYTHON.name: PYTHON}


class ToolError(Exception):
    """A call that could not run; ``str()`` is the response's error, ``"<kind>: <message>"``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def python_code(arguments_json: str) -> str:
    """The ``code`` of the python tool's arguments; ToolError when they do not match its schema."""
    try:
        arguments = json.loads(arguments_json)
    except ValueError as err:
        raise ToolError(
            "invalid_arguments", f'arguments are not JSON ({err}); expected {{"code": "..."}}'
        ) from None
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        raise ToolError("invalid_arguments", 'expected an object {"code": "<python source>"}')
    extra = sorted(set(arguments) - {"code"})
    if extra:
        raise ToolError("invalid_arguments", f"unexpected argument(s): {', '.join(extra)}")
    code: str = arguments["code"]
    if len(code.encode("utf-8", "surrogatepass")) > CODE_MAX_BYTES:
        raise ToolError("invalid_arguments", f"code is longer than {CODE_MAX_BYTES} bytes")
    return code


def sandbox_config(settings: RewardSettings) -> SandboxConfig:
    """The sandboxes' configuration from the service's settings."""
    limits = SandboxLimits(
        timeout_s=settings.sandbox_timeout_s,
        cpu_s=settings.sandbox_cpu_s,
        session_cpu_s=settings.sandbox_session_cpu_s,
        memory_mb=settings.sandbox_memory_mb,
        output_bytes=settings.sandbox_output_bytes,
        processes=settings.sandbox_processes,
        disk_bytes=settings.sandbox_disk_mb * 1024 * 1024,
    )
    return SandboxConfig(
        limits=limits,
        python=settings.sandbox_python or sys.executable,
        site_packages=settings.sandbox_site_packages,
        root_dir=settings.sandbox_dir or None,
        uid_base=settings.sandbox_uid_base,
        isolation=settings.sandbox_isolation,
    )


def to_response(
    result: RunResult, call_id: str, output_bytes: int, session_lost: bool
) -> reward_pb2.ExecuteResponse:
    """The ExecuteResponse of a run: stdout then stderr as the observation, marked if cut."""
    output = result.stdout
    if result.stderr:
        output += ("\n" if output and not output.endswith("\n") else "") + result.stderr
    if result.truncated:
        output += f"\n[output truncated: more than {output_bytes} bytes]"
    error = result.error + ("; the session's state was lost" if session_lost and result.error else "")
    return reward_pb2.ExecuteResponse(
        call_id=call_id,
        ok=result.ok,
        output=output,
        error=error,
        exit_code=result.exit_code,
        timed_out=result.timed_out,
        truncated=result.truncated,
        wall_s=result.wall_s,
    )


@dataclass
class Session:
    """A session id's sandbox; ``users`` counts calls holding or waiting for it."""

    sandbox: SandboxProcess | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    users: int = 0


class ToolsServicer(reward_pb2_grpc.ToolsServicer):
    """Lists the tools and executes calls in sandboxes (see the module docstring)."""

    def __init__(self, settings: RewardSettings, sandboxes: Sandboxes | None = None) -> None:
        self._settings = settings
        self._sandboxes = sandboxes if sandboxes is not None else Sandboxes(sandbox_config(settings))
        self._executor = ThreadPoolExecutor(settings.sandbox_concurrency + 2, thread_name_prefix="sandbox")
        self._slots = asyncio.Semaphore(settings.sandbox_concurrency)
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._reaper: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Future[None]] = set()
        atexit.register(self.close)

    @property
    def sandboxes(self) -> Sandboxes:
        return self._sandboxes

    @property
    def session_count(self) -> int:
        """Live sessions (each may hold a sandbox process)."""
        return len(self._sessions)

    async def ListTools(
        self, request: reward_pb2.ListToolsRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ListToolsResponse:
        return reward_pb2.ListToolsResponse(tools=[tool.spec() for tool in TOOLS.values()])

    async def Execute(
        self, request: reward_pb2.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ExecuteResponse:
        started = time.monotonic()
        remaining = context.time_remaining()
        until = math.inf if remaining is None else started + remaining - DEADLINE_MARGIN_S
        wanted = request.timeout_s if math.isfinite(request.timeout_s) and request.timeout_s > 0 else 0.0
        timeout_s = min(wanted or self._settings.sandbox_timeout_s, self._settings.sandbox_max_timeout_s)
        try:
            if request.tool not in TOOLS:
                raise ToolError(
                    "unknown_tool", f"unknown tool {request.tool!r}; tools: {', '.join(sorted(TOOLS))}"
                )
            code = python_code(request.arguments_json)
            if request.session_id:
                result, lost = await self._in_session(request.session_id, code, timeout_s, until)
            else:
                result, lost = await self._once(code, timeout_s, until), False
        except ToolError as err:
            if err.kind in ("sandbox", "busy"):
                log.warning("call %r: %s", request.call_id, err)
            return reward_pb2.ExecuteResponse(
                call_id=request.call_id,
                ok=False,
                error=str(err),
                timed_out=err.kind == "timeout",
                wall_s=time.monotonic() - started,
            )
        return to_response(result, request.call_id, self._settings.sandbox_output_bytes, lost)

    async def _once(self, code: str, timeout_s: float, until: float) -> RunResult:
        def run(cancel: threading.Event) -> RunResult:
            sandbox = self._sandboxes.start(timeout_s=_left(until, self._sandboxes.config.start_timeout_s))
            try:
                return sandbox.run(code, _left(until, timeout_s), cancel)
            finally:
                sandbox.close()

        async with self._slot(until):
            return await self._in_thread(run)

    async def _in_session(
        self, session_id: str, code: str, timeout_s: float, until: float
    ) -> tuple[RunResult, bool]:
        """Run in the session's sandbox (started if it has none); True when its state was lost."""
        session = self._session(session_id)
        async with self._hold(session_id, session, until):

            def run(cancel: threading.Event) -> RunResult:
                if session.sandbox is None or not session.sandbox.alive:
                    start_s = _left(until, self._sandboxes.config.start_timeout_s)
                    session.sandbox = self._sandboxes.start(session=True, timeout_s=start_s)
                return session.sandbox.run(code, _left(until, timeout_s), cancel)

            async with self._slot(until):
                result = await self._in_thread(run)
            if not result.alive:  # killed with everything in it; the next call starts afresh
                session.sandbox = None
        return result, not result.alive

    @contextlib.asynccontextmanager
    async def _hold(self, session_id: str, session: Session, until: float) -> AsyncIterator[None]:
        """The session to oneself, waited for until the deadline; ``users`` counts waiters too,
        so neither eviction nor the idle reaper takes a session someone is about to use."""
        session.users += 1
        try:
            try:
                async with asyncio.timeout_at(_loop_time(until)):
                    await session.lock.acquire()
            except TimeoutError:
                raise ToolError("busy", f"session {session_id!r} stayed busy until the deadline") from None
            try:
                yield
            finally:
                session.last_used = time.monotonic()
                session.lock.release()
        finally:
            session.users -= 1

    def _session(self, session_id: str) -> Session:
        """The session of ``session_id``, made (and room made for it) when new."""
        if len(session_id) > SESSION_ID_MAX:
            raise ToolError("invalid_arguments", f"session_id is longer than {SESSION_ID_MAX} characters")
        session = self._sessions.get(session_id)
        if session is not None:
            self._sessions.move_to_end(session_id)
            return session
        limit = self._settings.sandbox_max_sessions
        if limit == 0:
            raise ToolError(
                "invalid_arguments", "sessions are turned off (VERST_REWARD_SANDBOX_MAX_SESSIONS=0)"
            )
        if len(self._sessions) >= limit:
            idle = next((sid for sid, s in self._sessions.items() if s.users == 0), None)
            if idle is None:
                raise ToolError("busy", f"all {limit} sessions are in use")
            log.info("ending session %r to make room for %r", idle, session_id)
            self._end(self._sessions.pop(idle))
        session = self._sessions[session_id] = Session()
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._end_idle_sessions())
        return session

    async def _end_idle_sessions(self) -> None:
        """End sessions idle for longer than ``sandbox_session_idle_s``, for as long as any live."""
        idle_s = self._settings.sandbox_session_idle_s
        while self._sessions:
            await asyncio.sleep(min(idle_s / 2, 5.0))
            now = time.monotonic()
            for session_id, session in list(self._sessions.items()):
                if session.users == 0 and now - session.last_used > idle_s:
                    log.info(
                        "ending session %r after %.0fs without calls", session_id, now - session.last_used
                    )
                    self._end(self._sessions.pop(session_id))

    def _end(self, session: Session) -> None:
        """Close the session's sandbox on a worker thread (it blocks while the kill is reaped)."""
        if session.sandbox is not None:
            closing = asyncio.get_running_loop().run_in_executor(self._executor, session.sandbox.close)
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
            session.sandbox = None

    @contextlib.asynccontextmanager
    async def _slot(self, until: float) -> AsyncIterator[None]:
        """One of the ``sandbox_concurrency`` slots, waited for until the deadline."""
        try:
            async with asyncio.timeout_at(_loop_time(until)):
                await self._slots.acquire()
        except TimeoutError:
            raise ToolError("busy", "no sandbox became free before the call's deadline") from None
        try:
            yield
        finally:
            self._slots.release()

    async def _in_thread(self, run: Callable[[threading.Event], T]) -> T:
        """``run(cancel)`` on the sandbox threads; if this call is cancelled, so is the run, and
        the slot is held until the sandbox is really gone."""
        cancel = threading.Event()
        future = asyncio.get_running_loop().run_in_executor(self._executor, run, cancel)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancel.set()
            await asyncio.wait([future], timeout=CLOSE_TIMEOUT_S)
            raise
        except SandboxError as err:
            raise ToolError("sandbox", str(err)) from None

    async def aclose(self) -> None:
        """End every session and wait for their sandboxes to be gone."""
        if self._reaper is not None:
            self._reaper.cancel()
        for session_id in list(self._sessions):
            self._end(self._sessions.pop(session_id))
        if self._closing:
            await asyncio.wait(self._closing, timeout=CLOSE_TIMEOUT_S)

    def close(self) -> None:
        """End every session now, blocking (at interpreter exit, when the loop is gone)."""
        for session in self._sessions.values():
            if session.sandbox is not None:
                session.sandbox.close()
                session.sandbox = None
        self._sessions.clear()


def _left(until: float, wanted: float) -> float:
    """``wanted`` seconds, or what is left before ``until`` (monotonic) when that is less."""
    left = until - time.monotonic()
    if left <= 0:
        raise ToolError("timeout", "the call's deadline passed before the code could run")
    return min(wanted, left)


def _loop_time(until: float) -> float | None:
    """``until`` (time.monotonic) on the running loop's clock; None for no deadline."""
    if math.isinf(until):
        return None
    return asyncio.get_running_loop().time() + (until - time.monotonic())


def register(server: grpc.aio.Server, settings: RewardSettings) -> list[str]:
    """Add the Tools servicer to ``server``; returns its service name for health checks."""
    reward_pb2_grpc.add_ToolsServicer_to_server(ToolsServicer(settings), server)
    return [SERVICE_NAME]
