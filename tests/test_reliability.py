"""Reliability with real server processes: chaos, load, disk faults, HTTP fuzzing, isolation.
The promises are in docs/reliability.md; bench/chaos.py and bench/load.py hold the longer runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier.keys import Namespace
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.workload import LAYOUT, NS, fill_for, retrieved_is_exact, tokens

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_bench(name: str, *flags: str) -> dict:
    out = subprocess.run([sys.executable, str(BENCH / name), *flags], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow
def test_chaos_kills_never_give_wrong_bytes_or_hangs():
    result = run_bench("chaos.py", "--quick")
    assert result["kills"] == 10 and result["server_exits_unkilled"] == 0  # each kill hit a running server
    assert result["wrong_bytes"] == 0 and result["client_hangs"] == 0
    assert result["clients_finished"] == result["clients"]
    assert result["disk_files_scanned"] > 0 and result["disk_files_corrupt"] == 0
    assert result["hits"] > 0 and result["misses"] > 0  # the kills were felt, and the cache still served
    assert result["max_rss_over_l1_mb"] < 200


@pytest.mark.slow
def test_load_stays_within_capacity_without_errors():
    result = run_bench("load.py", "--quick")
    assert result["clients_finished"] == result["clients"] == 8
    assert result["wrong_bytes"] == 0 and result["client_hangs"] == 0 and result["client_errors"] == 0
    assert result["tiers_over_capacity"] == []
    assert result["l1_evictions"] > 0  # the working set did not fit
    assert result["max_rss_over_l1_mb"] < 200


# -- disk faults ---------------------------------------------------------------------------------


@contextmanager
def mounted(target: Path, *how: str):
    """``mount *how target`` for the block, or skip where mounting is not allowed (it needs root or
    CAP_SYS_ADMIN; CI runs as root). tests/test_disk_faults.py injects the same faults anywhere."""
    target.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", *how, str(target)], capture_output=True, text=True)
    if mount.returncode != 0:
        said = (mount.stderr.strip().splitlines() or ["failed"])[0].rsplit(": ", 1)[-1]  # no per-test path
        pytest.skip(f"mount is not allowed here (needs root or CAP_SYS_ADMIN): {said}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def fs_server(tmp_path: Path, base: Path, capacity_gb: float) -> ServerProcess:
    adapter = json.dumps({"type": "fs", "base_path": str(base), "max_capacity_gb": capacity_gb})
    return ServerProcess(tmp_path, "--l2-adapter", adapter).start()


def l2(server: ServerProcess) -> dict:
    return server.get("/status")["tiers"][1]


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_disk_full_keeps_serving_and_recovers(tmp_path):
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=512k", "tmpfs") as small:
        server = fs_server(tmp_path, small / "l2", capacity_gb=0.01)  # the tier thinks it has 10 MB
        try:
            client = KvtierClient(server.url, timeout_s=5)
            client_cache = TokenCache(client)
            for p in range(60):  # about 1.3 MB of objects for a 512 KiB filesystem
                toks = tokens(p * 1000, 80)
                assert client_cache.store(NS, toks, fill_for(toks)) == 5
            wait_for(lambda: l2(server)["stats"]["errors"] > 0)
            assert server.get("/healthcheck") == {"status": "healthy"}
            assert l2(server)["healthy"] is False and 'kvtier_tier_healthy{tier="disk"} 0.0' in server.get("/metrics")
            toks = tokens(59 * 1000, 80)
            with client_cache.retrieve(NS, toks) as r:  # served from L1 all the same
                assert r.num_tokens == 80 and retrieved_is_exact(r, toks)
            client.clear()  # frees the disk
            wait_for(lambda: l2(server)["objects"] == 0)
            puts = l2(server)["stats"]["puts"]
            toks = tokens(99_000, 32)
            client_cache.store(NS, toks, fill_for(toks))
            wait_for(lambda: l2(server)["stats"]["puts"] == puts + 2)  # writes work again
            assert l2(server)["healthy"] is True
            client.close()
        finally:
            server.stop()


@pytest.mark.slow
def test_files_damaged_behind_the_servers_back_are_misses(tmp_path):
    base = tmp_path / "l2"
    server = fs_server(tmp_path, base, capacity_gb=0.05)
    try:
        for p in range(4):
            toks = tokens(p * 1000, 32)  # two chunks each
            TokenCache(KvtierClient(server.url)).store(NS, toks, fill_for(toks))
        wait_for(lambda: l2(server)["objects"] == 8)
        server.stop()
        server.start()  # L1 is empty now: every hit comes from disk
        client = KvtierClient(server.url, timeout_s=5)
        client_cache = TokenCache(client)
        files = {p: [base / f"{s.key.hex()}.kv" for s in client_cache.lookup(NS, tokens(p * 1000, 32)).spans]
                 for p in range(4)}
        assert all(len(f) == 2 for f in files.values())
        data = bytearray(files[0][0].read_bytes())
        data[200] ^= 0xFF
        files[0][0].write_bytes(data)  # corrupted
        files[1][0].write_bytes(files[1][0].read_bytes()[:100])  # truncated
        files[2][1].unlink()  # deleted
        expected = {0: 0, 1: 0, 2: 16, 3: 32}
        for p, hit in expected.items():
            toks = tokens(p * 1000, 32)
            with client_cache.retrieve(NS, toks) as r:
                assert r.num_tokens == hit and retrieved_is_exact(r, toks)
        assert l2(server)["stats"]["corrupt"] == 2
        assert not files[0][0].exists() and not files[1][0].exists()
        assert server.get("/healthcheck") == {"status": "healthy"}
        client.close()
    finally:
        server.stop()


def test_read_only_directory_keeps_serving_and_recovers(tmp_path):
    base = tmp_path / "l2"
    base.mkdir(mode=0o700)  # the disk tier refuses a folder other users may read
    server = fs_server(tmp_path, base, capacity_gb=0.05)
    try:
        client = KvtierClient(server.url, timeout_s=5)
        client_cache = TokenCache(client)
        with mounted(base, "--bind", str(base)):
            subprocess.run(["mount", "-o", "remount,ro,bind", str(base)], check=True)
            toks = tokens(1000, 32)
            assert client_cache.store(NS, toks, fill_for(toks)) == 2
            wait_for(lambda: l2(server)["stats"]["errors"] >= 2)
            assert l2(server)["healthy"] is False
            with client_cache.retrieve(NS, toks) as r:
                assert r.num_tokens == 32 and retrieved_is_exact(r, toks)
        toks = tokens(2000, 32)  # the bind mount is gone: writable again
        client_cache.store(NS, toks, fill_for(toks))
        wait_for(lambda: l2(server)["objects"] == 2)
        assert l2(server)["healthy"] is True
        client.close()
    finally:
        server.stop()


# -- HTTP fuzzing ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("http"), "--admin-token", "fuzz-token").start()
    yield server
    server.stop()


paths = st.one_of(
    st.sampled_from(["/healthcheck", "/status", "/metrics", "/clear-cache", "/api/clear-cache", "/dashboard",
                     "/docs", "/openapi.json", "/", "/../etc/passwd", "/status?x=1", "/clear-cache/../status"]),
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=40).map(lambda s: "/" + s),
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]), path=paths,
       auth=st.one_of(st.none(), st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30),
                      st.just("Bearer fuzz-token-wrong")),
       body=st.binary(max_size=200))
def test_http_api_never_answers_500_or_hangs(http_server, method, path, auth, body):
    from urllib.parse import quote

    url = http_server.http + quote(path, safe="/?=&%")
    request = urllib.request.Request(url, method=method, data=body or None)
    if auth is not None:
        request.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    assert status < 500
    if "clear-cache" in path and method == "POST":
        assert status in (401, 404, 405)  # never cleared without the token


# -- isolation and access -------------------------------------------------------------------------


def test_tenants_never_see_each_others_kv(tmp_path):
    server = ServerProcess(tmp_path).start()
    try:
        client = KvtierClient(server.url)
        client_cache = TokenCache(client)
        alice = Namespace(model="workload", layout=LAYOUT, tenant_salt=b"tenant-a")
        bob = Namespace(model="workload", layout=LAYOUT, tenant_salt=b"tenant-b")
        toks = tokens(0, 64)
        assert client_cache.store(alice, toks, fill_for(toks)) == 4
        assert client_cache.lookup(bob, toks).hit_tokens == 0
        with client_cache.retrieve(bob, toks) as r:
            assert r.num_tokens == 0
        assert client_cache.lookup(alice, toks).hit_tokens == 64
        status = json.dumps(server.get("/status")) + server.get("/metrics")
        for secret in (b"tenant-a", alice.root):
            assert secret.hex() not in status and "tenant-a" not in status
        client.close()
    finally:
        server.stop()


def listening_addresses(pid: int) -> set[str]:
    """host:port of the process's listening TCP sockets, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = str(fd.readlink()) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.add(f"{address}:{int(port, 16)}")
    return found


