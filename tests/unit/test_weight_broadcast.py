"""The distributed weight transport's rounds over gloo on 127.0.0.1: the stream layout and its
fingerprint, a sender and two receivers in processes of their own, a receiver whose sender never
sends (bounded by its deadline), a fingerprint mismatch, and rounds the receiver or the sender
skipped."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from services.common.pb import common_pb2
from services.common.weight_broadcast import (
    ALIGN,
    BroadcastError,
    Deadline,
    Group,
    Header,
    Layout,
    buckets,
    checksum,
    fingerprint,
    open_group,
    pack,
    send_round,
    unpack,
)
from services.rollout.config import EngineSettings
from services.rollout.engine_protocol import ServedWeights
from services.rollout.server import receiver_for
from services.rollout.transport import BroadcastReceiver, serve_handle

HOST = "127.0.0.1"


def sample_state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(7, 5, generator=generator),
        "model.norm.weight": torch.randn(5, generator=generator).to(torch.bfloat16),
        "model.layers.0.mlp.weight": torch.randn(3, 11, generator=generator).to(torch.float16),
        "buffers.positions": torch.arange(13, dtype=torch.int64),
        "buffers.mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
    }


def assert_same(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert sorted(left) == sorted(right)
    for name in left:
        assert left[name].dtype == right[name].dtype and left[name].shape == right[name].shape, name
        assert torch.equal(left[name], right[name]), name


# -- the stream and its fingerprint ---------------------------------------------------------------


def test_pack_and_unpack_round_trip_through_buckets_of_any_size() -> None:
    state = sample_state()
    layout = Layout.of_state(state)
    assert all(offset % ALIGN == 0 for offset in layout.offsets)
    assert Layout.from_proto(layout.to_proto()) == layout
    stream = pack(state, layout, torch.device("cpu"))
    assert stream.numel() == layout.total_bytes
    for bucket_bytes in (1, 37, 64, layout.total_bytes, 10 * layout.total_bytes):
        rebuilt = torch.empty_like(stream)
        cut = list(buckets(stream.numel(), bucket_bytes))
        assert cut[0][0] == 0 and cut[-1][1] == stream.numel()
        assert all(a[1] == b[0] for a, b in itertools.pairwise(cut))
        for start, stop in cut:
            rebuilt[start:stop] = stream[start:stop]
        assert_same(unpack(rebuilt, layout), state)


@pytest.mark.parametrize("length", [64, 64 * 1001, (1 << 24) + 64 * 3])
def test_the_checksum_is_its_definition(length: int) -> None:
    """The byte sum and the sum of bytes x (position mod 256 x 65521 + 1), across chunks and rows."""
    generator = torch.Generator().manual_seed(length)
    stream = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=generator)
    values = stream.to(torch.int64)
    weights = torch.arange(length, dtype=torch.int64) % (256 * 65521) + 1
    assert checksum(stream) == (int(values.sum()), int((values * weights).sum()))


def test_the_fingerprint_changes_with_any_byte_order_or_spec() -> None:
    state = sample_state()
    layout = Layout.of_state(state)
    stream = pack(state, layout, torch.device("cpu"))
    mark = fingerprint(stream, layout)
    assert fingerprint(pack(sample_state(), layout, torch.device("cpu")), layout) == mark
    flipped = stream.clone()
    flipped[100] ^= 1
    assert fingerprint(flipped, layout) != mark
    swapped = stream.clone()
    swapped[:64], swapped[64:128] = stream[64:128].clone(), stream[:64].clone()  # a misordered bucket
    assert fingerprint(swapped, layout) != mark
    renamed = Layout.of_state({("x" + k if k == "scalar" else k): v for k, v in state.items()})
    assert renamed.total_bytes == layout.total_bytes and fingerprint(stream, renamed) != mark
    assert fingerprint(pack(sample_state(1), layout, torch.device("cpu")), layout) != mark
    header = Header(3, 7, layout.total_bytes, mark)
    assert Header.from_tensor(header.to_tensor()) == header


# -- rounds over gloo ----------------------------------------------------------------------------


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    """The trainer's TCPStore on a free loopback port."""
    yield dist.TCPStore(HOST, 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)


