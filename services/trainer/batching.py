"""Training samples, their packing into micro-batches by a token budget, and collation.

A micro-batch is a few rows, right-padded to its longest row, so its cost is
``rows * longest``; packing keeps that under ``trainer.micro_batch_tokens``.
With ``trainer.packing`` (the default) a row holds several samples end to end,
each with its own position ids from 0; transformers reads the restarts of the
position ids as sequence boundaries and masks attention across them
(``masking_utils.find_packed_sequence_indices``), so a sample sees only itself
and the rows need almost no padding. Without it a row is one sample, masked by
``attention_mask``. ``layout_checks.packs_exactly`` checks at load that a model honours
packed position ids; one that does not is trained a sample per row.

With ``trainer.share_prompts`` the samples of one prompt (a GRPO group) share its tokens:
a unit of a row is the prompt but its last token once, then for each sample its own span,
the prompt's last token again followed by the response. A 4D attention mask lets a span see
the shared prefix and itself only, and position ids continue from the prompt in each span,
so every sample's logits are those it gets alone while the prompt is computed once
(``plan_samples`` keeps a unit's samples together; ``layout_checks.shares_exactly`` checks
the model at load).

Per-token tensors are aligned with the *targets* (``input_ids[:, 1:]``): the
logits at column t score token t + 1, so response token j of a sample that
starts at column c and whose prompt has P tokens sits at column c + P + j - 1.
The column before the next sample (which would score its first token) is never
on the mask.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy
import torch

log = logging.getLogger(__name__)


# --- which samples of a step share a prompt in their row (collate(shared=True)) ---------------

SHARED_UNIT_TOKENS = 1024
"""At most this many tokens share one prompt (longer groups are cut into pieces): wider rows
make attention dearer than the prompt tokens a piece saves (at batching.ATTENTION_WIDTH, the
same 1,024, attention costs a token as much as the rest of its forward and backward)."""
SHARED_SAMPLE_TOKENS = SHARED_UNIT_TOKENS // 2
"""Prompts are shared only in steps whose samples are all this short: longer ones leave a piece
one sample (nothing shared), and their rows would need masks of width x width."""


def sharing_pays(samples: Sequence[TrainSample], shared: bool) -> bool:
    """Whether a step's ``samples`` are laid out with shared prompts (``shared`` asked for it)."""
    return shared and bool(samples) and max(s.length for s in samples) <= SHARED_SAMPLE_TOKENS


def row_units(samples: Sequence[TrainSample], row: Sequence[int]) -> list[list[int]]:
    """The samples of ``row`` as units: runs of consecutive samples with the same prompt (of
    at least two tokens: a shorter one has nothing to share)."""
    units: list[list[int]] = []
    for index in row:
        prompt = samples[index].prompt_token_ids
        previous = samples[units[-1][0]].prompt_token_ids if units else None
        if previous is not None and len(prompt) > 1 and list(prompt) == list(previous):
            units[-1].append(index)
        else:
            units.append([index])
    return units


def unit_length(samples: Sequence[TrainSample], unit: Sequence[int]) -> int:
    """Tokens of a unit laid out: its prompt but the last token once, then per sample that last
    token and the response (a unit of one sample: just the sample)."""
    prompt = len(samples[unit[0]].prompt_token_ids)
    return (
        prompt - 1 + sum(1 + len(samples[i].response_token_ids) for i in unit)
        if prompt
        else sum(samples[i].length for i in unit)
    )


@dataclass(frozen=True, slots=True)
class TrainSample:
    """One response to learn from, with everything the loss needs.

    The optional per-token lists are aligned with ``response_token_ids`` and filled in
    at the start of a step (``services/trainer/prepare.py``); left None they default
    as their docstrings say.
    """

    prompt_token_ids: Sequence[int]
    response_token_ids: Sequence[int]
    loss_mask: Sequence[bool]
    behaviour_logprobs: Sequence[float]
    advantage: float | Sequence[float]
    """One per response token, or one number for all of them (an outcome estimator's)."""
    old_logprobs: Sequence[float] | None = None
    """log p under the trainer's weights when the step began (PPO's old policy); None: behaviour's."""
    ref_logprobs: Sequence[float] | None = None
    """log p under the frozen reference model; None when there is no KL term."""
    returns: Sequence[float] | None = None
    """The critic's targets (GAE); None without a critic."""
    old_values: Sequence[float] | None = None
    """The critic's values when the step began (for the value clip); None without a critic."""
    is_weights: Sequence[float] | None = None
    """Behaviour importance weight of each token's policy loss (algorithm.off_policy_correction); None: 1."""
    weight: float = 1.0
    """Multiplies every token weight of the sample (staleness downweighting)."""

    @property
    def length(self) -> int:
        return len(self.prompt_token_ids) + len(self.response_token_ids)

    @property
    def loss_tokens(self) -> int:
        return sum(1 for keep in self.loss_mask if keep)

    def token_advantages(self) -> list[float]:
        if isinstance(self.advantage, int | float):
            return [float(self.advantage)] * len(self.response_token_ids)
        if len(self.advantage) != len(self.response_token_ids):
            raise ValueError("a sample needs one advantage per response token")
        return [float(a) for a in self.advantage]


