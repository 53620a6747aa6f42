"""kvtier's figures in vLLM's own metrics: the stats object that travels from the connector to
vLLM's front end, the Prometheus counters built from it, and (marked ``vllm``) a real vLLM OpenAI
server with kvtier whose ``/metrics`` and periodic log show kvtier's hits per tier, load and save
bytes and times, and dropped saves.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections import Counter

import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.parser import text_string_to_metric_families

from kvtier.integrations.vllm.metrics import FIGURES, PREFIX, Interval, KvtierPromMetrics, build_stats, totals
from kvtier.paged.hits import tokens_by_tier
from kvtier.paged.jobs import LoadSample
from kvtier.paged.load_costs import LoadOrRecompute
from kvtier_testing.engine_process import kvtier_transfer_config
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.services import MODEL_NAME, free_port, service_env, vllm_server


# -- the stats object, no engine --------------------------------------------------------------------


def test_interval_gives_what_each_figure_gained_and_nothing_when_idle():
    interval = Interval()
    first = interval.take({"lookups": 2, "lookup_s": 0.5, "hits_by_tier": Counter({"memory": 256})})
    assert first.data == {"lookups": 2, "lookup_seconds": 0.5, "hit_tokens": {"memory": 256}}
    now = {"lookups": 3, "lookup_s": 0.5, "hits_by_tier": Counter({"memory": 256, "disk-0": 512}), "other": 1}
    assert interval.take(now).data == {"lookups": 1, "hit_tokens": {"disk-0": 512}}
    assert interval.take(now) is None


def test_intervals_add_up_to_the_totals_while_a_thread_bumps_them():
    """The worker's saver and loader threads bump its totals while the engine's thread takes
    each step's interval from them: no figure is lost or counted twice."""
    from kvtier.paged.context import WorkerStats

    stats, interval, sent = WorkerStats(), Interval(), Counter()
    by_group: Counter = Counter()

    def bump() -> None:
        for i in range(20_000):
            stats.add(saves=1, save_bytes=3)
            stats.add_labelled("save_bytes_by_group", i % 3, 2)

    def send() -> None:
        step = interval.take(vars(stats))
        for name, value in (step.data if step is not None else {}).items():
            if isinstance(value, dict):
                by_group.update(value)
            else:
                sent[name] += value

    thread = threading.Thread(target=bump)
    thread.start()
    while thread.is_alive():
        send()
    thread.join()
    send()
    assert interval.take(vars(stats)) is None
    figures = totals(stats.snapshot())
    assert (sent["saves"], sent["save_bytes"]) == (figures["saves"], figures["save_bytes"]) == (20_000, 60_000)
    assert dict(by_group) == figures["group_save_bytes"] == {"0": 13_334, "1": 13_334, "2": 13_332}


def test_every_figure_names_a_field_of_the_connector_stats():
    from kvtier.integrations.vllm.scheduler import SchedulerStats
    from kvtier.paged.context import WorkerStats

    fields = set(SchedulerStats().as_dict()) | set(WorkerStats().snapshot())
    assert {f.field for f in FIGURES} <= fields
    assert len({f.name for f in FIGURES}) == len(FIGURES)


def test_worker_counters_bumped_from_several_threads_lose_nothing():
    from kvtier.paged.context import WorkerStats

    stats = WorkerStats()

    def bump() -> None:
        for _ in range(20_000):
            stats.add(loads=1, load_bytes=3)
            stats.add_labelled("save_bytes_by_group", 0, 1)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    snapshot = stats.snapshot()
    assert (snapshot["loads"], snapshot["load_bytes"], snapshot["save_bytes_by_group"]) == (80_000, 240_000, {0: 80_000})


def test_stats_from_ranks_and_scheduler_sum_and_reduce_to_one_log_line():
    worker = build_stats({"load_bytes": 100, "load_seconds": 0.25})
    other_rank = build_stats({"load_bytes": 50, "dropped_saves": 1})
    scheduler = build_stats({"hit_tokens": {"memory": 128, "disk-0": 256}})
    total = worker.aggregate(other_rank).aggregate(scheduler).aggregate(build_stats({"hit_tokens": {"memory": 128}}))
    assert total.reduce() == {
        "kvtier_hit_tokens[disk-0]": 256, "kvtier_hit_tokens[memory]": 256,
        "kvtier_load_bytes": 150, "kvtier_load_seconds": 0.25, "kvtier_dropped_saves": 1,
    }
    assert not total.is_empty() and build_stats(None).is_empty()


