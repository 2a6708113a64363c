"""The trainer processes' group: where this process stands in it, and the collectives of a
data parallel optimiser step.

Every rank runs its share of the step's micro-batches (``share_of``), the loss scaled so
that DeepSpeed's average over ranks is the gradient of the whole batch (``gradient_scale``),
and the step's totals are summed over ranks (``sum_over_ranks``). How rank 0 leads the
others through a job is ``leader.py``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class World:
    """This process's place among the trainer processes, as the launcher describes it."""

    rank: int
    size: int
    local_rank: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


def world_from_env() -> World:
    """RANK, WORLD_SIZE, LOCAL_RANK as torchrun and the deepspeed launcher set them (absent: one process)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"RANK {rank} and WORLD_SIZE {size} do not describe a process group")
    return World(rank, size, int(os.environ.get("LOCAL_RANK", str(rank))))


def rank() -> int:
    """This process's rank in the trainer's group (0 without one)."""
    return dist.get_rank() if dist.is_initialized() else 0


def size() -> int:
    """Processes training together (1 without a group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


P = TypeVar("P")


def share_of(packs: list[P]) -> list[tuple[P, bool]]:
    """This rank's micro-batches of an optimiser step, each with whether it is real.

    Rank r takes packs r, r + size, ... (the packs come largest first, so the shares
    are balanced). Every rank must run the same number of forward and backward passes,
    since ZeRO reduces gradients (and ZeRO-3 gathers weights) inside them: a rank with
    fewer packs repeats its last one, or else the step's last, as padding that the
    caller weights 0.
    """
    world, me = size(), rank()
    mine = [(pack, True) for pack in packs[me::world]]
    passes = -(-len(packs) // world)
    if not packs:
        return []
    filler = mine[-1][0] if mine else packs[-1]
    return mine + [(filler, False)] * (passes - len(mine))


def gradient_scale() -> float:
    """Factor on each rank's loss: DeepSpeed averages gradients over ranks, and each rank's
    loss is its part of a loss normalised over the whole batch, so their sum is wanted."""
    return float(size())


D = TypeVar("D")


def sum_over_ranks(totals: D) -> D:
    """A dataclass of numbers summed field by field over every rank (itself in one process)."""
    if size() == 1:
        return totals
    fields = dataclasses.fields(cast(Any, totals))
    values = torch.tensor([float(getattr(totals, f.name)) for f in fields], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        values = values.cuda()
    dist.all_reduce(values)
    summed = {
        f.name: type(getattr(totals, f.name))(value) for f, value in zip(fields, values.tolist(), strict=True)
    }
    return cast(D, dataclasses.replace(cast(Any, totals), **summed))
