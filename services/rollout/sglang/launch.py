"""Start and stop an SGLang server as a child process (``python -m sglang.launch_server``).

The server runs in its own process group, so stopping it also stops the scheduler and
detokenizer processes it spawns; its output goes to a log file whose tail is quoted when it
fails to start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.common.parented import parented

DEFAULT_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
"""Report log p of the sampled token under the raw logits (temperature 1, before top-k/top-p),
as the torch engine and the trainer do; SGLang's default is after temperature scaling."""
_LOG_TAIL_BYTES = 4000


def sglang_command(
    model_path: str | os.PathLike[str],
    port: int,
    extra_args: Sequence[str] = (),
    *,
    host: str = "127.0.0.1",
    python: str = sys.executable,
    dtype: str | None = None,
    mem_fraction_static: float | None = None,
    skip_tokenizer_init: bool = False,
) -> list[str]:
    """The argv that starts one SGLang server for ``model_path`` on ``host:port``.

    ``skip_tokenizer_init`` adds ``--skip-tokenizer-init`` (pure token-in/token-out; stop strings
    then fail on the server). ``extra_args`` are appended verbatim (``--tp 2``, ``--context-length``).
    """
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}")
    command = [python, "-m", "sglang.launch_server", "--model-path", os.fspath(model_path)]
    command += ["--host", host, "--port", str(port)]
    if dtype is not None:
        command += ["--dtype", dtype]
    if mem_fraction_static is not None:
        if not 0.0 < mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
        command += ["--mem-fraction-static", str(mem_fraction_static)]
    if skip_tokenizer_init:
        command.append("--skip-tokenizer-init")
    return command + [str(arg) for arg in extra_args]


def sglang_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, verst's SGLang defaults, then ``env`` on top."""
    return {**os.environ, **DEFAULT_ENV, **(env or {})}


class SGLangProcess:
    """One launched server: the child process and its log file."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], log_path: Path | None = None) -> None:
        self.command = list(command)
        if log_path is None:
            handle, name = tempfile.mkstemp(prefix="verst-sglang-", suffix=".log")
            os.close(handle)
            log_path = Path(name)
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                parented(self.command),  # a killed engine leaves no server holding the GPU
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,  # its own process group: stop() reaches its children
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def returncode(self) -> int | None:
        """The exit status, or None while it runs."""
        return self.process.poll()

    def log_tail(self, limit: int = _LOG_TAIL_BYTES) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError as err:
            return f"(log {self.log_path} unreadable: {err})"
        return data[-limit:].decode("utf-8", "replace")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after ``timeout_s``; returns the status."""
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(timeout_s)
        self._signal(signal.SIGKILL)  # children that outlived the server
        return self.process.returncode

    def _signal(self, sig: signal.Signals) -> None:
        """Signal the server's process group; the server alone if it has no group of its own."""
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            if self.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.process.send_signal(sig)
