"""Reading back a service's log file (services/common/service_logs.py): bounded, whole lines only."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.service_logs import BLOCK_BYTES, MAX_LINE_BYTES, after, log_path, tail


def test_tail_gives_the_last_whole_lines_and_where_to_go_on(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_bytes(b"".join(b"line %d\n" % n for n in range(50_000)) + b"unfinished")
    shown = tail(log, 2)
    assert shown.lines == ["line 49998", "line 49999"]
    assert shown.end == log.stat().st_size - len(b"unfinished")
    with log.open("ab") as file:
        file.write(b" now\n")
    assert after(log, shown.end, 10).lines == ["unfinished now"]
    assert tail(log, 1000).lines[0] == "line 49001"  # across several blocks


def test_long_lines_are_cut_and_a_truncated_file_is_read_from_its_start(tmp_path: Path) -> None:
    log = tmp_path / "b.log"
    long = b"x" * (MAX_LINE_BYTES + BLOCK_BYTES * 2)
    log.write_bytes(b"first\n" + long + b"\nlast\n")
    assert tail(log, 1).lines == ["last"]
    cut = tail(log, 2).lines[0]  # longer than a tail reads: its end, marked
    assert cut == f"… {'x' * MAX_LINE_BYTES}"
    first, cut, last = tail(log, 40).lines  # read whole: its start, with its length
    assert (first, last) == ("first", "last")
    assert cut.startswith("x" * MAX_LINE_BYTES) and cut.endswith(f"({len(long)} bytes)") and len(cut) < 5000
    first = after(log, 0, 1)
    assert first.lines == ["first"]
    passed = after(log, first.end, 1)  # one line longer than a read still moves the reader on
    assert passed.end > first.end and passed.lines[0].endswith("bytes)")
    log.write_bytes(b"new\n")
    assert after(log, 10_000, 5).lines == ["new"]


@pytest.mark.parametrize("name", ["../x", "a/b", "", "Api", "-x", "a" * 65, "x.log"])
def test_only_service_names_make_a_log_path(name: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a service name"):
        log_path(tmp_path, name)
    assert log_path(tmp_path, "engine-0") == tmp_path / "engine-0.log"
