"""User reward functions ("plugins"): a ScoreRequest whose verifier is ``module:function``.

A JobSpec names one as ``reward.plugin`` (it travels as ``ScoreRequest.verifier``); the
reward service imports the module once, on first use, from its own import path, and calls
the function for every request that names it. The contract is ``RewardPlugin``:

    def score(request: reward_pb2.ScoreRequest) -> float | PluginScore
    async def score(request: reward_pb2.ScoreRequest) -> float | PluginScore

``request`` is the whole ScoreRequest (response text and token ids, answer, prompt,
metadata, number of turns). The result is the reward, or a ``PluginScore`` mapping:
``{"reward": 0.5, "components": {"format": 1.0}, "info": {"parsed": "42"}}``. A sync
function runs on the service's verifier threads, an async one on its event loop (it must
not block it). A plugin that cannot be imported, raises, returns anything else, or passes
the call's deadline gives reward 0 with ``ScoreResponse.error`` saying why.

A plugin runs inside the reward service with its privileges. Modules of the standard
library and of verst itself are refused (``os:system`` is not a reward function), as are
names starting with ``_``; ``VERST_REWARD_PLUGIN_MODULES`` narrows plugins to listed
packages, and ``VERST_REWARD_PLUGINS_ENABLED=false`` turns them off.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol, Required, TypedDict

from services.common.pb import reward_pb2
from services.common.plugins import REFUSED_PACKAGES, load_function
from services.common.plugins import PluginError as LoadError

PLUGIN_NAME = re.compile(r"^[\w.]+:\w+$")
"""``module:function``, as ``RewardConfig.plugin`` validates it."""

PluginResult = tuple[float, dict[str, float], dict[str, str]]
"""(reward, components, info), as ``verifiers.VerifierResult``."""


class PluginScore(TypedDict, total=False):
    """What a plugin may return instead of a bare reward."""

    reward: Required[float]
    components: Mapping[str, float]
    info: Mapping[str, str]


class RewardPlugin(Protocol):
    """A user reward function: one ScoreRequest in, a reward (or a PluginScore) out."""

    def __call__(
        self, request: reward_pb2.ScoreRequest
    ) -> float | PluginScore | Awaitable[float | PluginScore]: ...


class PluginError(Exception):
    """A plugin may not or could not be loaded."""


class PluginResultError(PluginError):
    """A plugin returned something that is not a score."""


def is_plugin(name: str) -> bool:
    """Whether a verifier name names a plugin (built-in verifier names have no colon)."""
    return ":" in name


def to_result(value: Any) -> PluginResult:
    """(reward, components, info) of a plugin's return value; PluginResultError when it is not one."""
    if isinstance(value, Mapping):
        extra = sorted(set(value) - {"reward", "components", "info"})
        if extra or "reward" not in value:
            raise PluginResultError(
                f"expected a number or {{'reward', 'components', 'info'}}, got keys {sorted(value)}"
            )
        reward, components, info = value["reward"], value.get("components", {}), value.get("info", {})
    else:
        reward, components, info = value, {}, {}
    if not isinstance(reward, int | float) and not hasattr(reward, "__float__"):
        raise PluginResultError(f"the reward must be a number, got {type(reward).__name__}: {reward!r:.100}")
    if not isinstance(components, Mapping) or not isinstance(info, Mapping):
        raise PluginResultError("components and info must be mappings")
    try:
        reward = float(reward)
        components = {str(k): float(v) for k, v in components.items()}
    except (TypeError, ValueError) as err:
        raise PluginResultError(f"rewards and components must be numbers: {err}") from None
    if not math.isfinite(reward):
        raise PluginResultError(f"the reward is {reward}, not a finite number")
    return reward, components, {str(k): str(v) for k, v in info.items()}


class Plugins:
    """Loads each plugin once and calls it under a deadline."""

    def __init__(self, executor: Executor, *, enabled: bool = True, modules: Sequence[str] = ()) -> None:
        self._executor = executor
        self._enabled = enabled
        self._modules = tuple(modules)
        self._loaded: dict[str, asyncio.Future[RewardPlugin]] = {}

    def check(self, name: str) -> tuple[str, str]:
        """(module, function) of an allowed plugin name; PluginError when it is not allowed."""
        if not self._enabled:
            raise PluginError("plugins are turned off (VERST_REWARD_PLUGINS_ENABLED=false)")
        if PLUGIN_NAME.fullmatch(name) is None:
            raise PluginError(f"{name!r} is not module:function")
        module, function = name.split(":")
        if module.split(".")[0] in REFUSED_PACKAGES or function.startswith("_"):
            raise PluginError(f"{name!r} may not be a plugin (standard library, verst, or private)")
        if self._modules and not any(module == p or module.startswith(p + ".") for p in self._modules):
            raise PluginError(f"module {module!r} is not in VERST_REWARD_PLUGIN_MODULES")
        return module, function

    async def load(self, name: str) -> RewardPlugin:
        """The plugin, imported on a thread the first time (an import may be slow); a failed
        import stays failed until the service restarts, like a module that imported."""
        future = self._loaded.get(name)
        if future is None:
            module, function = self.check(name)
            loop = asyncio.get_running_loop()
            future = asyncio.ensure_future(loop.run_in_executor(self._executor, _import, module, function))
            self._loaded[name] = future
        return await asyncio.shield(future)  # a caller's deadline must not cancel the shared import

    async def score(self, name: str, request: reward_pb2.ScoreRequest, timeout_s: float) -> PluginResult:
        """Load and call the plugin, all within ``timeout_s``; raises whatever went wrong."""
        async with asyncio.timeout(timeout_s):
            plugin = await self.load(name)
            if _is_async(plugin):
                value = await plugin(request)  # type: ignore[misc]
            else:
                loop = asyncio.get_running_loop()
                value = await loop.run_in_executor(self._executor, plugin, request)
                if inspect.isawaitable(value):  # a sync callable that returned a coroutine
                    value = await value
        return to_result(value)


def _import(module: str, function: str) -> RewardPlugin:
    try:
        target = load_function(f"{module}:{function}")
    except LoadError as err:
        raise PluginError(str(err)) from None
    try:
        inspect.signature(target).bind(reward_pb2.ScoreRequest())
    except TypeError as err:
        raise PluginError(f"{module}:{function} does not take one ScoreRequest: {err}") from None
    except ValueError:  # a builtin without a signature: calling it will tell
        pass
    return target


def _is_async(plugin: Callable[..., Any]) -> bool:
    call = getattr(plugin, "__call__", None)  # noqa: B004 - an object with an async __call__
    return inspect.iscoroutinefunction(plugin) or inspect.iscoroutinefunction(call)
