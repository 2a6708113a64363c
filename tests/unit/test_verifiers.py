"""The built-in verifiers against hand-checked cases, and user plugins through the servicer.

Plugins used here are functions of this module, named ``tests.unit.test_verifiers:<name>``
as a JobSpec would name them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from services.common.config import RewardConfig
from services.common.pb import reward_pb2
from services.reward import math_verifier as math_verifier_module
from services.reward.code_verifier import CodeVerifier, extract_code, parse_tests
from services.reward.config import RewardSettings
from services.reward.math_verifier import MathVerifier
from services.reward.plugins import PluginError, PluginResultError, Plugins, to_result
from services.reward.server import RewardServicer
from services.reward.task_verifiers import TASK_VERIFIERS
from services.reward.verifiers import (
    VERIFIER_REGISTRY,
    VERIFIERS,
    NumericVerifier,
    VerifierOptions,
    builtin_verifiers,
    exact_match,
    last_number,
)
from services.tasks.catalog import TASKS

HERE = "tests.unit.test_verifiers"


# --- exact match and numbers --------------------------------------------------------------------


def test_exact_match_strips_whitespace_only() -> None:
    assert exact_match(" Paris\n", "Paris", {})[0] == 1.0
    assert exact_match("paris", "Paris", {})[0] == 0.0


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("the answer is 42", 42.0),
        ("first 3, then 5", 5.0),
        ("x = -3/4.", -0.75),
        ("Total: $1,234.50.", 1234.5),
        (".5 of it", 0.5),
        ("6.02e23 atoms", 6.02e23),
        ("v2 has 7", 7.0),
        ("1, 2, 3", 3.0),
        ("no digits", None),
    ],
)
def test_last_number(text: str, value: float | None) -> None:
    got = last_number(text)
    assert (got[0] if got else None) == value


@pytest.mark.parametrize(
    ("rel_tol", "abs_tol", "response", "answer", "correct"),
    [
        (0.01, 0.0, "202", "200", True),  # |2| <= 0.01 * 202
        (0.01, 0.0, "198", "200", True),  # |2| <= 0.01 * 200: the edge is inside
        (0.01, 0.0, "203", "200", False),
        (0.01, 0.0, "197.9", "200", False),
        (0.0, 0.5, "0.5", "0", True),  # relative tolerance is useless at 0; absolute decides
        (0.0, 0.5, "-0.5", "0", True),
        (0.0, 0.5, "0.51", "0", False),
        (1e-6, 1e-9, "so it is 0.3333333", "1/3", True),
        (1e-6, 1e-9, "0.333", "1/3", False),
    ],
)
def test_numeric_tolerance_edges(
    rel_tol: float, abs_tol: float, response: str, answer: str, correct: bool
) -> None:
    reward, components, info = NumericVerifier(rel_tol, abs_tol)(response, answer, {})
    assert reward == float(correct)
    assert components == {"correct": float(correct), "parsed": 1.0}
    assert info["parsed"] == response.split()[-1]


def test_numeric_without_a_number() -> None:
    assert VERIFIERS["numeric"]("I do not know", "12", {}) == (
        0.0,
        {"correct": 0.0, "parsed": 0.0},
        {"parsed": ""},
    )
    with pytest.raises(ValueError, match="has no number"):
        VERIFIERS["numeric"]("12", "twelve", {})


def test_the_registry_holds_every_builtin_verifier() -> None:
    names = {"exact_match", "numeric", "math", "code", "reasoning_gym", *TASKS, *TASK_VERIFIERS}
    assert set(VERIFIER_REGISTRY.names()) == names == set(VERIFIERS)
    assert VERIFIER_REGISTRY.where(configurable=True) == {"numeric", "math", "code"}
    assert VERIFIER_REGISTRY.get("exact_match").fn is exact_match is VERIFIERS["exact_match"]
    for name, verify in TASK_VERIFIERS.items():  # the metadata-reading one, not the task's generic one
        assert VERIFIERS[name] is verify
    with pytest.raises(ValueError, match=r"reward.verifier 'fuzzy' is not available in this reward service"):
        VERIFIER_REGISTRY.get("fuzzy")


def test_configurable_verifiers_take_the_services_options() -> None:
    numeric = builtin_verifiers(VerifierOptions(numeric_rel_tol=0.1, numeric_abs_tol=0.0))["numeric"]
    assert numeric == NumericVerifier(0.1, 0.0)
    assert numeric("10.5", "10", {})[0] == 1.0
    assert VERIFIERS["numeric"]("10.5", "10", {})[0] == 0.0


# --- math ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def math_verifier() -> Iterator[MathVerifier]:
    verifier = MathVerifier(workers=2, timeout_s=5.0)
    yield verifier
    verifier.close()


@pytest.mark.parametrize(
    ("response", "answer", "correct"),
    [
        ("0.5", "1/2", True),
        ("The answer is $\\frac{1}{2}$.", "0.5", True),
        ("so we get \\boxed{0.5}", "\\frac{1}{2}", True),
        ("\\boxed{\\frac12}", "1/2", True),
        ("First 3, but in the end \\boxed{7}.", "7", True),
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", True),
        ("$1+x$", "x+1", True),
        ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", True),
        ("\\boxed{4}", "3", False),
        ("\\boxed{0.51}", "1/2", False),
    ],
)
def test_math_equivalent_forms(
    math_verifier: MathVerifier, response: str, answer: str, correct: bool
) -> None:
    reward, components, info = math_verifier(response, answer, {})
    assert (reward, components["correct"], components["parsed"]) == (float(correct), float(correct), 1.0)
    assert info["parsed"] and info["gold"]


def test_math_without_an_answer_and_with_an_unreadable_reference(math_verifier: MathVerifier) -> None:
    assert math_verifier("no idea", "1/2", {}) == (
        0.0,
        {"correct": 0.0, "parsed": 0.0},
        {"parsed": "", "gold": "\\frac{1}{2}"},
    )
    with pytest.raises(ValueError, match="cannot read the reference answer"):
        math_verifier("1", "", {})


def test_math_runs_off_the_main_thread(math_verifier: MathVerifier) -> None:
    """math-verify's own alarms need the main thread; the service calls verifiers on threads."""
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda r: math_verifier(r, "1/2", {})[0], ["0.5", "\\boxed{0.25}"]))
    assert results == [1.0, 0.0]


