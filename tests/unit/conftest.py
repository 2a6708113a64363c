"""Fixtures of the unit tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from services.tasks import catalog
from services.tasks.models import Recipe


@pytest.fixture
def builtin_recipe(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, Recipe], None]:
    """``register(name, recipe)``: ``builtin:<name>`` is built from ``recipe`` for the rest of the test."""

    def register(name: str, recipe: Recipe) -> None:
        task = catalog.TASKS[name]
        assert task.base_model is not None
        base_model = dataclasses.replace(task.base_model, recipe=recipe)
        monkeypatch.setitem(catalog.TASKS, name, dataclasses.replace(task, base_model=base_model))

    return register
