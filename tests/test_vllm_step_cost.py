"""What the connector does on vLLM's engine thread each step (issue 43), over the real scheduler
and worker halves without an engine (``kvtier_testing.connector_steps``): a step in which no
request of kvtier's loads or saves walks none of the running requests, makes no metadata and
reads no stats; and every figure a step does move still reaches vLLM's stats.
``bench/step_cost.py`` times the same hooks over vLLM's real scheduler."""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from types import SimpleNamespace

import pytest

from kvtier.events import decode_record
from kvtier.integrations.vllm import metrics
from kvtier.integrations.vllm import scheduler as scheduler_module
from kvtier.integrations.vllm.block_records import block_records
from kvtier.integrations.vllm.metrics import GAUGES, Interval
from kvtier.paged.context import WorkerStats
from kvtier.paged.planner import SchedulerStats
from kvtier_testing.connector_steps import BLOCK, CHUNK, Steps


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(n)]


class Untouchable:
    """A field of vLLM's step output that a decode step's hooks must not walk."""

    def __iter__(self):
        raise AssertionError("a step without loads or saves walked every running request")

    __len__ = __getitem__ = __iter__


def _decode_step(steps: Steps, req_ids, walkable: bool = False) -> SimpleNamespace:
    """vLLM's output of a step that gives each request one token (no new request); its list of
    running requests raises when walked unless ``walkable``."""
    scheduled = dict.fromkeys(req_ids, 1)
    cached = (SimpleNamespace(req_ids=list(req_ids), num_computed_tokens=[steps.running[r].num_computed_tokens for r in req_ids])
              if walkable else SimpleNamespace(req_ids=Untouchable(), num_computed_tokens=Untouchable()))
    return SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens=scheduled, total_num_scheduled_tokens=len(scheduled),
                           scheduled_cached_reqs=cached)


@pytest.fixture
def steps():
    s = Steps(num_blocks=256)
    yield s
    s.close()


def _prefilled(steps: Steps, count: int) -> list[str]:
    """``count`` requests admitted and their prompts computed in one step (saved), left running."""
    ids = [f"r{i}" for i in range(count)]
    for i, req_id in enumerate(ids):
        steps.admit(req_id, _tokens(i, CHUNK + 8))
    scheduled = {r: steps.running[r].num_tokens for r in ids}
    new = [SimpleNamespace(req_id=r, num_computed_tokens=0) for r in ids]
    output = SimpleNamespace(scheduled_new_reqs=new, num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                             scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]))
    meta = steps.scheduler.build_connector_meta(output)
    assert len(meta.saves) == count
    steps.worker.wait_for_save(meta)
    for req_id in ids:
        steps.running[req_id].num_computed_tokens = steps.running[req_id].num_tokens
    return ids


def test_a_decode_step_walks_no_running_request_and_makes_no_metadata(steps):
    ids = _prefilled(steps, 24)
    first = steps.scheduler.build_connector_meta(_decode_step(steps, ids))
    second = steps.scheduler.build_connector_meta(_decode_step(steps, ids))
    assert not (first.loads or first.saves or first.probes or first.timed_step or first.idle)
    assert first is second, "each step without loads or saves made metadata of its own"


def test_a_step_that_moves_no_figure_reads_no_stats(steps, monkeypatch):
    ids = _prefilled(steps, 4)
    assert steps.worker._saver.wait_idle(10)
    steps.scheduler.update_connector_output(steps.worker.build_connector_worker_meta())
    assert steps.scheduler.get_kv_connector_stats() is not None and steps.worker.get_kv_connector_stats() is not None

    def refuse(self):
        raise AssertionError("a step that moved no figure read the stats")

    monkeypatch.setattr(Interval, "take", refuse)
    steps.scheduler.build_connector_meta(_decode_step(steps, ids, walkable=True))
    assert steps.worker.build_connector_worker_meta() is None
    assert steps.scheduler.get_kv_connector_stats() is None
    assert steps.worker.get_kv_connector_stats() is None


def test_a_busy_step_sends_what_it_moved_without_copying_every_total(steps, monkeypatch):
    """A step that saves and looks up sends its figures built from the fields that moved: no
    copy of every running total, renamed, a step (what ``figures`` gives a reader)."""
    def refuse(*args):
        raise AssertionError("a step's stats copied every running total")

    for owner, name in ((SchedulerStats, "as_dict"), (WorkerStats, "snapshot"), (metrics, "totals")):
        monkeypatch.setattr(owner, name, refuse)
    _prefilled(steps, 2)
    assert steps.worker._saver.wait_idle(10)
    scheduler, worker = steps.scheduler.get_kv_connector_stats(), steps.worker.get_kv_connector_stats()
    assert scheduler.data["lookups"] == 2 and worker.data["saves"] == 2 and set(worker.data["group_save_bytes"]) == {"0"}


