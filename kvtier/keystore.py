"""The key-store protocol: what every store of whole KV objects under chunk keys offers, whether
it lives in this process (``TieredStore``) or behind a socket (``KvtierClient``).

Its methods name the two-phase life of data, so that no caller can forget a phase:

    find      locate(spans, partials)           the longest cached prefix of a key chain
              locate_groups(chains)             of several chains (a model's groups), in one call
    read      acquire(keys) ... release(leases) objects held while the caller reads them
    write     reserve(items) ... commit(slots)  a slot per object, filled by the caller, then
              (or abort(slots))                 made visible; an aborted slot was never seen
    watch     take_events()                     what changed since the last call

``kvtier.cache.TokenCache`` is written once over this protocol: it turns tokens into keys and
back, and fills and seals objects. A key store never sees a token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import msgspec

from kvtier.events import CacheEvent
from kvtier.keys import ChunkSpan


class Reservation(msgspec.Struct, frozen=True):
    """A writable slot for one whole object (``view`` is exactly its size), invisible to readers
    until committed. A struct, not a dataclass: a store makes one per page, ten times faster."""

    key: bytes
    view: memoryview
    offset: int = -1  # where the slot starts in the store's (shared) arena
    slot: int = 0  # the store's handle for it (a server's slot id)
    checksum: bool = False  # seal the object with its checksum: its bytes will cross a socket
    record: bytes = b""  # the block record to send with the object (a client's frames path)
    tenant: str = ""  # whose object it is, to send with it (a client's frames path)
    arena: bytes = b""  # the id of the server's arena the slot is in (its commit names it)


@dataclass(frozen=True)
class Lease:
    """A read-only view of one whole object, held in the store's arena until released.
    ``in_arena=False``: a private copy (nothing to release)."""

    key: bytes
    view: memoryview
    offset: int = -1  # where the object starts in the store's (shared) arena; -1 for a copy
    in_arena: bool = True
    lease: int = 0  # the store's handle for it (a server's lease id)
    checked: bool = True  # False: the bytes crossed a socket and their checksum is still to verify


@dataclass(frozen=True)
class Pin:
    """The objects a lookup leased where they lie (a server's shared arena) for the load that
    follows it, which then needs no call of its own: the store's lease handle, the arena's id,
    and each object's key -> (offset, size). Plain data: it travels in an engine's step metadata
    to another thread or process of the same host, which gives the lease back on behalf of the
    session that holds it (a server refuses a handle named by another session). Good for half the
    store's lease timeout."""

    lease: int
    arena: bytes
    objects: dict[bytes, tuple[int, int]]
    leased_at: float  # time.monotonic() (system-wide on Linux: the same clock in every process)
    session: bytes = b""  # the server session that holds the lease


@dataclass(frozen=True)
class Located:
    """Where the longest cached prefix of a key chain is: the tier holding each of its keys,
    highest first; and where the walk stopped, which candidate partial chunk was found, if any."""

    tiers: list[str] = field(default_factory=list)
    partial: int = -1  # index into the candidates for the chunk the walk stopped at; -1: none
    partial_tier: str = ""
    pin: Pin | None = None  # ``locate(..., pin=True)`` of a store in another process: the objects leased


class KeyStore(Protocol):
    """A store of whole KV objects under chunk keys (see the module docstring)."""

    @property
    def chunk_size(self) -> int | None:
        """Tokens per chunk the store was made for; None while a remote store is not reached."""

    @property
    def reachable(self) -> bool:
        """False while a remote store is known to be down (calls are instant misses then)."""

    def ping(self) -> bool:
        """Whether the store answers; a remote store connects and learns its chunk size."""

    def locate(self, spans: Sequence[ChunkSpan], partials: Sequence[Sequence[ChunkSpan]] = (), pin: bool = False) -> Located:
        """The tiers of the longest contiguous cached prefix of the chunks ``spans`` (their keys;
        their token ranges only feed hit-rate metrics); then, where it stops at chunk i, the
        first of ``partials[i]`` (shorter prefixes of chunk i, longest first) that is cached.
        ``pin``: a store in another process may also lease the objects of the hit it holds in
        shared memory (``Located.pin``); hand the pin to ``pinned`` or ``unpin``."""

    def locate_groups(self, chains: Sequence[tuple[Sequence[ChunkSpan], Sequence[Sequence[ChunkSpan]]]],
                      pin: bool = False) -> list[Located]:
        """``locate`` of each (spans, partials) chain (one per KV-cache group of a model), in one
        round trip to a server."""

    def acquire(self, keys: Sequence[bytes], checksum: bool = False) -> list[Lease]:
        """Leases on the objects of the longest contiguous cached prefix of ``keys``; with
        ``checksum``, every object carries its checksum (it is about to leave memory)."""

    def release(self, leases: Sequence[Lease]) -> None: ...

    def pinned(self, pin: Pin, keys: Sequence[bytes]) -> list[Lease] | None:
        """Leases on ``keys`` from a lookup's ``pin`` (``release`` gives them back), or None
        where the pin cannot serve them here (another arena, too old, a key it lacks): then
        ``unpin`` it and ``acquire``."""

    def unpin(self, pin: Pin) -> None:
        """Give back a pin no load used."""

    def reserve(
        self, items: Sequence[tuple[bytes, int]], records: Sequence[bytes] = (), tenant: str = ""
    ) -> list[Reservation | None]:
        """A slot for each (key, object size), in order: None where the key is cached already.
        The list ends early at the first key there is no room for (the rest would be
        unreachable without it). ``records[i]``, if given, is the engine's block record of
        object i (kvtier.events.BlockRecord, encoded), kept beside it; ``tenant`` owns the
        objects (tiers/tenants.py; empty: the default tenant)."""

    def lend(
        self, items: Sequence[tuple[bytes, int]], records: Sequence[bytes] = (), tenant: str = ""
    ) -> list[Reservation] | None:
        """A slot for every item at once, taken without waiting for anything (no round trip, no
        lock another thread holds), or None where the store cannot. The caller fills, seals and
        commits (or aborts) them as ``reserve``'s; whether a key is cached already shows at commit."""

    def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        """Make filled, sealed slots visible; True for each that now is."""

    def commit_filling(self, reservations: Sequence[Reservation], fill: Callable[[int, int], None]) -> list[bool]:
        """``commit`` of slots ``lend`` gave, which ``fill(a, b)`` fills and seals part by part
        (``reservations[a:b]``): a store behind a socket commits one part while the next is
        filled. A part the store could not commit anyway may be left unfilled (not stored)."""

    def abort(self, reservations: Sequence[Reservation]) -> None: ...

    def take_events(self) -> list[CacheEvent]:
        """The changes since the last call (and forget them)."""
