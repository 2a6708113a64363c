"""A sandbox call's stdout and stderr: kept up to a byte budget they share, up to an end marker.

The child writes a marker on both streams after each call's code returns, so a session's next
call starts on clean streams; a marker split across two reads is still found.
"""

from __future__ import annotations


class OutputBudget:
    """Output bytes a call may still keep, shared by stdout and stderr."""

    def __init__(self, size: int) -> None:
        self.left = size
        self.over = False

    def take(self, data: bytes) -> bytes:
        kept = data[: self.left]
        self.left -= len(kept)
        self.over = self.over or len(kept) < len(data)
        return kept


class OutputStream:
    """stdout or stderr of the running call: keeps what fits the budget, finds the end marker
    even when a read splits it."""

    def __init__(self, marker: bytes) -> None:
        self.marker = marker
        self.data = bytearray()
        self.tail = b""
        self.marked = False

    def begin(self) -> None:
        self.data, self.tail, self.marked = bytearray(), b"", False

    def feed(self, chunk: bytes, budget: OutputBudget) -> None:
        if self.marked:
            return  # written after the call ended, by something the code left running
        window = self.tail + chunk
        end = window.find(self.marker)
        if end >= 0:
            self.data += budget.take(window[:end])
            self.tail, self.marked = b"", True
            return
        held = next(
            n
            for n in range(min(len(self.marker) - 1, len(window)), -1, -1)
            if window.endswith(self.marker[:n])
        )
        self.data += budget.take(window[: len(window) - held])  # held back: maybe the marker's start
        self.tail = window[len(window) - held :]

    def text(self, budget: OutputBudget) -> str:
        if self.tail:
            self.data += budget.take(self.tail)
            self.tail = b""
        return self.data.decode("utf-8", "replace")
