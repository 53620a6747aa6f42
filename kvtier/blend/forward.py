"""The blended forward pass: a Llama forward loop that recomputes only some tokens' KV.

    embed ─▶ layers < check: every token, fresh KV ─▶ check layer: fresh K/V of every token,
    compared with the cached K/V; the candidates (the ``candidate_factor`` × ``recompute_ratio``
    share of cached tokens that deviate most, plus every uncached token) keep running ─▶ the next
    ``filter_layers`` layers: the running tokens' deviation is measured again and the set narrowed,
    down to ``recompute_ratio`` ─▶ later layers: only the kept tokens run ─▶ norm ─▶ lm_head on
    the last token. Tokens that run write their fresh K/V over the cached entries; the rest keep
    their cached K/V.

Gradual filtering (CacheBlend §4.3): one early layer's deviation only roughly predicts which
tokens deviate deeper down (at the check layer, keys mostly reflect how layer 0 attended, e.g. to
each segment's first token, its attention sink when made alone), so the check layer keeps a wider
set and later layers, whose deviations are sharper, pick the final tokens among it. A candidate's
fresh K/V at the next layer is exact (every earlier layer's KV is fresh), so narrowing there picks
what a check at that layer would pick among the candidates, for a fraction of its cost.

The loop uses the model's own modules (norms, projections, MLP, rotary embedding), so it computes
what transformers computes; with every token kept (``recompute_ratio=1``, or nothing cached) it
matches the model's own forward to float rounding (tests hold it to 1e-5). Attention is
``scaled_dot_product_attention``: causal over all tokens while all run; once only some tokens
run, in blocks of queries that each see the keys up to their last position, with a position mask
(key position <= query position).

``recompute_ratio=0`` is naive reuse: cached tokens never run, at any layer (no check).
Batch size 1; Llama-family decoder layers (pre-norm, q/k/v/o projections, rotate-half RoPE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvtier.errors import ConfigError

#: Model types whose decoder layers this loop reproduces (tested against the model's forward).
SUPPORTED_MODEL_TYPES = ("llama",)


def check_supported(model: Any) -> None:
    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        model_type = getattr(config, "model_type", None)
        raise ConfigError(f"CacheBlend supports model types {list(SUPPORTED_MODEL_TYPES)}, got {model_type!r}")
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(kind != "full_attention" for kind in layer_types):
        raise ConfigError(f"CacheBlend needs full attention in every layer, got {sorted(set(layer_types))}")
    if getattr(config, "pretraining_tp", 1) not in (1, None):
        raise ConfigError("CacheBlend does not support pretraining_tp > 1")


@dataclass
class BlendPass:
    logits: torch.Tensor  # [vocab]: the next-token logits after the last token
    kv: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim]: the KV the pass ended with
    selected: torch.Tensor  # positions that ran through every layer (sorted)
    deviation: torch.Tensor | None  # per token at the check layer (0 for uncached tokens); None if no check


class BlendForward:
    """Runs a Llama model's layers by hand over one prompt (batch 1)."""

    def __init__(self, model: Any) -> None:
        check_supported(model)
        self.model = model
        self.decoder = model.model
        config = model.config
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                blocks: list[_QueryBlock] | None) -> torch.Tensor:
        gqa = self.num_heads != self.num_kv_heads
        if blocks is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        return torch.cat([
            F.scaled_dot_product_attention(q[:, :, b.start : b.end], k[:, :, : b.keys], v[:, :, : b.keys],
                                           attn_mask=b.mask, scale=scaling, enable_gqa=gqa)
            for b in blocks
        ], dim=2)

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        kv: torch.Tensor | None = None,
        reused: torch.Tensor | None = None,
        *,
        check_layer: int = 1,
        recompute_ratio: float = 1.0,
        candidate_factor: float = 1.0,
        filter_layers: int = 1,
    ) -> BlendPass:
        """One prefill. ``input_ids`` [tokens]; ``kv`` [layers, 2, kv_heads, tokens, head_dim]
        holds the cached KV (keys already at their positions) where ``reused`` [tokens] is True,
        anything elsewhere; it is updated in place and returned. Without ``kv`` every token runs.
        ``candidate_factor`` 1 selects once, at the check layer (no gradual filtering)."""
        device = input_ids.device
        n = input_ids.shape[0]
        L, H, D = self.num_layers, self.num_kv_heads, self.head_dim
        if not 0 <= check_layer < L:
            raise ConfigError(f"check_layer must be in [0, {L}), got {check_layer}")
        if not 0.0 <= recompute_ratio <= 1.0:
            raise ConfigError(f"recompute_ratio must be in [0, 1], got {recompute_ratio}")
        if not candidate_factor >= 1.0 or filter_layers < 1:
            raise ConfigError(f"candidate_factor must be >= 1 and filter_layers >= 1, "
                              f"got {candidate_factor} and {filter_layers}")
        dtype = self.decoder.embed_tokens.weight.dtype
        if kv is None or reused is None or not bool(reused.any()):
            reused = torch.zeros(n, dtype=torch.bool, device=device)
            kv = torch.empty((L, 2, H, n, D), dtype=dtype, device=device)
        reused = reused.clone()
        reused[-1] = False  # the last token's logits are needed: it always runs
        positions = torch.arange(n, device=device)
        hidden = self.decoder.embed_tokens(input_ids[None])  # [1, n, hidden]
        cos, sin = self.decoder.rotary_emb(hidden, positions[None])

        selected = positions  # the tokens that run
        blocks = None  # None: every token runs (causal); else the query blocks of the selected ones
        deviation = None
        blend = bool(reused.any())
        shares = {}  # layer -> share of cached tokens that keep running after it
        if blend and 0.0 < recompute_ratio < 1.0:
            shares = filter_schedule(check_layer, L, recompute_ratio, candidate_factor, filter_layers)
        if blend and recompute_ratio == 0.0:  # naive reuse: cached tokens never run
            selected, blocks = self._keep(positions, reused, None, dtype=hidden.dtype)
            hidden, cos, sin = hidden[:, selected], cos[:, selected], sin[:, selected]

        for index, layer in enumerate(self.decoder.layers[:L]):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            shape = (1, x.shape[1], -1, D)
            q = attn.q_proj(x).view(shape).transpose(1, 2)
            k = attn.k_proj(x).view(shape).transpose(1, 2)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
            k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
            narrowed = None
            if index in shares:  # the running tokens' deviation here; keep the share that deviates most
                measured = torch.full((n,), -math.inf, device=device)  # tokens not running: never kept
                measured[selected] = _deviation(k[0], kv[index, 0, :, selected], reused[selected])
                if index == check_layer:
                    deviation = measured
                narrowed, new_blocks = self._keep(positions, reused, measured, shares[index], hidden.dtype)
            if blocks is None:  # every token ran: all of this layer's KV is fresh
                kv[index, 0] = k[0]
                kv[index, 1] = v[0]
                keys, values = k, v
            else:
                kv[index, 0, :, selected] = k[0]
                kv[index, 1, :, selected] = v[0]
                keys, values = kv[index, 0][None], kv[index, 1][None]
            if narrowed is not None:  # from here on only the narrowed tokens run (a subset)
                rows = torch.isin(selected, narrowed)
                q, hidden, cos, sin = q[:, :, rows], hidden[:, rows], cos[:, rows], sin[:, rows]
                selected, blocks = narrowed, new_blocks
            out = self._attend(q, keys, values, attn.scaling, blocks)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, hidden.shape[1], -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))

        last = self.decoder.norm(hidden[:, -1:])
        logits = self.model.lm_head(last)[0, -1]
        return BlendPass(logits, kv, selected, deviation)

    @staticmethod
    def _keep(positions: torch.Tensor, reused: torch.Tensor, deviation: torch.Tensor | None,
              ratio: float = 0.0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list[_QueryBlock]]:
        """The tokens that keep running (every uncached token, plus the ``ratio`` share of
        cached tokens that deviate most), sorted, and their query blocks."""
        keep = ~reused
        cached = positions[reused]
        count = math.ceil(ratio * cached.numel()) if deviation is not None else 0
        if count:
            top = torch.topk(deviation[cached], count).indices
            keep = keep.clone()
            keep[cached[top]] = True
        selected = positions[keep]
        return selected, _query_blocks(positions, selected, dtype)