PER_TOKEN_FIELDS = ("behaviour", "old", "ref", "advantages", "returns", "old_values", "is_weights", "weights")
"""Target-aligned float tensors collate fills from each sample's per-response-token values."""
Pack = list[list[int]]
"""One micro-batch: its rows, each the indices of the samples laid end to end in it."""


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Right-padded rows of a few samples; target-aligned tensors have one column less."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    """Each sample's positions from 0 (the padding after a row's samples counts from 0 too)."""
    attention_mask: torch.Tensor | None
    """1 on real tokens for rows of one sample; None for packed rows (the position ids mask them);
    ``[rows, 1, width, width]`` booleans for shared prompts (True: may attend)."""
    placements: tuple[tuple[int, int], ...]
    """(row, column of its first token) of each sample, in the order they were given."""
    behaviour_logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    """The trainer's logprobs at the start of the step (behaviour's where a sample has none)."""
    ref_logprobs: torch.Tensor
    """The reference model's logprobs (0 where a sample has none)."""
    advantages: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor
    is_weights: torch.Tensor
    """Behaviour importance weight of each token (1 where a sample has none)."""
    mask: torch.Tensor
    weights: torch.Tensor
    """Aggregation weight x the sample's weight; 0 off the mask."""
    tokens: int
    """Real (unpadded) tokens, prompts included."""
    padded_tokens: int
    """Tokens the forward pass computes: rows x the longest row."""

    def model_inputs(self) -> dict[str, torch.Tensor | bool]:
        """Keyword arguments of a transformers forward pass over this micro-batch."""
        inputs: dict[str, torch.Tensor | bool] = {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "use_cache": False,
        }
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        return inputs


def pack_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped so that ``rows * longest <= token_budget`` in each group.

    First-fit decreasing: longest first, each into the first group it fits. A
    sequence longer than the budget on its own gets a group of its own. Every
    index appears exactly once.
    """
    if token_budget < 1:
        raise ValueError("token_budget must be >= 1")
    groups: list[list[int]] = []
    room: list[int] = []  # rows each group opened so far can still take
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True):
        slot = next((g for g, free in enumerate(room) if free > 0), None)
        if slot is not None:
            groups[slot].append(index)
            room[slot] -= 1
        else:  # its first member is its longest: it sets the group's width
            room.append(token_budget // max(lengths[index], 1) - 1)
            groups.append([index])
    return groups


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Indices of ``lengths`` in rows of at most ``width`` tokens in all (first-fit decreasing);
    a sequence longer than ``width`` gets a row of its own."""
    if width < 1:
        raise ValueError("width must be >= 1")
    rows: list[list[int]] = []
    room: list[int] = []  # free tokens of each row opened so far
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True):
        length = lengths[index]
        slot = next((r for r, free in enumerate(room) if free >= length), None)
        if slot is not None:
            rows[slot].append(index)
            room[slot] -= length
        else:
            room.append(width - length)
            rows.append([index])
    return rows


ATTENTION_WIDTH = 1024
"""Row width at which attention costs about as much per token as the rest of a forward and
backward pass: on CPU, SmolLM2-135M took 1.76x as long over one row of 1024 tokens as over eight
rows of 128, so a token in a row of width w costs about 1 + w / 1024."""
ROW_WIDTHS = tuple(1 + k / 8 for k in range(9))
"""Row widths ``plan_micro_batches`` tries, as multiples of the longest sample."""


