"""Run untrusted Python in a sandbox process: one per call, or one per stateful session.

A ``SandboxProcess`` is one ``sandbox_child.py`` supervisor and its runner (see that module for
the isolation layers: network namespace, read-only mount namespace, a uid of its own, a seccomp
filter that refuses sockets, rlimits). Whether they can be applied here is probed once per
interpreter and mode (``probe``, also run and logged at the service's start): where they cannot,
every start fails at once with one ``SandboxIsolationError`` that names what is missing and the
setting to change, instead of running the code with less isolation. This side starts it with a
scrubbed environment and a private working directory, sends it code, and reads stdout, stderr
and a status pipe without ever holding more than the output cap: past the cap, or past the
wall-time limit, or when the caller cancels, it tells the supervisor to kill every process of
the sandbox, which it does and then reports how the runner ended. Everything here blocks;
callers run it on threads.

A call's end is known from its status line plus a marker the runner writes on stdout and
stderr after the code returns, so a session's next call starts on clean streams. Output a
background thread or process writes after its call ended shows up in the next call of the
session (or is dropped when there is none).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from services.reward import sandbox_child
from services.reward.sandbox_output import OutputBudget, OutputStream

log = logging.getLogger(__name__)

CHILD = Path(sandbox_child.__file__)
POLL_S = 0.05
"""How often a waiting call looks at its cancel flag."""
STATUS_LINE_MAX = 64 * 1024
"""Longest status line kept; the code can write junk on the status pipe, bounded by this."""
CLOSE_TIMEOUT_S = sandbox_child.REAP_DEADLINE_S + 3.0
"""How long closing waits for the supervisor to kill, reap and report."""


ISOLATION_SETTING = "VERST_REWARD_SANDBOX_ISOLATION"
"""The setting that chooses ``SandboxConfig.isolation``, as the refusal names it."""
ISOLATION_NEEDS = (
    "the sandbox needs root in the reward container, with CAP_SYS_ADMIN (namespaces, mounts) beside "
    "Docker's default CAP_SETUID, CAP_SETGID and CAP_CHOWN, and seccomp and AppArmor profiles that "
    "allow unshare and mount (docs/reward.md, 'What the reward container needs')"
)


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, or vanished): not the code's fault."""


class SandboxIsolationError(SandboxError):
    """The sandbox cannot isolate code here (a layer the mode requires cannot be applied)."""


class Isolation(StrEnum):
    """How much isolation a sandbox must have before it runs code."""

    REQUIRED = sandbox_child.REQUIRED
    """Every layer (namespaces, uid, seccomp); a missing one refuses every call."""
    UNSAFE = sandbox_child.UNSAFE
    """For trusted code only: the namespaces that cannot be made are left out (no uid of its own
    either without root); seccomp, and the uid drop when root, still apply."""


class ErrorKind(StrEnum):
    """Why a call did not succeed; the prefix of ``RunResult.error``."""

    NONE = ""
    EXCEPTION = "exception"
    EXIT = "exit"
    TIMEOUT = "timeout"
    CPU_TIME = "cpu_time"
    MEMORY = "memory"
    OUTPUT_LIMIT = "output_limit"
    CRASH = "crash"
    CANCELLED = "cancelled"
    SANDBOX = "sandbox"


@dataclass(frozen=True)
class SandboxLimits:
    """What one call (or one session) may use."""

    timeout_s: float = 10.0
    """Wall time of one call when the caller names none."""
    cpu_s: float = 10.0
    """CPU seconds of one call, per process (RLIMIT_CPU; SIGXCPU past it)."""
    session_cpu_s: float = 600.0
    """CPU seconds a session's runner may use over all its calls."""
    memory_mb: int = 512
    """Address space of each sandbox process, MiB (RLIMIT_AS)."""
    output_bytes: int = 64 * 1024
    """stdout plus stderr of one call; past it the call is stopped and its output truncated."""
    processes: int = 32
    """Processes and threads of the sandbox (RLIMIT_NPROC; its own uid when the service is root)."""
    disk_bytes: int = 64 * 1024 * 1024
    """Space for files: the size of the working directory (a tmpfs) under the mount namespace,
    and the largest file the code may write (RLIMIT_FSIZE)."""
    open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE); at least 64."""


@dataclass(frozen=True)
class SandboxConfig:
    """How sandboxes are made."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    """Limits of every call."""
    python: str = sys.executable
    """Interpreter that runs the code."""
    site_packages: bool = False
    """Let the code import the interpreter's site-packages (drops ``-S``)."""
    root_dir: str | None = None
    """Directory for the sandboxes' working directories; None: the system's temporary directory."""
    uid_base: int = 2_000_000_000
    """First uid of the sandboxes when the service is root; each live one gets its own."""
    uid_count: int = 65536
    """How many uids from ``uid_base`` the sandboxes may use."""
    start_timeout_s: float = 10.0
    """How long a new sandbox may take to isolate itself and say it is ready."""
    isolation: Isolation = Isolation.REQUIRED
    """Refuse to run code without every layer, or (trusted code only) run it with what applies."""


