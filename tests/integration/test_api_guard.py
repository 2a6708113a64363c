"""The api's guard against a real Redis: the bearer token, the body cap, short error excerpts, lone
surrogates, summaries in lists, and every response code in the OpenAPI."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from services.api.config import ApiSettings
from services.api.guard import EXCERPT_CHARS
from services.api.server import create_app

TOKEN = "s3cret-token-0123456789"


@asynccontextmanager
async def api(redis_url: str, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    values = {"REDIS_URL": redis_url, "controller": False, "check_specs": False, **settings}
    app = create_app(ApiSettings.model_validate(values))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            yield client


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with api(redis_url, max_body_bytes=4096) as client:
        yield client


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_with_a_token_every_endpoint_but_health_and_metrics_needs_it(redis_url: str) -> None:
    async with api(redis_url, token=TOKEN) as client:
        for method, path in [
            ("POST", "/v1/jobs"),
            ("GET", "/v1/jobs"),
            ("GET", "/v1/jobs/x-1"),
            ("GET", "/v1/jobs/x-1/metrics"),
            ("POST", "/v1/jobs/x-1/cancel"),
            ("GET", "/openapi.json"),
        ]:
            for headers in [{}, bearer("wrong-token-0123456789"), {"Authorization": TOKEN}]:
                reply = await client.request(method, path, headers=headers, json={})
                assert reply.status_code == 401, (method, path, headers)
                assert reply.headers["www-authenticate"] == "Bearer" and reply.json()["detail"]
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        submitted = await client.post("/v1/jobs", json={"name": "ok"}, headers=bearer())
        assert submitted.status_code == 201, submitted.text
        job_id = submitted.json()["job_id"]
        lower = {"authorization": f"bearer {TOKEN}"}  # the scheme is case-insensitive
        assert (await client.get(f"/v1/jobs/{job_id}", headers=lower)).status_code == 200
        assert (await client.get("/v1/jobs/nope-1", headers=bearer())).status_code == 404


async def test_without_a_token_nothing_is_asked(client: httpx.AsyncClient) -> None:
    assert (await client.post("/v1/jobs", json={})).status_code == 201
    assert (await client.get("/v1/jobs")).status_code == 200


def test_a_short_token_is_a_settings_error() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        ApiSettings.model_validate({"token": "short"})


async def test_a_body_over_the_cap_is_a_413(client: httpx.AsyncClient) -> None:
    big = {"name": "big", "rollout": {"stop": ["x" * 1000] * 5}}
    reply = await client.post("/v1/jobs", json=big)
    assert reply.status_code == 413 and "4096 bytes" in reply.json()["detail"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"name": "chunked", "rollout": {"stop": ['
        for _ in range(10):
            yield b'"' + b"y" * 500 + b'",'
        yield b'"z"]}}'

    streamed = await client.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    assert (await client.post("/v1/jobs", json={"name": "small"})).status_code == 201
    assert [job["name"] for job in (await client.get("/v1/jobs")).json()["jobs"]] == ["small"]


async def test_a_422_repeats_only_an_excerpt_of_the_input(redis_url: str) -> None:
    async with api(redis_url) as client:
        name = "x" * 500_000 + " y"
        reply = await client.post(
            "/v1/jobs", json={"name": name, "trainer": {"deepspeed": {"k": "v" * 100_000}}}
        )
        assert reply.status_code == 422
        assert len(reply.content) < 3000, "nothing near the input's size comes back"
        errors = {tuple(e["loc"]): e for e in reply.json()["detail"]}
        shown = errors[("body", "name")]["input"]
        assert shown.startswith("x" * EXCERPT_CHARS) and shown.endswith("(500002 characters)")
        assert "at most 65536" in errors[("body", "trainer", "deepspeed")]["msg"]
        huge_key = await client.post("/v1/jobs", json={"rollout": {"k" * 10_000: 1}})
        assert huge_key.status_code == 422 and len(huge_key.content) < 2000


@pytest.mark.parametrize(
    "body",
    [
        b'{"name": "\\ud800"}',
        b'{"trainer": {"deepspeed": {"\\udc00": "\\ud800"}}}',
        b'{"rollout": {"\\ud800": 1}}',
        b'{"seed": 1e400}',
        b'{"algorithm": {"kl_coef": NaN}}',
    ],
)
async def test_lone_surrogates_and_non_finite_numbers_are_a_422_not_a_500(
    client: httpx.AsyncClient, body: bytes
) -> None:
    reply = await client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 422, reply.text
    assert json.loads(reply.content)["detail"][0]["loc"][0] == "body"


@pytest.mark.parametrize("body", [b'{"name": "\xff"}', b"[" * 3000])
async def test_a_body_that_is_not_json_text_is_a_400(client: httpx.AsyncClient, body: bytes) -> None:
    reply = await client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text  # not UTF-8, or nested past the parser's depth
    assert reply.json() == {"detail": "There was an error parsing the body"}


@pytest.mark.parametrize("name", ["aジョブ名", "ünïcode", "a b", "-lead", "a/b"])
async def test_names_are_ascii_letters_digits_and_three_marks(client: httpx.AsyncClient, name: str) -> None:
    reply = await client.post("/v1/jobs", json={"name": name})
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"] == ["body", "name"]


async def test_lists_show_summaries_and_the_job_shows_its_spec(client: httpx.AsyncClient) -> None:
    job_id = (await client.post("/v1/jobs", json={"name": "one", "trainer": {"deepspeed": {"a": 1}}})).json()[
        "job_id"
    ]
    [listed] = (await client.get("/v1/jobs")).json()["jobs"]
    assert listed["job_id"] == job_id and listed["name"] == "one" and "spec" not in listed
    assert (await client.get(f"/v1/jobs/{job_id}")).json()["spec"]["trainer"]["deepspeed"] == {"a": 1}


async def test_the_openapi_declares_every_code_and_the_bearer_scheme(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    paths = schema["paths"]

    def codes(path: str, method: str) -> set[str]:
        return set(paths[path][method]["responses"])

    assert codes("/v1/jobs", "post") == {"201", "400", "401", "413", "422", "503"}
    assert codes("/v1/jobs", "get") == {"200", "304", "401", "422", "503"}
    assert codes("/v1/jobs/{job_id}", "get") == {"200", "401", "404", "422", "503"}
    assert codes("/v1/jobs/{job_id}/metrics", "get") == {"200", "401", "404", "422", "503"}
    assert codes("/v1/jobs/{job_id}/cancel", "post") == {"200", "401", "404", "409", "413", "422", "503"}
    assert codes("/healthz", "get") == {"200", "503"} and codes("/metrics", "get") == {"200", "503"}
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert paths["/v1/jobs"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in paths["/healthz"]["get"] and "security" not in paths["/metrics"]["get"]
    listed = schema["components"]["schemas"]["JobList"]["properties"]["jobs"]["items"]["$ref"]
    assert listed.endswith("/JobSummary")