def test_front_end_copy_leaves_the_payload_untouched():
    """vLLM's log accumulator aggregates in place what its Prometheus logger also reads."""
    payload = {"hit_tokens": {"memory": 1}, "loads": 1}
    build_stats(payload).aggregate(build_stats(payload))
    assert payload == {"hit_tokens": {"memory": 1}, "loads": 1}


def test_stats_survive_vllms_engine_to_front_end_serialization():
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    data = Interval().take({"hits_by_tier": Counter({"memory": 256}), "load_s": 0.01, "loads": 1}).to_dict()
    [decoded] = [MsgpackDecoder(SchedulerStats).decode(MsgpackEncoder().encode(SchedulerStats(kv_connector_stats=data)))]
    assert build_stats(decoded.kv_connector_stats).reduce() == build_stats(data).reduce()


@pytest.mark.parametrize("start, end, expected", [
    (0, 256, {"memory": 256}),
    (128, 640, {"memory": 128, "disk-0": 256, "redis": 128}),  # from inside the first chunk to inside the third
    (512, 700, {"redis": 188}),  # the tail chunk alone
])
def test_loaded_tokens_are_counted_by_the_tier_of_their_chunk(start, end, expected):
    assert tokens_by_tier(["memory", "disk-0", "redis"], 256, start, end) == Counter(expected)


