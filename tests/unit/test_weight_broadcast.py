"""The distributed weight transport's rounds over gloo on 127.0.0.1: the stream layout and its
fingerprint, a sender and two receivers in processes of their own, a receiver whose sender never
sends (bounded by its deadline), a fingerprint mismatch, and rounds the receiver or the sender
skipped."""

from __future__ import annotations

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
from services.rollout.transport import BroadcastReceiver

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
