"""The REST api against a real Redis server: submit, validate, list, get, metrics, cancel, /metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from services.api.config import ApiSettings
from services.api.server import JobList, create_app
from services.common.bus import Bus
from services.common.jobs import RUNNING, SUCCEEDED, JobStore
from services.common.pb import common_pb2
from services.common.streams import JOBS


@pytest.fixture
async def app(redis_url: str) -> AsyncIterator[FastAPI]:
    # The controller is tested on its own (test_controller.py); here the api only serves REST.
    app = create_app(
        ApiSettings.model_validate(
            # Every scrape reads the store here, so the test sees each change at once.
            {"REDIS_URL": redis_url, "controller": False, "check_specs": False, "metrics_refresh_s": 0}
        )
    )
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        yield client


async def test_submit_returns_201_with_a_queued_job(client: httpx.AsyncClient, bus: Bus) -> None:
    reply = await client.post("/v1/jobs", json={"name": "addition", "trainer": {"steps": 3}})
    assert reply.status_code == 201, reply.text
    job = reply.json()
    assert job["job_id"].startswith("addition-") and job["name"] == "addition"
    assert job["state"] == "JOB_STATE_QUEUED"
    assert job["spec"]["trainer"]["steps"] == 3 and job["spec"]["rollout"]["prompts_per_step"] == 8
    assert (job["policy_version"], job["step"], job["metrics"]) == (0, 0, {})
    await bus.ensure_group(JOBS, "trainers")
    [submission] = await bus.read(JOBS, "trainers", "t", common_pb2.JobSubmission, block_ms=100)
    assert submission.message.job_id == job["job_id"]


async def test_a_bad_spec_is_a_422_naming_each_field_path(client: httpx.AsyncClient) -> None:
    reply = await client.post(
        "/v1/jobs", json={"rollout": {"max_new_tokns": 5, "temperature": -1}, "algorithm": {"group_size": 1}}
    )
    assert reply.status_code == 422
    problems = {tuple(error["loc"]): error["msg"] for error in reply.json()["detail"]}
    assert "Extra inputs are not permitted" in problems[("body", "rollout", "max_new_tokns")]
    assert "greater than or equal to 0" in problems[("body", "rollout", "temperature")]
    assert "must be >= 2 for the 'grpo' estimator" in problems[("body", "algorithm", "group_size")]
    assert (await client.get("/v1/jobs")).json() == {"jobs": []}, "nothing was stored"


async def test_a_moved_algorithm_key_is_a_422_naming_its_new_place(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/jobs", json={"algorithm": {"gae_lambda": 0.95, "group_size": 1}})
    assert reply.status_code == 422
    problems = {tuple(error["loc"]): error["msg"] for error in reply.json()["detail"]}
    assert problems[("body", "algorithm", "gae_lambda")] == "moved: use algorithm.gae.lambda"
    assert "must be >= 2" in problems[("body", "algorithm", "group_size")]  # reported together


async def test_get_list_and_404(client: httpx.AsyncClient) -> None:
    ids = [(await client.post("/v1/jobs", json={"name": f"j{i}"})).json()["job_id"] for i in range(3)]
    listed = (await client.get("/v1/jobs")).json()["jobs"]
    assert [job["job_id"] for job in listed] == ids[::-1]
    assert [job["job_id"] for job in (await client.get("/v1/jobs", params={"limit": 1})).json()["jobs"]] == [
        ids[2]
    ]
    assert (await client.get("/v1/jobs", params={"limit": 0})).status_code == 422
    job = (await client.get(f"/v1/jobs/{ids[0]}")).json()
    assert job["job_id"] == ids[0] and job["name"] == "j0"
    assert job["submitted_at"] <= job["updated_at"]
    missing = await client.get("/v1/jobs/nope-00000000")
    assert missing.status_code == 404 and "nope-00000000" in missing.json()["detail"]
    assert (await client.get("/v1/jobs/nope-00000000/metrics")).status_code == 404
    assert (await client.post("/v1/jobs/nope-00000000/cancel")).status_code == 404


async def test_a_list_is_sent_again_only_while_unchanged(client: httpx.AsyncClient, app: FastAPI) -> None:
    """Lists are rendered once per change of their jobs (RenderedLists): every change shows at
    once, and a client holding the ETag gets a 304 while nothing changed."""
    ids = [(await client.post("/v1/jobs", json={"name": f"j{i}"})).json()["job_id"] for i in range(2)]
    first = await client.get("/v1/jobs")
    etag = first.headers["etag"]
    again = await client.get("/v1/jobs")
    assert (again.json(), again.headers["etag"]) == (first.json(), etag)
    unchanged = await client.get("/v1/jobs", headers={"If-None-Match": f'"other", {etag}'})
    assert (unchanged.status_code, unchanged.content, unchanged.headers["etag"]) == (304, b"", etag)

    await app.state.store.update_progress(ids[0], 7, 7)
    changed = await client.get("/v1/jobs", headers={"If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["etag"] != etag
    assert [job["policy_version"] for job in changed.json()["jobs"]] == [0, 7]
    await client.post(f"/v1/jobs/{ids[1]}/cancel")
    assert (await client.get("/v1/jobs")).json()["jobs"][0]["state"] == "JOB_STATE_CANCELLED"
    newest = (await client.post("/v1/jobs", json={"name": "j2"})).json()["job_id"]
    assert [job["job_id"] for job in (await client.get("/v1/jobs")).json()["jobs"]] == [newest, *ids[::-1]]
    one = await client.get("/v1/jobs", params={"limit": 1})
    assert [job["job_id"] for job in one.json()["jobs"]] == [newest] and one.headers["etag"] != etag
    assert JobList.model_validate(changed.json()).jobs[1].policy_version == 7, "the schema's shape"


async def test_metrics_history_and_latest_metrics(client: httpx.AsyncClient, app: FastAPI) -> None:
    job_id = (await client.post("/v1/jobs", json={})).json()["job_id"]
    store: JobStore = app.state.store
    await store.merge_metrics(job_id, {"accuracy": 0.3, "reward_mean": 0.4}, step=0, source="eval")
    await store.merge_metrics(job_id, {"loss": 0.5}, step=1, source="trainer", policy_version=1)
    await store.merge_metrics(job_id, {"accuracy": 0.9, "reward_mean": 0.95}, step=2, source="eval")

    job = (await client.get(f"/v1/jobs/{job_id}")).json()
    assert job["metrics"] == {"eval/accuracy": 0.9, "eval/reward_mean": 0.95, "trainer/loss": 0.5}
    history = (await client.get(f"/v1/jobs/{job_id}/metrics")).json()
    assert history["job_id"] == job_id
    assert [(p["source"], p["step"]) for p in history["points"]] == [("eval", 0), ("trainer", 1), ("eval", 2)]
    assert history["points"][1]["policy_version"] == 1
    evals = (await client.get(f"/v1/jobs/{job_id}/metrics", params={"source": "eval"})).json()["points"]
    assert [p["values"]["accuracy"] for p in evals] == [0.3, 0.9]


async def test_cancel_and_a_finished_job_cannot_be_cancelled(client: httpx.AsyncClient, app: FastAPI) -> None:
    first = (await client.post("/v1/jobs", json={})).json()["job_id"]
    cancelled = await client.post(f"/v1/jobs/{first}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["state"] == "JOB_STATE_CANCELLED" and cancelled.json()["reason"]
    again = await client.post(f"/v1/jobs/{first}/cancel")
    assert again.status_code == 409 and "JOB_STATE_CANCELLED" in again.json()["detail"]

    second = (await client.post("/v1/jobs", json={})).json()["job_id"]
    await app.state.store.set_state(second, SUCCEEDED)
    assert (await client.post(f"/v1/jobs/{second}/cancel")).status_code == 409
    assert (await client.get(f"/v1/jobs/{second}")).json()["state"] == "JOB_STATE_SUCCEEDED"


async def test_prometheus_metrics(client: httpx.AsyncClient, app: FastAPI) -> None:
    store: JobStore = app.state.store
    running = (await client.post("/v1/jobs", json={"name": "run"})).json()["job_id"]
    await client.post("/v1/jobs", json={"name": "wait"})
    await store.set_state(running, RUNNING)
    await store.update_progress(running, 4, 4)
    await store.merge_metrics(running, {"accuracy": 0.625}, step=4, source="eval")

    reply = await client.get("/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    text = reply.text
    assert 'verst_jobs{state="JOB_STATE_QUEUED"} 1.0' in text
    assert 'verst_jobs{state="JOB_STATE_RUNNING"} 1.0' in text
    assert 'verst_jobs{state="JOB_STATE_FAILED"} 0.0' in text
    assert f'verst_job_eval_accuracy{{job_id="{running}"}} 0.625' in text
    assert f'verst_job_policy_version{{job_id="{running}"}} 4.0' in text
    assert f'verst_job_metric{{job_id="{running}",name="eval/accuracy"}} 0.625' in text

    await store.set_state(running, SUCCEEDED)
    text = (await client.get("/metrics")).text
    assert 'verst_jobs{state="JOB_STATE_SUCCEEDED"} 1.0' in text
    assert running not in text, "finished jobs leave the per-job gauges"


async def test_healthz(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok", "service": "api"}
