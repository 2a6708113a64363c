"""Code graded by unit tests run in the python sandbox (``sandbox.py``).

The ``code`` verifier takes the response's program (its last fenced code block, or the
whole text when it has none) and the task's tests, carried in ``ScoreRequest.answer`` as
JSON: a list of test snippets (``["assert add(1, 2) == 3", ...]``, MBPP's ``test_list``),
a ``{name: snippet}`` object, or ``{"tests": <either>, "timeout_s": <per test>}``.

One sandbox call runs them all: a harness defines the candidate, then runs each test in
the candidate's namespace under a SIGALRM time limit of its own (the sandbox runs code in
its main thread), and reports each outcome as a tagged line on the real stdout (the
candidate's own ``print`` goes to /dev/null). The reward is the fraction of tests passed;
each test is a component ``test:<name>``. A test with no report failed: the candidate
crashed the process, ran out the call's wall time, swallowed the alarm, or flooded its
output, and the tests already reported keep their outcome. Only a sandbox that fails
itself (cannot start, vanishes) or a malformed test list raises, which the service turns
into ``ScoreResponse.error``.

The harness is not a boundary against code that games it from inside (it could find the
report tag in the harness's frames); the sandbox still keeps such code away from the host.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import threading
from collections.abc import Callable, Mapping
from typing import Any

from services.reward.sandbox import ErrorKind, SandboxConfig, SandboxError, Sandboxes

CodeResult = tuple[float, dict[str, float], dict[str, str]]
"""(reward, components, info), as ``verifiers.VerifierResult``."""

FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
"""A fenced code block, untagged or tagged python; the last one is the program."""
LOAD_TIMEOUT_S = 2.0
"""Time for the candidate's module-level code (defining its functions)."""
CALL_OVERHEAD_S = 1.0
"""Wall time of one call beyond its tests: the interpreter and the harness."""
MESSAGE_MAX = 300
"""Longest failure message kept per test."""

HARNESS = """
import json as _json, os as _os, signal as _signal, sys as _sys


def _verst_grade(payload):
    results = _os.dup(1)
    tag = payload["tag"]

    def report(record):
        _os.write(results, (tag + _json.dumps(record) + "\\n").encode())

    class TestTimeout(BaseException):
        pass

    def on_alarm(signum, frame):
        raise TestTimeout()

    def describe(err):
        try:
            return (type(err).__name__ + ": " + str(err)).rstrip(": ")[:{message_max}]
        except BaseException:
            return type(err).__name__

    def run(source, filename, seconds):
        try:
            _signal.signal(_signal.SIGALRM, on_alarm)
            _signal.setitimer(_signal.ITIMER_REAL, seconds)
            try:
                exec(compile(source, filename, "exec"), namespace)
            finally:
                _signal.setitimer(_signal.ITIMER_REAL, 0)
        except TestTimeout:
            return "timeout: longer than %gs" % seconds
        except BaseException as err:
            return describe(err)
        return ""

    _sys.stdout = _sys.stderr = open(_os.devnull, "w")
    namespace = {{"__name__": "__candidate__", "__builtins__": __builtins__}}
    error = run(payload["code"], "<candidate>", payload["load_s"])
    report({{"load": error}})
    for name, test in payload["tests"]:
        if error:
            outcome = "the candidate did not load: " + error
        else:
            outcome = run(test, "<test>", payload["test_s"])
        report({{"test": name, "error": outcome}})


_verst_grade(_json.loads({payload!r}))
"""


def extract_code(response_text: str) -> str:
    """The program in a response: its last fenced block, else the whole text."""
    blocks = FENCE.findall(response_text)
    return blocks[-1] if blocks else response_text


