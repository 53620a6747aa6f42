"""The server with real processes: separate interpreters as engines, restarts, kills."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier.server.admin_token import token_for
from kvtier_testing.kvtier_processes import ServerProcess, free_port
from kvtier_testing.workload import NS, fill_for, retrieved_is_exact, tokens

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)


def engine(action: str, server: ServerProcess, first: int, count: int, *flags: str) -> dict:
    """Run one store or retrieve in a separate Python interpreter."""
    out = subprocess.run([sys.executable, "-m", "kvtier_testing.workload", action, server.url, str(first), str(count), *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture
def server(kvtier_server_with_disk):
    return kvtier_server_with_disk


@pytest.mark.parametrize("path", ["shared-memory", "frames"])
@pytest.mark.slow
def test_process_b_retrieves_what_process_a_stored(server, path):
    flags = ("--frames",) if path == "frames" else ()
    stored = engine("store", server, 1000, 100, *flags)
    assert stored == {"stored": 7, "shared_memory": path == "shared-memory"}
    got = engine("retrieve", server, 1000, 100, *flags)
    assert got == {"tokens": 100, "exact": True, "shared_memory": path == "shared-memory"}
    other = engine("retrieve", server, 1000, 100, "--frames" if not flags else "")  # the other path reads it too
    assert other["tokens"] == 100 and other["exact"]


@pytest.mark.slow
def test_restart_keeps_disk_hits(server):
    assert engine("store", server, 5000, 64)["stored"] == 4
    assert server.stop() == 0  # SIGTERM: pending disk writes are flushed
    server.start()
    client = KvtierClient(server.url, timeout_s=5)
    client_cache = TokenCache(client)
    assert client_cache.lookup(NS, tokens(5000, 64)).tiers == ["disk"] * 4
    client.close()
    assert engine("retrieve", server, 5000, 64) == {"tokens": 64, "exact": True, "shared_memory": True}


@pytest.mark.slow
def test_killed_server_gives_misses_in_time_then_recovers(server):
    client = KvtierClient(server.url, timeout_s=5)  # the stores that must succeed: room for a loaded host's stall
    client_cache = TokenCache(client)
    toks = tokens(9000, 48)
    assert client_cache.store(NS, toks, fill_for(toks)) == 3
    client.timeout_s = 0.5
    server.kill()
    for _ in range(3):
        start = time.monotonic()
        assert client_cache.lookup(NS, toks).hit_tokens == 0
        with client_cache.retrieve(NS, toks) as r:
            assert r.num_tokens == 0
        assert client_cache.store(NS, toks, fill_for(toks)) == 0
        assert time.monotonic() - start < 3 * 0.5 + 0.3  # each call within its timeout
    assert client.stats.timeouts >= 1 and client.stats.dropped_stores >= 1
    server.start()  # a new server: new arena, empty L1, disk kept nothing (killed before flush?)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not client.ping():
        time.sleep(0.2)
    client.timeout_s = 5
    assert client_cache.store(NS, toks, fill_for(toks)) == 3  # the new server's L1 is empty
    with client_cache.retrieve(NS, toks) as r:
        assert r.num_tokens == 48 and retrieved_is_exact(r, toks)
    client.close()


@pytest.mark.slow
def test_client_of_a_restarted_server_never_reads_the_old_arena(server):
    client = KvtierClient(server.url, timeout_s=2)
    client_cache = TokenCache(client)
    toks = tokens(300, 32)
    client_cache.store(NS, toks, fill_for(toks))
    server.stop()
    server.start()  # quick restart: the client's socket reconnects by itself, its mapping is stale
    other = tokens(700, 32)
    assert engine("store", server, 700, 32)["stored"] == 2
    with client_cache.retrieve(NS, other) as r:  # refused as stale-arena, then a fresh hello
        assert r.num_tokens in (0, 32) and retrieved_is_exact(r, other)
    with client_cache.retrieve(NS, other) as r:
        assert r.num_tokens == 32 and retrieved_is_exact(r, other)
    client.close()


def test_http_endpoints(server):
    engine("store", server, 100, 40)
    assert server.get("/healthcheck") == {"status": "healthy"}
    status = server.get("/status")
    assert status["tiers"][0]["name"] == "memory" and status["tiers"][0]["objects"] == 3
    assert status["config"]["store"]["chunk_size"] == 16
    metrics = server.get("/metrics")
    for name in ("kvtier_lookups_total", "kvtier_stored_tokens_total 40.0", 'kvtier_tier_usage_bytes{tier="memory"}',
                 'kvtier_tier_capacity_bytes{tier="disk"}', "kvtier_request_seconds_bucket", "kvtier_connected_clients"):
        assert name in metrics
    request = urllib.request.Request(server.http + "/clear-cache", method="POST",
                                     headers={"Authorization": f"Bearer {token_for(server.http)}"})
    assert json.load(urllib.request.urlopen(request))["removed"] >= 3
    assert server.get("/status")["tiers"][0]["objects"] == 0


def test_admin_token_protects_clear(tmp_path):
    proc = ServerProcess(tmp_path, "--admin-token", "s3cret-token").start()
    try:
        for path in ("/clear-cache", "/api/clear-cache"):
            with pytest.raises(urllib.error.HTTPError) as denied:
                urllib.request.urlopen(urllib.request.Request(proc.http + path, method="POST"))
            assert denied.value.code == 401
            request = urllib.request.Request(proc.http + path, method="POST",
                                             headers={"Authorization": "Bearer s3cret-token"})
            assert urllib.request.urlopen(request).status == 200
        assert "s3cret-token" not in json.dumps(proc.get("/status"))
        assert "s3cret-token" not in proc.get("/metrics")
        assert "s3cret-token" not in proc.log.read_text()
        client = KvtierClient(proc.url)
        client_cache = TokenCache(client)
        with pytest.raises(Exception, match="unauthorized"):
            client.clear()
        client.close()
    finally:
        proc.stop()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--l1-size-gb", "0"], "size_gb"),
        (["--l1-size-gb", "1", "--eviction-ratio", "2"], "eviction_ratio"),
        (["--l1-size-gb", "1", "--l2-adapter", "{nope"], "not valid JSON"),
        (["--l1-size-gb", "1", "--l2-adapter", '{"type":"fs"}'], "base_path"),
        (["--l1-size-gb", "1", "--l2-adapter", '{"type":"tape","base_path":"x"}'], "type"),
        (["--l1-size-gb", "1", "--l2-adapter", '{"type":"fs","base_path":"/x","extra":1}'], "extra"),
        (["--l1-size-gb", "1", "--port", "70000"], "port"),
        (["--l1-size-gb", "1", "--log-level", "LOUD"], "log_level"),
        (["--l1-size-gb", "1", "--frobnicate"], "unrecognized"),
        (["--l1-size-gb", "1", "--http-host", "0.0.0.0"], "requires --admin-token"),
        ([], "--l1-size-gb"),
    ],
)
@pytest.mark.slow
def test_bad_config_exits_2_naming_the_problem(flags, message):
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "server", *flags], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2
    assert message in out.stderr


def test_a_disk_tier_folder_other_users_may_read_stops_the_server_with_exit_2(tmp_path):
    """An L2 folder open to other users (as an older kvtier made it, or ``mkdir`` under umask 022)
    stops ``kvtier server`` at start: exit 2, the folder and the fix named, nothing removed."""
    base = tmp_path / "l2"
    base.mkdir(mode=0o755)
    base.chmod(0o755)
    (base / "note.txt").write_text("kept")
    adapter = json.dumps({"type": "fs", "base_path": str(base), "max_capacity_gb": 0.01})
    ports = ("--port", str(free_port()), "--http-port", str(free_port()))  # bound only if it wrongly started
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "server", *ports, "--l1-size-gb", "0.01", "--l2-adapter",
                          adapter], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"L2 {base} may be read or changed by other users (mode 0755" in out.stderr
    assert f"chmod -R go-rwx {base}" in out.stderr
    assert (base / "note.txt").read_text() == "kept"


@pytest.mark.slow
def test_port_in_use_is_a_clear_error(server, tmp_path):
    clash = ServerProcess(tmp_path)
    clash.args[clash.args.index("--port") + 1] = str(server.port)
    out = subprocess.run(clash.args, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "Address already in use" in out.stderr


def test_only_unlocked_arena_files_are_cleared_and_nothing_else_in_shm_stops_a_start(tmp_path, monkeypatch):
    """/dev/shm is the whole host's (on Kubernetes, every pod's): a directory or a file of
    someone else's under a kvtier- name is left there, and the server still starts."""
    import fcntl

    from kvtier.wire import shm

    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    stale, live = tmp_path / "kvtier-4242-0123456789ab", tmp_path / "kvtier-4243-0123456789ab"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    foreign_dir, foreign_file = tmp_path / "kvtier-4244-0123456789ab", tmp_path / "kvtier-bench-work"
    foreign_dir.mkdir()
    foreign_file.write_bytes(b"x")
    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        arena = shm.SharedArena.create(1 << 16)
    try:
        assert arena.path.parent == tmp_path
        assert not stale.exists() and live.exists() and foreign_dir.is_dir() and foreign_file.exists()
    finally:
        arena.close(unlink=True)


