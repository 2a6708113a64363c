"""The inside of one sandbox: a supervisor and the runner it forks to run the code.

Started by ``services/reward/sandbox.py`` as ``python -I -S sandbox_child.py CONFIG_JSON`` with a
scrubbed environment, so standard library only. The supervisor keeps the service's uid and is a
child subreaper, so orphans are reaped, not left as zombies that count against the sandbox uid's
process limit. When the runner dies, or the service's lifeline pipe is written or closed, it kills
and reaps every process of the sandbox, reports the runner's wait status and exits. The runner
isolates itself, runs each request's code in one namespace of globals (a session is one runner given
several requests) and writes one status line per request. Its layers, in order (the ready line names
those that applied; docs/reward.md says what each stops): ``netns``, ``mountns`` and ``hidepid``,
``uid`` (the supervisor is root, which makes the kill a ``kill(-1)`` as that uid, atomic against
forks), ``seccomp`` (no socket at all), and rlimits. With ``isolation`` "required" a layer that
cannot be applied is a setup error naming it (the service refuses to run code); with
"unsafe-no-isolation" the namespaces that cannot be made are left out, and ``uid`` (when root) and
``seccomp`` are still required.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import linecache
import math
import os
import re
import resource
import select
import shutil
import signal
import stat
import struct
import sys
import time
import traceback
from collections.abc import Callable

STATUS_PIPE, LIFELINE_PIPE = 3, 4
"""Where the supervisor puts the status pipe (to the service) and the lifeline (from it)."""
CONTROL_FD = 62
"""Where the runner keeps the request pipe, so the code's stdin can be /dev/null."""
STATUS_FD = 63
"""Where the runner keeps the status pipe."""
SETUP_FAILED = 70
"""The runner's exit status when it could not isolate itself (its status line says why)."""
REAP_DEADLINE_S = 5.0
"""How long the supervisor waits for killed processes to be reaped."""

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET = 0x00020000, 0x08000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = (
    1,
    4,
    22,
    36,
    38,
)
MOUNT_OPTION_FLAGS = {"nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME}
MOUNT_OPTION_FLAGS.update(nodiratime=MS_NODIRATIME, relatime=MS_RELATIME, strictatime=MS_STRICTATIME)

REQUIRED, UNSAFE = "required", "unsafe-no-isolation"
"""The config's ``isolation``: every layer, or the namespaces only where they can be made."""

# seccomp: a classic BPF program over struct seccomp_data {int nr; u32 arch; ...}.
SECCOMP_MODE_FILTER, SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 2, 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
X32_SYSCALL_BIT = 0x40000000
"""x86_64's x32 ABI: the same arch, syscall numbers above this bit; refused whole."""
SECCOMP_ARCHES = {  # machine: (AUDIT_ARCH_*, {syscall: number})
    "x86_64": (0xC000003E, {"socket": 41, "socketpair": 53, "io_uring_setup": 425, "pidfd_getfd": 438}),
    "aarch64": (0xC00000B7, {"socket": 198, "socketpair": 199, "io_uring_setup": 425, "pidfd_getfd": 438}),
}
"""Refused to the code: sockets of every family, and the two other ways to get one (an io_uring
can make sockets; pidfd_getfd copies another process's). Syscalls of a foreign ABI (i386 through
int 0x80, x32) are refused whole, so the numbers cannot be dodged."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, value, 0, 0, 0), f"prctl({option})")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else os.fsencode(s)

    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def write_status(fd: int, message: dict[str, object]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


# --- the supervisor --------------------------------------------------------------------------


def processes() -> dict[int, tuple[int, int]]:
    """{pid: (real uid, threads)} of every process, zombies included."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as status:
                fields = dict(line.split(b":", 1) for line in status if b":" in line)
        except OSError:
            continue  # it exited while we looked
        found[int(name)] = (int(fields[b"Uid"].split()[0]), int(fields.get(b"Threads", b"1")))
    return found


def uid_tasks(uid: int) -> dict[int, int]:
    """{pid: threads} of the processes whose real uid is ``uid``."""
    return {pid: threads for pid, (owner, threads) in processes().items() if owner == uid}


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root``, from a snapshot of /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as stat_file:
                    fields = stat_file.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_as(uid: int, gid: int) -> None:
    """``kill(-1, SIGKILL)`` as ``uid``: every process of the uid, atomically with respect to fork."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        except BaseException:
            os._exit(1)
        os._exit(0)
    os.waitpid(pid, 0)


class Reaper:
    """Reaps our children (orphans come to us as subreaper), remembering the runner's status."""

    def __init__(self, runner: int) -> None:
        self.runner = runner
        self.runner_status: int | None = None
        self.runner_cpu_s = 0.0

    def reap(self, until: float) -> None:
        """Reap until no child is left or ``until`` (monotonic) passes."""
        while True:
            try:
                pid, wait_status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == self.runner:
                self.runner_status = wait_status
                self.runner_cpu_s = usage.ru_utime + usage.ru_stime
            elif pid == 0:
                if time.monotonic() >= until:
                    return
                time.sleep(0.005)


def kill_sandbox(config: dict, reaper: Reaper) -> bool:
    """Kill and reap every process of the sandbox; True when none is left."""
    uid = config.get("uid")
    deadline = time.monotonic() + REAP_DEADLINE_S
    while True:
        if uid is not None:
            kill_as(uid, config["gid"])
        else:  # without a uid of its own: the runner's group, then any descendant that left it
            for pid in descendants(os.getpid()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        reaper.reap(min(deadline, time.monotonic() + 0.5))
        left = uid_tasks(uid) if uid is not None else descendants(os.getpid())
        if not left or time.monotonic() >= deadline:
            return not left


def take_fds(config: dict) -> None:
    """Put the status pipe on fd 3 and the lifeline on fd 4, whatever numbers they came with."""
    high = [fcntl.fcntl(config[key], fcntl.F_DUPFD_CLOEXEC, 100) for key in ("status_fd", "lifeline_fd")]
    for key in ("status_fd", "lifeline_fd"):
        os.close(config[key])
    for fd, target in zip(high, (STATUS_PIPE, LIFELINE_PIPE), strict=True):
        os.dup2(fd, target, inheritable=False)
        os.close(fd)


def supervise(config: dict, runner: int) -> None:
    """Wait for the runner's end or the service's word, clean up, report, exit."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the pipes to the service must close when the sandbox's processes die
        os.dup2(devnull, fd)
    os.close(devnull)
    reaper = Reaper(runner)
    pidfd = os.pidfd_open(runner)
    while reaper.runner_status is None:
        ready, _, _ = select.select([LIFELINE_PIPE, pidfd], [], [])
        if pidfd in ready:
            reaper.reap(time.monotonic())
        elif LIFELINE_PIPE in ready:  # any byte, or EOF when the service died: stop everything
            os.read(LIFELINE_PIPE, 64)
            break
    clean = kill_sandbox(config, reaper)
    if clean:  # the service does it too, unless it died first
        shutil.rmtree(config["workdir"], ignore_errors=True)
    # None only if the runner outlived its SIGKILL for REAP_DEADLINE_S (stuck in the kernel)
    status = reaper.runner_status if reaper.runner_status is not None else signal.SIGKILL
    report = {"event": "exit", "status": status, "cpu_s": reaper.runner_cpu_s, "clean": clean}
    write_status(STATUS_PIPE, report)
    os._exit(0 if clean else 1)


# --- the runner's isolation ------------------------------------------------------------------


def reachable(path: str) -> str | None:
    """The first directory on ``path`` that others may not traverse, or None."""
    current = "/"
    for part in [p for p in path.split("/") if p]:
        if not os.stat(current).st_mode & stat.S_IXOTH:
            return current
        current = os.path.join(current, part)
    return None if os.stat(current).st_mode & stat.S_IXOTH else current


def expose(paths: list[str]) -> None:
    """Make ``paths`` reachable by others: cover each blocking directory with a tmpfs that shows
    only the entries on the way to them (bound from the original through an O_PATH fd)."""
    for _ in range(8):  # one level of blocking directories per round
        wanted: dict[str, set[str]] = {}
        for path in paths:
            blocker = reachable(path)
            if blocker is not None and blocker != path:
                rest = os.path.relpath(path, blocker).split("/")[0]
                wanted.setdefault(blocker, set()).add(rest)
        if not wanted:
            return
        for blocker, names in wanted.items():
            fds = {name: os.open(os.path.join(blocker, name), os.O_PATH) for name in names}
            mount("tmpfs", blocker, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
            for name, fd in fds.items():
                target = os.path.join(blocker, name)
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    os.mkdir(target)
                else:
                    os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
                mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
                os.close(fd)
    raise OSError(errno.ELOOP, f"could not expose {paths}")


def mountinfo() -> list[tuple[str, str]]:
    """(mount point, per-mount options) of every mount, parents first."""
    unescape = re.compile(r"\\([0-7]{3})")
    mounts = []
    with open("/proc/self/mountinfo") as info:
        for line in info:
            fields = line.split()
            point = unescape.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
            mounts.append((point, fields[5]))
    return mounts


def read_only_except(workdir: str, config: dict) -> None:
    """Remount every mount read-only and nosuid, except ``workdir``: a tmpfs of the disk limit's
    size, owned by the sandbox uid (files in memory, gone with the sandbox)."""
    size, uid = config["limits"]["file_bytes"], config["uid"]
    options = f"size={max(size, 4096)},nr_inodes=16384,mode=0700,uid={uid},gid={config['gid']}"
    mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, options)
    for point, options in mountinfo():
        if point == workdir:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        for option in options.split(","):
            flags |= MOUNT_OPTION_FLAGS.get(option, 0)
        try:
            mount(None, point, None, flags)
        except OSError as err:
            if err.errno != errno.ENOENT or point == "/":  # ENOENT: hidden under a cover
                raise


class IsolationError(Exception):
    """A layer the config requires could not be applied; ``layer`` names it."""

    def __init__(self, layer: str, reason: str) -> None:
        super().__init__(f"{layer}: {reason}")
        self.layer = layer


def isolate_filesystem(workdir: str, config: dict) -> None:
    """The mount namespace (see the module docstring)."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWIPC), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here may reach the host's mounts
    expose([p for p in [*sys.path, workdir] if os.path.isdir(p)])
    read_only_except(workdir, config)


def hide_processes() -> None:
    """A /proc of our own, ``hidepid=2``: other uids' processes are invisible."""
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")


def isolate_network() -> None:
    _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")


def socket_filter(machine: str, errno_value: int = errno.EACCES) -> bytes:
    """The BPF program that refuses ``SECCOMP_ARCHES[machine]``'s syscalls with ``errno_value``."""
    if machine not in SECCOMP_ARCHES:
        raise OSError(errno.ENOSYS, f"no syscall numbers for machine {machine!r}")
    arch, numbers = SECCOMP_ARCHES[machine]
    return syscall_filter(arch, sorted(numbers.values()), errno_value)


def syscall_filter(arch: int, refused: list[int], errno_value: int) -> bytes:
    """A BPF program: ``refused`` syscalls, any of a foreign ABI, fail with ``errno_value``."""
    checks = [(BPF_JGE_K, X32_SYSCALL_BIT)] + [(BPF_JEQ_K, nr) for nr in refused]
    refuse = (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno_value)
    program = [
        (BPF_LD_W_ABS, 0, 0, 4),  # the arch
        (BPF_JEQ_K, 1, 0, arch),  # ours: skip the refusal
        refuse,
        (BPF_LD_W_ABS, 0, 0, 0),  # the syscall number
    ]
    for index, (code, value) in enumerate(checks):  # a match jumps to the refusal after the allow
        program.append((code, len(checks) - index, 0, value))
    program += [(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW), refuse]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


def install_filter(program: bytes) -> None:
    """Install a seccomp filter (needs no_new_privs or CAP_SYS_ADMIN); this thread and its
    descendants keep it for good."""

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    code = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.addressof(code))
    _check(
        _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0),
        "prctl(PR_SET_SECCOMP)",
    )


