"""Multi-turn episodes through the runner: real Redis, the real Reward + Tools service (the python
sandbox) in this process, and a scripted router whose "model" emits fixed turns per sample.

The router is a test double so that the turns, and hence the tool calls, are deterministic; it
records every request and what it answered, so the test can check token-in/token-out: the
trajectory is exactly the concatenation of what the router was sent and produced.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from services.common.bus import Bus
from services.common.config import JobSpec
from services.common.jobs import RUNNING, JobStore
from services.common.pb import common_pb2, reward_pb2, rollout_pb2, router_pb2_grpc
from services.common.streams import JobStreams
from services.data import encode_prompt
from services.reward import server as reward_server
from services.reward.config import RewardSettings
from services.reward.server import RewardServicer
from services.runner.config import RunnerSettings
from services.runner.episode import turn_seed
from services.runner.group import resume_seed
from services.runner.server import GROUP, Runner
from services.tasks.tiny_llama import SPECIAL_TOKENS
from tests.helpers import eventually, serve, stream_messages

pytestmark = pytest.mark.timeout(120)

ENGINE_ID = "scripted-engine"
VERSION = 5
"""Policy version of first attempts; a resume is generated under VERSION + 1."""
ABORT_AFTER = 3
"""Tokens a scripted abort lets through before the sample comes back ABORT."""
MARKERS = ("</tool_call>", "</python>")
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(x + 1)"}}</tool_call>'
SCRIPTS = {
    # session state across turns: x is set in turn 1 and read in turn 2; then the answer
    0: ["<python>\n  x = 123 * 456\n  print(x)\n</python>", CALL, "56088"],
    # a malformed call (a brace short) gets an error observation; turn 2 is aborted and resumed
    1: ['<tool_call>{"name": "python", "arguments": {"code": "print(1)"}</tool_call>', "56088"],
    # calls every turn: the third call is never run (max_turns); turn 1's output is cut
    2: ["<python>print('ab' * 50)</python>", "<python>print(2)</python>", "<python>print(3)</python>"],
    # a failing run, then a bare JSON call (ended by EOS), then a wrong answer
    3: ["<python>1/0</python>", '{"name": "python", "arguments": {"code": "print(7 * 6)"}}', "0"],
}
ABORTED_TURNS = {(1, 2)}
"""(sample, turn) whose first attempt the router aborts after ABORT_AFTER tokens."""


def char_tokenizer() -> PreTrainedTokenizerFast:
    """verst's character tokenizer, with a newline token (python prints lines)."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for char in ["\n", *map(chr, range(32, 127))]:
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


_TOKENIZER = char_tokenizer()


def _decode(ids: Any, skip_special_tokens: bool = False) -> str:
    return str(_TOKENIZER.decode(list(ids), skip_special_tokens=skip_special_tokens))


@dataclass
class Exchange:
    """One Generate the router answered, per sample."""

    request: rollout_pb2.GenerateRequest
    index: int
    turn: int
    completion: rollout_pb2.Completion


@dataclass
class ScriptedRouter(router_pb2_grpc.RouterServicer):
    """Answers each sample's turn t with SCRIPTS[sample][t - 1]: its characters, then EOS unless
    the turn ends at an end-of-call marker (the engine stops there, at the stop string)."""

    tokenizer: Any
    prompt_id: str = ""
    exchanges: list[Exchange] = field(default_factory=list)

    def turn_ids(self, index: int, turn: int) -> list[int]:
        text = SCRIPTS[index][turn - 1]
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids if text.endswith(MARKERS) else [*ids, self.tokenizer.eos_token_id]

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: Any
    ) -> rollout_pb2.GenerateResponse:
        assert all(marker in request.sampling.stop for marker in MARKERS), "turns stop after a call"
        pattern = rf"{re.escape(self.prompt_id)}(?::(\d+))?(?::turn(\d+))?(?::resume\d+)?"
        match = re.fullmatch(pattern, request.request_id)
        if match is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected id {request.request_id}")
        turn = int(match.group(2) or 1)
        indices = [int(match.group(1))] if match.group(1) else list(range(request.sampling.n))
        completions = []
        for position, index in enumerate(indices):
            completion = self.completion(request, index, turn)
            self.exchanges.append(Exchange(request, index, turn, completion))
            completions.append(rollout_pb2.Completion(index=position, **_fields(completion)))
        return rollout_pb2.GenerateResponse(
            request_id=request.request_id, completions=completions, engine_id=ENGINE_ID
        )

    def completion(
        self, request: rollout_pb2.GenerateRequest, index: int, turn: int
    ) -> rollout_pb2.Completion:
        full = self.turn_ids(index, turn)
        resumed = request.resume_offset > 0
        done = len(request.prompt_token_ids) - request.resume_offset if resumed else 0
        end = min(len(full), done + request.sampling.max_new_tokens)
        finish = common_pb2.FINISH_REASON_STOP if end == len(full) else common_pb2.FINISH_REASON_LENGTH
        if (index, turn) in ABORTED_TURNS and not resumed:
            end, finish = done + ABORT_AFTER, common_pb2.FINISH_REASON_ABORT
        return rollout_pb2.Completion(
            token_ids=full[done:end],
            logprobs=[-0.5 - 0.01 * p - 0.1 * index for p in range(done, end)],
            policy_versions=[VERSION + resumed] * (end - done),
            finish_reason=finish,
        )