@dataclass
class RunResult:
    """The outcome of one call."""

    stdout: str
    stderr: str
    kind: ErrorKind
    error: str
    """Empty on success, else ``"<kind>: <what happened>"``."""
    exit_code: int
    """The code's exit status; minus the signal number when a signal ended it."""
    truncated: bool
    wall_s: float
    signal: int | None = None
    alive: bool = False
    """The sandbox survived the call and can take another (a session keeps its globals)."""

    @property
    def ok(self) -> bool:
        return self.kind is ErrorKind.NONE

    @property
    def timed_out(self) -> bool:
        return self.kind is ErrorKind.TIMEOUT


def process_uids(low: int, high: int) -> set[int]:
    """The real uids in [low, high) that some process has."""
    return {uid for uid, _ in sandbox_child.processes().values() if low <= uid < high}


class UidPool:
    """Gives each live sandbox a uid no other process has; a uid whose processes could not all
    be killed stays out of use while any of them lives.

    Another sandbox service on the same host (a second replica, a test run) draws from the same
    range: each pool starts at an offset of its own and skips any uid that has a process when it
    is handed out, so two services do not share a uid (and so a kill of one's sandbox)."""

    def __init__(self, base: int, count: int) -> None:
        self._base, self._count = base, count
        self._lock = threading.Lock()
        self._next = (os.getpid() * 997) % count
        self._busy: set[int] = set()
        self.used: set[int] = set()
        """Every uid this pool has handed out."""
        taken = process_uids(base, base + count)
        if taken:
            log.info("sandbox uids %s have processes (another service's?); skipping them", sorted(taken))

    def acquire(self) -> int:
        with self._lock:
            taken = process_uids(self._base, self._base + self._count)
            for _ in range(self._count):
                uid = self._base + self._next
                self._next = (self._next + 1) % self._count
                if uid in self._busy or uid in taken:
                    continue
                self._busy.add(uid)
                self.used.add(uid)
                return uid
        raise SandboxError(f"all {self._count} sandbox uids are in use")

    def release(self, uid: int, clean: bool) -> None:
        with self._lock:
            self._busy.discard(uid)
            if not clean:  # acquire skips it while any of its processes lives
                log.error("sandbox uid %d still has processes after the kill; it stays out of use", uid)


