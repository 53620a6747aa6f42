"""vLLM integration: ``KvtierConnector``, kvtier as vLLM's external KV cache.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvtier.url": "tcp://127.0.0.1:5555"}}'

Only what is vLLM's lives here; what any paged engine needs is ``kvtier.paged``. Modules:
``config`` (the ``kvtier.*`` keys), ``common`` (the layout read from vLLM's specs, a request's
scope, the step's metadata), ``scheduler`` (engine-core process: vLLM's hooks into the planner),
``worker`` (worker processes: the loader and saver over vLLM's KV tensors), ``block_records``
(vLLM's block hashes for KV events), ``metrics``, ``keystores`` (the token cache over an
embedded store or a server client), ``connector`` (the class vLLM instantiates). See docs/vllm.md.
"""

__all__ = ["KvtierConnector"]


def __getattr__(name: str):
    # vLLM imports the class by name; importing it (and vLLM) lazily keeps the package's helpers
    # (config parsing, the engine process driver) cheap to import where vLLM is not needed.
    if name == "KvtierConnector":
        from kvtier.integrations.vllm.connector import KvtierConnector

        return KvtierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
