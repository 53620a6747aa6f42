"""The tiny model of every family (``kvtier_testing.tiny_model.FAMILIES``): each config is valid
for its transformers class and builds a loadable model folder; builds are reused when nothing
changed and redone when the family, seed or config changes. No vLLM here: which families vLLM's
CPU build serves is checked by the families' vLLM tests."""

import json

import pytest

from kvtier_testing.tiny_model import FAMILIES, build_tiny_model, family_spec


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_config_is_valid_and_tiny(name):
    import transformers

    spec = FAMILIES[name]
    config = getattr(transformers, spec.config_class)(**spec.config, architectures=[spec.model_class])
    text = config.get_text_config(decoder=True)
    assert text.num_hidden_layers == 4
    assert text.hidden_size == 256
    assert getattr(transformers, spec.model_class) is not None
    assert spec.folder == ("tiny-llama" if name == "llama" else f"tiny-{name}")


def test_family_configs_have_the_kind_of_layers_they_are_named_for():
    assert FAMILIES["sliding"].config["sliding_window"] == 256
    assert FAMILIES["sliding_mixed"].config["layer_types"].count("full_attention") == 2
    assert FAMILIES["chunked_local"].config["no_rope_layers"] == [1, 1, 1, 0]
    assert FAMILIES["hybrid_gdn"].dtype == "bfloat16"
    assert FAMILIES["mla"].config["kv_lora_rank"] == 512 and FAMILIES["mla"].config["qk_rope_head_dim"] == 64


def test_unknown_family_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model family 'nope'.*sliding_mixed"):
        family_spec("nope")


# Smaller than the real builds, so the test stays fast; the recipe is the same.
_SMALL = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 512}


@pytest.mark.parametrize("name", ["sliding_mixed", "hybrid_gdn", "mla"])
def test_build_is_idempotent_and_loads(tmp_path, name):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    overrides = dict(_SMALL, **({"moe_intermediate_size": 32} if name in ("hybrid_gdn", "mla") else {}))
    path = build_tiny_model(tmp_path / name, family=name, **overrides)
    marker = path / "kvtier-tiny-model.json"
    first = marker.stat().st_mtime_ns
    weights = (path / "model.safetensors").read_bytes()

    assert build_tiny_model(tmp_path / name, family=name, **overrides) == path
    assert marker.stat().st_mtime_ns == first  # reused, not rebuilt

    recipe = json.loads(marker.read_text())
    assert recipe["family"] == name and recipe["config"]["hidden_size"] == 64
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [FAMILIES[name].model_class]
    model = AutoModelForCausalLM.from_pretrained(path)
    assert next(model.parameters()).dtype == getattr(torch, FAMILIES[name].dtype)
    assert AutoTokenizer.from_pretrained(path)("the house")["input_ids"][0] == 1  # <s>

    build_tiny_model(tmp_path / name, family=name, seed=1, **overrides)  # another seed: rebuilt
    assert json.loads(marker.read_text())["seed"] == 1
    assert (path / "model.safetensors").read_bytes() != weights
