"""bench/serving.py's parts that need no engine: vLLM's own client accepts the arguments the
bench gives it (its parser is the judge), and the gap-closed figure."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("serving", Path(__file__).parents[1] / "bench" / "serving.py")
serving = importlib.util.module_from_spec(_spec)
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
