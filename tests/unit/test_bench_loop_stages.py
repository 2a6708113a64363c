"""bench/loop_stages.py's CPU accounting: seconds per step of each service between two polls."""

from __future__ import annotations

import pytest

from bench.loop_stages import ServiceCpu, cpu_lines, cpu_per_step


def test_cpu_per_step_spans_the_steps_after_the_skip_and_before_the_last() -> None:
    samples = [
        ServiceCpu(0, {"trainer": 5.0}),  # start-up: left out
        ServiceCpu(4, {"trainer": 10.0, "engine-0": 3.0}),
        ServiceCpu(6, {"trainer": 12.0, "engine-0": 3.5}),
        ServiceCpu(9, {"trainer": 16.0, "engine-0": 4.5, "runner": 0.5}),
        ServiceCpu(10, {"trainer": 30.0, "engine-0": 9.0}),  # the last step: its final save and eval
    ]
    per_step, span = cpu_per_step(samples, skip=3, steps=10)
    assert span == 5
    assert per_step == pytest.approx({"trainer": 1.2, "engine-0": 0.3, "runner": 0.1})
    assert list(per_step) == ["trainer", "engine-0", "runner"]  # dearest first
    line = cpu_lines(per_step, span)[-1]
    assert "trainer 1.200, engine-0 0.300, runner 0.100; in all 1.600" in line


def test_cpu_per_step_needs_two_polls_steps_apart() -> None:
    assert cpu_per_step([ServiceCpu(5, {"trainer": 1.0}), ServiceCpu(5, {"trainer": 2.0})], 3, 10) == ({}, 0)
    assert cpu_lines({}, 0) == []
