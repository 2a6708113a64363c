"""The one evaluator of bench/e2e.py: held-out greedy accuracy of a saved Hugging Face model
directory, with plain transformers, the same code for the checkpoints of both sides."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.e2e_runs import Run


class Evaluator:
    """Greedy held-out accuracy of checkpoints; the tokenizer is the base model's for all of them."""

    def __init__(
        self,
        tokenizer_dir: Path,
        examples: Sequence[Any],
        correct: Callable[[str, Any], bool],
        max_new_tokens: int,
        encode: Callable[[Any, Any], list[int]],
        batch_size: int = 256,
    ) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.examples = list(examples)
        self.correct = correct
        """(response text, example) -> whether it is right (the task's exact-match component)."""
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.prompts = [encode(self.tokenizer, example) for example in self.examples]
        """Each example's prompt ids as verst's controller encodes them (``BenchTask.encode``)."""
        self.base: dict[Path, float] = {}
        """Accuracy of the base model, which every run starts from."""

    @torch.no_grad()
    def accuracy(self, model_dir: Path) -> float:
        """Fraction of the held-out prompts whose greedy response is right (``correct``)."""
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        right = 0
        for first in range(0, len(self.prompts), self.batch_size):
            rows = self.prompts[first : first + self.batch_size]
            examples = self.examples[first : first + self.batch_size]
            responses = self._greedy(model, rows)
            right += sum(self.correct(text, ex) for text, ex in zip(responses, examples, strict=True))
        return right / len(self.prompts)

    def _greedy(self, model: Any, prompts: list[list[int]]) -> list[str]:
        """Left-padded batched greedy decoding: every response starts at the same column."""
        pad = self.tokenizer.pad_token_id
        width = max(len(ids) for ids in prompts)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        return self.tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)

    def evaluate(self, run: Run, base_dir: Path, *, keep: bool = False) -> None:
        """Fill in the accuracy of every point of ``run`` (step 0 is the base model); then delete the
        run's checkpoint copies unless ``keep``."""
        for point in run.points:
            if point.step == 0:
                if base_dir not in self.base:
                    self.base[base_dir] = self.accuracy(base_dir)
                point.accuracy = self.base[base_dir]
            else:
                point.accuracy = self.accuracy(Path(point.checkpoint))
        if keep:
            return
        for point in run.points:
            if point.step and point.checkpoint:
                shutil.rmtree(point.checkpoint, ignore_errors=True)
                point.checkpoint = ""