def plan_micro_batches(lengths: Sequence[int], token_budget: int, packed: bool = True) -> list[Pack]:
    """The micro-batches of one optimiser step, largest first: each a list of rows of sample indices.

    Packed: samples go end to end into rows (first-fit decreasing), then the rows into
    micro-batches of ``rows * longest row <= token_budget``. Wider rows leave less padding but
    make attention dearer (it is quadratic in the row), so rows of 1 to 2 times the longest
    sample are tried and the plan of the least estimated cost is taken (``ATTENTION_WIDTH``).
    Not packed: one sample per row, the same grouping.
    """
    if not packed or not lengths:
        return [[[index] for index in group] for group in pack_micro_batches(lengths, token_budget)]
    longest = max(lengths)
    widths = sorted({min(round(longest * factor), max(longest, token_budget)) for factor in ROW_WIDTHS})
    plans = [_packed_plan(lengths, token_budget, width) for width in widths]
    return min(plans, key=lambda plan: _estimated_cost(lengths, plan))  # the first, narrowest, on ties


def _packed_plan(lengths: Sequence[int], token_budget: int, width: int) -> list[Pack]:
    rows = pack_rows(lengths, width)
    fills = [sum(lengths[i] for i in row) for row in rows]
    return [[rows[r] for r in group] for group in pack_micro_batches(fills, token_budget)]


def _estimated_cost(lengths: Sequence[int], plan: Sequence[Pack]) -> float:
    """Token positions computed, padding included, each dearer the wider its micro-batch's rows."""
    cost = 0.0
    for pack in plan:
        width = max(sum(lengths[i] for i in row) for row in pack)
        cost += len(pack) * width * (1 + width / ATTENTION_WIDTH)
    return cost


def padding_waste(lengths: Sequence[int], packs: Sequence[Pack]) -> float:
    """Share of the token positions of ``packs`` that are padding: 1 - real / (rows x longest row)."""
    real = sum(lengths[i] for pack in packs for row in pack for i in row)
    computed = sum(len(pack) * max(sum(lengths[i] for i in row) for row in pack) for pack in packs if pack)
    return 1.0 - real / computed if computed else 0.0


def collate(
    samples: Sequence[TrainSample],
    token_weights: Sequence[float],
    device: torch.device | str,
    rows: Sequence[Sequence[int]] | None = None,
    pad_token_id: int = 0,
    shared: bool = False,
) -> MicroBatch:
    """Right-padded tensors of ``samples`` on ``device``; ``token_weights`` holds each
    sample's aggregation weight per loss token (see losses.sample_token_weights).

    ``rows`` lays the samples out (indices into ``samples``, each exactly once); None: one
    sample per row. A row of several samples is packed (see the module's docstring); with
    ``shared``, consecutive samples of a row with the same prompt share it.
    """
    if not samples or len(samples) != len(token_weights):
        raise ValueError("collate needs one token weight per sample, and at least one sample")
    layout = [list(row) for row in rows] if rows is not None else [[i] for i in range(len(samples))]
    if sorted(i for row in layout for i in row) != list(range(len(samples))):
        raise ValueError("rows must hold every sample exactly once")
    units = [row_units(samples, row) if shared else [[i] for i in row] for row in layout]
    fills = [sum(unit_length(samples, unit) for unit in row) for row in units]
    packed = any(len(row) > 1 for row in layout)
    width = max(fills)
    shape = (len(layout), width)
    # numpy buffers filled from the samples' lists, one tensor each at the end: far cheaper
    # than a small tensor per sample and field for the many short samples of RL
    buffers = RowBuffers(
        numpy.full(shape, pad_token_id, dtype=numpy.int64),
        numpy.zeros(shape, dtype=numpy.int64),
        numpy.full(shape, -1, dtype=numpy.int64),
        numpy.full(shape, -1, dtype=numpy.int64),
    )
    targets = (len(layout), max(width - 1, 0))
    per_token = {
        name: numpy.full(targets, 1.0 if name == "is_weights" else 0.0, dtype=numpy.float32)
        for name in PER_TOKEN_FIELDS
    }
    mask = numpy.zeros(targets, dtype=numpy.bool_)
    placements: dict[int, tuple[int, int]] = {}
    for row, row_of_units in enumerate(units):
        column = 0
        for number, unit in enumerate(row_of_units):
            for index, at in buffers.place_unit(samples, unit, row, column, number):
                placements[index] = at
                _place_targets(
                    samples[index], token_weights[index] * samples[index].weight, at, per_token, mask
                )
            column += unit_length(samples, unit)
        buffers.positions[row, column:] = numpy.arange(width - column)
    on = {name: torch.from_numpy(array).to(device) for name, array in per_token.items()}
    attention = buffers.attention(shared, packed)
    return MicroBatch(
        input_ids=torch.from_numpy(buffers.input_ids).to(device),
        position_ids=torch.from_numpy(buffers.positions).to(device),
        attention_mask=None if attention is None else torch.from_numpy(attention).to(device),
        placements=tuple(placements[i] for i in range(len(samples))),
        behaviour_logprobs=on["behaviour"],
        old_logprobs=on["old"],
        ref_logprobs=on["ref"],
        advantages=on["advantages"],
        returns=on["returns"],
        old_values=on["old_values"],
        is_weights=on["is_weights"],
        mask=torch.from_numpy(mask).to(device),
        weights=torch.from_numpy(per_token["weights"] * mask).to(device),
        tokens=sum(fills),
        padded_tokens=len(layout) * width,
    )


