"""vLLM's KV tensors seen as pages, and the copies between pages and chunk payloads (worker side).

vLLM hands the connector, per layer, one tensor (attention: a view ``[blocks, heads, tokens,
content]`` of its KV allocation) or several (Mamba/GDN: conv and SSM state), each with one row
per block. kvtier needs one thing from them: that the row of one block is a contiguous run of
bytes. That is checked here, on the tensors themselves, rather than assumed (the groups of a
hybrid model overlay one allocation, and attention pages may be padded to the Mamba page: the
strides say where each row is); the interior of a row is never interpreted. When every layer
of a group lives in one allocation at a constant distance from the next (layer-outermost layouts
such as the CPU backend's ``LBHNC``), one strided view ``[layer, block, page]`` covers them all,
and on an accelerator each copy moves a block range of every layer at once; on CPU, copies go
layer by layer (see below).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.common import GroupLayout

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
    """Byte views of one KV-cache group's pages: ``slots`` holds, for each layer of the group in
    order and each of the layer's tensors (one for attention; conv and SSM state for Mamba/GDN),
    a ``[block, row_bytes]`` uint8 view. A payload of ``n`` blocks is the slots' rows one after
    the other: ``[slot][block][row]``, contiguous (for attention, ``[layer, block, page]``)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], group: GroupLayout, num_blocks: int) -> None:
        self.group = group
        self.num_blocks = num_blocks
        missing = [name for name in group.layer_names if name not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV tensor for layers {missing[:4]}")
        slots, self.rows = [], []
        for name in group.layer_names:
            tensors = kv_caches[name]
            tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
            if len(tensors) == 1 and len(group.rows) > 1:
                # one raw page per block (vLLM's CPU build for Mamba/GDN): the state tensors
                # one after the other at its start, the padding after them
                rows, exact = (group.page_bytes,), False
            elif len(tensors) == len(group.rows):
                rows, exact = group.rows, True
            else:
                raise ConfigError(
                    f"layer {name}: {len(tensors)} KV tensors {[(tuple(t.shape), t.dtype) for t in tensors]},"
                    f" the {group.kind} group has {len(group.rows)} of {group.rows} bytes a block"
                )
            slots += [self._row_view(name, t, row, exact) for t, row in zip(tensors, rows)]
            self.rows += rows
        self.slots = slots
        self.page_bytes = group.page_bytes * len(group.layer_names)  # one block of every layer
        self.device = slots[0].device
        self.uniform = len(set(self.rows)) == 1
        self.pages = self._stack(slots) if self.uniform else None  # None unless evenly spaced in one allocation
        self._host = [t.numpy() for t in slots] if self.device.type == "cpu" else None

    def _row_view(self, name: str, cache, row_bytes: int, exact: bool) -> torch.Tensor:
        """``[block, row_bytes]`` bytes of ``cache`` (one row per block; with ``exact``, the
        whole of each block's row, else its first ``row_bytes``)."""
        if not isinstance(cache, torch.Tensor):
            raise ConfigError(f"layer {name}: expected KV tensors, got {type(cache).__name__}")
        if cache.dim() < 2 or cache.shape[0] != self.num_blocks:
            raise ConfigError(
                f"layer {name}: KV tensor of shape {tuple(cache.shape)} does not have one row per block"
                f" ({self.num_blocks} blocks); kernel block sizes other than the block size are not supported"
            )
        row = cache[0]
        size = row.numel() * row.element_size()
        if not row.is_contiguous() or size < row_bytes or (exact and size != row_bytes):
            raise ConfigError(
                f"layer {name}: a block's KV is not one contiguous row of {row_bytes} bytes"
                f" (shape {tuple(cache.shape)}, strides {cache.stride()}); this KV layout is not supported"
            )
        itemsize = cache.element_size()
        view = torch.empty(0, dtype=torch.uint8, device=cache.device)
        view.set_(
            cache.untyped_storage(),
            cache.storage_offset() * itemsize,
            (self.num_blocks, row_bytes),
            (cache.stride(0) * itemsize, 1),
        )
        return view

    @staticmethod
    def _stack(slots: list[torch.Tensor]) -> torch.Tensor | None:
        first = slots[0]
        storage = first.untyped_storage()
        if any(t.untyped_storage().data_ptr() != storage.data_ptr() or t.stride() != first.stride() for t in slots):
            return None
        offsets = [t.storage_offset() for t in slots]
        step = offsets[1] - offsets[0] if len(offsets) > 1 else first.shape[0] * first.stride(0)
        if step <= 0 or any(b - a != step for a, b in zip(offsets, offsets[1:])):
            return None
        view = torch.empty(0, dtype=torch.uint8, device=first.device)
        view.set_(storage, offsets[0], (len(slots), *first.shape), (step, *first.stride()))
        return view

    # -- copies --------------------------------------------------------------------------------
    #
    # On CPU the copies go through numpy, slot by slot, both sides contiguous: plain memcpy on
    # the calling thread. torch would split them over its intra-op threads, which is no faster
    # for a memory copy and can be a hundred times slower when the cores are busy (the engine's
    # own threads, the saver thread). On an accelerator, torch copies, all layers at once where
    # one view covers them.

    def payload_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.page_bytes

    def _segments(self, buffer, num_blocks: int):
        """A payload of ``num_blocks`` blocks cut into one ``[block, row]`` array per slot (one
        ``[slot, block, row]`` array where all rows are alike)."""
        array = np.frombuffer(buffer, dtype=np.uint8)
        if self.uniform:
            return array.reshape(len(self.rows), num_blocks, self.rows[0])
        segments, offset = [], 0
        for row in self.rows:
            size = num_blocks * row
            segments.append(array[offset : offset + size].reshape(num_blocks, row))
            offset += size
        return segments

    def scatter(self, payload, num_blocks: int, first: int, block_ids: Sequence[int]) -> None:
        """Blocks ``first..first+len(block_ids)`` of a payload (bytes-like of ``num_blocks``
        blocks) into vLLM's blocks ``block_ids``."""
        if not block_ids:
            return
        runs = _runs(block_ids)
        segments = self._segments(payload, num_blocks)
        if self._host is not None:
            for dst, src in zip(self._host, segments):
                if len(runs) <= MAX_RUN_COPIES:
                    for pos, block, length in runs:
                        dst[block : block + length] = src[first + pos : first + pos + length]
                else:
                    dst[np.asarray(block_ids)] = src[first : first + len(block_ids)]
            return
        if self.pages is not None and len(runs) <= MAX_RUN_COPIES:
            stacked = torch.from_numpy(segments)
            for pos, block, length in runs:
                self.pages[:, block : block + length].copy_(stacked[:, first + pos : first + pos + length], non_blocking=True)
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for dst, src in zip(self.slots, segments):
            dst.index_copy_(0, index, torch.from_numpy(src[first : first + len(block_ids)]).to(self.device, non_blocking=True))

    def gather(self, block_ids: Sequence[int], dest: memoryview) -> None:
        """vLLM's blocks ``block_ids`` into ``dest``, a writable payload buffer of
        ``len(block_ids)`` blocks."""
        runs = _runs(block_ids)
        n = len(block_ids)
        segments = self._segments(dest, n)
        if self._host is not None:
            for out, src in zip(segments, self._host):
                if len(runs) <= MAX_RUN_COPIES:
                    for pos, block, length in runs:
                        out[pos : pos + length] = src[block : block + length]
                else:
                    np.take(src, np.asarray(block_ids), axis=0, out=out)
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for out, src in zip(segments, self.slots):
            torch.from_numpy(out).copy_(src.index_select(0, index))

    def synchronize(self) -> None:
        """Wait for copies queued on the device (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