def _fields(completion: rollout_pb2.Completion) -> dict[str, Any]:
    return {
        "token_ids": completion.token_ids,
        "logprobs": completion.logprobs,
        "policy_versions": completion.policy_versions,
        "finish_reason": completion.finish_reason,
    }


class RecordingReward(RewardServicer):
    """The real reward servicer, keeping the requests it scored."""

    def __init__(self, settings: RewardSettings) -> None:
        super().__init__(settings)
        self.items: list[reward_pb2.ScoreRequest] = []

    async def ScoreBatch(
        self, request: reward_pb2.ScoreBatchRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreBatchResponse:
        self.items.extend(request.items)
        return await super().ScoreBatch(request, context)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("checkpoint-v0")
    char_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
async def reward_and_tools() -> AsyncIterator[tuple[RecordingReward, str]]:
    """The reward process's two services on one server, as ``python -m services.reward`` serves them."""
    settings = RewardSettings(port=0, default_verifier="exact_match", sandbox_timeout_s=5.0)
    reward = RecordingReward(settings)

    def register(server: grpc.aio.Server) -> None:
        reward_server.reward_pb2_grpc.add_RewardServicer_to_server(reward, server)
        reward_server.tools.register(server, settings)

    server, address = await serve(register)
    yield reward, address
    await server.stop(None)


@pytest.fixture
async def router(tokenizer: Any) -> AsyncIterator[tuple[ScriptedRouter, str]]:
    fake = ScriptedRouter(tokenizer)
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(fake, s))
    yield fake, address
    await server.stop(None)


async def start_job(bus: Bus, tokenizer_dir: Path, **rollout: Any) -> tuple[str, JobSpec]:
    spec = JobSpec.model_validate(
        {"algorithm": {"group_size": 4}, "reward": {"verifier": "exact_match"}, "rollout": rollout}
    )
    store = JobStore(bus.redis)
    job_id = (await store.create(spec)).job_id
    await store.set_state(job_id, RUNNING)
    handle = common_pb2.CheckpointHandle(
        job_id=job_id, version=0, uri=tokenizer_dir.as_uri(), format="safetensors"
    )
    await bus.publish(JobStreams(job_id).checkpoints, handle)
    return job_id, spec


def make_task(job_id: str, spec: JobSpec, tokenizer: Any) -> common_pb2.PromptTask:
    prompt_id = f"{job_id}:0:0"
    return common_pb2.PromptTask(
        prompt_id=prompt_id,
        job_id=job_id,
        group_id=prompt_id,
        prompt_token_ids=encode_prompt(tokenizer, "What is 123*456? "),
        prompt_text="What is 123*456? ",
        n_samples=4,
        sampling=common_pb2.SamplingParams(
            temperature=1.0, max_new_tokens=spec.rollout.max_new_tokens, n=4, seed=7
        ),
        answer="56088",
        verifier="exact_match",
        split=common_pb2.SPLIT_TRAIN,
        max_turns=spec.rollout.max_turns,
        tools=spec.rollout.tools,
    )


async def roll_out(
    bus: Bus, task: common_pb2.PromptTask, router_address: str, reward_address: str
) -> list[common_pb2.Trajectory]:
    """Run a Runner until the task's group is published and acked; its trajectories."""
    stream = JobStreams(task.job_id)
    await bus.publish(stream.prompts, task)
    settings = RunnerSettings(
        router_address=router_address, reward_address=reward_address, jobs_refresh_s=0.05, retry_s=1.0
    )
    stop = asyncio.Event()
    running = asyncio.create_task(Runner(bus, JobStore(bus.redis), settings).run(stop))
    try:

        async def acked() -> bool:
            return await bus.redis.xlen(stream.trajectories) >= task.n_samples and (
                await bus.pending_count(stream.prompts, GROUP) == 0
            )

        await eventually(acked, timeout_s=60, what="the group's trajectories and the ack")
    finally:
        stop.set()
        await asyncio.wait_for(running, 15)
    return await stream_messages(bus, stream.trajectories, common_pb2.Trajectory)


