"""The router's local view of the engines: channels, load counts, affinity, drains, failures."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import grpc

from services.common import grpc_client
from services.common.engine_registry import EngineRegistry
from services.common.pb import common_pb2, rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

AFFINITY_CAPACITY = 65_536
"""Sessions remembered for affinity; the least recently used are forgotten first."""
GENERATE_BATCH = f"/{rollout_pb2.DESCRIPTOR.services_by_name['Rollout'].full_name}/GenerateBatch"
"""The path of the engines' GenerateBatch (``verst.v1.Rollout``)."""
LOAD = attrgetter("outstanding", "last_used", "engine_id")
"""The order of engines for a request with no affinity: least loaded, then least recently used."""


@dataclass(eq=False)
class EngineLink:
    """One engine as the router sees it."""

    info: common_pb2.EngineInfo
    channel: grpc.aio.Channel
    stub: rollout_pb2_grpc.RolloutStub
    outstanding: int = 0
    """Samples in flight through this router (the load measure)."""
    last_used: int = 0
    """When this engine last got a request (a pool-wide count): ties go to the least recent."""
    retired: bool = False
    """Gone from the view; its channel closes when its last call ends."""
    engine_id: str = field(init=False)
    """The info's, which never changes for a link (a plain attribute: every pick reads it)."""
    generate_batch_wire: Any = field(init=False, default=None)
    """The engine's GenerateBatch, its reply as the bytes it came as (the router passes them on)."""

    def __post_init__(self) -> None:
        self.engine_id = self.info.engine_id
        if self.channel is not None:
            self.generate_batch_wire = self.channel.unary_unary(
                GENERATE_BATCH,
                request_serializer=rollout_pb2.GenerateBatchRequest.SerializeToString,
                response_deserializer=None,  # the bytes as they are
            )

    @property
    def address(self) -> str:
        return self.info.address


@dataclass(frozen=True, slots=True)
class Choices:
    """Where a request may go: its eligible engines by id, and those of them that are ready."""

    every: dict[str, EngineLink]
    ready: list[EngineLink]


def _heartbeat(info: common_pb2.EngineInfo) -> float:
    return info.last_heartbeat.ToNanoseconds() / 1e9


class EnginePool:
    """Live engines from the registry, minus those that failed us since their last heartbeat."""

    def __init__(self, registry: EngineRegistry, ttl_s: float) -> None:
        self.registry = registry
        self.ttl_s = ttl_s
        self._links: dict[str, EngineLink] = {}
        self._failed: dict[str, float] = {}
        """engine id -> when (unix s) a call to it failed: readmitted only on a later heartbeat."""
        self._drained: set[str] = set()
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._uses = 0
        self._choices: dict[str, Choices] = {}
        """The engines a request of a job may go to, by job id: kept until the view changes
        (a refresh, a drain, a failure), so that a pick scans no more than it must."""

    async def refresh(self) -> None:
        """Bring the view in line with the registry's live engines."""
        alive = await self.registry.alive(self.ttl_s)
        seen: set[str] = set()
        for info in alive:
            failed_at = self._failed.get(info.engine_id)
            if failed_at is not None:
                if _heartbeat(info) <= failed_at:
                    continue
                del self._failed[info.engine_id]
            seen.add(info.engine_id)
            link = self._links.get(info.engine_id)
            if link is not None and link.address == info.address:
                link.info = info
                continue
            if link is not None:  # restarted elsewhere under the same id
                await self._retire(link)
            channel = grpc_client.channel(info.address)
            self._links[info.engine_id] = EngineLink(info, channel, rollout_pb2_grpc.RolloutStub(channel))
            log.info("engine %s at %s joined", info.engine_id, info.address)
        for engine_id in [e for e in self._links if e not in seen]:
            log.info("engine %s left", engine_id)
            await self._retire(self._links.pop(engine_id))
        alive_ids = {info.engine_id for info in alive}
        self._failed = {e: beat for e, beat in self._failed.items() if e in alive_ids}
        self._choices.clear()  # the engines, their states and their jobs as just read

    def pick(self, session_id: str, *, exclude: set[str], job_id: str = "") -> EngineLink | None:
        """The engine for the next attempt: among those serving ``job_id`` (if any does), the
        session's engine if it can serve, else the least loaded, preferring engines that
        report weights loaded."""
        choices = self._choices_for(job_id) if not exclude else self._eligible(exclude, job_id)
        if not choices.every:
            return None
        if session_id:
            preferred = choices.every.get(self._affinity.get(session_id, ""))
            if preferred is not None:
                return preferred
        return min(choices.ready or choices.every.values(), key=LOAD)

    def _choices_for(self, job_id: str) -> Choices:
        choices = self._choices.get(job_id)
        if choices is None:
            choices = self._choices[job_id] = self._eligible(set(), job_id)
        return choices

    def _eligible(self, exclude: set[str], job_id: str) -> Choices:
        candidates = [
            link
            for link in self._links.values()
            if link.engine_id not in exclude
            and link.engine_id not in self._drained
            and link.info.state != common_pb2.ENGINE_STATE_DRAINING
        ]
        if job_id:
            candidates = [link for link in candidates if link.info.job_id == job_id] or candidates
        ready = [link for link in candidates if link.info.state != common_pb2.ENGINE_STATE_STARTING]
        return Choices({link.engine_id: link for link in candidates}, ready)

    def acquire(self, link: EngineLink, samples: int) -> None:
        self._uses += 1
        link.outstanding += samples
        link.last_used = self._uses

    async def release(self, link: EngineLink, samples: int) -> None:
        link.outstanding -= samples
        if link.retired and link.outstanding == 0:
            await link.channel.close()

    def bind(self, session_id: str, link: EngineLink) -> None:
        """Send the session's next requests to ``link`` while it is alive."""
        if not session_id:
            return
        self._affinity[session_id] = link.engine_id
        self._affinity.move_to_end(session_id)
        while len(self._affinity) > AFFINITY_CAPACITY:
            self._affinity.popitem(last=False)

    async def mark_failed(self, link: EngineLink) -> None:
        """Drop an engine that refused a connection until it heartbeats again."""
        if self._links.get(link.engine_id) is not link:
            return
        self._failed[link.engine_id] = time.time()
        del self._links[link.engine_id]
        self._choices.clear()
        await self._retire(link)

    def set_drained(self, engine_id: str, drained: bool) -> None:
        self._choices.clear()
        if drained:
            self._drained.add(engine_id)
        else:
            self._drained.discard(engine_id)

    def is_drained(self, engine_id: str) -> bool:
        return engine_id in self._drained

    def links(self) -> list[EngineLink]:
        """Every engine in the view now, drained ones included."""
        return list(self._links.values())

    def engine_ids(self) -> list[str]:
        """Engines in the view now (for tests and logs)."""
        return sorted(self._links)

    def view(self) -> dict[str, common_pb2.EngineInfo]:
        """What the router last read about each engine in the view."""
        return {engine_id: link.info for engine_id, link in self._links.items()}

    async def _retire(self, link: EngineLink) -> None:
        link.retired = True
        if link.outstanding == 0:
            await link.channel.close()

    async def close(self) -> None:
        for link in list(self._links.values()):
            await link.channel.close()
        self._links.clear()
        self._choices.clear()
