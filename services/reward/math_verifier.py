"""Math answers checked with the ``math-verify`` package, in worker processes.

math-verify parses LaTeX and plain expressions into sympy and compares them: ``1/2``,
``0.5`` and ``\\frac{1}{2}`` are one answer, and the answer of a long response is found in
its ``\\boxed{}`` (or its last expression). Two things keep it out of the reward service's
own threads. Its timeouts are SIGALRM alarms, which Python only allows in a process's main
thread, while verifiers run on a thread pool; and some inputs take unbounded time
(``\\boxed{9^{9^{9^9}}}`` is a power tower sympy tries to evaluate). So each check runs in a
worker process that reads requests on stdin in its main thread, where an alarm of our own
bounds parse plus compare; a worker past its deadline reports it and exits. The parent has
a backstop for code an alarm cannot interrupt (a long C call): a worker that has not
answered a grace period after the deadline is killed. Either way a replacement starts on
the next call, and the check's caller gets ``TimeoutError``: an error, not a zero.

This module imports only the standard library at the top, so a worker starts fast and the
service does not load sympy unless a math answer is scored.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
"""The directory that holds ``services``: on a worker's import path."""
WORKER_COMMAND = "from services.reward.math_verifier import worker_main; worker_main()"
KILL_GRACE_S = 2.0
"""How long past its deadline a worker may take to answer before it is killed."""
REPLY_MAX_BYTES = 1 << 20
"""Longest reply line read from a worker (answers are echoed, so bounded by the request)."""

MathResult = tuple[float, dict[str, float], dict[str, str]]
"""(reward, components, info), as ``verifiers.VerifierResult``."""


class MathWorkerError(RuntimeError):
    """A worker could not start, or died, or broke the protocol: the check could not be made."""


