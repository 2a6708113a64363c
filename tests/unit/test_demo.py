"""The demo's summary pieces: metric series and the PNG plot."""

from __future__ import annotations

import math
from pathlib import Path

from services.demo import plot, seconds_per_step, series

HISTORY = [
    {"step": 0, "source": "eval", "values": {"accuracy": 0.25}},
    {"step": 1, "source": "trainer", "values": {"reward_mean": 0.4, "loss": 0.1}},
    {"step": 1, "source": "trainer", "values": {"duplicates_skipped": 1.0}},
    {"step": 2, "source": "trainer", "values": {"reward_mean": 0.5}},
    {"step": 2, "source": "trainer", "values": {"reward_mean": 0.6}},
    {"step": 2, "source": "eval", "values": {"accuracy": 0.75}},
]


def test_series_takes_one_source_and_the_last_value_per_step() -> None:
    assert series(HISTORY, "trainer", "reward_mean") == ([1, 2], [0.4, 0.6])
    assert series(HISTORY, "eval", "accuracy") == ([0, 2], [0.25, 0.75])
    assert series(HISTORY, "eval", "reward_mean") == ([], [])


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = plot(HISTORY, tmp_path / "sub" / "curves.png", "a job")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_seconds_per_step_is_the_median_gap_between_trainer_metrics() -> None:
    rows = [
        {"source": "trainer", "time": "2026-12-05T10:00:00+00:00"},
        {"source": "eval", "time": "2026-12-05T10:00:01+00:00"},
        {"source": "trainer", "time": "2026-12-05T10:00:02+00:00"},
        {"source": "trainer", "time": "2026-12-05T10:00:05+00:00"},
        {"source": "trainer", "time": "2026-12-05T10:00:06+00:00"},
    ]
    assert seconds_per_step(rows) == 2.0  # gaps 2, 3, 1
    assert math.isnan(seconds_per_step(rows[:1]))
