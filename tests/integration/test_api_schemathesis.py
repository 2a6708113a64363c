"""schemathesis on the api's own OpenAPI: every operation, with hypothesis generating valid and
invalid requests from the schema (bounded and derandomized, so every run sends the same), against
a real api process (uvicorn, with its controller and its token) over real Redis. None may be a
5xx, and every status must be one the schema declares for the operation."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.core.errors import InvalidSchema
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import status_code_conformance

from tests.conftest import ROOT
from tests.integration.api_process import ApiProcess, serving

TOKEN = "schemathesis-token-0123456789"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES_PER_OPERATION = 50


@pytest.fixture
def api(redis_url: str) -> Iterator[ApiProcess]:
    env = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "VERST_LOG_LEVEL": "WARNING"}
    with serving(sys.executable, env, redis_url, TOKEN=TOKEN, CHECK_SPECS="false") as process:
        yield process


def check_operation(operation: Any, mode: Any, seen: Counter[int]) -> bool:
    """EXAMPLES_PER_OPERATION requests that hypothesis draws from the operation's schema: valid
    ones (POSITIVE) or ones that break it (NEGATIVE). False where schemathesis could not build
    invalid requests for the operation's schema (its generator gives up on some of JobSpec's
    arrays in some runs: "Cannot generate an array with 1 demanded elements"); valid ones it must."""

    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(mode))
    def send(case: Any) -> None:
        reply = case.call(headers=HEADERS, timeout=30)
        seen[reply.status_code] += 1
        where = (case.method, case.formatted_path, reply.status_code)
        assert reply.status_code < 500, (*where, reply.text[:300])
        case.validate_response(reply, checks=[status_code_conformance])

    try:
        send()
    except Unsatisfiable:  # an operation without inputs has no invalid request to send
        assert mode is GenerationMode.NEGATIVE and not operation.path_parameters
    except InvalidSchema:
        if mode is not GenerationMode.NEGATIVE:
            raise
        return False
    return True


def test_the_openapi_under_schemathesis_gets_no_5xx(api: ApiProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{api.url}/openapi.json", headers=HEADERS)
    operations = [result.ok() for result in schema.get_all_operations()]
    seen: Counter[int] = Counter()
    not_negated = []
    for operation in operations:
        for mode in GenerationMode:
            if not check_operation(operation, mode, seen):
                not_negated.append(operation.label)
    print(f"schemathesis: {len(operations)} operations, outcomes {sorted(seen.items())}")
    print(f"schemathesis could not build invalid requests for: {not_negated}")
    assert len(operations) >= 6 and sum(seen.values()) >= 4 * len(operations)
    assert len(not_negated) <= len(operations) // 4, not_negated
