"""CacheBlend for transformers models: reuse each segment's cached KV wherever it appears.

    segments ──lookup/retrieve (segment namespace)──▶ cached KV at positions 0..n-1
             ──RoPE re-rotation to the prompt's positions──▶ one KV tensor for the prompt
             ──blended forward (check layer, recompute ratio)──▶ logits of the last token
             ──missing segments: KV made in isolation, stored for next time

Segments whose KV is cached are reused wherever they appear in the prompt (after another system
prompt, in another order, next to new documents). Reused KV lacks attention to whatever preceded
the segment in this prompt; the blended forward restores it for the tokens where it matters most:
at the check layer it computes every token's fresh K/V and keeps running the cached tokens whose
keys deviate most (and every uncached token); the next layer measures their deviation again and
narrows them to the ``recompute_ratio`` share (gradual filtering); the others keep their cached KV
in later layers (Yao et al., "CacheBlend", EuroSys 2025).

Uncached segments are computed normally, with full attention to everything before them, and then
also computed alone at positions 0..n-1 and stored (``store=True``), because that is the KV a later
prompt can reuse anywhere. The first segment needs no second pass: at position 0 its KV is the
isolated one. The last segment (the question) is not stored unless ``cache_last``.

The blended KV is not the exact KV of the prompt, so it is never stored under prefix keys.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvtier.blend.forward import BlendForward
from kvtier.blend.rope import rotary_for_model
from kvtier.blend.segments import SegmentStore, stack_cache
from kvtier.errors import ConfigError
from kvtier.integrations.transformers import token_list, new_cache, layout_for_model, namespace_for_model
from kvtier.keys import Namespace
from kvtier.keystore import KeyStore

__all__ = ["BlendConfig", "BlendResult", "BlendedModel"]


@dataclass(frozen=True)
class BlendConfig:
    """``check_layer``: the layer where deviations are first measured (layers before it run every
    token). ``recompute_ratio``: share of cached tokens recomputed through every later layer; 0 is
    naive reuse (cached tokens never run), 1 a full recompute. ``candidate_factor``: gradual
    filtering; the check layer keeps ``candidate_factor × recompute_ratio`` of the cached tokens
    running, and the next ``filter_layers`` layers narrow them to ``recompute_ratio`` by their
    deviation there (1: select once, at the check layer)."""

    check_layer: int = 1
    recompute_ratio: float = 0.15
    candidate_factor: float = 3.0
    filter_layers: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.check_layer, int) or isinstance(self.check_layer, bool) or self.check_layer < 0:
            raise ConfigError(f"check_layer must be a non-negative integer, got {self.check_layer!r}")
        if not _is_real(self.recompute_ratio) or not 0.0 <= self.recompute_ratio <= 1.0:
            raise ConfigError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio!r}")
        if not _is_real(self.candidate_factor) or not 1.0 <= self.candidate_factor < math.inf:
            raise ConfigError(f"candidate_factor must be a finite number >= 1, got {self.candidate_factor!r}")
        if not isinstance(self.filter_layers, int) or isinstance(self.filter_layers, bool) or self.filter_layers < 1:
            raise ConfigError(f"filter_layers must be a positive integer, got {self.filter_layers!r}")


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class BlendResult:
    logits: torch.Tensor  # [vocab]: predicts the token after the prompt
    past_key_values: Any  # a DynamicCache with the blended KV of the whole prompt (for decoding)
    reused_tokens: int  # tokens whose KV came from kvtier
    recomputed_tokens: int  # of those, how many were recomputed from the check layer on
    computed_tokens: int  # tokens not cached: run through every layer
    segment_hits: list[int]  # per segment, leading tokens found cached
    stored_segments: int = 0  # segments whose (missing) chunks were stored
    selected: torch.Tensor | None = field(default=None, repr=False)  # positions that ran every layer
    timings: dict[str, float] = field(default_factory=dict)  # seconds: retrieve, rotate, forward, store

    @property
    def next_token_logits(self) -> torch.Tensor:
        return self.logits


class BlendedModel:
    """A transformers Llama-family causal LM whose prompts, given as segments, reuse each
    segment's KV from a ``TieredStore`` or a ``KvtierClient``. Batch size 1."""

    def __init__(
        self,
        model: Any,
        store: KeyStore,
        model_name: str | None = None,
        revision: str | None = None,
        namespace: Namespace | None = None,
        config: BlendConfig | None = None,
    ) -> None:
        self.model = model
        self.forward = BlendForward(model)
        self.rotary = rotary_for_model(model)
        self.config = config or BlendConfig()
        if self.config.check_layer >= self.forward.num_layers:
            raise ConfigError(f"check_layer {self.config.check_layer} >= the model's {self.forward.num_layers} layers")
        namespace = namespace or namespace_for_model(model, model_name, revision)
        expected = layout_for_model(model)
        if dataclasses.replace(namespace.layout, group=expected.group) != expected:
            raise ConfigError(f"namespace layout {namespace.layout} does not match the model's {expected}")
        self.segments = SegmentStore(store, namespace, model.dtype)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def lookup(self, segments: Sequence[Sequence[int]]) -> list[int]:
        """Per segment, how many of its leading tokens are cached (through the server, if any)."""
        return [result.hit_tokens for result in self.segments.lookup(segments)]

    @torch.inference_mode()
    def prefill(
        self,
        segments: Sequence[Sequence[int]],
        *,
        reuse: bool = True,
        store: bool = True,
        cache_last: bool = False,
        recompute_ratio: float | None = None,
        check_layer: int | None = None,
    ) -> BlendResult:
        """Prefill the concatenation of ``segments``, reusing their cached KV (``reuse``) and
        storing the KV of the missing ones (``store``; the last one only if ``cache_last``).
        ``recompute_ratio`` and ``check_layer`` override the configuration for this call."""
        config = dataclasses.replace(
            self.config,
            check_layer=self.config.check_layer if check_layer is None else check_layer,
            recompute_ratio=self.config.recompute_ratio if recompute_ratio is None else recompute_ratio,
        )
        segments = [token_list(segment) for segment in segments]
        if not segments or not all(segments):
            raise ValueError("segments must be a non-empty list of non-empty token sequences")
        device = self.device
        starts = [0]
        for segment in segments:
            starts.append(starts[-1] + len(segment))
        n = starts[-1]
        L, H, D = self.forward.num_layers, self.forward.num_kv_heads, self.forward.head_dim
        timings: dict[str, float] = {}

        t0 = time.perf_counter()
        on_cpu = device.type == "cpu"
        kv = torch.empty((L, 2, H, n, D), dtype=self.model.dtype, device=device)
        reused = torch.zeros(n, dtype=torch.bool)
        hits = []
        for segment, start in zip(segments, starts):
            m = 0
            if reuse and on_cpu:  # straight into the prompt's KV
                m = self.segments.load_into(segment, kv[:, :, :, start : start + len(segment)])
            elif reuse and (cached := self.segments.load(segment, device)) is not None:
                m = cached.num_tokens
                kv[:, :, :, start : start + m] = cached.kv
            hits.append(m)
            reused[start : start + m] = True
        timings["retrieve"] = time.perf_counter() - t0

        t1 = time.perf_counter()
        for start, m in zip(starts, hits):  # each reused segment: one contiguous range of keys
            if start and m:
                keys = kv[:, 0, :, start : start + m]
                keys.copy_(self.rotary.move(keys, torch.arange(m), torch.arange(start, start + m)))
        timings["rotate"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        ids = torch.tensor([t for segment in segments for t in segment], dtype=torch.long, device=device)
        result = self.forward.run(ids, kv, reused.to(device), check_layer=config.check_layer,
                                  recompute_ratio=config.recompute_ratio, candidate_factor=config.candidate_factor,
                                  filter_layers=config.filter_layers)
        timings["forward"] = time.perf_counter() - t2

        t3 = time.perf_counter()
        stored = 0
        if store:
            for i in range(len(segments) if cache_last else len(segments) - 1):
                if hits[i] < len(segments[i]):
                    stored += self._store_segment(segments[i], starts[i], hits[i], result.kv) > 0
        timings["store"] = time.perf_counter() - t3

        reused_count = int(reused[:-1].sum())  # the last token always runs
        selected_reused = int(reused[result.selected.cpu()].sum())
        return BlendResult(
            logits=result.logits,
            past_key_values=self._dynamic_cache(result.kv),
            reused_tokens=reused_count,
            recomputed_tokens=selected_reused,
            computed_tokens=n - reused_count,
            segment_hits=hits,
            stored_segments=stored,
            selected=result.selected,
            timings=timings,
        )

    def _store_segment(self, segment: list[int], start: int, have: int, kv: torch.Tensor) -> int:
        """Store the KV of a segment that was missing (or partly cached), made in isolation."""
        if start == 0 and have == 0:  # at position 0 the prompt's KV of it is the isolated KV
            return self.segments.save(segment, kv[:, :, :, : len(segment)])
        cache = new_cache(self.model)
        if have:  # the cached part, at its canonical positions, as the prefix of the isolated run
            cached = self.segments.load(segment, self.device)
            if cached is None or cached.num_tokens != have:
                return 0  # evicted meanwhile: next time
            for layer in range(self.forward.num_layers):
                cache.update(cached.kv[layer, 0][None], cached.kv[layer, 1][None], layer)
        device = self.device
        self.model(
            input_ids=torch.tensor([segment[have:]], dtype=torch.long, device=device),
            position_ids=torch.arange(have, len(segment), device=device)[None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return self.segments.save(segment, stack_cache(cache, self.forward.num_layers), start=have)

    def _dynamic_cache(self, kv: torch.Tensor) -> Any:
        cache = new_cache(self.model)
        for layer in range(self.forward.num_layers):
            cache.update(kv[layer, 0][None], kv[layer, 1][None], layer)
        return cache

    @torch.inference_mode()
    def generate(self, segments: Sequence[Sequence[int]], max_new_tokens: int = 32, *, stop_at_eos: bool = True,
                 **prefill_options: Any) -> list[int]:
        """Greedy decoding after a blended prefill (``prefill_options`` go to ``prefill``);
        returns the generated tokens."""
        prefill = self.prefill(segments, **prefill_options)
        n = sum(len(segment) for segment in segments)
        eos = _eos_ids(self.model) if stop_at_eos else set()
        cache = prefill.past_key_values
        token = int(prefill.logits.argmax())
        out = [token]
        device = self.device
        while len(out) < max_new_tokens and token not in eos:
            step = self.model(
                input_ids=torch.tensor([[token]], device=device),
                position_ids=torch.tensor([[n + len(out) - 1]], device=device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = step.past_key_values
            token = int(step.logits[0, -1].argmax())
            out.append(token)
        return out


def _eos_ids(model: Any) -> set[int]:
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, (list, tuple)) else {int(eos)}
