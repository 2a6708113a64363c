"""The reward's gRPC server: ``verst.v1.Reward`` (Score, ScoreBatch) over a verifier registry,
and ``verst.v1.Tools`` (``tools.py``) in the same process.

Scoring failures are data, not transport errors: an unknown verifier, a
verifier that raises, returns something malformed, or overruns
``score_timeout_s`` gives a ``ScoreResponse`` with reward 0 and ``error`` set,
while the call itself succeeds, so one bad item never sinks its batch and the
runner can record the failure on the trajectory.

Verifiers run on a thread pool (they are plain functions and may be slow or
blocking). Python cannot interrupt a thread, so a verifier past its deadline
keeps its worker until it returns; the caller has its answer by then.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common.pb import reward_pb2, reward_pb2_grpc
from services.common.settings import load_settings
from services.reward import tools
from services.reward.config import RewardSettings
from services.reward.verifiers import VERIFIERS, Verifier, VerifierResult

log = logging.getLogger(__name__)

SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name
"""``"verst.v1.Reward"``, as health checks and reflection name it."""


class VerifierOutputError(ValueError):
    """A verifier returned something other than (finite reward, {name: number}, {name: str})."""


def to_response(result: VerifierResult) -> reward_pb2.ScoreResponse:
    """The ScoreResponse of a verifier's result; raises VerifierOutputError when it is malformed."""
    try:
        reward, components, info = result
        response = reward_pb2.ScoreResponse(
            reward=float(reward),
            components={str(k): float(v) for k, v in components.items()},
            info={str(k): str(v) for k, v in info.items()},
        )
    except (TypeError, ValueError, AttributeError) as err:
        raise VerifierOutputError(
            f"expected (reward, components, info), got {result!r:.200}: {err}"
        ) from None
    if not math.isfinite(response.reward):
        raise VerifierOutputError(f"reward is {response.reward}, not a finite number")
    return response


def error_response(message: str) -> reward_pb2.ScoreResponse:
    return reward_pb2.ScoreResponse(reward=0.0, error=message)


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """Scores responses with the verifier each request names (or the default one)."""

    def __init__(self, settings: RewardSettings, verifiers: Mapping[str, Verifier] = VERIFIERS) -> None:
        if settings.default_verifier not in verifiers:
            raise ValueError(f"default verifier {settings.default_verifier!r} is not registered")
        self._verifiers = dict(verifiers)
        self._default = settings.default_verifier
        self._timeout_s = settings.score_timeout_s
        self._executor = ThreadPoolExecutor(settings.score_workers, thread_name_prefix="verifier")

    async def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        return await self.score(request)

    async def ScoreBatch(
        self, request: reward_pb2.ScoreBatchRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreBatchResponse:
        # gather keeps the request's order whatever order the items finish in.
        results = await asyncio.gather(*(self.score(item) for item in request.items))
        return reward_pb2.ScoreBatchResponse(results=results)

    async def score(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        """Score one request; every failure becomes a response with ``error`` set."""
        name = request.verifier or self._default
        verifier = self._verifiers.get(name)
        if verifier is None:
            known = ", ".join(sorted(self._verifiers))
            return error_response(f"unknown verifier {name!r}; known verifiers: {known}")
        loop = asyncio.get_running_loop()
        call = loop.run_in_executor(
            self._executor, verifier, request.response_text, request.answer, dict(request.metadata)
        )
        try:
            result = await asyncio.wait_for(call, timeout=self._timeout_s)
            return to_response(result)
        except TimeoutError:
            message = f"verifier {name!r} did not finish within {self._timeout_s:g}s"
        except VerifierOutputError as err:
            message = f"verifier {name!r} returned a malformed result: {err}"
        except Exception as err:  # a verifier's bug must not fail the call or the batch
            message = f"verifier {name!r} failed: {type(err).__name__}: {err}"
        log.warning("trajectory %r: %s", request.trajectory_id, message)
        return error_response(message)


def register(server: grpc.aio.Server, settings: RewardSettings | None = None) -> list[str]:
    """Add the Reward servicer, and the Tools one unless ``tools_enabled`` is off, to ``server``;
    returns their service names for health checks.

    ``settings`` defaults to the environment's (VERST_REWARD_*).
    """
    settings = settings if settings is not None else load_settings(RewardSettings)
    reward_pb2_grpc.add_RewardServicer_to_server(RewardServicer(settings), server)
    return [SERVICE_NAME, *(tools.register(server, settings) if settings.tools_enabled else [])]
