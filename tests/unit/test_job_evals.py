"""Which periodic evaluations are covered (services/controller/evaluation.dues_without_result): an
evaluation made for due u of version v covers the dues u..v; a row without its due, its interval.
And the metric row of one evaluation: each set's names, and the versions that served it; and a
due evaluation that never ran, told on the job's event log."""

from __future__ import annotations

from services.common.bus import Bus
from services.common.config import DEFAULT_EVAL_SET, JobSpec
from services.common.events import EventLog
from services.controller.config import ControllerSettings
from services.controller.eval_scores import PromptOutcome, set_scores
from services.controller.evaluation import (
    SERVED_VERSION,
    SERVED_VERSION_MAX,
    EvalResult,
    JobEvals,
    dues_without_result,
)
from services.controller.stubs import ServiceStubs
from services.controller.telemetry import ControllerMetrics


def test_an_evaluation_covers_the_dues_from_its_own_to_its_version() -> None:
    # made for the due at 40 once the engines served 63: it covers 40 and 60, not 80
    assert dues_without_result([(63, 40.0)], [40, 60, 80], 20) == [80]
    # made for 40 of version 45: 60 still has none
    assert dues_without_result([(45, 40.0)], [40, 60], 20) == [60]
    assert dues_without_result([(45, 40.0), (61, 60.0)], [40, 60], 20) == []


def test_a_row_without_its_due_covers_its_own_interval() -> None:
    # rows written before dues were recorded: version 63 covers the due at 60 only
    assert dues_without_result([(63, None)], [40, 60, 80], 20) == [40, 80]
    assert dues_without_result([(40, None), (79, None)], [40, 60], 20) == []


def test_no_evaluation_covers_no_due() -> None:
    assert dues_without_result([], [2, 4], 2) == [2, 4]
    assert dues_without_result([(4, 2.0)], [], 2) == []


def test_a_result_names_each_sets_metrics_and_the_versions_that_served_it() -> None:
    greedy = set_scores([PromptOutcome(1.0), PromptOutcome(0.0)], [])
    sampled = set_scores([PromptOutcome(1.0, samples=2, samples_right=1)], [1, 2])
    result = EvalResult(version=4, newest_version=5, sets={DEFAULT_EVAL_SET: greedy, "hard": sampled})
    values = result.metric_values()
    assert (values["accuracy"], values["num_prompts"]) == (0.5, 2.0), "data.eval's set: unprefixed"
    assert (values["hard/accuracy"], values["hard/mean@2"], values["hard/pass@2"]) == (1.0, 0.5, 1.0)
    assert (values[SERVED_VERSION], values[SERVED_VERSION_MAX]) == (4.0, 5.0)
    assert "mean@2" not in values and "hard/reward_mean" in values


async def test_an_evaluation_that_never_ran_is_a_warning_on_the_jobs_event_log(bus: Bus) -> None:
    spec = JobSpec.model_validate({"name": "addition"})
    stubs = ServiceStubs("127.0.0.1:9", "127.0.0.1:9")  # never called: nothing runs
    evals = JobEvals(bus, stubs, ControllerSettings(), ControllerMetrics(), "job-1", spec)
    evals.events = EventLog(bus.redis)
    evals.done.add(2)
    evals.due(2)  # covered by the evaluation of version 2: nothing to say
    evals.due(4)
    await evals.close()
    await stubs.close()
    [event] = await evals.events.read("job-1")
    assert event.data()["message"] == "the evaluation due at version 4 did not run before training ended"
