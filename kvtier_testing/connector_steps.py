"""The connector's two sides driven step by step as vLLM drives them, without vLLM's engine: the
real ``KvtierScheduler`` and ``KvtierWorker`` over one embedded store, vLLM's KV as CPU tensors,
and a stand-in forward pass whose KV says whether its context was right. For fast tests of what
the connector stores when a load comes back short (no model, no engine start).

The forward pass: the KV of a token is the largest value among the tokens before it, and at
least 1.0. Computed over the right context every token holds 1.0; a block vLLM never filled
holds ``GARBAGE`` (what an earlier request left there), and every token computed after it holds
``GARBAGE`` too, as attention over wrong KV gives wrong KV.

vLLM's side as its scheduler does it (``kv_load_failure_policy: recompute``): each step
schedules the rest of every running prompt; blocks reported not loaded send their request back
to the first of them, and the step's output of that request is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from kvtier.integrations.vllm.config import parse_extra_config
from kvtier.integrations.vllm.scheduler import KvtierScheduler
from kvtier.integrations.vllm.worker import KvtierWorker
from kvtier.keys import ChunkSpan, prefix_keys
from kvtier.layout import KVLayout
from kvtier.paged.groups import FullAttention
from kvtier.paged.layout import EngineLayout, GroupLayout, pages
from kvtier.paged.namespaces import NamespaceCache, RequestScope

LAYERS, HEADS, HEAD_SIZE = 2, 2, 32
BLOCK, CHUNK = 16, 32
GARBAGE = 4.0


def engine_layout() -> EngineLayout:
    """One full-attention group of ``LAYERS`` layers, vLLM's CPU page layout [block, heads, tokens, K and V]."""
    layout = KVLayout(LAYERS, HEADS, HEAD_SIZE, "float32", block_size=BLOCK, arrangement="connector-steps")
    group = GroupLayout(0, FullAttention(), tuple(f"layer{i}" for i in range(LAYERS)), (BLOCK * layout.bytes_per_token // LAYERS,), layout)
    return EngineLayout("tiny", "", (group,), BLOCK, 1, layout.arrangement)


@dataclass
class Request:
    """The fields of vLLM's ``Request`` the connector reads."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict | None = None
    cache_salt: str | None = None
    mm_features: list = field(default_factory=list)
    prompt_embeds: None = None
    lora_request: None = None
    block_hashes: list = field(default_factory=list)
    num_computed_tokens: int = 0
    num_in_flight_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    num_prompt_tokens = num_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids


class Steps:
    def __init__(self, num_blocks: int = 128, **extra) -> None:
        self.engine = engine_layout()
        config = parse_extra_config({"kvtier.chunk_size": CHUNK, "kvtier.l1_size_gb": 0.01, "kvtier.save_buffer_gb": 0.01,
                                     "kvtier.load_or_recompute": False, **extra})
        self.kv = torch.full((LAYERS, num_blocks, HEADS, BLOCK, 2 * HEAD_SIZE), GARBAGE)
        self.blocks: dict[str, list[int]] = {}
        self.scheduler = KvtierScheduler(config, self.engine, lambda req_id: (self.blocks[req_id],))
        self.worker = KvtierWorker(config, self.engine, 0, num_blocks)
        self.worker.register_kv_caches({f"layer{i}": self.kv[i] for i in range(LAYERS)})
        self.store = self.scheduler.cache.key_store
        self.running: dict[str, Request] = {}
        self._new: set[str] = set()
        self._next_block = 1  # block 0 is vLLM's null block
        self.not_loaded: list[set[int]] = []  # blocks reported not loaded, per step

    def admit(self, req_id: str, tokens: list[int], **fields) -> int:
        """Look the prompt up and admit it (``fields``: more of the request's, such as its
        ``cache_salt``): the tokens kvtier loads in its first step."""
        request = Request(req_id, list(tokens), **fields)
        external, asynchronous = self.scheduler.get_num_new_matched_tokens(request, 0)
        assert external is not None and not asynchronous, (external, asynchronous)
        count = pages(len(tokens), BLOCK)
        self.blocks[req_id] = list(range(self._next_block, self._next_block + count))
        self._next_block += count
        self.scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (self.blocks[req_id],)), external)
        request.num_computed_tokens = external
        self.running[req_id] = request
        self._new.add(req_id)
        return external

    def step(self) -> None:
        """One engine step: the rest of every running prompt; finished ones leave."""
        scheduled = {r.request_id: r.num_tokens - r.num_computed_tokens for r in self.running.values()}
        new = [SimpleNamespace(req_id=i, num_computed_tokens=self.running[i].num_computed_tokens) for i in scheduled if i in self._new]
        cached = [i for i in scheduled if i not in self._new]
        output = SimpleNamespace(
            scheduled_new_reqs=new, num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_cached_reqs=SimpleNamespace(req_ids=cached, num_computed_tokens=[self.running[i].num_computed_tokens for i in cached]),
        )
        self._new.clear()
        meta = self.scheduler.build_connector_meta(output)
        self.worker.start_load_kv(meta)
        for req_id, count in scheduled.items():
            self._forward(self.running[req_id], count)
        self.worker.wait_for_save(meta)
        _, _, invalid = self.worker.take_load_results(meta)
        self.not_loaded.append(invalid)
        self.scheduler.update_connector_output(self.worker.build_connector_worker_meta())
        for req_id, count in scheduled.items():
            request = self.running[req_id]
            bad = [i for i, block in enumerate(self.blocks[req_id][: pages(request.num_computed_tokens, BLOCK)]) if block in invalid]
            if bad:  # vLLM computes again from the first block that did not load
                request.num_computed_tokens = bad[0] * BLOCK
                continue
            request.num_computed_tokens += count
            if request.num_computed_tokens == request.num_tokens:
                del self.running[req_id]
                self.scheduler.request_finished(request, (self.blocks[req_id],))

    def run(self) -> None:
        while self.running:
            self.step()
        assert self.worker._saver.wait_idle(10)

    def _forward(self, request: Request, count: int) -> None:
        blocks, start = self.blocks[request.request_id], request.num_computed_tokens
        context = max([1.0, *(float(self.kv[0, blocks[p // BLOCK], 0, p % BLOCK, 0]) for p in range(start))])
        for p in range(start, start + count):
            self.kv[:, blocks[p // BLOCK], :, p % BLOCK, :] = context  # tokens in the step see each other: all hold 1.0 or worse

    def spans(self, tokens: list[int], salt: str = "") -> list[ChunkSpan]:
        """The chunks of a prompt (the last one shorter where it ends inside it) of requests
        with the cache salt ``salt``."""
        return prefix_keys(self.namespace(salt), np.asarray(tokens, dtype=np.uint32), CHUNK, BLOCK).spans

    def namespace(self, salt: str = ""):
        return NamespaceCache(self.engine).get(0, RequestScope(salt=salt))[0]

    def stored_values(self, tokens: list[int]) -> list[set[float] | None]:
        """For each chunk of the prompt, the values its KV in the store takes over the chunk's
        tokens, or None where the store does not hold it."""
        values = []
        for span in self.spans(tokens):
            with self.scheduler.cache.retrieve_spans(self.namespace(), [span]) as retrieval:
                if not retrieval.chunks:
                    values.append(None)
                    continue
                kv = np.frombuffer(retrieval.chunks[0].payload, np.float32).reshape(LAYERS, -1, HEADS, BLOCK, 2 * HEAD_SIZE)
                kv = kv.transpose(0, 2, 1, 3, 4).reshape(LAYERS, HEADS, -1, 2 * HEAD_SIZE)[:, :, : span.num_tokens]
                values.append(set(np.unique(kv).tolist()))
        return values

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
