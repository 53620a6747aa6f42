"""How the router orders instances for a request. A policy ranks the available instances (best
first); the router tries them in that order until one answers (``app.py``). A policy may also
rewrite the request before it is sent (``prepare``): prefill/decode runs the prefill there.

    round-robin    each instance in turn
    least-loaded   fewest requests in flight, ties in turn
    pd             prefill on a prefill pool (in turn), then decode on the instances (in turn)
    cache-aware    most usable cached prefix against queue depth (cache_aware.py)
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import httpx

from kvtier.disagg.params import PREFILL_PARAM, PREFILLED_PARAM
from kvtier.router.instances import Instance

log = logging.getLogger(__name__)


@dataclass
class Routed:
    """A request on its way: its route (``/v1/completions``...) and JSON body; ``prefill`` is a
    policy's estimate of the prompt tokens it would compute on each instance (cache-aware)."""

    path: str
    body: dict
    prefill: dict = field(default_factory=dict)


class Policy:
    name = ""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def in_turn(self, instances: list[Instance]) -> list[Instance]:
        """Every instance once, starting with the next one in the rotation."""
        if not instances:
            return []
        start = next(self._turn) % len(instances)
        return instances[start:] + instances[:start]

    async def prepare(self, request: Routed, client: httpx.AsyncClient) -> Routed:
        return request

    async def rank(self, request: Routed, instances: list[Instance]) -> list[Instance]:
        raise NotImplementedError

    def status(self) -> dict:
        return {}

    async def close(self) -> None:
        pass


class RoundRobin(Policy):
    name = "round-robin"

    async def rank(self, request: Routed, instances: list[Instance]) -> list[Instance]:
        return self.in_turn(instances)


class LeastLoaded(Policy):
    name = "least-loaded"

    async def rank(self, request: Routed, instances: list[Instance]) -> list[Instance]:
        return sorted(self.in_turn(instances), key=lambda i: i.in_flight)  # sorted is stable: ties in turn


def prefill_request(body: dict) -> dict:
    """The request a prefill instance gets: same prompt and sampling, one token, no streaming,
    and the question for the connector."""
    prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["kv_transfer_params"] = {PREFILL_PARAM: True}
    return prefill


def _transfer_params(response: httpx.Response) -> dict | None:
    try:
        params = response.json().get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) and PREFILLED_PARAM in params else None


class PrefillDecode(RoundRobin):
    """Prefill/decode disaggregation. Each request goes first to a prefill instance with
    ``max_tokens=1`` (it computes the prompt's KV and stores it in kvtier) and asks, in
    ``kv_transfer_params``, how many prompt tokens it saved; then, as sent, to a decode instance
    (the router's instances, in turn) with that count, so the decoder waits for that KV (up to its
    ``kvtier.prefill_wait_s``) rather than computing the prompt while it is on its way. A prefill
    instance that is down or fails is skipped for the next one; if none answers, the decoder
    computes the prompt itself (counted): a prefill outage costs speed, not answers."""

    name = "pd"

    def __init__(self, prefill: list[Instance]) -> None:
        super().__init__()
        if not prefill:
            raise ValueError("the pd policy needs at least one prefill instance")
        self.prefill = prefill
        self._prefill_turn = Policy()
        self.counts = {"prefill_failures": 0, "decoded_without_prefill": 0}

    async def prepare(self, request: Routed, client: httpx.AsyncClient) -> Routed:
        for instance in self._prefill_turn.in_turn(self.prefill):
            try:
                response = await client.post(instance.url + request.path, json=prefill_request(request.body))
            except httpx.HTTPError as exc:
                log.warning("prefill instance %s unreachable: %s", instance.url, exc)
            else:
                if response.status_code == 200:
                    params = _transfer_params(response)
                    return Routed(request.path, {**request.body, "kv_transfer_params": params}) if params else request
                if response.status_code < 500:  # the request itself is bad: the decoder will say so too
                    return request
                log.warning("prefill instance %s answered %d", instance.url, response.status_code)
            self.counts["prefill_failures"] += 1
        self.counts["decoded_without_prefill"] += 1
        return request

    def status(self) -> dict:
        return dict(self.counts)


POLICIES = ("cache-aware", "round-robin", "least-loaded", "pd")