def block_sockets() -> None:
    install_filter(socket_filter(os.uname().machine))


def apply_layer(name: str, step: Callable[[], None], required: bool, layers: list[str]) -> bool:
    """Run ``step``; its ``name`` joins ``layers``, or, when it fails, an IsolationError if the
    layer is ``required``, else False (the sandbox goes without it)."""
    try:
        step()
    except OSError as err:
        if required:
            raise IsolationError(name, str(err.strerror or err)) from None  # without "[Errno n]"
        return False
    layers.append(name)
    return True


def set_limits(config: dict, nproc: int) -> None:
    limits = config["limits"]
    for limit, value in [
        (resource.RLIMIT_CPU, (math.ceil(limits["cpu_s"]), limits["cpu_hard_s"])),
        (resource.RLIMIT_NPROC, (nproc, nproc)),
        (resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2),
        (resource.RLIMIT_NOFILE, (limits["open_files"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
    ]:
        resource.setrlimit(limit, value)


def drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getegid() != gid:
        raise OSError(errno.EPERM, "could not drop privileges")
    prctl(PR_SET_DUMPABLE, 1)  # /proc/self belongs to the sandbox uid again (dropped by setuid)


def isolate(config: dict) -> list[str]:
    """Everything of the module docstring's list, as root where it needs to be, then the drop."""
    workdir, uid = config["workdir"], config.get("uid")
    required = config["isolation"] != UNSAFE
    if required and uid is None:
        raise IsolationError("root", f"the service runs as uid {os.geteuid()}, not as root")
    os.setpgid(0, 0)
    layers: list[str] = []
    apply_layer("netns", isolate_network, required, layers)
    if uid is not None and apply_layer(
        "mountns", lambda: isolate_filesystem(workdir, config), required, layers
    ):
        apply_layer("hidepid", hide_processes, required, layers)
    os.chdir(workdir)
    if uid is not None:
        set_limits(config, config["limits"]["processes"])
        apply_layer("uid", lambda: drop_privileges(uid, config["gid"]), True, layers)  # never code as root
    else:  # the uid's other processes count too: allow this many more than it has now
        set_limits(config, sum(uid_tasks(os.getuid()).values()) + config["limits"]["processes"])
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    apply_layer("seccomp", block_sockets, True, layers)  # everywhere: no socket at all for the code
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    if os.getppid() != config["supervisor"]:
        os._exit(SETUP_FAILED)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large file is an OSError, not a death
    return layers


# --- the runner ------------------------------------------------------------------------------


def read_request(fd: int) -> dict | None:
    """One length-prefixed JSON request; None at EOF (the service closed the session)."""
    header = read_exactly(fd, 4)
    if header is None:
        return None
    body = read_exactly(fd, struct.unpack(">I", header)[0])
    return None if body is None else json.loads(body)


def read_exactly(fd: int, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def set_call_cpu(cpu_s: float) -> None:
    """Allow this call ``cpu_s`` more CPU seconds (RLIMIT_CPU counts the process's lifetime)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    used = usage.ru_utime + usage.ru_stime
    soft = max(math.floor(used) + 1, round(used + cpu_s))  # whole seconds; must exceed what is used
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard < 0 else min(soft, hard), hard))


def show_exception(err: BaseException) -> None:
    """The traceback on stderr, without the runner's own frame."""
    try:
        traceback.print_exception(type(err), err, err.__traceback__.tb_next if err.__traceback__ else None)
    except MemoryError:
        os.write(2, f"{type(err).__name__}\n".encode())


def run_code(source: str, filename: str, namespace: dict, main_pid: int) -> dict[str, object]:
    """Run one request's code; the outcome for its status line."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    outcome: dict[str, object] = {"exit_code": 0, "exception": None, "message": ""}
    try:
        exec(compile(source, filename, "exec"), namespace)
    except SystemExit as err:
        if isinstance(err.code, int) or err.code is None:
            outcome["exit_code"] = err.code or 0
        else:
            print(err.code, file=sys.stderr)
            outcome["exit_code"] = 1
    except BaseException as err:
        outcome.update(exit_code=1, exception=type(err).__name__, message=str(err)[:500])
        show_exception(err)
    finally:
        if os.getpid() != main_pid:  # a fork of the code ended: it must not serve requests
            flush_stdio()
            os._exit(exit_code(outcome))
    return outcome


def flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # the code closed or broke it
            stream.flush()


def exit_code(outcome: dict[str, object]) -> int:
    code = outcome["exit_code"]
    return code if isinstance(code, int) else 1


def serve(config: dict, layers: list[str]) -> None:
    """Answer requests until EOF: run, flush, mark the end of both streams, report."""
    marker = config["marker"].encode()
    namespace: dict[str, object] = {"__name__": "__main__", "__builtins__": __builtins__}
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # a timed-out call still shows what it printed
    write_status(STATUS_FD, {"event": "ready", "layers": layers, "uid": os.getuid()})
    calls = 0
    while (request := read_request(CONTROL_FD)) is not None:
        calls += 1
        set_call_cpu(request["cpu_s"])
        filename = "<code>" if calls == 1 else f"<code {calls}>"
        outcome = run_code(request["code"], filename, namespace, os.getpid())
        flush_stdio()
        marked = []
        for fd in (1, 2):
            try:
                os.write(fd, marker)  # atomic: shorter than PIPE_BUF
                marked.append(fd)
            except OSError:  # the code closed or replaced the fd: the service will not wait for it
                pass
        write_status(STATUS_FD, {"event": "result", "marked": marked, **outcome})


def runner_main(config: dict) -> None:
    """The forked runner: move the pipes aside, isolate, serve; never returns."""
    try:
        os.dup2(0, CONTROL_FD, inheritable=False)
        os.dup2(STATUS_PIPE, STATUS_FD, inheritable=False)
        for fd in (STATUS_PIPE, LIFELINE_PIPE):
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        layers = isolate(config)
    except IsolationError as err:
        write_status(STATUS_FD, {"event": "setup_error", "layer": err.layer, "message": str(err)})
        os._exit(SETUP_FAILED)
    except BaseException as err:
        write_status(STATUS_FD, {"event": "setup_error", "message": f"{type(err).__name__}: {err}"})
        os._exit(SETUP_FAILED)
    try:
        serve(config, layers)
    finally:
        os._exit(0)


def main() -> None:
    config = json.loads(sys.argv[1])
    config["supervisor"] = os.getpid()
    take_fds(config)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    runner = os.fork()
    if runner == 0:
        runner_main(config)
    supervise(config, runner)


if __name__ == "__main__":
    main()
