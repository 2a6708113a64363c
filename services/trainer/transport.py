"""How the engines get each published version's weights (``VERST_TRAINER_WEIGHT_TRANSPORT``).

``filesystem`` (the default): the handle names the weights-only directory on a shared volume,
and nothing else happens. ``distributed``: the same directory is still written (it is every
engine's fallback), and the handle also carries a ``WeightsBroadcast``; a thread of this
process then broadcasts the tensors over a torch.distributed group to the engines it names
(services/common/weight_broadcast.py), off the training loop, within a deadline.

The group's members are the live engines of the registry that take weights this way and
serve this job already (only they can copy a state dict into the job's model; the others
load files). The group is kept while its members stay the same and its rounds succeed;
after a timeout or an error it is torn down and the next version forms a new one. A round
not begun when a newer version is published is skipped: engines that wanted it load its
files, and the engines take the newer one over the group.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from redis.exceptions import RedisError
from safetensors.torch import load_file

from services.common.engine_registry import EngineRegistry
from services.common.pb import common_pb2
from services.common.weight_broadcast import (
    BroadcastError,
    Deadline,
    Group,
    Header,
    Layout,
    fingerprint,
    open_group,
    pack,
    send_round,
)
from services.trainer.checkpoints import WEIGHTS_FILE, PublishedWeights
from services.trainer.config import TrainerSettings

log = logging.getLogger(__name__)

CheckpointHandle = common_pb2.CheckpointHandle
DISTRIBUTED = "distributed"
"""What an engine lists in EngineInfo.weight_transports when it can receive broadcasts."""
_IDLE_WAIT_S = 1.0
"""The idle sending thread looks at its stop flag at least this often."""
_CLOSE_TIMEOUT_S = 5.0
"""Longest wait at close for the sending thread to end."""


class WeightTransport(Protocol):
    """What the lineage asks of a transport for each weights-only version it publishes."""

    name: str

    async def announce(self, published: PublishedWeights) -> CheckpointHandle:
        """The handle to publish for ``published`` (its own, or a copy saying how else to get it)."""
        ...

    def deliver(self, handle: CheckpointHandle) -> None:
        """After ``handle`` was published: start delivering its weights (returns at once)."""
        ...

    def close(self) -> None: ...


class FilesystemTransport:
    """The handle names the files; engines read them."""

    name = "filesystem"

    async def announce(self, published: PublishedWeights) -> CheckpointHandle:
        return published.handle

    def deliver(self, handle: CheckpointHandle) -> None:
        return None

    def close(self) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Round:
    """One version to broadcast to one group."""

    group_name: str
    members: tuple[str, ...]
    header: Header
    stream: torch.Tensor
    bucket_bytes: int
    deadline_s: float


def read_stream(weights: Path) -> tuple[Layout, torch.Tensor, str]:
    """The layout, byte stream and fingerprint of a model.safetensors file: the bytes the
    engines would read, already a snapshot that the next optimiser step cannot change."""
    state = load_file(str(weights))
    layout = Layout.of_state(state)
    stream = pack(state, layout, torch.device("cpu"))
    return layout, stream, fingerprint(stream, layout)


class DistributedTransport:
    """Broadcasts each version from this process (trainer rank 0) to the job's engines."""

    name = DISTRIBUTED

    def __init__(
        self, registry: EngineRegistry, settings: TrainerSettings, backend: str, address: str
    ) -> None:
        self.registry = registry
        self.backend = backend
        self.address = address
        self.port = settings.weight_transport_port
        self.deadline_s = settings.weight_transport_deadline_s
        self.bucket_bytes = settings.weight_transport_bucket_bytes
        self.engine_ttl_s = settings.weight_transport_engine_ttl_s
        self.sent_rounds = 0
        self.failed_rounds = 0
        self._store: dist.TCPStore | None = None
        self._plan: tuple[str, tuple[str, ...]] | None = None
        """The group the newest handle named, and its members."""
        self._failed: set[str] = set()
        """Groups whose round failed: never named again."""
        self._group: Group | None = None
        self._rounds: dict[int, Round] = {}
        self._cond = threading.Condition()
        self._pending: Round | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="weight-broadcast", daemon=True)

    async def announce(self, published: PublishedWeights) -> CheckpointHandle:
        """The handle with a WeightsBroadcast for the job's engines; the plain one when none
        would receive it, or when preparing the round failed (it never fails the step)."""
        try:
            return await self._announce(published)
        except (RedisError, OSError, RuntimeError, ValueError) as err:
            version = published.handle.version
            log.warning("no weight broadcast of v%d: %s; the engines load its files", version, err)
            return published.handle

    async def _announce(self, published: PublishedWeights) -> CheckpointHandle:
        handle = published.handle
        members = await self._members(handle.job_id)
        if not members:
            return handle
        layout, stream, mark = await asyncio.to_thread(read_stream, published.directory / WEIGHTS_FILE)
        port = await asyncio.to_thread(self._open_store)
        name = self._group_name(handle.job_id, members)
        announced = CheckpointHandle()
        announced.CopyFrom(handle)
        announced.broadcast.CopyFrom(
            common_pb2.WeightsBroadcast(
                group_name=name,
                master_address=self.address,
                master_port=port,
                world_size=len(members) + 1,
                engine_ids=members,
                backend=self.backend,
                tensors=layout.to_proto(),
                bucket_bytes=self.bucket_bytes,
                deadline_s=self.deadline_s,
                fingerprint=mark,
            )
        )
        header = Header(int(handle.epoch), int(handle.version), layout.total_bytes, mark)
        self._rounds = {
            int(handle.version): Round(name, members, header, stream, self.bucket_bytes, self.deadline_s)
        }
        return announced

    def deliver(self, handle: CheckpointHandle) -> None:
        if not handle.HasField("broadcast"):
            return
        prepared = self._rounds.pop(int(handle.version), None)
        if prepared is None:
            return
        with self._cond:
            if self._pending is not None:
                log.info(
                    "weight broadcast of v%d skipped for v%d", self._pending.header.version, handle.version
                )
            self._pending = prepared
            self._cond.notify_all()
            if not self._thread.is_alive() and not self._closing:
                self._thread.start()

    def close(self) -> None:
        """Stop broadcasting: a round in flight fails at once (the group is aborted)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._close_group()
        if self._thread.is_alive():
            self._thread.join(_CLOSE_TIMEOUT_S)
        self._store = None

    # -- membership ----------------------------------------------------------------------

    async def _members(self, job_id: str) -> tuple[str, ...]:
        """Live engines that receive broadcasts and serve ``job_id`` now, by engine id."""
        alive = await self.registry.alive(self.engine_ttl_s)
        found = (e.engine_id for e in alive if DISTRIBUTED in e.weight_transports and e.job_id == job_id)
        return tuple(sorted(found))

    def _group_name(self, job_id: str, members: tuple[str, ...]) -> str:
        """The group the plan names while its members hold and it has not failed, else a new one."""
        with self._cond:
            plan = self._plan
            if plan is not None and plan[1] == members and plan[0] not in self._failed:
                return plan[0]
            name = f"{job_id}-{uuid.uuid4().hex[:12]}"
            self._plan = (name, members)
            return name

    def _open_store(self) -> int:
        """The TCPStore the groups meet on (bound once, kept for the life of the transport)."""
        if self._store is None:
            self._store = dist.TCPStore(
                self.address,
                self.port,
                None,
                True,
                timeout=timedelta(seconds=self.deadline_s),
                wait_for_workers=False,
            )
            log.info("weight broadcast store on %s:%d (%s)", self.address, self._store.port, self.backend)
        return int(self._store.port)

    # -- the sending thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait(_IDLE_WAIT_S)
                if self._closing:
                    return
                prepared, self._pending = self._pending, None
            self._send(prepared)

    def _send(self, prepared: Round) -> None:
        deadline = Deadline(prepared.deadline_s)
        started = time.monotonic()
        version = prepared.header.version
        try:
            group = self._group
            if group is None or group.name != prepared.group_name:
                self._close_group()
                assert self._store is not None
                self._group = group = open_group(
                    self._store,
                    name=prepared.group_name,
                    rank=0,
                    size=len(prepared.members) + 1,
                    backend=self.backend,
                    deadline=deadline,
                    host=self.address,
                )
            send_round(group, prepared.stream, prepared.header, prepared.bucket_bytes, deadline)
        except (BroadcastError, TimeoutError, RuntimeError) as err:
            self.failed_rounds += 1
            with self._cond:
                self._failed.add(prepared.group_name)
            self._close_group()
            log.warning(
                "weight broadcast of v%d to %s failed after %.2fs (%s); they load its files, and the "
                "next version forms a new group",
                *(version, ",".join(prepared.members), time.monotonic() - started, err),
            )
            return
        self.sent_rounds += 1
        log.info(
            "weight broadcast of v%d (%d bytes) to %s in %.3fs (group %s)",
            *(version, prepared.header.total_bytes, ",".join(prepared.members)),
            *(time.monotonic() - started, prepared.group_name),
        )

    def _close_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close()


def open_transport(
    settings: TrainerSettings, registry: EngineRegistry, device: torch.device
) -> WeightTransport:
    """The transport the settings name (per deployment, for every job of this trainer)."""
    if settings.weight_transport == "filesystem":
        return FilesystemTransport()
    backend = settings.weight_transport_backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    address = settings.weight_transport_host or socket.gethostname()
    return DistributedTransport(registry, settings, backend, address)
