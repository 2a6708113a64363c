"""Weights over a torch.distributed group: what the trainer's rank 0 sends and the engines
receive under the ``distributed`` weight transport (the trainer and the engines both use it;
neither imports the other).

A round carries one checkpoint. Its tensors lie end to end in one byte stream, each at a
multiple of ``ALIGN`` bytes (so a received tensor is a view of the stream), in the order of
the handle's ``WeightsBroadcast.tensors``. Rank 0 first broadcasts a header (epoch, version,
stream length, fingerprint), then the stream in buckets of ``bucket_bytes``. The group is a
``ProcessGroupGloo`` (CPU tensors) or ``ProcessGroupNCCL`` (CUDA tensors) made directly on a
``PrefixStore`` over the trainer's ``TCPStore``: never the default world, which the trainer's
own ranks use. Every wait, group formation included, ends by the round's deadline.

The fingerprint is a checksum of the stream (Adler-like: the byte sum and the sum of bytes
weighted by their position mod 256 x 65521, plus one) and a digest of the tensor specs,
computed with torch ops on the tensors' device, so it costs no copy to the host on either
side. It catches a round that delivered other bytes (another version, a torn or misordered
bucket); it is not a cryptographic hash: the file's sha256 still guards the filesystem handle.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.common.pb import common_pb2

ALIGN = 64
"""Every tensor starts at a multiple of this many bytes of the stream."""
MAGIC = 0x76657273
"""The first word of a header ("vers")."""
_ROW = 256
_MOD = 65521
"""The checksum weighs byte i by (i mod _ROW * _MOD) + 1."""
_CHUNK = _ROW * 65536
"""Bytes checksummed at once (whole rows): 16 MB, 64 MB of float32 temporaries."""
_HEADER_WORDS = 8
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
BACKENDS = ("gloo", "nccl")


class BroadcastError(RuntimeError):
    """A round that did not deliver its checkpoint: a timeout, a broken group, other bytes."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each tensor lies in a round's stream."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    total_bytes: int

    @classmethod
    def of(cls, specs: Sequence[tuple[str, str, Sequence[int]]]) -> Layout:
        offsets, position = [], 0
        for _, dtype, shape in specs:
            if dtype not in DTYPES:
                raise ValueError(f"cannot broadcast tensors of dtype {dtype!r}")
            offsets.append(position)
            size = DTYPES[dtype].itemsize * _numel(shape)
            position += -(-size // ALIGN) * ALIGN
        return cls(
            names=tuple(name for name, _, _ in specs),
            dtypes=tuple(dtype for _, dtype, _ in specs),
            shapes=tuple(tuple(int(n) for n in shape) for _, _, shape in specs),
            offsets=tuple(offsets),
            total_bytes=position,
        )

    @classmethod
    def of_state(cls, state: Mapping[str, torch.Tensor]) -> Layout:
        """The layout of a state dict, its tensors in key order."""
        return cls.of([(name, dtype_name(state[name].dtype), state[name].shape) for name in sorted(state)])

    @classmethod
    def from_proto(cls, specs: Sequence[common_pb2.TensorSpec]) -> Layout:
        return cls.of([(spec.name, spec.dtype, spec.shape) for spec in specs])

    def to_proto(self) -> list[common_pb2.TensorSpec]:
        return [
            common_pb2.TensorSpec(name=name, dtype=dtype, shape=shape)
            for name, dtype, shape in zip(self.names, self.dtypes, self.shapes, strict=True)
        ]

    @property
    def digest(self) -> int:
        """A 62-bit digest of the specs: two sides agree on the stream's meaning."""
        text = json.dumps([self.names, self.dtypes, self.shapes])
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest()) >> 2


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for n in shape:
        count *= int(n)
    return count


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack(state: Mapping[str, torch.Tensor], layout: Layout, device: torch.device) -> torch.Tensor:
    """The stream of ``state``'s tensors (a uint8 tensor on ``device``), padding zeroed."""
    stream = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
    for name, offset in zip(layout.names, layout.offsets, strict=True):
        raw = state[name].detach().contiguous().reshape(-1).view(torch.uint8)
        stream[offset : offset + raw.numel()].copy_(raw)
    return stream


