"""LoRA's parts: the JobSpec section, the torch engine's merge against peft's, the adapters it
refuses, a backend without adapters refusing an adapter handle, the trainer's check of a saved
adapter, and the view of a job's saved versions that the export reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from google.protobuf import json_format
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file

from services.common.checkpoint_layout import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    HANDLE_FILE,
    WEIGHTS_HANDLE_FILE,
    SavedVersions,
)
from services.common.config import JobSpecError, parse_job_spec
from services.common.pb import common_pb2
from services.rollout.engine_protocol import AdapterEngine
from services.rollout.sglang.backend import SGLangBackend
from services.rollout.sglang.engine import SGLangEngine
from services.rollout.torch.adapters import lora_deltas, read_adapter
from services.rollout.torch.engine import TorchEngine
from services.rollout.transport import serve_handle
from services.rollout.weights import CheckpointError, file_sha256
from services.trainer.adapters import check_saved_config, wrap
from tests.integration.rollout_helpers import tiny_llama


def test_the_lora_section_is_typed_and_names_its_fields() -> None:
    spec = parse_job_spec({"model": {"lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]}}})
    assert spec.model.lora is not None and (spec.model.lora.rank, spec.model.lora.alpha) == (8, 32.0)
    assert parse_job_spec({}).model.lora is None
    for bad, field in [
        ({"rank": 0}, "model.lora.rank"),
        ({"dropout": 1.0}, "model.lora.dropout"),
        ({"target_modules": []}, "model.lora.target_modules"),
        ({"target_modules": ["q proj"]}, "model.lora.target_modules"),
        ({"ranks": 4}, "model.lora.ranks"),
    ]:
        with pytest.raises(JobSpecError, match=field):
            parse_job_spec({"model": {"lora": bad}})


def peft_adapter(tmp_path: Path, **options: object) -> tuple[torch.nn.Module, Path]:
    """A tiny Llama with a LoRA adapter whose B is random, saved by peft; the merged model."""
    config = LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear", task_type="CAUSAL_LM", **options)
    wrapped = get_peft_model(tiny_llama(0, heads=2), config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    wrapped.save_pretrained(tmp_path)
    return wrapped.merge_and_unload(), tmp_path


@pytest.mark.parametrize("options", [{}, {"use_rslora": True}], ids=["plain", "rslora"])
def test_the_engines_merge_is_peft_merge(tmp_path: Path, options: dict[str, object]) -> None:
    merged, directory = peft_adapter(tmp_path, **options)
    base = tiny_llama(0, heads=2).state_dict()
    config, tensors = read_adapter(directory, file_sha256(directory / ADAPTER_WEIGHTS_FILE))
    deltas = lora_deltas(config, tensors)
    assert len(deltas) == 14 and all(name.endswith("_proj.weight") for name in deltas)
    for name, weight in merged.state_dict().items():
        expected = base[name] + deltas[name] if name in deltas else base[name]
        assert torch.allclose(weight, expected, atol=1e-6), name
    assert any(delta.abs().max() > 1e-2 for delta in deltas.values())


def test_adapters_the_merge_does_not_cover_are_refused(tmp_path: Path) -> None:
    _, directory = peft_adapter(tmp_path)
    sha = file_sha256(directory / ADAPTER_WEIGHTS_FILE)
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        read_adapter(directory, "0" * 64)
    config, tensors = read_adapter(directory, sha)
    for odd, match in [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "not LoRA"),
    ]:
        with pytest.raises(CheckpointError, match=match):
            lora_deltas(config | odd, tensors)
    embedding = {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 99)}
    with pytest.raises(CheckpointError, match="cannot merge"):
        lora_deltas(config, tensors | embedding)
    lone = {k: v for k, v in tensors.items() if "layers.0.self_attn.q_proj.lora_B" not in k}
    with pytest.raises(CheckpointError, match="alone"):
        lora_deltas(config, lone)


async def test_a_backend_without_adapters_refuses_an_adapter_handle(tmp_path: Path) -> None:
    """The SGLang engine does not apply LoRA adapters: it must not serve the base as the job."""
    client = SGLangBackend(["http://sglang.test"])
    sglang = SGLangEngine(client)
    handle = common_pb2.CheckpointHandle(job_id="j", version=3, uri=tmp_path.as_uri(), sha256="ab")
    handle.adapter.CopyFrom(common_pb2.LoraAdapter(base_uri=tmp_path.as_uri(), base_sha256="cd"))
    try:
        assert not isinstance(sglang, AdapterEngine)
        with pytest.raises(CheckpointError, match="LoRA adapter, and the sglang backend does not apply"):
            await serve_handle(sglang, None, handle, 0, 5.0)
    finally:
        await client.close()
    torch_engine = TorchEngine(
        device=torch.device("cpu"), dtype=torch.float32, max_batch_size=1, batch_wait_s=0
    )
    assert isinstance(torch_engine, AdapterEngine)


def test_a_saved_adapter_must_be_the_jobs(tmp_path: Path) -> None:
    lora = parse_job_spec({"model": {"lora": {"rank": 4, "alpha": 8}}}).model.lora
    assert lora is not None
    check_saved_config({"r": 4, "lora_alpha": 8, "peft_type": "LORA"}, lora, tmp_path)
    for saved, match in [
        ({"r": 8, "lora_alpha": 8}, "rank 8"),
        ({"r": 4, "lora_alpha": 16}, "alpha 16"),
        ({"r": 4, "lora_alpha": 8, "use_dora": True}, "use_dora"),
        ({"r": 4, "lora_alpha": 8, "peft_type": "IA3"}, "IA3"),
    ]:
        with pytest.raises(ValueError, match=f"model.lora.init_from: .*{match}"):
            check_saved_config(saved, lora, tmp_path)


def saved(directory: Path, name: str, epoch: int, version: int, *, durable: bool = False) -> None:
    directory.mkdir(parents=True)
    handle = common_pb2.CheckpointHandle(job_id="j", version=version, epoch=epoch, durable=durable)
    (directory / (HANDLE_FILE if durable else WEIGHTS_HANDLE_FILE)).write_text(
        json_format.MessageToJson(handle)
    )
    (directory / name).write_bytes(b"")


def test_the_saved_versions_prefer_the_newest_lineage(tmp_path: Path) -> None:
    job = tmp_path / "j"
    saved(job / "v000002", "model.safetensors", 1, 2, durable=True)
    saved(job / "weights" / "v000002-e1", "model.safetensors", 1, 2)
    saved(job / "weights" / "v000004-e1", "model.safetensors", 1, 4)  # a lost lineage's
    saved(job / "weights" / "v000003-e2", "model.safetensors", 2, 3)
    (job / "weights" / ".v000005-e2.tmp-1").mkdir()  # a save in progress: not a version
    versions = SavedVersions(tmp_path, "j")
    assert [(s.key, s.handle.durable) for s in versions.all()] == [
        ((1, 2), True),
        ((1, 4), False),
        ((2, 3), False),
    ]
    assert versions.find().key == (2, 3) and versions.find(2).directory == (job / "v000002").resolve()
    with pytest.raises(LookupError, match=r"no saved v5 .*v2 \(epoch 1, durable\), v4 .*, v3 \(epoch 2"):
        versions.find(5)
    with pytest.raises(LookupError, match="no saved any version"):
        SavedVersions(tmp_path, "other").find()


def test_an_adapter_directory_needs_its_config(tmp_path: Path) -> None:
    save_file({"x": torch.zeros(1)}, str(tmp_path / ADAPTER_WEIGHTS_FILE))
    with pytest.raises(CheckpointError, match=ADAPTER_CONFIG_FILE):
        read_adapter(tmp_path, file_sha256(tmp_path / ADAPTER_WEIGHTS_FILE))
    (tmp_path / ADAPTER_CONFIG_FILE).write_text(json.dumps({"r": 0}))
    config, _ = read_adapter(tmp_path, file_sha256(tmp_path / ADAPTER_WEIGHTS_FILE))
    with pytest.raises(CheckpointError, match="rank 0"):
        lora_deltas(config, {})


def test_targets_that_match_no_module_name_the_field() -> None:
    lora = parse_job_spec({"model": {"lora": {"target_modules": ["no_such_proj"]}}}).model.lora
    assert lora is not None
    with pytest.raises(ValueError, match=r"model.lora.target_modules: .*no_such_proj"):
        wrap(tiny_llama(0, heads=2), lora, None)
    wrapped = wrap(tiny_llama(0, heads=2), lora.model_copy(update={"target_modules": ["q_proj"]}), None)
    trained = [name for name, p in wrapped.named_parameters() if p.requires_grad]
    assert len(trained) == 4 and all("q_proj.lora_" in name for name in trained)


def test_the_merge_transposes_for_fan_in_fan_out_layers(tmp_path: Path) -> None:
    """GPT-2's Conv1D layers store their weight transposed: peft says so with fan_in_fan_out."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32))
    base = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    config = LoraConfig(r=4, lora_alpha=8.0, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    wrapped = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    wrapped.save_pretrained(tmp_path)
    merged = wrapped.merge_and_unload().state_dict()
    adapter, tensors = read_adapter(tmp_path, file_sha256(tmp_path / ADAPTER_WEIGHTS_FILE))
    deltas = lora_deltas(adapter, tensors)
    assert adapter["fan_in_fan_out"] and len(deltas) == 6
    for name, weight in merged.items():
        assert torch.allclose(weight, base[name] + deltas[name] if name in deltas else base[name], atol=1e-6)
