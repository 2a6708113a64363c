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
worker until it returns; the caller has its answer by then. A batch's items for a quick
verifier (a trait of the registry's entries: microseconds of pure Python) run one after
another in one pool job, whose deadline is the batch's: at the deadline the items done keep
their scores, the one running times out, and those not started are scored one by one. The
``math`` and ``code`` verifiers bound their own work in processes they can kill.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common.grpc_server import run
from services.common.metrics_http import serving_service_metrics
from services.common.pb import reward_pb2, reward_pb2_grpc
from services.common.settings import load_settings, setup_logging
from services.reward import tools
from services.reward.config import RewardSettings
from services.reward.plugins import PluginError, PluginResultError, Plugins, is_plugin
from services.reward.sandbox import check_isolation
from services.reward.telemetry import UNKNOWN, RewardMetrics
from services.reward.verifiers import (
    Verifier,
    VerifierOptions,
    VerifierResult,
    builtin_verifiers,
    quick_verifiers,
)

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
        response = reward_pb2.ScoreResponse(reward=float(reward))
        # item by item: a protobuf map's update (and a constructor given a dict) goes through
        # MutableMapping's generic Python code, 3x slower for a verifier's few components
        response_components, response_info = response.components, response.info
        for name, value in components.items():
            response_components[str(name)] = float(value)
        for name, text in info.items():
            response_info[str(name)] = str(text)
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

    ``verifiers`` defaults to the built-in registry configured by ``settings``; ``quick`` names
    those whose checks take microseconds (by default the registry's ``quick`` ones).
    """

    def __init__(
        self,
        settings: RewardSettings,
        verifiers: Mapping[str, Verifier] | None = None,
        quick: frozenset[str] | None = None,
        metrics: RewardMetrics | None = None,
    ) -> None:
        if verifiers is None:
            verifiers = builtin_verifiers(verifier_options(settings))
        self._quick = quick_verifiers() if quick is None else quick
        if settings.default_verifier not in verifiers and not is_plugin(settings.default_verifier):
            raise ValueError(f"default verifier {settings.default_verifier!r} is not registered")
        self._verifiers = dict(verifiers)
        self._default = settings.default_verifier
        self._timeout_s = settings.score_timeout_s
        self.metrics = metrics or RewardMetrics()
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
        items = list(request.items)
        results: list[reward_pb2.ScoreResponse | None] = [None] * len(items)
        together = [i for i, item in enumerate(items) if (item.verifier or self._default) in self._quick]
        if len(together) > 1:
            await self._score_together(items, together, results, self._deadline_s(context))
        rest = [i for i, result in enumerate(results) if result is None]
        timeout_s = self._deadline_s(context)
        # gather keeps the request's order whatever order the items finish in.
        scored = await asyncio.gather(*(self.score(items[i], timeout_s) for i in rest))
        for i, result in zip(rest, scored, strict=True):
            results[i] = result
        return reward_pb2.ScoreBatchResponse(results=results)

    async def _score_together(
        self,
        items: list[reward_pb2.ScoreRequest],
        indices: list[int],
        results: list[reward_pb2.ScoreResponse | None],
        timeout_s: float,
    ) -> None:
        """Score these items (of quick verifiers) one after another in one pool job within
        ``timeout_s``: the items done fill ``results``, the one running at the deadline gets a
        timeout, and those not started are left None."""
        outcomes: list[tuple[VerifierResult | Exception, float]] = []
        stop = threading.Event()
        started = time.perf_counter()

        def run() -> None:
            for i in indices:
                if stop.is_set():
                    return
                item = items[i]
                verifier = self._verifiers[item.verifier or self._default]
                began = time.perf_counter()
                try:
                    outcome = verifier(item.response_text, item.answer, dict(item.metadata))
                except Exception as err:  # the item's failure, not the batch's
                    outcome = err
                outcomes.append((outcome, time.perf_counter() - began))

        job = asyncio.get_running_loop().run_in_executor(self._executor, run)
        timed_out = False
        try:
            await asyncio.wait_for(job, timeout_s)
        except TimeoutError:
            stop.set()
            timed_out = True
        done = list(outcomes)  # the job may still append the item it was running
        for i, (outcome, seconds) in zip(indices, done, strict=False):
            results[i] = self._response(items[i], outcome, timeout_s, seconds)
        if timed_out and len(done) < len(indices):
            running_s = time.perf_counter() - started - sum(seconds for _, seconds in done)
            late = items[indices[len(done)]]
            results[indices[len(done)]] = self._response(late, TimeoutError(), timeout_s, running_s)

    def _response(
        self,
        request: reward_pb2.ScoreRequest,
        outcome: VerifierResult | Exception,
        timeout_s: float,
        seconds: float,
    ) -> reward_pb2.ScoreResponse:
        """The response for a verifier's result, or for its failure (logged); either is counted,
        with the ``seconds`` it took."""
        name = request.verifier or self._default
        what = f"plugin {name!r}" if is_plugin(name) else f"verifier {name!r}"
        label = name if name in self._verifiers or is_plugin(name) else UNKNOWN
        if not isinstance(outcome, Exception):
            try:
                response = to_response(outcome)
            except VerifierOutputError as err:
                outcome = err
            else:
                self.metrics.scored(label, seconds, None)
                return response
        self.metrics.scored(label, seconds, outcome)
        message = failure_message(what, outcome, timeout_s)
        log.warning("trajectory %r: %s", request.trajectory_id, message)
        return error_response(message)

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
        text_only = not error and not is_plugin(name)  # registered verifiers never see token ids
        return reward_pb2.CheckVerifierResponse(
            ok=not error, error=error, verifiers=known, text_only=text_only
        )

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
        started = time.perf_counter()
        try:
            if is_plugin(name):
                result = await self._plugins.score(name, request, timeout_s)
            else:
                result = await self._verify(name, request, timeout_s)
        except Exception as err:  # a verifier's bug must not fail the call or the batch
            return self._response(request, err, timeout_s, time.perf_counter() - started)
        return self._response(request, result, timeout_s, time.perf_counter() - started)

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


def failure_message(what: str, err: Exception, timeout_s: float) -> str:
    """Why ``what`` (a verifier or plugin, named) gave no score, as the response's ``error``."""
    if isinstance(err, UnknownVerifierError):
        return str(err)
    if isinstance(err, TimeoutError):  # the item's deadline, or a verifier's own (which says more)
        return f"{what} timed out: {err}" if str(err) else f"{what} did not finish within {timeout_s:.3g}s"
    if isinstance(err, (VerifierOutputError, PluginResultError)):
        return f"{what} returned a malformed result: {err}"
    if isinstance(err, PluginError):
        return f"{what} cannot be used: {err}"
    return f"{what} failed: {type(err).__name__}: {err}"


def register(
    server: grpc.aio.Server, settings: RewardSettings | None = None, metrics: RewardMetrics | None = None
) -> list[str]:
    """Add the Reward servicer, and the Tools one unless ``tools_enabled`` is off, to ``server``;
    returns their service names for health checks.

    ``settings`` defaults to the environment's (VERST_REWARD_*); ``metrics``: where the
    servicer counts its items (a registry of its own when None).
    """
    settings = settings if settings is not None else load_settings(RewardSettings)
    reward_pb2_grpc.add_RewardServicer_to_server(RewardServicer(settings, metrics=metrics), server)
    check_isolation(tools.sandbox_config(settings))  # logs whether python code can run here, and how
    return [SERVICE_NAME, *(tools.register(server, settings) if settings.tools_enabled else [])]


def main() -> None:
    """``python -m services.reward``: settings from the environment, /metrics, then serve."""
    settings = load_settings(RewardSettings)
    setup_logging(settings.service_name, settings.log_level)
    metrics = RewardMetrics()
    with serving_service_metrics(metrics.registry, settings):
        run(settings, lambda server: register(server, settings, metrics), registry=metrics.registry)
