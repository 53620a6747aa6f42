"""Tiny models with random weights and a locally trained tokenizer, for tests and demos: a Llama
by default, or one of ``FAMILIES`` (sliding-window, chunked-local, hybrid GDN/Mamba2, MLA...),
each built from the same recipe so that every KV-cache group kind vLLM builds can be tested.

No model hub is needed: the tokenizer is a byte-level BPE trained with the ``tokenizers`` library
on generated English-like text, and the weights are a seeded random initialisation. The folder is
a normal Hugging Face model folder, loadable offline by ``AutoTokenizer``,
``AutoModelForCausalLM`` and vLLM::

    path = build_tiny_model()             # under kvtier_testing.cache_dir()
    path = build_tiny_model(family="sliding_mixed")
    model = AutoModelForCausalLM.from_pretrained(path)

Building is idempotent: a folder that holds a complete build with the same parameters is reused;
anything else is rebuilt next to it and swapped in atomically.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.layout import KVLayout
from kvtier_testing.cache_dir import cache_dir

#: Folder name of the default build under ``cache_dir()``.
DEFAULT_NAME = "tiny-llama"

#: Bumped when the build recipe changes, so stale folders are rebuilt.
BUILD_VERSION = 1
_MARKER = "kvtier-tiny-model.json"

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)

DEFAULT_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "max_position_embeddings": 16384,
    "vocab_size": 4096,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.05,
    "tie_word_embeddings": False,
}

_ATTENTION = {k: DEFAULT_CONFIG[k] for k in (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "vocab_size", "rms_norm_eps", "initializer_range", "tie_word_embeddings",
)}


@dataclass(frozen=True)
class Family:
    """One model family vLLM caches differently (its KV-cache groups): a transformers config and
    model class, the dtype it runs in on vLLM's CPU build, and a tiny config of that class."""

    name: str
    config_class: str
    model_class: str
    config: dict[str, Any]
    dtype: str = "float32"
    #: What the family is for when vLLM's CPU build cannot serve it as a test engine.
    note: str = ""
    #: vLLM engine arguments the family needs beyond its dtype.
    engine_args: dict[str, Any] = field(default_factory=dict)
    #: Whether vLLM's CPU build answers depending on how many tokens a step holds (MLA: its rotary
    #: op, pinned in tests/test_vllm_families.py): a question prefilled after loaded context is
    #: then not vLLM alone's whole prefill, and vLLM's own connector is the exactness reference.
    step_dependent: bool = False

    @property
    def llm_kwargs(self) -> dict[str, Any]:
        """What to start a vLLM engine on this family's tiny model with."""
        return {"dtype": self.dtype, **self.engine_args}

    @property
    def folder(self) -> str:
        return DEFAULT_NAME if self.name == "llama" else f"tiny-{self.name}"


