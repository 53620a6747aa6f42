"""bench/serving.py's parts that need no engine: vLLM's own client accepts the arguments the
bench gives it (its parser is the judge), the gap-closed figure, and the multi-turn workload's
conversations (each turn grows by the last answer, token for token)."""

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from kvtier_testing.services import metric_samples

_spec = importlib.util.spec_from_file_location("serving", Path(__file__).parents[1] / "bench" / "serving.py")
serving = importlib.util.module_from_spec(_spec)
sys.modules["serving"] = serving  # its dataclass looks its module up
_spec.loader.exec_module(serving)


def test_vllms_client_takes_the_prefix_repetition_run():
    args = serving._parse(["--quick", "--concurrency", "1,4"])
    client = serving.client_args("http://127.0.0.1:1", Path("/m"), args, 4)
    assert client.dataset_name == "prefix_repetition" and client.max_concurrency == 4
    assert (client.prefix_repetition_prefix_len, client.prefix_repetition_suffix_len) == (4000, 64)
    assert client.prefix_repetition_output_len == 16 and client.ignore_eos and client.temperature == 0
    assert client.num_prompts == args.prefixes * args.per_prefix == 96
    assert client.save_detailed  # the generated texts come back for the exactness check


def test_gap_closed_is_the_share_of_the_way_from_alone_to_the_floor():
    assert serving._gap(3.0, 2.0, 4.0) == 0.5  # throughput: higher is better
    assert serving._gap(200.0, 1000.0, 100.0) == 0.889  # TTFT: lower is better, same formula
    assert serving._gap(1.0, 2.0, 2.0) is None  # no gap to close


def test_multi_turn_parses_with_its_own_defaults_and_refuses_several_concurrencies(capsys):
    args = serving._parse(["--workload", "multi-turn", "--quick"])
    assert (args.users, args.turns, args.concurrency, args.answer_len) == (4, 4, [2], 256)
    assert serving._parse([]).workload == "prefix-repetition" and serving._parse([]).concurrency == [4, 8, 16]
    for bad in (["--concurrency", "1,4"], ["--turns", "1"], ["--cache-conversations", "0.5"]):
        with pytest.raises(SystemExit):
            serving._parse(["--workload", "multi-turn", *bad])
    assert "--concurrency: one value" in capsys.readouterr().err


def test_each_turn_is_the_last_one_with_its_answer_and_a_new_question():
    scripts = serving.conversations(users=3, turns=4, document_words=50, question_words=8, seed=7)
    assert scripts == serving.conversations(users=3, turns=4, document_words=50, question_words=8, seed=7)
    assert scripts != serving.conversations(users=3, turns=4, document_words=50, question_words=8, seed=8)
    assert len({s.document for s in scripts}) == 3 and all(len(set(s.questions)) == 4 for s in scripts)
    answers = ["first answer", "second answer", "third answer"]
    for turn in range(1, 4):
        before, after = (serving.turn_messages(scripts[0], answers[:k]) for k in (turn - 1, turn))
        assert after == before + [{"role": "assistant", "content": answers[turn - 1]},
                                  {"role": "user", "content": scripts[0].questions[turn]}]
    assert serving.turn_messages(scripts[1], [])[0]["content"].startswith(scripts[1].document)


def test_the_next_prompt_holds_the_last_prompt_and_the_answer_token_for_token(tiny_tokenizer):
    """What history storing hits through: the next turn's prompt begins with exactly the tokens of
    the last prompt and its answer. With whole-word answers it does; an answer of arbitrary
    tokens (what the random tiny model would say) is split otherwise once it comes back as text."""
    script = serving.conversations(users=1, turns=2, document_words=200, question_words=8, seed=0)[0]
    allowed = serving.whole_word_tokens(tiny_tokenizer)
    assert len(allowed) > 1000
    rng = random.Random(0)
    prompt = serving.rendered(tiny_tokenizer, serving.turn_messages(script, []))
    for answer in ([rng.choice(allowed) for _ in range(300)], [rng.randrange(4, len(tiny_tokenizer)) for _ in range(300)]):
        text = tiny_tokenizer.decode(answer)
        following = serving.rendered(tiny_tokenizer, serving.turn_messages(script, [text]))
        assert (following[: len(prompt) + len(answer)] == prompt + answer) is (answer[0] in allowed)


