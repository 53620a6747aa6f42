"""The lookup of a prompt (kvtier.paged.lookups) over a fake key store: no engine, no server. The
keys are hashed once per request, the hit is the longest prefix every TP rank holds, and the
pins of a round the ranks disagreed on go back before the next round."""

from __future__ import annotations

from types import SimpleNamespace

from kvtier.cache import TokenCache
from kvtier.keystore import Located
from kvtier.layout import KVLayout
from kvtier.paged.groups import FullAttention
from kvtier.paged.layout import EngineLayout, GroupLayout
from kvtier.paged.lookups import PromptLookup
from kvtier.paged.namespaces import RequestScope
from kvtier.paged.planner import RequestState

BLOCK, CHUNK = 16, 64


def _engine(tp_size: int, groups: int = 1) -> EngineLayout:
    layouts = [KVLayout(2, 2, 32, "float32", block_size=BLOCK, tp_size=tp_size, group=f"kv{g}" if g else "kv",
                        arrangement="test-lookups") for g in range(groups)]  # each group's keys its own
    return EngineLayout("tiny", "", tuple(GroupLayout(g, FullAttention(), (f"layer{2 * g}", f"layer{2 * g + 1}"),
                                                      (BLOCK * layout.bytes_per_token // 2,), layout)
                                          for g, layout in enumerate(layouts)), BLOCK, tp_size, "test-lookups")


class FakeKeyStore:
    """Holds a set of keys, all in "memory"; each locate pins what it found; unpins recorded."""

    chunk_size = CHUNK

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.pins = 0
        self.calls = 0  # locate_groups: round trips, were it a server
        self.unpinned: list[str] = []

    def locate(self, spans, partials=(), pin=False) -> Located:
        found = 0
        while found < len(spans) and spans[found].key in self.keys:
            found += 1
        self.pins += 1
        return Located(["memory"] * found, pin=f"pin{self.pins}" if pin and found else None)

    def locate_groups(self, chains, pin=False) -> list[Located]:
        self.calls += 1
        return [self.locate(spans, partials, pin) for spans, partials in chains]

    def unpin(self, pin) -> None:
        self.unpinned.append(pin)


def _state(prompt: int) -> RequestState:
    return RequestState(RequestScope(), SimpleNamespace(request_id="r", prompt_token_ids=list(range(prompt))))


def test_a_prompts_keys_are_hashed_once_per_request():
    lookup = PromptLookup(_engine(1), TokenCache(FakeKeyStore()))
    state = _state(3 * CHUNK)
    keys = lookup.keys(state, CHUNK)
    assert lookup.keys(state, CHUNK) is keys and state.keys is keys
    assert [s.end for s in keys[0][0].spans] == [CHUNK, 2 * CHUNK, 3 * CHUNK]
    assert lookup.chunk_keys(state.scope, state.tokens, CHUNK)[0][0].spans == keys[0][0].spans


def test_the_hit_is_the_longest_prefix_every_rank_holds_and_a_voided_rounds_pins_go_back():
    store = FakeKeyStore()
    lookup = PromptLookup(_engine(2), TokenCache(store))
    state = _state(3 * CHUNK + 5)
    keys = lookup.keys(state, CHUNK)
    assert keys[0][0].spans[0].key != keys[1][0].spans[0].key  # each rank's keys are its own
    store.keys = {s.key for s in keys[0][0].spans[:2]} | {keys[1][0].spans[0].key}
    found = lookup.find(state, CHUNK)
    assert (found.chunk, found.hit, found.tiers[0]) == (CHUNK, CHUNK, "memory")  # tiers: rank 0's, from token 0
    assert [[[s.end for s in spans] for spans in rank] for rank in found.spans] == [[[CHUNK]], [[CHUNK]]]
    assert store.unpinned == ["pin1", "pin2"]  # the first round: rank 0 held more than rank 1
    assert found.pins == [["pin3"], ["pin4"]]
    lookup.unpin(found.pins)
    assert store.unpinned == ["pin1", "pin2", "pin3", "pin4"]


def test_nothing_held_is_no_hit():
    found = PromptLookup(_engine(1), TokenCache(FakeKeyStore())).find(_state(2 * CHUNK), CHUNK)
    assert (found.hit, found.tiers, found.pins) == (0, [], [[None]])


def test_a_lookup_of_a_model_with_several_groups_is_one_call_per_rank():
    """Every group's chain in one ``locate_groups`` (one round trip to a server), not a locate
    per group; the hit is where every group's chain holds."""
    store = FakeKeyStore()
    lookup = PromptLookup(_engine(2, groups=3), TokenCache(store))
    state = _state(3 * CHUNK)
    keys = lookup.keys(state, CHUNK)
    assert len({rank[g].spans[0].key for rank in keys for g in range(3)}) == 6
    store.keys = {s.key for rank in keys for g, group in enumerate(rank) for s in group.spans[: 3 - g]}
    found = lookup.find(state, CHUNK)
    assert store.calls == 2, "one call per TP rank"
    assert found.hit == CHUNK and [[len(spans) for spans in rank] for rank in found.spans] == [[1, 1, 1], [1, 1, 1]]


def test_a_lookup_hashes_the_partial_chunks_of_the_chunk_its_walk_stops_at_only(monkeypatch):
    """Over a real embedded store holding the prompt's first three chunks: the walk stops at the
    fourth, whose partial chunks are the only ones hashed (each a pass of the chunk's tokens at a
    microsecond a block boundary: all of a 4096-token prompt's were about a third of its lookup), also
    when a save in flight makes the planner ask whether it covers the next chunk."""
    import kvtier.keys as keys_module
    from kvtier.paged.planner import SavesInFlight
    from kvtier.store import TieredStore
    from kvtier.tiers.memory import MemoryTier

    hashed = []  # chunks whose partial chunks were hashed, by where they start
    chain = keys_module.chain_keys
    monkeypatch.setattr(keys_module, "chain_keys",
                        lambda previous, chunk, ends=(): (ends and hashed.append(ends)) or chain(previous, chunk, ends))
    engine = _engine(1)
    cache = TokenCache(TieredStore(MemoryTier(64 << 20), chunk_size=CHUNK))
    lookup = PromptLookup(engine, cache)
    state = _state(16 * CHUNK + BLOCK)
    keys = lookup.keys(state, CHUNK)[0][0]
    namespace = lookup.namespaces.get(0, state.scope)[0]

    def zeros(span, dest: memoryview) -> None:
        dest[:] = bytes(len(dest))

    assert cache.store_spans(namespace, keys.spans[:3], zeros) == 3
    found = lookup.find(state, CHUNK)
    assert found.hit == 3 * CHUNK
    saves = SavesInFlight(hold_s=60, tp_size=1)
    saves.start(1, [keys.partials[3][0].key])
    assert saves.covers(keys, found.hit, CHUNK)
    assert hashed == [range(BLOCK, CHUNK, BLOCK)], "the fourth chunk's partials only, once"
    lookup.unpin(found.pins)
