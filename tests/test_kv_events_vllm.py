"""kvtier's KV events carry the block hashes vLLM itself computes: one vLLM engine with the kvtier
connector publishes its own KV events (``--kv-events-config``, zmq) while kvtier's server
publishes its; one subscriber written against vLLM's event structs reads both, and for the
blocks of the prompt kvtier stored, hashes, parents, tokens and extra keys agree, but for a
request's cache salt, which kvtier's never carry. Marked ``vllm``.
"""

from __future__ import annotations

import random

import pytest
from vllm.distributed.kv_events import BlockStored

from kvtier_testing.engine_process import EngineProcess, engine_env, kvtier_transfer_config
from kvtier_testing.kv_event_subscriber import EventSubscriber
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.services import free_port

pytestmark = pytest.mark.vllm

CHUNK = 256
BLOCK = 128  # the CPU attention backend's block size
SALT = "tenant-b-51e0-salt"


def blocks(messages, medium: str) -> list[tuple]:
    """(hash, parent, tokens, extra key) of every block stored on ``medium``, in order."""
    out = []
    for message in messages:
        for event in message.batch.events:
            if isinstance(event, BlockStored) and event.medium == medium:
                parent = event.parent_block_hash
                for i, block in enumerate(event.block_hashes):
                    extra = event.extra_keys[i] if event.extra_keys else None
                    out.append((block, parent, list(event.token_ids[i * BLOCK : (i + 1) * BLOCK]), extra))
                    parent = block
    return out


def test_kvtier_publishes_the_block_hashes_vllm_publishes_for_the_same_prompt(tmp_path, tiny_model_path):
    events = tmp_path / "events"
    server = ServerProcess(tmp_path, "--kv-events-dir", str(events), "--kv-events-source", "node", l1_gb=0.1,
                           chunk_size=CHUNK).start()
    vllm_port, vllm_replay = free_port(), free_port()
    vllm_events = EventSubscriber(f"tcp://127.0.0.1:{vllm_port}", f"tcp://127.0.0.1:{vllm_replay}", bind=True)
    kvtier_events = EventSubscriber(f"ipc://{events}/events", f"ipc://{events}/replay")
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv@engine@tiny",
                     "endpoint": f"tcp://127.0.0.1:{vllm_port}",  # no wildcard: vLLM connects to us
                     "replay_endpoint": f"tcp://127.0.0.1:{vllm_replay}"}
    rng = random.Random(7)
    prompt = [rng.randrange(4, 4096) for _ in range(4 * CHUNK + 40)]  # 8 whole blocks kvtier stores
    engine = EngineProcess(tiny_model_path, tmp_path, kvtier_transfer_config({"kvtier.url": server.url}),
                           enable_prefix_caching=True, max_model_len=2048, env=engine_env(),
                           llm_kwargs={"kv_events_config": events_config}, name="events")
    try:
        engine.start()
        engine.generate([prompt], max_tokens=1)
        engine.drain()
        whole = len(prompt) // BLOCK
        theirs = blocks(vllm_events.wait_for(lambda got: len(blocks(got, "GPU")) >= whole), "GPU")[:whole]
        ours = blocks(kvtier_events.wait_for(lambda got: len(blocks(got, "CPU")) >= whole), "CPU")
        assert len(ours) == whole == 8
        assert ours == theirs
        assert theirs[0][1] is None and [t for b in theirs for t in b[2]] == prompt[: whole * BLOCK]

        # a tenant's prompt: the same hashes (they bind its salt), vLLM's extra keys less the salt
        salted = [rng.randrange(4, 4096) for _ in range(2 * CHUNK + 40)]  # 4 whole blocks
        engine.generate([salted], max_tokens=1, cache_salt=SALT)
        engine.drain()
        theirs = blocks(vllm_events.wait_for(lambda got: len(blocks(got, "GPU")) >= whole + 4), "GPU")[-4:]
        ours = blocks(kvtier_events.wait_for(lambda got: len(blocks(got, "CPU")) >= whole + 4), "CPU")[whole:]
        assert theirs[0][3] == (SALT,) and ours[0][3] is None  # vLLM's own events carry the raw salt
        assert [b[:3] for b in ours] == [b[:3] for b in theirs] and [b[3] for b in ours[1:]] == [b[3] for b in theirs[1:]]
        assert all(SALT.encode() not in m.payload for m in kvtier_events.received)
        stored = [e for m in kvtier_events.received for e in m.batch.events if isinstance(e, BlockStored)]
        assert {m.topic for m in kvtier_events.received[1:]} == {f"kv@node@{tiny_model_path}"}
        assert {(e.medium, e.ownership, e.locality, e.block_size, e.lora_id) for e in stored} == {("CPU", "memory", "LOCAL", BLOCK, None)}
    finally:
        engine.stop()
        vllm_events.close()
        kvtier_events.close()
        server.stop()