def unpack(stream: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """The tensors of a stream, as views of it (no copy)."""
    state = {}
    for name, dtype, shape, offset in zip(
        layout.names, layout.dtypes, layout.shapes, layout.offsets, strict=True
    ):
        kind = DTYPES[dtype]
        raw = stream[offset : offset + kind.itemsize * _numel(shape)]
        state[name] = raw.view(kind).reshape(shape)
    return state


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def checksum(stream: torch.Tensor) -> tuple[int, int]:
    """(sum of bytes, sum of bytes x (position mod 256 * 65521 + 1)) of a uint8 stream, exact.

    The stream is read as rows of 256 bytes: one matmul against (1, k + 1) gives each row's
    sum and in-row weighted sum (below 2^24, so exact in float32; float64 on CUDA, where TF32
    may be on), and the rows' weights are added with int64 arithmetic on the row sums.
    """
    device = stream.device
    kind = torch.float64 if stream.is_cuda else torch.float32
    weights = _WEIGHTS.get(device)
    if weights is None:
        in_row = torch.arange(1, _ROW + 1, dtype=kind, device=device)
        weights = _WEIGHTS[device] = torch.stack([torch.ones_like(in_row), in_row], dim=1)
    plain = weighted = 0
    for start in range(0, stream.numel(), _CHUNK):
        chunk = stream[start : start + _CHUNK]
        tail = (-chunk.numel()) % _ROW
        if tail:
            chunk = torch.cat([chunk, chunk.new_zeros(tail)])
        sums = (chunk.view(-1, _ROW).to(kind) @ weights).to(torch.int64)
        row = torch.arange(sums.shape[0], dtype=torch.int64, device=device) + start // _ROW
        plain += int(sums[:, 0].sum())
        weighted += int(sums[:, 1].sum()) + _ROW * int(((row % _MOD) * sums[:, 0]).sum())
    return plain % (1 << 62), weighted % (1 << 62)


def fingerprint(stream: torch.Tensor, layout: Layout) -> str:
    """The fingerprint of a round's stream: spec digest, byte sum, weighted sum (hex)."""
    return format_fingerprint(layout.digest, *checksum(stream))


def format_fingerprint(digest: int, plain: int, weighted: int) -> str:
    return f"{digest:016x}-{plain:016x}-{weighted:016x}"


def buckets(total_bytes: int, bucket_bytes: int) -> Iterator[tuple[int, int]]:
    """The (start, stop) byte ranges of a stream's buckets."""
    if bucket_bytes < 1:
        raise ValueError("bucket_bytes must be >= 1")
    for start in range(0, total_bytes, bucket_bytes):
        yield start, min(start + bucket_bytes, total_bytes)


@dataclass(frozen=True, slots=True)
class Header:
    """What a round carries, announced before its buckets."""

    epoch: int
    version: int
    total_bytes: int
    fingerprint: str

    def to_tensor(self) -> torch.Tensor:
        digest, plain, weighted = (int(part, 16) for part in self.fingerprint.split("-"))
        words = [MAGIC, self.epoch, self.version, self.total_bytes, digest, plain, weighted, 0]
        return torch.tensor(words, dtype=torch.int64)

    @classmethod
    def from_tensor(cls, words: torch.Tensor) -> Header:
        values = [int(w) for w in words.cpu()]
        if values[0] != MAGIC:
            raise BroadcastError(f"not a round header: {values}")
        return cls(values[1], values[2], values[3], format_fingerprint(*values[4:7]))


class Deadline:
    """The time left of a round; raises TimeoutError once it is spent."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self) -> timedelta:
        remaining = self.at - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the round's deadline of {self.seconds:g}s has passed")
        return timedelta(seconds=remaining)


class Group:
    """One transport group: this process's rank in it, over the backend's process group."""

    def __init__(
        self, name: str, rank: int, size: int, backend: str, process_group: dist.ProcessGroup
    ) -> None:
        self.name = name
        self.rank = rank
        self.size = size
        self.backend = backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        self._pg: dist.ProcessGroup | None = process_group

    def broadcast(self, tensor: torch.Tensor, deadline: Deadline) -> None:
        """Broadcast ``tensor`` in place from rank 0, within the deadline."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        if self._pg is None:
            raise BroadcastError(f"group {self.name} is closed")
        work = self._pg.broadcast([tensor], options)
        if not work.wait(deadline.left()):
            raise TimeoutError("a broadcast did not complete by the round's deadline")
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    def close(self) -> None:
        """Leave the group (its other members' operations fail rather than wait)."""
        group, self._pg = self._pg, None
        abort = getattr(group, "abort", None)
        if callable(abort):
            with contextlib.suppress(RuntimeError):
                abort()


def open_group(
    store: dist.Store,
    *,
    name: str,
    rank: int,
    size: int,
    backend: str,
    deadline: Deadline,
    host: str = "",
) -> Group:
    """Join group ``name`` of ``size`` ranks on ``store`` as ``rank``; every rank must call it
    by the deadline. ``host``: the address gloo binds (empty: gloo's choice from the hostname)."""
    prefixed = dist.PrefixStore(f"verst-weights/{name}", store)
    timeout = deadline.left()
    try:
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            group: dist.ProcessGroup = dist.ProcessGroupGloo(prefixed, rank, size, options)
        elif backend == "nccl":
            nccl = dist.ProcessGroupNCCL
            options = nccl.Options()
            options._timeout = timeout
            group = nccl(prefixed, rank, size, options)
        else:
            raise ValueError(f"unknown broadcast backend {backend!r}: use one of {BACKENDS}")
    except RuntimeError as err:
        raise BroadcastError(f"could not form group {name} ({size} ranks, {backend}): {err}") from err
    return Group(name, rank, size, backend, group)


def send_round(
    group: Group, stream: torch.Tensor, header: Header, bucket_bytes: int, deadline: Deadline
) -> None:
    """Rank 0: the header, then the stream in buckets (through one bucket on the group's
    device when the stream lies elsewhere: a CPU stream over NCCL)."""
    device = group.device or torch.device("cpu")
    group.broadcast(header.to_tensor().to(device), deadline)
    staging = None if stream.device == device else torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    for start, stop in buckets(stream.numel(), bucket_bytes):
        chunk = stream[start:stop]
        if staging is not None:
            chunk = staging[: stop - start].copy_(chunk)
        group.broadcast(chunk, deadline)


def receive_header(group: Group, deadline: Deadline) -> Header:
    words = torch.zeros(_HEADER_WORDS, dtype=torch.int64, device=group.device or torch.device("cpu"))
    group.broadcast(words, deadline)
    return Header.from_tensor(words)


def receive_stream(group: Group, total_bytes: int, bucket_bytes: int, deadline: Deadline) -> torch.Tensor:
    """The buckets of a round whose header was received, into one stream on the group's device."""
    stream = torch.empty(total_bytes, dtype=torch.uint8, device=group.device or torch.device("cpu"))
    for start, stop in buckets(total_bytes, bucket_bytes):
        group.broadcast(stream[start:stop], deadline)
    return stream
