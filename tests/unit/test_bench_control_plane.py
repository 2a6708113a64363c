"""bench/control_plane.py: its simulated engine and trainer, and the script end to end in its
smallest configuration (the real services, two engine counts of a couple of seconds each).
Performance is not asserted: only that groups went round the loop and the summary line has its
format."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from bench.engine_simulator import CannedSamples, SimulatedEngine
from bench.trainer_simulator import Steps
from services.common.bus import Delivery
from services.common.pb import common_pb2, rollout_pb2
from services.tasks.addition_model import build_char_tokenizer

REPO = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(r"^control-plane: engines=1 groups_per_s=(\d+) engines=2 groups_per_s=(\d+)$")


@pytest.mark.slow
def test_smoke_run_prints_the_table_and_the_summary_line(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    sizes = ["--engines", "1,2", "--seconds", "1.5", "--warmup-seconds", "0.5", "--prompts-per-step", "8",
             "--max-new-tokens", "100"]  # fmt: skip
    command = [sys.executable, str(REPO / "bench" / "control_plane.py"), *sizes, "--results", str(results),
               "--no-results"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=150, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    summary = SUMMARY.match(lines[-1])
    assert summary is not None, lines[-1]
    assert all(int(rate) > 0 for rate in summary.groups()), lines[-1]  # groups went round the loop
    rows = [line for line in lines if re.match(r"^\| [12] \| [\d,]+ \|", line)]
    assert len(rows) >= 2, done.stdout
    assert not results.exists()  # --no-results


class _Context:
    """The part of a grpc.aio.ServicerContext that the simulated engine uses."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")


def _request(version: int, n: int = 3, max_new_tokens: int = 5) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        request_id=f"r{version}",
        prompt_token_ids=[1, 20, 21],
        sampling=common_pb2.SamplingParams(n=n, max_new_tokens=max_new_tokens),
        job_id="job",
        min_policy_version=version,
    )


async def test_simulated_engine_answers_a_batch_in_order_and_fails_only_the_request_too_new() -> None:
    engine = SimulatedEngine("sim-0", "127.0.0.1:1", "redis://127.0.0.1:1/0", CannedSamples(8), 0.05)
    engine.serve(common_pb2.CheckpointHandle(job_id="job", version=2, epoch=1))
    batch = rollout_pb2.GenerateBatchRequest(
        requests=[_request(2), _request(3), _request(1, n=2, max_new_tokens=50)]
    )
    wire = await engine.GenerateBatch(batch, _Context())  # type: ignore[arg-type]
    reply = rollout_pb2.GenerateBatchResponse.FromString(wire)
    assert [r.code for r in reply.results] == [0, grpc.StatusCode.FAILED_PRECONDITION.value[0], 0]
    first, last = reply.results[0].response, reply.results[2].response
    assert (first.request_id, last.request_id) == ("r2", "r1")
    assert [c.index for c in first.completions] == [0, 1, 2]
    assert all(len(c.token_ids) == len(c.logprobs) == 5 for c in first.completions)  # max_new_tokens
    assert [len(c.token_ids) for c in last.completions] == [8, 8]  # the canned length
    assert {v for c in first.completions for v in c.policy_versions} == {2}
    assert {c.finish_reason for c in first.completions} == {common_pb2.FINISH_REASON_LENGTH}
    tokenizer = build_char_tokenizer()  # builtin:addition's, which the benchmark's job uses
    for c in [*first.completions, *last.completions]:  # the text is what the runner would decode
        assert c.text == tokenizer.decode(list(c.token_ids), skip_special_tokens=True)
    assert first.engine_id == "sim-0" and first.stats.completion_tokens == 15
    alone = await engine.answer(_request(2))  # as Generate answers it, but for its time
    alone.stats.total_s = first.stats.total_s
    assert first == alone
    await engine.redis.aclose()


def _delivery(group: str, index: int, entry: int) -> Delivery[common_pb2.Trajectory]:
    trajectory = common_pb2.Trajectory(id=f"{group}:{index}", group_id=group, sample_index=index)
    return Delivery(entry_id=f"{entry}-0", message=trajectory, delivery_count=1, stream="s")


def test_trainer_simulator_takes_whole_groups_and_keeps_duplicates_for_the_ack() -> None:
    steps = Steps(group_size=2)
    for entry, (group, index) in enumerate([("a", 0), ("b", 0), ("a", 0), ("a", 1)]):
        steps.add(_delivery(group, index, entry))
    assert steps.take(2) is None  # b has one sample of two
    steps.add(_delivery("b", 1, 9))
    taken = steps.take(2)
    assert taken is not None
    assert [[d.message.id for d in group] for group in taken] == [["a:0", "a:1"], ["b:0", "b:1"]]
    assert [d.entry_id for d in steps.extra] == ["2-0"]  # a:0 delivered twice
    assert steps.take(1) is None


def test_canned_samples_are_built_once_per_version_while_engines_serve_several() -> None:
    samples = CannedSamples(6)
    first = {version: samples.completions_wire(2, 6, version) for version in (1, 2)}
    for _ in range(3):  # engines a version apart take turns: neither version is built again
        for version in (1, 2):
            assert samples.completions_wire(2, 6, version) is first[version]
    assert rollout_pb2.GenerateResponse.FromString(first[2]).completions[1].policy_versions == [2] * 6
    kept = samples.completion(0, 6, 2)
    for version in range(3, 3 + CannedSamples.VERSIONS_KEPT):  # newer versions push the oldest out
        samples.completions_wire(2, 6, version)
    assert samples.completion(0, 6, 2) is not kept
    assert len(samples._made) == CannedSamples.VERSIONS_KEPT