@dataclass(frozen=True, slots=True)
class RowBuffers:
    """The token-aligned buffers of one micro-batch as ``collate`` fills them."""

    input_ids: numpy.ndarray
    positions: numpy.ndarray
    units: numpy.ndarray
    """Per column, which unit of its row it belongs to (-1: padding)."""
    spans: numpy.ndarray
    """Per column, which sample's span it belongs to (-1: a unit's shared prefix, or padding)."""

    def place_unit(
        self, samples: Sequence[TrainSample], unit: Sequence[int], row: int, column: int, number: int
    ) -> list[tuple[int, tuple[int, int]]]:
        """Lay ``unit`` out at (``row``, ``column``); returns each sample's placement, the column
        such that column + prompt length - 1 is its first response target (as for a sample alone)."""
        prompt = list(samples[unit[0]].prompt_token_ids)
        shared = max(len(prompt) - 1, 0)
        end = column + shared
        self.input_ids[row, column:end] = prompt[:shared]
        self.positions[row, column:end] = numpy.arange(shared)
        self.units[row, column:end] = number
        placed = []
        for index in unit:
            sample = samples[index]
            span = [*prompt[shared:], *sample.response_token_ids]
            start, stop = end, end + len(span)
            self.input_ids[row, start:stop] = span
            self.positions[row, start:stop] = numpy.arange(shared, shared + len(span))
            self.units[row, start:stop] = number
            self.spans[row, start:stop] = index
            placed.append((index, (row, start - shared)))
            end = stop
        return placed

    def attention(self, shared: bool, packed: bool) -> numpy.ndarray | None:
        """The mask the forward needs: None for packed rows (the position ids separate the
        samples), 1 on real tokens for rows of one sample, a ``[rows, 1, width, width]`` boolean
        mask (True: may attend) for shared prompts."""
        if not shared:
            return None if packed else (self.units >= 0).astype(numpy.int64)
        width = self.units.shape[1]
        columns = numpy.arange(width)
        same_unit = (self.units[:, :, None] == self.units[:, None, :]) & (self.units[:, None, :] >= 0)
        visible = (self.spans[:, None, :] == -1) | (self.spans[:, :, None] == self.spans[:, None, :])
        causal = columns[None, :] <= columns[:, None]
        allowed = same_unit & visible & causal[None]
        allowed |= numpy.eye(width, dtype=numpy.bool_)[None]  # padding sees itself: no empty row
        return allowed[:, None]


def _place_targets(
    sample: TrainSample,
    weight: float,
    at: tuple[int, int],
    per_token: dict[str, numpy.ndarray],
    mask: numpy.ndarray,
) -> None:
    """Write ``sample``'s per-response-token values (``weight`` its token weight) into the target
    columns of a sample placed ``at`` (row, column of its first token)."""
    row, column = at
    response = len(sample.response_token_ids)
    first = column + len(sample.prompt_token_ids) - 1
    span = slice(first, first + response)
    values = {
        "behaviour": sample.behaviour_logprobs,
        "old": sample.old_logprobs if sample.old_logprobs is not None else sample.behaviour_logprobs,
        "ref": sample.ref_logprobs,
        "advantages": sample.token_advantages(),
        "returns": sample.returns,
        "old_values": sample.old_values,
        "is_weights": sample.is_weights,
        "weights": [weight] * response,
    }
    for name, value in values.items():
        if value is not None:
            per_token[name][row, span] = value
    mask[row, span] = sample.loss_mask


def collate_pack(
    samples: Sequence[TrainSample],
    token_weights: Sequence[float],
    pack: Pack,
    device: torch.device | str,
    shared: bool = False,
) -> MicroBatch:
    """``collate`` of one micro-batch of ``plan_samples``: ``pack``'s rows index into
    ``samples`` and ``token_weights`` (a whole step's); its placements follow the pack's rows."""
    indices, rows, start = [], [], 0
    for row in pack:
        indices.extend(row)
        rows.append(list(range(start, start + len(row))))
        start += len(row)
    chosen = [samples[i] for i in indices]
    return collate(chosen, [token_weights[i] for i in indices], device, rows, shared=shared)


