"""Every service module starts, answers health and server reflection, and stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.common.redis_server import free_port

GRPC_SERVICES = [
    (["services.router"], "VERST_ROUTER_PORT"),
    (["services.reward"], "VERST_REWARD_PORT"),
    (["services.trainer"], "VERST_TRAINER_PORT"),
    (["services.rollout"], "VERST_ENGINE_PORT"),
    (["services.runner"], "VERST_RUNNER_PORT"),
]
SERVED = {
    "services.router": {"verst.v1.Router"},
    "services.reward": {"verst.v1.Reward", "verst.v1.Tools"},
    "services.trainer": {"verst.v1.Trainer"},
    "services.rollout": {"verst.v1.Rollout"},
    "services.runner": set(),
    "services.controller": set(),
}
"""The services each process lists by reflection besides health and reflection itself."""
METRICS = {
    "services.router": ("VERST_ROUTER_METRICS_PORT", "verst_router_engines 0.0"),
    "services.reward": ("VERST_REWARD_METRICS_PORT", "# TYPE verst_reward_score_seconds histogram"),
    "services.trainer": ("VERST_TRAINER_METRICS_PORT", "verst_trainer_policy_version 0.0"),
    "services.rollout": ("VERST_ENGINE_METRICS_PORT", "verst_engine_tokens_per_second 0.0"),
    "services.runner": ("VERST_RUNNER_METRICS_PORT", "verst_runner_groups_in_flight 0.0"),
}
"""Each process's /metrics port variable, and a line of its own series on the page."""
HEALTH_CHECKED = 'verst_rpc_calls_total{code="OK",method="Check",service="grpc.health.v1.Health"}'
"""The page's line that counts the health checks the test made (each process times its RPCs)."""
ALWAYS = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
DEADLINE_S = 120.0
"""How long a process may take to serve health: the trainer imports DeepSpeed, slow on a busy 2-core host."""


def start(
    python: str, env: dict[str, str], module: list[str], port_var: str, redis_url: str
) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    proc = subprocess.Popen(
        [python, "-m", *module],
        env={**env, port_var: str(port), "REDIS_URL": redis_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, port


def grpc_health(port: int) -> int:
    """The health status, retrying until the deadline while the server starts."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def reflected_services(port: int) -> set[str]:
    """What a reflection client (`grpcurl list`) sees at the port."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return set(ProtoReflectionDescriptorDatabase(channel).get_services())


def stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        output, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"did not stop within 20s of SIGTERM:\n{output}")
    return proc.returncode, output


@pytest.mark.parametrize(
    ("module", "port_var"), GRPC_SERVICES, ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_grpc_service_lifecycle(
    python: str, python_env: dict[str, str], module: list[str], port_var: str, redis_url: str
) -> None:
    """Health, reflection, /metrics (its own series and its RPCs'), and a clean stop."""
    metrics_var, own_series = METRICS[module[0]]
    metrics_port = free_port()
    env = {**python_env, metrics_var: str(metrics_port)}
    proc, port = start(python, env, module, port_var, redis_url)
    try:
        assert grpc_health(port) == health_pb2.HealthCheckResponse.SERVING
        assert reflected_services(port) == ALWAYS | SERVED[module[0]]
        response = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
        assert response.status_code == 200
        assert own_series in response.text
        assert f"{HEALTH_CHECKED} 1.0" in response.text
    finally:
        code, output = stop(proc)
    assert code == 0, output
    assert "stopped" in output


def test_controller_runs_as_its_own_process(python: str, python_env: dict[str, str], redis_url: str) -> None:
    """`python -m services.controller`: gRPC health, its /metrics, a clean stop on SIGTERM."""
    metrics_port = free_port()
    env = {**python_env, "VERST_CONTROLLER_METRICS_PORT": str(metrics_port)}
    proc, port = start(python, env, ["services.controller"], "VERST_CONTROLLER_PORT", redis_url)
    try:
        assert grpc_health(port) == health_pb2.HealthCheckResponse.SERVING
        assert reflected_services(port) == ALWAYS | SERVED["services.controller"]
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert "verst_controller_drivers 0.0" in metrics
        assert HEALTH_CHECKED in metrics
    finally:
        code, output = stop(proc)
    assert code == 0, output
    assert "controller stopped" in output


def test_api_lifecycle(python: str, python_env: dict[str, str], redis_url: str) -> None:
    proc, port = start(python, python_env, ["services.api"], "VERST_API_PORT", redis_url)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert response.status_code == 200
        assert response.json() == {"status": "ok", "service": "api"}
    finally:
        code, output = stop(proc)
    assert code == 0, output


def test_bad_setting_names_the_variable(python: str, python_env: dict[str, str]) -> None:
    result = subprocess.run(
        [python, "-m", "services.router"],
        env={**python_env, "VERST_ROUTER_PORT": "70000"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "VERST_ROUTER_PORT" in result.stderr and "less than or equal to 65535" in result.stderr


def test_the_engine_takes_no_role_argument(python: str, python_env: dict[str, str]) -> None:
    result = subprocess.run(
        [python, "-m", "services.rollout", "trainer"],
        env=python_env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert (
        "usage: python -m services.rollout (the episode runner is python -m services.runner)" in result.stderr
    )
