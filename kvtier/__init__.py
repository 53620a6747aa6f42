"""kvtier: a tiered KV-cache layer for LLM inference engines."""

__version__ = "0.1.0"
