"""deploy/grafana/verst.json: a Grafana dashboard model whose queries name only series that some
verst process exports (the names come from the services' own registries)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.api.telemetry import ApiMetrics
from services.common.bus_lag import BusLagCollector
from services.common.rpc_metrics import RpcMetrics
from services.controller.telemetry import ControllerMetrics
from services.reward.telemetry import RewardMetrics
from services.rollout.engine_protocol import EngineStatus
from services.rollout.metrics import EngineMetrics
from services.router.telemetry import RouterMetrics
from services.runner.telemetry import RunnerMetrics
from services.trainer.telemetry import TrainerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "verst.json"
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("_count", "_sum", "_created"),
    "gauge": ("",),
}
"""The sample names Prometheus stores for a family of each type."""
UNUSED = "redis://127.0.0.1:1/0"
"""A Redis URL the lag collectors never dial: no stream is watched, so no scrape asks Redis."""


def registries() -> Iterator[CollectorRegistry]:
    """The registry of every verst process, as each process builds it."""
    router = RouterMetrics()
    router.follow(list, lambda _: False)
    status = EngineStatus(0, 0, "", "", 0, 0, 0)
    rpc = CollectorRegistry()
    RpcMetrics(rpc)
    yield from (router.registry, rpc, EngineMetrics(lambda: status).registry)
    yield from (
        RunnerMetrics(BusLagCollector(UNUSED)).registry,
        TrainerMetrics(BusLagCollector(UNUSED)).registry,
    )
    yield from (RewardMetrics().registry, ControllerMetrics().registry, ApiMetrics().registry)


def exported_names() -> set[str]:
    names = set()
    for registry in registries():
        for family in registry.collect():
            names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel["targets"]]


def test_it_is_a_dashboard_model_of_prometheus_panels() -> None:
    model = dashboard()
    assert model["title"] and model["uid"] and isinstance(model["schemaVersion"], int)
    ids = [panel["id"] for panel in model["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in model["panels"]:
        assert panel["type"] == "timeseries" and panel["title"]
        assert (
            set(panel["gridPos"]) == {"h", "w", "x", "y"}
            and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        )
        assert panel["datasource"]["type"] == "prometheus"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids))
    variables = {variable["name"]: variable for variable in model["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"


def test_every_query_names_series_a_service_exports() -> None:
    exported = exported_names()
    assert "verst_rpc_seconds_bucket" in exported and "verst_bus_lag_seconds" in exported  # the sets are real
    used = {name for expr in exprs() for name in re.findall(r"\bverst_[a-z0-9_]+", expr)}
    assert used, "the dashboard queries verst's series"
    unknown = sorted(used - exported)
    assert not unknown, f"the dashboard queries series no service exports: {unknown}"


@pytest.mark.parametrize(
    "series",
    ["verst_engine_tokens_per_second", "verst_rpc_seconds_bucket", "verst_bus_lag_seconds",
     "verst_trainer_step_stage_seconds_sum", "verst_runner_groups_total"],
)  # fmt: skip
def test_the_main_views_are_there(series: str) -> None:
    assert any(series in expr for expr in exprs())
