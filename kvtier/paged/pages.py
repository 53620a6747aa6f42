"""vLLM's KV tensors seen as pages, and the copies between pages and chunk payloads (worker side).

vLLM hands the connector, per layer, one tensor or several (Mamba/GDN: conv and SSM state), each
holding every block. Where a block's bytes lie is read from the tensor's shape and strides, never
assumed from a backend's name (``block_form``): the block dimension is the first, or the second
after a leading K/V dimension of two; the rest of a block is one or more contiguous runs of bytes
at fixed distances from the block's start. Layouts this covers, among others:

    vLLM 0.32, logical [B, H, N, C]   LBHNC, BLHNC (heads outer): one run a block
                                       LBNHC, BLNHC (tokens outer): one run a block
                                       LHBNC, BHLNC: one run per head
    FlashAttention  (2, B, N, H, D)    NHD and HND: two runs a block, K and V
    FlashInfer      (B, 2, N, H, D)    one run a block
    MLA             (B, N, D)          one run a block
    cross-layer     [B, L, ...]        per-layer views blocks L pages apart (BLHNC, or
                                       (B, L, 2, N, H, D) of earlier versions)

A block's page (one layer) is its runs in the order of their addresses, each copied byte for
byte: the interior of a run is never interpreted, and pages are only ever loaded into an engine
of the same arrangement (its layout name is in every key). A tensor whose elements overlap
(a broadcast view) is refused. When every layer of a group lives in one allocation at a constant
distance from the next (``LBHNC``, and the cross-layer layouts), one strided view
``[layer, block, ...]`` covers them all and each copy moves every layer at once.

On CUDA the copies run on a stream of their own between page-locked host memory and the KV
tensors (``device_copy.py``).
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvtier.errors import ConfigError
from kvtier.paged.device_copy import DeviceCopies
from kvtier.paged.layout import GroupLayout

# Payloads retrieved from the cache are read-only views; they are only ever read from here.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in block_ids, first block id, length) of each run of consecutive ids. Plain
    Python: a chunk names a few blocks, where numpy's per-call cost is many times the work."""
    runs: list[tuple[int, int, int]] = []
    for pos, block in enumerate(block_ids):
        block = int(block)
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((pos, block, 1))
    return runs


@dataclass(frozen=True)
class BlockForm:
    """Where each block's bytes lie in a KV tensor: block ``b`` starts ``offset + b * stride``
    bytes into the storage and holds one run of ``run`` contiguous bytes at each point of the
    grid ``parts`` (``part_strides`` bytes apart), in address order."""

    offset: int
    stride: int
    parts: tuple[int, ...]
    part_strides: tuple[int, ...]
    run: int

    @property
    def row_bytes(self) -> int:
        return math.prod(self.parts) * self.run


