"""A decoder for Llama-family models over a slot KV cache: the engine's fast path.

transformers' own forward rebuilds masks, walks its cache classes and (with ``DynamicCache``)
concatenates every layer's keys and values at every step; for the small models of RL on a
CPU that overhead is most of the step. This module runs the same weights (the HF modules'
own parameters, so an in-place weight update is seen at once) with a plain torch forward:

- every sample owns a *slot* of a cache ``[slots, kv_heads, length, head_dim]`` per layer
  (grown by doubling, in slots and in length, to what the samples need, within a budget of
  slots x length), positions start at 0 in every slot (no left padding), and a finished sample's
  slot is refilled by moving the last live one into it, so the live samples are always the
  first ``B`` slots and attention reads a view of the cache, never a gathered copy;
- prefill takes several prompts right-padded together (causal attention never looks at the
  padding), writes their keys and values into the slots of all their samples, and computes
  the LM head on each prompt's last token only;
- decode feeds one token per live slot at that slot's own position, attending to its own
  cache up to that position.

The arithmetic is transformers' (RMSNorm in float32, rotary tables from the model's own
rotary module, SDPA with the model's scaling), so logprobs equal a full forward pass of the
trainer's model to float error. Architectures outside the list (or with a sliding window or a
sequence-length-dependent rotary scaling) get ``unsupported_reason`` and the engine falls back
to transformers' forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import _pytree as pytree

from services.common.long_lived import freeze_long_lived_objects
from services.rollout.torch.aot import AotStep
from services.rollout.torch.sampler import sample_unfiltered

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
_SHORT_PROMPT = 128
"""Prompts up to this many tokens are prefilled with plain matmuls on a CPU (scores stay small)."""
_FIRST_LENGTH = 256
"""Cache length first allocated per slot; it doubles when a longer sample arrives."""
_FIRST_SLOTS = 16
"""Slots first allocated in the cache; they double when more samples join (up to ``slots``)."""


def _rope_type(config: Any) -> str:
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(config, name, None)
        if isinstance(value, dict):
            return str(value.get("rope_type") or value.get("type") or "default")
    return "default"


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run on the slot decoder, or None when it can."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", True)
    positions = int(getattr(config, "max_position_embeddings", 0) or 0)
    if window and uses_window and window < positions:
        return f"sliding window attention ({window} < {positions} positions)"
    if _rope_type(config) not in _STATIC_ROPE_TYPES:
        return f"rope type {_rope_type(config)!r} depends on the sequence length"
    body = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if body is None or not all(hasattr(body, name) for name in needed) or not hasattr(model, "lm_head"):
        return "the module layout is not model.{embed_tokens, layers, norm, rotary_emb} + lm_head"
    return None


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _fuse(linears: list[torch.nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """One weight (and bias) for several linears that read the same input.

    The linears' own parameters become views into the fused tensors, so loading a state dict
    into the model (an in-place copy) updates the fused weights too, with no extra memory.
    """
    weight = torch.cat([linear.weight.data for linear in linears])
    biases = [linear.bias for linear in linears]
    bias = torch.cat([b.data for b in biases]) if all(b is not None for b in biases) else None
    if bias is None and any(b is not None for b in biases):
        raise ValueError("some of the fused projections have a bias and some do not")
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = weight[start : start + rows]
        if bias is not None:
            linear.bias.data = bias[start : start + rows]
        start += rows
    return weight, bias


class LayerWeights(NamedTuple):
    """One decoder layer's tensors: the HF modules' parameters, or fused tensors they are views of."""

    input_norm: Tensor
    qkv: Tensor
    qkv_bias: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    post_norm: Tensor
    gate_up: Tensor
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None


class Frame(NamedTuple):
    """Every tensor a step reads besides its own inputs.

    The steps take it as an argument rather than reading the decoder's attributes, so that a
    compiled step sees weights and caches as inputs, never as constants baked into it: an
    in-place weight update, or a cache grown to a new length, is what the next call reads.
    """

    embed: Tensor
    layers: tuple[LayerWeights, ...]
    final_norm: Tensor
    lm_head: Tensor
    lm_head_bias: Tensor | None
    cos: Tensor
    sin: Tensor
    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]


@dataclass(frozen=True, slots=True)
class LayerConstants:
    """One layer's numbers that are not tensors (read once from its modules)."""

    input_eps: float
    post_eps: float
    qk_eps: float | None
    """The per-head query/key norm's epsilon (qwen3), or None when the layer has none."""
    scaling: float
    act: Any
    """The MLP's activation (transformers' ACT2FN module)."""

    @classmethod
    def of(cls, layer: torch.nn.Module) -> LayerConstants:
        attention = layer.self_attn
        q_norm = getattr(attention, "q_norm", None)
        return cls(
            input_eps=float(layer.input_layernorm.variance_epsilon),
            post_eps=float(layer.post_attention_layernorm.variance_epsilon),
            qk_eps=None if q_norm is None else float(q_norm.variance_epsilon),
            scaling=float(attention.scaling),
            act=layer.mlp.act_fn,
        )


