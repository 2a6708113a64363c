"""How long a running job may go without a new policy version before the controller fails it.

A fixed bound either fails a job whose steps are slow (a long GPU step, a large batch) or
waits too long for one that stalled. Each job's bound follows its own pace instead::

    allowed = max(stall_timeout_s, stall_step_factor x the slowest of the last stall_window_steps steps)

and, while the job waits for its first new version (after it starts, after the controller
takes it over, after a new trainer resumes it), at least ``stall_startup_s``: that wait holds a
model load, the engines' first weights and a first step that compiles or warms caches.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.controller.config import ControllerSettings


@dataclass(frozen=True, slots=True)
class StallLimits:
    """The controller settings that bound a job's wait for its next version."""

    floor_s: float
    """stall_timeout_s: the least a job is ever allowed."""
    step_factor: float
    """stall_step_factor: allowed per second of the slowest recent step."""
    startup_s: float
    """stall_startup_s: the least allowed for the first new version after a start."""
    window_steps: int
    """stall_window_steps: how many recent steps count."""


class StallWatch:
    """One job's pace: the seconds between its recent versions, and what it is allowed now."""

    def __init__(self, limits: StallLimits) -> None:
        self.limits = limits
        self._steps: deque[float] = deque(maxlen=limits.window_steps)
        self._starting = True

    def start(self) -> None:
        """The job (re)starts: its next version may take the start-up allowance."""
        self._starting = True

    def progressed(self, step_s: float) -> None:
        """A new version came ``step_s`` seconds after the previous one (or the start)."""
        self._steps.append(max(step_s, 0.0))
        self._starting = False

    @property
    def slowest_step_s(self) -> float | None:
        """The slowest of the recent steps (None before the first)."""
        return max(self._steps) if self._steps else None

    def allowed_s(self) -> float:
        """Seconds without a new version that the job is allowed now."""
        allowed = self.limits.floor_s
        if self._steps:
            allowed = max(allowed, self.limits.step_factor * max(self._steps))
        if self._starting:
            allowed = max(allowed, self.limits.startup_s)
        return allowed

    def explain(self) -> str:
        """Why the bound is what it is, for the reason a stalled job fails with."""
        parts = [f"allowed {self.allowed_s():.0f}s"]
        if self._starting:
            parts.append(f"start-up allowance {self.limits.startup_s:.0f}s")
        slowest = self.slowest_step_s
        if slowest is not None:
            parts.append(f"slowest recent step {slowest:.1f}s x {self.limits.step_factor:g}")
        return ", ".join(parts)


def stall_limits(settings: ControllerSettings) -> StallLimits:
    """The limits the controller's settings give every job."""
    return StallLimits(
        floor_s=settings.stall_timeout_s,
        step_factor=settings.stall_step_factor,
        startup_s=settings.stall_startup_s,
        window_steps=settings.stall_window_steps,
    )