def test_math_past_its_deadline_is_an_error_and_the_worker_is_replaced() -> None:
    verifier = MathVerifier(workers=1, timeout_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not finish within 1s"):
            verifier("\\boxed{9^{9^{9^{9}}}}", "42", {})  # sympy evaluates the tower
        assert time.monotonic() - started < 15
        assert verifier("\\boxed{42}", "42", {})[0] == 1.0  # a fresh worker
    finally:
        verifier.close()


def test_math_kills_a_worker_that_cannot_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backstop for a worker its own alarm cannot stop (stopped here with SIGSTOP)."""
    monkeypatch.setattr(math_verifier_module, "KILL_GRACE_S", 0.5)
    verifier = MathVerifier(workers=1, timeout_s=0.5)
    try:
        assert verifier("1", "1", {})[0] == 1.0
        [worker] = verifier._idle
        os.kill(worker.proc.pid, signal.SIGSTOP)
        with pytest.raises(TimeoutError):
            verifier("1", "1", {})
        assert worker.proc.poll() is not None, "killed"
        assert verifier("2", "2", {})[0] == 1.0
    finally:
        verifier.close()


# --- code ---------------------------------------------------------------------------------------

ADD_TESTS = json.dumps(["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"])


@pytest.fixture(scope="module")
def code() -> CodeVerifier:
    return CodeVerifier(test_timeout_s=1.0, timeout_s=8.0)


def test_code_extraction_and_test_formats() -> None:
    fenced = "Here:\n```python\ndef f(): pass\n```\nand better:\n```py\ndef g(): pass\n```\n"
    assert extract_code(fenced) == "def g(): pass\n"
    assert extract_code("def h(): pass") == "def h(): pass"
    assert parse_tests('["assert 1"]') == ([("0", "assert 1")], None)
    assert parse_tests('{"tests": {"one": "assert 1"}, "timeout_s": 0.5}') == ([("one", "assert 1")], 0.5)
    for bad, says in [("assert 1", "must be JSON"), ("[]", "no tests"), ('[1]', "not a string"),
                      ('{"tests": [], "extra": 1}', "unexpected key")]:  # fmt: skip
        with pytest.raises(ValueError, match=says):
            parse_tests(bad)


def test_code_passing(code: CodeVerifier) -> None:
    response = "```python\ndef add(a, b):\n    print('noise', a, b)\n    return a + b\n```"
    reward, components, info = code(response, ADD_TESTS, {})
    assert reward == 1.0
    assert components == {"test:0": 1.0, "test:1": 1.0, "test:2": 1.0, "pass_rate": 1.0, "loaded": 1.0}
    assert info == {"passed": "3/3"}


def test_code_failing_gets_the_fraction_passed(code: CodeVerifier) -> None:
    reward, components, info = code("def add(a, b):\n    return a + b + (a == 2)", ADD_TESTS, {})
    assert reward == pytest.approx(2 / 3)
    assert (components["test:0"], components["test:1"], components["test:2"]) == (1.0, 1.0, 0.0)
    assert info["failures"] == "2: AssertionError"


def test_code_that_does_not_load_fails_every_test(code: CodeVerifier) -> None:
    for response in ["def add(a, b) return a", "import sys\nsys.exit(0)\ndef add(a, b): return a + b"]:
        reward, components, info = code(response, ADD_TESTS, {})
        assert (reward, components["loaded"]) == (0.0, 0.0)
        assert info["failures"].startswith("0: the candidate did not load: ")


def test_code_timing_out_fails_that_test_only(code: CodeVerifier) -> None:
    response = "def add(a, b):\n    while a == 2:\n        pass\n    return a + b"
    started = time.monotonic()
    reward, components, info = code(
        response, json.dumps({"tests": json.loads(ADD_TESTS), "timeout_s": 0.3}), {}
    )
    assert time.monotonic() - started < 5
    assert reward == pytest.approx(2 / 3) and components["test:2"] == 0.0
    assert info["failures"] == "2: timeout: longer than 0.3s"


def test_code_that_outlives_the_whole_call_keeps_what_was_reported() -> None:
    """A candidate that swallows the test alarm runs until the sandbox call's wall time."""
    verifier = CodeVerifier(test_timeout_s=0.2, timeout_s=2.5)
    response = (
        "import time\n"
        "def add(a, b):\n"
        "    while a == 2:\n"
        "        try:\n            time.sleep(10)\n"
        "        except BaseException:\n            pass\n"
        "    return a + b"
    )
    reward, components, info = verifier(response, ADD_TESTS, {})
    assert reward == pytest.approx(2 / 3) and components["test:2"] == 0.0
    assert info["run"].startswith("timeout: ")
    assert info["failures"].startswith("2: no result: timeout: ")


def test_code_crashing_the_process(code: CodeVerifier) -> None:
    response = (
        "import os, signal\n"
        "def add(a, b):\n"
        "    if a == -1:\n"
        "        os.kill(os.getpid(), signal.SIGSEGV)\n"
        "    return a + b"
    )
    reward, components, info = code(response, ADD_TESTS, {})
    assert reward == pytest.approx(1 / 3)
    assert [components[f"test:{i}"] for i in range(3)] == [1.0, 0.0, 0.0]
    assert info["run"] == "crash: the process was killed by signal SIGSEGV"


def test_code_with_malformed_tests_is_an_error_not_a_zero(code: CodeVerifier) -> None:
    with pytest.raises(ValueError, match="must be JSON"):
        code("def add(a, b): return a + b", "add(1, 2) == 3", {})


# --- plugins ------------------------------------------------------------------------------------


def length_plugin(request: reward_pb2.ScoreRequest) -> dict[str, Any]:
    """A sync plugin: 1 / (1 + characters of difference), with components and info."""
    gap = abs(len(request.response_text) - len(request.answer))
    return {"reward": 1 / (1 + gap), "components": {"gap": gap}, "info": {"verifier": request.verifier}}


async def async_plugin(request: reward_pb2.ScoreRequest) -> float:
    await asyncio.sleep(0.01)
    return float(request.response_text == request.answer)


def raising_plugin(request: reward_pb2.ScoreRequest) -> float:
    raise RuntimeError("the judge is out to lunch")


def slow_plugin(request: reward_pb2.ScoreRequest) -> float:
    time.sleep(float(request.metadata.get("sleep_s", "2")))
    return 1.0


async def slow_async_plugin(request: reward_pb2.ScoreRequest) -> float:
    await asyncio.sleep(2.0)
    return 1.0


def nan_plugin(request: reward_pb2.ScoreRequest) -> float:
    return float("nan")


def text_plugin(request: reward_pb2.ScoreRequest) -> str:
    return "high"


def two_argument_plugin(request: reward_pb2.ScoreRequest, answer: str) -> float:
    return 1.0


NOT_CALLABLE = 3


@pytest.fixture
def servicer() -> RewardServicer:
    return RewardServicer(RewardSettings(port=0, score_timeout_s=0.5, tools_enabled=False), VERIFIERS)


async def score(servicer: RewardServicer, plugin: str, response: str = "231", **metadata: str) -> Any:
    request = reward_pb2.ScoreRequest(
        response_text=response, answer="231", verifier=plugin, metadata=metadata
    )
    return await servicer.score(request)


async def test_sync_and_async_plugins_score(servicer: RewardServicer) -> None:
    result = await score(servicer, f"{HERE}:length_plugin", "23")
    assert (result.reward, dict(result.components), result.error) == (0.5, {"gap": 1.0}, "")
    assert result.info["verifier"] == f"{HERE}:length_plugin"
    right, wrong = (
        await score(servicer, f"{HERE}:async_plugin"),
        await score(servicer, f"{HERE}:async_plugin", "2"),
    )
    assert (right.reward, wrong.reward, right.error, wrong.error) == (1.0, 0.0, "", "")


def test_a_plugin_is_named_by_the_job_spec() -> None:
    assert RewardConfig(plugin=f"{HERE}:length_plugin").scorer == f"{HERE}:length_plugin"
    assert RewardConfig(verifier="math").scorer == "math"


@pytest.mark.parametrize(
    ("plugin", "error"),
    [
        ("raising_plugin", "failed: RuntimeError: the judge is out to lunch"),
        ("slow_plugin", "did not finish within 0.5s"),
        ("slow_async_plugin", "did not finish within 0.5s"),
        ("nan_plugin", "returned a malformed result: the reward is nan"),
        ("text_plugin", "returned a malformed result: the reward must be a number, got str"),
        (
            "two_argument_plugin",
            "cannot be used: tests.unit.test_verifiers:two_argument_plugin does not take",
        ),
        ("NOT_CALLABLE", "cannot be used: tests.unit.test_verifiers:NOT_CALLABLE is not callable"),
        ("missing", "cannot be used: module 'tests.unit.test_verifiers' has no 'missing'"),
    ],
)
async def test_failing_plugins_are_errors_not_zeros(
    servicer: RewardServicer, plugin: str, error: str
) -> None:
    started = time.monotonic()
    result = await score(servicer, f"{HERE}:{plugin}")
    assert time.monotonic() - started < 1.5
    assert result.reward == 0.0
    assert error in result.error and result.error.startswith("plugin 'tests.unit.test_verifiers:")


async def test_a_module_that_does_not_import(servicer: RewardServicer) -> None:
    result = await score(servicer, "no_such_package.rewards:score")
    assert result.error == (
        "plugin 'no_such_package.rewards:score' cannot be used: "
        "cannot import 'no_such_package.rewards': No module named 'no_such_package'"
    )


async def test_a_plugin_is_imported_once(servicer: RewardServicer, monkeypatch: pytest.MonkeyPatch) -> None:
    imports: list[str] = []
    import importlib

    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name: imports.append(name) or real(name))
    results = await asyncio.gather(*(score(servicer, f"{HERE}:async_plugin") for _ in range(5)))
    assert [r.reward for r in results] == [1.0] * 5 and imports == [HERE]


