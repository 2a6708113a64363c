"""The python sandbox's behaviour: results, error kinds, limits, sessions, concurrency, cleanup.

Hostile code (fork bombs, escapes, secrets, sockets, crashes) is in test_sandbox_security.py.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.reward.sandbox import (
    ErrorKind,
    Isolation,
    OutputBudget,
    OutputStream,
    RunResult,
    SandboxConfig,
    SandboxError,
    Sandboxes,
    SandboxLimits,
    process_uids,
)

pytestmark = pytest.mark.timeout(60)

LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=5.0, memory_mb=256, output_bytes=4096, processes=16)
ISOLATION = Isolation.REQUIRED if os.geteuid() == 0 else Isolation.UNSAFE
"""Every layer as root (CI); without root the service would refuse, so these tests, whose code is
trusted, opt into the unsafe mode (test_sandbox_isolation.py checks the refusal itself)."""


def sandbox_uids_in_use(sandboxes: Sandboxes) -> set[int]:
    """Uids these sandboxes ran as that still have a process (none, once every sandbox is closed)."""
    if sandboxes.uids is None:
        return set()
    used = sandboxes.uids.used  # not the whole range: other services on this host draw from it too
    return {uid for uid in process_uids(min(used, default=0), max(used, default=-1) + 1) if uid in used}


@pytest.fixture
def sandbox_dir(tmp_path: Path) -> Iterator[Path]:
    """Where the sandboxes' working directories go; empty again after every test."""
    yield tmp_path
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def sandboxes(sandbox_dir: Path) -> Iterator[Sandboxes]:
    sandboxes = Sandboxes(SandboxConfig(limits=LIMITS, root_dir=str(sandbox_dir), isolation=ISOLATION))
    yield sandboxes
    assert sandbox_uids_in_use(sandboxes) == set()


def ok(result: RunResult) -> RunResult:
    assert result.ok, (result.error, result.stderr)
    return result


def test_stdout_stderr_and_exit_status(sandboxes: Sandboxes) -> None:
    result = ok(sandboxes.run("import sys\nprint('out', 6 * 7)\nprint('err', file=sys.stderr)"))
    assert (result.stdout, result.stderr, result.exit_code, result.error) == ("out 42\n", "err\n", 0, "")
    assert not result.truncated and not result.timed_out and 0 < result.wall_s < LIMITS.timeout_s


def test_an_exception_is_reported_with_its_traceback(sandboxes: Sandboxes) -> None:
    result = sandboxes.run("x = 1\n\ndef f():\n    return x / 0\n\nf()")
    assert (result.kind, result.error, result.exit_code) == (
        ErrorKind.EXCEPTION,
        "exception: ZeroDivisionError: division by zero",
        1,
    )
    assert 'File "<code>", line 4, in f\n    return x / 0' in result.stderr
    assert "sandbox_child" not in result.stderr  # the runner's own frames are left out


def test_syntax_errors_and_exit_codes(sandboxes: Sandboxes) -> None:
    syntax = sandboxes.run("def (")
    assert syntax.kind == ErrorKind.EXCEPTION and syntax.error.startswith("exception: SyntaxError")
    assert sandboxes.run("import sys; sys.exit(0)").ok
    exited = sandboxes.run("import sys; print('bye'); sys.exit(3)")
    assert (exited.kind, exited.exit_code, exited.stdout) == (ErrorKind.EXIT, 3, "bye\n")
    died = sandboxes.run("import os; os._exit(4)")
    assert (died.kind, died.exit_code, died.alive) == (ErrorKind.EXIT, 4, False)
    assert "exited with status 4 before finishing the call" in died.error


def test_the_working_directory_is_private_writable_and_removed(
    sandboxes: Sandboxes, sandbox_dir: Path
) -> None:
    result = ok(
        sandboxes.run(
            "import os, tempfile\n"
            "open('notes.txt', 'w').write('hello')\n"
            "print(os.getcwd(), os.environ['HOME'] == os.getcwd(), tempfile.gettempdir() == os.getcwd())\n"
            "print(sorted(os.listdir('.')), open('notes.txt').read())"
        )
    )
    cwd, home, tmp = result.stdout.splitlines()[0].split()
    assert Path(cwd).parent == sandbox_dir and home == tmp == "True"
    assert result.stdout.splitlines()[1] == "['notes.txt'] hello"
    assert not Path(cwd).exists()


