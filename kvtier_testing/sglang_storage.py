"""SGLang's storage layer on this CPU-only machine, for the conformance suite and the benchmark:
SGLang's real host pools (MHA and MLA, page-first and layer-first), its storage config, its
``HiCacheFile`` reference and the storage backends under test, built the same way for each.

Runs in the side venv (``make sglang-venv``: ``sglang`` installed without its CUDA dependencies).
SGLang's import pulls in torchvision, whose PyPI wheel is a CUDA build: beside the CPU torch its
kernels do not load, and its fake-kernel registration of ``torchvision::nms``/``qnms`` then fails
for want of the operators. ``import_sglang`` declares those two operators (schemas only, never
called) before the first import; on a host with a matching torchvision it changes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

_TORCHVISION_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None


def import_sglang() -> None:
    """Make SGLang's storage modules importable here (see the module docstring)."""
    global _library
    if _library is not None:
        return
    try:
        import torchvision  # noqa: F401  (a working torchvision: nothing to do)

        _library = False
        return
    except RuntimeError:
        pass
    import sys

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    _library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _TORCHVISION_OPS:
        _library.define(schema)


@dataclass(frozen=True)
class PoolSpec:
    """One host pool geometry: MHA or MLA KV, or Mamba state (``heads`` x ``head_dim`` float32 per
    layer, beside a small conv state of ``dtype``); SGLang's host ``layout``."""

    kind: str = "mha"  # "mha", "mla" or "mamba"
    layout: str = "page_first"
    page_size: int = 16
    layers: int = 4
    heads: int = 2
    head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    tokens: int = 1024  # device pool size; the host pool holds twice as many

    @property
    def mla(self) -> bool:
        return self.kind == "mla"


def host_pool(spec: PoolSpec):
    """SGLang's own host pool for ``spec``, over a CPU device pool of the same geometry."""
    import_sglang()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    if spec.kind == "mamba":  # one state per slot: SGLang's Mamba pool has pages of one slot
        from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
        from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

        slots = spec.tokens // spec.page_size
        info = MambaStateBufferInfo(temporal=torch.zeros(spec.layers, slots + 1, spec.heads, spec.head_dim),
                                    conv=(torch.zeros(spec.layers, slots + 1, 8, 3, dtype=spec.dtype),))
        return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, layout=spec.layout)
    common = dict(pin_memory=False, device="cpu", start_layer=0, end_layer=spec.layers)
    if spec.mla:  # kv_lora_rank 4 * head_dim / 8... any split: the host pool keeps their sum per token
        device = MLATokenToKVPool(spec.tokens, spec.page_size, spec.dtype, spec.head_dim, spec.head_dim // 4,
                                  spec.layers, "cpu", False, start_layer=0, end_layer=spec.layers)
        return MLATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, spec.page_size,
                                    spec.layout, device_capacity_tokens=device.size,
                                    target_layer_num=spec.layers, **common)
    device = MHATokenToKVPool(spec.tokens, spec.page_size, spec.dtype, spec.heads, spec.head_dim, spec.layers,
                              "cpu", False, start_layer=0, end_layer=spec.layers)
    return MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, spec.page_size,
                                spec.layout, device_capacity_tokens=device.size, **common)


def storage_config(extra: dict, *, model: str = "tiny-model", tp_rank: int = 0, tp_size: int = 1,
                   mla: bool = False, page_first: bool = True):
    import_sglang()
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=page_first, model_name=model, extra_config=dict(extra))


KVTIER_BACKEND = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang.storage",
                  "class_name": "KvtierStorage"}


def kvtier_extra(url: str | None = None, **keys) -> dict:
    """SGLang's extra config for the kvtier backend: through ``url``'s server, else embedded."""
    extra = dict(KVTIER_BACKEND)
    if url is not None:
        extra["kvtier.url"] = url
    extra.update({f"kvtier.{k}": v for k, v in keys.items()})
    return extra


def make_backend(name: str, extra: dict, **config):
    """A backend as SGLang's factory makes it: ``file`` (HiCacheFile) or ``dynamic`` (kvtier)."""
    import_sglang()
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return StorageBackendFactory.create_backend(name, storage_config(extra, **config), None)


def file_extra(path: Path) -> dict:
    return {"file_storage_path": str(path)}


def l2_disk(path: Path, gb: float = 1.0) -> str:
    return json.dumps({"type": "fs", "base_path": str(path), "max_capacity_gb": gb})
