"""GET /v1/jobs/{id}/events (Server-Sent Events) and `verst watch`, against a real api process on a
real Redis: events come in log order, a reconnect with Last-Event-ID gets exactly the events after
that id, a finished job's stream ends after its terminal state, and `verst watch` ends with the job.

The api runs without its controller: the test moves the job itself through the job store, the
owner of its state and metrics, and cancels it through the api."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from httpx_sse import ServerSentEvent, aconnect_sse

from services.common.bus import Bus
from services.common.config import JobSpec
from services.common.events import START, warning_event
from services.common.jobs import CANCELLED, QUEUED, RUNNING, SUCCEEDED, JobStore, MetricRow
from tests.integration.api_process import ApiProcess, serving
from tests.integration.cli_thread import ended, run_cli

TOKEN = "events-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DEADLINE_S = 30.0


@pytest.fixture
def api(python: str, python_env: dict[str, str], redis_url: str) -> Iterator[ApiProcess]:
    settings = {"TOKEN": TOKEN, "CHECK_SPECS": "false", "CONTROLLER": "false", "EVENTS_HEARTBEAT_S": "1"}
    with serving(python, python_env, redis_url, **settings) as process:
        yield process


@pytest.fixture
async def client(api: ApiProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=api.url, headers=AUTH, timeout=10) as client:
        yield client


async def submit(client: httpx.AsyncClient, steps: int = 5) -> str:
    spec = JobSpec.model_validate({"name": "addition", "trainer": {"steps": steps}})
    response = await client.post("/v1/jobs", json=spec.model_dump(mode="json"))
    assert response.status_code == 201, response.text
    return str(response.json()["job_id"])


async def step(store: JobStore, job_id: str, number: int, source: str = "trainer") -> None:
    values = {"reward_mean": number / 10} if source == "trainer" else {"accuracy": 0.5, "num_prompts": 8.0}
    await store.merge_metric_rows(job_id, [MetricRow(number, number, source, values, time.time())])


async def take(source_events: AsyncIterator[ServerSentEvent], count: int) -> list[ServerSentEvent]:
    async with asyncio.timeout(DEADLINE_S):
        return [await anext(source_events) for _ in range(count)]


async def read_to_end(source_events: AsyncIterator[ServerSentEvent]) -> list[ServerSentEvent]:
    """Every event until the api ends the stream (a stream that never ends fails the deadline)."""
    async with asyncio.timeout(DEADLINE_S):
        return [event async for event in source_events]


def events_url(job_id: str) -> str:
    return f"/v1/jobs/{job_id}/events"


async def test_a_reconnect_with_last_event_id_gets_exactly_the_events_after_it(
    client: httpx.AsyncClient, bus: Bus
) -> None:
    store = JobStore(bus.redis)
    job_id = await submit(client)
    assert await store.set_state(job_id, RUNNING)
    for number in (1, 2, 3):
        await step(store, job_id, number)

    async with aconnect_sse(client, "GET", events_url(job_id)) as source:
        assert source.response.status_code == 200
        first = await take(source.aiter_sse(), 3)  # then the client goes away
    assert [(e.event, json.loads(e.data).get("state")) for e in first] == [
        ("state", QUEUED), ("state", RUNNING), ("metrics", None),
    ]  # fmt: skip
    assert json.loads(first[2].data)["values"] == {"reward_mean": 0.1}

    await step(store, job_id, 4)  # while nobody listens
    await store.events.append(warning_event(job_id, "careful"))
    async with aconnect_sse(
        client, "GET", events_url(job_id), headers={"Last-Event-ID": first[-1].id}
    ) as source:
        events = source.aiter_sse()
        backlog = await take(events, 4)  # steps 2, 3, 4 and the warning
        await step(store, job_id, 5)  # live, then the end
        await step(store, job_id, 5, source="eval")
        assert (await client.post(f"/v1/jobs/{job_id}/cancel")).status_code == 200
        rest = await read_to_end(events)

    logged = [event.id for event in await store.events.read(job_id, START, count=1000)]
    seen = [event.id for event in [*first, *backlog, *rest]]
    assert seen == logged  # in order, none twice, none missing
    assert [e.event for e in backlog] == ["metrics", "metrics", "metrics", "warning"]
    assert [e.event for e in rest] == ["metrics", "evaluation", "state"]
    last = json.loads(rest[-1].data)
    assert (last["state"], last["reason"], last["id"]) == (CANCELLED, "cancelled by the user", rest[-1].id)

    # the job has ended: a reconnect after its last event gets nothing and the stream ends
    async with aconnect_sse(
        client, "GET", events_url(job_id), headers={"Last-Event-ID": rest[-1].id}
    ) as source:
        assert await read_to_end(source.aiter_sse()) == []


async def test_an_idle_stream_sends_heartbeats(client: httpx.AsyncClient) -> None:
    job_id = await submit(client)
    async with client.stream("GET", events_url(job_id)) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        async with asyncio.timeout(5):  # the heartbeat is 1 s here
            async for line in response.aiter_lines():
                if line.startswith(":"):
                    break


async def test_refusals(client: httpx.AsyncClient, api: ApiProcess) -> None:
    job_id = await submit(client)
    assert (await client.get(events_url("nope-00000000"))).status_code == 404
    bad = await client.get(events_url(job_id), headers={"Last-Event-ID": "$"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["header", "last-event-id"]
    async with httpx.AsyncClient(base_url=api.url, timeout=10) as anonymous:
        assert (await anonymous.get(events_url(job_id))).status_code == 401


async def test_verst_watch_follows_the_job_until_it_ends(
    client: httpx.AsyncClient,
    api: ApiProcess,
    bus: Bus,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("VERST_API_TOKEN", TOKEN)
    store = JobStore(bus.redis)
    job_id = await submit(client, steps=3)
    assert await store.set_state(job_id, RUNNING)
    await step(store, job_id, 1)

    thread, outcome = run_cli(["watch", job_id, "--api", api.url])
    await asyncio.sleep(1.0)
    assert thread.is_alive()  # the job runs on: so does the watch
    await step(store, job_id, 2, source="eval")
    await step(store, job_id, 3)
    assert await store.set_state(job_id, SUCCEEDED, "all steps done")
    assert await ended(thread), "verst watch did not end with the job"

    assert outcome["status"] == 0
    out = capsys.readouterr().out
    assert f"{job_id}: running" in out
    assert f"{job_id}: evaluation of v2: accuracy 0.500" in out and "num_prompts" not in out
    assert out.rstrip().endswith(f"{job_id}: succeeded: all steps done")


async def test_verst_watch_json_prints_each_event_once_and_fails_with_the_job(
    client: httpx.AsyncClient,
    api: ApiProcess,
    bus: Bus,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("VERST_API_TOKEN", TOKEN)
    store = JobStore(bus.redis)
    job_id = await submit(client)
    thread, outcome = run_cli(["watch", job_id, "--json", "--api", api.url])
    await step(store, job_id, 1)
    assert (await client.post(f"/v1/jobs/{job_id}/cancel")).status_code == 200
    assert await ended(thread), "verst watch did not end with the job"

    assert outcome["status"] == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    logged = [event.id for event in await store.events.read(job_id, START)]
    assert [line["id"] for line in lines] == logged
    assert (lines[-1]["kind"], lines[-1]["state"]) == ("state", CANCELLED)


async def test_verst_watch_reconnects_across_an_api_restart_and_shows_each_event_once(
    python: str, python_env: dict[str, str], redis_url: str, bus: Bus, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = {"TOKEN": TOKEN, "CHECK_SPECS": "false", "CONTROLLER": "false", "EVENTS_HEARTBEAT_S": "1"}
    store = JobStore(bus.redis)
    with serving(python, python_env, redis_url, **settings) as first:
        async with httpx.AsyncClient(base_url=first.url, headers=AUTH, timeout=10) as client:
            job_id = await submit(client, steps=4)
        assert await store.set_state(job_id, RUNNING)
        await step(store, job_id, 1)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("VERST_API_TOKEN", TOKEN)
            thread, outcome = run_cli(["watch", job_id, "--json", "--give-up-s", "60", "--api", first.url])
            await asyncio.sleep(1.5)  # the watch has the first events
    # The api is gone: the watch retries while the job goes on without it.
    await step(store, job_id, 2)
    await step(store, job_id, 3, source="eval")
    await asyncio.sleep(1.5)
    assert thread.is_alive(), "the watch gave up while the api was down"
    with serving(python, python_env, redis_url, port=first.port, **settings):
        await step(store, job_id, 4)
        assert await store.set_state(job_id, SUCCEEDED, "all steps done")
        assert await ended(thread, DEADLINE_S), "verst watch did not end with the job"

    assert outcome["status"] == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    logged = [event.id for event in await store.events.read(job_id, START)]
    assert [line["id"] for line in lines] == logged, "each event shown once, none skipped"
    assert [line["step"] for line in lines if "step" in line] == [1, 2, 3, 4]


async def test_an_open_stream_does_not_hold_up_the_api_stopping(
    python: str, python_env: dict[str, str], redis_url: str
) -> None:
    process = ApiProcess(python, python_env, redis_url, CHECK_SPECS="false", CONTROLLER="false")
    try:
        process.wait_until_serving()
        async with httpx.AsyncClient(base_url=process.url, timeout=10) as client:
            job_id = await submit(client)
            async with aconnect_sse(client, "GET", events_url(job_id)) as source:
                events = source.aiter_sse()
                assert (await take(events, 1))[0].event == "state"
                began = time.monotonic()
                code, output = await asyncio.to_thread(process.stop)
                assert code == 0, output
                assert time.monotonic() - began < 10.0
                assert await read_to_end(events) == []  # the api ended the stream
    finally:
        process.stop()