class SandboxProcess:
    """One live sandbox. ``start`` it, ``run`` code any number of times (one at a time), then
    ``close`` it; a call that does not end normally kills it."""

    def __init__(self, config: SandboxConfig, uids: UidPool | None) -> None:
        self.config = config
        self.layers: list[str] = []
        self._uids = uids
        self._uid: int | None = None
        self._workdir: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lifeline = -1
        self._selector = selectors.DefaultSelector()
        marker = f"\0\x1everst-end-{secrets.token_hex(8)}\0".encode()
        self._marker = marker
        self._streams = {"out": OutputStream(marker), "err": OutputStream(marker)}
        self._budget = OutputBudget(config.limits.output_bytes)
        self._status_buffer = b""
        self._events: dict[str, dict] = {}
        self._closed = False
        self._hard_cpu = math.inf

    @property
    def alive(self) -> bool:
        return self._proc is not None and not self._closed and "exit" not in self._events

    def start(self, session: bool = False, timeout_s: float | None = None) -> None:
        """Spawn the supervisor and wait (at most ``timeout_s``, default the config's) until
        the runner says it is isolated and ready; a ``session`` gets the session CPU budget."""
        try:
            self._spawn(session)
            deadline = time.monotonic() + (self.config.start_timeout_s if timeout_s is None else timeout_s)
            self._pump(deadline, lambda: bool({"ready", "setup_error"} & self._events.keys()))
        except BaseException:
            self.close()
            raise
        if "ready" not in self._events:
            event = self._events.get("setup_error", {})
            self.close()
            if "layer" in event:
                raise SandboxIsolationError(isolation_refusal(str(event.get("message"))))
            raise SandboxError(f"the sandbox did not start: {event.get('message', 'no ready signal')}")
        self.layers = list(self._events["ready"]["layers"])

    def _spawn(self, session: bool) -> None:
        self._workdir = os.path.realpath(tempfile.mkdtemp(prefix="verst-sandbox-", dir=self.config.root_dir))
        self._hard_cpu = self._cpu_hard_s(session)
        if self._uids is not None:
            self._uid = self._uids.acquire()
            os.chown(self._workdir, self._uid, self._uid)
        status_r, status_w = os.pipe()
        self._selector.register(status_r, selectors.EVENT_READ, "status")  # close() closes it
        lifeline_r, self._lifeline = os.pipe()
        limits = self.config.limits
        child_config = {
            "workdir": self._workdir,
            "uid": self._uid,
            "gid": self._uid,
            "marker": self._marker.decode(),
            "isolation": self.config.isolation.value,
            "status_fd": status_w,
            "lifeline_fd": lifeline_r,
            "limits": {
                "cpu_s": limits.cpu_s,
                "cpu_hard_s": self._hard_cpu,
                "memory_bytes": limits.memory_mb * 1024 * 1024,
                "processes": limits.processes,
                "file_bytes": limits.disk_bytes,
                "open_files": max(64, limits.open_files),
            },
        }
        flags = ["-I", "-B", "-X", "utf8"] + ([] if self.config.site_packages else ["-S"])
        env = {  # nothing of the service's environment
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": self._workdir,
            "TMPDIR": self._workdir,
            "LANG": "C.UTF-8",
            "MALLOC_ARENA_MAX": "2",  # glibc's per-thread arenas would eat RLIMIT_AS
        }
        try:
            self._proc = subprocess.Popen(
                [self.config.python, *flags, str(CHILD), json.dumps(child_config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w, lifeline_r),
                env=env,
                cwd="/",
                start_new_session=True,
            )
        finally:
            os.close(status_w)
            os.close(lifeline_r)
        assert self._proc.stdin and self._proc.stdout and self._proc.stderr
        os.set_blocking(self._proc.stdin.fileno(), False)
        os.set_blocking(status_r, False)
        for name, fd in (("out", self._proc.stdout.fileno()), ("err", self._proc.stderr.fileno())):
            os.set_blocking(fd, False)
            self._selector.register(fd, selectors.EVENT_READ, name)

    def _cpu_hard_s(self, session: bool) -> int:
        """RLIMIT_CPU's hard limit (SIGKILL), a second past the soft one (SIGXCPU) of the last call."""
        limits = self.config.limits
        return math.ceil(max(limits.cpu_s, limits.session_cpu_s) if session else limits.cpu_s) + 1

    def run(self, code: str, timeout_s: float, cancel: threading.Event | None = None) -> RunResult:
        """Run ``code`` with a wall-time limit; the sandbox is killed unless the call ends normally."""
        if not self.alive:
            raise SandboxError("the sandbox is not running")
        started = time.monotonic()
        deadline = started + timeout_s
        for stream in self._streams.values():
            stream.begin()
        self._budget = OutputBudget(self.config.limits.output_bytes)
        self._events.pop("result", None)
        request = json.dumps({"code": code, "cpu_s": self.config.limits.cpu_s}).encode()
        reason = self._send(struct.pack(">I", len(request)) + request, deadline, cancel)
        if reason == "sent":
            reason = self._pump(deadline, self._call_done, cancel)
        if reason != "done":
            self.close()
        return self._result(reason, time.monotonic() - started, timeout_s)

    def _call_done(self) -> bool:
        result = self._events.get("result")
        if result is None:
            return False
        streams = {1: self._streams["out"], 2: self._streams["err"]}
        return all(streams[fd].marked for fd in result.get("marked", []) if fd in streams)

    def _send(self, data: bytes, deadline: float, cancel: threading.Event | None) -> str:
        """Write the request, reading output meanwhile; "sent", or why the call ended."""
        assert self._proc is not None and self._proc.stdin is not None
        fd = self._proc.stdin.fileno()
        while data:
            try:
                data = data[os.write(fd, data) :]
            except BlockingIOError:
                reason = self._pump(min(deadline, time.monotonic() + POLL_S), lambda: False, cancel)
                if reason != "timeout" or time.monotonic() >= deadline:
                    return reason
            except BrokenPipeError:
                return self._pump(deadline, lambda: False, cancel)  # it died: collect its exit
        return "sent"

    def _pump(
        self,
        deadline: float,
        done: Callable[[], bool],
        cancel: threading.Event | None = None,
        watch: bool = True,
    ) -> str:
        """Read until ``done()``: "done", or why not: "timeout", "eof" (every pipe closed), and
        when ``watch``: "exit" (the supervisor reported the runner's end), "output" (over the
        cap), "cancelled"."""
        while True:
            if done():
                return "done"
            if watch and "exit" in self._events:
                return "exit"
            if watch and self._budget.over:
                return "output"
            if watch and cancel is not None and cancel.is_set():
                return "cancelled"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            if not self._selector.get_map():
                return "eof"
            for key, _ in self._selector.select(min(remaining, POLL_S)):
                self._read(key.fd, key.data)

    def _read(self, fd: int, name: str) -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            self._selector.unregister(fd)
            if name == "status":
                os.close(fd)
            return
        if name == "status":
            self._status(chunk)
        else:
            self._streams[name].feed(chunk, self._budget)

    def _status(self, chunk: bytes) -> None:
        *lines, self._status_buffer = (self._status_buffer + chunk).split(b"\n")
        self._status_buffer = self._status_buffer[-STATUS_LINE_MAX:]
        for line in lines:
            try:
                event = json.loads(line)
                self._events[str(event["event"])] = event
            except (ValueError, KeyError, TypeError):
                continue  # the code wrote on the status pipe: not ours

    def _result(self, reason: str, wall_s: float, timeout_s: float) -> RunResult:
        limits = self.config.limits
        code, sig, kind, error = 0, None, ErrorKind.NONE, ""
        if reason == "done":
            outcome = self._events["result"]
            code = int(outcome.get("exit_code") or 0)
            exception = outcome.get("exception")
            if exception == "MemoryError":
                kind, error = ErrorKind.MEMORY, f"out of memory (limit {limits.memory_mb} MiB)"
            elif exception:
                kind, error = ErrorKind.EXCEPTION, f"{exception}: {outcome.get('message', '')}".rstrip(": ")
            elif code:
                kind, error = ErrorKind.EXIT, f"the code exited with status {code}"
        elif reason == "exit":
            code, sig, kind, error = self._death(self._events["exit"])
        else:
            sig, code = signal.SIGKILL, -signal.SIGKILL
            kind, error = {
                "timeout": (ErrorKind.TIMEOUT, f"the code ran longer than {timeout_s:g}s and was stopped"),
                "output": (
                    ErrorKind.OUTPUT_LIMIT,
                    f"the code wrote more than {limits.output_bytes} bytes of output and was stopped",
                ),
                "cancelled": (ErrorKind.CANCELLED, "the call was cancelled and the code stopped"),
                "eof": (ErrorKind.SANDBOX, "the sandbox supervisor vanished"),
            }[reason]
        out, err = self._streams["out"].text(self._budget), self._streams["err"].text(self._budget)
        return RunResult(
            stdout=out,
            stderr=err,
            kind=kind,
            error=f"{kind}: {error}" if kind else "",
            exit_code=code,
            truncated=self._budget.over,
            wall_s=wall_s,
            signal=int(sig) if sig else None,
            alive=self.alive,
        )

    def _death(self, report: dict) -> tuple[int, int | None, ErrorKind, str]:
        """(exit code, signal, kind, message) of a runner that ended during a call."""
        wait_status = int(report["status"])
        if os.WIFSIGNALED(wait_status):
            sig = os.WTERMSIG(wait_status)
            at_hard_limit = float(report.get("cpu_s", 0)) >= self._hard_cpu - 0.05
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and at_hard_limit):
                cpu = self.config.limits.cpu_s
                return -sig, sig, ErrorKind.CPU_TIME, f"the code used more than {cpu:g}s of CPU"
            return -sig, sig, ErrorKind.CRASH, f"the process was killed by signal {signal.Signals(sig).name}"
        code = os.WEXITSTATUS(wait_status)
        return code, None, ErrorKind.EXIT, f"the process exited with status {code} before finishing the call"

    def close(self) -> None:
        """Kill every process of the sandbox, wait for the report, remove the working directory."""
        if self._closed:
            return
        self._closed = True
        if self._lifeline >= 0:
            with contextlib.suppress(OSError):  # OSError: the supervisor is gone already
                os.write(self._lifeline, b"k")
            os.close(self._lifeline)
            self._lifeline = -1
        if self._proc is not None:  # read what is left (kept within the budget) until every pipe closes
            self._pump(time.monotonic() + CLOSE_TIMEOUT_S, lambda: False, watch=False)
            self._reap()
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fd)
            if key.data == "status":
                os.close(key.fd)
        self._selector.close()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        if self._uid is not None and self._uids is not None:
            started = self._proc is not None
            self._uids.release(
                self._uid, clean=not started or bool(self._events.get("exit", {}).get("clean"))
            )

    def _reap(self) -> None:
        assert self._proc is not None
        for pipe in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        try:
            self._proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("sandbox supervisor %d did not exit; killing it", self._proc.pid)
            self._proc.kill()
            self._proc.wait(timeout=CLOSE_TIMEOUT_S)


