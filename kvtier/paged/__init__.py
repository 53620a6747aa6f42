"""The scheduler side of kvtier over vLLM's paged KV cache, apart from vLLM itself."""
