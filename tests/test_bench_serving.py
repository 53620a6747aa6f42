"""bench/serving.py's parts that need no engine: vLLM's own client accepts the arguments the
bench gives it (its parser is the judge), the gap-closed figure, and the multi-turn workload's
conversations (each turn grows by the last answer, token for token)."""

import importlib.util
import random
import sys
from pathlib import Path

import pytest

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
    assert client.num_prompts == args.prefixes * args.per_prefix == 24
    assert client.save_detailed  # the generated texts come back for the exactness check


def test_gap_closed_is_the_share_of_the_way_from_alone_to_the_floor():
    assert serving._gap(3.0, 2.0, 4.0) == 0.5  # throughput: higher is better
    assert serving._gap(200.0, 1000.0, 100.0) == 0.889  # TTFT: lower is better, same formula
    assert serving._gap(1.0, 2.0, 2.0) is None  # no gap to close


def test_multi_turn_parses_with_its_own_defaults_and_refuses_several_concurrencies(capsys):
    args = serving._parse(["--workload", "multi-turn", "--quick"])
    assert (args.users, args.turns, args.concurrency, args.answer_len) == (4, 4, [2], 256)
    assert serving._parse([]).workload == "prefix-repetition" and serving._parse([]).concurrency == [1, 4, 8]
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