def offer(
    store: dist.TCPStore,
    engines: list[str],
    state: dict[str, torch.Tensor],
    *,
    version: int = 1,
    group: str = "g",
    deadline_s: float = 30.0,
    bucket_bytes: int = 100,
) -> common_pb2.CheckpointHandle:
    """The handle of ``state`` as v``version`` (epoch 1), offered over group ``group``."""
    layout = Layout.of_state(state)
    handle = common_pb2.CheckpointHandle(job_id="job", version=version, epoch=1, uri="file:///nowhere")
    handle.broadcast.CopyFrom(
        common_pb2.WeightsBroadcast(
            group_name=group,
            master_address=HOST,
            master_port=store.port,
            world_size=len(engines) + 1,
            engine_ids=engines,
            backend="gloo",
            tensors=layout.to_proto(),
            bucket_bytes=bucket_bytes,
            deadline_s=deadline_s,
            fingerprint=fingerprint(pack(state, layout, torch.device("cpu")), layout),
        )
    )
    return handle


def send(group: Group, handle: common_pb2.CheckpointHandle, state: dict[str, torch.Tensor]) -> None:
    """Rank 0's round of ``state`` as the version ``handle`` names."""
    layout = Layout.of_state(state)
    stream = pack(state, layout, torch.device("cpu"))
    header = Header(int(handle.epoch), int(handle.version), layout.total_bytes, handle.broadcast.fingerprint)
    send_round(group, stream, header, int(handle.broadcast.bucket_bytes), Deadline(30))


def sender_group(store: dist.TCPStore, name: str, size: int) -> Group:
    return open_group(store, name=name, rank=0, size=size, backend="gloo", deadline=Deadline(30), host=HOST)


