"""Prefill/decode disaggregation: a prefill pool writes prompt KV to kvtier, a decode pool reads it."""
