"""vLLM's KV layouts, CPU and CUDA, read from the tensors' shapes and strides: pages gathered
into payloads and scattered back byte for byte, for every layout vLLM's backends register (no
engine: tensors built the way vLLM builds them). On a machine with a GPU, set
``KVTIER_TEST_DEVICE=cuda`` and the same tests run on CUDA tensors, through the copy stream and
page-locked host memory."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.paged.device_copy import PageLocks
from kvtier.paged.groups import MLA, FullAttention
from kvtier.paged.layout import GroupLayout
from kvtier.paged.pages import PagedKV, _runs, block_form

DEVICE = torch.device(os.environ.get("KVTIER_TEST_DEVICE", "cpu"))
L, B, N, H, D = 3, 20, 16, 2, 8  # layers, blocks, tokens a block, KV heads, head size
MLA_D = 24
DTYPE = torch.bfloat16


def _random(*shape) -> torch.Tensor:
    """bf16 from random bits: every bit pattern is a value, so only a byte-exact copy compares equal."""
    return torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16).view(DTYPE).to(DEVICE)


def _split(alloc: torch.Tensor, layer_dim: int, perm) -> list[torch.Tensor]:
    """Per-layer views of one allocation, in the logical order ``perm`` (vLLM's stride order undone)."""
    return [alloc.select(layer_dim, l).permute(*perm) for l in range(L)]


# name -> (per-layer views, a reading of the same memory with the wrong strides, or None where a
# wrong reading keeps each block's bytes and so cannot go wrong); logical shapes are vLLM's
LAYOUTS = {
    # vLLM 0.32: logical [B, H, N, C] (C: K and V of a token), physical order by KVCacheLayout
    "LBHNC": lambda: (_split(_random(L, B, H, N, 2 * D), 0, (0, 1, 2, 3)), ("LHBNC", (L, H, B, N, 2 * D), 0, (1, 0, 2, 3))),
    "LBNHC": lambda: (_split(_random(L, B, N, H, 2 * D), 0, (0, 2, 1, 3)), None),
    "LHBNC": lambda: (_split(_random(L, H, B, N, 2 * D), 0, (1, 0, 2, 3)), ("LBHNC", (L, B, H, N, 2 * D), 0, (0, 1, 2, 3))),
    "BLHNC": lambda: (_split(_random(B, L, H, N, 2 * D), 1, (0, 1, 2, 3)), ("LBHNC", (L, B, H, N, 2 * D), 0, (0, 1, 2, 3))),
    "BLNHC": lambda: (_split(_random(B, L, N, H, 2 * D), 1, (0, 2, 1, 3)), ("LBNHC", (L, B, N, H, 2 * D), 0, (0, 2, 1, 3))),
    "BHLNC": lambda: (_split(_random(B, H, L, N, 2 * D), 2, (0, 1, 2, 3)), ("BLHNC", (B, L, H, N, 2 * D), 1, (0, 1, 2, 3))),
    # FlashAttention before 0.32: per layer (2, B, N, H, D), NHD or HND in memory
    "flash-NHD": lambda: ([_random(2, B, N, H, D) for _ in range(L)], ("flashinfer", (B, 2, N, H, D), None, None)),
    "flash-HND": lambda: ([_random(2, B, H, N, D).permute(0, 1, 3, 2, 4) for _ in range(L)], ("flashinfer", (B, 2, H, N, D), None, (1, 0, 3, 2, 4))),
    # cross-layer blocks: (L, 2, B, N, H, D) logical, (B, L, 2, N, H, D) in memory
    "flash-cross-layer": lambda: (_split(_random(B, L, 2, N, H, D), 1, (1, 0, 2, 3, 4)), ("per-layer", (L, 2, B, N, H, D), 0, (0, 1, 2, 3, 4))),
    # FlashInfer: (B, 2, N, H, D)
    "flashinfer": lambda: ([_random(B, 2, N, H, D) for _ in range(L)], ("flash", (2, B, N, H, D), None, None)),
    # MLA: (B, N, latent), and its cross-layer form (B, L, N, latent)
    "mla": lambda: ([_random(B, N, MLA_D) for _ in range(L)], None),
    "mla-cross-layer": lambda: (_split(_random(B, L, N, MLA_D), 1, (0, 1, 2)), ("per-layer", (L, B, N, MLA_D), 0, (0, 1, 2))),
}


def _misread(views: list[torch.Tensor], wrong) -> list[torch.Tensor]:
    """The same memory read with another layout's strides (a reader blind to the real ones)."""
    _, shape, layer_dim, perm = wrong
    storage = views[0].untyped_storage()
    whole = torch.empty(0, dtype=DTYPE, device=DEVICE).set_(storage)
    if layer_dim is None:  # one tensor a layer: each layer's own memory, read with other strides
        return [torch.empty(0, dtype=DTYPE, device=DEVICE).set_(v.untyped_storage()).view(shape).permute(*(perm or range(len(shape)))) for v in views]
    return _split(whole.view(shape), layer_dim, perm)


def _group(views: list[torch.Tensor]) -> GroupLayout:
    mla = views[0].shape[-1] == MLA_D
    layout = KVLayout(L, 1 if mla else H, MLA_D if mla else D, "bfloat16", block_size=N, arrangement="test",
                      **({"kv_parts": 1} if mla else {}))
    page = N * layout.bytes_per_token // L
    return GroupLayout(0, MLA() if mla else FullAttention(), tuple(f"layer{l}" for l in range(L)), (page,), layout)


def _paged(views, host_copies) -> PagedKV:
    return PagedKV({f"layer{l}": v for l, v in enumerate(views)}, _group(views), B, host_copies)


def _block_dim(view: torch.Tensor) -> int:
    return 1 if view.shape[0] == 2 and view.shape[1] == B else 0


def _logical_blocks(views, ids) -> list[torch.Tensor]:
    """Each layer's values of blocks ``ids`` in vLLM's logical order, as bits."""
    index = torch.tensor(ids, device=DEVICE)
    return [v.index_select(_block_dim(v), index).view(torch.int16).cpu() for v in views]


def _physical_page(view: torch.Tensor, block: int) -> bytes:
    """One block's bytes in address order, found element by element (independent of BlockForm)."""
    elements = torch.empty(0, dtype=view.dtype).set_(view.untyped_storage().cpu())  # all of the memory, as laid out
    address = torch.arange(elements.numel()).as_strided(view.shape, view.stride(), view.storage_offset())
    return elements[address.select(_block_dim(view), block).flatten().sort().values].view(torch.uint8).numpy().tobytes()


def _payload(pages: PagedKV, n: int) -> memoryview:
    return memoryview(np.zeros(pages.payload_bytes(n), dtype=np.uint8))  # an ndarray: page-locked for CUDA


COPIES = [None] if DEVICE.type == "cuda" else [True, False]  # numpy copies, torch's (the device path)


@pytest.mark.parametrize("host_copies", COPIES, ids=lambda c: {None: "device", True: "numpy", False: "torch"}[c])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("src_ids, dst_ids", [([5, 6, 7, 8], [11, 12, 13, 14]), ([9, 3, 17, 18, 1, 12], [2, 19, 4, 0, 15, 16]),
                                              ([5, 7, 6, 8], [11, 13, 12, 14])],
                         ids=["one-run", "scattered", "one-span-out-of-order"])
def test_pages_of_each_vllm_layout_round_trip_byte_for_byte(layout, host_copies, src_ids, dst_ids):
    engine, _ = LAYOUTS[layout]()
    other, _ = LAYOUTS[layout]()
    before = [v.clone() for v in other]
    source, target = _paged(engine, host_copies), _paged(other, host_copies)
    payload = _payload(source, len(src_ids))
    source.gather(src_ids, payload)
    source.synchronize()
    if DEVICE.type == "cuda":  # the payload's memory was page-locked for the copy
        assert source._device.page_locks.locked_bytes >= len(payload)
    # the payload is each layer's pages in address order, block after block
    assert bytes(payload) == b"".join(_physical_page(v, b) for v in engine for b in src_ids)
    target.scatter(payload, len(src_ids), 0, dst_ids)
    target.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(_logical_blocks(other, dst_ids), _logical_blocks(engine, src_ids)))
    untouched = [b for b in range(B) if b not in dst_ids]
    assert all(torch.equal(a, b) for a, b in zip(_logical_blocks(other, untouched), _logical_blocks(before, untouched)))
    # a part of a payload lands in its blocks and only there
    target.scatter(payload, len(src_ids), 2, dst_ids[:2])
    target.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(_logical_blocks(other, dst_ids[:2]), _logical_blocks(engine, src_ids[2:4])))


