"""Engine backends by the name ``VERST_ENGINE_BACKEND`` gives: each opens an ``Engine``
(engine_protocol.py) that the one Rollout servicer serves.

``torch`` runs the model in this process (services/rollout/torch/), ``sglang`` drives SGLang
servers over HTTP (services/rollout/sglang/). A backend of one's own is an async function
``open_engine(settings: EngineSettings) -> Engine | None`` named as ``module:function``
(None: a signal stopped it while starting); docs/extending.md has the recipe. Both built-ins are
registered lazily: choosing SGLang never imports the torch engine, nor the reverse.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.common.registry import Entry, Registry
from services.rollout.config import EngineSettings
from services.rollout.engine_protocol import Engine

OpenEngine = Callable[[EngineSettings], Awaitable[Engine | None]]
"""How a backend starts its Engine from the engine's settings."""
SettingsCheck = Callable[[EngineSettings], str | None]
"""What is wrong with the settings for a backend (a message naming the variable), or None."""


@dataclass(frozen=True, slots=True)
class EngineBackend(Entry[OpenEngine]):
    """A generation backend and what the engine process does for it."""

    in_process: bool = False
    """Runs the model in this process: VERST_ENGINE_DEVICE and _TORCH_THREADS apply to it."""
    check_settings: SettingsCheck | None = None
    """Checked at start-up, before anything opens: a bad setting stops the process at once."""


ENGINE_BACKENDS: Registry[EngineBackend] = Registry(
    EngineBackend, kind="engine backend", field="VERST_ENGINE_BACKEND", owner="engine"
)
"""Every backend by the name VERST_ENGINE_BACKEND uses (or a user's ``module:function``)."""


def _sglang_servers_named(settings: EngineSettings) -> str | None:
    if settings.sglang_urls.strip() or settings.sglang_model_path:
        return None
    urls, path = EngineSettings.env_name("sglang_urls"), EngineSettings.env_name("sglang_model_path")
    return f"invalid setting {urls}: set it (attach) or {path} (launch)"


ENGINE_BACKENDS.register_lazy("torch", "services.rollout.torch.backend:open_torch_engine", in_process=True)
ENGINE_BACKENDS.register_lazy(
    "sglang", "services.rollout.sglang.engine:open_sglang_engine", check_settings=_sglang_servers_named
)
