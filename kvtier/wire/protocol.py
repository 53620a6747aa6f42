"""The wire protocol between ``kvtier.client`` and ``kvtier server``: every message type, its
fields and the protocol version, in one place.

A message is a ZeroMQ multipart message. Frame 0 is a msgpack-encoded request or reply (tagged by
``op``); object bytes, when they travel by socket rather than shared memory, follow as frames
1..n. Requests carry the protocol version; a server answers a version it does not speak with
``Error(code="version")``. Keys are 32-byte chunk keys (kvtier.keys).

A lookup is one ``Lookup``: the keys of a prompt's chunks and, per chunk, the candidate partial
chunks to try where the walk stops (so a lookup never costs a second round trip). Server-side
counters of every request type (``kvtier_requests_total{op}``) let a test count round trips.

A write may carry, per object, the engine's block record (``kvtier.events.BlockRecord``, encoded;
empty for none): the server keeps it beside the object and publishes vLLM's KV events from it.
A write also names the tenant whose objects it stores (empty: the default tenant), for the tiers'
tenant quotas (kvtier/tiers/tenants.py).

Writes through shared memory are two-phase: ``Reserve`` gives slots in the arena, the client
writes whole sealed objects into them, ``Commit`` makes them visible (or ``Abort`` gives them back).
Slots may be reserved *ahead* (``ahead`` sizes in ``Reserve`` and ``Commit``): unnamed until the
``Commit`` that names the key of the object written into each, so a client that keeps a pool of
them stores with one round trip (fill, then ``Commit``, which refills the pool).
A key that another session is writing gets a slot all the same (by key or ahead): the first
commit stores it and a later one answers ``committed`` (the key is stored), so a writer that
aborts never leaves unstored a key whose bytes another client had.
Reads through shared memory are leases: ``Retrieve`` leases objects and says where they are,
``Release`` gives them back. Any request may carry the handles its client is done with (``done``:
leases to release, slots reserved ahead it will not fill), handled before the request itself, so
a release costs no round trip of its own; ``Release`` alone is for when no request follows soon.
Leases and slots expire after the server's lease timeout (``HelloReply.lease_timeout_s``), so a
client that dies mid-way cannot hold memory for longer.

Every request but ``Hello`` and ``Ping`` names the ``session`` its client's hello opened
(kvtier/server/sessions.py). A hello opens one for a process that proves it may map the arena
(``Hello.token``: the bytes of the token file ``HelloReply.token_path`` names; a first hello
without it learns the path) or for any peer of a CurveZMQ port; otherwise it answers with no
session, and every other request is refused (``unauthorized``). Handles are random and belong to
the session that got them: a handle named by another session is refused (and counted), one the
server no longer knows is ignored. A hello naming its session again keeps it, and its handles,
across a reconnect; a session the server does not know (it restarted, or the session was idle
past its limit) is refused as ``stale-session``: say hello again. A connection holds a few
sessions at most (a new one forgets that connection's oldest), and a server holding its most
answers a hello that would open another with ``busy``: one client never pushes out another's.
A request is judged by its ``Head`` (``op`` and ``session``) before the rest is decoded: one that
needs a session and names none the server knows costs it nothing more; a ``Hello`` or ``Ping`` is
one frame of at most ``MAX_OPEN_REQUEST_BYTES``. A ``Retrieve`` of a session whose earlier replies
its peer has not taken (past the server's limit) is answered ``busy``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

from kvtier.events import MAX_RECORD_BYTES, CacheEvent
from kvtier.schema import TenantName

PROTOCOL_VERSION = 7
#: Shared-memory requests name the arena they mean by this many bytes of its nonce, so a client
#: still mapping the arena of a server that has since restarted is refused ("stale-arena"),
#: never handed offsets into memory that now means something else.
ARENA_ID_SIZE = 8

#: Upper bounds a server enforces on any request, whatever the client says.
MAX_KEYS = 65536
#: The largest object (one chunk of one KV-cache group) a client may store: 256 tokens of a
#: 126-layer model with 8 KV heads of 128 in 16 bits take 126 MiB, a 1024-token chunk 504 MiB.
MAX_OBJECT_BYTES = 1 << 30
#: No frame of a message to the server may be larger (the data port's ``MAXMSGSIZE``: ZeroMQ
#: cuts off a peer that announces more, before it is received): an object, or a request.
MAX_FRAME_BYTES = MAX_OBJECT_BYTES
#: A ``Hello`` or ``Ping`` (the requests that need no session) is one frame of at most this size.
MAX_OPEN_REQUEST_BYTES = 4096
#: Key chains one ``LookupGroups`` may name (one per KV-cache group of a model); together they may
#: carry no more keys and partials than one ``Lookup`` (the front thread answers either in place).
MAX_GROUPS = 256

Keys = Annotated[list[Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]], msgspec.Meta(max_length=MAX_KEYS)]
Ids = Annotated[list[int], msgspec.Meta(max_length=MAX_KEYS)]
#: Token counts and indexes: never negative (a negative index would silently count from the end).
Positions = Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_KEYS)]
Records = Annotated[list[Annotated[bytes, msgspec.Meta(max_length=MAX_RECORD_BYTES)]], msgspec.Meta(max_length=MAX_KEYS)]
Sizes = Annotated[list[Annotated[int, msgspec.Meta(ge=1, le=MAX_OBJECT_BYTES)]], msgspec.Meta(max_length=MAX_KEYS)]


#: A session (sessions.py) and the arena's token (wire/shm.py), as the wire carries them.
Session = Annotated[bytes, msgspec.Meta(max_length=64)]


class _Request(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, frozen=True):
    v: int = PROTOCOL_VERSION
    done: Ids = []  # handles the client is done with: leases released, unfilled slots aborted, first
    session: Session = b""  # from HelloReply; what the ``done`` handles and any handle named must belong to


class Hello(_Request, tag="hello"):
    """First message of a client: learns the server's shared-memory arena, if it can map it, and
    gets its session. ``session``: the client's session so far, kept if the server knows it;
    ``token``: the token file's bytes, to be admitted without one."""

    client: str = ""
    token: Session = b""