#: Every family, by name. Each is 4 layers with hidden size 256 so that a prompt of a few
#: thousand tokens prefills in about a second on one CPU core.
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "LlamaConfig", "LlamaForCausalLM", DEFAULT_CONFIG),
    # One SlidingWindowSpec group.
    Family("sliding", "MistralConfig", "MistralForCausalLM",
           {**DEFAULT_CONFIG, "sliding_window": 256}),
    # Sliding-window and full-attention layers: two groups.
    Family("sliding_mixed", "Gemma3TextConfig", "Gemma3ForCausalLM", {
        **DEFAULT_CONFIG, "sliding_window": 256, "query_pre_attn_scalar": 64,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    }),
    # Chunked-local attention on the RoPE layers (no_rope_layers 1), full on the NoPE one:
    # 3 chunked + 1 full. Dense (no MoE layer).
    Family("chunked_local", "Llama4TextConfig", "Llama4ForCausalLM", {
        **_ATTENTION, "intermediate_size": 512, "intermediate_size_mlp": 512,
        "attention_chunk_size": 256, "no_rope_layers": [1, 1, 1, 0],
        "interleave_moe_layer_step": 0, "moe_layers": [], "num_local_experts": 1,
    }),
    # Gated-DeltaNet (linear attention, a Mamba-like state group) alternating with full
    # attention. vLLM's CPU GDN kernels need bfloat16; vLLM's Qwen3-Next needs an MoE layer.
    Family("hybrid_gdn", "Qwen3NextConfig", "Qwen3NextForCausalLM", {
        **_ATTENTION, "intermediate_size": 512,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128, "mlp_only_layers": [],
    }, dtype="bfloat16"),
    # Multi-head latent attention: one MLAAttentionSpec group (latent 512 + rope 64). Dense.
    Family("mla", "DeepseekV2Config", "DeepseekV2ForCausalLM", {
        **_ATTENTION, "intermediate_size": 512, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
        "first_k_dense_replace": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
    }, engine_args={"attention_config": {"backend": "CPU_MLA"}},  # vLLM picks AMX_MLA where the CPU has
    # AMX tiles, and that backend takes only bfloat16 (or quantised) weights: the float32 model runs on
    # the reference backend, which vLLM picks anyway elsewhere
    step_dependent=True),
    # Sliding (window 128) and full layers with a 4-expert, top-2 MoE.
    Family("gpt_oss", "GptOssConfig", "GptOssForCausalLM", {
        **_ATTENTION, "intermediate_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    }),
    # Mamba2 layers (MAMBA2 state group) with attention layers.
    Family("mamba2_hybrid", "NemotronHConfig", "NemotronHForCausalLM", {
        **_ATTENTION, "intermediate_size": 512, "hybrid_override_pattern": "M*M-",
        "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 64, "n_groups": 1,
        "conv_kernel": 4, "chunk_size": 256,
    }, note="vLLM's CPU build runs it only with prefix caching off: for unit-level use"),
)}


