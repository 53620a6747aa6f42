"""Negative controls for the exactness checks: wrong KV that still passes every integrity check.

A test stores a prompt's KV the normal way, reads the objects back through a key store's public
key-level API (``acquire``/``release``), damages a payload (one page zeroed, the blocks of a chunk
shifted by one, two layers swapped), then clears the store and puts the objects back under their
own keys with valid checksums (``reserve``/``commit``). Nothing below the integration can tell, so
a warm request loads the damaged KV, and the test's exactness check must report a mismatch. The
same round trip without damage must still pass, which shows that the failures come from the damage.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from kvtier.objects import HEADER_SIZE, read_header, reseal

#: Turns a float32 payload into a view ``[layer, block, ...]`` of it, for the payload arrangement
#: of one integration (a block is ``block_size`` tokens of one layer: one page).
PageView = Callable[[np.ndarray], np.ndarray]


def zero_one_page(kv: np.ndarray) -> None:
    kv[kv.shape[0] // 2, 1] = 0


def shift_blocks_by_one(kv: np.ndarray) -> None:
    kv[:, 1:] = kv[:, :-1].copy()


def swap_two_layers(kv: np.ndarray) -> None:
    kv[[0, 1]] = kv[[1, 0]]


DAMAGES: dict[str, Callable[[np.ndarray], None]] = {
    "one page zeroed": zero_one_page,
    "blocks shifted by one": shift_blocks_by_one,
    "two layers swapped": swap_two_layers,
}


def read_objects(store, keys: Sequence[bytes]) -> dict[bytes, bytes]:
    """Copies of the whole objects stored under ``keys`` (all of them must be there)."""
    leases = store.acquire(keys)
    try:
        assert [lease.key for lease in leases] == list(keys), "not every object is cached"
        return {lease.key: bytes(lease.view) for lease in leases}
    finally:
        store.release(leases)


def stored_objects(store) -> dict[bytes, bytes]:
    """Copies of every object an embedded store holds, flushed to its first lower tier (a disk
    tier, whose files name the keys) first."""
    store.flush()
    return read_objects(store, sorted(bytes.fromhex(path.stem) for path in store.lower[0].path.glob("*.kv")))


def _resealed(obj: bytes, dtype, change: Callable[[np.ndarray], None]) -> bytes:
    """A copy of a raw object with ``change`` done to its payload (viewed as ``dtype``),
    resealed: its checksum is valid again, so only the KV itself is wrong."""
    header = read_header(obj)
    assert header.codec_id == 0, header  # raw KV
    buf = bytearray(obj)
    payload = np.frombuffer(memoryview(buf)[HEADER_SIZE : HEADER_SIZE + header.payload_length], dtype=dtype)
    before = payload.copy()
    change(payload)
    assert not np.array_equal(payload, before), "the damage changed nothing"
    reseal(memoryview(buf), header, header.codec_id)
    return bytes(buf)


def damaged(obj: bytes, damage: Callable[[np.ndarray], None], pages: PageView) -> bytes:
    """A copy of a raw float32 object with ``damage`` done to its pages, resealed."""
    assert read_header(obj).dtype == "float32", read_header(obj)
    return _resealed(obj, np.float32, lambda kv: damage(pages(kv)))


def zeroed(obj: bytes) -> bytes:
    """A copy of a raw object of any dtype (recurrent state included) with its payload zeroed,
    resealed."""
    return _resealed(obj, np.uint8, lambda payload: payload.fill(0))


def replace_objects(store, objects: dict[bytes, bytes]) -> None:
    """Clear the store, then store each object under its key as it is."""
    store.clear()
    reservations = store.reserve([(key, len(obj)) for key, obj in objects.items()])
    assert len(reservations) == len(objects) and None not in reservations, "no room for the objects"
    for reservation, obj in zip(reservations, objects.values()):
        reservation.view[:] = obj
    store.commit(reservations)