def in_thread(work: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``work`` in a thread now; the returned call joins it and returns (or raises) its outcome."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as err:  # handed to the test's thread
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> Any:
        thread.join(60)
        assert not thread.is_alive(), "the thread is still running"
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return join


def test_two_receivers_in_processes_of_their_own_get_identical_tensors(
    store: dist.TCPStore, tmp_path: Path, python: str, python_env: dict[str, str]
) -> None:
    state = sample_state()
    handle = offer(store, ["engine-a", "engine-b"], state, bucket_bytes=97)  # buckets cut tensors
    handle_file = tmp_path / "handle.bin"
    handle_file.write_bytes(handle.SerializeToString())
    peers = [
        subprocess.Popen(
            [python, "-m", "tests.unit.broadcast_peer", name, str(handle_file), str(tmp_path / name)],
            env=python_env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name in ("engine-a", "engine-b")
    ]
    try:
        group = sender_group(store, "g", 3)
        send(group, handle, state)
        results = [json.loads(peer.communicate(timeout=60)[0].splitlines()[-1]) for peer in peers]
    finally:
        for peer in peers:
            peer.kill()
    assert [result["ok"] for result in results] == [True, True], results
    for name in ("engine-a", "engine-b"):
        assert_same(load_file(str(tmp_path / name)), state)
    group.close()


def test_a_receiver_whose_sender_never_sends_gives_up_by_its_deadline(store: dist.TCPStore) -> None:
    state = sample_state()
    handle = offer(store, ["engine-a"], state, deadline_s=2.0)
    receiver = BroadcastReceiver("engine-a", HOST)
    started = time.monotonic()
    receiving = in_thread(lambda: receiver.receive(handle))
    group = sender_group(store, "g", 2)  # the group forms, and then nothing is sent
    with pytest.raises((TimeoutError, BroadcastError)):
        receiving()
    assert 1.5 < time.monotonic() - started < 6.0
    group.close()


def test_a_receiver_without_its_group_gives_up_by_its_deadline(store: dist.TCPStore) -> None:
    handle = offer(store, ["engine-a"], sample_state(), deadline_s=1.5)
    started = time.monotonic()
    with pytest.raises(BroadcastError, match="could not form group"):
        BroadcastReceiver("engine-a", HOST).receive(handle)
    assert time.monotonic() - started < 5.0


def test_other_bytes_than_the_handles_fingerprint_are_refused(store: dist.TCPStore) -> None:
    state = sample_state()
    handle = offer(store, ["engine-a"], state)
    receiver = BroadcastReceiver("engine-a", HOST)
    receiving = in_thread(lambda: receiver.receive(handle))
    group = sender_group(store, "g", 2)
    tampered = dict(state, scalar=torch.tensor(3.5))  # sent under the handle's fingerprint
    send(group, handle, tampered)
    with pytest.raises(BroadcastError, match="fingerprint mismatch"):
        receiving()
    group.close()


def test_skipped_rounds_are_drained_or_kept_for_the_next_handle(store: dist.TCPStore) -> None:
    states = {version: sample_state(version) for version in (1, 2, 3)}
    handles = {version: offer(store, ["engine-a"], states[version], version=version) for version in states}
    receiver = BroadcastReceiver("engine-a", HOST)
    # The engine saw v2 only: it drains the round of v1, then takes v2, in the same group.
    receiving = in_thread(lambda: receiver.receive(handles[2]))
    group = sender_group(store, "g", 2)
    send(group, handles[1], states[1])
    send(group, handles[2], states[2])
    assert_same(receiving(), states[2])
    # It wants v2 again but the trainer sends v3: refused now, served from memory for v3's handle.
    receiving = in_thread(lambda: receiver.receive(handles[2]))
    send(group, handles[3], states[3])
    with pytest.raises(BroadcastError, match="sent epoch 1 v3, not v2"):
        receiving()
    assert_same(receiver.receive(handles[3]), states[3])
    group.close()
    receiver.leave()


# -- the engine's choice between the group and the files -----------------------------------------


class RecordingEngine:
    """Serves whatever it is handed, and says how."""

    receives_state_dicts = True

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def load_weights(self, path: Path, **fields: Any) -> ServedWeights:
        self.calls.append("files")
        return ServedWeights(fields["version"], fields["job_id"], path, fields["mode"])

    async def load_state_dict(self, state: dict[str, torch.Tensor], **fields: Any) -> ServedWeights:
        self.calls.append("state dict")
        return ServedWeights(fields["version"], fields["job_id"], fields["path"], fields["mode"])


def files_of(directory: Path) -> str:
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"")
    (directory / "config.json").write_text("{}")
    return directory.as_uri()


async def test_an_unreachable_group_falls_back_to_the_files_and_says_why(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    handle = offer(store, ["engine-a"], sample_state(), deadline_s=1.0)
    handle.uri = files_of(tmp_path / "v1")
    engine = RecordingEngine()
    delivered = await serve_handle(engine, BroadcastReceiver("engine-a", HOST), handle, 0, 5.0)  # type: ignore[arg-type]
    assert engine.calls == ["files"] and delivered.transport == "filesystem"
    assert "could not form group" in delivered.fallback


async def test_a_group_copy_is_used_and_a_handle_without_one_is_no_fallback(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    state = sample_state()
    handle = offer(store, ["engine-a"], state)
    engine = RecordingEngine()
    receiver = BroadcastReceiver("engine-a", HOST)
    serving = asyncio.create_task(serve_handle(engine, receiver, handle, 0, 5.0))  # type: ignore[arg-type]
    group = await asyncio.to_thread(sender_group, store, "g", 2)
    await asyncio.to_thread(send, group, handle, state)
    delivered = await serving
    assert engine.calls == ["state dict"] and (delivered.transport, delivered.fallback) == ("distributed", "")
    plain = common_pb2.CheckpointHandle(job_id="job", version=2, uri=files_of(tmp_path / "v2"))
    delivered = await serve_handle(engine, receiver, plain, 0, 5.0)  # type: ignore[arg-type]
    assert engine.calls[-1] == "files" and (delivered.transport, delivered.fallback) == ("filesystem", "")
    other = offer(store, ["engine-b"], state, version=3)
    other.uri = files_of(tmp_path / "v3")
    delivered = await serve_handle(engine, receiver, other, 0, 5.0)  # type: ignore[arg-type]
    assert delivered.transport == "filesystem" and "not in group" in delivered.fallback
    group.close()
    receiver.leave()


def test_only_engines_that_take_state_dicts_and_allow_it_receive() -> None:
    allowed, refused = (
        EngineSettings(redis_url="redis://x"),
        EngineSettings(redis_url="redis://x", weight_transport_distributed=False),
    )
    engine = RecordingEngine()
    assert receiver_for(allowed, engine, "e") is not None  # type: ignore[arg-type]
    assert receiver_for(refused, engine, "e") is None  # type: ignore[arg-type]
    engine.receives_state_dicts = False  # the SGLang backend
    assert receiver_for(allowed, engine, "e") is None  # type: ignore[arg-type]
