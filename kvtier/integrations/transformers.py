"""Prefix reuse for Hugging Face transformers causal LMs, through ``past_key_values``.

    prompt ──lookup/retrieve──▶ cached prefix KV ──▶ DynamicCache ──▶ model runs on the rest only
                                                                           │
                                       new chunks ◀──fill from the cache tensors──┘

``PrefixCachedModel`` wraps a model and a key store (a ``TieredStore``, or a ``KvtierClient`` of
``kvtier server``), through the one ``TokenCache``. ``prefill`` loads the longest cached
prefix of the prompt (at most ``len(prompt) - 1`` tokens, so that the last token is always
computed and its logits exist), runs the model on the remaining tokens with the right positions,
and stores the prompt's chunks that were not cached yet. ``generate`` is greedy decoding on top.

The payload arrangement is ``hf-layer-kv-hnd``: for each layer, K as [kv_heads, tokens, head_dim]
then V in the same shape, contiguous, in the model's dtype. Keys are cached after RoPE, as
transformers caches them, so a chunk is only valid at the positions it was computed at; that is
what prefix keys guarantee.

Limits: batch size 1; models whose layers all use full attention (no sliding-window or linear
attention layers), whose cache is transformers' ``DynamicCache``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from kvtier.cache import TokenCache
from kvtier.errors import ConfigError
from kvtier.keys import ChunkSpan, Namespace
from kvtier.keystore import KeyStore
from kvtier.layout import DTYPE_SIZES, KVLayout

ARRANGEMENT = "hf-layer-kv-hnd"

__all__ = [
    "GenerationResult",
    "PrefillResult",
    "PrefixCachedModel",
    "layer_kv",
    "layout_for_model",
    "namespace_for_model",
    "new_cache",
    "token_list",
]


def _text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ConfigError(f"KV dtype {name!r} is not supported")
    return name


def layout_for_model(model: Any) -> KVLayout:
    """The KVLayout of a transformers model's KV cache (from its config and its dtype), or
    ConfigError for a model whose cache is not plain full attention."""
    _check_supported(model)
    config = _text_config(model.config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_size=head_dim,
        dtype=_dtype_name(model.dtype),
        block_size=1,
        arrangement=ARRANGEMENT,
    )


def namespace_for_model(model: Any, model_name: str | None = None, revision: str | None = None,
                        tenant_salt: bytes = b"") -> Namespace:
    """A namespace bound to the model's identity and KV layout. ``model_name`` defaults to the
    path or hub id the model was loaded from; ``revision`` to its commit hash where known."""
    config = model.config
    name = model_name or getattr(config, "_name_or_path", "") or getattr(config, "model_type", "")
    if not name:
        raise ConfigError("cannot derive a model name from the model: pass model_name")
    if revision is None:
        revision = getattr(config, "_commit_hash", None) or ""
    return Namespace(model=str(name), layout=layout_for_model(model), revision=revision,
                     tenant_salt=tenant_salt)


def _check_supported(model: Any) -> None:
    """The transformers integration and CacheBlend cache plain full-attention KV: sliding
    windows, local chunks, recurrent state and MLA latents are refused here, at start (kvtier's
    vLLM connector caches those)."""
    config = _text_config(model.config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(kind != "full_attention" for kind in layer_types):
        raise ConfigError(f"only full-attention models are supported, got layer types {sorted(set(layer_types))}")
    for name in ("sliding_window", "attention_chunk_size", "kv_lora_rank"):
        if getattr(config, name, None) and not (name == "sliding_window" and getattr(config, "use_sliding_window", True) is False):
            raise ConfigError(f"only full-attention models are supported; this one sets {name}={getattr(config, name)}")
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError("encoder-decoder models are not supported")


def token_list(input_ids: Any) -> list[int]:
    """A prompt (a list, or a tensor of batch size 1) as a list of token ids."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"batch size must be 1, got input_ids of shape {tuple(input_ids.shape)}")
            input_ids = input_ids[0]
        return [int(t) for t in input_ids.tolist()]
    array = np.asarray(input_ids)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1:
        raise ValueError(f"input_ids must be one sequence, got shape {array.shape}")
    return [int(t) for t in array.tolist()]


def layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one layer, [batch, kv_heads, tokens, head_dim], across cache APIs."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # older DynamicCache


