"""services/trainer/policy.py's import_deepspeed: a trainer imports DeepSpeed without the MLflow
that DeepSpeed's autotuner would otherwise import (about 0.9 s of every trainer's start), mlflow
stays importable afterwards, and an mlflow imported before is left as it is. Each case runs in a
fresh interpreter: what one test imported would hide what the next one imports."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow


def run_fresh(code: str) -> None:
    """Run ``code`` in a new interpreter; fail with its output when it fails."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_deepspeed_comes_without_mlflow_and_mlflow_still_imports() -> None:
    run_fresh("""
        import sys
        from services.trainer.policy import import_deepspeed

        deepspeed = import_deepspeed()
        assert deepspeed is sys.modules["deepspeed"]
        assert "mlflow" not in sys.modules, "mlflow came in with deepspeed"
        assert "pandas" not in sys.modules, "pandas came in with deepspeed"
        import mlflow  # not left hidden
        assert sys.modules["mlflow"] is mlflow
    """)


def test_an_mlflow_imported_before_is_left_as_it_is() -> None:
    run_fresh("""
        import sys
        import mlflow
        from services.trainer.policy import import_deepspeed

        import_deepspeed()
        from deepspeed.autotuning import autotuner
        assert autotuner.has_mlflow, "the autotuner saw no mlflow though it was imported"
        assert sys.modules["mlflow"] is mlflow
    """)
