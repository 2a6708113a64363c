"""compose/: the base file and its GPU overrides, checked without Docker: against the Compose
specification's JSON schema (vendored in tests/contract/compose_spec/), and against verst itself
(entry points, settings, ports, secrets, pins). compose_model.py interpolates and merges them."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.contract.compose_model import (
    BASE,
    COMPOSE_DIR,
    OVERRIDES,
    ROOT,
    config,
    env_names,
    interpolate,
    interpolations,
    raw,
    settings_for,
    verst_services,
)

DOCKERFILE = COMPOSE_DIR / "Dockerfile"
LOCK = COMPOSE_DIR / "requirements.lock"
BUILD_LOCK = COMPOSE_DIR / "build-tools.lock"
SCHEMA = Path(__file__).parent / "compose_spec" / "compose-spec.json"
VARIANTS = [None, "gpu", "rocm"]
SHARED_ENV = {"REDIS_URL", "VERST_LOG_LEVEL", "VERST_REDIS_PASSWORD"}
FOREIGN_ENV = {"HIP_VISIBLE_DEVICES"}
"""Variables a verst service reads that are no verst setting (the ROCm runtime's)."""
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
SECRET_WORDS = re.compile(r"password|token|secret|requirepass|--pass\b|(^|\s)-a(\s|$)", re.IGNORECASE)


@pytest.fixture(params=VARIANTS, ids=lambda v: v or "base")
def variant(request: pytest.FixtureRequest) -> str | None:
    return request.param


def argv_strings(service: dict[str, Any]) -> list[str]:
    """Everything a service puts on a command line: command, entrypoint, health check."""
    parts: list[Any] = []
    for key in ("command", "entrypoint"):
        value = service.get(key, [])
        parts += value if isinstance(value, list) else [value]
    test = service.get("healthcheck", {}).get("test", [])
    parts += test if isinstance(test, list) else [test]
    return [str(part) for part in parts]


# --- the specification --------------------------------------------------------------------------


def test_the_vendored_schema_is_the_compose_specification() -> None:
    schema = json.loads(SCHEMA.read_text())
    assert schema["title"] == "Compose Specification" and "services" in schema["properties"]
    assert "Apache License" in (SCHEMA.parent / "LICENSE").read_text()


def test_every_file_and_merge_matches_the_compose_schema(variant: str | None) -> None:
    validator = jsonschema_rs.Draft202012Validator(json.loads(SCHEMA.read_text()))
    errors = [f"{e.instance_path}: {e.message}" for e in validator.iter_errors(config(variant))]
    assert not errors, errors


def test_the_schema_check_can_fail() -> None:
    validator = jsonschema_rs.Draft202012Validator(json.loads(SCHEMA.read_text()))
    broken = config("gpu")
    broken["services"]["trainer"]["stop_grace_period"] = 120  # a duration must be a string
    broken["services"]["engine"]["deploy"]["replicas"] = "many"
    assert len(list(validator.iter_errors(broken))) >= 2


@pytest.mark.parametrize("path", [BASE, *OVERRIDES.values()], ids=lambda p: p.name)
def test_every_interpolation_has_a_default_or_an_error(path: Path) -> None:
    found = interpolations(path)
    assert found, "no variables at all: the scan is broken"
    for match in found:
        assert not match["bare"], f"{path.name}: bare ${match['bare']}… (write ${{NAME}}, or $$)"
        if match["name"]:
            assert match["op"] in (":-", "-", ":?", "?"), f"{path.name}: ${{{match['name']}}} has no default"


def test_required_variables_say_what_to_set() -> None:
    with pytest.raises(KeyError, match="VERST_SGLANG_MODEL_PATH: set VERST_SGLANG_MODEL_PATH"):
        interpolate(raw(OVERRIDES["gpu"]), {})
    with pytest.raises(KeyError, match="VERST_RENDER_GID"):
        interpolate(raw(OVERRIDES["rocm"]), {"VERST_SGLANG_MODEL_PATH": "/data/m"})
    interpolate(raw(BASE), {})  # the base needs nothing set


# --- each service against verst -----------------------------------------------------------------


def test_the_services_and_redis_are_there() -> None:
    services = {"redis", "api", "controller", "router", "engine", "runner", "reward", "trainer"}
    assert set(config()["services"]) == services
    assert set(config("gpu")["services"]) == set(config("rocm")["services"]) == services | {"sglang"}
    assert config()["services"]["api"]["environment"]["VERST_API_CONTROLLER"] == "false"  # one controller


def test_commands_are_real_entry_points(variant: str | None) -> None:
    services = verst_services(config(variant))
    assert len(services) == 7
    for name, service in services.items():
        command = service["command"]
        assert len(command) == 3 and command[2].startswith("services."), name
        assert importlib.util.find_spec(f"{command[2]}.__main__") is not None, (
            f"{name}: {command[2]} has no __main__"
        )


def test_every_verst_variable_is_a_setting(variant: str | None) -> None:
    for name, service in verst_services(config(variant)).items():
        known = env_names(settings_for(service["command"])) | SHARED_ENV
        for var in service["environment"]:
            setting = var.removesuffix("_FILE")  # X_FILE stands for X (services/common/settings.py)
            assert setting in known or var in FOREIGN_ENV, (
                f"{name} sets {var}, which its settings do not read"
            )


def test_the_setting_check_can_fail() -> None:
    engine = config()["services"]["engine"]
    known = env_names(settings_for(engine["command"])) | SHARED_ENV
    assert "VERST_ENGINE_ADVERTISE_ADDRESS" in known and "VERST_ENGINE_ADVERTISE" not in known


@pytest.mark.parametrize("name", sorted(verst_services(config())))
def test_ports_agree(name: str) -> None:
    """The port the service listens on is the one its health check and peers use."""
    service = config()["services"][name]
    env = service["environment"]
    (port_var,) = [var for var in env if var.endswith("_PORT")]
    port = env[port_var]
    assert re.search(rf":{port}(/|$)", service["healthcheck"]["test"][-1])
    assert service["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "services.common.healthcheck"]
    cls = settings_for(service["command"])
    assert cls.model_fields["port"].default == int(port), "compose and the settings default disagree"
    assert env[port_var.replace("_PORT", "_HOST")] == "0.0.0.0"
    metrics = cls.model_fields.get("metrics_port")
    if metrics is None:  # the api serves /metrics on its own port
        assert service["ports"] == ["8000:8000"]
    else:
        assert str(metrics.default) in service["expose"]


def test_every_port_is_documented_at_the_top() -> None:
    header = BASE.read_text().split("\nname: verst", 1)[0]
    loaded = config()
    ports = {"6379", "30000"}
    for service in verst_services(loaded).values():
        ports |= {str(v) for k, v in service["environment"].items() if k.endswith("_PORT")}
        ports |= set(service.get("expose", []))
    for port in ports:
        assert re.search(rf"#.*\b{port}\b", header), f"port {port} is not in the comment block"


def test_addresses_point_at_real_services_and_ports(variant: str | None) -> None:
    loaded = config(variant)
    services = verst_services(loaded)
    ports = {
        n: s["environment"][next(v for v in s["environment"] if v.endswith("_PORT"))]
        for n, s in services.items()
    }
    ports["sglang"] = "30000"
    for name, service in services.items():
        for var, value in service["environment"].items():
            if var.endswith("_ADDRESS") and value != "auto":
                host, _, port = str(value).partition(":")
                assert host in loaded["services"], f"{name}.{var} names no service {host!r}"
                assert ports[host] == port, f"{name}.{var}: {host} listens on {ports[host]}, not {port}"
            if var.endswith("_URLS"):
                for url in value.split(","):
                    host, _, port = url.removeprefix("http://").partition(":")
                    assert ports[host] == port.rstrip("/"), f"{name}.{var}: {url}"


def test_depends_on_targets_exist(variant: str | None) -> None:
    loaded = config(variant)
    for name, service in loaded["services"].items():
        for target in service.get("depends_on", {}):
            assert target in loaded["services"], f"{name} depends on missing {target}"


def test_engines_and_trainers_scale_without_clashing(variant: str | None) -> None:
    """`--scale engine=N`: each replica advertises its own address (auto), and neither engines nor
    trainers publish a host port or keep a container name (compose refuses to scale either)."""
    loaded = config(variant)
    engine, trainer = loaded["services"]["engine"], loaded["services"]["trainer"]
    assert engine["environment"]["VERST_ENGINE_ADVERTISE_ADDRESS"] == "auto"
    for service in (engine, trainer):
        assert "ports" not in service and "container_name" not in service
    assert isinstance(trainer["deploy"]["replicas"], int)


def test_stop_grace_outlasts_each_services_own_shutdown(variant: str | None) -> None:
    """Docker kills a container stop_grace_period after SIGTERM: later than the service's own
    shutdown grace, and for the trainer later than a step and a durable checkpoint (120 s)."""
    from tests.contract.compose_model import seconds

    for name, service in verst_services(config(variant)).items():
        cls = settings_for(service["command"])
        prefix = cls.env_name("shutdown_grace_s")
        own = float(service["environment"].get(prefix, cls.model_fields["shutdown_grace_s"].default))
        assert seconds(service["stop_grace_period"]) > own + 5, name
    trainer = config(variant)["services"]["trainer"]
    assert seconds(trainer["stop_grace_period"]) >= 120
    assert float(trainer["environment"]["VERST_TRAINER_SHUTDOWN_GRACE_S"]) >= 100


def test_data_and_plugins_are_mounted_everywhere(variant: str | None) -> None:
    loaded = config(variant)
    for name, service in verst_services(loaded).items():
        assert "verst-data:/data" in service["volumes"], name
        assert "verst-plugins:/plugins:ro" in service["volumes"], name
    bound = config(variant, {"VERST_DATA_DIR": "/srv/verst", "VERST_PLUGINS_DIR": "/srv/plugins"})
    assert "/srv/verst:/data" in bound["services"]["trainer"]["volumes"]  # a bind mount instead
    assert "/srv/plugins:/plugins:ro" in bound["services"]["reward"]["volumes"]
    assert {"verst-data", "verst-plugins"} <= set(loaded["volumes"])
    api = loaded["services"]["api"]["environment"]
    assert api["VERST_DATA_ROOTS"] == "/data" and api["VERST_CHECKPOINT_ROOT"] == "/data"
    assert "PYTHONPATH=/plugins" in DOCKERFILE.read_text() and "WORKDIR /data" in DOCKERFILE.read_text()


# --- secrets ------------------------------------------------------------------------------------


def test_no_secret_on_any_command_line(variant: str | None) -> None:
    for name, service in config(variant)["services"].items():
        for part in argv_strings(service):
            if "/run/secrets/" in part:  # read inside the container into the environment only
                assert "REDISCLI_AUTH=" in part and "$(cat /run/secrets/" in part, f"{name}: {part}"
                continue
            assert not SECRET_WORDS.search(part), f"{name} puts a secret on argv: {part}"


def test_the_argv_check_can_fail() -> None:
    leaky = {
        "command": ["redis-server", "--requirepass", "x"],
        "healthcheck": {"test": ["CMD", "redis-cli", "-a", "x"]},
    }
    assert sum(bool(SECRET_WORDS.search(part)) for part in argv_strings(leaky)) == 2


def test_secrets_come_from_files_never_from_the_compose_environment(variant: str | None) -> None:
    loaded = config(variant)
    assert set(loaded["secrets"]) == {"redis_password", "api_token"}
    assert all(set(secret) == {"file"} for secret in loaded["secrets"].values())
    for name, service in loaded["services"].items():
        for var, value in service.get("environment", {}).items():
            assert not re.search(r"PASSWORD|TOKEN", var) or var.endswith("_FILE"), f"{name}.{var}"
            assert not re.search(r"://[^/]*:[^/]*@", str(value)), f"{name}.{var} has a password in a URL"
            if str(value).startswith("/run/secrets/"):
                assert value.removeprefix("/run/secrets/") in service["secrets"], f"{name}.{var}"
    for name, service in verst_services(loaded).items():
        assert service["environment"]["VERST_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password"
        assert service["environment"]["REDIS_URL"] == "redis://redis:6379/0", name
    assert loaded["services"]["api"]["environment"]["VERST_API_TOKEN_FILE"] == "/run/secrets/api_token"
    assert (COMPOSE_DIR / "secrets" / ".gitignore").read_text().splitlines()[1:] == ["*", "!.gitignore"]


def test_redis_never_evicts_and_takes_its_password_from_the_secret() -> None:
    redis = config()["services"]["redis"]
    conf = (COMPOSE_DIR / "redis" / "redis.conf").read_text()
    entrypoint = (COMPOSE_DIR / "redis" / "entrypoint.sh").read_text()
    assert re.search(r"^maxmemory-policy noeviction$", conf, re.MULTILINE)
    assert re.search(r"^appendonly yes$", conf, re.MULTILINE)
    settings = [line for line in conf.splitlines() if line and not line.startswith("#")]
    assert not any(line.startswith("requirepass") for line in settings), "added at start, from the secret"
    assert redis["entrypoint"] == ["/bin/sh", "/usr/local/etc/verst-redis/entrypoint.sh"]
    assert "./redis:/usr/local/etc/verst-redis:ro" in redis["volumes"] and redis["secrets"] == [
        "redis_password"
    ]
    assert re.fullmatch(r"\d+[kmg]b", redis["environment"]["REDIS_MAXMEMORY"])
    assert "maxmemory %s" in entrypoint and "exec docker-entrypoint.sh redis-server" in entrypoint
    assert redis["healthcheck"]["test"][0] == "CMD-SHELL"


# --- images and the build -----------------------------------------------------------------------


def test_every_pulled_image_is_pinned_by_digest(variant: str | None) -> None:
    for name, service in config(variant)["services"].items():
        if "build" in service:
            assert service["image"].startswith("verst:"), name
            base = service["build"].get("args", {}).get("BASE_IMAGE")
            assert base is None or DIGEST.search(base), f"{name}: BASE_IMAGE {base} is not pinned"
        else:
            assert DIGEST.search(service["image"]), f"{name}: {service['image']} is not pinned"
    default_base = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert default_base and default_base[1].startswith("python:3.11-slim@") and DIGEST.search(default_base[1])


def test_the_gpu_overrides_put_the_trainer_and_sglang_on_gpus() -> None:
    gpu, rocm = config("gpu")["services"], config("rocm")["services"]
    for name in ("trainer", "sglang"):
        (device,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert (
            device["driver"] == "nvidia"
            and device["capabilities"] == ["gpu"]
            and device["device_ids"] == ["0"]
        )
        assert set(rocm[name]["devices"]) == {"/dev/kfd", "/dev/dri"} and rocm[name]["group_add"][:1] == [
            "video"
        ]
    for services, base in ((gpu, "nvidia/cuda:"), (rocm, "rocm/dev-ubuntu-22.04@")):
        assert services["trainer"]["environment"]["VERST_TRAINER_DEVICE"] == "cuda"
        assert services["trainer"]["build"]["args"]["BASE_IMAGE"].startswith(base)
        assert "whl/cu" in services["trainer"]["build"]["args"]["TORCH_INDEX_URL"] or base.startswith("rocm")
        engine, sglang = services["engine"], services["sglang"]
        assert engine["environment"]["VERST_ENGINE_BACKEND"] == "sglang"
        assert engine["environment"]["VERST_ENGINE_SGLANG_URLS"] == "http://sglang:30000"
        assert engine["depends_on"]["sglang"]["condition"] == "service_healthy"
        assert (
            "python3 -m sglang.launch_server" in sglang["command"][-1]
            and "--port 30000" in sglang["command"][-1]
        )
        assert sglang["environment"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
        # SGLang loads each checkpoint from the path its handle names: the same mount point
        assert (
            "verst-data:/data:ro" in sglang["volumes"]
            and "verst-data:/data" in services["trainer"]["volumes"]
        )
        assert services["trainer"]["environment"]["VERST_TRAINER_WEIGHT_TRANSPORT"] == "filesystem"
    assert rocm["trainer"]["group_add"][1] == "109"  # VERST_RENDER_GID


def test_the_dockerfile_builds_from_the_lock_as_a_user_of_its_own() -> None:
    text = DOCKERFILE.read_text()
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    makefile_torch = re.search(
        r"^TORCH_SPEC \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE
    )
    assert makefile_torch and f"ARG TORCH_VERSION={makefile_torch[1]}" in text, "the image and make agree"
    assert "pip install --require-hashes --no-deps --no-build-isolation -r compose/requirements.lock" in text
    assert "pip install --require-hashes --no-deps -r compose/build-tools.lock" in text
    assert re.search(r"^USER 10001:10001$", text, re.MULTILINE) and "useradd --uid 10001" in text
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*") - 1].startswith("#") and "*" in ignore  # an allowlist
    for sources in re.findall(r"^COPY (.+) \S+$", text, flags=re.MULTILINE):
        for source in sources.split():
            assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"
            allowed = f"!{source}" in ignore or f"!{source}/" in ignore
            assert allowed, f".dockerignore keeps {source} out of the build context"


def locked(path: Path) -> dict[str, str]:
    """name -> version of every pin in a lock file, each checked to carry a hash."""
    text = path.read_text()
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\$", text, re.MULTILINE))
    blocks = re.split(r"^(?=[A-Za-z0-9_.-]+==)", text, flags=re.MULTILINE)[1:]
    assert len(blocks) == len(pins) and all("--hash=sha256:" in block for block in blocks)
    return {canonicalize_name(name): version for name, version in pins.items()}


def test_the_lock_pins_every_dependency_but_torch() -> None:
    pins = locked(LOCK)
    assert "torch" not in pins and not any(name.startswith("nvidia-") for name in pins)
    project = re.search(
        r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.MULTILINE | re.DOTALL
    )
    assert project
    for line in re.findall(r'^\s*"([^"]+)"', project[1], re.MULTILINE):
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if name != "torch":
            assert name in pins, f"{name} is not in {LOCK.name}: run compose/lock.sh"
            assert requirement.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]}"
    for name, version in locked(BUILD_LOCK).items():
        assert pins.get(name, version) == version, f"{BUILD_LOCK.name} and {LOCK.name} disagree on {name}"


def test_the_reward_sandbox_gets_exactly_the_privileges_it_needs(variant: str | None) -> None:
    """Root with CAP_SYS_ADMIN and AppArmor off for the reward service (its sandbox's namespaces and
    mounts, docs/reward.md), never privileged mode; every other verst service keeps the image's user
    and no added capability."""
    services = config(variant)["services"]
    reward = services["reward"]
    assert reward["user"] == "0:0"
    assert reward["cap_add"] == ["SYS_ADMIN"]
    assert reward["security_opt"] == ["apparmor=unconfined"]
    for name, service in services.items():
        assert not service.get("privileged"), name
        if name != "reward":
            assert not service.get("cap_add"), name
