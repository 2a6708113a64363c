"""``encode_text``: a text prompt's ids through the fast tokenizer's backend, exactly as
``tokenizer(text, add_special_tokens=False)`` gives them, and through ``__call__`` whenever the
backend is set otherwise."""

from __future__ import annotations

from unittest import mock

import pytest
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from services.data import PromptExample, encode_prompt
from services.data.prompts import encode_text
from tests.chat_tokenizers import chat_tokenizer

TEXTS = ("12+34=", "", "a  b\n\tc", "<|im_start|>user\nhi<|im_end|>", "naïve ☃ text", "<s>x</s>")


def called(tokenizer: object, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]


@pytest.mark.parametrize("text", TEXTS)
def test_the_backend_gives_the_ids_call_gives(text: str) -> None:
    tokenizer = chat_tokenizer()
    expected = called(tokenizer, text)
    with mock.patch.object(PreTrainedTokenizerBase, "__call__", side_effect=AssertionError("__call__")):
        assert encode_text(tokenizer, text) == expected  # and __call__ was not needed


def test_special_tokens_split_as_the_tokenizer_says() -> None:
    tokenizer = chat_tokenizer()
    text = "<|im_start|>hi"
    whole = encode_text(tokenizer, text)
    tokenizer.split_special_tokens = True
    split = encode_text(tokenizer, text)  # the backend still encodes special tokens whole: __call__
    assert split == called(tokenizer, text) and len(split) > len(whole)
    with mock.patch.object(PreTrainedTokenizerBase, "__call__", side_effect=AssertionError("__call__")):
        assert encode_text(tokenizer, text) == split  # __call__ set the backend: now it is used


def test_a_backend_set_to_truncate_or_pad_is_not_used_as_it_is() -> None:
    tokenizer = chat_tokenizer()
    text = "a prompt longer than four tokens"
    full = called(tokenizer, text)
    tokenizer.backend_tokenizer.enable_truncation(4)
    assert encode_text(tokenizer, text) == full
    tokenizer.backend_tokenizer.enable_padding(length=64, pad_id=0)
    assert encode_text(tokenizer, text) == full


def test_a_text_prompt_is_encoded_through_it_with_bos_first() -> None:
    tokenizer = chat_tokenizer(None)
    ids = encode_prompt(tokenizer, PromptExample("p", "12+34=", ""))
    assert ids == [tokenizer.bos_token_id, *called(tokenizer, "12+34=")]
