"""The compose files as Docker Compose reads them, without Docker: variable interpolation, the
merge of an override file onto the base, and the settings class of each verst service.

Interpolation follows the Compose specification: ``$$`` is a literal ``$``; ``${VAR}``,
``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``, ``${VAR?error}``, ``${VAR:+alt}``.
The merge follows `docker compose -f base -f override`: mappings merge key by key, a scalar or a
list from the override replaces the base's, except the lists Compose unions (ports, expose,
secrets, devices, group_add, ...) and ``volumes``, merged by mount target.
"""

from __future__ import annotations

import copy
import importlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from services.common.settings import ServiceSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
BASE = COMPOSE_DIR / "docker-compose.yml"
OVERRIDES = {"gpu": COMPOSE_DIR / "gpu.yml", "rocm": COMPOSE_DIR / "rocm.yml"}
CONFIG_MODULES = ["api", "controller", "router", "reward", "trainer", "rollout", "runner"]

INTERPOLATION = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?+])?(?P<arg>[^}]*)\}|(?P<bare>[A-Za-z_]))"
)
UNION_LISTS = {
    "ports",
    "expose",
    "secrets",
    "configs",
    "devices",
    "group_add",
    "dns",
    "cap_add",
    "extra_hosts",
}

TEST_ENV = {"VERST_SGLANG_MODEL_PATH": "/data/models/base", "VERST_RENDER_GID": "109"}
"""What a user must set for the overrides (their required variables); the rest take defaults."""


def raw(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def interpolations(path: Path) -> list[re.Match[str]]:
    """Every ``$`` expression in the file (comments skipped: Compose does not read them)."""
    found = []
    for line in path.read_text().splitlines():
        code = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
        found += list(INTERPOLATION.finditer(code))
    return found


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """``value`` with every string interpolated from ``env``, as Compose does."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value
    return INTERPOLATION.sub(lambda match: _substitute(match, env), value)


def _substitute(match: re.Match[str], env: Mapping[str, str]) -> str:
    if match["escaped"]:
        return "$"
    if match["bare"]:
        raise ValueError(f"bare ${match['bare']}...: write ${{NAME}} or $$ for a literal $")
    name, op, arg = match["name"], match["op"] or "", match["arg"]
    value, is_set = env.get(name, ""), name in env
    present = bool(value) if op.startswith(":") else is_set
    if op.endswith("-"):
        return value if present else arg
    if op.endswith("?"):
        if not present:
            raise KeyError(f"{name}: {arg}")
        return value
    if op.endswith("+"):
        return arg if present else ""
    return value


def merge(base: Any, override: Any, key: str = "") -> Any:
    """``override`` merged onto ``base`` as `docker compose -f base -f override` merges them."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for name, value in override.items():
            merged[name] = merge(base[name], value, name) if name in base else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(override, list):
        if key == "volumes":
            by_target = {_mount_target(item): item for item in base}
            by_target.update({_mount_target(item): item for item in override})
            return list(by_target.values())
        if key in UNION_LISTS:
            return base + [item for item in override if item not in base]
    return copy.deepcopy(override)


def _mount_target(volume: str | dict[str, Any]) -> str:
    if isinstance(volume, dict):
        return str(volume["target"])
    return volume.split(":")[1]


def config(override: str | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The base file, with ``override`` merged onto it, interpolated (YAML anchors resolved)."""
    env = {**TEST_ENV, **(env or {})}
    loaded = interpolate(raw(BASE), env)
    if override is not None:
        loaded = merge(loaded, interpolate(raw(OVERRIDES[override]), env))
    return loaded


def verst_services(loaded: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run a verst process (`python -m services.X`)."""
    return {
        name: svc
        for name, svc in loaded["services"].items()
        if svc.get("command", [])[:3] and svc["command"][:2] == ["python", "-m"]
    }


def settings_classes() -> dict[str, type[ServiceSettings]]:
    classes: dict[str, type[ServiceSettings]] = {}
    for name in CONFIG_MODULES:
        module = importlib.import_module(f"services.{name}.config")
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, ServiceSettings)
                and value is not ServiceSettings
            ):
                classes[value.service_name] = value
    return classes


def settings_for(command: list[str]) -> type[ServiceSettings]:
    """The settings class of the process a compose command starts."""
    module = command[2]
    name = {"services.rollout": "rollout-engine"}.get(module, module.removeprefix("services."))
    return settings_classes()[name]


def env_names(cls: type[ServiceSettings]) -> set[str]:
    return {cls.env_name(field) for field in cls.model_fields}


def seconds(duration: str) -> float:
    """A Compose duration (``90s``, ``2m``, ``1m30s``) in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", duration)
    if not duration or parts is None:
        raise ValueError(f"not a duration: {duration!r}")
    hours, minutes, secs = (float(part or 0) for part in parts.groups())
    return hours * 3600 + minutes * 60 + secs
