"""verst's tasks: prompts with reference answers, their verifiers, the base models verst builds.

The public API, importable without torch::

    from services.tasks import get_task, train_prompts, eval_prompts, resolve_model_path

Modules: ``prompts`` (PromptExample, encode_prompt, JSONL files), ``catalog`` (the
``Task`` registry, ``builtin:`` data sources and model paths), ``addition``,
``multiply`` and ``reverse`` (each task's problems, scorer and base-model recipe), ``models`` (the
build cache: stamp, lock, build into place). The torch side, imported only to build
or load a model: ``tiny_llama`` (what the models share), ``addition_model``,
``multiply_model`` and ``reverse_model`` (their warm-ups).
"""

from services.tasks.catalog import (
    TASKS,
    Task,
    built_model_dir,
    builtin_model,
    builtin_task_name,
    ensure_builtin_model,
    eval_prompts,
    get_task,
    resolve_model_path,
    train_prompts,
)
from services.tasks.models import BaseModel, ModelPathError
from services.tasks.prompts import (
    BUILTIN_PREFIX,
    DataError,
    PromptExample,
    PromptTooLongError,
    encode_prompt,
    read_jsonl_prompts,
)

__all__ = [
    "BUILTIN_PREFIX",
    "TASKS",
    "BaseModel",
    "DataError",
    "ModelPathError",
    "PromptExample",
    "PromptTooLongError",
    "Task",
    "built_model_dir",
    "builtin_model",
    "builtin_task_name",
    "encode_prompt",
    "ensure_builtin_model",
    "eval_prompts",
    "get_task",
    "read_jsonl_prompts",
    "resolve_model_path",
    "train_prompts",
]
