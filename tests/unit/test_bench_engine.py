"""bench/engine.py's ratio: paired within each repeat, so that a drift in machine speed between
repeats cancels out of it."""

from __future__ import annotations

import pytest

from bench.engine import Case, Timing


def timings(*seconds: float) -> list[Timing]:
    return [Timing(s, s, 0.0) for s in seconds]


def test_the_ratio_is_the_median_of_the_per_repeat_ratios() -> None:
    # The machine ran 2x slower during the last two repeats; verst was 2.5x as fast throughout.
    case = Case("demo", 64, tokens=4096)
    case.verst = timings(0.1, 0.1, 0.1, 0.2, 0.2)
    case.hf = timings(0.25, 0.25, 0.25, 0.5, 0.5)
    assert case.ratio == pytest.approx(2.5)
    # The ratio of the medians can pair one side's fast minutes with the other's slow ones.
    case.hf = timings(0.25, 0.5, 0.5, 0.5, 0.5)  # HF's slow minutes came earlier
    assert case.ratio_of_medians == pytest.approx(5.0)
    assert case.ratio == pytest.approx(2.5)


def test_the_machine_line_names_the_matmul_features_the_host_has() -> None:
    from bench.engine_sides import matmul_isa

    assert matmul_isa("fpu sse2 avx2 fma avx512f avx512_bf16 avx512bw") == "avx2 avx512f avx512_bf16"
    assert matmul_isa("fpu avx2 amx_bf16 amx_tile") == "avx2 amx_bf16"
    assert matmul_isa("fpu sse2") == "none of avx2 avx512f avx512_bf16 amx_bf16"
