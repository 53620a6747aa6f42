"""``kvtier router``: one OpenAI-compatible front over N vLLM instances; a policy picks the instance.

    instances.py   an instance: its URL, where its KV events and its kvtier server are, its queue
    policies.py    round-robin, least-loaded, prefill/decode (pd), and the policy interface
    cache_aware.py the cache-aware policy: each instance's cached prefix (vLLM's own, from its KV
                   events; kvtier's, from /api/lookup) weighed by load cost and against its queue
    vllm_prefix.py vLLM's block hashes of a prompt, and the index its KV events build
    app.py         forwarding: failover before the first byte, streaming, the HTTP routes
"""
