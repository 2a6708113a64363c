"""Multi-turn episodes: the model calls tools, sees their output, and goes on, up to ``max_turns``.

A task with ``max_turns`` > 1 is rolled out as one episode per sample. The first turn is the
group's Generate of n samples (they share the prompt); from then on each sample goes on
alone, the samples of a group concurrently. Per sample:

1. A turn is generated with the end-of-call markers of the job's ``tool_call_format``
   (``toolcalls.end_markers``) added to the stop strings, so it ends right after a call, at
   the end-of-sequence token, at a job stop string, or at the token budget. A turn that
   comes back aborted is resumed as a single-turn sample is (``group.resume``, at
   most ``max_resumes`` times per turn).
2. The turn's text (its tokens alone, decoded) is parsed for complete tool calls
   (``toolcalls``). A turn without one ends the episode: it is the answer. A turn with calls
   ends the episode with FINISH_REASON_TOOL_CALL when it was the last turn allowed (or the
   job is no longer served): a call nobody will read is not run.
3. Each call runs through ``Tools.Execute`` with the job's ``tool_timeout_s`` in the
   episode's own session (one per sample and rollout attempt), so Python state persists
   across its turns. A malformed call, a tool the task does not list and a failed run all
   become error text the model sees; only a failing Tools service fails the task (retried).
4. The observation is ``tool_observation`` with ``{output}`` replaced by the output (cut to
   ``max_tool_output_tokens`` tokens: its beginning and its end around a marker), one per
   call. A chat task (its ``messages_json`` set: the prompt is its chat template's rendering)
   gets the template's own tool turns instead: one ``tool`` message per call, rendered with the
   job's ``data.chat_template_kwargs`` after the model's turn, with the end of that turn and the
   next turn's opening (``services.data.chat.tool_turn_ids``: only the appended part is
   rendered, and a template that would rewrite earlier turns fails the task). Either way only
   the observation is tokenized, and its tokens are appended with loss mask false,
   logprob 0 and the policy version of the model token before them (the version whose call
   produced them, so the oldest version of a trajectory, which staleness reads, is its
   model's).
5. The next turn's prompt is the task prompt plus every token so far, as token ids: earlier
   turns are never decoded and encoded again, so the trajectory is exactly what the engines
   saw and produced.

The token budget: the task's ``max_new_tokens`` bounds the whole response, model tokens and
observations together, so a trajectory is never longer than a single-turn one may be. Each
turn gets what is left; an observation that would leave no token for a next turn is not
appended, and the episode ends with FINISH_REASON_LENGTH.

The trajectory has the task prompt as its prompt and the whole episode as its response;
``num_turns`` counts the model's turns. The verifier scores the last turn's text
(``ScoreRequest.response_text``) and gets the whole response as token ids,
``metadata["transcript"]`` (its text), ``num_turns`` and the counts ``tool_calls`` and
``tool_errors`` (also in the trajectory's metadata).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.common.pb import common_pb2, reward_pb2, rollout_pb2
from services.data.chat import ChatTemplateError, tool_turn_ids
from services.runner.group import (
    GroupClients,
    InvalidTaskError,
    Sample,
    call,
    finish_group,
    generate_group,
    group_request,
    resume,
    run_all,
)
from services.runner.toolcalls import ToolCall, end_markers, formats_of, parse_tool_calls

TOOL_DEADLINE_MARGIN_S = 5.0
"""Added to ``tool_timeout_s`` for a call's gRPC deadline: starting a sandbox, or waiting for one."""
OBSERVATION_LOGPROB = 0.0
"""Behaviour logprob recorded for tool output tokens (masked out of the loss)."""


async def roll_out_episodes(
    task: common_pb2.PromptTask, clients: GroupClients
) -> list[common_pb2.Trajectory]:
    """One Trajectory per sample of ``task``, each a whole multi-turn episode, with rewards."""
    formats = formats_of(clients.rollout.tool_call_format)
    request = group_request(task, stop=end_markers(formats))
    conversation = task_messages(task)
    firsts = await generate_group(request, clients)
    attempt = uuid.uuid4().hex[:12]  # a redelivered task must not find an older attempt's state
    episodes = [
        Episode(
            task, clients, request, formats, i, f"{task.prompt_id}:{i}:{attempt}", list(conversation or [])
        )
        for i in range(len(firsts))
    ]
    samples = await run_all(
        [episode.run(first) for episode, first in zip(episodes, firsts, strict=True)], name=task.prompt_id
    )
    return await finish_group(task, samples, clients)


