"""A real api process (`python -m services.api`, uvicorn) for the tests that need one."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx

from services.common.redis_server import free_port

START_DEADLINE_S = 30.0


class ApiProcess:
    """`python -m services.api` on a free loopback port, with the environment ``env`` plus
    ``settings`` (VERST_API_* names without the prefix, e.g. {"TOKEN": ...}); ``port`` reuses a
    port (an api restarted where its clients expect it)."""

    def __init__(
        self, python: str, env: dict[str, str], redis_url: str, port: int = 0, **settings: str
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        api_env = {f"VERST_API_{name}": value for name, value in settings.items()}
        self.proc = subprocess.Popen(
            [python, "-m", "services.api"],
            env={**env, **api_env, "VERST_API_PORT": str(self.port), "REDIS_URL": redis_url},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def wait_until_serving(self) -> None:
        """Until /healthz answers (any status); fails if the process exits or the deadline passes."""
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the api exited with {self.proc.returncode}:\n{self.output()}")
            try:
                httpx.get(f"{self.url}/healthz", timeout=2)
                return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def output(self) -> str:
        """What the process printed; only once it has exited."""
        assert self.proc.stdout is not None and self.proc.poll() is not None
        return self.proc.stdout.read()

    def stop(self) -> tuple[int, str]:
        """SIGTERM (if it still runs), then its exit status and output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            output, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            output, _ = self.proc.communicate()
            raise AssertionError(f"the api did not stop within 30s of SIGTERM:\n{output}") from None
        return self.proc.returncode, output


@contextlib.contextmanager
def serving(python: str, env: dict[str, str], redis_url: str, **settings: str) -> Iterator[ApiProcess]:
    """An ApiProcess once /healthz answers; on exit it is stopped and must exit with status 0."""
    process = ApiProcess(python, env, redis_url, **settings)
    try:
        process.wait_until_serving()
        yield process
    finally:
        code, output = process.stop()
        assert code == 0, output