def test_the_environment_is_scrubbed(sandboxes: Sandboxes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERST_SECRET_TOKEN", "do-not-leak")
    result = ok(sandboxes.run("import os\nprint(sorted(os.environ))"))
    assert result.stdout == "['HOME', 'LANG', 'MALLOC_ARENA_MAX', 'PATH', 'TMPDIR']\n"


def test_timeout_keeps_what_was_printed(sandboxes: Sandboxes) -> None:
    started = time.monotonic()
    result = sandboxes.run("print('started')\nwhile True:\n    pass", timeout_s=1.0)
    assert time.monotonic() - started < 3.0
    assert (result.kind, result.timed_out, result.signal, result.exit_code) == (
        ErrorKind.TIMEOUT,
        True,
        signal.SIGKILL,
        -signal.SIGKILL,
    )
    assert result.error == "timeout: the code ran longer than 1s and was stopped"
    assert result.stdout == "started\n"


def test_cpu_time_limit(sandbox_dir: Path) -> None:
    sandboxes = Sandboxes(
        SandboxConfig(limits=SandboxLimits(cpu_s=1.0), root_dir=str(sandbox_dir), isolation=ISOLATION)
    )
    started = time.monotonic()
    result = sandboxes.run("while True:\n    pass", timeout_s=10.0)
    assert time.monotonic() - started < 5.0
    assert result.kind == ErrorKind.CPU_TIME and result.error == "cpu_time: the code used more than 1s of CPU"
    assert result.signal in (signal.SIGXCPU, signal.SIGKILL)


def test_output_past_the_cap_is_truncated_and_stops_the_code(sandboxes: Sandboxes) -> None:
    result = sandboxes.run(
        "import sys, time\nprint('a' * 3000)\nprint('b' * 3000, file=sys.stderr)\ntime.sleep(30)"
    )
    assert result.kind == ErrorKind.OUTPUT_LIMIT and result.truncated and result.wall_s < 3.0
    assert len(result.stdout.encode()) + len(result.stderr.encode()) == LIMITS.output_bytes
    assert result.stdout == "a" * 3000 + "\n" and result.stderr == "b" * (LIMITS.output_bytes - 3001)


def test_output_just_under_the_cap_is_whole(sandboxes: Sandboxes) -> None:
    result = ok(sandboxes.run(f"print('x' * {LIMITS.output_bytes - 1}, end='')\nprint()"))
    assert result.stdout == "x" * (LIMITS.output_bytes - 1) + "\n" and not result.truncated


def test_utf8_output_split_across_reads(sandboxes: Sandboxes) -> None:
    result = ok(sandboxes.run("print('é€😀' * 400)"))
    assert result.stdout == "é€😀" * 400 + "\n"


def test_the_end_marker_is_found_wherever_reads_split_it() -> None:
    marker = b"\0\x1eend\0"
    data = b"ab\0\x1een" + marker + b"late"  # a false start of the marker, then the marker
    for first in range(len(data) + 1):
        for second in range(first, len(data) + 1):
            stream, budget = OutputStream(marker), OutputBudget(100)
            for chunk in (data[:first], data[first:second], data[second:]):
                stream.feed(chunk, budget)
            assert stream.marked and stream.text(budget) == "ab\0\x1een", (first, second)


def test_a_session_keeps_its_globals(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.start(session=True)
    try:
        ok(sandbox.run("import math\ncounter = 41\ndef bump():\n    global counter\n    counter += 1", 5.0))
        assert ok(sandbox.run("bump()\nprint(counter, math.pi > 3)", 5.0)).stdout == "42 True\n"
        failed = sandbox.run("print(counter)\nraise KeyError('k')", 5.0)
        assert failed.kind == ErrorKind.EXCEPTION and failed.alive and failed.stdout == "42\n"
        assert 'File "<code 3>", line 2' in failed.stderr
        assert ok(sandbox.run("bump(); print(counter)", 5.0)).stdout == "43\n"
        assert ok(sandbox.run("open('kept.txt', 'w').write('x')", 5.0)).alive
        assert ok(sandbox.run("print(open('kept.txt').read())", 5.0)).stdout == "x\n"
    finally:
        sandbox.close()
    assert not sandbox.alive


def test_a_killed_session_reports_it_and_refuses_more_calls(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.start(session=True)
    try:
        ok(sandbox.run("x = 1", 5.0))
        result = sandbox.run("import time; time.sleep(30)", 0.5)
        assert result.kind == ErrorKind.TIMEOUT and not result.alive and not sandbox.alive
        with pytest.raises(SandboxError, match="not running"):
            sandbox.run("print(x)", 5.0)
    finally:
        sandbox.close()


def test_output_of_background_work_does_not_end_a_session_call_early(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.start(session=True)
    try:
        code = "import threading, time\n"
        code += "threading.Thread(target=lambda: (time.sleep(0.3), print('late'))).start()"
        assert ok(sandbox.run(code, 5.0)).stdout == ""
        time.sleep(0.5)
        assert ok(sandbox.run("print('next')", 5.0)).stdout == "late\nnext\n"
    finally:
        sandbox.close()


def test_a_forked_child_does_not_answer_for_the_runner(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.start(session=True)
    try:
        code = "import os\npid = os.fork()\nif pid == 0:\n    print('child')\n"
        code += "else:\n    os.waitpid(pid, 0)\n    print('parent')"
        assert ok(sandbox.run(code, 5.0)).stdout == "child\nparent\n"
        assert ok(sandbox.run("print(pid != 0)", 5.0)).stdout == "True\n"
    finally:
        sandbox.close()


def test_concurrent_calls_run_in_parallel(sandboxes: Sandboxes) -> None:
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: sandboxes.run(f"import time; time.sleep(1); print({i})"), range(4)))
    assert time.monotonic() - started < 3.5  # one after the other: 4s and more
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]
    if sandboxes.uids is not None:
        uids = [ok(sandboxes.run("import os; print(os.getuid())")).stdout for _ in range(2)]
        assert uids[0] != uids[1]  # round robin: a uid is not reused right away


def test_a_cancelled_call_stops_the_code(sandboxes: Sandboxes) -> None:
    import threading

    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    started = time.monotonic()
    result = sandboxes.run("import time; time.sleep(30)", timeout_s=10.0, cancel=cancel)
    assert result.kind == ErrorKind.CANCELLED and time.monotonic() - started < 3.0


def test_a_missing_interpreter_is_a_sandbox_error(sandbox_dir: Path) -> None:
    broken = Sandboxes(SandboxConfig(python="/nonexistent/python", root_dir=str(sandbox_dir)))
    with pytest.raises((SandboxError, OSError)):
        broken.run("print(1)")


@pytest.mark.skipif(os.geteuid() != 0, reason="the namespaces and the uid need root")
def test_as_root_every_layer_applies(sandboxes: Sandboxes) -> None:
    sandbox = sandboxes.start()
    try:
        assert sandbox.layers == ["netns", "mountns", "hidepid", "uid", "seccomp"]
        uid = int(
            ok(sandbox.run("import os; print(os.getuid(), os.getgid(), os.getgroups())", 5.0)).stdout.split()[
                0
            ]
        )
        assert sandboxes.config.uid_base <= uid < sandboxes.config.uid_base + sandboxes.config.uid_count
    finally:
        sandbox.close()


def test_uids_another_service_runs_as_are_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sandbox services on one host draw from one uid range: a uid with a process is skipped."""
    from services.reward import sandbox as sandbox_module
    from services.reward.sandbox import SandboxError, UidPool

    foreign = {5000, 5001}
    monkeypatch.setattr(sandbox_module, "process_uids", lambda low, high: foreign & set(range(low, high)))
    pool = UidPool(5000, 4)
    assert {pool.acquire(), pool.acquire()} == {5002, 5003}
    with pytest.raises(SandboxError, match="in use"):
        pool.acquire()
    pool.release(5003, clean=True)
    assert pool.acquire() == 5003 and pool.used == {5002, 5003}