def plan_samples(
    samples: Sequence[TrainSample], token_budget: int, packed: bool = True, shared: bool = False
) -> list[Pack]:
    """``plan_micro_batches`` of ``samples``; with ``shared`` (and ``packed``), of their prompt
    units instead: the samples of one prompt, in pieces of at most ``SHARED_UNIT_TOKENS`` (or the
    budget), each piece's samples consecutive in one row."""
    if not (shared and packed):
        return plan_micro_batches([s.length for s in samples], token_budget, packed)
    cap = max(max(s.length for s in samples), min(token_budget, SHARED_UNIT_TOKENS))
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for index, sample in enumerate(samples):
        by_prompt.setdefault(tuple(sample.prompt_token_ids), []).append(index)
    units: list[list[int]] = []
    for members in by_prompt.values():
        units.append([])
        for index in members:
            if units[-1] and unit_length(samples, [*units[-1], index]) > cap:
                units.append([])
            units[-1].append(index)
    lengths = [unit_length(samples, unit) for unit in units]
    plan = plan_micro_batches(lengths, token_budget, packed=True)
    return [[[i for u in row for i in units[u]] for row in pack] for pack in plan]


def plan_step(
    samples: Sequence[TrainSample], token_budget: int, packed: bool, shared: bool
) -> tuple[list[Pack], bool]:
    """A step's micro-batches (``plan_samples``) and whether they share prompts: where asked for
    and packed, for steps short enough (``sharing.sharing_pays``). Collate them with that flag."""
    shared = packed and sharing_pays(samples, shared)
    return plan_samples(samples, token_budget, packed, shared), shared


def per_response_token(
    samples: Sequence[TrainSample],
    token_budget: int,
    device: torch.device | str,
    forward: Callable[[MicroBatch], torch.Tensor],
    packed: bool = True,
    shared: bool = False,
) -> list[list[float]]:
    """``forward``'s target-aligned ``[rows, width - 1]`` output, cut to each sample's response
    tokens: samples laid out by ``plan_samples`` and run a micro-batch at a time."""
    found: dict[int, list[float]] = {}
    unweighted = [0.0] * len(samples)
    packs, shared = plan_step(samples, token_budget, packed, shared)
    for pack in packs:
        batch = collate_pack(samples, unweighted, pack, device, shared)
        values = forward(batch).detach().float().cpu()
        indices = [i for row in pack for i in row]
        for index, (row, column) in zip(indices, batch.placements, strict=True):
            sample = samples[index]
            first = column + len(sample.prompt_token_ids) - 1
            found[index] = values[row, first : first + len(sample.response_token_ids)].tolist()
    return [found[i] for i in range(len(samples))]


def response_matrix(rows: Sequence[Sequence[float]], fill: float = 0.0) -> torch.Tensor:
    """Per-response-token lists as one ``[samples, longest]`` float64 tensor, padded with ``fill``."""
    width = max((len(row) for row in rows), default=0)
    matrix = numpy.full((len(rows), width), fill, dtype=numpy.float64)
    for index, row in enumerate(rows):
        matrix[index, : len(row)] = row
    return torch.from_numpy(matrix)


def response_mask(samples: Sequence[TrainSample]) -> torch.Tensor:
    """The loss mask of each sample's response tokens, ``[samples, longest]``, False past the end."""
    width = max((len(s.response_token_ids) for s in samples), default=0)
    mask = numpy.zeros((len(samples), width), dtype=numpy.bool_)
    for index, sample in enumerate(samples):
        mask[index, : len(sample.loss_mask)] = sample.loss_mask
    return torch.from_numpy(mask)


def unpad(matrix: torch.Tensor, samples: Sequence[TrainSample]) -> list[list[float]]:
    """The rows of a ``[samples, longest]`` response tensor, each cut to its sample's length."""
    rows = matrix.tolist()
    return [rows[i][: len(s.response_token_ids)] for i, s in enumerate(samples)]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p of each next token, in fp32: ``[batch, tokens - 1]``, aligned with the targets.

    log_softmax of the raw logits (temperature 1), like the engines' behaviour logprobs.
    """
    shifted = logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    return shifted.gather(-1, targets).squeeze(-1) - torch.logsumexp(shifted, dim=-1)
