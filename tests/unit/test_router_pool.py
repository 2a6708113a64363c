"""EnginePool.pick against a reference written from its contract, over random pools: among the
engines serving the request's job (all live ones when none does), excluding those tried, drained
or draining, the session's engine when it is one of them, else the least loaded (then least
recently used, then by id), preferring engines that are not starting. The pool keeps the
eligible engines between picks; a refresh, a drain or a failure must be seen by the next pick."""

from __future__ import annotations

import random

from services.common.pb import common_pb2
from services.router.pool import EngineLink, EnginePool

STATES = [
    common_pb2.ENGINE_STATE_SERVING,
    common_pb2.ENGINE_STATE_STARTING,
    common_pb2.ENGINE_STATE_DRAINING,
    common_pb2.ENGINE_STATE_LOADING_WEIGHTS,
]
JOBS = ["", "job-a", "job-b"]


class Registry:
    """The engine registry's ``alive`` over a list the test changes."""

    def __init__(self, infos: list[common_pb2.EngineInfo]) -> None:
        self.infos = infos

    async def alive(self, ttl_s: float) -> list[common_pb2.EngineInfo]:
        return list(self.infos)


def reference_pick(
    links: list[EngineLink],
    drained: set[str],
    affinity: dict[str, str],
    session_id: str,
    exclude: set[str],
    job_id: str,
) -> str | None:
    live = [
        link
        for link in links
        if link.info.engine_id not in exclude | drained
        and link.info.state != common_pb2.ENGINE_STATE_DRAINING
    ]
    serving = [link for link in live if link.info.job_id == job_id] if job_id else []
    candidates = serving or live
    if not candidates:
        return None
    ids = [link.info.engine_id for link in candidates]
    if session_id and affinity.get(session_id) in ids:
        return affinity[session_id]
    ready = [link for link in candidates if link.info.state != common_pb2.ENGINE_STATE_STARTING]
    best = sorted(
        ready or candidates, key=lambda link: (link.outstanding, link.last_used, link.info.engine_id)
    )
    return best[0].info.engine_id


def random_infos(rng: random.Random) -> list[common_pb2.EngineInfo]:
    return [
        common_pb2.EngineInfo(
            engine_id=f"e{i}",
            address=f"127.0.0.1:{20000 + i}",
            state=rng.choice(STATES),
            job_id=rng.choice(JOBS),
        )
        for i in range(rng.randrange(0, 9))
    ]


async def test_picks_are_the_references_while_loads_drains_states_and_engines_change() -> None:
    rng = random.Random(5)
    registry = Registry(random_infos(rng))
    pool = EnginePool(registry, ttl_s=10.0)  # type: ignore[arg-type]
    await pool.refresh()
    affinity: dict[str, str] = {}
    drained: set[str] = set()
    sessions = [f"s{i}" for i in range(6)]
    picked = 0
    for _ in range(3000):
        roll = rng.random()
        if roll < 0.03:  # engines come, go, change state or job
            registry.infos = random_infos(rng)
            await pool.refresh()
        elif roll < 0.06 and pool.engine_ids():
            engine_id = rng.choice(pool.engine_ids())
            drain = rng.random() < 0.6
            pool.set_drained(engine_id, drain)
            (drained.add if drain else drained.discard)(engine_id)
        elif roll < 0.08 and pool.links():
            await pool.mark_failed(rng.choice(pool.links()))
        links = pool.links()
        session = rng.choice(["", *sessions])
        job = rng.choice(JOBS)
        exclude = {link.engine_id for link in links if rng.random() < 0.15}
        expected = reference_pick(links, drained, affinity, session, exclude, job)
        link = pool.pick(session, exclude=exclude, job_id=job)
        assert (link.engine_id if link else None) == expected
        if link is not None:
            picked += 1
            pool.acquire(link, rng.randrange(1, 9))
            if rng.random() < 0.5:
                pool.bind(session, link)
                if session:
                    affinity[session] = link.engine_id
            if rng.random() < 0.5:
                await pool.release(link, 1)
    assert picked > 1000
    await pool.close()