def _disjoint(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """No two elements at one address (sufficient: each dimension steps past all inner ones)."""
    extent = 1
    for size, stride in sorted(((n, s) for n, s in zip(shape, strides) if n > 1), key=lambda d: d[1]):
        if stride < extent:
            return False
        extent += stride * (size - 1)
    return True


def block_form(name: str, cache: torch.Tensor, num_blocks: int) -> BlockForm:
    """Read a tensor's ``BlockForm`` from its shape and strides, or ConfigError."""
    if not isinstance(cache, torch.Tensor):
        raise ConfigError(f"layer {name}: expected KV tensors, got {type(cache).__name__}")
    shape, strides = tuple(cache.shape), tuple(cache.stride())
    if len(shape) >= 2 and shape[0] == num_blocks:
        dim = 0
    elif len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks:
        dim = 1  # K and V apart, each holding every block (FlashAttention's (2, B, ...))
    else:
        raise ConfigError(
            f"layer {name}: KV tensor of shape {shape} does not have one row per block"
            f" ({num_blocks} blocks); kernel block sizes other than the block size are not supported"
        )
    if not _disjoint(shape, strides):
        raise ConfigError(f"layer {name}: KV tensor of shape {shape} with strides {strides} overlaps itself")
    inner = sorted(((n, s) for d, (n, s) in enumerate(zip(shape, strides)) if d != dim and n > 1), key=lambda d: -d[1])
    run = 1
    while inner and inner[-1][1] == run:  # the contiguous run: the innermost dimensions back to back
        run *= inner.pop()[0]
    item = cache.element_size()
    return BlockForm(
        cache.storage_offset() * item, strides[dim] * item,
        tuple(n for n, _ in inner), tuple(s * item for _, s in inner), run * item,
    )


def _byte_view(cache: torch.Tensor, form: BlockForm, num_blocks: int) -> torch.Tensor:
    """``[block, *parts, run]`` uint8 view of ``cache``'s storage."""
    view = torch.empty(0, dtype=torch.uint8, device=cache.device)
    view.set_(cache.untyped_storage(), form.offset, (num_blocks, *form.parts, form.run), (form.stride, *form.part_strides, 1))
    return view


class PagedKV:
    """Byte views of one KV-cache group's pages: ``slots`` holds, for each layer of the group in
    order and each of the layer's tensors (one for attention; conv and SSM state for Mamba/GDN),
    a ``[block, *parts, run]`` uint8 view (``BlockForm``). A payload of ``n`` blocks is the slots'
    rows one after the other: ``[slot][block][row]``, contiguous (for attention,
    ``[layer, block, page]``). Copies go through numpy on CPU tensors and through torch on an
    accelerator; ``host_copies`` overrides that choice (tests run the torch path on CPU)."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], group: GroupLayout, num_blocks: int,
                 host_copies: bool | None = None) -> None:
        self.group = group
        self.num_blocks = num_blocks
        missing = [name for name in group.layer_names if name not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV tensor for layers {missing[:4]}")
        slots, self.rows, self.forms = [], [], []
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
                    f" the {group.kind.name} group has {len(group.rows)} of {group.rows} bytes a block"
                )
            for t, row in zip(tensors, rows):
                form = self._form(name, t, row, exact)
                slots.append(_byte_view(t, form, num_blocks))
                self.forms.append(form)
            self.rows += rows
        self.slots = slots
        self.page_bytes = group.page_bytes * len(group.layer_names)  # one block of every layer
        self.device = slots[0].device
        self.uniform = len(set(self.rows)) == 1 and len({f.parts for f in self.forms}) == 1
        self.pages = self._stack(slots) if self.uniform else None  # None unless evenly spaced in one allocation
        host = self.device.type == "cpu" if host_copies is None else host_copies
        self._host = [t.numpy() for t in slots] if host else None
        self._host_pages = self.pages.numpy() if host and self.pages is not None else None
        self._device = None if host else DeviceCopies(self.device)
        # the device copies of separate, alike allocations (one a layer): a payload moves in one transfer
        self._alike = _alike(slots) if not host and self.uniform and self.pages is None else None

    def _form(self, name: str, cache, row_bytes: int, exact: bool) -> BlockForm:
        """The tensor's ``BlockForm``, checked against the bytes a block must hold there (with
        ``exact``, all of its row; else the first ``row_bytes`` of one contiguous row)."""
        form = block_form(name, cache, self.num_blocks)
        if exact and form.row_bytes == row_bytes:
            return form
        if not exact and not form.parts and form.run >= row_bytes:
            return BlockForm(form.offset, form.stride, (), (), row_bytes)
        raise ConfigError(
            f"layer {name}: a block holds {form.row_bytes} bytes in {math.prod(form.parts)} runs"
            f" (shape {tuple(cache.shape)}, strides {cache.stride()}), the group needs"
            f" {'' if exact else 'one run of at least '}{row_bytes}; this KV layout is not supported"
        )

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
        return view if _disjoint(view.shape, view.stride()) else None  # cross-layer: layers interleave

    # -- copies --------------------------------------------------------------------------------
    #
    # On CPU the copies go through numpy on the calling thread, each one call into C (which lets
    # go of the GIL) per slot pair, however scattered vLLM's blocks are: a Python loop per run
    # of consecutive blocks cost a call and a GIL round trip per run, and on the loader thread
    # each round trip waits for the engine's thread. Blocks in one run: one slice assignment
    # (memcpy of each layer's run). Scattered blocks: out of vLLM's blocks ``np.take`` with
    # ``out`` (memcpy of each page; it needs a contiguous source, else it would copy the whole
    # KV cache first: the cross-layer and K/V-split layouts keep a loop per run), into them one
    # indexed assignment a slot. Indexed reads and ``take``'s ``mode="raise"`` go through a temporary:
    # never used. torch
    # would split them over its intra-op threads, which is no faster for a memory copy and can
    # be a hundred times slower when the cores are busy (the engine's own threads, the saver
    # thread). On an accelerator, torch copies in a few batched operations (device_copy.py): a
    # payload moves in one transfer (one per slot where its blocks are a part of it), and one
    # indexed copy puts its blocks of every layer in place, in words as wide as the runs allow.

    def payload_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.page_bytes

    def _segments(self, buffer, num_blocks: int):
        """A payload of ``num_blocks`` blocks cut into one ``[block, *parts, run]`` array per slot
        (one ``[slot, block, *parts, run]`` array where all slots are alike)."""
        array = np.frombuffer(buffer, dtype=np.uint8)
        if self.uniform:
            return array.reshape(len(self.rows), num_blocks, *self.forms[0].parts, self.forms[0].run)
        segments, offset = [], 0
        for row, form in zip(self.rows, self.forms):
            size = num_blocks * row
            segments.append(array[offset : offset + size].reshape(num_blocks, *form.parts, form.run))
            offset += size
        return segments

    def _host_pairs(self, segments, slots: slice = slice(None), stacked: bool = True):
        """(vLLM's pages, payload) array pairs for the host copies of ``slots`` (``segments``
        holds those slots only), and the index that precedes the block axis in both: every slot
        in one pair where they are evenly spaced in one allocation and ``stacked``, else a pair a
        slot (scattered ids: each block a contiguous row of its slot; with the slot axis before
        the index numpy moved 7.0 GB/s where memcpy moves 13.5, a slot at a time 8.3)."""
        if stacked and self._host_pages is not None:
            return [(self._host_pages[slots], segments)], (slice(None),)
        return list(zip(self._host[slots], segments)), ()

    def scatter(self, payload, num_blocks: int, first: int, block_ids: Sequence[int], slots: slice = slice(None)) -> None:
        """Blocks ``first..first+len(block_ids)`` of a payload (bytes-like of ``num_blocks``
        blocks) into vLLM's blocks ``block_ids``; only the ``slots`` given (default all: a
        layer-by-layer load copies one attention layer's slot at a time)."""
        n = len(block_ids)
        if not n:
            return
        segments = self._segments(payload, num_blocks)[slots]
        if self._device is not None:
            with self._device.copying(payload) as copies:
                index = copies.index(block_ids)
                if self.pages is not None:
                    pages = self.pages[slots]
                    _wide(pages).index_copy_(1, index, _as(copies.to_device(torch.from_numpy(segments[:, first : first + n])), pages))
                elif self._alike is not None:  # one transfer, then each layer's blocks
                    wide = self._alike[slots]
                    data = copies.to_device(torch.from_numpy(segments[:, first : first + n])).view(wide[0].dtype)
                    for dst, src in zip(wide, data):
                        dst.index_copy_(0, index, src)
                else:
                    for dst, src in zip(self.slots[slots], segments):
                        _wide(dst).index_copy_(0, index, _as(copies.to_device(torch.from_numpy(src[first : first + n])), dst))
            return
        index, start = self._index(block_ids)
        pairs, lead = self._host_pairs(segments, slots, stacked=start is not None)
        for dst, src in pairs:
            part = src[(*lead, slice(first, first + n))]
            if start is not None:
                dst[(*lead, slice(start, start + n))] = part
            else:
                dst[(*lead, index)] = part

    def gather(self, block_ids: Sequence[int], dest: memoryview) -> None:
        """vLLM's blocks ``block_ids`` into ``dest``, a writable payload buffer of
        ``len(block_ids)`` blocks. Called from the engine's thread: on CUDA the engine's later
        kernels wait (on the device) for the copy, and ``dest`` is complete once ``fence()`` is."""
        if not len(block_ids):
            return
        segments = self._segments(dest, len(block_ids))
        if self._device is not None:
            with self._device.copying(dest, engine_waits=True) as copies:
                index = copies.index(block_ids)
                if self.pages is not None:
                    copies.to_host(_wide(self.pages).index_select(1, index), torch.from_numpy(segments))
                elif self._alike is not None:  # each layer's blocks side by side, one transfer
                    wide = self._alike
                    staged = torch.empty((len(wide), len(block_ids), *wide[0].shape[1:]), dtype=wide[0].dtype, device=self.device)
                    for src, out in zip(wide, staged):
                        torch.index_select(src, 0, index, out=out)
                    copies.to_host(staged, torch.from_numpy(segments))
                else:
                    for out, src in zip(segments, self.slots):
                        copies.to_host(_wide(src).index_select(0, index), torch.from_numpy(out))
            return
        pairs, lead = self._host_pairs(segments)
        index, start = self._index(block_ids)
        for src, out in pairs:
            if start is not None:
                out[...] = src[(*lead, slice(start, start + len(block_ids)))]
            elif src.flags.c_contiguous:  # ids checked: "clip" never clips
                np.take(src, index, axis=len(lead), out=out, mode="clip")
            else:
                for pos, block, length in _runs(index):
                    out[(*lead, slice(pos, pos + length))] = src[(*lead, slice(block, block + length))]

    def _index(self, block_ids: Sequence[int]) -> tuple[np.ndarray | None, int | None]:
        """(None, the first id) where ``block_ids`` are one run of consecutive ids, else (them as
        an index array, None); IndexError for an id that names no block. The run is found in
        plain Python: a chunk names a few blocks, where numpy's per-call cost is many times the work."""
        ids = block_ids.tolist() if isinstance(block_ids, np.ndarray) else list(block_ids)
        first, n = ids[0], len(ids)
        if ids == list(range(first, first + n)):
            if 0 <= first and first + n <= self.num_blocks:
                return None, first
        else:
            index = np.asarray(ids, dtype=np.intp)
            if not (index.view(np.uintp) >= self.num_blocks).any():  # a negative id too, as unsigned
                return index, None
        raise IndexError(f"block ids {ids} outside vLLM's {self.num_blocks} blocks")

    def twin(self) -> "PagedKV":
        """The same views with copies of their own (on CUDA their own stream and event): for
        another thread that copies while this object's thread does too. Built on the engine's
        thread (its copies wait for the engine's stream)."""
        twin = copy.copy(self)
        if self._device is not None:
            twin._device = DeviceCopies(self.device)
        return twin

    def fence(self):
        """What another thread waits on (``.synchronize()``) for the copies queued so far to
        end: their CUDA event, or None where copies end when they return."""
        return self._device.done if self._device is not None else None

    def synchronize(self) -> None:
        """Wait for the copies queued on the device (their event; never the engine's stream).
        No-op on CPU."""
        if self._device is not None:
            self._device.wait()


def _wide(view: torch.Tensor) -> torch.Tensor:
    """A byte view as the widest integers its runs, strides and offset allow (an indexed copy
    moves one element per thread on a GPU)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if view.shape[-1] % size == 0 and view.storage_offset() % size == 0 and all(s % size == 0 for s in view.stride()[:-1]):
            return view.view(dtype)
    return view


def _alike(slots: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The slots' ``_wide`` views if they are alike (one shape, one element type: the payload is
    then one array of them, which moves in one transfer), else None. Per-layer allocations (a
    FlashAttention layout) copied a layer at a time moved half as fast as torch's pinned copies."""
    wide = [_wide(t) for t in slots]
    return wide if len({(t.shape[1:], t.dtype) for t in wide}) == 1 else None


def _as(data: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Contiguous bytes ``data`` as the element type ``_wide`` gives ``like``."""
    return data.view(_wide(like).dtype)
