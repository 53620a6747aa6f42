"""Train the tiny Llama that kvtier's CacheBlend tests and benchmark measure quality with.

    python -m kvtier_testing.blend.train_task_model   # writes kvtier_testing/blend/data/task-model

A 4-layer Llama (hidden 64, 2 query heads of 32, 1 KV head, RoPE) trained from scratch on the
registry task of ``kvtier_testing.blend.task``, with a fixed seed, on one CPU thread, in about 8 minutes.
Loss is on the answers and on copy rows (a random sequence of task words repeated: every token of
the repeat is a target): copy rows only for the first ``--copy-steps``, until the model looks
things up in its context, then mixed into every batch. Without them the loss stayed on a plateau
near chance through the 1,000 to 2,000 steps tried. The folder it writes is a normal Hugging Face
model folder (``AutoModelForCausalLM`` and ``AutoTokenizer`` load it offline); the repository ships
the result, so tests and benchmarks never train. With the same seed, torch version and thread
count the weights are bitwise the same; elsewhere the accuracy is the same within noise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

from kvtier_testing.blend import task

DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "task-model"

MODEL_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
}


def build_model(seed: int, **overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{**MODEL_CONFIG, **overrides},
        vocab_size=task.VOCAB_SIZE,
        bos_token_id=task.BOS_ID,
        eos_token_id=task.EOS_ID,
        pad_token_id=task.PAD_ID,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float32)


def batch(rng: random.Random, size: int, questions: int, copies: int):
    """Right-padded token ids and the (row, position) pairs whose next token is a target:
    ``size`` registry prompts with ``questions`` questions each, then ``copies`` copy rows."""
    import torch

    rows = [task.make_training_sequence(rng, rng.randint(2, 8), questions) for _ in range(size)]
    rows += [task.make_copy_sequence(rng) for _ in range(copies)]
    length = max(len(tokens) for tokens, _ in rows)
    ids = torch.full((len(rows), length), task.PAD_ID, dtype=torch.long)
    where = []
    for i, (tokens, positions) in enumerate(rows):
        ids[i, : len(tokens)] = torch.tensor(tokens)
        where += [(i, p) for p in positions]
    rows_idx = torch.tensor([w[0] for w in where])
    pos_idx = torch.tensor([w[1] for w in where])
    return ids, rows_idx, pos_idx


def accuracy(model, examples) -> float:
    """Share of examples whose greedy next token after the prompt is the answer (full recompute,
    one right-padded batch: causal attention never sees the padding)."""
    import torch

    length = max(len(example.tokens) for example in examples)
    ids = torch.full((len(examples), length), task.PAD_ID, dtype=torch.long)
    for i, example in enumerate(examples):
        ids[i, : len(example.tokens)] = torch.tensor(example.tokens)
    last = torch.tensor([len(example.tokens) - 1 for example in examples])
    with torch.inference_mode():
        predicted = model(input_ids=ids).logits[torch.arange(len(examples)), last].argmax(-1)
    answers = torch.tensor([example.answer for example in examples])
    return (predicted == answers).float().mean().item()


def save(model, out: Path, record: dict) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=task.BOS_ID, eos_token_id=task.EOS_ID, pad_token_id=task.PAD_ID, do_sample=False
    )
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(task.VOCAB)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=word_level, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
    ).save_pretrained(out)
    # Older transformers read ``torch_dtype`` and ``rope_theta``; newer ones write ``dtype`` and
    # ``rope_parameters``: keep both, as kvtier_testing.tiny_model does.
    config_file = out / "config.json"
    saved = json.loads(config_file.read_text())
    saved.setdefault("torch_dtype", "float32")
    saved.setdefault("rope_theta", saved.get("rope_parameters", {}).get("rope_theta", 10000.0))
    config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    (out / "training.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def _step(model, optimizer, ids, rows, positions) -> float:
    import torch

    hidden = model.model(input_ids=ids).last_hidden_state[rows, positions]
    loss = torch.nn.functional.cross_entropy(model.lm_head(hidden), ids[rows, positions + 1])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def train(steps: int, batch_size: int, seed: int, threads: int, out: Path, log_every: int = 100,
          lr: float = 2e-3, copy_steps: int = 800, **overrides) -> dict:
    """``copy_steps`` steps of copy rows only (until the model looks things up in its context),
    then ``steps`` steps of registry prompts with copy rows mixed in, cosine-decayed."""
    import torch

    torch.set_num_threads(threads)
    model = build_model(seed, **overrides)
    model.train()
    rng = random.Random(f"kvtier-blend-train-{seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = 50
    total = copy_steps + steps
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * (
            1.0 if s < copy_steps else 0.5 * (1 + math.cos(math.pi * (s - copy_steps) / steps))),
    )
    held_out = task.eval_set(128, offset=10_000)
    start = time.perf_counter()
    for step in range(1, total + 1):
        if step <= copy_steps:
            ids, rows, positions = batch(rng, 0, questions=0, copies=batch_size)
        else:
            ids, rows, positions = batch(rng, batch_size, questions=12, copies=batch_size // 4)
        loss = _step(model, optimizer, ids, rows, positions)
        schedule.step()
        if step % log_every == 0 or step == total:
            model.eval()
            acc = accuracy(model, held_out)
            model.train()
            print(f"step {step:5d}  loss {loss:.4f}  held-out accuracy {acc:.3f}  "
                  f"{time.perf_counter() - start:6.0f} s", flush=True)
    model.eval()
    record = {
        "seed": seed,
        "steps": steps,
        "copy_steps": copy_steps,
        "batch_size": batch_size,
        "threads": threads,
        "train_seconds": round(time.perf_counter() - start, 1),
        "held_out_accuracy": accuracy(model, held_out),
        "torch": torch.__version__,
        "model": {**MODEL_CONFIG, **overrides},
        "lr": lr,
        "task": {"records_per_page": task.RECORDS_PER_PAGE, "max_filler": task.MAX_FILLER, "pages": [2, 8]},
    }
    save(model, out, record)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--copy-steps", type=int, default=800)
    parser.add_argument("--hidden-size", type=int, default=None,
                        help="experiments only: the shipped model uses the default")
    parser.add_argument("--log-every", type=int, default=100)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    overrides = {}
    if args.hidden_size:
        overrides = {"hidden_size": args.hidden_size, "intermediate_size": 2 * args.hidden_size}
    record = train(args.steps, args.batch_size, args.seed, args.threads, args.out, args.log_every, args.lr,
                   args.copy_steps, **overrides)
    print(json.dumps(record, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
