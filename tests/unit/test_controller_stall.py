"""services/controller/stall.py: how long a job may go without a new version follows its pace.
The controller failing a stalled job, and not a slow but steady one: tests/integration/
test_controller.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.controller.config import ControllerSettings
from services.controller.stall import StallLimits, StallWatch, stall_limits

LIMITS = StallLimits(floor_s=600.0, step_factor=3.0, startup_s=1800.0, window_steps=3)


def test_the_first_version_after_a_start_gets_the_start_up_allowance() -> None:
    watch = StallWatch(LIMITS)
    assert watch.allowed_s() == 1800.0
    watch.progressed(900.0)  # a first GPU step, model load included
    assert watch.allowed_s() == 2700.0  # 3 x 900
    watch.start()  # a new trainer resumed the job: another model load ahead
    assert watch.allowed_s() == 2700.0
    assert "start-up allowance 1800s" in watch.explain()


def test_the_bound_is_the_floor_or_a_multiple_of_the_slowest_recent_step() -> None:
    watch = StallWatch(LIMITS)
    watch.progressed(10.0)
    assert watch.allowed_s() == 600.0  # quick steps: the floor
    watch.progressed(400.0)
    assert watch.allowed_s() == 1200.0
    for _ in range(3):  # the slow step leaves the window of three
        watch.progressed(150.0)
    assert watch.allowed_s() == 600.0
    assert watch.slowest_step_s == 150.0
    assert watch.explain() == "allowed 600s, slowest recent step 150.0s x 3"


def test_a_step_that_went_backwards_counts_as_none() -> None:
    watch = StallWatch(LIMITS)
    watch.progressed(-5.0)  # an outage's end moved the start past now
    assert watch.slowest_step_s == 0.0 and watch.allowed_s() == 600.0


def test_the_controller_settings_give_the_limits_with_bounds() -> None:
    settings = ControllerSettings(
        stall_timeout_s=60.0, stall_step_factor=2.5, stall_startup_s=900.0, stall_window_steps=4
    )
    assert stall_limits(settings) == StallLimits(60.0, 2.5, 900.0, 4)
    defaults = stall_limits(ControllerSettings())
    assert (defaults.floor_s, defaults.step_factor, defaults.startup_s) == (600.0, 3.0, 1800.0)
    for field, bad in [("stall_step_factor", 0.5), ("stall_window_steps", 0), ("stall_startup_s", 0.0)]:
        with pytest.raises(ValidationError, match=field):
            ControllerSettings(**{field: bad})
