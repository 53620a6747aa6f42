"""Moving cached keys to new positions: RoPE re-rotation behind one small interface.

Cached keys are stored after RoPE, at their segment's canonical positions (0, 1, ...). RoPE
rotates each pair of key dimensions by an angle ``position * inv_freq[i]``; rotations of a plane
compose by adding angles, so a key made at position ``p`` becomes the key made at ``p + delta`` by
one more rotation. That holds only where the angle is linear in the position with fixed
frequencies and no extra scaling of the cos/sin tables:

- supported: ``default``, ``linear`` (frequencies divided by a factor) and ``llama3`` (frequencies
  reshaped once at load time), all in the "rotate half" pairing that Llama-family models use;
- refused with a ``ConfigError``: ``dynamic`` and ``longrope`` (the frequencies depend on the
  sequence length, so a key's rotation depends on the prompt it was made in) and ``yarn``-style
  types that scale cos/sin (``attention_scaling != 1``), until someone needs and tests them.

Another RoPE family (interleaved pairs as in GPT-J, partial rotary dims) is another ``Rotary``
implementation; ``rotary_for_model`` is the one place that chooses.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvtier.errors import ConfigError

#: RoPE types whose angle is ``position * inv_freq`` with frequencies fixed at load time.
POSITION_LINEAR_TYPES = ("default", "linear", "llama3")


class Rotary(Protocol):
    def move(self, keys: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``keys`` [..., tokens, head_dim] made at positions ``source`` [tokens], as made at
        positions ``target`` [tokens]."""


class RotateHalfRope:
    """Llama's RoPE: dimension i pairs with i + head_dim/2 (``rotate_half``).

    A move undoes the rotation of the source position and applies that of the target, with
    cos/sin tables computed as transformers computes them (float32 angles). That is the rotation
    by ``target - source``, but it rounds as the model does: a key moved to position p equals
    the key the model makes at p to float rounding, even where the model's own float32 angle at
    p is off by an ulp (a table of cos/sin(target - source) would differ from the model's key by
    about 1e-4 at p = 1000).
    """

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq.detach().to(torch.float32)

    def cos_sin(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin tables [..., head_dim] for ``positions``, as the model makes them."""
        freqs = positions.to(device, torch.float32)[..., None] * self.inv_freq.to(device)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()

    def move(self, keys: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        cos_s, sin_s = self.cos_sin(torch.as_tensor(source), keys.device)
        cos_t, sin_t = self.cos_sin(torch.as_tensor(target), keys.device)
        # R(target) R(-source) as one table, by angle subtraction on the model's own tables:
        # one pass over the keys instead of two
        cos = (cos_t * cos_s + sin_t * sin_s).to(keys.dtype)
        sin = (sin_t * cos_s - cos_t * sin_s).to(keys.dtype)
        return keys * cos + _rotate_half(keys) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_type(config: Any) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type") or params.get("type") or "default"


def rotary_for_model(model: Any) -> Rotary:
    """The re-rotation of ``model``'s keys; ConfigError where it cannot be exact."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    rope_type = _rope_type(config)
    if rope_type not in POSITION_LINEAR_TYPES:
        raise ConfigError(
            f"CacheBlend cannot re-rotate keys of RoPE type {rope_type!r}: supported are {list(POSITION_LINEAR_TYPES)}"
        )
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("CacheBlend does not support partial rotary embeddings")
    rotary_emb = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary_emb is None or not hasattr(rotary_emb, "inv_freq"):
        raise ConfigError(f"{type(model).__name__} has no rotary embedding with fixed frequencies")
    if getattr(rotary_emb, "attention_scaling", 1.0) != 1.0:
        raise ConfigError(f"CacheBlend does not support RoPE with attention scaling ({rope_type!r})")
    inv_freq = getattr(rotary_emb, "original_inv_freq", None)
    return RotateHalfRope(inv_freq if inv_freq is not None else rotary_emb.inv_freq)