def test_prometheus_counters_per_engine_and_tier():
    registry = CollectorRegistry()
    types = {kind: (lambda kind: lambda **kw: kind(registry=registry, **kw))(kind) for kind in (PromCounter, Gauge, Histogram)}
    from vllm.config import VllmConfig

    metrics = KvtierPromMetrics(VllmConfig(), types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    metrics.observe({"hit_tokens": {"memory": 256}, "load_bytes": 4096, "future_figure": 1}, engine_idx=1)
    metrics.observe({"hit_tokens": {"memory": 256, "disk-0": 128}}, engine_idx=1)
    samples = _samples(generate_latest(registry).decode())
    assert samples[("hit_tokens", ("1", "m", "memory"))] == 512
    assert samples[("hit_tokens", ("1", "m", "disk-0"))] == 128
    assert samples[("load_bytes", ("1", "m"))] == 4096
    assert samples[("dropped_saves", ("0", "m"))] == 0  # present from the start


def test_load_or_recompute_estimates_are_gauges_of_their_newest_value():
    """The estimates travel when they change, as values (not what they gained), the newest
    winning where stats meet; vLLM's /metrics shows them as gauges."""
    interval = Interval()
    estimates = {"prefill_us_per_token": 90.0, "prefill_tokens_per_s": None, "tier_tokens_per_s": {"memory": 10**8},
                 "load_decision_changes": 1}
    assert interval.take(estimates).data == {"prefill_us_per_token": 90.0, "tier_tokens_per_second": {"memory": 10**8},
                                                     "load_decision_changes": 1}
    assert interval.take(estimates) is None
    later = {**estimates, "prefill_tokens_per_s": 8000, "tier_tokens_per_s": {"memory": 10**8, "redis": 485},
             "load_decision_changes": 3}
    assert interval.take(later).data == {"prefill_tokens_per_second": 8000, "tier_tokens_per_second": {"redis": 485},
                                                 "load_decision_changes": 2}
    # as the estimates give them, they survive vLLM's engine-to-front-end serialization
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    costs = LoadOrRecompute(half_life_s=60.0, probe_s=30.0)
    for i, tokens in enumerate([1024, 4096, 2048, 4096, 512]):
        costs.observe_step(tokens, tokens * (tokens - 1) // 2, 0.01 + 1e-4 * tokens, now=i)
        costs.observe_load(LoadSample("memory", tokens, tokens * 4096, 1e-5 + tokens / 2e8), now=i)
    data = Interval().take(costs.gauges()).to_dict()
    assert set(data) == {"prefill_us_per_token", "prefill_tokens_per_second", "tier_tokens_per_second"}
    [decoded] = [MsgpackDecoder(SchedulerStats).decode(MsgpackEncoder().encode(SchedulerStats(kv_connector_stats=data)))]
    assert decoded.kv_connector_stats == data
    merged = build_stats({"prefill_us_per_token": 90.0, "load_decision_changes": 1}).aggregate(
        build_stats({"prefill_us_per_token": 80.0, "load_decision_changes": 1}))
    assert merged.data == {"prefill_us_per_token": 80.0, "load_decision_changes": 2}

    registry = CollectorRegistry()
    types = {kind: (lambda kind: lambda **kw: kind(registry=registry, **kw))(kind) for kind in (PromCounter, Gauge, Histogram)}
    from vllm.config import VllmConfig

    metrics = KvtierPromMetrics(VllmConfig(), types, ["model_name", "engine"], {0: ["m", "0"]})
    metrics.observe({"prefill_us_per_token": 90.0, "tier_tokens_per_second": {"redis": 485}, "load_decision_changes": 1})
    metrics.observe({"prefill_us_per_token": 80.0, "load_decision_changes": 1})
    shown = {(s.name, s.labels.get("tier")): s.value for family in text_string_to_metric_families(generate_latest(registry).decode())
             for s in family.samples if s.name.startswith(PREFIX)}
    assert shown[(PREFIX + "prefill_us_per_token", None)] == 80.0
    assert shown[(PREFIX + "tier_tokens_per_second", "redis")] == 485
    assert shown[(PREFIX + "load_decision_changes_total", None)] == 2


def _samples(text: str) -> dict:
    """(figure name, sorted label values) -> value of every ``vllm:kvtier_*_total`` sample."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(PREFIX) and sample.name.endswith("_total"):
                key = sample.name[len(PREFIX):-len("_total")]
                labels = tuple(v for _, v in sorted(sample.labels.items()))
                out[(key, labels)] = sample.value
    return out


# -- a real vLLM OpenAI server with kvtier ------------------------------------------------------------


CHUNK = 256
BLOCK = 128  # the CPU attention backend's block size
DOC = [random.Random(1).randrange(4, 4096) for _ in range(4 * CHUNK)]
QUESTIONS = [[random.Random(100 + i).randrange(4, 4096) for _ in range(24)] for i in range(4)]
LOG_LINE = re.compile(r"KV Transfer metrics: (.*)")


class Figures:
    """The ``vllm:kvtier_*`` counters of one scrape of vLLM's /metrics."""

    def __init__(self, text: str) -> None:
        self.samples = []  # (figure name, labels, value)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith(PREFIX) and sample.name.endswith("_total"):
                    self.samples.append((sample.name[len(PREFIX):-len("_total")], sample.labels, sample.value))

    def total(self, name: str) -> float:
        return sum(value for figure, _, value in self.samples if figure == name)

    def by_tier(self, name: str, label: str = "tier") -> dict[str, float]:
        return {labels[label]: value for figure, labels, value in self.samples if figure == name}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_path):
    """One kvtier server (memory and disk tiers) and one vLLM OpenAI server using it, vLLM's own
    prefix cache off so that every repeat is kvtier's; vLLM logs its stats every second."""
    tmp = tmp_path_factory.mktemp("metrics")
    kvtier = ServerProcess(tmp, "--l2-adapter", json.dumps({"type": "fs", "base_path": str(tmp / "l2"), "max_capacity_gb": 1}),
                           l1_gb=0.25, chunk_size=CHUNK).start()
    env = {**service_env(tmp / "cache"), "VLLM_LOG_STATS_INTERVAL": "1"}
    port = free_port()
    connector = kvtier_transfer_config({"kvtier.url": kvtier.url, "kvtier.timeout_s": 0.5})
    vllm = vllm_server("vllm", tiny_model_path, port, env, tmp / "logs", connector, max_model_len=2048,
                       extra_args=("--no-enable-prefix-caching",)).start()
    try:
        vllm.wait_healthy(600)
        yield kvtier, vllm, f"http://127.0.0.1:{port}"
    finally:
        vllm.terminate()
        vllm.wait_or_kill(time.monotonic() + 15)
        kvtier.stop()


def _complete(url: str, prompt: list[int]) -> int:
    """Send a prompt; the tokens vLLM did not compute (its prefix cache is off: kvtier's)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return (response.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _figures_when(url: str, ready, timeout: float = 15) -> Figures:
    """Scrape until ``ready(figures)``: figures reach the front end with the engine's step outputs."""
    deadline = time.monotonic() + timeout
    while True:
        figures = Figures(httpx.get(url + "/metrics", timeout=10).text)
        if ready(figures) or time.monotonic() > deadline:
            return figures
        time.sleep(0.2)


def _bytes_per_token(model_path) -> int:
    from kvtier.layout import DTYPE_SIZES

    config = json.loads((model_path / "config.json").read_text())
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_size * DTYPE_SIZES["float32"]


@pytest.mark.vllm
def test_vllm_metrics_and_log_show_kvtier_hits_per_tier_bytes_and_drops(stack, tiny_model_path):
    kvtier, vllm, url = stack
    tiers = [tier["name"] for tier in kvtier.get("/status")["tiers"]]
    memory, disk = tiers[0], tiers[1]
    per_token = _bytes_per_token(tiny_model_path)
    page = BLOCK * per_token

    # cold: looked up, nothing hit
    assert _complete(url, DOC + QUESTIONS[0]) == 0
    cold = _figures_when(url, lambda f: f.total("lookups") >= 1)
    assert cold.total("lookups") >= 1
    assert cold.total("hit_tokens") == 0 and cold.total("load_bytes") == 0 and cold.total("loads") == 0

    # warm: the document comes from kvtier's memory tier, byte for byte the pages of its tokens
    assert _complete(url, DOC + QUESTIONS[1]) == len(DOC)
    warm = _figures_when(url, lambda f: f.total("hit_tokens") >= len(DOC) and f.total("loads") >= 1)
    assert warm.by_tier("hit_tokens") == {memory: len(DOC)}
    assert warm.total("loaded_tokens") == len(DOC) and warm.total("failed_loads") == 0
    assert warm.total("load_bytes") == len(DOC) * per_token  # the document is whole pages
    assert warm.total("load_seconds") > 0 and warm.total("retrieve_seconds") > 0
    # the cold prompt's four chunks and its tail (one page), maybe the warm one's tail too
    assert warm.total("save_bytes") in ((len(DOC) + BLOCK) * per_token, (len(DOC) + 2 * BLOCK) * per_token)
    assert warm.total("save_bytes") % page == 0
    assert warm.by_tier("group_save_bytes", "group") == {"0": warm.total("save_bytes")}  # one group
    assert warm.total("save_seconds") > 0 and warm.total("stage_seconds") > 0
    assert warm.total("dropped_saves") == 0 and warm.total("failed_saves") == 0

    # vLLM's periodic log line shows the same interval's figures
    line = _wait_for_log(vllm.log, lambda fields: fields.get(f"kvtier_hit_tokens[{memory}]") == str(len(DOC)))
    assert int(line["kvtier_load_bytes"]) == len(DOC) * per_token, line

    # the kvtier server away: the lookup misses and the save is dropped; the answer comes all the same
    kvtier.stop()
    assert _complete(url, QUESTIONS[2] + DOC) == 0

    # back, with its disk only (memory starts empty): hits are the disk tier's; the drop was counted
    # (the saver thread drops it after the engine's last step: it travels with this request's steps)
    kvtier.start()
    time.sleep(2.5)  # the engine's clients reconnect after their backoff
    assert _complete(url, DOC + QUESTIONS[3]) == len(DOC)
    back = _figures_when(url, lambda f: f.by_tier("hit_tokens").get(disk, 0) >= len(DOC) and f.total("dropped_saves"))
    assert back.by_tier("hit_tokens") == {memory: len(DOC), disk: len(DOC)}
    assert back.total("load_bytes") == 2 * len(DOC) * per_token
    assert back.total("dropped_saves") == 1 and back.total("failed_saves") == 0


def _wait_for_log(path, ready, timeout: float = 15) -> dict[str, str]:
    """The fields of the first "KV Transfer metrics" line of vLLM's log that is ``ready``."""
    deadline = time.monotonic() + timeout
    while True:
        for match in LOG_LINE.finditer(path.read_text(errors="replace")):
            fields = dict(part.split("=", 1) for part in match.group(1).strip().split(", "))
            if ready(fields):
                return fields
        assert time.monotonic() < deadline, f"no matching 'KV Transfer metrics' line in {path}"
        time.sleep(0.3)