class Ping(_Request, tag="ping"):
    pass


class Lookup(_Request, tag="lookup"):
    """The longest cached prefix of ``keys``; where it stops at chunk i, the first cached key of
    ``partials[j]`` for which ``partial_at[j] == i`` (in the order given: longest first).
    ``ends[i]``, if given, is where chunk i ends in the prompt (``partial_ends[j]`` for partial
    j, which starts where chunk i does): the token ranges feed the hit-rate metrics."""

    keys: Keys = []
    ends: Positions = []
    partials: Keys = []
    partial_at: Positions = []
    partial_ends: Positions = []
    pin: bool = False  # also lease the hit's objects the arena holds now, for the load that follows
    arena: bytes = b""  # with pin: the client's arena id (no pin in another arena)


class LookupGroups(_Request, tag="lookup_groups"):
    """A ``Lookup`` of each of several key chains in one round trip: one per KV-cache group of a
    model (their prompt is the same, their keys are not). ``pin`` and ``arena`` hold for every
    chain; a chain's own ``done``, ``session`` and ``pin`` stay unset."""

    chains: Annotated[list[Lookup], msgspec.Meta(max_length=MAX_GROUPS)] = []
    pin: bool = False
    arena: bytes = b""


class Reserve(_Request, tag="reserve"):
    """Slots for whole objects of ``tenant``; ``sizes[i]`` is the size of the object under
    ``keys[i]`` and ``records[i]`` its block record (``records`` empty: none); and slots reserved
    ahead, unnamed (the default tenant's until a commit names their objects), of the ``ahead``
    sizes (as many as there is room for)."""

    keys: Keys = []
    sizes: Sizes = []
    arena: bytes = b""  # the client's arena id (ARENA_ID_SIZE bytes of the hello nonce)
    records: Records = []
    ahead: Sizes = []
    tenant: TenantName = ""


class Commit(_Request, tag="commit"):
    """Make filled slots visible. ``keys[i]`` (all or none) names the object in ``slots[i]``:
    required for a slot reserved ahead, which takes that key now (``records[i]`` its block record);
    a slot reserved by key must be named by its own. ``ahead``: slots to reserve ahead again, in
    the same round trip. A slot whose key is cached already is given back (committed: True).
    ``tenant``: whose objects the slots reserved ahead now hold (a slot reserved by key keeps the
    tenant of its ``Reserve``)."""

    slots: Ids = []  # slot ids from ReserveReply or CommitReply
    keys: Keys = []
    records: Records = []
    ahead: Sizes = []
    arena: bytes = b""  # the arena the slots are in (a restarted server refuses the commit as stale)
    tenant: TenantName = ""


class Abort(_Request, tag="abort"):
    slots: Ids = []


class Put(_Request, tag="put"):
    """Whole objects in frames 1..n, one per key: the path of clients on other hosts.
    ``records`` and ``tenant`` as in ``Reserve``."""

    keys: Keys = []
    records: Records = []
    tenant: TenantName = ""


class Retrieve(_Request, tag="retrieve"):
    """The longest cached prefix of ``keys``; ``inline`` asks for the bytes as frames."""

    keys: Keys = []
    inline: bool = False
    arena: bytes = b""  # required unless inline: offsets are only meaningful in that arena


