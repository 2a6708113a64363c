"""gRPC stubs of the services the controller calls (router, reward), over channels opened once."""

from __future__ import annotations

import logging

import grpc

from services.common.config import JobSpec
from services.common.grpc_client import Channels
from services.common.pb import reward_pb2_grpc, rollout_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)


class ServiceStubs:
    """One channel per address, shared by every job driver of a controller."""

    def __init__(self, router_address: str, reward_address: str) -> None:
        self.router_address = router_address
        self.reward_address = reward_address
        """The reward service of jobs whose spec names none (reward.address)."""
        self._channels = Channels()

    def router(self) -> router_pb2_grpc.RouterStub:
        return router_pb2_grpc.RouterStub(self._channels.get(self.router_address))

    def reward(self, spec: JobSpec) -> reward_pb2_grpc.RewardStub:
        return reward_pb2_grpc.RewardStub(self._channels.get(spec.reward.address or self.reward_address))

    async def oldest_served_version(self, job_id: str) -> int | None:
        """The oldest version an engine of the job serves, by the router; None when none serves
        it (yet) or the router does not answer (logged)."""
        try:
            reply = await self.router().ListEngines(router_pb2.ListEnginesRequest(), timeout=5.0)
        except grpc.aio.AioRpcError as err:
            log.warning("%s: router ListEngines failed: %s: %s", job_id, err.code().name, err.details())
            return None
        versions = [engine.policy_version for engine in reply.engines if engine.job_id == job_id]
        return min(versions) if versions else None

    async def abort_job(self, job_id: str, timeout_s: float) -> None:
        """Ask the router to drop an ended job's requests on every engine at once; a failure is
        logged, not raised (the requests then end with their own deadlines)."""
        request = rollout_pb2.AbortJobRequest(job_id=job_id)
        try:
            reply = await self.router().AbortJob(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            log.warning("%s: router AbortJob failed: %s: %s", job_id, err.code().name, err.details())
            return
        failed = ", ".join(reply.failed_engine_ids)
        log.log(
            logging.WARNING if failed else logging.INFO,
            "%s: %d requests aborted on %d engines%s",
            *(job_id, reply.aborted, len(reply.engine_ids), f"; no answer from {failed}" if failed else ""),
        )

    async def close(self) -> None:
        await self._channels.close()