@pytest.mark.slow
def test_arena_of_a_killed_server_is_removed_by_the_next_one(server):
    from kvtier.wire.shm import SHM_DIR

    mine = set(SHM_DIR.glob(f"kvtier-{server.proc.pid}-*"))
    assert len(mine) == 2  # the arena and its token file
    server.kill()  # no chance to clean up
    assert all(path.exists() for path in mine)
    server.start()
    assert not any(path.exists() for path in mine)


def test_stale_arena_cleanup_removes_unlocked_arenas_and_leaves_folders_alone(monkeypatch, tmp_path):
    from kvtier.wire import shm

    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    (tmp_path / "kvtier-folder-1").mkdir()  # another program's folder of a matching name
    stale = tmp_path / "kvtier-123-0123456789ab"
    stale.write_bytes(b"x")
    live = shm.SharedArena.create(1 << 20)
    try:
        shm.remove_stale_arenas()
        assert not stale.exists() and (tmp_path / "kvtier-folder-1").is_dir() and live.path.exists()
    finally:
        live.close()


def _lease_count(server: ServerProcess, client: KvtierClient) -> int:
    client.ping()  # carries the handles given back
    status = server.get("/status")
    return status["leases_and_reservations"] - status["reserved_ahead"]


def test_a_lookup_pins_what_the_arena_holds_and_the_load_reads_it_without_a_call(server):
    """The scheduler's lookup leases the hit; the worker's client (another connection) reads the
    objects through its own mapping of the arena without a retrieve, and gives the lease back."""
    scheduler, worker = TokenCache(KvtierClient(server.url)), TokenCache(KvtierClient(server.url))
    toks = tokens(7000, 64)
    assert scheduler.store(NS, toks, fill_for(toks)) == 4
    spans = scheduler.spans(NS, toks)
    worker.key_store.ping()
    before = _lease_count(server, worker.key_store)
    found = scheduler.lookup_spans(spans, pin=True)
    assert found.hit_tokens == 64 and found.pin is not None and set(found.pin.objects) == {s.key for s in spans}
    assert _lease_count(server, worker.key_store) == before + 1
    retrieves = server.get("/status")["traffic"]["requests"].get("retrieve", 0)
    retrieval = worker.retrieve_pinned(NS, spans[1:], found.pin)  # a load past vLLM's own hit
    assert retrieval is not None and [c.span for c in retrieval.chunks] == spans[1:]
    assert retrieved_is_exact(retrieval, toks)
    assert server.get("/status")["traffic"]["requests"].get("retrieve", 0) == retrieves
    retrieval.close()  # given back in the scheduler's session, which holds the lease: by the release thread
    deadline = time.monotonic() + 2
    while _lease_count(server, worker.key_store) != before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _lease_count(server, worker.key_store) == before
    assert "kvtier_foreign_handles_total 0.0" in server.get("/metrics")
    assert scheduler.lookup_spans(spans).pin is None  # asked for only
    scheduler.key_store.close()
    worker.key_store.close()