@pytest.mark.parametrize("layout", sorted(name for name, make in LAYOUTS.items() if name not in ("LBNHC", "mla")))
def test_a_reading_with_the_wrong_strides_moves_the_wrong_bytes(layout):
    """Negative control: the same memory read with another layout's strides is accepted (it is a
    layout too) but moves other bytes, so the round trip above would catch a wrong reading."""
    engine, wrong = LAYOUTS[layout]()
    other, _ = LAYOUTS[layout]()
    ids = [5, 6, 7, 8]
    misread = _paged(_misread(engine, wrong), COPIES[0])
    payload = _payload(misread, len(ids))
    misread.gather(ids, payload)
    misread.synchronize()
    target = _paged(other, COPIES[0])
    target.scatter(payload, len(ids), 0, ids)
    target.synchronize()
    assert not all(torch.equal(a, b) for a, b in zip(_logical_blocks(other, ids), _logical_blocks(engine, ids)))


def test_pages_are_physical_bytes_so_layouts_never_share_objects():
    """Token-major and head-major pages of the same KV differ byte for byte: a payload of one
    loaded by the other is wrong KV, which is why the layout's name is in every key."""
    nhd, _ = LAYOUTS["flash-NHD"]()
    hnd = [torch.empty(2, B, H, N, D, dtype=DTYPE, device=DEVICE).permute(0, 1, 3, 2, 4) for _ in range(L)]
    for src, dst in zip(nhd, hnd):
        dst.copy_(src)  # the same logical KV
    assert all(torch.equal(a, b) for a, b in zip(_logical_blocks(nhd, range(B)), _logical_blocks(hnd, range(B))))
    pages_nhd, pages_hnd = _paged(nhd, COPIES[0]), _paged(hnd, COPIES[0])
    a, b = _payload(pages_nhd, 2), _payload(pages_hnd, 2)
    pages_nhd.gather([3, 4], a)
    pages_hnd.gather([3, 4], b)
    pages_nhd.synchronize()
    pages_hnd.synchronize()
    assert bytes(a) != bytes(b)
    pages_hnd.scatter(a, 2, 0, [3, 4])
    pages_hnd.synchronize()
    assert not all(torch.equal(x, y) for x, y in zip(_logical_blocks(nhd, [3, 4]), _logical_blocks(hnd, [3, 4])))


