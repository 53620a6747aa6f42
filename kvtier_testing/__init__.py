"""kvtier's harness: what tests, benchmarks and demos use to run kvtier, never kvtier itself.

Shipped in the same distribution as ``kvtier`` so that the demos run from a wheel install, but no
module under ``kvtier/`` imports from it. It holds the tiny random model builder, vLLM engines and
servers as child processes, real Redis/S3/kvtier servers for integration tests, the deterministic
KV workload, damaged KV for negative controls, the blend task model, benchmark timing and plots,
and the demos. Whatever it writes (models, compile caches, bench work folders) goes under
``cache_dir()``.
"""

from kvtier_testing.cache_dir import cache_dir

__all__ = ["cache_dir"]