def family_spec(name: str) -> Family:
    """The family called ``name``, or a ValueError that lists the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


# -- generated English-like text ---------------------------------------------------------------

_FUNCTION_WORDS = (
    "the of and to a in that is was he for it with as his on be at by i this had not are but "
    "from or have an they which one you were her all she there would their we him been has when "
    "who will more no if out so said what up its about into than them can only other new some "
    "could time these two may then do first any my now such like our over man me even most made "
    "after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while last"
).split()
_ONSETS = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "br", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr", "ch", "sp", ""]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "rk", "ck", "ss"]
_SUFFIXES = ["", "", "", "s", "ed", "ing", "er", "ly", "tion", "ment", "ness", "al"]
_QUESTION_STARTS = ["What", "Why", "How", "Where", "When", "Which", "Who"]


@functools.lru_cache(maxsize=8)
def _lexicon(seed: int, size: int = 2500) -> tuple[list[str], list[float]]:
    """Pseudo-words (function words first) and their cumulative Zipf weights."""
    rng = random.Random(f"kvtier-lexicon-{seed}")
    words = dict.fromkeys(_FUNCTION_WORDS)
    while len(words) < size:
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.choice((1, 1, 2, 2, 3)))
        )
        words.setdefault(word + rng.choice(_SUFFIXES))
    return list(words), list(itertools.accumulate(1.0 / (rank + 1) ** 1.05 for rank in range(len(words))))


def sample_text(n_words: int, seed: int = 0, lexicon_seed: int = 0) -> str:
    """Deterministic English-like prose of about ``n_words`` words (roughly 1.2 tokens a word
    with the tiny model's tokenizer): sentences of Zipf-distributed words, in paragraphs."""
    rng = random.Random(f"kvtier-text-{seed}")
    words, cum_weights = _lexicon(lexicon_seed)
    out: list[str] = []
    count = 0
    sentences_in_paragraph = 0
    while count < n_words:
        length = rng.randint(6, 22)
        sentence = rng.choices(words, cum_weights=cum_weights, k=length)
        sentence[0] = sentence[0].capitalize()
        if length > 10 and rng.random() < 0.4:
            sentence[rng.randint(3, length - 3)] += ","
        out.append(" ".join(sentence) + rng.choice(".....?!"))
        count += length
        sentences_in_paragraph += 1
        if sentences_in_paragraph >= rng.randint(3, 8):
            out.append("\n\n")
            sentences_in_paragraph = 0
        else:
            out.append(" ")
    return "".join(out).strip() + "\n"


def sample_question(seed: int, lexicon_seed: int = 0) -> str:
    """A short deterministic question to append to a document."""
    rng = random.Random(f"kvtier-question-{seed}")
    words, cum_weights = _lexicon(lexicon_seed)
    body = " ".join(rng.choices(words, cum_weights=cum_weights, k=rng.randint(5, 12)))
    return f"\n\nQuestion: {rng.choice(_QUESTION_STARTS)} {body}?\nAnswer:"


# -- building ------------------------------------------------------------------------------------


def _build_tokenizer(vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [sample_text(400, seed=seed * 1000 + i) for i in range(300)]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    for token, expected in zip(SPECIAL_TOKENS, range(4)):
        assert tokenizer.token_to_id(token) == expected, token
    return tokenizer


def _is_complete(path: Path, recipe: dict) -> bool:
    try:
        marker = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    needed = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    has_weights = (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists()
    return marker == recipe and has_weights and all((path / name).exists() for name in needed)


def build_tiny_model(
    path: Path | str | None = None, seed: int = 0, family: str = "llama", **config_overrides: Any
) -> Path:
    """Create (or reuse) a tiny random model folder of ``family`` (a key of ``FAMILIES``) at
    ``path`` (default: ``tiny-<family>`` under ``cache_dir()``) and return its path.

    ``config_overrides`` replace entries of the family's config (hidden_size, num_hidden_layers,
    vocab_size, ...). The same family, ``seed`` and overrides always give the same weights and
    tokenizer.
    """
    spec = family_spec(family)
    path = Path(path) if path is not None else cache_dir(spec.folder)
    config_kwargs = {**spec.config, **config_overrides}
    recipe = {"build_version": BUILD_VERSION, "seed": seed, "family": spec.name, "config": config_kwargs}
    if _is_complete(path, recipe):
        return path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    tmp.chmod(0o755)
    try:
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=_build_tokenizer(config_kwargs["vocab_size"], seed),
            unk_token="<unk>",
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<pad>",
            model_max_length=config_kwargs["max_position_embeddings"],
            clean_up_tokenization_spaces=False,
        )
        tokenizer.save_pretrained(tmp)

        config = getattr(transformers, spec.config_class)(
            **config_kwargs,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            architectures=[spec.model_class],
            dtype=spec.dtype,
        )
        torch_dtype = getattr(torch, spec.dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = getattr(transformers, spec.model_class)(config).to(torch_dtype).eval()
        model.generation_config = GenerationConfig(
            bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
        )
        model.save_pretrained(tmp, safe_serialization=True)

        # Older readers (vLLM among them) look for ``torch_dtype``; newer transformers write ``dtype``.
        config_file = tmp / "config.json"
        saved = json.loads(config_file.read_text())
        saved.setdefault("torch_dtype", spec.dtype)
        saved.setdefault("dtype", spec.dtype)
        config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")

        (tmp / _MARKER).write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
        if path.exists():  # incomplete or stale: replace it
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.replace(path, old / path.name)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, path)
        except OSError:  # another process finished the same build first
            if not _is_complete(path, recipe):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def tiny_layout(config: Any, dtype: str | None = None, arrangement: str = "hf-layer-kv-hnd") -> KVLayout:
    """The KVLayout of a Hugging Face (decoder) config, as transformers' caches hold it."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
        dtype = str(dtype).removeprefix("torch.")
    return KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_size=head_dim,
        dtype=dtype,
        block_size=1,
        arrangement=arrangement,
    )


layout_for_config = tiny_layout
