"""compose/docker-compose.yml, checked structurally (no Docker engine runs here)."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.settings import ServiceSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
DOCKERFILE = ROOT / "compose" / "Dockerfile"
CONFIG_MODULES = ["api", "controller", "router", "reward", "trainer", "rollout", "runner"]
SHARED_ENV = {"REDIS_URL", "VERST_LOG_LEVEL"}


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def app_services() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose()["services"].items() if name != "redis"}


def settings_classes() -> list[type[ServiceSettings]]:
    classes = []
    for name in CONFIG_MODULES:
        module = importlib.import_module(f"services.{name}.config")
        classes += [
            value
            for value in vars(module).values()
            if isinstance(value, type) and issubclass(value, ServiceSettings) and value is not ServiceSettings
        ]
    return classes


def settings_for(command: list[str]) -> type[ServiceSettings]:
    """The settings class of the process a compose command starts."""
    module = command[2]
    by_name = {cls.service_name: cls for cls in settings_classes()}
    name = {"services.rollout": "rollout-engine"}.get(module, module.removeprefix("services."))
    return by_name[name]


def env_names(cls: type[ServiceSettings]) -> set[str]:
    return {cls.env_name(field) for field in cls.model_fields}


def test_the_services_and_redis_are_there() -> None:
    services = {"redis", "api", "controller", "router", "engine", "runner", "reward", "trainer"}
    assert set(compose()["services"]) == services
    assert compose()["services"]["api"]["environment"]["VERST_API_CONTROLLER"] == "false"  # one controller


@pytest.mark.parametrize("name", sorted(app_services()))
def test_command_is_a_real_entry_point(name: str) -> None:
    command = app_services()[name]["command"]
    assert command[:2] == ["python", "-m"]
    module = command[2]
    assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{module} has no __main__"
    assert len(command) == 3


@pytest.mark.parametrize("name", sorted(app_services()))
def test_every_env_var_exists_in_the_config(name: str) -> None:
    service = app_services()[name]
    known = env_names(settings_for(service["command"])) | SHARED_ENV
    unknown = set(service["environment"]) - known
    assert not unknown, f"{name} sets variables its settings do not read: {sorted(unknown)}"


@pytest.mark.parametrize("name", sorted(app_services()))
def test_ports_agree(name: str) -> None:
    """The port the service listens on is the one its health check and peers use."""
    service = app_services()[name]
    env = service["environment"]
    (port_var,) = [var for var in env if var.endswith("_PORT")]
    port = env[port_var]
    assert " ".join(service["healthcheck"]["test"]).endswith(f":{port}") or f":{port}/" in " ".join(
        service["healthcheck"]["test"]
    )
    cls = settings_for(service["command"])
    assert cls.model_fields["port"].default == int(port), "compose and the settings default disagree"
    assert env[port_var.replace("_PORT", "_HOST")] == "0.0.0.0"


def test_addresses_point_at_real_services_and_ports() -> None:
    services = app_services()
    ports = {name: svc["environment"][next(v for v in svc["environment"] if v.endswith("_PORT"))]
             for name, svc in services.items()}  # fmt: skip
    for name, svc in services.items():
        for var, value in svc["environment"].items():
            if var.endswith("_ADDRESS"):
                host, _, port = str(value).partition(":")
                assert host in services, f"{name}.{var} names no service {host!r}"
                assert ports[host] == port, f"{name}.{var}: {host} listens on {ports[host]}, not {port}"


def test_depends_on_targets_exist() -> None:
    everything = compose()["services"]
    for name, svc in everything.items():
        for target in svc.get("depends_on", {}):
            assert target in everything, f"{name} depends on missing {target}"


def test_every_service_has_a_health_check_with_the_project_probe() -> None:
    for name, svc in compose()["services"].items():
        test = svc["healthcheck"]["test"]
        if name != "redis":
            assert test[:4] == ["CMD", "python", "-m", "services.common.healthcheck"]
            assert test[4] in {"grpc", "http"}


def test_trainers_scale_as_replicas_without_clashing() -> None:
    """Each trainer replica trains one job at a time; replicas publish no host port (two would
    clash) and keep no container name of their own (compose refuses to scale one)."""
    trainer = app_services()["trainer"]
    replicas = trainer["deploy"]["replicas"]
    assert isinstance(replicas, int) and replicas >= 1
    assert "ports" not in trainer and "container_name" not in trainer


@pytest.mark.parametrize("name", sorted(app_services()))
def test_metrics_ports_are_exposed(name: str) -> None:
    """Each service with a /metrics port of its own exposes it to the compose network (a
    Prometheus there scrapes `service:port`)."""
    service = app_services()[name]
    field = settings_for(service["command"]).model_fields.get("metrics_port")
    if field is None:  # the api serves /metrics on its own port
        assert "ports" in service
        return
    assert str(field.default) in service.get("expose", [])


def test_checkpoints_volume_is_shared_by_trainer_and_engines() -> None:
    services = app_services()
    assert "checkpoints:/data" in services["trainer"]["volumes"]
    assert "checkpoints:/data" in services["engine"]["volumes"]
    assert "checkpoints" in compose()["volumes"]


def test_dockerfile_installs_the_pinned_torch_and_the_project() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r'TORCH_SPEC="torch==2\.13\.0"', text)
    assert "pip install --no-cache-dir --no-build-isolation -e ." in text
    for path in re.findall(r"^COPY (\S+) ", text, flags=re.MULTILINE):
        assert (ROOT / path).exists(), f"Dockerfile copies missing {path}"


def test_redis_wants_a_password_and_every_service_gives_it() -> None:
    redis = compose()["services"]["redis"]
    secret = "${VERST_REDIS_PASSWORD:?set VERST_REDIS_PASSWORD}"
    assert redis["command"][-2:] == ["--requirepass", secret]
    assert secret in redis["healthcheck"]["test"]
    for name, svc in app_services().items():
        assert svc["environment"]["REDIS_URL"] == f"redis://:{secret}@redis:6379/0", name


def test_the_api_sets_a_token_and_confines_spec_paths_to_the_volume() -> None:
    env = app_services()["api"]["environment"]
    assert env["VERST_API_TOKEN"] == "${VERST_API_TOKEN:?set VERST_API_TOKEN}"
    assert env["VERST_DATA_ROOTS"] == "/data" and env["VERST_CHECKPOINT_ROOT"] == "/data"
    assert "checkpoints:/data" in app_services()["api"]["volumes"], "the api sees the paths it checks"
    assert "WORKDIR /data" in DOCKERFILE.read_text(), "relative checkpoint dirs land in the root"
