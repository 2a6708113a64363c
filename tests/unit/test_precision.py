"""The trainer's mixed precision (services/trainer/precision.py): the body under autocast, the
LM head in float32, and the settings that cannot run."""

from __future__ import annotations

import logging

import pytest
import torch

from services.common.config import JobSpecError, parse_job_spec
from services.trainer import precision
from services.trainer.precision import autocast, check_autocast, keep_head_in_float32
from tests.integration.rollout_helpers import tiny_llama

CPU = torch.device("cpu")


def test_autocast_computes_the_body_in_bfloat16_and_off_leaves_float32() -> None:
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with autocast("bfloat16", CPU):
        assert layer(x).dtype == torch.bfloat16
    with autocast("off", CPU):
        assert layer(x).dtype == torch.float32


def test_the_head_kept_in_float32_gives_float32_logits_of_the_same_weights() -> None:
    model = tiny_llama(0)
    ids = torch.randint(3, 64, (2, 12))
    keys = sorted(model.state_dict())
    with torch.no_grad(), autocast("bfloat16", CPU):
        assert model(input_ids=ids).logits.dtype == torch.bfloat16  # the head autocast too
        keep_head_in_float32(model)
        out = model(input_ids=ids, output_hidden_states=True)
    assert out.logits.dtype == torch.float32
    # the head's own float32 product of the (bfloat16-computed) final hidden states
    expected = out.hidden_states[-1].float() @ model.get_output_embeddings().weight.T
    torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-5)
    assert sorted(model.state_dict()) == keys
    with torch.no_grad():
        full = model(input_ids=ids).logits  # outside autocast: float32 throughout
    assert full.dtype == torch.float32
    assert 0 < float((full - out.logits).abs().max()) < 0.05


def test_float16_autocast_needs_a_gpu() -> None:
    check_autocast("bfloat16", CPU)
    check_autocast("off", CPU)
    with pytest.raises(ValueError, match=r"trainer\.autocast float16 needs a GPU"):
        check_autocast("float16", CPU)


def test_autocast_needs_float32_weights() -> None:
    assert parse_job_spec({"trainer": {"autocast": "bfloat16"}}).trainer.autocast == "bfloat16"
    with pytest.raises(JobSpecError, match=r"trainer.autocast 'bfloat16' keeps the weights in float32"):
        parse_job_spec({"model": {"dtype": "bfloat16"}, "trainer": {"autocast": "bfloat16"}})
    with pytest.raises(JobSpecError, match=r"trainer\.autocast"):
        parse_job_spec({"trainer": {"autocast": "half"}})


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_on_a_cpu_without_bfloat16_matmuls_is_warned_of(
    native: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(precision, "cpu_has_bfloat16_matmuls", lambda: native)
    with caplog.at_level(logging.WARNING, logger="services.trainer.precision"):
        check_autocast("bfloat16", CPU)
        check_autocast("off", CPU)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == (0 if native else 1)
    if not native:
        assert "without bfloat16 matmuls" in warned[0] and "trainer.autocast: off" in warned[0]


def test_the_cpu_check_answers() -> None:
    assert isinstance(precision.cpu_has_bfloat16_matmuls(), bool)