def test_pages_of_several_groups_copy_through_one_payload_and_lock_it_once():
    """A hybrid model's groups (and the loader's and saver's twins) copy through the same arena
    and ring: registering a mapping is the process's state, so they share one record of it. On
    CUDA, a registration the driver refuses (here: the same memory again) must not surface as an
    error in the next kernel launch; on an H200 it did (every copy after it raised)."""
    first, _ = LAYOUTS["LBHNC"]()
    second, _ = LAYOUTS["LBHNC"]()
    pages_first, pages_second = _paged(first, COPIES[0]), _paged(second, COPIES[0])
    payload = _payload(pages_first, 4)
    pages_first.gather([5, 6, 7, 8], payload)
    pages_first.synchronize()
    twin = pages_second.twin()  # the loader's copies
    twin.scatter(payload, 4, 0, [1, 2, 3, 4])
    twin.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(_logical_blocks(second, [1, 2, 3, 4]), _logical_blocks(first, [5, 6, 7, 8])))
    if DEVICE.type == "cuda":
        from kvtier.paged.device_copy import _cudart_register

        assert pages_first._device.page_locks is twin._device.page_locks
        assert pages_first._device.page_locks.locked_bytes >= len(payload)
        array = np.frombuffer(payload, dtype=np.uint8)
        assert not _cudart_register(array.ctypes.data, array.nbytes)  # registered already: refused
        pages_second.scatter(payload, 4, 0, [9, 10, 11, 12])  # the next launches do not raise it
        pages_second.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(_logical_blocks(second, [9, 10, 11, 12]), _logical_blocks(first, [5, 6, 7, 8])))


@pytest.mark.parametrize("ids", [[3, 4, B], [3, 4, -1], [B - 2, B - 1, B], [-1, 0, 1]],
                         ids=["past-the-end", "negative", "run-past-the-end", "run-from-negative"])
