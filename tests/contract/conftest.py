"""Fixtures of the contract tests."""

from tests.contract.sglang_fake import backend, fake  # noqa: F401
