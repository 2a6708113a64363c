"""Settings of the reward service (environment variables VERST_REWARD_*)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings
from services.reward.verifiers import VERIFIERS


class RewardSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="VERST_REWARD_")
    service_name: ClassVar[str] = "reward"

    port: int = Field(50053, ge=0, le=65535)
    """gRPC port of the reward service; 0 picks a free one."""
    default_verifier: str = Field("addition", min_length=1)
    """Verifier used for a ScoreRequest whose `verifier` is empty."""
    score_timeout_s: float = Field(10.0, gt=0.0, le=3600.0)
    """Deadline of one verifier call; a slower one yields ScoreResponse.error."""
    score_workers: int = Field(4, ge=1, le=1024)
    """Threads that run verifiers (the items of a ScoreBatch are scored concurrently on them)."""

    @field_validator("default_verifier")
    @classmethod
    def _known_verifier(cls, value: str) -> str:
        if value not in VERIFIERS:
            raise ValueError(f"unknown verifier {value!r}; known: {', '.join(sorted(VERIFIERS))}")
        return value