def test_to_result_forms() -> None:
    assert to_result(1) == (1.0, {}, {})
    assert to_result(True) == (1.0, {}, {})
    assert to_result({"reward": 0.25, "info": {"n": 3}}) == (0.25, {}, {"n": "3"})
    for bad, says in [
        ({"score": 1}, "got keys"),
        ({"reward": 1, "extra": 2}, "got keys"),
        (None, "must be a number"),
        ({"reward": 1, "components": {"a": "x"}}, "must be numbers"),
        (float("inf"), "not a finite number"),
    ]:
        with pytest.raises(PluginResultError, match=says):
            to_result(bad)


@pytest.mark.parametrize(
    ("name", "enabled", "modules", "says"),
    [
        ("os:system", True, (), "standard library, verst, or private"),
        ("services.reward.server:error_response", True, (), "standard library, verst, or private"),
        (f"{HERE}:_private", True, (), "standard library, verst, or private"),
        (f"{HERE}:length_plugin", True, ("my_rewards",), "not in VERST_REWARD_PLUGIN_MODULES"),
        ("tests_extra:score", True, ("tests",), "not in VERST_REWARD_PLUGIN_MODULES"),
        (f"{HERE}:length_plugin", False, (), "plugins are turned off"),
    ],
)
def test_plugins_that_may_not_be_loaded(
    name: str, enabled: bool, modules: tuple[str, ...], says: str
) -> None:
    with pytest.raises(PluginError, match=says):
        Plugins(ThreadPoolExecutor(1), enabled=enabled, modules=modules).check(name)
    assert Plugins(ThreadPoolExecutor(1), modules=("tests",)).check(f"{HERE}:x") == (HERE, "x")
