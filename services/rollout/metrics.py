"""Prometheus metrics of one rollout engine, and the HTTP server that exposes them.

Generated tokens are counted as the backend samples them when it can say so (a
``TokenCountingEngine``: the torch engine, once per decode step), so the counter and the rate move
during long generations; a backend that learns of tokens only with a finished sample (SGLang's
``/generate`` answers whole samples) has them counted where the servicer hands that sample to its
caller. Completions are counted there, and weight loads where they finish, so the torch and the
SGLang backends report the same series. Load and
queue gauges are read from the engine's ``status()`` at scrape time, never cached.
Each engine has a registry of its own, so tests can run several in one process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.pb import common_pb2
from services.rollout.engine_protocol import EngineStatus, TokenCountingEngine
from services.rollout.watcher import LoadReport
from services.rollout.weights import CheckpointError

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0
"""The tokens/s gauge averages over this many recent seconds."""
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SYNC_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Longest wait for the HTTP server's thread to end at shutdown."""


def finish_reason_label(reason: int) -> str:
    """FINISH_REASON_LENGTH -> "length" (an unknown number keeps its value)."""
    try:
        return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
    except ValueError:
        return str(reason)


class TokenRate:
    """Tokens per second over the last ``window_s`` seconds (thread-safe: the scrape runs on
    the HTTP server's thread)."""

    def __init__(self, window_s: float = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, int]] = deque()
        self._sum = 0
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        with self._lock:
            now = self._clock()
            self._events.append((now, tokens))
            self._sum += tokens
            self._trim(now)

    def per_second(self) -> float:
        with self._lock:
            self._trim(self._clock())
            return self._sum / self.window_s

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self.window_s:
            self._sum -= self._events.popleft()[1]


LIVE_GAUGES = {
    "verst_engine_tokens_per_second": f"Generated tokens per second over the last {RATE_WINDOW_S:g} s.",
    "verst_engine_running_requests": "Requests being decoded now.",
    "verst_engine_queued_requests": "Requests waiting for a batch slot.",
    "verst_engine_outstanding_tokens": "Tokens still to generate for running and queued requests, at most.",
    "verst_engine_policy_version": "Policy version of the weights served now (-1 before the first load).",
}
"""Gauges computed at scrape time, by name, with their help text."""


class _LiveCollector(Collector):
    """The LIVE_GAUGES: the engine's status and the recent token rate, read at each scrape."""

    def __init__(self, status: Callable[[], EngineStatus], rate: TokenRate) -> None:
        self.status = status
        self.rate = rate

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(name, help_text) for name, help_text in LIVE_GAUGES.items()]

    def collect(self) -> Iterable[Metric]:
        status = self.status()
        values = {
            "verst_engine_tokens_per_second": self.rate.per_second(),
            "verst_engine_running_requests": status.running_requests,
            "verst_engine_queued_requests": status.queued_requests,
            "verst_engine_outstanding_tokens": status.outstanding_tokens,
            "verst_engine_policy_version": status.policy_version,
        }
        return [GaugeMetricFamily(name, text, value=values[name]) for name, text in LIVE_GAUGES.items()]


class EngineMetrics:
    """The engine's Prometheus series, in a registry of its own."""

    def __init__(self, status: Callable[[], EngineStatus], rate: TokenRate | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.rate = rate or TokenRate()
        self.registry.register(_LiveCollector(status, self.rate))
        self.generated_tokens = Counter(
            "verst_engine_generated_tokens", "Tokens generated, over all samples.", registry=self.registry
        )
        self.completions = Counter(
            "verst_engine_completions",
            "Finished samples by finish reason (a request with n samples counts n).",
            ["finish_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "verst_engine_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.weight_sync_latency = Histogram(
            "verst_engine_weight_sync_latency_seconds",
            "From a checkpoint handle's created_at (the trainer published it) to this engine serving it.",
            buckets=SYNC_BUCKETS,
            registry=self.registry,
        )
        self.last_weight_sync_latency = Gauge(
            "verst_engine_last_weight_sync_latency_seconds",
            "Weight sync latency of the newest load.",
            registry=self.registry,
        )
        self.weight_loads = Counter(
            "verst_engine_weight_loads",
            "Checkpoint loads by outcome: ok, refused (bad checkpoint), timeout, failed.",
            ["outcome"],
            registry=self.registry,
        )
        self.weight_transport_loads = Counter(
            "verst_engine_weight_transport_loads",
            "Weights served, by how they came: filesystem (the handle's files) or distributed (a group).",
            ["transport"],
            registry=self.registry,
        )
        self.weight_transport_fallbacks = Counter(
            "verst_engine_weight_transport_fallbacks",
            "Handles offered over a weight group but served from their files (timeout, mismatch, ...).",
            registry=self.registry,
        )
        self.counts_at_completion = True
        """Whether a sample's tokens are counted when it finishes (False: as they are sampled)."""

    def follow_sampling(self, engine: object) -> None:
        """Count ``engine``'s tokens as it samples them, when it can report them so."""
        if isinstance(engine, TokenCountingEngine):
            engine.count_tokens(self.sampled)
            self.counts_at_completion = False

    def sampled(self, tokens: int) -> None:
        """``tokens`` new tokens were sampled (any thread: the counter and the rate are thread-safe)."""
        self.generated_tokens.inc(tokens)
        self.rate.add(tokens)

    def completed(self, tokens: int, finish_reason: int) -> None:
        """One sample was handed to its caller (or dropped because the caller left); its tokens
        count now unless they were counted as they were sampled."""
        if self.counts_at_completion:
            self.sampled(tokens)
        self.completions.labels(finish_reason=finish_reason_label(finish_reason)).inc()

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(max(0.0, seconds))

    async def observe_load(self, loading: Awaitable[LoadReport]) -> LoadReport:
        """Await a weight load and record its outcome and its handle-to-serving latency."""
        try:
            report = await loading
        except CheckpointError:
            self.weight_loads.labels(outcome="refused").inc()
            raise
        except TimeoutError:
            self.weight_loads.labels(outcome="timeout").inc()
            raise
        except Exception:
            self.weight_loads.labels(outcome="failed").inc()
            raise
        self.weight_loads.labels(outcome="ok").inc()
        self.weight_transport_loads.labels(transport=report.transport).inc()
        if report.fallback:
            self.weight_transport_fallbacks.inc()
        if report.latency_s is not None:
            # Below 0 only when the trainer's clock is ahead of ours; a histogram's sum must not fall.
            latency = max(0.0, report.latency_s)
            self.weight_sync_latency.observe(latency)
            self.last_weight_sync_latency.set(latency)
        return report
