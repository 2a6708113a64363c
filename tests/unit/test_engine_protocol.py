"""Both backends are Engines, and the one servicer maps every engine exception to one status."""

import asyncio
import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
import pytest
import torch

from services.common.pb import common_pb2, rollout_pb2
from services.rollout.engine_protocol import (
    Engine,
    EngineStatus,
    EngineStoppedError,
    EngineUnavailableError,
    GenerationRequest,
    NoWeightsError,
    ServedWeights,
    StaleWeightsError,
    WrongJobError,
)
from services.rollout.metrics import EngineMetrics
from services.rollout.servicer import (
    STATUS_CODES,
    EngineInfoSource,
    JobEndedError,
    RolloutServicer,
    status_code,
)
from services.rollout.sglang.backend import SGLangBackend
from services.rollout.sglang.engine import SGLangEngine
from services.rollout.torch.engine import TorchEngine
from services.rollout.watcher import WeightLoader
from services.rollout.weights import CONFIG_FILE, WEIGHTS_FILE, CheckpointError
from tests.helpers import Aborted, FakeContext

MEMBERS = sorted(
    name for name, member in vars(Engine).items() if not name.startswith("_") and inspect.isfunction(member)
)


def signature_problems(cls: type) -> list[str]:
    """How ``cls``'s methods differ from the Engine protocol's: parameter names, kinds and
    defaults, and whether they are coroutines."""
    problems = []
    for name in MEMBERS:
        expected, actual = getattr(Engine, name), getattr(cls, name, None)
        if actual is None:
            problems.append(f"{name} is missing")
            continue
        if inspect.iscoroutinefunction(expected) != inspect.iscoroutinefunction(actual):
            problems.append(f"{name} is {'not ' if inspect.iscoroutinefunction(expected) else ''}async")
        shape = [(p.name, p.kind, p.default) for p in inspect.signature(expected).parameters.values()]
        if shape != [(p.name, p.kind, p.default) for p in inspect.signature(actual).parameters.values()]:
            problems.append(f"{name}{inspect.signature(actual)} is not {name}{inspect.signature(expected)}")
    return problems


def test_the_protocol_names_what_the_servicer_uses() -> None:
    assert MEMBERS == [
        "abort", "cancel", "close", "describe", "load_state_dict", "load_weights", "pause", "resume",
        "set_draining", "status", "submit",
    ]  # fmt: skip


@pytest.mark.parametrize("cls", [TorchEngine, SGLangEngine])
def test_both_backends_have_the_protocols_methods(cls: type) -> None:
    assert signature_problems(cls) == []


async def test_both_backends_are_engines() -> None:
    torch_engine = TorchEngine(
        device=torch.device("cpu"), dtype=torch.float32, max_batch_size=1, batch_wait_s=0
    )
    client = SGLangBackend(["http://sglang.test"])
    assert isinstance(torch_engine, Engine) and isinstance(SGLangEngine(client), Engine)
    assert (torch_engine.backend, SGLangEngine(client).backend) == ("torch", "sglang")
    await client.close()


def test_the_checks_catch_a_backend_that_differs() -> None:
    class Sync(SGLangEngine):
        def resume(self) -> None:  # type: ignore[override]
            pass

        async def abort(self, request_ids: Sequence[str] = (), *, everything: bool = False) -> int:  # type: ignore[override]
            return 0

    problems = signature_problems(Sync)
    assert [problem.split("(")[0] for problem in problems] == ["abort", "resume is not async"]
    assert "everything" in problems[0]
    assert not isinstance(object(), Engine)


# -- the status table ------------------------------------------------------------------------


class FailingEngine:
    """An Engine whose every call raises ``error`` (submit at once, or through on_error)."""

    backend = "fake"
    receives_state_dicts = False

    def __init__(self, error: Exception, *, later: bool = False) -> None:
        self.error = error
        self.later = later
        self.cancelled: list[GenerationRequest] = []

    def describe(self) -> str:
        return "nowhere"

    def status(self) -> EngineStatus:
        return EngineStatus(common_pb2.ENGINE_STATE_SERVING, 1, "job", "", 0, 0, 0)

    def submit(self, request: GenerationRequest) -> None:
        if not self.later:
            raise self.error
        assert request.on_error is not None
        request.on_error(self.error)

    def cancel(self, request: GenerationRequest) -> None:
        self.cancelled.append(request)

    async def load_weights(
        self, path: Path, *, sha256: str, version: int, job_id: str, mode: int, timeout_s: float
    ) -> ServedWeights:
        raise self.error

    async def load_state_dict(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        path: Path,
        version: int,
        job_id: str,
        mode: int,
        timeout_s: float,
    ) -> ServedWeights:
        raise self.error

    async def abort(self, request_ids: Sequence[str] = (), *, all_requests: bool = False) -> int:
        raise self.error

    async def pause(self, *, abort_inflight: bool) -> int:
        raise self.error

    async def resume(self) -> None:
        raise self.error

    def set_draining(self) -> None:
        pass

    async def close(self) -> None:
        pass