def _layer_weights(
    layer: torch.nn.Module, qkv: tuple[Tensor, Tensor | None], gate_up: tuple[Tensor, Tensor | None]
) -> LayerWeights:
    attention, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        qkv=qkv[0],
        qkv_bias=qkv[1],
        q_norm=None if q_norm is None else q_norm.weight,
        k_norm=None if k_norm is None else k_norm.weight,
        o=attention.o_proj.weight,
        o_bias=attention.o_proj.bias,
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=gate_up[0],
        gate_up_bias=gate_up[1],
        down=mlp.down_proj.weight,
        down_bias=mlp.down_proj.bias,
    )


def _static_shape(*tensors: Tensor | None, dims: tuple[int, ...] | None = None) -> None:
    """Tell torch.compile that these dims of ``tensors`` never change (all dims by default).

    The steps compile with dynamic shapes, so that batch sizes and lengths share one graph. Left
    at that, weight and head sizes would be symbolic too, and inductor's loops over them would
    use masked loads; fixed, they vectorize (a demo decode run on a CPU: ~75 ms against ~117).
    """
    for tensor in tensors:
        if tensor is None:
            continue
        for dim in range(tensor.dim()) if dims is None else dims:
            torch._dynamo.mark_static(tensor, dim)


class SlotDecoder:
    """Prefill and decode for up to ``slots`` samples of one model (one worker thread)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        slots: int,
        max_positions: int,
        compile_step: bool = False,
        max_tokens: int | None = None,
    ) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the slot decoder cannot run this model: {reason}")
        self.model = model
        body = model.model
        layers = list(body.layers)
        first = layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.heads = first.q_proj.out_features // self.head_dim
        self.kv_heads = first.k_proj.out_features // self.head_dim
        self.constants = [LayerConstants.of(layer) for layer in layers]
        self.final_eps = float(body.norm.variance_epsilon)
        qkv = [_fuse([a.q_proj, a.k_proj, a.v_proj]) for a in (layer.self_attn for layer in layers)]
        gate_up = [_fuse([layer.mlp.gate_proj, layer.mlp.up_proj]) for layer in layers]
        for weight, bias in (*qkv, *gate_up):
            _static_shape(weight, bias)
        self.slots = slots
        """Most samples it holds (the compiled steps take any batch up to it)."""
        self.max_positions = max_positions or 1 << 20
        self.max_tokens = max_tokens or slots * self.max_positions
        """Most positions the cache holds in all (slots allocated × length): its growth stops there."""
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.length = 0
        """Positions each allocated slot holds."""
        self.allocated = 0
        """Slots the cache holds now (it grows to what the samples need)."""
        self.frame = Frame(
            embed=body.embed_tokens.weight,
            layers=tuple(_layer_weights(*parts) for parts in zip(layers, qkv, gate_up, strict=True)),
            final_norm=body.norm.weight,
            lm_head=model.lm_head.weight,
            lm_head_bias=model.lm_head.bias,
            cos=torch.empty(0),
            sin=torch.empty(0),
            keys=(),
            values=(),
        )
        """The weights stay for the decoder's life; ``reserve`` puts in new tables and caches."""
        self.position_ids = torch.empty(0, dtype=torch.long)
        """0..length-1 (a step's span is a prefix of it)."""
        self._compile = compile_step
        """Compile the steps: one graph each for every batch size and length (dynamic shapes)."""
        self._compiled: dict[str, Any] = {}

    @property
    def keys(self) -> tuple[Tensor, ...]:
        return self.frame.keys

    @property
    def values(self) -> tuple[Tensor, ...]:
        return self.frame.values

    # -- cache -----------------------------------------------------------------

    def reserve(self, length: int, rows: int | None = None) -> None:
        """Make the first ``rows`` slots (all by default) hold at least ``length`` positions each.

        The cache grows by doubling in either dimension, no further than ``max_tokens`` allows
        (then just to what is asked); it may get shorter when it gets more slots, never shorter
        than ``length``, so ``length`` must cover every live sample. What it holds is kept.
        """
        rows = self.slots if rows is None else rows
        if length <= self.length and rows <= self.allocated:
            return
        if length > self.max_positions:
            raise ValueError(f"{length} positions exceed the model's {self.max_positions}")
        if rows > self.slots:
            raise ValueError(f"{rows} samples exceed the decoder's {self.slots} slots")
        new_length = self.length
        if length > self.length:
            new_length = min(max(length, 2 * self.length, _FIRST_LENGTH), self.max_positions)
        new_slots = self.allocated
        if rows > self.allocated:
            new_slots = min(max(rows, 2 * self.allocated, _FIRST_SLOTS), self.slots)
        if new_slots * new_length > self.max_tokens:  # doubling overshoots the budget: grow less
            new_length = max(length, min(new_length, self.max_tokens // new_slots))
            new_slots = max(rows, min(new_slots, self.max_tokens // new_length))
        self._allocate(new_slots, new_length)

    def _allocate(self, slots: int, length: int) -> None:
        """A new cache of ``slots`` x ``length`` positions holding what the old one held there."""
        shape = (slots, self.kv_heads, length, self.head_dim)
        layers = range(len(self.constants))
        keys = tuple(torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in layers)
        values = tuple(torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in layers)
        kept_slots, kept_length = min(slots, self.allocated), min(length, self.length)
        if kept_slots and kept_length:
            for old, new in zip(self.keys + self.values, keys + values, strict=True):
                new[:kept_slots, :, :kept_length].copy_(old[:kept_slots, :, :kept_length])
        cos, sin = self._rotary_tables(length)
        _static_shape(*keys, *values, dims=(1, 3))  # the slots (dim 0) and the length (dim 2) grow
        _static_shape(cos, sin, dims=(1,))
        self.frame = self.frame._replace(cos=cos, sin=sin, keys=keys, values=values)
        self.position_ids = torch.arange(length, device=self.device)
        self.length, self.allocated = length, slots

    def _rotary_tables(self, length: int) -> tuple[Tensor, Tensor]:
        positions = torch.arange(length, device=self.device).unsqueeze(0)
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = self.model.model.rotary_emb(probe, positions)
        return cos[0].clone(), sin[0].clone()  # [length, head_dim]

    def move(self, sources: list[int], targets: list[int], length: int) -> None:
        """Copy the first ``length`` positions of each slot in ``sources`` into the matching target."""
        source = torch.tensor(sources, device=self.device)
        target = torch.tensor(targets, device=self.device)
        for cache in (*self.keys, *self.values):
            cache[target, :, :length] = cache[source, :, :length]

    # -- forward -------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: list[list[int]]) -> torch.Tensor:
        """Run ``prompts`` (right-padded together); their keys and values go to every slot in
        ``slots[i]``. Returns float32 logits [len(prompts), vocab] of each prompt's last token."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        targets = torch.tensor([s for group in slots for s in group], device=self.device)
        sources = torch.tensor([i for i, group in enumerate(slots) for _ in group], device=self.device)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        return self._run(self._prefill_step, ids.to(self.device), targets, sources, last)

    def _prefill_step(
        self, frame: Frame, ids: Tensor, targets: Tensor, sources: Tensor, last: Tensor
    ) -> Tensor:
        rows, width = ids.shape
        cos, sin = frame.cos[:width], frame.sin[:width]
        future = torch.ones((width, width), dtype=torch.bool, device=self.device).triu(1)  # causal mask

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            frame.keys[layer][targets, :, :width] = k[sources]
            frame.values[layer][targets, :, :width] = v[sources]
            scale = self.constants[layer].scaling
            if self.device.type != "cpu" or width > _SHORT_PROMPT:
                gqa = self.heads != self.kv_heads
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            # short prompts on a CPU: batched matmuls beat SDPA's kernel, as in decode
            group = self.heads // self.kv_heads
            q = q.reshape(rows, self.kv_heads, group, width, self.head_dim)
            scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)).mul_(scale)
            scores.masked_fill_(future, -torch.inf)
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(weights, v.unsqueeze(2)).reshape(rows, self.heads, width, self.head_dim)

        hidden = self._layers(frame, F.embedding(ids, frame.embed), cos, sin, attend)
        hidden = hidden[torch.arange(rows, device=self.device), last]
        return self._logits(frame, hidden)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, span: int | None = None) -> torch.Tensor:
        """One step for slots 0..B-1: ``tokens[b]`` goes in at ``positions[b]`` of slot b; ``span``
        is max(positions) + 1 when the caller knows it. Returns float32 logits [B, vocab]."""
        span = int(positions.max()) + 1 if span is None else span
        return self._run(self._decode_step, tokens, positions, self.position_ids[:span])

    @torch.inference_mode()
    def decode_and_sample(
        self, tokens: Tensor, positions: Tensor, span: int, draw: tuple[Tensor, Tensor, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """``decode`` followed by ``sample_unfiltered(logits, *draw)`` in one step (one compiled
        graph when compile_step): the next tokens and their raw logprobs."""
        return self._run(self._decode_sample_step, tokens, positions, self.position_ids[:span], *draw)

    def _decode_sample_step(
        self,
        frame: Frame,
        tokens: Tensor,
        positions: Tensor,
        span_ids: Tensor,
        temperature: Tensor,
        uniform: Tensor,
        greedy: Tensor,
    ) -> tuple[Tensor, Tensor]:
        logits = self._decode_step(frame, tokens, positions, span_ids)
        return sample_unfiltered(logits, temperature, uniform, greedy)

    def _run(self, step: Any, *args: Any) -> Any:
        """``step(self.frame, *args)``, compiled when compile_step (falling back to eager if
        compiling fails)."""
        if self._compile:
            compiled = self._compiled.get(step.__name__)
            first = compiled is None
            try:
                if compiled is None:
                    compiled = self._compiled[step.__name__] = self._compile_step(step, args)
                result = compiled(self.frame, *args)
            except Exception as err:  # e.g. no C++ compiler for inductor: the eager step is the same
                log.warning("compiling %s failed, running it eagerly: %s", step.__name__, err)
                self._compile = False
            else:
                if first:  # the graphs just built live as long as this decoder
                    freeze_long_lived_objects()
                return result
        return step(self.frame, *args)

    def _compile_step(self, step: Any, args: tuple[Any, ...]) -> Any:
        """AOTInductor for the decode-and-sample step on a CPU (it runs once per token, and
        torch.compile's dynamo wrapper costs ~30% of it there); torch.compile otherwise."""
        if step == self._decode_sample_step and self.device.type == "cpu":
            return AotStep(step, (self.frame, *args), self._decode_dims(), name=step.__name__)
        # On a CPU the C++ wrapper calls the kernels without Python between them: ~12% of a
        # small model's decode step.
        options = {"cpp_wrapper": self.device.type == "cpu"}
        return torch.compile(step, dynamic=True, options=options)

    def _decode_dims(self) -> tuple[Any, ...]:
        """The dynamic dims of ``_decode_sample_step``'s arguments, for torch.export."""
        Dim = torch.export.Dim
        batch = Dim("batch", min=1, max=self.slots) if self.slots > 1 else None  # a Dim needs min < max
        slots = Dim("slots", min=1, max=self.slots) if self.slots > 1 else None
        span = Dim("span", min=1, max=self.max_positions)
        length = Dim("length", min=1, max=self.max_positions)
        cache = tuple({2: length} | ({0: slots} if slots is not None else {}) for _ in self.constants)
        static = pytree.tree_map(lambda _: {}, self.frame)  # the frame's structure, all dims fixed
        frame = static._replace(cos={0: length}, sin={0: length}, keys=cache, values=cache)
        rows = {0: batch} if batch is not None else {}
        return (frame, rows, rows, {0: span}, rows, rows, rows)

    def _decode_step(self, frame: Frame, tokens: Tensor, positions: Tensor, span_ids: Tensor) -> Tensor:
        batch, span = tokens.shape[0], span_ids.shape[0]
        rows = torch.arange(batch, device=self.device)
        future = span_ids > positions[:, None]
        bias = torch.zeros((batch, span), device=self.device, dtype=self.dtype).masked_fill_(
            future, -torch.inf
        )
        bias = bias[:, None, None, :]
        cos, sin = frame.cos[positions][:, None, None, :], frame.sin[positions][:, None, None, :]

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            keys, values = frame.keys[layer], frame.values[layer]
            keys[rows, :, positions] = k[:, :, 0]
            values[rows, :, positions] = v[:, :, 0]
            keys, values = keys[:batch, :, :span], values[:batch, :, :span]
            scale = self.constants[layer].scaling
            if self.device.type != "cpu":
                gqa = self.heads != self.kv_heads
                return F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=bias, scale=scale, enable_gqa=gqa
                )
            # one query per row: on a CPU, two batched matmuls beat SDPA's kernel
            q = q.reshape(batch, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
            scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale).add_(bias)
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(weights, values).reshape(batch, self.heads, 1, self.head_dim)

        hidden = self._layers(frame, F.embedding(tokens.unsqueeze(1), frame.embed), cos, sin, attend)
        return self._logits(frame, hidden[:, -1])

    def _layers(self, frame: Frame, x: Tensor, cos: Tensor, sin: Tensor, attend: Any) -> Tensor:
        batch, width, _ = x.shape
        rotated = self.heads + self.kv_heads
        for index, (w, c) in enumerate(zip(frame.layers, self.constants, strict=True)):
            h = _rms_norm(x, w.input_norm, c.input_eps)
            qkv = F.linear(h, w.qkv, w.qkv_bias).view(batch, width, -1, self.head_dim)
            if w.q_norm is not None and w.k_norm is not None:  # qwen3 normalises each head first
                assert c.qk_eps is not None
                q = _rms_norm(qkv[:, :, : self.heads], w.q_norm, c.qk_eps)
                k = _rms_norm(qkv[:, :, self.heads : rotated], w.k_norm, c.qk_eps)
                qk = _rotate(torch.cat((q, k), dim=2).transpose(1, 2), cos, sin)
            else:  # queries and keys turn in one go
                qk = _rotate(qkv[:, :, :rotated].transpose(1, 2), cos, sin)
            q, k, v = qk[:, : self.heads], qk[:, self.heads :], qkv[:, :, rotated:].transpose(1, 2)
            out = attend(index, q, k, v).transpose(1, 2).reshape(batch, width, -1)
            x = x + F.linear(out, w.o, w.o_bias)
            h = _rms_norm(x, w.post_norm, c.post_eps)
            gate, up = F.linear(h, w.gate_up, w.gate_up_bias).chunk(2, -1)
            x = x + F.linear(c.act(gate) * up, w.down, w.down_bias)
        return x

    def _logits(self, frame: Frame, hidden: Tensor) -> Tensor:
        return F.linear(
            _rms_norm(hidden, frame.final_norm, self.final_eps), frame.lm_head, frame.lm_head_bias
        ).float()
