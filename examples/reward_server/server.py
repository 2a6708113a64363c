"""A reward server of one's own, in place of verst's: partial credit for the addition task.

Anything that serves ``verst.v1.Reward`` (``proto/verst/v1/reward.proto``) can score a
job's samples: point the JobSpec's ``reward.address`` at it and the runner and the
evaluations call it instead of verst's reward service. Nothing else changes. This server is
written as a third party would write it: the generated stubs (``services.common.pb``),
grpcio and its health service, nothing else of verst.

Its rule differs from verst's ``addition`` verifier (1 for the exact answer, else 0): a
response earns the fraction of the answer's digits it has right, position by position from
the first written digit (verst's addition answers are written least significant digit
first, so these are the low digits, the ones carries reach last), less ``LENGTH_PENALTY``
per character of length difference, floored at 0. Components: ``digits_right``,
``length_penalty`` and ``exact``.

Run it with ``python -m examples.reward_server --port 50060`` (or
``python examples/reward_server/server.py --port 50060``) and submit
``examples/addition_partial_credit.yaml``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.pb import reward_pb2, reward_pb2_grpc

log = logging.getLogger("reward_server")

SERVICE_NAME = "verst.v1.Reward"
LENGTH_PENALTY = 0.1
"""Reward taken off per character the response is longer or shorter than the answer."""
SHUTDOWN_GRACE_S = 5.0
"""How long calls in flight may take to finish after SIGTERM."""


def partial_credit(response_text: str, answer: str) -> reward_pb2.ScoreResponse:
    """Digits right position by position, less a length penalty; an empty answer is an error."""
    answer = answer.strip()
    if not answer:
        return reward_pb2.ScoreResponse(error="the request has no reference answer")
    got = response_text.strip()
    right = sum(1 for mine, theirs in zip(got, answer, strict=False) if mine == theirs)
    digits = right / len(answer)
    penalty = LENGTH_PENALTY * abs(len(got) - len(answer))
    return reward_pb2.ScoreResponse(
        reward=max(0.0, digits - penalty),
        components={"digits_right": digits, "length_penalty": penalty, "exact": float(got == answer)},
        info={"scorer": "partial_credit", "parsed": got},
    )


class PartialCreditReward(reward_pb2_grpc.RewardServicer):
    """verst.v1.Reward with the partial-credit rule; ``calls`` counts the items scored."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        return self._score(request)

    def ScoreBatch(
        self, request: reward_pb2.ScoreBatchRequest, context: grpc.ServicerContext
    ) -> reward_pb2.ScoreBatchResponse:
        return reward_pb2.ScoreBatchResponse(results=[self._score(item) for item in request.items])

    def _score(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        with self._lock:
            self.calls += 1
        return partial_credit(request.response_text, request.answer)


def serve(host: str, port: int) -> tuple[grpc.Server, health.HealthServicer, int]:
    """A started server with the Reward and health services; returns it and its bound port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    reward_pb2_grpc.add_RewardServicer_to_server(PartialCreditReward(), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, bound


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument("--port", type=int, default=50060, help="port to listen on; 0 picks a free one")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reward_server %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server, health_servicer, port = serve(args.host, args.port)
    log.info("serving verst.v1.Reward (partial credit) on %s:%d", args.host, port)
    while not stop.wait(1.0):  # a signal sets it
        pass
    health_servicer.enter_graceful_shutdown()
    server.stop(SHUTDOWN_GRACE_S).wait(SHUTDOWN_GRACE_S + 1)
    log.info("stopped")


if __name__ == "__main__":
    main()
