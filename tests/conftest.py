"""Shared pytest fixtures."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# -- the tiny random Llama model (kvtier.tiny_model) ----------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """A tiny Llama model folder, built once (about 5 s) and reused across sessions; set
    KVTIER_TINY_MODEL to put it elsewhere than the repository's .cache/tiny-llama."""
    from kvtier.tiny_model import DEFAULT_PATH, build_tiny_model

    return build_tiny_model(Path(os.environ.get("KVTIER_TINY_MODEL", DEFAULT_PATH)))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_path):
    """The tiny model loaded with transformers, float32, eval mode (shared: do not modify)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
