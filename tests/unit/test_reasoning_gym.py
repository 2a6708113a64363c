"""The ``reasoning_gym`` data source and verifier: rows scored by their own dataset's scorer, a
held-out split disjoint from the training one and the same for every job, options that reach the
dataset, and bad names or options refused naming the field."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import reasoning_gym
from reasoning_gym.utils import extract_answer

from services.common.config import DataConfig, JobSpec, parse_job_spec
from services.common.pb import reward_pb2
from services.data import DATA_SOURCES, DataError, PromptExample, SourceRequest, eval_prompts, train_prompts
from services.data import reasoning_gym as gym
from services.reward.config import RewardSettings
from services.reward.reasoning_gym_verifier import ReasoningGymVerifier
from services.reward.server import RewardServicer
from services.reward.verifiers import VERIFIERS, last_number

ROOT = Path(__file__).resolve().parents[2]
VERIFY = VERIFIERS["reasoning_gym"]


def data(dataset: str, **options: Any) -> DataConfig:
    location = f"reasoning_gym:{dataset}"
    return DataConfig(train=location, eval=location, options=options)


def rows(config: DataConfig, split: str = "train") -> list[PromptExample]:
    """Every row of a split, straight from the source (the train split is finite)."""
    request = SourceRequest(config.train.partition(":")[2], split, config, 0)  # type: ignore[arg-type]
    return list(gym.reasoning_gym_source(request))


def direct_entry(dataset: str, row: PromptExample, *, size: int = 1000, seed: int = 0, **config: Any) -> Any:
    """The entry of a training row made by reasoning-gym itself, not through verst."""
    index = int(row.prompt_id.rpartition(":")[2])
    return reasoning_gym.create_dataset(dataset, size=size, seed=seed, **config)[index]


def responses(answer: str) -> dict[str, str]:
    return {
        "right": f"Let me think. 1 + 1 = 2.\n<answer>{answer}</answer>",
        "right, padded": f"<answer>  {answer} </answer>",
        "right, later tag wins": f"<answer>nope</answer> on reflection <answer>{answer}</answer>",
        "wrong": f"<answer>{answer}9</answer>",
        "answer among words": f"<answer>it is {answer} I think</answer>",
        "no tags": f"the answer is {answer}",
        "unclosed tag": f"<answer>{answer}",
        "empty tags": "<answer></answer>",
        "empty response": "",
    }


# --- scored by their own scorer -----------------------------------------------------------------


@pytest.mark.parametrize("dataset", ["chain_sum", "basic_arithmetic", "letter_counting", "gcd"])
def test_rows_are_scored_by_their_own_datasets_score_answer(dataset: str) -> None:
    scorer = reasoning_gym.create_dataset(dataset, size=10, seed=0)
    checked = 0
    for row in rows(data(dataset, size=12)):
        entry = direct_entry(dataset, row, size=12)
        assert gym.decode_entry(row.metadata[gym.ENTRY_KEY]) == entry
        assert (row.answer, row.text.rpartition("\n\n")[2]) == (entry["answer"], entry["question"])
        for kind, response in responses(row.answer).items():
            reward, components, info = VERIFY(response, row.answer, row.metadata)
            expected = scorer.score_answer(extract_answer(response), entry)
            assert reward == expected, (kind, response)
            assert components == {
                "correct": float(expected == 1.0),
                "score": expected,
                "parsed": float(extract_answer(response) is not None),
            }
            assert info["dataset"] == dataset
            checked += 1
        assert VERIFY(responses(row.answer)["right"], row.answer, row.metadata)[0] == 1.0
        assert VERIFY(responses(row.answer)["wrong"], row.answer, row.metadata)[1]["correct"] == 0.0
        assert VERIFY("no answer here", row.answer, row.metadata)[0] == 0.0
    assert checked == 12 * len(responses("1"))


def test_the_extractor_travels_with_the_row() -> None:
    numbers = rows(data("chain_sum", size=5, extractor="last_number"))
    whole = rows(data("chain_sum", size=5, extractor="whole"))
    for by_number, by_whole in zip(numbers, whole, strict=True):
        answer = by_number.answer
        assert by_number.metadata[gym.EXTRACTOR_KEY] == "last_number"
        assert "<answer>" not in by_number.text, "no instruction for tags by default"
        assert VERIFY(f"so 1 + 2 gives {answer}.", answer, by_number.metadata)[0] == 1.0
        assert VERIFY(f"{answer} is not it, it is 7{answer}", answer, by_number.metadata)[1]["correct"] == 0.0
        assert VERIFY(f"  {answer}\n", answer, by_whole.metadata)[0] == 1.0
        assert VERIFY(f"<answer>{answer}</answer>", answer, by_whole.metadata)[1]["correct"] == 0.0
    assert ReasoningGymVerifier(last_number).extract("last_number", "it is 1,234 apples") == "1234"


def test_arc_rows_keep_their_tuples_and_score_their_own_answer() -> None:
    [row] = eval_prompts(data("arc_agi", size=3, eval_size=1, instruction="none"))
    entry = gym.decode_entry(row.metadata[gym.ENTRY_KEY])
    assert isinstance(entry["metadata"]["output"], tuple)  # its scorer compares tuples of tuples
    assert VERIFY(f"<answer>{row.answer}</answer>", row.answer, row.metadata)[0] == 1.0
    assert VERIFY("<answer>0</answer>", row.answer, row.metadata)[1]["correct"] == 0.0


def test_a_composite_dataset_scores_each_row_by_its_part() -> None:
    parts = [{"name": "chain_sum", "weight": 1, "config": {}}, {"name": "gcd", "weight": 1, "config": {}}]
    made = rows(data("composite", size=20, datasets=parts))
    sources = {gym.decode_entry(r.metadata[gym.ENTRY_KEY])["metadata"]["source_dataset"] for r in made}
    assert sources == {"chain_sum", "gcd"}
    for row in made:
        assert VERIFY(f"<answer>{row.answer}</answer>", row.answer, row.metadata)[0] == 1.0


def test_a_response_without_the_rows_metadata_is_an_error_not_a_zero() -> None:
    with pytest.raises(
        ValueError, match=r"metadata lacks reasoning_gym\.dataset.*data\.train: reasoning_gym:"
    ):
        VERIFY("<answer>3</answer>", "3", {})
    [row] = rows(data("gcd", size=1))
    with pytest.raises(ValueError, match=r"reasoning_gym\.entry is no entry"):
        VERIFY("<answer>3</answer>", "3", {**row.metadata, gym.ENTRY_KEY: "{not json"})


async def test_the_reward_service_scores_a_row_and_reports_a_missing_entry() -> None:
    servicer = RewardServicer(RewardSettings(port=0, tools_enabled=False))
    [row] = rows(data("gcd", size=1))
    right = reward_pb2.ScoreRequest(
        response_text=f"<answer>{row.answer}</answer>",
        answer=row.answer,
        verifier="reasoning_gym",
        metadata=row.metadata,
    )
    scored = await servicer.score(right)
    assert (scored.reward, scored.error, dict(scored.components)["correct"]) == (1.0, "", 1.0)
    bare = reward_pb2.ScoreRequest(response_text="<answer>1</answer>", answer="1", verifier="reasoning_gym")
    failed = await servicer.score(bare)
    assert failed.reward == 0.0 and "metadata lacks reasoning_gym.dataset" in failed.error


# --- the splits ---------------------------------------------------------------------------------


def test_the_eval_split_is_disjoint_from_train_and_the_same_for_every_job() -> None:
    # 100 possible questions, 60 of them trained on: the held-out seed gives many of those again.
    config = data("chain_sum", size=60, eval_size=20, min_terms=2, max_terms=2, max_digits=1)
    train = {row.text for row in itertools.islice(train_prompts(config, seed=1), 60)}
    held_out = eval_prompts(config)
    assert len(held_out) == 20 and len({row.text for row in held_out}) == 20
    assert not train & {row.text for row in held_out}
    assert [int(row.prompt_id.rpartition(":")[2]) for row in held_out][-1] > 20, "the filter dropped some"
    other_job = {row.text for row in itertools.islice(train_prompts(config, seed=2), 60)}
    assert other_job == train, "the job's seed orders the rows; it does not change them"
    assert eval_prompts(config) == held_out
    script = (
        "from services.common.config import DataConfig; from services.data import eval_prompts;"
        f"print([r.prompt_id for r in eval_prompts(DataConfig.model_validate({config.model_dump()!r}))])"
    )
    elsewhere = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert elsewhere.stdout.strip() == str([row.prompt_id for row in held_out]), "stable across processes"


def test_too_few_new_questions_for_the_eval_split_is_an_error_naming_the_options() -> None:
    config = data("chain_sum", size=200, eval_size=100, min_terms=2, max_terms=2, max_digits=1)
    with pytest.raises(
        DataError, match=r"data\.options: only \d+ of 2000 held-out questions .* eval_size 100"
    ):
        eval_prompts(config)


def test_options_reach_the_dataset() -> None:
    made = rows(data("chain_sum", size=7, seed=5, min_terms=3, max_terms=3, max_digits=1))
    assert len(made) == 7
    for row in made:
        entry = gym.decode_entry(row.metadata[gym.ENTRY_KEY])
        assert entry == direct_entry("chain_sum", row, size=7, seed=5, min_terms=3, max_terms=3, max_digits=1)
        assert entry["metadata"]["num_terms"] == 3 and entry["metadata"]["num_digits"] == 1
    assert rows(data("chain_sum", size=7, seed=6))[0].text != made[0].text
    held_out = rows(data("chain_sum", size=7, seed=5, eval_size=3, min_terms=3, max_terms=3), "eval")
    at = reasoning_gym.create_dataset("chain_sum", size=10, seed=5 + 2**31, min_terms=3, max_terms=3)
    for row in held_out:  # reasoning-gym's rows at seed + 2**31, as the docs say
        assert gym.decode_entry(row.metadata[gym.ENTRY_KEY]) == at[int(row.prompt_id.rpartition(":")[2])]
    assert "State the final" in rows(data("chain_sum", size=1, instruction="none"))[0].text.split("\n")[0]
    assert "<answer>" in rows(data("chain_sum", size=1, instruction="direct"))[0].text


def test_the_default_instruction_is_reasoning_gyms_own() -> None:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    [row] = rows(data("gcd", size=1))
    assert row.text.startswith(SYSTEM_PROMPTS["default"].rstrip())
    assert row.metadata[gym.EXTRACTOR_KEY] == "answer_tag"


# --- bad names and options ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_terms": 0}, r"data\.options: reasoning-gym's chain_sum refuses \{'min_terms': 0\}"),
        ({"min_terms": 5, "max_terms": 2}, "data.options: .*max_terms must be >= min_terms"),
        ({"min_term": 2}, "data.options: reasoning-gym's chain_sum takes no min_term .*min_terms"),
        ({"size": 0}, "data.options.size: must be an integer from 1"),
        ({"size": True}, "data.options.size: must be an integer"),
        ({"seed": -1}, "data.options.seed: must be an integer from 0"),
        ({"eval_size": 1.5}, "data.options.eval_size"),
        ({"extractor": "regex"}, "data.options.extractor: must be one of answer_tag, last_number, whole"),
        ({"instruction": ["default"]}, r"data\.options\.instruction: must be one of"),
        ({"instruction": "be brief"}, r"data\.options\.instruction: must be one of .*default, .*none"),
    ],
)
def test_a_bad_option_is_refused_naming_data_options(options: dict[str, Any], message: str) -> None:
    with pytest.raises(DataError, match=message):
        next(train_prompts(data("chain_sum", **options), 0))


def test_an_unknown_dataset_is_refused_naming_the_location() -> None:
    with pytest.raises(
        DataError, match=r"data\.train: reasoning-gym has no dataset 'chain_sums' \(did you mean chain_sum"
    ):
        next(train_prompts(data("chain_sums"), 0))
    with pytest.raises(
        DataError, match=r"data\.eval: reasoning-gym has no dataset 'qqq' \(known: .*chain_sum"
    ):
        eval_prompts(DataConfig(train="reasoning_gym:gcd", eval="reasoning_gym:qqq"))


def test_the_api_check_names_the_field_of_a_bad_dataset_or_option() -> None:
    from services.api.spec_checks import readability_problems

    spec = JobSpec.model_validate({"data": {"train": "reasoning_gym:nope", "eval": "reasoning_gym:gcd"}})
    problems = dict(readability_problems(spec))
    assert "reasoning-gym has no dataset 'nope'" in problems[("data", "train")]
    assert ("data", "eval") not in problems
    spec = JobSpec.model_validate({"data": {"train": "reasoning_gym:gcd", "eval": None, "options": {"x": 1}}})
    assert (
        "data.options: reasoning-gym's gcd takes no x" in dict(readability_problems(spec))[("data", "train")]
    )


# --- the source's registration and the entry encoding --------------------------------------------


def test_the_source_is_registered_lazily_and_nothing_imports_reasoning_gym_unless_used() -> None:
    traits = DATA_SOURCES.declared("reasoning_gym")  # a finite train split, no path to confine
    assert (traits["endless"], traits["reads_path"], traits["suffixes"]) == (False, False, ())
    script = (
        "import sys; import services.reward.server, services.controller.feed, services.api.spec_checks;"
        "from services.common.config import parse_job_spec;"
        "parse_job_spec({'data': {'train': 'reasoning_gym:gcd', 'eval': None}});"
        "print('reasoning_gym' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False"


def test_the_job_spec_takes_a_reasoning_gym_location() -> None:
    spec = parse_job_spec(
        {
            "data": {"train": "reasoning_gym:chain_sum", "options": {"min_terms": 2}},
            "reward": {"verifier": "reasoning_gym"},
        }
    )
    assert spec.data.train == "reasoning_gym:chain_sum" and spec.reward.scorer == "reasoning_gym"


def test_the_entry_encoding_restores_tuples_and_refuses_what_json_would_change() -> None:
    entry = {"question": "q", "answer": "a", "metadata": {"grid": ((1, 2), (3,)), "pairs": [(1, "x")]}}
    assert gym.decode_entry(gym.encode_entry(entry)) == entry
    with pytest.raises(DataError, match="does not survive JSON unchanged"):
        gym._checked_encoding({"question": "q", "metadata": {1: "int key"}}, "toy", "train:0")
    with pytest.raises(DataError, match="cannot travel as JSON"):
        gym._checked_encoding({"question": "q", "metadata": {"s": {1, 2}}}, "toy", "train:0")


def test_every_extractor_the_source_offers_is_one_the_verifier_knows() -> None:
    verifier = ReasoningGymVerifier(last_number)
    for name in gym.EXTRACTORS:
        verifier.extract(name, "<answer>1</answer>")
    assert {f.name for f in dataclasses.fields(gym.GymOptions)} >= gym.OWN_OPTIONS