def test_a_block_id_outside_the_kv_cache_is_refused_before_any_block_moves(ids):
    """A block id vLLM's KV cache does not have (a bug upstream) is an error, raised before any
    copy: no block is overwritten, no payload half filled."""
    engine, _ = LAYOUTS["LBHNC"]()
    pages = _paged(engine, COPIES[0])
    payload = _payload(pages, 3)
    before = [v.clone() for v in engine]
    with pytest.raises(IndexError, match="outside"):
        pages.scatter(payload, 3, 0, ids)
    pages.synchronize()
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(engine, before))
    np.frombuffer(payload, dtype=np.uint8)[:] = 7
    with pytest.raises(IndexError, match="outside"):
        pages.gather(ids, payload)
    assert not np.any(np.frombuffer(payload, dtype=np.uint8) != 7)


def test_block_forms_are_read_from_strides():
    item = DTYPE.itemsize
    page = N * H * D * item
    (layer, *_), _ = LAYOUTS["flash-HND"]()
    form = block_form("l", layer, B)
    assert (form.stride, form.parts, form.part_strides, form.run) == (page, (2,), (B * page,), page)  # K, V
    cross, _ = LAYOUTS["flash-cross-layer"]()
    form = block_form("l", cross[1], B)
    assert (form.stride, form.offset, form.parts, form.run) == (L * 2 * page, 2 * page, (), 2 * page)
    heads, _ = LAYOUTS["LHBNC"]()
    form = block_form("l", heads[0], B)
    assert (form.parts, form.part_strides, form.run) == ((H,), (B * N * 2 * D * item,), N * 2 * D * item)
    # the layers of a cross-layer allocation are one view: a copy moves every layer at once
    assert _paged(cross, COPIES[0]).pages is not None and _paged(heads, COPIES[0]).pages is not None


def test_layouts_kvtier_cannot_read_are_refused():
    with pytest.raises(ConfigError, match="one row per block"):
        block_form("l", torch.zeros(2 * B, N, 2 * D), B)  # kernel blocks smaller than the block
    with pytest.raises(ConfigError, match="overlaps itself"):
        block_form("l", torch.zeros(B, 1, N, 2 * D).expand(B, H, N, 2 * D), B)  # a broadcast view
    views, _ = LAYOUTS["LBHNC"]()
    with pytest.raises(ConfigError, match="group needs"):
        PagedKV({f"layer{l}": v[:, :1] for l, v in enumerate(views)}, _group(views), B)  # a head short


# -- page-locked host memory (the bookkeeping; registration itself needs CUDA) ---------------------


class _Driver:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}

    def register(self, address: int, size: int) -> bool:
        self.registered[address] = size
        return True

    def unregister(self, address: int) -> None:
        del self.registered[address]


def test_a_mapping_is_locked_whole_once_and_stays_mapped_while_locked():
    driver = _Driver()
    locks = PageLocks(driver.register, driver.unregister)
    arena = mmap.mmap(-1, 1 << 20)
    view = memoryview(arena)
    assert locks.lock(view[4096:8192]) and locks.lock(view[65536:])
    assert list(driver.registered.values()) == [1 << 20] and locks.locked_bytes == 1 << 20
    ring = np.ones(1 << 16, dtype=np.uint8)
    assert locks.lock(memoryview(ring[100:200])) and sorted(driver.registered.values()) == [1 << 16, 1 << 20]
    assert not locks.lock(b"frame bytes") and not locks.lock(bytearray(10))  # not ours to lock
    view.release()
    with pytest.raises(BufferError):
        arena.close()  # a locked mapping cannot be unmapped under the device's copies
    locks.close()
    assert driver.registered == {}
    arena.close()


def test_a_mapping_nobody_holds_any_more_is_unlocked_and_freed():
    driver = _Driver()
    locks = PageLocks(driver.register, driver.unregister)
    old = mmap.mmap(-1, 1 << 20)
    assert locks.lock(memoryview(old)[:10])
    locks.lock(memoryview(old))  # still held by its owner: kept
    assert len(driver.registered) == 1
    del old  # the client mapped a new arena (a server restart)
    new = mmap.mmap(-1, 1 << 21)
    assert locks.lock(memoryview(new)[:10])
    assert list(driver.registered.values()) == [1 << 21]
    refused = PageLocks(lambda address, size: False, driver.unregister)
    assert not refused.lock(memoryview(new)) and not refused.lock(memoryview(new))


def test_block_ids_are_cut_into_runs_of_consecutive_ids():
    assert _runs([3, 4, 5, 9, 10, 2, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1), (6, 2, 1)]
    assert _runs(np.array([7], dtype=np.int64)) == [(0, 7, 1)]
    assert _runs([]) == []
