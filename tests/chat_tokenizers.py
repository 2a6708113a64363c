"""Tiny character tokenizers with real Jinja chat templates, for tests of chat prompts.

Each character is a token and the template markers are special tokens, so ids are easy to read
and a rendering can be compared with the tokenizer's own ``apply_chat_template``.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""SmolLM2-Instruct's chat template (ChatML), as its tokenizer carries it."""
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""Llama 3's shape: the template itself emits BOS."""
THINKING = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{% endif %}"
)
"""Qwen 3's switch: ``enable_thinking=False`` opens the answer with an empty thought."""
MARKERS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)


def chat_tokenizer(
    template: str | None = CHATML, *, bos: str = "<s>", eos: str = "<|im_end|>"
) -> PreTrainedTokenizerFast:
    """A character tokenizer whose template markers are special tokens, with ``template``."""
    vocab = {token: index for index, token in enumerate(("<pad>", "<s>", "</s>", "<unk>", *MARKERS))}
    for char in ["\n", *map(chr, range(32, 127))]:
        vocab[char] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [m for m in MARKERS if m not in (bos, eos)]})
    tokenizer.chat_template = template
    return tokenizer
