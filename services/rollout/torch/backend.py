"""``VERST_ENGINE_BACKEND=torch``: the TorchEngine with the engine's device, dtype and batching."""

from __future__ import annotations

from services.rollout.config import EngineSettings
from services.rollout.torch.engine import TorchEngine
from services.rollout.torch.model import DTYPES, resolve_device


async def open_torch_engine(settings: EngineSettings) -> TorchEngine:
    """A started TorchEngine with the settings' device, dtype and batching."""
    engine = TorchEngine(
        device=resolve_device(settings.device),
        dtype=None if settings.dtype == "auto" else DTYPES[settings.dtype],
        max_batch_size=settings.max_batch_size,
        max_batch_tokens=settings.max_batch_tokens,
        batch_wait_s=settings.batch_wait_ms / 1000.0,
        max_prefill_tokens=settings.max_prefill_tokens,
        default_update_mode=settings.default_update_mode,
        compile_decode=settings.compile_decode,
    )
    engine.start()
    return engine
