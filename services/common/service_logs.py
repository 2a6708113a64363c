"""Where a service's log file lies and how much of it is read back.

The local stack (services/stack.py, `verst up`) writes each child's stdout and stderr to
``{log_dir}/{name}.log`` (``api``, ``trainer-0``, ``engine-0``, ...); the api serves the end of them
(``GET /v1/services/{name}/logs``, services/api/logs.py). Reads are bounded: at most ``lines``
lines, each cut to MAX_LINE_BYTES, read from the end in blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SERVICE_NAME = re.compile(r"^[a-z][a-z0-9-]{0,63}$")
"""A service's name as the stack names its log: lower-case letters, digits and dashes."""
MAX_LINE_BYTES = 4096
"""A longer line is cut to this many bytes (and marked) when read back."""
BLOCK_BYTES = 65_536
"""Read from the end in blocks of this size."""


def log_path(log_dir: Path, name: str) -> Path:
    """The log file of service ``name`` (ValueError for a name that is not SERVICE_NAME)."""
    if not SERVICE_NAME.match(name):
        raise ValueError(f"{name!r:.80} is not a service name (lower-case letters, digits, dashes)")
    return log_dir / f"{name}.log"


@dataclass(frozen=True, slots=True)
class LogTail:
    lines: list[str]
    """Oldest first, without their line ends."""
    end: int
    """Byte offset just after the last line returned: read on from there to follow the file."""


def _text(raw: bytes) -> str:
    line = raw.rstrip(b"\r")
    cut = len(line) > MAX_LINE_BYTES
    text = line[:MAX_LINE_BYTES].decode("utf-8", "replace")
    return f"{text}… ({len(line)} bytes)" if cut else text


def tail(path: Path, lines: int) -> LogTail:
    """The last ``lines`` complete lines of ``path`` (a last line without its newline yet is
    left for the next read). Reads at most ``lines * MAX_LINE_BYTES`` bytes plus a block."""
    with path.open("rb") as file:
        size = file.seek(0, 2)
        end = size
        budget = lines * MAX_LINE_BYTES + BLOCK_BYTES
        data = b""
        while end > 0 and data.count(b"\n") <= lines and size - end < budget:
            start = max(0, end - BLOCK_BYTES)
            file.seek(start)
            data = file.read(end - start) + data
            end = start
        whole_first = end == 0 or (file.seek(end - 1) >= 0 and file.read(1) == b"\n")
    complete = data.rfind(b"\n") + 1  # the bytes up to the last newline
    kept = [_text(line) for line in data[:complete].split(b"\n")[:-1][-lines - 1 :]]
    if not whole_first and kept and len(kept) <= lines:  # the end of a line that began earlier
        partial = data[: data.find(b"\n")]
        kept[0] = f"… {_text(partial[-MAX_LINE_BYTES:])}"
    return LogTail(kept[-lines:], end + complete)


def after(path: Path, offset: int, lines: int) -> LogTail:
    """Up to ``lines`` complete lines from byte ``offset`` on; a file now shorter than
    ``offset`` (truncated, or a new one) is read from its start."""
    with path.open("rb") as file:
        size = file.seek(0, 2)
        start = offset if offset <= size else 0
        file.seek(start)
        cap = lines * MAX_LINE_BYTES + BLOCK_BYTES
        data = file.read(min(size - start, cap))
    kept = data.split(b"\n")[:-1][:lines]  # complete lines only: the rest waits for its newline
    if not kept and len(data) == cap:  # one line longer than a read: pass it on, cut
        return LogTail([_text(data)], start + len(data))
    used = sum(len(line) + 1 for line in kept)
    return LogTail([_text(line) for line in kept], start + used)