def spans(mask: list[bool]) -> list[tuple[bool, int, int]]:
    """Runs of equal mask values as (value, start, end)."""
    runs: list[tuple[bool, int, int]] = []
    for position, value in enumerate(mask):
        if runs and runs[-1][0] == value:
            runs[-1] = (value, runs[-1][1], position + 1)
        else:
            runs.append((value, position, position + 1))
    return runs


def check_token_in_token_out(
    trajectory: common_pb2.Trajectory, exchanges: list[Exchange], prompt: list[int]
) -> list[str]:
    """Every request's prompt is the trajectory up to that point, every answer the tokens after it,
    and the answers are the only tokens with loss mask true; the observations' texts."""
    full = [*prompt, *trajectory.response_token_ids]
    mask = list(trajectory.loss_mask)
    assert (
        len(mask)
        == len(trajectory.behaviour_logprobs)
        == len(trajectory.policy_versions)
        == len(trajectory.response_token_ids)
    )
    produced = [False] * len(mask)
    for exchange in exchanges:
        sent = list(exchange.request.prompt_token_ids)
        got = list(exchange.completion.token_ids)
        assert full[: len(sent)] == sent, f"{exchange.request.request_id}: prompt = everything so far"
        assert full[len(sent) : len(sent) + len(got)] == got, "the answer follows it verbatim"
        at = len(sent) - len(prompt)
        for k, logprob in enumerate(exchange.completion.logprobs):
            produced[at + k] = True
            assert trajectory.behaviour_logprobs[at + k] == pytest.approx(logprob)
            assert trajectory.policy_versions[at + k] == exchange.completion.policy_versions[k]
    assert mask == produced, "loss mask true exactly on the tokens the model produced"
    assert mask[-1], "an episode ends with the model's tokens"
    observations = []
    for model, start, end in spans(mask):
        if not model:
            assert list(trajectory.behaviour_logprobs[start:end]) == [0.0] * (end - start)
            assert set(trajectory.policy_versions[start:end]) == {trajectory.policy_versions[start - 1]}
            observations.append(_decode(trajectory.response_token_ids[start:end]))
    return observations