def filter_schedule(check_layer: int, num_layers: int, ratio: float, factor: float = 1.0,
                    filter_layers: int = 1) -> dict[int, float]:
    """Layer -> share of cached tokens that keep running after it: ``factor × ratio`` (at most 1)
    at the check layer, shrinking geometrically over the next ``filter_layers`` layers (fewer if
    the model ends first) to exactly ``ratio``. Factor 1: ``ratio`` at the check layer only."""
    steps = min(filter_layers, num_layers - 1 - check_layer) if factor > 1.0 else 0
    if not steps:
        return {check_layer: ratio}
    return {check_layer + j: min(1.0, ratio * factor ** ((steps - j) / steps)) for j in range(steps + 1)}


@dataclass
class _QueryBlock:
    """Selected queries [start, end) attend to keys [0, keys) under ``mask`` (additive)."""

    start: int
    end: int
    keys: int
    mask: torch.Tensor


def _query_blocks(positions: torch.Tensor, selected: torch.Tensor, dtype: torch.dtype,
                  min_block: int = 128, max_blocks: int = 16) -> list[_QueryBlock]:
    """Split the selected (sorted) queries into blocks that each attend only to the keys up to
    their last position: a causal attention of scattered queries costs about half of a
    rectangular one, as in a full causal prefill. The additive masks are made once per pass."""
    count = selected.numel()
    num_blocks = max(1, min(max_blocks, count // min_block))
    bounds = [count * i // num_blocks for i in range(num_blocks + 1)]
    blocks = []
    for start, end in zip(bounds, bounds[1:]):
        keys = int(selected[end - 1]) + 1
        allowed = positions[None, :keys] <= selected[start:end, None]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=selected.device)
        mask.masked_fill_(~allowed, float("-inf"))
        blocks.append(_QueryBlock(start, end, keys, mask[None, None]))
    return blocks


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _deviation(k: torch.Tensor, cached: torch.Tensor, reused: torch.Tensor) -> torch.Tensor:
    """Per token: squared L2 distance between its fresh and cached keys over all KV heads (0
    where nothing is cached). Keys only, as LMCache's CacheBlend does; on the task model, adding
    the values' distance picked worse tokens (docs/blend.md). ``k`` [kv_heads, n, head_dim]."""
    d = (k.float() - cached.float()).pow(2).sum(dim=(0, 2))
    return torch.where(reused, d, torch.zeros_like(d))
