"""A rollout strategy of one's own: a second try, after a hint, for answers that are not a number.

    rollout:
      strategy: examples.plugins.rollout_strategy:retry_with_hint
      max_turns: 2          # multi-turn: the retry is the model's second turn

The group's n samples come from one Generate, aborted ones resumed. Each sample whose answer
fails the format check (a bare integer) and left room in the budget gets ``HINT`` appended, and
the model goes on from there in a Generate of its own: its prompt is the task prompt, the first
answer and the hint, all as token ids (token-in/token-out: the first turn is never decoded and
encoded again, so the trajectory is exactly what the engine saw and produced). The hint's tokens
have loss mask false, logprob 0 and the policy version of the token before them; the loss mask
covers both model turns. The verifier scores the second answer; the response holds the whole
exchange, within the job's ``max_new_tokens``.

Written against the contract alone (services/runner/strategy.py): the runner's clients, the
group's first Generate and resumes, and ``finish_group`` to score the samples and build their
Trajectories.
"""

from __future__ import annotations

import hashlib
import re

from services.common.pb import common_pb2, rollout_pb2
from services.common.plugins import traits
from services.runner.strategy import (
    GroupClients,
    Sample,
    finish_group,
    generate_group,
    group_request,
    resume,
    run_all,
)

HINT = " Answer with digits only: "
"""Text the model reads before its second try (for a chat model: its template's user turn)."""
ANSWER = re.compile(r"\s*-?\d+\s*")
"""The format an answer must have to be left as it is."""
HINT_LOGPROB = 0.0
"""Behaviour logprob recorded for the hint's tokens (the model did not write them)."""


@traits(multi_turn=True)
async def retry_with_hint(task: common_pb2.PromptTask, clients: GroupClients) -> list[common_pb2.Trajectory]:
    """The group's trajectories, each a first answer and, when it was not a number, a second."""
    request = group_request(task)
    samples = await generate_group(request, clients)
    await run_all(
        [resume(request, s, clients, index=i, name=f"{task.prompt_id}:{i}") for i, s in enumerate(samples)],
        name=task.prompt_id,
    )
    hint = list(clients.tokenizer(HINT, add_special_tokens=False)["input_ids"])
    retried = await run_all(
        [_retry(task, request, sample, hint, clients) for sample in samples], name=f"{task.prompt_id}:hint"
    )
    return await finish_group(task, retried, clients)


async def _retry(
    task: common_pb2.PromptTask,
    first: rollout_pb2.GenerateRequest,
    sample: Sample,
    hint: list[int],
    clients: GroupClients,
) -> Sample:
    """``sample`` as it is when its answer has the format (or cannot be retried), else both tries."""
    completion = sample.completion
    left = first.sampling.max_new_tokens - len(completion.token_ids) - len(hint)
    text = clients.tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
    if (
        ANSWER.fullmatch(text)
        or completion.finish_reason != common_pb2.FINISH_REASON_STOP
        or completion.error
        or left < 1
    ):
        return sample
    index = completion.index
    request = _hinted_request(task, first, [*completion.token_ids, *hint], left, index)
    [second] = await generate_group(request, clients)
    await resume(request, second, clients, index=0, name=request.request_id)
    more = second.completion
    both = rollout_pb2.Completion(
        index=index,
        token_ids=[*completion.token_ids, *hint, *more.token_ids],
        logprobs=[*completion.logprobs, *[HINT_LOGPROB] * len(hint), *more.logprobs],
        # the hint follows the version that wrote the first answer (staleness reads the oldest)
        policy_versions=[
            *completion.policy_versions,
            *[completion.policy_versions[-1]] * len(hint),
            *more.policy_versions,
        ],
        finish_reason=more.finish_reason,
        error=more.error,
    )
    return Sample(
        both,
        second.engine_id,
        resumes=sample.resumes + second.resumes,
        loss_mask=[True] * len(completion.token_ids) + [False] * len(hint) + [True] * len(more.token_ids),
        num_turns=2,
        final_text=clients.tokenizer.decode(list(more.token_ids), skip_special_tokens=True),
        info={"hinted": "1"},
    )


def _hinted_request(
    task: common_pb2.PromptTask, first: rollout_pb2.GenerateRequest, so_far: list[int], left: int, index: int
) -> rollout_pb2.GenerateRequest:
    """One sample's second try: the task prompt and everything so far, the group's sampling."""
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(first.sampling)
    sampling.n = 1
    sampling.max_new_tokens = left
    if first.sampling.HasField("seed"):  # its own seed, reproducible: not sample 0's stream again
        digest = hashlib.blake2b(f"{first.sampling.seed}:{index}:hint".encode(), digest_size=8).digest()
        sampling.seed = int.from_bytes(digest, "big") >> 1
    return rollout_pb2.GenerateRequest(
        request_id=f"{task.prompt_id}:{index}:hint",
        prompt_token_ids=[*task.prompt_token_ids, *so_far],
        sampling=sampling,
        session_id=first.session_id,  # the engine that holds the group's prefix
        job_id=first.job_id,
        min_policy_version=first.min_policy_version,
        min_policy_epoch=first.min_policy_epoch,
    )