def test_a_saves_block_records_are_made_on_the_saver_thread_and_kept_with_its_objects(steps, monkeypatch):
    """The records KV events publish are made where the saver stores the objects, not on the
    engine's thread that plans the save (in one process: the embedded store, or vLLM's TP 1)."""
    made_on = []

    def recording(*args):
        made_on.append(threading.current_thread().name)
        return block_records(*args)

    monkeypatch.setattr(scheduler_module, "block_records", recording)
    tokens = _tokens(7, 2 * CHUNK)
    steps.admit("r", tokens, block_hashes=[i.to_bytes(32, "big") for i in range(1, len(tokens) // BLOCK + 1)])
    steps.step()
    assert steps.worker._saver.wait_idle(10)
    assert made_on and set(made_on) == {"kvtier-saver"}
    stored = sorted((decode_record(data) for _, data in steps.store.l1.records()), key=lambda r: r.parent_block_hash or 0)
    assert [r.token_ids for r in stored] == [tokens[:CHUNK], tokens[CHUNK:]]


def test_every_figure_a_step_moves_reaches_vllms_stats(steps):
    """Figures summed over every step's stats equal the running totals: loads, saves, lookups,
    misses and history, taken after each hook vLLM calls them after."""
    sent: Counter = Counter()

    def take() -> None:
        for side in (steps.scheduler, steps.worker):
            stats = side.get_kv_connector_stats()
            for name, value in (stats.data if stats is not None else {}).items():
                if name in GAUGES:
                    continue
                if isinstance(value, dict):
                    sent.update({(name, label): amount for label, amount in value.items()})
                else:
                    sent[name] += value

    doc = _tokens(100, 2 * CHUNK)
    for i in range(4):
        steps.admit(f"a{i}", doc + _tokens(200 + i, CHUNK + 8))
        take()
        while steps.running:
            steps.step()
            take()
        assert steps.worker._saver.wait_idle(10)
        steps.scheduler.update_connector_output(steps.worker.build_connector_worker_meta())  # the saves' report
        take()
    expected: Counter = Counter()
    for side in (steps.scheduler, steps.worker):
        for name, value in side.figures().items():
            if name in GAUGES or name == "load_costs" or value is None:
                continue
            if isinstance(value, dict):
                expected.update({(name, label): amount for label, amount in value.items()})
            else:
                expected[name] += value
    expected = Counter({k: v for k, v in expected.items() if v})
    assert expected["lookups"] == 4 and expected["saves"] >= 4 and expected["loaded_tokens"] > 0
    assert {k: pytest.approx(v) for k, v in expected.items()} == {k: v for k, v in sent.items() if v}


def test_no_load_cost_fit_runs_on_the_engines_thread(monkeypatch):
    """The load-or-recompute fits (kvtier/paged/load_costs.py) are fed and refitted on a thread
    of their own: a lookup reads the last estimates, it never refits (0.5-1.7 ms on the lookup of
    one hit in three, bench/step_cost.py), and a report never adds a sample on the engine's thread."""
    import threading

    from kvtier.paged.load_costs import REFIT_SAMPLES, RobustFit

    fitted_in, added_in = [], []
    real_fit, real_add = RobustFit._robust_fit, RobustFit.add
    monkeypatch.setattr(RobustFit, "_robust_fit", lambda fit: fitted_in.append(threading.current_thread()) or real_fit(fit))
    monkeypatch.setattr(RobustFit, "add", lambda fit, *a: added_in.append(threading.current_thread()) or real_add(fit, *a))
    steps = Steps(num_blocks=512, **{"kvtier.load_or_recompute": True})
    try:
        for i in range(2 * REFIT_SAMPLES):  # each round a prefill step (timed) and a hit (a load's sample)
            doc = _tokens(300 + i, 4 * CHUNK)
            steps.admit(f"fill{i}", doc)
            steps.run()
            steps.admit(f"hit{i}", doc + _tokens(400 + i, 8))  # loaded until the estimates say computing is faster
            steps.run()
        assert threading.main_thread() not in added_in + fitted_in, "a fit ran on the engine's thread"
        assert steps.scheduler.costs.flush()
        figures = steps.scheduler.figures()["load_costs"]
    finally:
        steps.close()
    assert len(added_in) >= 2 * REFIT_SAMPLES and fitted_in and threading.main_thread() not in added_in + fitted_in
    assert figures["prefill"] is not None and figures["tiers"], figures


@pytest.mark.parametrize("as_ints, hash_bytes", [(False, 32), (True, 32), (True, 8), (True, 12)])
def test_block_records_carry_vllms_hashes_as_its_setting_converts_them(monkeypatch, as_ints, hash_bytes):
    """The records of a save read vLLM's hash setting once a call, not once a block (each read
    looks into the environment), and still give the hashes vLLM's own events give, whatever
    the hashes' length (vLLM's hash functions give 32 or 8 bytes; 12: the fallback)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvtier.events import decode_record
    from kvtier.integrations.vllm.block_records import block_records
    from kvtier.keys import ChunkSpan

    import vllm.envs

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if as_ints else "0")
    reads = Counter()
    read_setting = vllm.envs.__getattr__

    def counted(name):
        reads[name] += 1
        return read_setting(name)

    monkeypatch.setattr(vllm.envs, "__getattr__", counted)
    rng = random.Random(hash_bytes)
    hashes = [rng.randbytes(hash_bytes) for _ in range(40)]
    request = SimpleNamespace(block_hashes=hashes, mm_features=[], lora_request=None, cache_salt=None, prompt_embeds=None)
    tokens = _tokens(7, 40 * 4)
    spans = [ChunkSpan(b"k1", 0, 16), ChunkSpan(b"k2", 16, 32)]
    records = {span: decode_record(data) for span, data in block_records(request, tokens, spans, 4, "m", 0).items()}
    assert reads["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] == 1
    assert records[(16, 32)].block_hashes == [maybe_convert_block_hash(h) for h in hashes[4:8]]
    assert records[(16, 32)].parent_block_hash == maybe_convert_block_hash(hashes[3])
    assert records[(0, 16)].parent_block_hash is None and records[(0, 16)].token_ids == tokens[:16]
    late = decode_record(block_records(request, tokens, [ChunkSpan(b"k3", 32, 48)], 4, "m", 0)[(32, 48)])
    assert late.block_hashes == [maybe_convert_block_hash(h) for h in hashes[8:12]]
    assert late.parent_block_hash == maybe_convert_block_hash(hashes[7])
    wide = decode_record(block_records(request, tokens, [ChunkSpan(b"k4", 32, 160)], 4, "m", 0)[(32, 160)])  # 33 at once
    assert wide.block_hashes == [maybe_convert_block_hash(h) for h in hashes[8:40]]
    assert wide.parent_block_hash == maybe_convert_block_hash(hashes[7])
    assert all(isinstance(h, int) == as_ints for r in records.values() for h in r.block_hashes)


@pytest.mark.parametrize("kind", ["plain", "salted", "lora", "multimodal"])
def test_block_records_ask_vllm_for_a_text_requests_extra_keys_once(monkeypatch, kind):
    """vLLM's extra keys of a text-only request's blocks are the request's own (its LoRA; the salt
    is left out): asked once a save plan, not once a block, and the same as asked block by block.
    A multimodal request's differ from block to block: asked for each."""
    from vllm.lora.request import LoRARequest
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    import kvtier.integrations.vllm.block_records as module
    from kvtier.events import decode_record
    from kvtier.keys import ChunkSpan

    asked = []
    monkeypatch.setattr(module, "generate_block_hash_extra_keys",
                        lambda *args: asked.append(args[1]) or generate_block_hash_extra_keys(*args))
    image = SimpleNamespace(identifier="img", mm_position=SimpleNamespace(offset=20, length=8))
    request = SimpleNamespace(block_hashes=[bytes([i]) * 32 for i in range(1, 9)], prompt_embeds=None,
                              mm_features=[image] if kind == "multimodal" else [],
                              lora_request=LoRARequest("adapter", 3, "/adapters/a") if kind == "lora" else None,
                              cache_salt="tenant-a" if kind == "salted" else None)
    spans = [ChunkSpan(b"k1", 0, 16), ChunkSpan(b"k2", 16, 32)]
    records = {span: decode_record(data) for span, data in
               module.block_records(request, _tokens(3, 32), spans, 4, "m", 0).items()}
    assert len(asked) == (8 if kind == "multimodal" else 1)
    for (start, end), record in records.items():
        one_by_one = [module._without_salt(generate_block_hash_extra_keys(request, b * 4, b * 4 + 4, 0)[0])
                      for b in range(start // 4, end // 4)]
        assert record.extra_keys == json.loads(json.dumps(to_event_extra_keys(one_by_one)))  # msgpack: lists
    assert (records[(16, 32)].extra_keys[1] is not None) == (kind in ("lora", "multimodal"))