def new_cache(model: Any) -> Any:
    """An empty transformers KV cache for ``model``."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [1, n, vocab]: the last computed token's (n=1), or all computed ones
    past_key_values: Any  # a DynamicCache holding the KV of the whole prompt
    reused_tokens: int  # loaded from kvtier
    computed_tokens: int  # run through the model
    stored_chunks: int = 0  # new chunks written to kvtier
    timings: dict[str, float] = field(default_factory=dict)  # seconds: retrieve, forward, store

    @property
    def next_token_logits(self) -> torch.Tensor:
        """Logits that predict the token after the prompt, [vocab]."""
        return self.logits[0, -1]


@dataclass
class GenerationResult:
    tokens: list[int]  # the generated tokens (not the prompt)
    reused_tokens: int
    computed_tokens: int
    ttft_s: float  # from the call to the first token chosen (prefill included)
    total_s: float
    prefill: PrefillResult = field(repr=False)


class PrefixCachedModel:
    """A transformers causal LM whose prompts reuse KV cached in a key store.

    Batch size 1. ``namespace`` defaults to one derived from the model (name, revision, layout);
    two models share cached KV only if their namespaces are equal.
    """

    def __init__(
        self,
        model: Any,
        store: KeyStore,
        model_name: str | None = None,
        revision: str | None = None,
        namespace: Namespace | None = None,
    ) -> None:
        self.model = model
        self.cache = TokenCache(store)
        self.layout = layout_for_model(model)
        self.namespace = namespace or namespace_for_model(model, model_name, revision)
        if self.namespace.layout != self.layout:
            raise ConfigError(f"namespace layout {self.namespace.layout} does not match the model's {self.layout}")
        self._dtype = model.dtype
        self._itemsize = DTYPE_SIZES[self.layout.dtype]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- prefill -----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: Any,
        *,
        reuse: bool = True,
        store: bool = True,
        all_logits: bool = False,
    ) -> PrefillResult:
        """Prefill a prompt, loading its longest cached prefix and storing its new chunks.

        ``reuse=False`` recomputes everything (a cold run); ``store=False`` leaves the store as
        it is. ``all_logits`` returns the logits of every computed token instead of the last.
        """
        tokens = token_list(input_ids)
        if not tokens:
            raise ValueError("input_ids is empty")
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        cache = new_cache(self.model)
        reused = self._load_prefix(tokens, cache) if reuse else 0
        timings["retrieve"] = time.perf_counter() - t0

        t1 = time.perf_counter()
        device = self.device
        new_ids = torch.tensor([tokens[reused:]], dtype=torch.long, device=device)
        positions = torch.arange(reused, len(tokens), dtype=torch.long, device=device).unsqueeze(0)
        out = self.model(
            input_ids=new_ids,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
        cache = out.past_key_values
        timings["forward"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        stored = self._store(tokens, cache, start=reused) if store else 0
        timings["store"] = time.perf_counter() - t2
        return PrefillResult(out.logits, cache, reused, len(tokens) - reused, stored, timings)

    def _load_prefix(self, tokens: list[int], cache: Any) -> int:
        """Fill ``cache`` with the KV of the longest cached prefix (at most len - 1 tokens)."""
        layout = self.layout
        L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_size
        row = D * self._itemsize  # bytes of one head's vector
        with self.cache.retrieve(self.namespace, tokens) as retrieval:
            reused = min(retrieval.num_tokens, len(tokens) - 1)
            if reused <= 0:
                return 0
            # One uint8 staging tensor in the final [layer, k/v, head, token, dim] order: each
            # chunk is copied once, straight from its (read-only) view; dtype-agnostic.
            staging = torch.empty((L, 2, H, reused, row), dtype=torch.uint8)
            dest = staging.numpy()
            for chunk in retrieval.chunks:
                span = chunk.span
                take = min(span.end, reused) - span.start
                if take <= 0:
                    break
                src = np.frombuffer(chunk.payload, dtype=np.uint8).reshape(L, 2, H, span.num_tokens, row)
                dest[:, :, :, span.start : span.start + take] = src[:, :, :, :take]
        kv = staging.view(self._dtype).to(self.device)  # [L, 2, H, reused, D]
        for layer in range(L):
            cache.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)
        return reused

    def _store(self, tokens: Sequence[int], cache: Any, start: int) -> int:
        """Store the chunks of ``tokens`` not cached yet, copying from ``cache`` (which must hold
        the KV of at least ``len(tokens)`` tokens)."""
        layout = self.layout
        L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_size
        layers = [layer_kv(cache, layer) for layer in range(L)]
        if layers[0][0].shape[-2] < len(tokens):
            raise ValueError(f"cache holds {layers[0][0].shape[-2]} tokens, fewer than the {len(tokens)} to store")

        def fill(span: ChunkSpan, dest: memoryview) -> None:
            out = torch.frombuffer(dest, dtype=torch.uint8).view(self._dtype)
            out = out.view(L, 2, H, span.num_tokens, D)
            for layer, (keys, values) in enumerate(layers):
                out[layer, 0].copy_(keys[0, :, span.start : span.end])
                out[layer, 1].copy_(values[0, :, span.start : span.end])

        return self.cache.store(self.namespace, tokens, fill, start=start)

    # -- generation --------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self,
        input_ids: Any,
        max_new_tokens: int = 32,
        *,
        reuse: bool = True,
        store: bool = True,
        stop_at_eos: bool = True,
        store_generated: bool = False,
    ) -> GenerationResult:
        """Greedy decoding after a cached prefill. ``store_generated`` also stores the KV of the
        generated tokens (prompt + output), so that a follow-up turn reuses them."""
        start = time.perf_counter()
        tokens = token_list(input_ids)
        prefill = self.prefill(tokens, reuse=reuse, store=store)
        next_token = int(prefill.next_token_logits.argmax())
        ttft = time.perf_counter() - start
        eos = self._eos_ids() if stop_at_eos else set()
        cache = prefill.past_key_values
        generated = [next_token]
        device = self.device
        while len(generated) < max_new_tokens and next_token not in eos:
            position = len(tokens) + len(generated) - 1
            out = self.model(
                input_ids=torch.tensor([[next_token]], dtype=torch.long, device=device),
                position_ids=torch.tensor([[position]], dtype=torch.long, device=device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.past_key_values
            next_token = int(out.logits[0, -1].argmax())
            generated.append(next_token)
        if store and store_generated and len(generated) > 1:
            # the cache holds every token but the last generated one
            self._store(tokens + generated[:-1], cache, start=len(tokens))
        return GenerationResult(
            tokens=generated,
            reused_tokens=prefill.reused_tokens,
            computed_tokens=prefill.computed_tokens,
            ttft_s=ttft,
            total_s=time.perf_counter() - start,
            prefill=prefill,
        )

    def _eos_ids(self) -> set[int]:
        eos = None
        generation_config = getattr(self.model, "generation_config", None)
        if generation_config is not None:
            eos = generation_config.eos_token_id
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None:
            return set()
        return {int(e) for e in eos} if isinstance(eos, (list, tuple)) else {int(eos)}
