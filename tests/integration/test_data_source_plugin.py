"""A job whose prompts come from a user's data source (examples/plugins/data_source.py), run by the
real controller against real Redis and the fake router and reward (test_controller.py's harness)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.common.bus import Bus
from services.common.jobs import FAILED, RUNNING
from services.data import encode_prompt, eval_prompts, train_prompts
from tests.integration.fake_services import FakeReward, FakeRouter
from tests.integration.test_controller import Controllers, Services, eval_points, knows, submit

ARITHMETIC = "examples.plugins.data_source:arithmetic"


@pytest.fixture
def services(router: tuple[FakeRouter, str], reward: tuple[FakeReward, str]) -> Services:
    router[0].correct_at_version = knows
    return router[0], router[1], reward[0], reward[1]


@pytest.fixture
async def controllers(bus: Bus, services: Services) -> AsyncIterator[Controllers]:
    controllers = Controllers(bus, services)
    yield controllers
    for controller in list(controllers.running):
        stop, task = controllers.running.pop(controller)
        stop.set()
        await task


async def test_a_user_data_source_feeds_the_job_and_its_evaluation(
    bus: Bus, tokenizer_dir: Path, tokenizer: Any, services: Services, controllers: Controllers
) -> None:
    fake_router = services[0]
    # Subtraction to train on; the held-out split is addition, which the fake engine can answer.
    data = {"source": ARITHMETIC, "train": "subtract", "eval": "add", "options": {"digits": 2}}
    spec, trainer = await submit(bus, tokenizer_dir, fake_router, data=data, eval={"num_prompts": 5})
    await controllers.start()
    await trainer.publish_version(0)
    await trainer.wait_for_state(RUNNING)
    prompts = await trainer.wait_for_prompts(4)

    expected = list(itertools.islice(train_prompts(spec.data, spec.seed), 4))
    assert [p.metadata["source_prompt_id"] for p in prompts] == [e.prompt_id for e in expected]
    assert [(p.prompt_text, p.answer) for p in prompts] == [(e.text, e.answer) for e in expected]
    assert all("-" in p.prompt_text for p in prompts)
    assert [list(p.prompt_token_ids) for p in prompts] == [encode_prompt(tokenizer, e.text) for e in expected]

    held_out = [e.text for e in eval_prompts(spec.data, 5)]
    asked = [
        tokenizer.decode(list(r.prompt_token_ids), skip_special_tokens=True) for r in fake_router.requests
    ]
    assert sorted(asked) == sorted(held_out) and all("+" in text for text in held_out)
    assert await eval_points(trainer.store, trainer.job_id) == {0: 0.0}


async def test_a_user_data_source_that_cannot_be_imported_fails_the_job(
    bus: Bus, tokenizer_dir: Path, services: Services, controllers: Controllers
) -> None:
    data = {"source": "tests.no_such_module:rows", "train": "x", "eval": None}
    _, trainer = await submit(bus, tokenizer_dir, services[0], data=data)
    await controllers.start()
    await trainer.publish_version(0)
    await trainer.wait_for_state(FAILED)
    reason = (await trainer.store.get(trainer.job_id)).reason
    assert "cannot prepare the job's prompts: data:" in reason and "cannot import" in reason