async def test_episodes_call_the_python_tool_between_turns(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    router: tuple[ScriptedRouter, str],
    reward_and_tools: tuple[RecordingReward, str],
) -> None:
    fake, router_address = router
    job_id, spec = await start_job(
        bus, tokenizer_dir, max_turns=3, tools=["python"], max_new_tokens=600, max_tool_output_tokens=64
    )
    task = make_task(job_id, spec, tokenizer)
    fake.prompt_id = task.prompt_id
    reward, reward_address = reward_and_tools
    got = await roll_out(bus, task, router_address, reward_address)

    assert [t.id for t in got] == [f"{task.prompt_id}:{i}" for i in range(4)]
    observations = {}
    for t in got:
        exchanges = [e for e in fake.exchanges if e.index == t.sample_index]
        assert list(t.prompt_token_ids) == list(task.prompt_token_ids)
        observations[t.sample_index] = check_token_in_token_out(t, exchanges, list(task.prompt_token_ids))
        assert t.num_turns == len({e.turn for e in exchanges})

    # 0: x computed in turn 1 and read in turn 2 (one session), then the right answer
    s0 = got[0]
    assert (s0.num_turns, s0.finish_reason, s0.reward, s0.reward_error) == (
        3,
        common_pb2.FINISH_REASON_STOP,
        1.0,
        "",
    )
    assert observations[0] == [
        "<tool_response>\n56088\n\n</tool_response>\n",
        "<tool_response>\n56089\n\n</tool_response>\n",
    ]
    assert (s0.metadata["tool_calls"], s0.metadata["tool_errors"], s0.metadata["resumes"]) == ("2", "0", "0")

    # 1: the malformed call is answered with an error; the aborted turn 2 resumed from its tokens
    s1 = got[1]
    [error] = observations[1]
    assert "error: the tool call is not valid JSON" in error and "</tool_response>" in error
    assert (s1.num_turns, s1.finish_reason, s1.reward, s1.metadata["resumes"]) == (
        2,
        common_pb2.FINISH_REASON_STOP,
        1.0,
        "1",
    )
    assert s1.metadata["tool_errors"] == "1"
    resume = next(e.request for e in fake.exchanges if e.request.request_id.endswith("turn2:resume1"))
    turn2 = next(e.request for e in fake.exchanges if e.request.request_id == f"{task.prompt_id}:1:turn2")
    assert list(resume.prompt_token_ids) == [*turn2.prompt_token_ids, *fake.turn_ids(1, 2)[:ABORT_AFTER]]
    assert resume.resume_offset == len(turn2.prompt_token_ids)
    assert resume.sampling.max_new_tokens == turn2.sampling.max_new_tokens - ABORT_AFTER
    assert turn2.sampling.seed == turn_seed(7, 1, 2) and resume.sampling.seed == resume_seed(
        turn2.sampling.seed, 1, 1
    )
    seeds = {e.request.request_id: e.request.sampling.seed for e in fake.exchanges if e.turn > 1}
    for index, turn in [(0, 2), (0, 3), (2, 3), (3, 3)]:
        assert seeds[f"{task.prompt_id}:{index}:turn{turn}"] == turn_seed(7, index, turn)
    assert len(set(seeds.values()) | {7}) == len(seeds) + 1, "a distinct seed per sample, turn and resume"
    model_versions = [v for v, m in zip(s1.policy_versions, s1.loss_mask, strict=True) if m]
    assert VERSION + 1 in model_versions, "the resumed tokens keep the version that produced them"

    # 2: max_turns: the third call ends the episode unexecuted; turn 1's long output was cut
    s2 = got[2]
    assert (s2.num_turns, s2.finish_reason) == (3, common_pb2.FINISH_REASON_TOOL_CALL)
    assert observations[2][1] == "<tool_response>\n2\n\n</tool_response>\n" and len(observations[2]) == 2
    cut = (
        "<tool_response>\n"
        + "ab" * 16
        + "\n[... 37 tokens of output cut ...]\n"
        + "b"
        + "ab" * 15
        + "\n\n</tool_response>\n"
    )
    assert observations[2][0] == cut, "the first and last 32 tokens of the output, around a marker"
    assert s2.metadata["tool_calls"] == "2" and s2.reward == 0.0

    # 3: a failing run is shown with its error; a bare JSON call ends its turn at EOS
    s3 = got[3]
    failure, forty_two = observations[3]
    assert "ZeroDivisionError" in failure and "error: exception" in failure
    assert "42" in forty_two and (s3.num_turns, s3.reward, s3.metadata["tool_errors"]) == (3, 0.0, "1")

    # the turn requests: per sample, alone, same affinity, the budget left, the task's sampling
    for e in fake.exchanges:
        if e.turn > 1 and not e.request.resume_offset:
            so_far = len(e.request.prompt_token_ids) - len(task.prompt_token_ids)
            assert (e.request.sampling.n, e.request.session_id, e.request.job_id) == (
                1,
                task.group_id,
                job_id,
            )
            assert e.request.sampling.max_new_tokens == 600 - so_far
            assert e.request.sampling.temperature == 1.0
    first = [e for e in fake.exchanges if e.turn == 1]
    assert len(first) == 4 and {e.request.request_id for e in first} == {task.prompt_id}, "one group Generate"

    # the reward service scored the last turn's text, with the whole response as the transcript and
    # the turn count; exact_match reads texts alone (CheckVerifier), so no token ids were sent
    items = {item.trajectory_id: item for item in reward.items}
    for t in got:
        item = items[t.id]
        assert item.response_text == SCRIPTS[t.sample_index][t.num_turns - 1]
        assert not item.response_token_ids and not item.prompt_token_ids and item.num_turns == t.num_turns
        assert item.metadata["transcript"] == _decode(t.response_token_ids, skip_special_tokens=True)


async def test_an_observation_that_leaves_no_budget_ends_the_episode_at_length(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    router: tuple[ScriptedRouter, str],
    reward_and_tools: tuple[RecordingReward, str],
) -> None:
    fake, router_address = router
    observation = tokenizer("<tool_response>\n56088\n\n</tool_response>\n", add_special_tokens=False)
    budget = len(fake.turn_ids(0, 1)) + len(observation["input_ids"])  # sample 0: nothing left after it
    job_id, spec = await start_job(bus, tokenizer_dir, max_turns=3, tools=["python"], max_new_tokens=budget)
    task = make_task(job_id, spec, tokenizer)
    fake.prompt_id = task.prompt_id
    got = await roll_out(bus, task, router_address, reward_and_tools[1])

    for t in got:
        assert (t.num_turns, t.finish_reason) == (1, common_pb2.FINISH_REASON_LENGTH)
        assert list(t.response_token_ids) == fake.turn_ids(t.sample_index, 1), "no observation appended"
        assert all(t.loss_mask) and t.metadata["tool_calls"] == "1"
        exchanges = [e for e in fake.exchanges if e.index == t.sample_index]
        check_token_in_token_out(t, exchanges, list(task.prompt_token_ids))
    assert {e.turn for e in fake.exchanges} == {1}, "no turn is asked for without a token to spend"
