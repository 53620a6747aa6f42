"""vLLM's KV tensors seen as pages, and the copies between pages and chunk payloads (worker side).

vLLM hands the connector one tensor per layer, a view ``[blocks, heads, tokens, content]`` of its
KV allocation. kvtier needs one thing from it: that the page of one block of one layer is a
contiguous run of bytes. That is checked here, on the tensors themselves, rather than assumed;
the interior of a page is never interpreted. When every layer lives in one allocation at a
constant distance from the next (layer-outermost layouts such as the CPU backend's ``LBHNC``), one
strided view ``[layer, block, page]`` covers them all, and on an accelerator each copy moves a
block range of every layer at once; on CPU, copies go layer by layer (see below).

A chunk payload is ``[layer, block of the chunk, page]``, contiguous.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.common import EngineLayout

# Payloads retrieved from the cache are read-only views; they are only ever read from here.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

#: Above this many runs of consecutive block ids, one indexed copy beats a copy per run.
MAX_RUN_COPIES = 4


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in block_ids, first block id, length) of each run of consecutive ids."""
    runs = []
    pos = 0
    n = len(block_ids)
    while pos < n:
        end = pos + 1
        while end < n and block_ids[end] == block_ids[end - 1] + 1:
            end += 1
        runs.append((pos, block_ids[pos], end - pos))
        pos = end
    return runs


class PagedKV:
    """Byte views of vLLM's KV pages: ``pages`` is ``[layer, block, page_bytes]`` (uint8)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], engine: EngineLayout, num_blocks: int) -> None:
        self.engine = engine
        self.page_bytes = engine.page_bytes
        self.num_blocks = num_blocks
        missing = [name for name in engine.layer_names if name not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV tensor for layers {missing[:4]}")
        layers = [self._page_view(name, kv_caches[name]) for name in engine.layer_names]
        self.device = layers[0].device
        self.layers = layers
        self.pages = self._stack(layers)  # None when the layers are not evenly spaced in one allocation
        self._host = [t.numpy() for t in layers] if self.device.type == "cpu" else None

    def _page_view(self, name: str, cache) -> torch.Tensor:
        if not isinstance(cache, torch.Tensor):
            raise ConfigError(f"layer {name}: expected one KV tensor, got {type(cache).__name__}")
        if cache.dim() < 2 or cache.shape[0] != self.num_blocks:
            raise ConfigError(
                f"layer {name}: KV tensor of shape {tuple(cache.shape)} does not have one row per block"
                f" ({self.num_blocks} blocks); kernel block sizes other than the block size are not supported"
            )
        page = cache[0]
        if not page.is_contiguous() or page.numel() * page.element_size() != self.page_bytes:
            raise ConfigError(
                f"layer {name}: a block's KV is not one contiguous page of {self.page_bytes} bytes"
                f" (shape {tuple(cache.shape)}, strides {cache.stride()}); this KV layout is not supported"
            )
        itemsize = cache.element_size()
        view = torch.empty(0, dtype=torch.uint8, device=cache.device)
        view.set_(
            cache.untyped_storage(),
            cache.storage_offset() * itemsize,
            (self.num_blocks, self.page_bytes),
            (cache.stride(0) * itemsize, 1),
        )
        return view

    @staticmethod
    def _stack(layers: list[torch.Tensor]) -> torch.Tensor | None:
        first = layers[0]
        storage = first.untyped_storage()
        if any(t.untyped_storage().data_ptr() != storage.data_ptr() or t.stride() != first.stride() for t in layers):
            return None
        offsets = [t.storage_offset() for t in layers]
        step = offsets[1] - offsets[0] if len(offsets) > 1 else first.shape[0] * first.stride(0)
        if step <= 0 or any(b - a != step for a, b in zip(offsets, offsets[1:])):
            return None
        view = torch.empty(0, dtype=torch.uint8, device=first.device)
        view.set_(storage, offsets[0], (len(layers), *first.shape), (step, *first.stride()))
        return view

    # -- copies --------------------------------------------------------------------------------
    #
    # On CPU the copies go through numpy, layer by layer, both sides contiguous: plain memcpy on
    # the calling thread. torch would split them over its intra-op threads, which is no faster
    # for a memory copy and can be a hundred times slower when the cores are busy (the engine's
    # own threads, the saver thread). On an accelerator, torch copies, all layers at once.

    def payload_view(self, buffer, num_blocks: int):
        """A chunk payload (bytes-like of ``num_blocks`` blocks) as ``[layer, block, page]``."""
        array = np.frombuffer(buffer, dtype=np.uint8).reshape(len(self.layers), num_blocks, self.page_bytes)
        return array if self._host is not None else torch.from_numpy(array)

    def scatter(self, payload, first: int, block_ids: Sequence[int]) -> None:
        """Pages ``first..first+len(block_ids)`` of a payload into vLLM's blocks ``block_ids``."""
        if not block_ids:
            return
        runs = _runs(block_ids)
        if self._host is not None:
            for layer, dst in enumerate(self._host):
                src = payload[layer]
                if len(runs) <= MAX_RUN_COPIES:
                    for pos, block, length in runs:
                        dst[block : block + length] = src[first + pos : first + pos + length]
                else:
                    dst[np.asarray(block_ids)] = src[first : first + len(block_ids)]
            return
        if self.pages is not None and len(runs) <= MAX_RUN_COPIES:
            for pos, block, length in runs:
                self.pages[:, block : block + length].copy_(payload[:, first + pos : first + pos + length], non_blocking=True)
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, dst in enumerate(self.layers):
            dst.index_copy_(0, index, payload[layer, first : first + len(block_ids)].to(self.device, non_blocking=True))

    def gather(self, block_ids: Sequence[int], dest: memoryview) -> None:
        """vLLM's blocks ``block_ids`` into ``dest``, a writable payload buffer of
        ``[layer, len(block_ids), page]``."""
        runs = _runs(block_ids)
        n = len(block_ids)
        if self._host is not None:
            out = np.frombuffer(dest, dtype=np.uint8).reshape(len(self.layers), n, self.page_bytes)
            for layer, src in enumerate(self._host):
                if len(runs) <= MAX_RUN_COPIES:
                    for pos, block, length in runs:
                        out[layer, pos : pos + length] = src[block : block + length]
                else:
                    np.take(src, np.asarray(block_ids), axis=0, out=out[layer])
            return
        out = torch.frombuffer(dest, dtype=torch.uint8).view(len(self.layers), n, self.page_bytes)
        if self.pages is not None and len(runs) <= MAX_RUN_COPIES:
            for pos, block, length in runs:
                out[:, pos : pos + length].copy_(self.pages[:, block : block + length])
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, src in enumerate(self.layers):
            out[layer].copy_(src.index_select(0, index))

    def synchronize(self) -> None:
        """Wait for copies queued on the device (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