class _Worker:
    """One worker process and the unread part of its stdout."""

    def __init__(self, start_timeout_s: float) -> None:
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER_COMMAND],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
        )
        self._buffer = b""
        try:
            ready = self.read(time.monotonic() + start_timeout_s)
        except TimeoutError:
            ready = f"no ready line within {start_timeout_s:g}s"
        except BaseException:
            self.kill()
            raise
        if ready != {"ready": True}:
            self.kill()
            raise MathWorkerError(f"the math-verify worker did not start: {ready!r:.200}")

    def ask(self, request: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Send one request and read its reply; TimeoutError past ``deadline`` (monotonic)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as err:
            raise MathWorkerError(f"the math-verify worker is gone: {err}") from None
        return self.read(deadline)

    def read(self, deadline: float) -> dict[str, Any]:
        """The next JSON line the worker writes, waited for until ``deadline``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                if not selector.select(left):
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise MathWorkerError(f"the math-verify worker exited with status {self._exit_status()}")
                self._buffer += chunk
                if len(self._buffer) > REPLY_MAX_BYTES:
                    raise MathWorkerError("the math-verify worker wrote an overlong reply")
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def _exit_status(self) -> int | str:
        """The worker's exit status; it closed its output, so it is exiting (waited for briefly)."""
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            return "unknown (it closed its output but did not exit; killed)"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


class MathVerifier:
    """The ``math`` verifier: reward 1.0 iff math-verify finds the response's final answer
    equal to the reference answer.

    Components: ``correct``, and ``parsed`` (an answer was found in the response at all).
    Info: the ``parsed`` answer and the ``gold`` one as math-verify read them. A reference
    answer it cannot read raises (the item gets an error), as does a check past
    ``timeout_s``. At most ``workers`` checks run at once, each in a worker process that is
    started on first use and kept.
    """

    def __init__(self, workers: int = 2, timeout_s: float = 5.0, start_timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._slots = threading.BoundedSemaphore(workers)
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)

    def __call__(self, response_text: str, answer: str, metadata: Mapping[str, str]) -> MathResult:
        reply = self.check(response_text, answer)
        if "error" in reply:
            raise ValueError(reply["error"])
        correct = float(reply["correct"])
        parsed = reply["parsed"]
        components = {"correct": correct, "parsed": float(bool(parsed))}
        return correct, components, {"parsed": parsed, "gold": reply["gold"]}

    def check(self, response_text: str, answer: str) -> dict[str, Any]:
        """The worker's reply for one comparison; TimeoutError past the timeout (plus the wait
        for a free worker, and a new worker's start)."""
        waited = time.monotonic()
        if not self._slots.acquire(timeout=self.timeout_s + KILL_GRACE_S + self.start_timeout_s):
            raise TimeoutError(f"no math-verify worker was free within {time.monotonic() - waited:.3g}s")
        try:
            worker = self._checkout()
            request = {"answer": answer, "response": response_text, "timeout_s": self.timeout_s}
            try:
                reply = worker.ask(request, time.monotonic() + self.timeout_s + KILL_GRACE_S)
            except TimeoutError:
                self._discard(worker)
                raise TimeoutError(f"math-verify did not finish within {self.timeout_s:g}s") from None
            except BaseException:
                self._discard(worker)
                raise
            if reply.get("timeout"):  # the worker exits after a timeout: sympy's state is suspect
                self._discard(worker)
                raise TimeoutError(f"math-verify did not finish within {self.timeout_s:g}s")
            self._checkin(worker)
            return reply
        finally:
            self._slots.release()

    def _checkout(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise MathWorkerError("the math verifier is closed")
            while self._idle:
                worker = self._idle.pop()
                if worker.alive:
                    return worker
                self._live.discard(worker)
        worker = _Worker(self.start_timeout_s)  # outside the lock: a start takes a second or two
        with self._lock:
            self._live.add(worker)
        return worker

    def _checkin(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        self._discard(worker)

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._live.discard(worker)
        worker.kill()

    def close(self) -> None:
        """Kill every worker; later checks fail."""
        with self._lock:
            self._closed = True
            workers, self._idle = list(self._live), []
            self._live.clear()
        for worker in workers:
            worker.kill()


# --- the worker process ---------------------------------------------------------------------------


class _Deadline(BaseException):
    """Raised by the alarm; a BaseException, so math-verify's ``except Exception`` lets it through."""


def _on_alarm(signum: int, frame: object) -> None:
    raise _Deadline


def compare(answer: str, response_text: str) -> dict[str, Any]:
    """Parse both with math-verify and compare them (no timeout: the caller sets one)."""
    from math_verify import parse, verify

    # A bare reference answer ("1/2", "x+1") is read as LaTeX math, as if written $...$.
    delimited = "$" in answer or "\\boxed" in answer
    gold = parse(answer if delimited else f"${answer}$", parsing_timeout=None)  # type: ignore[arg-type]
    if not gold:
        raise ValueError(f"math-verify cannot read the reference answer {answer!r:.200}")
    predicted = parse(response_text, parsing_timeout=None)  # type: ignore[arg-type]
    correct = bool(predicted) and verify(gold, predicted, timeout_seconds=None)
    return {"correct": correct, "parsed": _shown(predicted), "gold": _shown(gold)}


def _shown(parsed: list[Any]) -> str:
    """The extracted text (math-verify's last item) rather than str(sympy), which can be slow."""
    if not parsed:
        return ""
    text = parsed[-1] if isinstance(parsed[-1], str) else str(parsed[0])
    return text[:500]


def worker_main() -> None:
    """A worker: answer JSON lines from stdin on stdout, in this (main) thread, until EOF."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr  # whatever sympy or math-verify print must not corrupt the replies
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that we disabled its timeouts
    signal.signal(signal.SIGALRM, _on_alarm)
    compare("1/2", "\\boxed{0.5}")  # imports and warms sympy before saying ready
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        signal.setitimer(signal.ITIMER_REAL, float(request["timeout_s"]))
        try:
            reply = compare(request["answer"], request["response"])
        except _Deadline:
            replies.write(json.dumps({"timeout": True}) + "\n")
            return
        except Exception as err:
            message = str(err) if type(err) is ValueError else f"{type(err).__name__}: {err}"
            reply = {"error": message[:1000]}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        replies.write(json.dumps(reply) + "\n")
