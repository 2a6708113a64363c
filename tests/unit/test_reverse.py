"""The reverse task (the race's compute-bound task): its prompts and splits, its partial-credit
score and exact-match accuracy, its verifier in the reward service, its base model's recipe and a
tiny build (seconds), and its entry among the race's tasks."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from bench.e2e_runs import Hyper
from bench.e2e_tasks import BENCH_TASKS
from bench.e2e_trl import trl_config
from bench.e2e_verst import job_spec
from services.common.config import parse_job_spec
from services.common.pb import reward_pb2
from services.data import encode_prompt
from services.reward.config import RewardSettings
from services.reward.server import RewardServicer
from services.reward.verifiers import VERIFIER_REGISTRY, VERIFIERS
from services.tasks import builtin_model, ensure_builtin_model, get_task
from services.tasks.models import read_stamp
from services.tasks.reverse import (
    REVERSE_EVAL_SIZE,
    ReverseProblem,
    ReverseRecipe,
    reverse_eval_problems,
    reverse_train_problems,
    score_reverse,
)
from services.tasks.reverse_model import build_reverse_model, build_reverse_tokenizer, warm_up_reverse
from services.tasks.tiny_llama import tiny_llama_config

TINY = ReverseRecipe(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, steps=3, batch_size=4
)
"""Same code path as the real recipe, a tiny fraction of the work."""


def test_prompt_is_the_letters_and_the_answer_is_them_reversed() -> None:
    problem = ReverseProblem("abcdefgh")
    assert (problem.prompt, problem.answer) == ("abcdefgh=", "hgfedcba")
    example = get_task("reverse").eval()[0]
    assert example.prompt_id == "reverse:eval:0"
    assert example.text.endswith("=") and example.answer == example.text[:-1][::-1]


def test_eval_split_is_fixed_distinct_and_well_formed() -> None:
    problems = reverse_eval_problems()
    assert len(set(problems)) == len(problems) == REVERSE_EVAL_SIZE
    assert all(8 <= len(p.letters) <= 16 and p.letters.isalpha() and p.letters.islower() for p in problems)
    assert {len(p.letters) for p in problems} == set(range(8, 17))  # every length is held out
    reverse_eval_problems.cache_clear()
    assert reverse_eval_problems() == problems


def test_train_split_is_seeded_and_never_yields_an_eval_string() -> None:
    held_out = set(reverse_eval_problems())
    first = list(itertools.islice(reverse_train_problems(5), 3000))
    assert not held_out & set(first)
    assert first == list(itertools.islice(reverse_train_problems(5), 3000))
    assert first != list(itertools.islice(reverse_train_problems(6), 3000))
    # the train stream would produce an eval string if it were not filtered out
    stream = reverse_train_problems(0)
    assert all(next(stream) not in held_out for _ in range(100))


@pytest.mark.parametrize(
    ("response", "reward", "exact"),
    [
        ("hgfedcba", 1.0, 1.0),
        (" hgfedcba\n", 1.0, 1.0),  # surrounding whitespace is not an answer's
        ("hgfedcbx", 7 / 8, 0.0),  # one letter wrong
        ("hgfedc", 6 / 8, 0.0),  # stopped early: the missing positions count as wrong
        ("hgfedcbaaa", 8 / 10, 0.0),  # ran on: over the longer length
        ("abcdefgh", 0.0, 0.0),  # the prompt copied, not reversed
        ("", 0.0, 0.0),
    ],
)
def test_score_gives_partial_credit_and_exact_match_apart(response: str, reward: float, exact: float) -> None:
    got, components = score_reverse(response, "hgfedcba")
    assert got == pytest.approx(reward)
    assert components["positions"] == pytest.approx(reward)
    assert components["exact"] == exact
    assert get_task("reverse").is_correct(response, "hgfedcba") is (exact == 1.0)


def test_only_an_exact_answer_scores_one() -> None:
    assert score_reverse("hgfedcba", "hgfedcba")[0] == 1.0
    assert max(score_reverse(r, "hgfedcba")[0] for r in ("hgfedcbaa", "hgfedcb", "ggfedcba")) < 1.0
    assert score_reverse("hgfedcba", "hgfedcba")[1]["format"] == 1.0
    assert score_reverse("hgf3dcba", "hgfedcba")[1]["format"] == 0.0


def test_accuracy_counts_exact_match_on_reverse_and_the_reward_on_addition() -> None:
    reverse, addition = get_task("reverse"), get_task("addition")
    assert (reverse.accuracy, addition.accuracy) == ("exact", "correct")
    assert not reverse.is_correct("hgfedcbx", "hgfedcba")
    assert addition.is_correct("231", "231") and not addition.is_correct("23", "231")
    assert not BENCH_TASKS["reverse"].correct()("hgfedcbx", "hgfedcba")
    assert BENCH_TASKS["reverse"].scorer()("hgfedcbx", "hgfedcba") == pytest.approx(7 / 8)


async def test_the_reward_service_scores_reverse_by_name() -> None:
    assert VERIFIER_REGISTRY.get("reverse").fn is VERIFIERS["reverse"]
    servicer = RewardServicer(RewardSettings(port=0, score_timeout_s=5.0, tools_enabled=False), VERIFIERS)
    request = reward_pb2.ScoreRequest(response_text="hgfedcbx", answer="hgfedcba", verifier="reverse")
    result = await servicer.score(request)
    assert result.error == ""
    assert result.reward == pytest.approx(7 / 8)
    assert dict(result.components) == pytest.approx({"exact": 0.0, "positions": 7 / 8, "format": 1.0})


def test_tokenizer_is_one_token_per_letter(tmp_path: Path) -> None:
    build_reverse_tokenizer().save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 4 + 27
    ids = encode_prompt(tokenizer, "abz=")
    assert ids == [tokenizer.bos_token_id, 4, 5, 29, 30]
    assert tokenizer.decode([*ids, tokenizer.eos_token_id], skip_special_tokens=True) == "abz="
    # TRL's prompts write BOS out as text; it must come back as the one BOS id
    assert tokenizer(text=tokenizer.bos_token + "abz=")["input_ids"] == ids


def test_the_registered_recipe_is_a_5m_parameter_llama() -> None:
    recipe = builtin_model("reverse").recipe
    assert recipe == ReverseRecipe()
    config = tiny_llama_config(recipe, build_reverse_tokenizer())
    with torch.device("meta"):
        parameters = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert 4.5e6 < parameters < 5.5e6
    assert recipe.digest("reverse") == ReverseRecipe().digest("reverse")
    assert dataclasses.replace(recipe, steps=recipe.steps + 1).digest("reverse") != recipe.digest("reverse")


def test_warm_up_lowers_the_loss() -> None:
    """80 steps of a 32-wide model take the loss from ln(31) (uniform over the vocabulary) to
    about 3.04 (measured), below what uniform letters with EOS in place would give."""
    recipe = dataclasses.replace(
        TINY,
        hidden_size=32,
        intermediate_size=64,
        steps=80,
        batch_size=16,
        learning_rate=3e-3,
        warmup_steps=5,
    )
    tokenizer = build_reverse_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(recipe, tokenizer))
    first = warm_up_reverse(model, tokenizer, dataclasses.replace(recipe, steps=1), progress=False)
    last = warm_up_reverse(model, tokenizer, recipe, progress=False)
    assert first == pytest.approx(math.log(31), abs=0.1)
    assert last < first - 0.3


def test_a_tiny_build_is_deterministic_and_records_its_scores(tmp_path: Path) -> None:
    first = ensure_builtin_model("reverse", tmp_path / "a", recipe=TINY, progress=False)
    second = ensure_builtin_model("reverse", tmp_path / "b", recipe=TINY, progress=False)
    weights_a, weights_b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    stamp = read_stamp(first)
    assert stamp is not None and stamp["recipe_hash"] == TINY.digest("reverse")
    assert 0.0 <= stamp["eval_exact_match"] <= stamp["eval_positions"] <= 1.0
    assert stamp["eval_prompts"] == REVERSE_EVAL_SIZE
    assert AutoTokenizer.from_pretrained(first)("abc")["input_ids"] == [4, 5, 6]
    with pytest.raises(ValueError, match="no reverse warm-up for task 'addition'"):
        build_reverse_model("reverse", dataclasses.replace(TINY, task="addition"), tmp_path / "c")


def test_the_race_task_carries_the_issues_settings(tmp_path: Path) -> None:
    task = BENCH_TASKS["reverse"]
    assert (task.bound, task.model, task.data, task.verifier) == (
        "compute",
        "builtin:reverse",
        "builtin:reverse",
        "reverse",
    )
    hp = Hyper(task="reverse", model_dir="/models/r", seed=0, **task.hyper)
    assert (hp.group_size, hp.prompts_per_step, hp.max_new_tokens, hp.learning_rate) == (8, 16, 20, 1e-4)
    assert 0.3 < task.target <= 1.0 and task.eval_prompts <= REVERSE_EVAL_SIZE
    spec = parse_job_spec(job_spec(hp, task, tmp_path / "ckpt", max_staleness=1))
    assert spec.reward.verifier == "reverse" and spec.data.train == "builtin:reverse"
    assert spec.rollout.max_new_tokens == trl_config(hp, tmp_path / "trl")["max_completion_length"] == 20
    examples = task.train_examples(seed=0, count=3)
    assert [e.prompt_id for e in examples] == ["reverse:train:0", "reverse:train:1", "reverse:train:2"]
    assert len(task.eval_examples(task.eval_prompts)) == task.eval_prompts


def test_the_staleness_check_runs_the_race_job_of_either_task() -> None:
    from bench.staleness import job_spec as staleness_spec

    reverse = staleness_spec(BENCH_TASKS["reverse"], 0, 1, {"off_policy_correction": "decoupled"}, 5)
    assert (reverse.model.path, reverse.data.train, reverse.data.eval) == ("builtin:reverse",) * 3
    assert (reverse.reward.verifier, reverse.rollout.max_new_tokens, reverse.trainer.learning_rate) == (
        "reverse",
        20,
        1e-4,
    )
    assert (reverse.algorithm.max_staleness, reverse.algorithm.off_policy_correction) == (1, "decoupled")
    addition = staleness_spec(BENCH_TASKS["addition"], 0, 0, {}, 5)  # examples/addition.yaml's job
    assert (addition.model.path, addition.rollout.max_new_tokens, addition.rollout.prompts_per_step) == (
        "builtin:addition",
        8,
        16,
    )
    assert (addition.algorithm.group_size, addition.algorithm.clip_low, addition.algorithm.clip_high) == (
        8,
        0.2,
        0.28,
    )


def test_a_reverse_race_writes_its_own_results_section() -> None:
    from bench.e2e_report import SECTION_TITLE, section, section_title
    from bench.e2e_runs import Point, Run, outcome

    assert section_title("addition") == SECTION_TITLE == "## e2e (bench/e2e.py)"
    assert section_title("reverse") == "## e2e (bench/e2e.py --task reverse)"
    runs = [Run("verst", 1, [Point(0, 0.0, 0.36), Point(5, 2.0, 0.5)])]
    text = section("cmd", {}, [], runs, outcome("reverse", 0.5, runs))
    assert text.splitlines()[0] == "## e2e (bench/e2e.py --task reverse)"
