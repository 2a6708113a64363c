"""The rollout strategy contract: how one PromptTask becomes its group's scored Trajectories.

A strategy is an async function ``strategy(task, clients) -> trajectories`` (``RolloutStrategy``)
that the runner calls once per task it takes, with the job's ``GroupClients``: the router
(``Generate``) and the reward service (``ScoreBatch``), whose calls the runner batches with
other groups' (batching.py; each call still answers alone), the Tools stub (``Execute``), the job's
tokenizer, the call deadlines, the job's ``rollout`` section and its ``data.chat_template_kwargs``
(a chat task, ``task.messages_json`` set, renders tool turns with
``services.data.chat.tool_turn_ids``). It returns one Trajectory per sample of the group, all
``task.n_samples`` of them, each with its ``sample_index``; the runner applies the job's reward
shaping, publishes them in one batch and only then acks the task.

What makes a Trajectory valid (the trainer refuses it otherwise): ``response_token_ids``,
``behaviour_logprobs`` (what the engine reported), ``policy_versions`` (the version that sampled
each token) and ``loss_mask`` (true for the model's own tokens) aligned per token; the ids the
engines saw and produced, never text decoded and encoded again; a finite ``reward``, or a
``reward_error``. The easiest way there is to keep each sample as a ``Sample`` (the completion
grown turn by turn, with its loss mask) and end with ``finish_group``, which scores the samples
in one ScoreBatch and builds the Trajectories, as the built-ins do.

Errors: raise ``InvalidTaskError`` for a task that can never be rolled out (it is
dead-lettered) and ``RetryLaterError`` for a service that failed (the task stays pending and is
retried); ``call`` maps gRPC errors to the two. A strategy must give every wait a deadline:
the clients' timeouts are the job's.

Built-ins (registered in services/common/rollout_strategies.py with their traits):
``group`` (group.py) and ``tool_episode`` (episode.py). A user's own is named in the JobSpec as
``rollout.strategy: module:function`` and declares its traits with ``@traits(multi_turn=True)``
(services/common/plugins.py); examples/plugins/rollout_strategy.py is one. The runner imports
it from its own import path when the job's first task comes.
"""

from __future__ import annotations

from typing import Protocol

from services.common.config import RolloutConfig
from services.common.pb import common_pb2
from services.common.plugins import PluginError
from services.common.rollout_strategies import (
    FIELD,
    ROLLOUT_STRATEGIES,
    RolloutStrategyEntry,
    strategy_name,
    strategy_problem,
)
from services.runner.group import (
    GroupClients,
    InvalidTaskError,
    RetryLaterError,
    Sample,
    call,
    finish_group,
    generate,
    generate_group,
    group_request,
    resume,
    run_all,
)
from services.runner.spliced import array_lengths, head

__all__ = [
    "GroupClients",
    "InvalidTaskError",
    "RetryLaterError",
    "RolloutStrategy",
    "Sample",
    "call",
    "check_trajectories",
    "finish_group",
    "generate",
    "generate_group",
    "group_request",
    "load_strategy",
    "resume",
    "run_all",
]


class RolloutStrategy(Protocol):
    """``await strategy(task, clients)``: the group's scored Trajectories, one per sample."""

    async def __call__(
        self, task: common_pb2.PromptTask, clients: GroupClients, /
    ) -> list[common_pb2.Trajectory]: ...


def load_strategy(rollout: RolloutConfig) -> RolloutStrategyEntry:
    """The strategy the job's ``rollout`` section names (imported on first use), checked against
    its turns; ``InvalidTaskError`` naming the field when it cannot be had or does not fit."""
    name = strategy_name(rollout.strategy, rollout.max_turns)
    try:
        entry = ROLLOUT_STRATEGIES.resolve(name)
    except PluginError as err:  # names the field and the path
        raise InvalidTaskError(str(err)) from None
    except Exception as err:  # a module that fails as it is imported fails every task alike
        raise InvalidTaskError(f"{FIELD} {name!r} cannot be loaded: {err!r}") from None
    problem = strategy_problem(name, entry.multi_turn, rollout.max_turns)
    if problem is not None:
        raise InvalidTaskError(f"{FIELD} {problem}")
    return entry


def check_trajectories(
    name: str, task: common_pb2.PromptTask, trajectories: list[common_pb2.Trajectory]
) -> None:
    """``InvalidTaskError`` naming the strategy when what it returned is not the task's group:
    one trajectory per sample, of this task, tokens aligned. A strategy that is wrong once is
    wrong on every retry, so its task is dead-lettered rather than retried."""
    heads = [head(t) for t in trajectories]
    indices = sorted(t.sample_index for t in heads)
    if indices != list(range(task.n_samples)):
        raise InvalidTaskError(f"{FIELD} {name!r} returned samples {indices} for n_samples={task.n_samples}")
    for trajectory, t in zip(trajectories, heads, strict=True):
        sizes = set(array_lengths(trajectory))
        if (t.job_id, t.prompt_id) != (task.job_id, task.prompt_id) or len(sizes) != 1:
            raise InvalidTaskError(
                f"{FIELD} {name!r}: trajectory {t.id!r} is not of task {task.prompt_id!r}"
                " or its tokens, logprobs, versions and loss mask do not align"
            )
