"""decode_texts gives exactly what ``tokenizer.decode(ids, skip_special_tokens=True)`` gives."""

from __future__ import annotations

import random
from typing import Any

from transformers import PreTrainedTokenizerFast

from services.common.job_tokenizer import decode_texts
from services.tasks.addition_model import build_char_tokenizer
from services.tasks.multiply_model import build_tool_tokenizer
from tests.chat_tokenizers import chat_tokenizer


def one_by_one(tokenizer: Any, sequences: list[list[int]]) -> list[str]:
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in sequences]


def random_sequences(tokenizer: Any, count: int = 40) -> list[list[int]]:
    rng = random.Random(7)
    vocab = len(tokenizer)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(0, 30))] for _ in range(count)]


def test_fast_tokenizers_decode_as_decode_does_special_tokens_skipped() -> None:
    for tokenizer in (build_char_tokenizer(), build_tool_tokenizer(), chat_tokenizer()):
        sequences = random_sequences(tokenizer)
        assert any(set(ids) & set(tokenizer.all_special_ids) for ids in sequences)
        assert decode_texts(tokenizer, sequences) == one_by_one(tokenizer, sequences)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_clean_up() -> None:
    tokenizer = chat_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True  # WordLevel, not BPE: transformers cleans up
    sequences = [tokenizer.encode("a , b . c ' s", add_special_tokens=False)]
    assert one_by_one(tokenizer, sequences) == ["a, b. c's"]
    assert decode_texts(tokenizer, sequences) == ["a, b. c's"]


def test_a_subclass_with_its_own_decode_is_asked_one_by_one() -> None:
    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids: Any, **kwargs: Any) -> str:
            return str(super()._decode(token_ids, **kwargs)).upper()

    base = chat_tokenizer()
    shouting = Shouting(tokenizer_object=base.backend_tokenizer)
    sequences = [base.encode("quiet", add_special_tokens=False)]
    assert decode_texts(shouting, sequences) == ["QUIET"]


def test_protobuf_repeated_fields_and_tuples_are_sequences_too() -> None:
    from services.common.pb import rollout_pb2

    tokenizer = build_char_tokenizer()
    completion = rollout_pb2.Completion(token_ids=tokenizer.encode("1+2=3", add_special_tokens=False))
    assert decode_texts(tokenizer, [completion.token_ids, (0,)]) == one_by_one(
        tokenizer, [list(completion.token_ids), [0]]
    )