def test_phases_are_means_over_the_requests_or_jobs_of_one_run():
    before = {"vllm:request_queue_time_seconds_sum": 1.0, "vllm:request_queue_time_seconds_count": 2,
              "vllm:kvtier_load_seconds_total": 0.5, "vllm:kvtier_loads_total": 3, "vllm:kvtier_async_loads_total": 1}
    after = {"vllm:request_queue_time_seconds_sum": 4.0, "vllm:request_queue_time_seconds_count": 5,
             "vllm:kvtier_load_seconds_total": 0.9, "vllm:kvtier_loads_total": 8, "vllm:kvtier_async_loads_total": 2}
    got = serving.phases(after, before)
    assert got["queued_ms"] == 1000.0 and got["queued_n"] == 3
    assert got["sync_load_ms"] == 100.0 and got["sync_load_n"] == 4  # 5 loads, 1 of them asynchronous
    assert "lookup_ms" not in got  # no lookup in the run: no mean
    counted = serving.phases({**after, "vllm:num_preemptions_total": 3, "vllm:iteration_tokens_total_count": 40},
                             {**before, "vllm:num_preemptions_total": 1, "vllm:iteration_tokens_total_count": 10})
    assert (counted["preemptions"], counted["steps"]) == (2, 30) and "deferred_lookups" not in counted


def test_the_queue_sampler_reads_vllms_labelled_gauges():
    text = ('# HELP vllm:num_requests_running x\n'
            'vllm:num_requests_running{engine="0",model_name="tiny"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0\n'
            'vllm:num_requests_waiting_by_reason{engine="0",reason="x"} 9.0\n')
    assert serving.queue_gauges(metric_samples(text)) == (3.0, 5.0)


def test_every_concurrency_has_its_own_bars():
    targets = serving._concurrency_targets([4, 16], lmcache=True)
    assert targets["kvtier_ttft_p50_vs_floor@4"].bar == 1.5 and targets["kvtier_ttft_p50_vs_floor@16"].bar == 2.0
    assert targets["gap_closed_throughput@16"].met(0.9) and not targets["gap_closed_throughput@4"].met(0.89)
    assert targets["vs_lmcache_ttft_p50@4"].met(0.5) and not targets["vs_lmcache_ttft_p50@4"].met(0.51)
    assert "vs_lmcache_ttft_p50@4" not in serving._concurrency_targets([4], lmcache=False)


def test_a_concurrencys_figures_are_medians_over_repeats_with_their_spread():
    def run(req_per_s, p50, text="a"):
        return {"req_per_s": req_per_s, "ttft_p50_ms": p50, "hit_ttft_p50_ms": p50 / 2, "texts": [text]}
    scenarios = {"alone": [run(1.0, 1000), run(1.0, 1000), run(1.0, 1000)],
                 "kvtier": [run(1.9, 110), run(1.5, 150), run(2.0, 100)],
                 "floor": [run(2.0, 100), run(2.0, 100), run(2.0, 100)]}
    got = serving._per_concurrency(scenarios)
    assert got["gap_closed_throughput"] == 0.9 and got["kvtier_ttft_p50_vs_floor"] == 1.1
    assert got["kvtier_hit_ttft_p50_vs_floor"] == 1.1
    assert got["spread"]["kvtier_ttft_p50_vs_floor"] == "1.00-1.50" and got["texts_identical"]
    scenarios["kvtier"][1]["texts"] = ["b"]
    assert not serving._per_concurrency(scenarios)["texts_identical"]
    assert "floor_vs_lmcache_ttft_p50" not in got


def test_with_lmcache_the_floors_own_ratio_to_it_says_how_low_vs_lmcache_can_go():
    def run(p50):
        return {"req_per_s": 1.0, "ttft_p50_ms": p50, "hit_ttft_p50_ms": p50, "texts": ["a"]}
    scenarios = {"alone": [run(1000)], "kvtier": [run(300)], "floor": [run(250)], "lmcache": [run(400)]}
    got = serving._per_concurrency(scenarios)
    assert (got["vs_lmcache_ttft_p50"], got["floor_vs_lmcache_ttft_p50"]) == (0.75, 0.625)


def test_a_hits_ttft_is_the_median_over_requests_whose_prefix_came_before():
    firsts = serving.first_of_prefix([0, 1, 0, 2, 1, 1])
    assert firsts == [True, True, False, True, False, False]
    run = {"ttfts": [9.0, 8.0, 0.1, 7.0, 0.3, 0.2]}
    assert serving.hit_ttft_p50_ms(run, firsts) == 200.0
    with pytest.raises(SystemExit):
        serving._parse(["--per-prefix", "1"])