def parse_tests(answer: str) -> tuple[list[tuple[str, str]], float | None]:
    """The (name, snippet) tests and the per-test timeout the answer asks for (None: default)."""
    try:
        spec: Any = json.loads(answer)
    except ValueError as err:
        raise ValueError(f"the answer must be JSON tests for the code verifier: {err}") from None
    timeout_s = None
    if isinstance(spec, dict) and "tests" in spec:
        extra = sorted(set(spec) - {"tests", "timeout_s"})
        if extra:
            raise ValueError(f"unexpected key(s) in the tests: {', '.join(extra)}")
        timeout_s = spec.get("timeout_s")
        if timeout_s is not None and not (isinstance(timeout_s, int | float) and 0 < timeout_s < math.inf):
            raise ValueError(f"tests timeout_s must be a positive number, got {timeout_s!r}")
        spec = spec["tests"]
    if isinstance(spec, list):
        tests = [(str(index), snippet) for index, snippet in enumerate(spec)]
    elif isinstance(spec, dict):
        tests = list(spec.items())
    else:
        raise ValueError("tests must be a list of snippets or an object of named snippets")
    if not tests:
        raise ValueError("there are no tests to run")
    for name, snippet in tests:
        if not isinstance(snippet, str):
            raise ValueError(f"test {name!r} is not a string of code")
    return tests, timeout_s


class CodeVerifier:
    """The ``code`` verifier (see the module docstring).

    ``sandboxes`` is built on first use (it scans processes when the service is root);
    ``test_timeout_s`` bounds each test, unless the tests ask for less, and ``timeout_s``
    the whole sandbox call.
    """

    def __init__(
        self,
        sandbox_config: SandboxConfig | Callable[[], SandboxConfig] = SandboxConfig,
        *,
        test_timeout_s: float = 2.0,
        timeout_s: float = 8.0,
    ) -> None:
        self._config = sandbox_config
        self._sandboxes: Sandboxes | None = None
        self._lock = threading.Lock()
        self.test_timeout_s = test_timeout_s
        self.timeout_s = timeout_s

    @property
    def sandboxes(self) -> Sandboxes:
        with self._lock:
            if self._sandboxes is None:
                config = self._config if isinstance(self._config, SandboxConfig) else self._config()
                self._sandboxes = Sandboxes(config)
            return self._sandboxes

    def __call__(self, response_text: str, answer: str, metadata: Mapping[str, str]) -> CodeResult:
        tests, asked_s = parse_tests(answer)
        test_s = min(asked_s or self.test_timeout_s, self.test_timeout_s)
        tag = f"@verst-{secrets.token_hex(8)}@"
        payload = {
            "tag": tag,
            "code": extract_code(response_text),
            "tests": tests,
            "load_s": LOAD_TIMEOUT_S,
            "test_s": test_s,
        }
        source = HARNESS.format(message_max=MESSAGE_MAX, payload=json.dumps(payload))
        wall_s = min(self.timeout_s, LOAD_TIMEOUT_S + test_s * len(tests) + CALL_OVERHEAD_S)
        result = self.sandboxes.run(source, timeout_s=wall_s)
        if result.kind is ErrorKind.SANDBOX:
            raise SandboxError(result.error)
        records = _records(result.stdout, tag)
        return _score(tests, records, result.error)


def _records(stdout: str, tag: str) -> list[dict[str, Any]]:
    """The harness's reports, wherever the candidate's own writes to fd 1 left them."""
    records = []
    for chunk in stdout.split(tag)[1:]:
        line = chunk.partition("\n")[0]
        try:
            record = json.loads(line)
        except ValueError:
            continue  # cut by the output cap or the kill
        if isinstance(record, dict):
            records.append(record)
    return records


def _score(tests: list[tuple[str, str]], records: list[dict[str, Any]], run_error: str) -> CodeResult:
    """Reward = the fraction passed; a test without a report failed with the run's error."""
    outcomes: dict[str, str] = {}
    loaded: str | None = None
    for record in records:
        if "load" in record and loaded is None:
            loaded = str(record["load"])
        elif "test" in record:
            outcomes.setdefault(str(record["test"]), str(record.get("error", "")))
    missing = f"no result: {run_error or 'the run ended early'}"
    failures = {name: outcomes.get(name, missing) for name, _ in tests}
    failures = {name: error for name, error in failures.items() if error}
    passed = len(tests) - len(failures)
    components = {f"test:{name}": float(name not in failures) for name, _ in tests}
    reward = passed / len(tests)
    components.update(pass_rate=reward, loaded=float(loaded == ""))
    info = {"passed": f"{passed}/{len(tests)}"}
    if failures:
        info["failures"] = "; ".join(f"{name}: {error}" for name, error in failures.items())[:2000]
    if run_error:
        info["run"] = run_error
    return reward, components, info