def test_servers_bind_loopback_by_default(tmp_path):
    server = ServerProcess(tmp_path).start()
    try:
        addresses = listening_addresses(server.proc.pid)
        assert addresses == {f"0100007F:{server.port}", f"0100007F:{server.http_port}"}  # 127.0.0.1 only
    finally:
        server.stop()


@pytest.mark.slow
def test_base_path_cannot_reach_outside_files(tmp_path):
    """Symlinks named like objects are not followed, foreign files are never deleted, and a
    clear removes only kvtier's own files."""
    base = tmp_path / "l2"
    base.mkdir(mode=0o700)  # the disk tier refuses a folder other users may read
    outside = tmp_path / "secret.txt"
    outside.write_text("do not touch")
    fake_key = "ab" * 32
    (base / f"{fake_key}.kv").symlink_to(outside)
    (base / "notes.txt").write_text("mine")
    server = fs_server(tmp_path, base, capacity_gb=0.01)
    try:
        client = KvtierClient(server.url)
        client_cache = TokenCache(client)
        toks = tokens(0, 32)
        client_cache.store(NS, toks, fill_for(toks))
        wait_for(lambda: l2(server)["objects"] == 2)
        client.clear()
        client.close()
    finally:
        server.stop()
    assert outside.read_text() == "do not touch"
    assert (base / "notes.txt").read_text() == "mine"
    assert [p.name for p in base.glob("*.kv")] == [f"{fake_key}.kv"]  # kvtier's two objects are gone
    assert (base / f"{fake_key}.kv").is_symlink()
