"""Publishing finished groups: the trajectories of the groups that finish together go out in one
Redis round trip, and then their tasks are acked in one more.

A task is acked only once every one of its trajectories is written (ack after the work is
durable); a group whose publish failed raises for its caller alone and its task stays pending,
to be retried after it is reclaimed. The batching is a ``Coalescer`` (batching.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from services.common.bus import Bus, Delivery
from services.common.pb import common_pb2
from services.runner.batching import Coalescer, Outcome

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FinishedGroup:
    """A task's trajectories, the stream they go to, and the task's delivery to ack after."""

    stream: str
    trajectories: list[common_pb2.Trajectory]
    delivery: Delivery[common_pb2.PromptTask]


class GroupPublisher:
    """Publishes finished groups in batches and acks their tasks (consumer group ``group``)."""

    def __init__(
        self,
        bus: Bus,
        group: str,
        *,
        window_s: float,
        max_calls: int,
        observe: Callable[[int], None] | None = None,
    ) -> None:
        self.bus = bus
        self.group = group
        self._calls = Coalescer[FinishedGroup, None](
            self._send, window_s=window_s, max_calls=max_calls, name="trajectory publish", observe=observe
        )

    async def publish_and_ack(
        self,
        stream: str,
        trajectories: list[common_pb2.Trajectory],
        delivery: Delivery[common_pb2.PromptTask],
    ) -> None:
        """Publish ``trajectories`` on ``stream``, then ack ``delivery``; raises when either
        failed (the delivery is then left pending unless its trajectories were written and only
        the ack failed: a retry publishes them again, and the trainer keeps one per id)."""
        await self._calls.call(FinishedGroup(stream, trajectories, delivery), None)

    async def _send(self, groups: list[FinishedGroup], timeouts: list[float | None]) -> list[Outcome[None]]:
        try:
            published = await self.bus.publish_groups([(g.stream, g.trajectories) for g in groups])
        except Exception as err:  # the round trip failed: nothing is acked
            return [err] * len(groups)
        done = [g for g, outcome in zip(groups, published, strict=True) if not isinstance(outcome, Exception)]
        try:
            await self.bus.ack_many(self.group, [(g.delivery.stream, g.delivery.entry_id) for g in done])
        except Exception as err:
            return [outcome if isinstance(outcome, Exception) else err for outcome in published]
        return [outcome if isinstance(outcome, Exception) else None for outcome in published]

    async def close(self) -> None:
        await self._calls.close()
