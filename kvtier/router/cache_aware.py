"""The cache-aware policy: per request, the instance where it will cost least, counting both what
its prompt finds cached there and how busy the instance is.

For each instance the router estimates the work before the request's first token there, in
*prompt tokens computed*:

    cost = tokens not cached anywhere the instance can read
         + tokens loaded from kvtier x that tier's cost per token (``Medium.load_cost``)
         + the prompt tokens still to compute of the requests sent there that have not started
           answering (the router's own estimates of them, until their first bytes arrive)
         + requests in flight there x ``queue_cost_tokens`` (each decoding request slows the steps)

Tokens in the instance's own prefix cache (vLLM's device cache, learned from its KV events,
``vllm_prefix.py``) cost nothing; tokens past them that the instance's kvtier server holds
(``POST /api/lookup``, asked of each server once per request, concurrently, within
``lookup_timeout_s``) cost their tier's load cost; the rest are computed. The lowest cost wins;
ties go to fewer requests in flight, then in turn. A request the router cannot tokenise (a batch,
no tokenizer, an unknown chat template) is placed least-loaded.

The prompt is tokenised with the model's tokenizer from a local folder, as vLLM does: a
completion's text with special tokens, a chat's messages through the tokenizer's chat template
with a generation prompt and without added special tokens.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import msgspec
import zmq

from kvtier.events import Medium
from kvtier.router.instances import Instance
from kvtier.router.policies import Policy, Routed
from kvtier.router.vllm_prefix import BlockHasher, EventSubscriber, PrefixIndex
from kvtier.server.admin_token import token_for

log = logging.getLogger(__name__)

#: The cost of a tier kvtier reports that is none of these (a newer medium).
UNKNOWN_TIER_COST = 0.5


class CacheAware(Policy):
    name = "cache-aware"

    def __init__(
        self,
        instances: list[Instance],
        tokenizer: Any,
        namespace: dict | None = None,
        hash_algorithm: str = "sha256",
        queue_cost_tokens: float = 64.0,
        tier_costs: dict[str, float] | None = None,
        lookup_timeout_s: float = 0.2,
        admin_token: str = "",
    ) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.namespace = namespace  # None: vLLM's own caches only
        self.queue_cost_tokens = queue_cost_tokens
        self.tier_costs = {**{m.value: m.load_cost for m in Medium}, **(tier_costs or {})}
        self.hasher = BlockHasher(hash_algorithm)
        self.index = PrefixIndex()
        self._context = zmq.Context()
        self.subscribers = [EventSubscriber(self.index, i.url, i.events, self._context, i.events_curve)
                            for i in instances if i.events]
        self.admin_token = admin_token  # "": the token each kvtier server on this host made (admin_token.py)
        self._kvtier = httpx.AsyncClient(timeout=lookup_timeout_s)
        self.counts = {"scored": 0, "unscored": 0, "expected_local_tokens": 0, "expected_kvtier_tokens": 0,
                       "kvtier_lookup_failures": 0}

    # -- the prompt --------------------------------------------------------------------------

    def tokens(self, request: Routed) -> list[int] | None:
        body = request.body
        try:
            if request.path.endswith("/chat/completions"):
                messages = body.get("messages")
                if not isinstance(messages, list):
                    return None
                text = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=body.get("add_generation_prompt", True))
                return self.tokenizer.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
            if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return prompt
        except Exception as exc:  # a template the tokenizer lacks, content it cannot render
            log.debug("cannot tokenise a request: %s", exc)
        return None

    # -- what each instance holds ------------------------------------------------------------

    def local_tokens(self, instances: list[Instance], tokens: list[int], salt: str | None,
                     hashes: dict[int, list[int]] | None = None) -> dict[Instance, int]:
        """Tokens of the prompt each instance's own cache holds; ``hashes`` (by block size) is
        filled with the prompt's block hashes on the way."""
        hashes = {} if hashes is None else hashes
        local = {}
        for instance in instances:
            block_size = self.index.block_size.get(instance.url)
            if block_size is None:
                local[instance] = 0
                continue
            if block_size not in hashes:
                hashes[block_size] = self.hasher.hashes(tokens, block_size, salt)
            local[instance] = block_size * self.index.cached_blocks(instance.url, hashes[block_size])
        return local

    async def kvtier_prefixes(self, instances: list[Instance], tokens: list[int], salt: str | None) -> dict[str, dict]:
        """Each kvtier server's answer (by its URL); a server that fails or is slow counts as empty."""
        if self.namespace is None:
            return {}
        urls = sorted({i.kvtier for i in instances if i.kvtier})
        body = msgspec.json.encode({"namespace": {**self.namespace, "tenant_salt": salt or ""}, "tokens": tokens})

        async def ask(url: str) -> dict | None:
            try:
                token = self.admin_token or token_for(url)
                headers = {"Authorization": f"Bearer {token}"} if token else None
                response = await self._kvtier.post(url + "/api/lookup", content=body, headers=headers)
                response.raise_for_status()
                return response.json()
            except (httpx.HTTPError, ValueError) as exc:
                self.counts["kvtier_lookup_failures"] += 1
                log.debug("kvtier lookup at %s failed: %s", url, exc)
                return None

        answers = await asyncio.gather(*(ask(url) for url in urls))
        return {url: answer for url, answer in zip(urls, answers) if answer}

    def tier_cost(self, tier: str) -> float:
        medium = tier.split("-", 1)[0]
        return self.tier_costs.get(medium, UNKNOWN_TIER_COST)

    def cost(self, num_tokens: int, local: int, kvtier: dict | None) -> tuple[float, int]:
        """The request's prefill cost on an instance (in tokens computed), and the tokens it
        would load from kvtier."""
        prefix = kvtier["prefix_tokens"] if kvtier else 0
        loaded = max(0, prefix - local)
        if loaded:
            tiers = kvtier["tiers"]
            per_token = sum(n * self.tier_cost(t) for t, n in tiers.items()) / max(1, sum(tiers.values()))
        else:
            per_token = 0.0
        return num_tokens - max(local, prefix) + loaded * per_token, loaded

    # -- the policy --------------------------------------------------------------------------

    async def rank(self, request: Routed, instances: list[Instance]) -> list[Instance]:
        order = self.in_turn(instances)
        tokens = self.tokens(request)
        if tokens is None:
            self.counts["unscored"] += 1
            return sorted(order, key=lambda i: i.in_flight)
        salt = request.body.get("cache_salt") or None
        hashes: dict[int, list[int]] = {}
        local = self.local_tokens(order, tokens, salt, hashes)
        kvtier = await self.kvtier_prefixes(order, tokens, salt)
        scored = {}
        for instance in order:
            cost, loaded = self.cost(len(tokens), local[instance], kvtier.get(instance.kvtier))
            request.prefill[instance] = cost
            scored[instance] = (cost + instance.prefill_tokens + self.queue_cost_tokens * instance.in_flight, loaded)
        ranked = sorted(order, key=lambda i: (scored[i][0], i.in_flight))
        self.counts["scored"] += 1
        self.counts["expected_local_tokens"] += local[ranked[0]]
        self.counts["expected_kvtier_tokens"] += scored[ranked[0]][1]
        block_size = self.index.block_size.get(ranked[0].url)
        if block_size in hashes:  # it will hold them soon (if another instance takes it, they expire)
            self.index.expect(ranked[0].url, hashes[block_size])
        return ranked

    def status(self) -> dict:
        return {**self.counts, "kvtier_lookups": self.namespace is not None,
                "indexed_blocks": {i: self.index.blocks(i) for i in self.index.block_size},
                "event_batches": sum(s.batches for s in self.subscribers),
                "event_gaps": sum(s.gaps for s in self.subscribers)}

    async def close(self) -> None:
        for subscriber in self.subscribers:
            subscriber.stop()
        self._context.term()
        await self._kvtier.aclose()
