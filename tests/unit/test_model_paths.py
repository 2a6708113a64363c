"""Model paths (services/models/): local directories, hub ids from a local Hugging Face cache laid
out as huggingface_hub lays it out (never the network), GGUF files named by suffix or by
``model.gguf_file``, and the spec's own checks of ``gguf_file``."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from services.common.config import JobSpecError, parse_job_spec
from services.models import (
    Kind,
    ModelPathError,
    locate,
    prepared_model_path,
    readable_problem,
    resolve_model_path,
)
from services.tasks.addition_model import build_char_tokenizer

REPO = "verst-tests/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def save_tiny_model(directory: Path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory)
    build_char_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face hub cache holding REPO at REVISION (``models--org--name/snapshots/<rev>`` and
    ``refs/main``), made the process's cache; any network connection fails the test."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    save_tiny_model(repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    return cache


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(hub_cache: Path) -> None:
    snapshot = resolve_model_path(REPO)
    assert snapshot == hub_cache / f"models--verst-tests--tiny-llama/snapshots/{REVISION}"
    assert locate(REPO).kind is Kind.HUB
    model = AutoModelForCausalLM.from_pretrained(snapshot)
    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    assert model.config.hidden_size == 16 and tokenizer("1+2=", add_special_tokens=False).input_ids


def test_a_hub_id_missing_from_the_cache_says_so(hub_cache: Path) -> None:
    with pytest.raises(
        ModelPathError, match=r"'verst-tests/absent' is not a local path, and the hub id is not in"
    ):
        resolve_model_path("verst-tests/absent")
    with pytest.raises(ModelPathError, match="does not exist"):
        resolve_model_path("/no/such/dir")  # not spelled as a hub id: no cache lookup


def test_a_local_directory_wins_over_a_hub_id_of_the_same_spelling(
    hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = save_tiny_model(tmp_path / "work" / REPO)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model_path(REPO) == local.resolve()
    assert locate(REPO).kind is Kind.DIRECTORY


def test_a_gguf_file_is_found_by_suffix_or_inside_a_directory_or_hub_snapshot(
    hub_cache: Path, tmp_path: Path
) -> None:
    snapshot = hub_cache / f"models--verst-tests--tiny-llama/snapshots/{REVISION}"
    for directory in (tmp_path, snapshot):
        (directory / "tiny.Q8_0.gguf").write_bytes(b"GGUF" + bytes(60))
    assert locate(str(tmp_path / "tiny.Q8_0.gguf")).gguf == tmp_path / "tiny.Q8_0.gguf"
    assert locate(str(tmp_path), "tiny.Q8_0.gguf").gguf == tmp_path / "tiny.Q8_0.gguf"
    found = locate(REPO, "tiny.Q8_0.gguf")
    assert found.kind is Kind.GGUF and found.gguf == snapshot / "tiny.Q8_0.gguf"
    assert readable_problem(found) is None
    assert prepared_model_path(REPO, "tiny.Q8_0.gguf") is None  # not converted: the api skips its tokenizer
    with pytest.raises(ModelPathError, match=r"has no GGUF file 'other\.gguf'"):
        locate(REPO, "other.gguf")
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf")
    assert "lacks the GGUF magic" in str(readable_problem(locate(str(tmp_path / "fake.gguf"))))


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"path": "/models", "gguf_file": "x.bin"}, "must be a .gguf file's path relative to model.path"),
        ({"path": "/models", "gguf_file": "../x.gguf"}, "must be a .gguf file's path relative to model.path"),
        ({"path": "builtin:addition", "gguf_file": "x.gguf"}, "needs model.path to be a directory or hub id"),
        ({"path": "/m/x.gguf", "gguf_file": "y.gguf"}, "needs model.path to be a directory or hub id"),
    ],
)
def test_the_spec_refuses_a_gguf_file_outside_its_path(model: dict[str, str], message: str) -> None:
    with pytest.raises(JobSpecError, match=r"model\.gguf_file") as caught:
        parse_job_spec({"model": model})
    assert message in str(caught.value)