class Release(_Request, tag="release"):
    """Nothing but its ``done`` handles."""


class Clear(_Request, tag="clear"):
    token: str = ""


class Status(_Request, tag="status"):
    pass


class TakeEvents(_Request, tag="events"):
    """The store's changes since the last ``TakeEvents`` of any client (each event goes to one
    taker; the store keeps a bounded backlog)."""


Request = Union[
    Hello, Ping, Lookup, LookupGroups, Reserve, Commit, Abort, Put, Retrieve, Release, Clear, Status, TakeEvents,
]


class _Reply(msgspec.Struct, tag_field="op", frozen=True):
    pass


class HelloReply(_Reply, tag="hello"):
    version: str
    chunk_size: int
    shm_path: str  # empty when the server has no shared-memory arena
    shm_size: int
    shm_nonce: bytes  # the arena's first bytes: a client that reads them maps the same memory
    arena_offset: int
    lease_timeout_s: float  # a lease or a slot left this long is released or aborted
    session: bytes  # the client's session (the one its hello named, if kept); empty: not admitted
    token_path: str  # the token file whose bytes admit a process that may map the arena


class Pong(_Reply, tag="pong"):
    pass


class LookupReply(_Reply, tag="lookup"):
    """With ``pin``: one ``lease`` (0: none) on the longest prefix of the hit's objects (its
    chunks, then the partial chunk found) that the arena holds, at ``offsets`` with ``sizes``."""

    tiers: list[str]  # the highest tier holding each chunk of the hit prefix
    partial: int = -1  # index into the request's partials of the one found; -1: none
    partial_tier: str = ""
    lease: int = 0
    offsets: list[int] = []
    sizes: list[int] = []


class LookupGroupsReply(_Reply, tag="lookup_groups"):
    """A ``LookupReply`` per chain, in order, each with its own lease."""

    chains: list[LookupReply]


SlotState = Literal["slot", "cached", "full"]


class ReserveReply(_Reply, tag="reserve"):
    """Per key: a slot to fill (``slot`` id, arena ``offset``), ``cached`` already, or ``full``
    (no room; the keys after it are not reserved either). Then the slots reserved ahead: the
    first ``len(ahead_slots)`` of the ``ahead`` sizes asked for."""

    states: list[str]
    slots: list[int]
    offsets: list[int]
    ahead_slots: list[int] = []
    ahead_offsets: list[int] = []


class CommitReply(_Reply, tag="commit"):
    committed: list[bool]
    ahead_slots: list[int] = []  # as in ReserveReply
    ahead_offsets: list[int] = []


class AbortReply(_Reply, tag="abort"):
    pass


class PutReply(_Reply, tag="put"):
    stored: list[bool]


class RetrieveReply(_Reply, tag="retrieve"):
    """One entry per object of the hit prefix: an arena ``offset`` and ``size``, or offset -1
    when the object comes as a frame (inline request, or not in the arena)."""

    lease: int
    offsets: list[int]
    sizes: list[int]


class ReleaseReply(_Reply, tag="release"):
    pass


class ClearReply(_Reply, tag="clear"):
    removed: int


class StatusReply(_Reply, tag="status"):
    status: dict


class EventsReply(_Reply, tag="events"):
    events: list[CacheEvent]


class Error(_Reply, tag="error"):
    code: str  # "bad-request", "version", "stale-arena", "stale-session", "unauthorized", "busy", "internal"
    message: str


Reply = Union[
    HelloReply, Pong, LookupReply, LookupGroupsReply, ReserveReply, CommitReply, AbortReply, PutReply, RetrieveReply,
    ReleaseReply, ClearReply, StatusReply, EventsReply, Error,
]

class Head(msgspec.Struct):
    """What every request starts with: its type and the session it names. Decoding only these
    skips the rest without building it, so a request is judged before it costs memory."""

    op: str = ""
    session: bytes = b""


_encoder = msgspec.msgpack.Encoder()
_head_decoder = msgspec.msgpack.Decoder(Head)
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes | memoryview) -> Request:
    """Raises msgspec.DecodeError/ValidationError for anything that is not a valid request."""
    return _request_decoder.decode(data)


def peek(data: bytes | memoryview) -> Head:
    """The ``Head`` of an encoded request without decoding the rest (empty where it has none):
    lets the server choose where a request is handled, and refuse one without a session, before
    it is validated."""
    try:
        return _head_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Head()


def decode_reply(data: bytes | memoryview) -> Reply:
    return _reply_decoder.decode(data)