def test_pinned_objects_outlive_a_clear_until_given_back(server):
    """A pin is a lease: clearing the cache (or evicting) cannot hand its memory to another
    object while a load may still read it."""
    client = KvtierClient(server.url)
    cache = TokenCache(client)
    toks, other = tokens(8000, 32), tokens(8100, 32)
    assert cache.store(NS, toks, fill_for(toks)) == 2
    spans = cache.spans(NS, toks)
    pin = cache.lookup_spans(spans, pin=True).pin
    assert client.clear() >= 2  # memory and disk
    held = _memory_used(server, client)  # the pinned objects' memory is still theirs
    assert cache.store(NS, other, fill_for(other)) == 2  # new objects, elsewhere in the arena
    with cache.retrieve_pinned(NS, spans, pin) as retrieval:
        assert len(retrieval.chunks) == 2 and retrieved_is_exact(retrieval, toks)
    assert cache.lookup_spans(spans).hit_tokens == 0
    assert client.clear() >= 2
    assert _memory_used(server, client) < held  # freed with the retrieval's release
    client.close()


def _memory_used(server: ServerProcess, client: KvtierClient) -> int:
    client.ping()  # carries the handles given back
    [memory] = [t for t in server.get("/status")["tiers"] if t["medium"] == "memory"]
    return memory["used_bytes"]


def test_a_pin_is_refused_where_it_cannot_be_trusted_and_given_back(server):
    client = KvtierClient(server.url)
    cache = TokenCache(client)
    toks = tokens(9500, 32)
    assert cache.store(NS, toks, fill_for(toks)) == 2
    spans = cache.spans(NS, toks)
    before = _lease_count(server, client)
    pin = cache.lookup_spans(spans, pin=True).pin
    stale = dataclasses.replace(pin, leased_at=pin.leased_at - 3600)  # past half the lease timeout
    foreign = dataclasses.replace(pin, arena=b"\0" * len(pin.arena))  # another server's arena
    lacking = dataclasses.replace(pin, objects={spans[0].key: pin.objects[spans[0].key]})
    assert all(cache.retrieve_pinned(NS, spans, p) is None for p in (stale, foreign, lacking))
    frames = TokenCache(KvtierClient(server.url, use_shared_memory=False))  # no mapping of the arena
    assert frames.retrieve_pinned(NS, spans, pin) is None
    assert frames.lookup_spans(spans, pin=True).pin is None and frames.lookup_spans(spans).hit_tokens == 32
    client.unpin(pin)
    assert _lease_count(server, client) == before
    frames.key_store.close()
    client.close()
