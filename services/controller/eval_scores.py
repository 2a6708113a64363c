"""What an evaluation reports of one held-out set, from each prompt's scored answers.

- ``accuracy``: the fraction of prompts whose greedy answer is right; ``reward_mean``: the greedy
  answers' mean reward. An answer is right when its reward is at least ``RIGHT`` (the verifier's
  "fully correct"; verst's verifiers score a right answer 1.0).
- With ``eval.samples_per_prompt`` = n > 0, n more answers per prompt sampled at
  ``eval.temperature``: ``mean@n``, the mean over prompts of the fraction of its n answers that
  are right, and ``pass@k`` for each k of ``eval.pass_k``, the unbiased estimator of Chen et al.
  2021 ("Evaluating Large Language Models Trained on Code", eq. 1): with c of a prompt's n
  answers right, the chance that k of them drawn without replacement hold a right one,
  ``1 - C(n-c, k) / C(n, k)``, averaged over prompts.
- ``errors``: answers (greedy or sampled) that could not be generated or scored; each counts as
  wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from math import comb

RIGHT = 1.0
"""An answer is right when its reward is at least this."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` of ``n`` sampled answers right."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every draw of k holds a right answer
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)  # exact integers; one correctly rounded division


@dataclass(frozen=True, slots=True)
class PromptOutcome:
    """One prompt's scored answers."""

    greedy_reward: float
    """The greedy answer's reward (0 when it failed)."""
    samples: int = 0
    """Sampled answers (n)."""
    samples_right: int = 0
    """Sampled answers that are right (c)."""
    failed: int = 0
    """Answers, greedy or sampled, that could not be generated or scored."""


@dataclass(frozen=True, slots=True)
class SetScores:
    """One set's results in one evaluation."""

    accuracy: float
    reward_mean: float
    num_prompts: int
    errors: int
    samples: int = 0
    """Sampled answers per prompt (n); 0: none were sampled."""
    mean_at_n: float = 0.0
    pass_at: dict[int, float] = field(default_factory=dict)
    """pass@k by k."""

    def metric_values(self, prefix: str = "") -> dict[str, float]:
        """The metrics as the job records them, each name after ``prefix`` (a named set's ``<name>/``)."""
        values = {
            "accuracy": self.accuracy,
            "reward_mean": self.reward_mean,
            "num_prompts": float(self.num_prompts),
            "errors": float(self.errors),
        }
        if self.samples:
            values[f"mean@{self.samples}"] = self.mean_at_n
            values |= {f"pass@{k}": value for k, value in self.pass_at.items()}
        return {f"{prefix}{name}": value for name, value in values.items()}


def set_scores(outcomes: Sequence[PromptOutcome], pass_k: Sequence[int]) -> SetScores:
    """A set's scores from its prompts' outcomes (each with the same number of samples)."""
    count = len(outcomes)
    if count == 0:
        raise ValueError("a set's scores need at least one prompt")
    samples = outcomes[0].samples
    if any(outcome.samples != samples for outcome in outcomes):
        raise ValueError("every prompt of a set has the same number of sampled answers")
    scores = SetScores(
        accuracy=sum(1 for o in outcomes if o.greedy_reward >= RIGHT) / count,
        reward_mean=sum(o.greedy_reward for o in outcomes) / count,
        num_prompts=count,
        errors=sum(o.failed for o in outcomes),
        samples=samples,
    )
    if not samples:
        return scores
    mean = sum(o.samples_right / samples for o in outcomes) / count
    passes = {k: sum(pass_at_k(samples, o.samples_right, k) for o in outcomes) / count for k in pass_k}
    return replace(scores, mean_at_n=mean, pass_at=passes)
