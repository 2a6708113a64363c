"""The reward's gRPC server: ``verst.v1.Reward`` (Score, ScoreBatch) over a verifier registry
and user plugins, and ``verst.v1.Tools`` (``tools.py``) in the same process.

A request's ``verifier`` names a registered verifier (``verifiers.py``), or a user plugin
as ``module:function`` (``plugins.py``); empty means ``default_verifier``.

Scoring failures are data, not transport errors: an unknown verifier or plugin, one
that raises, returns something malformed, or overruns its deadline gives a
``ScoreResponse`` with reward 0 and ``error`` set, while the call itself succeeds, so
one bad item never sinks its batch and the runner can record the failure on the
trajectory. The deadline of an item is ``score_timeout_s``, or less when the call's own
gRPC deadline comes sooner (so the answer arrives while the caller still waits).

Verifiers and sync plugins run on a thread pool (they are plain functions and may be
slow or blocking). Python cannot interrupt a thread, so one past its deadline keeps its
worker until it returns; the caller has its answer by then. The ``math`` and ``code``
verifiers bound their own work in processes they can kill.
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
from services.reward.plugins import PluginError, PluginResultError, Plugins, is_plugin
from services.reward.verifiers import Verifier, VerifierOptions, VerifierResult, builtin_verifiers

log = logging.getLogger(__name__)

SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name
"""``"verst.v1.Reward"``, as health checks and reflection name it."""
DEADLINE_MARGIN_S = 0.05
"""Time kept from a call's gRPC deadline to send the answers back."""


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


def verifier_options(settings: RewardSettings) -> VerifierOptions:
    """The configurable verifiers' options from the service's settings."""
    return VerifierOptions(
        numeric_rel_tol=settings.numeric_rel_tol,
        numeric_abs_tol=settings.numeric_abs_tol,
        math_workers=settings.math_workers,
        math_timeout_s=settings.math_timeout_s,
        code_test_timeout_s=settings.code_test_timeout_s,
        code_timeout_s=settings.code_timeout_s,
        sandbox=tools.sandbox_config(settings),
    )


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """Scores responses with the verifier or plugin each request names (or the default one).

    ``verifiers`` defaults to the built-in registry configured by ``settings``.
    """

    def __init__(self, settings: RewardSettings, verifiers: Mapping[str, Verifier] | None = None) -> None:
        if verifiers is None:
            verifiers = builtin_verifiers(verifier_options(settings))
        if settings.default_verifier not in verifiers and not is_plugin(settings.default_verifier):
            raise ValueError(f"default verifier {settings.default_verifier!r} is not registered")
        self._verifiers = dict(verifiers)
        self._default = settings.default_verifier
        self._timeout_s = settings.score_timeout_s
        self._executor = ThreadPoolExecutor(settings.score_workers, thread_name_prefix="verifier")
        self._plugins = Plugins(
            self._executor, enabled=settings.plugins_enabled, modules=settings.plugin_modules
        )

    async def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        return await self.score(request, self._deadline_s(context))

    async def ScoreBatch(
        self, request: reward_pb2.ScoreBatchRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreBatchResponse:
        timeout_s = self._deadline_s(context)
        # gather keeps the request's order whatever order the items finish in.
        results = await asyncio.gather(*(self.score(item, timeout_s) for item in request.items))
        return reward_pb2.ScoreBatchResponse(results=results)

    async def CheckVerifier(
        self, request: reward_pb2.CheckVerifierRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.CheckVerifierResponse:
        """Whether the name would score here: registered, or a plugin that is allowed and imports."""
        return await self.check(request.verifier, self._deadline_s(context))

    async def check(self, name: str, timeout_s: float | None = None) -> reward_pb2.CheckVerifierResponse:
        """CheckVerifier's answer for ``name`` (empty: the default), within ``timeout_s``."""
        name = name or self._default
        known = sorted(self._verifiers)
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        error = ""
        if is_plugin(name):
            try:
                await asyncio.wait_for(self._plugins.load(name), timeout_s)
            except PluginError as err:
                error = f"plugin {name!r} cannot be used: {err}"
            except TimeoutError:
                error = f"plugin {name!r} did not import within {timeout_s:.3g}s"
        elif name not in self._verifiers:
            listed = ", ".join(known)
            error = f"unknown verifier {name!r}; known verifiers: {listed}, or a plugin as module:function"
        return reward_pb2.CheckVerifierResponse(ok=not error, error=error, verifiers=known)

    def _deadline_s(self, context: grpc.aio.ServicerContext) -> float:
        """``score_timeout_s``, or what is left of the call's deadline when that is less."""
        remaining = context.time_remaining()
        if remaining is None:
            return self._timeout_s
        return max(min(self._timeout_s, remaining - DEADLINE_MARGIN_S), 0.001)

    async def score(
        self, request: reward_pb2.ScoreRequest, timeout_s: float | None = None
    ) -> reward_pb2.ScoreResponse:
        """Score one request within ``timeout_s`` (default ``score_timeout_s``); every failure
        becomes a response with ``error`` set."""
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        name = request.verifier or self._default
        plugin = is_plugin(name)
        what = f"plugin {name!r}" if plugin else f"verifier {name!r}"
        try:
            if plugin:
                result = await self._plugins.score(name, request, timeout_s)
            else:
                result = await self._verify(name, request, timeout_s)
            return to_response(result)
        except UnknownVerifierError as err:
            message = str(err)
        except TimeoutError as err:  # the item's deadline, or a verifier's own (which says more)
            message = (
                f"{what} timed out: {err}" if str(err) else f"{what} did not finish within {timeout_s:.3g}s"
            )
        except (VerifierOutputError, PluginResultError) as err:
            message = f"{what} returned a malformed result: {err}"
        except PluginError as err:
            message = f"{what} cannot be used: {err}"
        except Exception as err:  # a verifier's bug must not fail the call or the batch
            message = f"{what} failed: {type(err).__name__}: {err}"
        log.warning("trajectory %r: %s", request.trajectory_id, message)
        return error_response(message)

    async def _verify(self, name: str, request: reward_pb2.ScoreRequest, timeout_s: float) -> VerifierResult:
        verifier = self._verifiers.get(name)
        if verifier is None:
            known = ", ".join(sorted(self._verifiers))
            raise UnknownVerifierError(
                f"unknown verifier {name!r}; known verifiers: {known}, or a plugin as module:function"
            )
        loop = asyncio.get_running_loop()
        call = loop.run_in_executor(
            self._executor, verifier, request.response_text, request.answer, dict(request.metadata)
        )
        return await asyncio.wait_for(call, timeout=timeout_s)


class UnknownVerifierError(LookupError):
    """A request named a verifier that is not registered."""


def register(server: grpc.aio.Server, settings: RewardSettings | None = None) -> list[str]:
    """Add the Reward servicer, and the Tools one unless ``tools_enabled`` is off, to ``server``;
    returns their service names for health checks.

    ``settings`` defaults to the environment's (VERST_REWARD_*).
    """
    settings = settings if settings is not None else load_settings(RewardSettings)
    reward_pb2_grpc.add_RewardServicer_to_server(RewardServicer(settings), server)
    return [SERVICE_NAME, *(tools.register(server, settings) if settings.tools_enabled else [])]