class Sandboxes:
    """Makes sandbox processes with one configuration; a uid each when the service is root."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.uids = UidPool(config.uid_base, config.uid_count) if os.geteuid() == 0 else None

    def probe(self, timeout_s: float | None = None) -> list[str]:
        """The layers a sandbox gets here (see ``probe``)."""
        return probe(self.config, self.uids, timeout_s)

    def start(self, session: bool = False, timeout_s: float | None = None) -> SandboxProcess:
        """A started sandbox (see ``SandboxProcess.start``); the caller closes it. Refused at once
        (SandboxIsolationError) where the probe found that the isolation cannot be had."""
        self.probe(timeout_s)
        sandbox = SandboxProcess(self.config, self.uids)
        sandbox.start(session, timeout_s)
        return sandbox

    def run(
        self, code: str, timeout_s: float | None = None, cancel: threading.Event | None = None
    ) -> RunResult:
        """Run ``code`` in a fresh sandbox that is gone when this returns."""
        sandbox = self.start()
        try:
            return sandbox.run(code, self.config.limits.timeout_s if timeout_s is None else timeout_s, cancel)
        finally:
            sandbox.close()


# --- the isolation probe: one sandbox started and closed, its verdict kept per interpreter and mode --

_probes: dict[tuple[str, bool, Isolation, int], list[str] | SandboxIsolationError] = {}
_probe_lock = threading.Lock()


def isolation_refusal(missing: str) -> str:
    """The one error every call gets where the sandbox cannot isolate code."""
    return (
        f"the python sandbox cannot isolate code here ({missing}), so it runs none: {ISOLATION_NEEDS}; "
        f"to run trusted code without that isolation set {ISOLATION_SETTING}={Isolation.UNSAFE}"
    )


def probe(config: SandboxConfig, uids: UidPool | None, timeout_s: float | None = None) -> list[str]:
    """The layers a sandbox of ``config`` gets, from one sandbox started and closed the first
    time; raises SandboxIsolationError (kept: later calls get it without a start) when the mode's
    layers cannot be applied, SandboxError (not kept) when the probe itself failed."""
    key = (config.python, config.site_packages, config.isolation, os.geteuid())
    with _probe_lock:  # one probe at a time; the others wait for its verdict
        verdict = _probes.get(key)
        if verdict is None:
            sandbox = SandboxProcess(config, uids)
            try:
                sandbox.start(timeout_s=timeout_s)
                verdict = sandbox.layers
            except SandboxIsolationError as err:
                verdict = err
            finally:
                sandbox.close()
            _probes[key] = verdict
    if isinstance(verdict, SandboxIsolationError):
        raise SandboxIsolationError(str(verdict))
    return list(verdict)


def check_isolation(config: SandboxConfig) -> bool:
    """Probe at a service's start and log the verdict: an error when calls will be refused, a
    warning in the unsafe mode; True when code can run."""
    try:
        layers = Sandboxes(config).probe()
    except SandboxIsolationError as err:
        log.error("python tool and code verifier calls will fail: %s", err)
        return False
    except SandboxError as err:
        log.warning("could not check the python sandbox's isolation at start (tried again per call): %s", err)
        return True
    if config.isolation is Isolation.UNSAFE:
        log.warning(
            "%s=%s: the python sandbox runs code with only %s; trusted code only",
            ISOLATION_SETTING,
            Isolation.UNSAFE,
            ", ".join(layers),
        )
    else:
        log.info("python sandbox isolation: %s, rlimits", ", ".join(layers))
    return True
