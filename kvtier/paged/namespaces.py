"""The namespaces of a request's keys: the model, each group's layout, and the scope of the
request (LoRA adapter, cache salt)."""

from __future__ import annotations

from typing import NamedTuple

from kvtier.keys import Namespace
from kvtier.paged.layout import EngineLayout


class RequestScope(NamedTuple):
    """The part of a key's namespace that varies per request: the LoRA adapter (its KV differs
    from the base model's) and vLLM's ``cache_salt`` (tenants that must not share a cache); and
    the tenant whose quota its stores count against (not part of the keys)."""

    lora: str = ""
    salt: str = ""
    tenant: str = ""


class NamespaceCache:
    """Namespaces of every group by (TP rank, request scope): their root digests are computed
    once."""

    def __init__(self, engine: EngineLayout) -> None:
        self.engine = engine
        self._cache: dict[tuple[int, RequestScope], tuple[Namespace, ...]] = {}

    def get(self, tp_rank: int, scope: RequestScope) -> tuple[Namespace, ...]:
        spaces = self._cache.get((tp_rank, scope))
        if spaces is None:
            model = self.engine.model if not scope.lora else f"{self.engine.model}+lora:{scope.lora}"
            salt = scope.salt.encode()
            spaces = tuple(Namespace(model, g.layout_of(tp_rank), self.engine.revision, salt) for g in self.engine.groups)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[(tp_rank, scope)] = spaces
        return spaces