def servicer_over(engine: Engine) -> RolloutServicer:
    info = EngineInfoSource(engine, "engine-1", "node:1")
    return RolloutServicer(engine, WeightLoader(engine, 5.0), info, EngineMetrics(engine.status))


def test_the_fake_is_an_engine() -> None:
    assert isinstance(FailingEngine(RuntimeError()), Engine) and signature_problems(FailingEngine) == []


LOAD_ERRORS = [
    (CheckpointError("sha256 mismatch"), grpc.StatusCode.INVALID_ARGUMENT),
    (TimeoutError("not taken within 1s"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (EngineStoppedError("engine is shutting down"), grpc.StatusCode.UNAVAILABLE),
    (
        EngineUnavailableError("SGLang http://s/update_weights_from_disk: cannot connect"),
        grpc.StatusCode.UNAVAILABLE,
    ),
]


@pytest.mark.parametrize(("error", "code"), LOAD_ERRORS)
async def test_load_weights_errors_map_to_one_status_each(
    error: Exception, code: grpc.StatusCode, tmp_path
) -> None:
    (tmp_path / WEIGHTS_FILE).write_bytes(b"w")
    (tmp_path / CONFIG_FILE).write_text("{}")
    request = rollout_pb2.LoadWeightsRequest(
        handle=common_pb2.CheckpointHandle(uri=tmp_path.as_uri(), version=2)
    )
    with pytest.raises(Aborted) as failed:
        await servicer_over(FailingEngine(error)).LoadWeights(request, FakeContext())
    assert (failed.value.code, failed.value.details) == (code, str(error))


async def test_a_bad_checkpoint_uri_is_invalid_before_the_engine_hears_of_it() -> None:
    engine = FailingEngine(AssertionError("the engine was asked"))
    request = rollout_pb2.LoadWeightsRequest(handle=common_pb2.CheckpointHandle(uri="s3://bucket/v1"))
    with pytest.raises(Aborted) as failed:
        await servicer_over(engine).LoadWeights(request, FakeContext())
    assert failed.value.code == grpc.StatusCode.INVALID_ARGUMENT and "s3" in failed.value.details


async def test_an_error_the_table_does_not_name_is_not_turned_into_a_status() -> None:
    assert status_code(RuntimeError("a bug")) is None
    with pytest.raises(RuntimeError, match="a bug"):
        await servicer_over(FailingEngine(RuntimeError("a bug"))).Pause(
            rollout_pb2.PauseRequest(), FakeContext()
        )


GENERATE_ERRORS = [
    (NoWeightsError("no weights loaded"), grpc.StatusCode.FAILED_PRECONDITION),
    (WrongJobError("engine serves job 'a', not 'b'"), grpc.StatusCode.FAILED_PRECONDITION),
    (StaleWeightsError("the request needs job v3 or newer"), grpc.StatusCode.FAILED_PRECONDITION),
    (JobEndedError("job 'b' ended: its requests are refused"), grpc.StatusCode.FAILED_PRECONDITION),
    (ValueError("prompt_token_ids is empty"), grpc.StatusCode.INVALID_ARGUMENT),
    (EngineStoppedError("engine is shutting down"), grpc.StatusCode.UNAVAILABLE),
    (EngineUnavailableError("SGLang http://s/generate: HTTP 500"), grpc.StatusCode.UNAVAILABLE),
]


@pytest.mark.parametrize("later", [False, True], ids=["on-submit", "on-error"])
@pytest.mark.parametrize(("error", "code"), GENERATE_ERRORS)
async def test_generate_errors_map_to_one_status_each(
    error: Exception, code: grpc.StatusCode, later: bool
) -> None:
    servicer = servicer_over(FailingEngine(error, later=later))
    request = rollout_pb2.GenerateRequest(
        prompt_token_ids=[1], sampling=common_pb2.SamplingParams(max_new_tokens=1)
    )
    for call in (
        servicer.Generate(request, FakeContext()),
        anext(servicer.GenerateStream(request, FakeContext())),
    ):
        with pytest.raises(Aborted) as failed:
            await call
        assert (failed.value.code, failed.value.details) == (code, str(error))


async def test_bad_sampling_and_resume_offsets_are_invalid() -> None:
    servicer = servicer_over(FailingEngine(AssertionError("the engine was asked")))
    for request in (
        rollout_pb2.GenerateRequest(
            prompt_token_ids=[1], sampling=common_pb2.SamplingParams(max_new_tokens=0)
        ),
        rollout_pb2.GenerateRequest(
            prompt_token_ids=[1], resume_offset=2, sampling=common_pb2.SamplingParams(max_new_tokens=1)
        ),
    ):
        with pytest.raises(Aborted) as failed:
            await servicer.Generate(request, FakeContext())
        assert failed.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_every_status_in_the_table_is_tested() -> None:
    tested = [error for error, _ in LOAD_ERRORS + GENERATE_ERRORS]
    for kind, _ in STATUS_CODES:
        assert any(type(error) is kind or type(error).__mro__[1] is kind for error in tested), kind
    assert all(status_code(error) == code for error, code in LOAD_ERRORS + GENERATE_ERRORS)


class VersionedEngine(FailingEngine):
    """Serves "job" at ``version``; a load serves the handle's version."""

    def __init__(self) -> None:
        super().__init__(AssertionError("not expected"))
        self.version = 1

    def status(self) -> EngineStatus:
        return EngineStatus(common_pb2.ENGINE_STATE_SERVING, self.version, "job", "", 0, 0, 0)

    async def load_weights(
        self, path: Path, *, sha256: str, version: int, job_id: str, mode: int, timeout_s: float
    ) -> ServedWeights:
        self.version = version
        return ServedWeights(version=version, job_id=job_id, path=path, mode=mode)


async def test_a_request_waits_for_the_version_it_needs_until_it_loads(tmp_path: Path) -> None:
    (tmp_path / WEIGHTS_FILE).write_bytes(b"w")
    (tmp_path / CONFIG_FILE).write_text("{}")
    engine = VersionedEngine()
    loader = WeightLoader(engine, 5.0)
    await loader.wait_for_version("job", (0, 1), timeout_s=0.01)  # served already: no wait
    waiting = asyncio.create_task(loader.wait_for_version("job", (0, 2), timeout_s=5.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    handle = common_pb2.CheckpointHandle(job_id="job", epoch=1, version=2, uri=tmp_path.as_uri(), sha256="ab")
    await loader.load(handle, rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE)
    await asyncio.wait_for(waiting, 1.0)  # woken by the load, long before its deadline
    with pytest.raises(
        StaleWeightsError, match=r"needs job v3 \(epoch 1\) or newer; the engine serves job v2"
    ):
        await loader.wait_for_version("job", (1, 3), timeout_s=0.05)
    with pytest.raises(StaleWeightsError, match="needs other v1"):
        await loader.wait_for_version("other", (0, 1), timeout_s=0.05)


async def test_a_later_epoch_satisfies_any_version_of_an_earlier_one(tmp_path: Path) -> None:
    """A trainer resumed from an older durable checkpoint publishes lower versions in a new
    epoch: a task issued at v9 of epoch 1 must not wait for the new lineage to reach v9."""
    (tmp_path / WEIGHTS_FILE).write_bytes(b"w")
    (tmp_path / CONFIG_FILE).write_text("{}")
    loader = WeightLoader(VersionedEngine(), 5.0)
    handle = common_pb2.CheckpointHandle(job_id="job", epoch=2, version=5, uri=tmp_path.as_uri(), sha256="ab")
    await loader.load(handle, rollout_pb2.WEIGHT_UPDATE_MODE_CONTINUE)
    await loader.wait_for_version("job", (1, 9), timeout_s=0.01)
    with pytest.raises(StaleWeightsError, match=r"needs job v9 \(epoch 2\)"):
        await loader.wait_for_version("job", (2, 9), timeout_s=0.05)
    with pytest.raises(StaleWeightsError, match=r"needs job v2 \(epoch 3\)"):  # the old lineage's v5
        await loader.wait_for_version("job", (3, 2), timeout_s=0.05)


async def test_generate_for_a_version_not_loaded_in_time_is_failed_precondition() -> None:
    engine = VersionedEngine()
    info = EngineInfoSource(engine, "engine-1", "node:1")
    servicer = RolloutServicer(
        engine, WeightLoader(engine, 5.0), info, EngineMetrics(engine.status), version_wait_s=0.05
    )
    request = rollout_pb2.GenerateRequest(
        prompt_token_ids=[1],
        job_id="job",
        min_policy_version=4,
        sampling=common_pb2.SamplingParams(max_new_tokens=1),
    )
    with pytest.raises(Aborted) as failed:
        await servicer.Generate(request, FakeContext())
    assert failed.value.code == grpc.StatusCode.FAILED_PRECONDITION and "needs job v4" in failed.value.details
