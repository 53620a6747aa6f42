"""Task accuracy of full recompute, naive reuse and CacheBlend on the trained task model.

For every held-out example of ``kvtier_testing.blend.task``: the pages are prefilled once through a
``BlendedModel`` (which stores each page's KV made alone at positions 0..n-1), then the same
prompt is answered by the model's own forward (full recompute) and by blended prefills that
reuse the cached pages at each recompute ratio (0 = naive reuse). An answer is right when the
greedy next token is the answer's colour.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch

from kvtier.blend.model import BlendConfig, BlendedModel
from kvtier.store import TieredStore
from kvtier.tiers.memory import MemoryTier
from kvtier_testing.blend import task

#: The shipped weights (``python -m kvtier_testing.blend.train_task_model`` rebuilds them).
TASK_MODEL_PATH = Path(__file__).resolve().parent / "data" / "task-model"


def load_task_model(path: Path | str | None = None) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    path = Path(path) if path is not None else TASK_MODEL_PATH
    if not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"no task model at {path}: run python -m kvtier_testing.blend.train_task_model")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def evaluate(
    model: Any,
    size: int = 400,
    ratios: Sequence[float] = (0.0, 0.05, 0.15, 0.30),
    config: BlendConfig | None = None,
    by_kind: bool = False,
) -> dict:
    """Accuracy per method: ``"full"`` and one entry per ratio (blended with ``config``, whose
    ratio each entry overrides). With ``by_kind``, also ``"<method>/split"`` and
    ``"<method>/within"``."""
    examples = task.eval_set(size)
    store = TieredStore(MemoryTier(64 << 20), chunk_size=256)
    try:
        blended = BlendedModel(model, store, model_name="kvtier-blend-task-model", config=config)
        right: dict[Any, list[bool]] = {"full": [], **{ratio: [] for ratio in ratios}}
        for example in examples:
            blended.prefill(example.segments, reuse=False)  # stores every page made alone
            full = model(torch.tensor([example.tokens]), logits_to_keep=1).logits[0, -1]
            right["full"].append(int(full.argmax()) == example.answer)
            for ratio in ratios:
                result = blended.prefill(example.segments, store=False, recompute_ratio=ratio)
                right[ratio].append(int(result.logits.argmax()) == example.answer)
            store.clear()
    finally:
        store.close()
    scores: dict = {method: sum(hits) / len(hits) for method, hits in right.items()}
    if by_kind:
        for method, hits in right.items():
            for kind in ("split", "within"):
                mine = [hit for hit, example in zip(hits, examples) if example.kind == kind]
                scores[f"{method}/{kind}"] = sum(mine) / len(mine)
    return scores
