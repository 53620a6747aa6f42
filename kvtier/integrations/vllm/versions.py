"""Every difference between the vLLM releases kvtier supports (0.32, 0.33, 0.34) that kvtier meets,
in one place, detected by feature rather than by version number. Nothing else in kvtier tests
vLLM's version; the compatibility tier (``.ci/vllm-compat``) runs the connector against each
release's own classes.

What the connector itself meets:

- 0.33 adds sleep mode hooks (``unregister_kv_caches`` / ``restore_kv_caches``, and
  ``supports_sleep_mode``, True by default) and 0.34 ``may_load_async``: ``KvtierConnector``
  defines them on every release, where 0.32 never calls them. 0.34's ``kv_cache_access``
  (IN_PROCESS: workers copy pages in their own process) and ``supports_lookahead_block_hashes``
  (False: no EAGLE lookahead hashes) keep their defaults, which are right for kvtier.
- Every other name kvtier imports from vLLM is where it was in 0.32.

What building vLLM's classes without its engine meets (kvtier_testing/vllm_classes.py):

- 0.33 moved the KV-cache planning from ``vllm.v1.core.kv_cache_utils`` to
  ``vllm.v1.core.kv_cache_planning``, whose ``get_kv_cache_configs`` takes the model's groups,
  planned first (``get_global_kv_cache_groups``): ``kv_cache_configs``.
- 0.34's ``ModelRunnerOutput`` no longer takes ``req_id_to_index``: ``model_runner_output``.
- 0.34's scheduler starts the loads of requests ``may_load_async`` names while its batch is full
  (``--max-num-inflight-kv-loads``): ``loads_while_batch_full``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import ModelRunnerOutput


def kv_cache_configs(vllm_config: "VllmConfig", specs: list[dict[str, "KVCacheSpec"]],
                     memory: list[int]) -> list["KVCacheConfig"]:
    """Each worker's ``KVCacheConfig`` from its layers' specs and memory, as vLLM's engine core
    plans them."""
    try:
        from vllm.v1.core import kv_cache_planning
    except ImportError:  # 0.32: one call, in kv_cache_utils
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        return get_kv_cache_configs(vllm_config, specs, memory)
    groups = kv_cache_planning.get_global_kv_cache_groups(vllm_config, specs)
    return kv_cache_planning.get_kv_cache_configs(vllm_config, specs, memory, groups)


def model_runner_output(req_ids: list[str], **fields: Any) -> "ModelRunnerOutput":
    """vLLM's ``ModelRunnerOutput`` of one step for ``req_ids`` (in that order)."""
    from vllm.v1.outputs import ModelRunnerOutput

    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:  # 0.32
        fields["req_id_to_index"] = {req_id: i for i, req_id in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **fields)


def loads_while_batch_full() -> bool:
    """Whether vLLM's scheduler has ``max_num_inflight_kv_loads`` (and asks ``may_load_async``)."""
    from vllm.config import SchedulerConfig

    return "max_num_inflight_kv_loads" in {f.name for f in dataclasses.fields(SchedulerConfig)}