def turn_seed(seed: int, index: int, turn: int) -> int:
    """The seed of turn ``turn`` (from 2) of sample ``index`` of a task seeded ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{index}:turn{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def task_messages(task: common_pb2.PromptTask) -> list[dict[str, Any]] | None:
    """The chat messages of a chat task, None for a text one; InvalidTaskError when unreadable."""
    if not task.messages_json:
        return None
    try:
        messages = json.loads(task.messages_json)
    except ValueError as err:
        raise InvalidTaskError(f"messages_json is not JSON: {err}") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise InvalidTaskError("messages_json is not a list of messages")
    return messages


def render_observation(template: str, output: str) -> str:
    """``template`` with ``{output}`` replaced (no other braces are read, so any text is safe)."""
    return template.replace("{output}", output)


@dataclass
class Episode:
    """One sample's episode as it grows: the response so far, aligned per token."""

    task: common_pb2.PromptTask
    clients: GroupClients
    group: rollout_pb2.GenerateRequest
    """The group's first Generate: every turn samples as it does, for one sample."""
    formats: tuple[str, ...]
    index: int
    session_id: str
    """The Tools session of this episode: its Python state lives across turns."""
    conversation: list[dict[str, Any]] = field(default_factory=list)
    """A chat task's messages so far (prompt, model turns, tool turns); empty for a text task."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    num_turns: int = 0
    resumes: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    engine_id: str = ""

    async def run(self, sample: Sample) -> Sample:
        """Take turns from the first one (``sample``, from the group's Generate) to the end."""
        request = self.group
        while True:
            name = f"{self.task.prompt_id}:{self.index}" if self.num_turns == 0 else request.request_id
            await resume(request, sample, self.clients, index=self.index, name=name)
            text = self._take_turn(sample)
            completion = sample.completion
            ended = completion.finish_reason != common_pb2.FINISH_REASON_STOP or bool(completion.error)
            calls = [] if ended else parse_tool_calls(text, self.formats)
            if not calls:
                return self._result(completion.finish_reason, completion.error, text)
            if self.num_turns >= self.task.max_turns or not self.clients.serving():
                return self._result(common_pb2.FINISH_REASON_TOOL_CALL, "", text)
            observation = await self._observe(calls, text, list(completion.token_ids))
            if len(observation) >= self._left():  # no token left for a turn to read it
                return self._result(common_pb2.FINISH_REASON_LENGTH, "", text)
            self._append(observation, [OBSERVATION_LOGPROB] * len(observation), self.versions[-1], False)
            request = self._turn_request()
            [sample] = await generate_group(request, self.clients)

    def _left(self) -> int:
        return self.task.sampling.max_new_tokens - len(self.token_ids)

    def _append(self, ids: list[int], logprobs: list[float], versions: int | list[int], model: bool) -> None:
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions if isinstance(versions, list) else [versions] * len(ids))
        self.mask.extend([model] * len(ids))

    def _take_turn(self, sample: Sample) -> str:
        """Append a finished turn's tokens; its text, decoded from its own tokens."""
        completion = sample.completion
        ids = list(completion.token_ids)
        self._append(ids, list(completion.logprobs), list(completion.policy_versions), True)
        self.num_turns += 1
        self.resumes += sample.resumes
        self.engine_id = sample.engine_id
        return str(self.clients.tokenizer.decode(ids, skip_special_tokens=True))

    def _turn_request(self) -> rollout_pb2.GenerateRequest:
        """The next turn: prompt and every token so far, the group's sampling for one sample."""
        group, turn = self.group, self.num_turns + 1
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(group.sampling)
        sampling.n = 1
        sampling.max_new_tokens = self._left()
        if group.sampling.HasField("seed"):
            sampling.seed = turn_seed(group.sampling.seed, self.index, turn)
        return rollout_pb2.GenerateRequest(
            request_id=f"{self.task.prompt_id}:{self.index}:turn{turn}",
            prompt_token_ids=[*self.task.prompt_token_ids, *self.token_ids],
            sampling=sampling,
            session_id=group.session_id,  # the engine that holds the group's prefix
            job_id=group.job_id,
            min_policy_version=group.min_policy_version,
            min_policy_epoch=group.min_policy_epoch,
        )

    async def _observe(self, calls: list[ToolCall], turn_text: str, turn_ids: list[int]) -> list[int]:
        """Run the calls in order (they may share state); the tokens of their observations."""
        outputs = []
        for number, tool_call in enumerate(calls):
            output, error = await self._execute(tool_call, number)
            shown = self._cut(output)
            if error:
                self.tool_errors += 1
                separator = "\n" if shown and not shown.endswith("\n") else ""
                shown += f"{separator}error: {error}"
            outputs.append(shown)
        if not self.conversation:
            text = "".join(render_observation(self.clients.rollout.tool_observation, o) for o in outputs)
            return list(self.clients.tokenizer(text, add_special_tokens=False)["input_ids"])
        turns = [
            {"role": "tool", "name": c.name or "unknown", "content": o}
            for c, o in zip(calls, outputs, strict=True)
        ]
        kwargs = self.clients.chat_template_kwargs
        try:
            ids = tool_turn_ids(self.clients.tokenizer, self.conversation, turn_text, turn_ids, turns, kwargs)
        except ChatTemplateError as err:
            raise InvalidTaskError(f"tool turn of a chat task: {err}") from None
        self.conversation += [{"role": "assistant", "content": turn_text}, *turns]
        return ids

    async def _execute(self, tool_call: ToolCall, number: int) -> tuple[str, str]:
        """One call's output and what went wrong (empty when nothing did)."""
        self.tool_calls += 1
        allowed = list(self.task.tools)
        if tool_call.error:
            return "", tool_call.error
        if allowed and tool_call.name not in allowed:
            return "", f"unknown tool {tool_call.name!r}; tools: {', '.join(allowed)}"
        timeout_s = self.clients.rollout.tool_timeout_s
        request = reward_pb2.ExecuteRequest(
            tool=tool_call.name,
            arguments_json=tool_call.arguments_json,
            session_id=self.session_id,
            timeout_s=timeout_s,
            call_id=f"{self.task.prompt_id}:{self.index}:turn{self.num_turns}:call{number}",
        )
        reply = await call(
            "tools Execute",
            self.clients.retry_s,
            lambda: self.clients.tools.Execute(request, timeout=timeout_s + TOOL_DEADLINE_MARGIN_S),
        )
        return str(reply.output), "" if reply.ok else str(reply.error or "the tool failed")

    def _cut(self, output: str) -> str:
        """``output`` cut to ``max_tool_output_tokens`` tokens: its first and last halves, with a
        marker between (the end of a traceback says what went wrong)."""
        cap = self.clients.rollout.max_tool_output_tokens
        tokenizer = self.clients.tokenizer
        ids = list(tokenizer(output, add_special_tokens=False)["input_ids"])
        if len(ids) <= cap:
            return output
        head, tail = ids[: (cap + 1) // 2], ids[len(ids) - cap // 2 :]
        marker = f"\n[... {len(ids) - cap} tokens of output cut ...]\n"
        return (
            tokenizer.decode(head, skip_special_tokens=True)
            + marker
            + tokenizer.decode(tail, skip_special_tokens=True)
        )

    def _result(self, finish_reason: int, error: str, final_text: str) -> Sample:
        completion = rollout_pb2.Completion(
            index=self.index,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            policy_versions=self.versions,
            finish_reason=finish_reason,
            error=error,
        )
        return Sample(
            completion,
            self.engine_id,
            resumes=self.resumes,
            loss_mask=self.mask,
            num_turns=self.num_turns,
            final_text=final_text,
            info={"tool_calls": str(self.tool_calls), "tool_errors": str(self.tool_errors)},
        )
