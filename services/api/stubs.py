"""gRPC stubs of the services the controller calls (router, reward), over channels opened once."""

from __future__ import annotations

from services.common.config import JobSpec
from services.common.grpc_client import Channels
from services.common.pb import reward_pb2_grpc, router_pb2_grpc


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

    async def close(self) -> None:
        await self._channels.close()
