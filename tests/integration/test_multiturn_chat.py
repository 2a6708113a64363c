"""Multi-turn episodes of a chat job: the prompt comes from the feed rendered by the chat template,
the tool results are appended as the template's own tool turns, and the trajectory the trainer
gets is token for token what the engine saw and produced: exactly the template's rendering of the
whole conversation. Real Redis, the real Reward + Tools service, the scripted router of
test_multiturn.py, a ChatML character tokenizer (tests/chat_tokenizers.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import AutoTokenizer

from services.common.bus import Bus
from services.common.config import JobSpec
from services.common.jobs import RUNNING, JobStore
from services.common.pb import common_pb2, router_pb2_grpc
from services.common.streams import JobStreams
from services.controller.feed import PromptFeed
from services.reward import server as reward_server
from services.reward.config import RewardSettings
from tests.chat_tokenizers import CHATML, chat_tokenizer
from tests.helpers import serve
from tests.integration.test_multiturn import SCRIPTS, RecordingReward, ScriptedRouter, roll_out

pytestmark = pytest.mark.timeout(120)

MESSAGES = [
    {"role": "system", "content": "Use the python tool."},
    {"role": "user", "content": "What is 123*456?"},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("chat-checkpoint-v0")
    chat_tokenizer(CHATML).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
async def router(tokenizer: Any) -> AsyncIterator[tuple[ScriptedRouter, str]]:
    fake = ScriptedRouter(tokenizer)
    server, address = await serve(lambda s: router_pb2_grpc.add_RouterServicer_to_server(fake, s))
    yield fake, address
    await server.stop(None)


@pytest.fixture
async def reward_and_tools() -> AsyncIterator[tuple[RecordingReward, str]]:
    settings = RewardSettings(port=0, default_verifier="exact_match", sandbox_timeout_s=5.0)
    reward = RecordingReward(settings)

    def register(server: grpc.aio.Server) -> None:
        reward_server.reward_pb2_grpc.add_RewardServicer_to_server(reward, server)
        reward_server.tools.register(server, settings)

    server, address = await serve(register)
    yield reward, address
    await server.stop(None)


async def chat_task(bus: Bus, tokenizer: Any, tokenizer_dir: Path, data: Path) -> common_pb2.PromptTask:
    """The first task of a multi-turn chat job over ``data``, as the controller's feed makes it."""
    spec = JobSpec.model_validate(
        {
            "algorithm": {"group_size": 4},
            "reward": {"verifier": "exact_match"},
            "data": {"train": str(data), "eval": None, "metadata_fields": ["level"]},
            "rollout": {
                "max_turns": 3,
                "tools": ["python"],
                "max_new_tokens": 600,
                "max_tool_output_tokens": 64,
            },
        }
    )
    store = JobStore(bus.redis)
    job_id = (await store.create(spec)).job_id
    await store.set_state(job_id, RUNNING)
    handle = common_pb2.CheckpointHandle(
        job_id=job_id, version=0, uri=tokenizer_dir.as_uri(), format="safetensors"
    )
    await bus.publish(JobStreams(job_id).checkpoints, handle)
    [task, *_] = PromptFeed(spec, job_id, tokenizer).batch(0)  # one row: the batch repeats it
    return task


async def test_tool_results_are_the_templates_tool_turns_and_the_trainer_gets_what_the_engine_saw(
    bus: Bus,
    tokenizer: Any,
    tokenizer_dir: Path,
    tmp_path: Path,
    router: tuple[ScriptedRouter, str],
    reward_and_tools: tuple[RecordingReward, str],
) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": MESSAGES, "answer": "56088", "level": 2}) + "\n")
    task = await chat_task(bus, tokenizer, tokenizer_dir, data)
    assert json.loads(task.messages_json) == MESSAGES
    own = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert list(task.prompt_token_ids) == list(own), "the prompt is the template's rendering"
    fake, router_address = router
    fake.prompt_id = task.prompt_id
    reward, reward_address = reward_and_tools
    got = await roll_out(bus, task, router_address, reward_address)

    for t in got:
        full = [*t.prompt_token_ids, *t.response_token_ids]
        exchanges = [e for e in fake.exchanges if e.index == t.sample_index]
        produced = [False] * len(t.response_token_ids)
        for e in exchanges:
            sent, answer = list(e.request.prompt_token_ids), list(e.completion.token_ids)
            assert full[: len(sent) + len(answer)] == sent + answer, "each turn saw everything so far"
            start = len(sent) - len(task.prompt_token_ids)
            produced[start : start + len(answer)] = [True] * len(answer)
        assert list(t.loss_mask) == produced, "the loss mask is true exactly on the model's tokens"
        last = exchanges[-1]
        assert full == [*last.request.prompt_token_ids, *last.completion.token_ids], "nothing re-tokenized"
        rendered = str(tokenizer.decode(full, skip_special_tokens=False))
        assert "<|im_end|><|im_end|>" not in rendered, "a turn the model closed is not closed again"

    # sample 0 (python, a hermes call, the answer): the whole trajectory is the template's rendering
    s0 = got[0]
    conversation = [*MESSAGES]
    for turn, output in zip(SCRIPTS[0], ["56088\n", "56089\n", None], strict=True):
        conversation.append({"role": "assistant", "content": turn})
        if output is not None:
            conversation.append({"role": "tool", "name": "python", "content": output})
    whole = tokenizer.apply_chat_template(conversation, tokenize=True)["input_ids"]
    assert [*s0.prompt_token_ids, *s0.response_token_ids] == list(whole)[:-1], "all but the final newline"
    assert (s0.num_turns, s0.reward) == (3, 1.0)

    # sample 3's second call is a bare JSON turn the model ended with <|im_end|> itself
    rendered = str(tokenizer.decode(list(got[3].response_token_ids), skip_special_tokens=False))
    assert '"print(7 * 6)"}}<|im_end|>\n<|im_start|>tool\n42\n<|im_end|>\n<|im_start|>assistant\n' in rendered

    # the row's metadata reaches the reward with every sample, beside the runner's own keys
    for item in reward.items:
        assert item.metadata["level"] == "2" and item.metadata["source_prompt_id"] == "chat.jsonl:1"
        assert "tool_calls" in item.metadata
