"""Where the sandbox cannot isolate code it refuses to run it, with one clear error, unless the
unsafe mode is chosen; the seccomp filter that refuses sockets applies in every mode.

Two stand-ins for a reward container without the privileges the sandbox needs: an interpreter
wrapped in a seccomp filter that refuses unshare(2) (what Docker's default profile does without
CAP_SYS_ADMIN), and a service in a user namespace of its own, so not root.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.reward import sandbox_child
from services.reward.sandbox import (
    ISOLATION_SETTING,
    Isolation,
    SandboxConfig,
    SandboxError,
    Sandboxes,
    SandboxIsolationError,
    SandboxLimits,
    check_isolation,
)
from tests.unit.test_sandbox import sandbox_uids_in_use

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=5.0, memory_mb=256, output_bytes=4096, processes=16)
UNSHARE = {"x86_64": 272, "aarch64": 97}
"""unshare(2)'s number on the machines ``sandbox_child.SECCOMP_ARCHES`` knows."""
SOCKETS = """
import socket
for family in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX):
    try:
        socket.socket(family)
        print("allowed")
    except PermissionError:
        print("refused")
"""

WRAPPER = """#!{python}
# The interpreter as a container refusing unshare(2) would run it (EPERM, as Docker's default
# seccomp profile does without CAP_SYS_ADMIN).
import errno, os, sys
sys.path.insert(0, {child_dir!r})
import sandbox_child
arch, _ = sandbox_child.SECCOMP_ARCHES[os.uname().machine]
sandbox_child.prctl(sandbox_child.PR_SET_NO_NEW_PRIVS, 1)
sandbox_child.install_filter(sandbox_child.syscall_filter(arch, [{unshare}], errno.EPERM))
os.execv({python!r}, [{python!r}, *sys.argv[1:]])
"""


@pytest.fixture
def no_unshare_python(tmp_path: Path) -> str:
    """An interpreter that cannot unshare: no network nor mount namespace for its sandboxes."""
    machine = os.uname().machine
    if machine not in UNSHARE:
        pytest.skip(f"no unshare number for {machine}")
    wrapper = tmp_path / "python-without-unshare"
    child_dir = str(Path(sandbox_child.__file__).parent)
    wrapper.write_text(WRAPPER.format(python=sys.executable, child_dir=child_dir, unshare=UNSHARE[machine]))
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.fixture
def sandbox_dir(tmp_path: Path) -> Iterator[str]:
    path = tmp_path / "sandboxes"
    path.mkdir()
    yield str(path)
    assert list(path.iterdir()) == []


def test_the_socket_filter_refuses_sockets_only() -> None:
    """The BPF program on its own, in a forked process: sockets refused, pipes still made."""
    program = sandbox_child.socket_filter(os.uname().machine)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        try:
            sandbox_child.prctl(sandbox_child.PR_SET_NO_NEW_PRIVS, 1)
            sandbox_child.install_filter(program)
            libc = ctypes.CDLL(None, use_errno=True)
            refused = libc.socket(2, 1, 0) == -1 and ctypes.get_errno() == errno.EACCES
            os.pipe()
            os._exit(0 if refused else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with pytest.raises(OSError, match="no syscall numbers"):
        sandbox_child.socket_filter("sparc")


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid layer (kept in the unsafe mode) needs root")
def test_without_namespaces_every_call_is_refused_with_one_clear_error(
    no_unshare_python: str, sandbox_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = SandboxConfig(limits=LIMITS, python=no_unshare_python, root_dir=sandbox_dir)
    assert check_isolation(config) is False  # at the service's start: logged, once
    assert "python tool and code verifier calls will fail" in caplog.text
    sandboxes = Sandboxes(config)
    for _ in range(2):  # the second is refused from the probe's verdict, without a start
        with pytest.raises(SandboxIsolationError) as refused:
            sandboxes.run("print('never runs')")
        message = str(refused.value)
        assert "cannot isolate code here (netns: unshare(CLONE_NEWNET): Operation not permitted)" in message
        assert f"{ISOLATION_SETTING}=unsafe-no-isolation" in message and "CAP_SYS_ADMIN" in message
    assert isinstance(refused.value, SandboxError)  # what the tools and the code verifier report
    assert sandbox_uids_in_use(sandboxes) == set()


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid layer (kept in the unsafe mode) needs root")
def test_the_unsafe_mode_runs_code_without_namespaces_but_never_with_sockets(
    no_unshare_python: str, sandbox_dir: str
) -> None:
    config = SandboxConfig(
        limits=LIMITS, python=no_unshare_python, root_dir=sandbox_dir, isolation=Isolation.UNSAFE
    )
    sandboxes = Sandboxes(config)
    assert sandboxes.probe() == ["uid", "seccomp"]
    result = sandboxes.run("import os\nprint(os.getuid() != 0)")  # os: imported by the runner already
    assert result.ok and result.stdout == "True\n", result.error
    # Without the mount namespace the sandbox uid imports only what others may read (here the
    # interpreter may sit under a 0700 /root); the not-root test below checks sockets regardless.
    if sandbox_child.reachable(str(Path(socket.__file__).parent)) is None:
        result = sandboxes.run(SOCKETS)
        assert result.ok and result.stdout.split() == ["refused"] * 3, result.error
    assert sandbox_uids_in_use(sandboxes) == set()


NOT_ROOT = """
import ctypes, json, sys
if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:  # CLONE_NEWUSER, no uid map
    print(json.dumps({"skip": ctypes.get_errno()}))
    sys.exit(0)
from services.reward.sandbox import Isolation, SandboxConfig, SandboxIsolationError, Sandboxes
limits = dict(timeout_s=5.0, memory_mb=256)
report = {}
try:
    Sandboxes(SandboxConfig(root_dir=sys.argv[1])).run("print(1)")
    report["required"] = "ran"
except SandboxIsolationError as err:
    report["required"] = str(err)
unsafe = Sandboxes(SandboxConfig(root_dir=sys.argv[1], isolation=Isolation.UNSAFE))
report["layers"] = unsafe.probe()
result = unsafe.run(sys.argv[2])
report["unsafe"] = [result.ok, result.stdout.split(), result.error]
print(json.dumps(report))
"""


def test_a_service_that_is_not_root_refuses_unless_unsafe(
    sandbox_dir: str, python_env: dict[str, str]
) -> None:
    """The service in a user namespace without a uid map: not root, no capabilities after exec."""
    done = subprocess.run(
        [sys.executable, "-c", NOT_ROOT, sandbox_dir, SOCKETS],
        env=python_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    if "skip" in report:
        pytest.skip(f"no user namespace here (errno {report['skip']})")
    assert "cannot isolate code here (root: the service runs as uid" in report["required"]
    assert f"{ISOLATION_SETTING}=unsafe-no-isolation" in report["required"]
    assert report["layers"] == ["seccomp"]
    assert report["unsafe"] == [True, ["refused"] * 3, ""]
