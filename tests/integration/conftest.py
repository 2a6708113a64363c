"""Fixtures of the integration tests: the fake router and reward services (fake_services.py)."""

from tests.integration.fake_services import (  # noqa: F401  (fixtures)
    builtin_reward,
    reward,
    router,
    runner_for,
    tokenizer,
    tokenizer_dir,
)
