"""verst's toy tasks: prompts with reference answers, their scorers, the base models verst builds.

The public API, importable without torch::

    from services.tasks import get_task, ensure_builtin_model

Modules: ``catalog`` (the ``Task`` registry, the ``builtin`` data source, ``builtin:`` model
paths), ``problems`` (the held-out and training splits the synthetic tasks share), ``addition``,
``multiply`` and ``reverse`` (each task's problems, scorer and base-model recipe), ``models`` (the
build cache: stamp, lock, build into place; GGUF conversions use it too). A JobSpec's
``model.path`` in every form is resolved by ``services.models``. The torch side, imported only to build
or load a model: ``tiny_llama`` (what the models share), ``addition_model``,
``multiply_model`` and ``reverse_model`` (their warm-ups). Prompts, their encoding and the
data sources are ``services.data``'s.
"""

from services.tasks.catalog import (
    BUILTIN_PREFIX,
    TASKS,
    Task,
    built_model_dir,
    builtin_model,
    builtin_source,
    ensure_builtin_model,
    get_task,
)
from services.tasks.models import BaseModel, ModelPathError

__all__ = [
    "BUILTIN_PREFIX",
    "TASKS",
    "BaseModel",
    "ModelPathError",
    "Task",
    "built_model_dir",
    "builtin_model",
    "builtin_source",
    "ensure_builtin_model",
    "get_task",
]
