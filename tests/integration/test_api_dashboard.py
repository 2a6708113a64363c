"""The dashboard's page and assets are served without the token, its data only with it, and
GET /v1/cluster reports the engines of the registry and the trainers holding jobs, against a real
Redis."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from services.common.engine_registry import EngineRegistry
from services.common.pb import common_pb2
from services.common.streams import JOBS, TRAINERS_GROUP
from tests.integration.test_api_guard import TOKEN, api, bearer


async def test_the_page_and_its_assets_need_no_token_the_data_does(redis_url: str) -> None:
    async with api(redis_url, token=TOKEN) as client:
        page = await client.get("/")
        assert page.status_code == 200 and 'src="dashboard/app.js"' in page.text
        for asset in ("app.js", "chart.js", "yaml.js", "style.css"):
            reply = await client.get(f"/dashboard/{asset}")
            assert reply.status_code == 200 and reply.text, asset
        assert (await client.get("/dashboard/missing.js")).status_code == 404
        assert (await client.get("/v1/cluster")).status_code == 401
        assert (await client.get("/dashboardx")).status_code == 401  # only the folder is open


async def test_the_cluster_shows_live_engines_and_the_job_each_trainer_holds(redis_url: str) -> None:
    async with api(redis_url, token=TOKEN, engine_ttl_s=5.0) as client:
        empty = {"engines": [], "trainers": [], "services": []}
        assert (await client.get("/v1/cluster", headers=bearer())).json() == empty
        redis = aioredis.Redis.from_url(redis_url)
        try:
            registry = EngineRegistry(redis)
            info = common_pb2.EngineInfo(
                engine_id="engine-a", backend="torch", job_id="j-1", policy_version=7, running_requests=3
            )
            await registry.heartbeat(info)
            await registry.heartbeat(common_pb2.EngineInfo(engine_id="engine-old"), now=time.time() - 60)
            job = (await client.post("/v1/jobs", json={"name": "held"}, headers=bearer())).json()
            await redis.xgroup_create(JOBS, TRAINERS_GROUP, id="0", mkstream=True)
            await redis.xreadgroup(TRAINERS_GROUP, "trainer-1", {JOBS: ">"}, count=1)  # claims the job
            await redis.xgroup_createconsumer(JOBS, TRAINERS_GROUP, "trainer-2")  # waiting, holds none
            cluster = (await client.get("/v1/cluster", headers=bearer())).json()
        finally:
            await redis.aclose()
    [engine] = cluster["engines"]  # engine-old's heartbeat is older than the ttl
    assert engine["engine_id"] == "engine-a" and engine["policy_version"] == 7
    assert engine["running_requests"] == 3 and engine["state"] == "ENGINE_STATE_UNSPECIFIED"
    holding, idle = cluster["trainers"]
    assert holding["trainer_id"] == "trainer-1" and holding["job_id"] == job["job_id"]
    assert holding["state"] == "JOB_STATE_QUEUED" and holding["policy_version"] == 0
    assert idle == {"trainer_id": "trainer-2", "idle_s": idle["idle_s"], "job_id": ""}
