"""Each service's own Prometheus series: what the router, runner, reward service and trainer
record, and the metrics ports the local stack hands its children."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from services.common.pb import common_pb2, reward_pb2
from services.reward.config import RewardSettings
from services.reward.server import RewardServicer
from services.router.pool import EngineLink
from services.router.telemetry import RouterMetrics
from services.runner.telemetry import RunnerMetrics
from services.stack import Stack, StackConfig
from services.trainer.telemetry import TrainerMetrics
from tests.helpers import FakeContext


def test_the_router_reports_its_view_at_scrape_time() -> None:
    links: list[EngineLink] = []
    drained = {"e2"}
    metrics = RouterMetrics()
    metrics.follow(lambda: list(links), drained.__contains__)
    assert metrics.registry.get_sample_value("verst_router_engines") == 0
    for engine_id, state, outstanding in [
        ("e1", common_pb2.ENGINE_STATE_SERVING, 3),
        ("e2", common_pb2.ENGINE_STATE_SERVING, 0),
        ("e3", common_pb2.ENGINE_STATE_DRAINING, 1),
    ]:
        info = common_pb2.EngineInfo(engine_id=engine_id, state=state, queued_requests=2, running_requests=5)
        links.append(EngineLink(info, None, None, outstanding=outstanding))  # type: ignore[arg-type]
    value = metrics.registry.get_sample_value
    assert value("verst_router_engines") == 3
    assert value("verst_router_engines_routable") == 1  # e2 drained here, e3 draining itself
    assert value("verst_router_engine_in_flight", {"engine": "e1"}) == 3
    assert value("verst_router_engine_queued_requests", {"engine": "e3"}) == 2
    assert value("verst_router_engine_running_requests", {"engine": "e2"}) == 5


def test_the_runner_times_a_group_from_its_stage_stamps() -> None:
    metrics = RunnerMetrics()
    picked = 1000.0
    trajectory = common_pb2.Trajectory(stages=common_pb2.StageTimes(generated=1002.5, scored=1003.0))
    metrics.rolled_out([trajectory, trajectory], picked)
    metrics.published(0.25)
    value = metrics.registry.get_sample_value
    for stage in ("generated", "scored", "published"):
        assert value("verst_runner_groups_total", {"stage": stage}) == 1, (
            "a group counts once, not per sample"
        )
    assert value("verst_runner_stage_seconds_sum", {"stage": "generate"}) == 2.5
    assert value("verst_runner_stage_seconds_sum", {"stage": "score"}) == 0.5
    assert value("verst_runner_stage_seconds_sum", {"stage": "publish"}) == 0.25


def test_the_trainer_observes_each_steps_stages() -> None:
    metrics = TrainerMetrics()
    version = 0
    metrics.follow_version(lambda: version)
    step = {"wait_seconds": 1.0, "optimise_seconds": 2.0, "publish_seconds": 0.5, "checkpoint_seconds": 0.0}
    metrics.stepped(step, trajectories=16)
    version = 1
    metrics.stepped({**step, "checkpoint_seconds": 4.0}, trajectories=16)
    value = metrics.registry.get_sample_value
    assert value("verst_trainer_steps_total") == 2 and value("verst_trainer_trajectories_total") == 32
    assert value("verst_trainer_step_stage_seconds_sum", {"stage": "optimise"}) == 4.0
    assert value("verst_trainer_step_stage_seconds_count", {"stage": "checkpoint"}) == 1  # only a durable one
    assert value("verst_trainer_policy_version") == 1


def _verifiers() -> Mapping[str, object]:
    def right(response: str, answer: str, metadata: Mapping[str, str]) -> tuple[float, dict, dict]:
        return 1.0, {}, {}

    def broken(response: str, answer: str, metadata: Mapping[str, str]) -> tuple[float, dict, dict]:
        raise ValueError("a bug")

    def slow(response: str, answer: str, metadata: Mapping[str, str]) -> tuple[float, dict, dict]:
        time.sleep(0.3)
        return 1.0, {}, {}

    return {"addition": right, "broken": broken, "slow": slow}


async def test_the_reward_service_counts_items_errors_and_seconds_per_verifier() -> None:
    settings = RewardSettings(score_timeout_s=0.1)
    servicer = RewardServicer(settings, _verifiers(), quick=frozenset({"addition"}))  # type: ignore[arg-type]
    items = [reward_pb2.ScoreRequest(verifier=name) for name in ("", "addition", "broken", "slow", "nope")]
    reply = await servicer.ScoreBatch(reward_pb2.ScoreBatchRequest(items=items), FakeContext())  # type: ignore[arg-type]
    assert [bool(result.error) for result in reply.results] == [False, False, True, True, True]
    value = servicer.metrics.registry.get_sample_value
    assert value("verst_reward_items_total", {"verifier": "addition"}) == 2  # scored together, both counted
    assert value("verst_reward_errors_total", {"verifier": "broken", "kind": "error"}) == 1
    assert value("verst_reward_errors_total", {"verifier": "slow", "kind": "timeout"}) == 1
    assert value("verst_reward_errors_total", {"verifier": "unknown", "kind": "error"}) == 1
    assert 0.05 < value("verst_reward_score_seconds_sum", {"verifier": "slow"}) < 0.3
    assert value("verst_reward_errors_total", {"verifier": "addition", "kind": "error"}) is None


def test_the_stack_gives_every_child_a_metrics_port(tmp_path: Path) -> None:
    ports = {name: 0 for name in ("api", "router", "engine", "engine_metrics", "reward", "trainer", "runner")}
    config = StackConfig(
        log_dir=tmp_path, engines=2, trainers=2, **{f"{n}_port": p for n, p in ports.items()}
    )
    stack = Stack(config)
    children = stack._plan()
    assert set(stack.metrics_ports) == {child.name for child in children}
    for child in children:
        if child.name != "api":  # the api serves /metrics on its own port
            (variable,) = [name for name in child.env if name.endswith("_METRICS_PORT") and "VERST_" in name
                           and name.split("_")[1].lower() in child.name]  # fmt: skip
            assert child.env[variable] == str(stack.metrics_ports[child.name])
    assert len(set(stack.metrics_ports.values())) == len(children), "no two children share a port"
