"""A ScoreBatch's items for quick verifiers run one after another in one pool job, and still
get what one Score each would give them: their own results, errors and deadlines."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from services.common.pb import reward_pb2
from services.reward.config import RewardSettings
from services.reward.server import RewardServicer
from services.reward.verifiers import VERIFIERS, VerifierResult, quick_verifiers

SEEN: list[tuple[str, int]] = []


def recording(response_text: str, answer: str, metadata: Mapping[str, str]) -> VerifierResult:
    """Quick: records its thread; raises on "boom", sleeps on "slow", returns junk on "junk"."""
    SEEN.append((response_text, threading.get_ident()))
    if response_text == "boom":
        raise RuntimeError("exploded")
    if response_text == "slow":
        time.sleep(1.0)
    if response_text == "junk":
        return "nonsense"  # type: ignore[return-value]
    correct = float(response_text == answer)
    return correct, {"correct": correct}, {}


class NoDeadline:
    """A gRPC context without a deadline."""

    def time_remaining(self) -> None:
        return None


def servicer(timeout_s: float = 5.0, *, quick: frozenset[str] = frozenset({"quick"})) -> RewardServicer:
    verifiers: dict[str, Any] = {**VERIFIERS, "quick": recording, "slow_lane": recording}
    settings = RewardSettings(port=0, score_timeout_s=timeout_s, tools_enabled=False)
    return RewardServicer(settings, verifiers, quick)


def batch(*items: tuple[str, str]) -> reward_pb2.ScoreBatchRequest:
    return reward_pb2.ScoreBatchRequest(
        items=[
            reward_pb2.ScoreRequest(trajectory_id=f"t{i}", response_text=text, answer="7", verifier=name)
            for i, (name, text) in enumerate(items)
        ]
    )


async def test_quick_items_share_one_pool_job_in_order_and_score_as_alone() -> None:
    SEEN.clear()
    scorer = servicer()
    request = batch(("quick", "7"), ("slow_lane", "7"), ("quick", "6"), ("nope", "7"), ("quick", "7"))
    reply = await scorer.ScoreBatch(request, NoDeadline())  # type: ignore[arg-type]
    alone = [await scorer.score(item) for item in request.items]
    assert list(reply.results) == alone
    assert [r.reward for r in reply.results] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert "unknown verifier 'nope'" in reply.results[3].error
    quick_threads = {ident for text, ident in SEEN[:3]}
    assert len(quick_threads) == 1, "the three quick items ran in one pool job"


async def test_one_failing_item_fails_alone() -> None:
    reply = await servicer().ScoreBatch(
        batch(("quick", "boom"), ("quick", "7"), ("quick", "junk"), ("quick", "7")),
        NoDeadline(),  # type: ignore[arg-type]
    )
    errors = [r.error for r in reply.results]
    assert errors[0] == "verifier 'quick' failed: RuntimeError: exploded"
    assert errors[2].startswith("verifier 'quick' returned a malformed result")
    assert (errors[1], errors[3]) == ("", "")
    assert [r.reward for r in reply.results] == [0.0, 1.0, 0.0, 1.0]


async def test_at_the_deadline_the_running_item_times_out_and_the_rest_are_scored_alone() -> None:
    SEEN.clear()
    started = time.monotonic()
    reply = await servicer(timeout_s=0.3).ScoreBatch(
        batch(("quick", "7"), ("quick", "slow"), ("quick", "7"), ("quick", "6")),
        NoDeadline(),  # type: ignore[arg-type]
    )
    assert time.monotonic() - started < 0.9, "the answer came at the deadline, not after the slow item"
    results = list(reply.results)
    assert results[0].reward == 1.0 and results[0].error == ""
    assert results[1].error == "verifier 'quick' did not finish within 0.3s"
    assert [(r.reward, r.error) for r in results[2:]] == [(1.0, ""), (0.0, "")]
    time.sleep(0.8)  # the slow item's thread finishes; it must not have run the items after it
    assert [text for text, _ in SEEN].count("7") == 2, "the items after the slow one were scored once each"


def test_the_registry_marks_its_quick_verifiers() -> None:
    quick = quick_verifiers()
    assert {"exact_match", "numeric", "addition", "reverse"} <= quick
    assert not {"math", "code", "reasoning_gym"} & quick, "slow or process-bound verifiers keep a thread each"
