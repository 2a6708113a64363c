"""The engine's side of the ``distributed`` weight transport: join the trainer's group when a
checkpoint handle names this engine, receive the version's tensors by the round's deadline,
check their fingerprint, and hand them to the engine; on any failure load the handle's files
instead, and say so (the load's log line and ``verst_engine_weight_transport_fallbacks``).

The group is kept between versions while the handles name the same one. A receiver in the
group takes every round the trainer sends: an older one than its handle's (this engine skipped
that version) is drained, a newer one (the trainer skipped this version) is kept for the next
handle, which names it, and this version is loaded from its files.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from services.common.pb import common_pb2
from services.common.weight_broadcast import (
    BroadcastError,
    Deadline,
    Group,
    Header,
    Layout,
    fingerprint,
    open_group,
    receive_header,
    receive_stream,
    unpack,
)
from services.rollout.engine_protocol import AdapterEngine, Engine, ServedWeights
from services.rollout.weights import CheckpointError, checkpoint_dir, uri_path

log = logging.getLogger(__name__)

FILESYSTEM = "filesystem"
DISTRIBUTED = "distributed"


class BroadcastReceiver:
    """This engine's membership of a trainer's weight group (one thread at a time: the loader's)."""

    def __init__(self, engine_id: str, host: str = "") -> None:
        self.engine_id = engine_id
        self.host = host
        self._group: Group | None = None
        self._key: tuple[object, ...] | None = None
        self._store: dist.Store | None = None
        self._ahead: tuple[Header, torch.Tensor] | None = None
        """A round received before its handle was seen (the trainer skipped the one wanted)."""

    def named(self, handle: common_pb2.CheckpointHandle) -> bool:
        return handle.HasField("broadcast") and self.engine_id in handle.broadcast.engine_ids

    def receive(self, handle: common_pb2.CheckpointHandle) -> dict[str, torch.Tensor]:
        """The tensors of ``handle``'s version over its group (blocking). Raises BroadcastError
        (no such round, other bytes, a broken group) or TimeoutError (the deadline passed)."""
        offer = handle.broadcast
        layout = Layout.from_proto(offer.tensors)
        wanted = (int(handle.epoch), int(handle.version))
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (ahead[0].epoch, ahead[0].version) == wanted:
            return self._checked(ahead[1], layout, offer.fingerprint)
        deadline = Deadline(offer.deadline_s)
        group = self._join(offer, deadline)
        try:
            while True:
                header = receive_header(group, deadline)
                if header.total_bytes != layout.total_bytes:
                    size = header.total_bytes
                    raise BroadcastError(f"the round of v{header.version} has {size} bytes, not ours")
                stream = receive_stream(group, header.total_bytes, int(offer.bucket_bytes), deadline)
                got = (header.epoch, header.version)
                if got == wanted:
                    return self._checked(stream, layout, offer.fingerprint)
                if got[0] == wanted[0] and got[1] < wanted[1]:
                    continue  # a version this engine skipped: drained
                if fingerprint(stream, layout) == header.fingerprint:
                    self._ahead = (header, stream)
                raise BroadcastError(f"the trainer sent epoch {got[0]} v{got[1]}, not v{wanted[1]}")
        except (BroadcastError, TimeoutError, RuntimeError) as err:
            if self._ahead is None:
                self.leave()  # out of step with the sender, or broken: a new group next time
            if isinstance(err, (BroadcastError, TimeoutError)):
                raise
            raise BroadcastError(f"{type(err).__name__}: {err}") from err

    @staticmethod
    def _checked(stream: torch.Tensor, layout: Layout, expected: str) -> dict[str, torch.Tensor]:
        found = fingerprint(stream, layout)
        if found != expected:
            raise BroadcastError(f"fingerprint mismatch: the handle has {expected}, the tensors {found}")
        return unpack(stream, layout)

    def _join(self, offer: common_pb2.WeightsBroadcast, deadline: Deadline) -> Group:
        """The group ``offer`` names, joined now unless this engine is in it already."""
        if self.engine_id not in offer.engine_ids:
            raise BroadcastError(f"{self.engine_id} is not in group {offer.group_name}")
        rank = list(offer.engine_ids).index(self.engine_id) + 1
        key = (offer.group_name, offer.master_address, offer.master_port, offer.world_size, rank)
        if self._group is not None and self._key == key:
            return self._group
        self.leave()
        try:
            address, port = offer.master_address, offer.master_port
            self._store = dist.TCPStore(address, port, None, False, timeout=deadline.left())
        except RuntimeError as err:
            raise BroadcastError(f"cannot reach {offer.master_address}:{offer.master_port}: {err}") from err
        self._group = open_group(
            self._store,
            name=offer.group_name,
            rank=rank,
            size=offer.world_size,
            backend=offer.backend,
            deadline=deadline,
            host=self.host,
        )
        self._key = key
        log.info("joined weight group %s as rank %d of %d", offer.group_name, rank, offer.world_size)
        return self._group

    def leave(self) -> None:
        group, self._group, self._key, self._store = self._group, None, None, None
        if group is not None:
            group.close()


@dataclass(frozen=True, slots=True)
class Delivered:
    """How a handle's weights came to be served."""

    update: ServedWeights
    transport: str
    """``distributed`` (over the group) or ``filesystem`` (its files)."""
    fallback: str = ""
    """Why the group's copy was not used though the handle offered it (empty: it was, or none)."""


async def serve_handle(
    engine: Engine,
    receiver: BroadcastReceiver | None,
    handle: common_pb2.CheckpointHandle,
    mode: int,
    timeout_s: float,
) -> Delivered:
    """Serve ``handle``'s weights over its group when it names this engine, else (or when that
    fails) from its files; a LoRA adapter's through ``load_adapter`` (CheckpointError from a
    backend without one). Raises what ``Engine.load_weights`` raises."""
    if handle.HasField("adapter"):
        return Delivered(await serve_adapter(engine, handle, mode, timeout_s), FILESYSTEM)
    reason = ""
    if receiver is not None and receiver.named(handle):
        try:
            state = await asyncio.to_thread(receiver.receive, handle)
            update = await engine.load_state_dict(
                state,
                path=uri_path(handle.uri),
                version=handle.version,
                job_id=handle.job_id,
                mode=mode,
                timeout_s=timeout_s,
            )
            return Delivered(update, DISTRIBUTED)
        except (BroadcastError, TimeoutError, CheckpointError) as err:
            reason = f"{type(err).__name__}: {err}"
        log.warning(
            "weights %s v%d over group %s failed (%s); loading its files instead",
            *(handle.job_id, handle.version, handle.broadcast.group_name, reason),
        )
    elif handle.HasField("broadcast") and receiver is not None:
        reason = f"{receiver.engine_id} is not in group {handle.broadcast.group_name}"
    update = await engine.load_weights(
        checkpoint_dir(handle.uri),
        sha256=handle.sha256,
        version=handle.version,
        job_id=handle.job_id,
        mode=mode,
        timeout_s=timeout_s,
    )
    return Delivered(update, FILESYSTEM, reason)


async def serve_adapter(
    engine: Engine, handle: common_pb2.CheckpointHandle, mode: int, timeout_s: float
) -> ServedWeights:
    """Serve a LoRA adapter handle on a backend that applies adapters (``AdapterEngine``); any
    other refuses it, so that an engine never serves the base model as if it were the job's."""
    adapter = handle.adapter
    if not isinstance(engine, AdapterEngine):
        raise CheckpointError(
            f"job {handle.job_id} v{handle.version} is a LoRA adapter, and the {engine.backend} backend "
            "does not apply adapters: serve LoRA jobs with the torch backend, or export merged "
            "weights (`verst export --merge`) and serve those"
        )
    return await engine.load_adapter(
        uri_path(handle.uri),
        sha256=handle.sha256,
        base=checkpoint_dir(adapter.base_uri),
        base_sha256=adapter.base_sha256,
        version=handle.version,
        job_id=handle.job_id,
        mode=mode,
        timeout_s=timeout_s,
    )
