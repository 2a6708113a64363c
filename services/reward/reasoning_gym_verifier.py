"""The ``reasoning_gym`` verifier: a reasoning-gym row scored by its own dataset's ``score_answer``.

Rows of the ``reasoning_gym`` data source (``services/data/reasoning_gym.py``) carry in their
metadata the dataset, its configuration, the whole entry and the extractor the job chose
(``data.options.extractor``); the verifier takes the answer out of the response with that
extractor and asks ``score_answer(answer, entry)`` of the dataset made with that configuration:

- ``answer_tag``: reasoning-gym's own ``extract_answer``, the last ``<answer>…</answer>`` (what
  its instructions ask for); a response without one gives ``score_answer`` None;
- ``last_number``: the last number of the response, as the ``numeric`` verifier reads it;
- ``whole``: the whole response, stripped.

The reward is the dataset's score (some give partial credit: chain_sum a fraction for an answer
that holds the right one among other text). Components: ``correct`` (1.0 when the score is 1.0:
held-out accuracy counts a reward of at least 1), ``score`` (the score itself) and ``parsed``
(the extractor found an answer). A row without the metadata raises: it is an error, not a zero.

reasoning-gym is imported on the first score, never when the service starts.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from services.data.reasoning_gym import create_dataset, gym_row

GymResult = tuple[float, dict[str, float], dict[str, str]]
"""(reward, components, info), as ``verifiers.VerifierResult``."""
NumberParser = Callable[[str], "tuple[float, str] | None"]
"""The value and text of a text's last number, or None (``verifiers.last_number``)."""


@functools.lru_cache(maxsize=64)
def scorer(dataset: str, config: str) -> Callable[[str | None, dict[str, Any]], float]:
    """``score_answer`` of ``dataset`` made with ``config`` (JSON), made once per configuration:
    some scorers read their configuration (arc_agi's board format), some datasets load files."""
    return create_dataset(dataset, json.loads(config)).score_answer


@dataclass(frozen=True)
class ReasoningGymVerifier:
    """Scores a reasoning-gym row (the module docstring says how)."""

    last_number: NumberParser
    """How ``last_number`` finds a number: verifiers.py passes its own, so both read numbers alike."""

    def __call__(self, response_text: str, answer: str, metadata: Mapping[str, str]) -> GymResult:
        row = gym_row(metadata)
        extracted = self.extract(row.extractor, response_text)
        score = float(scorer(row.dataset, row.config)(extracted, row.entry))
        if not math.isfinite(score):
            raise ValueError(f"reasoning-gym's {row.dataset} scored {extracted!r:.100} as {score}")
        components = {"correct": float(score >= 1.0), "score": score, "parsed": float(extracted is not None)}
        return score, components, {"parsed": extracted or "", "dataset": row.dataset}

    def extract(self, extractor: str, response_text: str) -> str | None:
        """The answer in ``response_text`` by ``extractor``; None when it finds none."""
        if extractor == "answer_tag":
            from reasoning_gym.utils import extract_answer

            return extract_answer(response_text, tag_name="answer", strip=True)
        if extractor == "last_number":
            number = self.last_number(response_text)
            return None if number is None else number[1].replace(",", "").replace(" ", "")
        if extractor == "whole":
            return response_text.strip()
        raise ValueError(f"unknown extractor {extractor!r}")
