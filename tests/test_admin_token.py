"""The HTTP port's admin actions always need a token: without ``--admin-token`` the server makes
one, which only its own user can read and which ``kvtier`` commands of that user find by
themselves (kvtier/server/admin_token.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier.server.admin_token import token_for, token_path
from kvtier_testing.another_user import is_root, run_as_nobody, shared_folder
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.workload import NS, fill_for, tokens

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)


def stored_objects(server: ServerProcess) -> int:
    return server.get("/status")["tiers"][0]["objects"]


def store_some(server: ServerProcess) -> None:
    client = KvtierClient(server.url, timeout_s=5)
    toks = tokens(7000, 48)
    assert TokenCache(client).store(NS, toks, fill_for(toks)) == 3
    client.close()


def kvtier(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=60)


#: As nobody on the server's host: clear the cache without a token, and read the server's token file.
_OUTSIDER = """
import encodings.idna, json, sys, urllib.error, urllib.request  # idna: loaded lazily, from a folder nobody may not read
become_nobody()
http, token_file = sys.argv[1:]
got = {}
for path in ("/clear-cache", "/api/clear-cache"):
    try:
        with urllib.request.urlopen(urllib.request.Request(http + path, method="POST"), timeout=10) as response:
            got[path] = response.status
    except urllib.error.HTTPError as exc:
        got[path] = exc.code
try:
    with open(token_file) as f:
        got["token"] = f.read()
except OSError as exc:
    got["token"] = type(exc).__name__
print(json.dumps(got))
"""


def test_another_user_on_loopback_can_neither_clear_the_cache_nor_read_the_made_token(tmp_path, monkeypatch):
    """A server without --admin-token on loopback: a POST /clear-cache of another local user
    (nobody) without a token is refused and clears nothing, and the token file the server made
    (0600, in a 0700 folder of its user's) cannot be read by that user. The runtime folder above
    it is one every user may walk through, so only the token's own folder and file modes protect it."""
    with shared_folder() as runtime:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
        server = ServerProcess(tmp_path).start()
        try:
            store_some(server)
            made = token_path(server.http_port)
            if is_root():  # no file mode stops root; as non-root, the modes below are the check
                got = run_as_nobody(_OUTSIDER, server.http, str(made))
                assert got == {"/clear-cache": 401, "/api/clear-cache": 401, "token": "PermissionError"}
            assert stored_objects(server) == 3
            assert made.parent.stat().st_mode & 0o777 == 0o700 and made.stat().st_mode & 0o777 == 0o600
            assert made.read_text() == token_for(server.http) and len(token_for(server.http)) >= 32
        finally:
            server.stop()
        assert not made.exists()  # removed at stop


def test_kvtier_kvcache_clear_as_the_servers_user_needs_no_flag(tmp_path):
    """The server's user clears with ``kvtier kvcache clear --url``: the command reads the token
    the server made. A wrong --token is refused with a message that says what to do."""
    server = ServerProcess(tmp_path).start()
    try:
        store_some(server)
        refused = kvtier("kvcache", "clear", "--url", server.http, "--token", "wrong")
        assert refused.returncode == 1 and "refused the admin token" in refused.stderr
        assert stored_objects(server) == 3
        cleared = kvtier("kvcache", "clear", "--url", server.http)
        assert cleared.returncode == 0, cleared.stderr
        assert cleared.stdout.startswith("cleared: 3 objects removed") and stored_objects(server) == 0
    finally:
        server.stop()


def test_a_token_file_is_read_for_loopback_urls_only(monkeypatch, tmp_path):
    """A local token is never sent off the host: a URL that is not on loopback gets none."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    token_path(8080).parent.mkdir(mode=0o700)
    token_path(8080).write_text("local-token")
    assert token_for("http://127.0.0.1:8080") == token_for("http://localhost:8080/") == "local-token"
    for url in ("http://10.0.0.5:8080", "http://kvtier.example:8080", "http://127.0.0.1:8081", "http://[::1]:x"):
        assert token_for(url) == "", url
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert str(token_path(8080)).startswith(os.path.expanduser("~/.cache/kvtier/"))


def test_the_router_asks_a_local_server_with_the_token_it_made(tmp_path):
    """``kvtier router``'s cache-aware lookups reach a server on its host without a flag: it reads
    the server's made token for each kvtier URL."""
    import asyncio

    import msgspec

    from kvtier.router.cache_aware import CacheAware
    from kvtier.router.instances import Instance

    server = ServerProcess(tmp_path).start()
    try:
        store_some(server)
        namespace = {"model": NS.model, "revision": NS.revision, "layout": msgspec.to_builtins(NS.layout)}
        instances = [Instance("http://127.0.0.1:1", kvtier=server.http)]  # no vLLM: only its kvtier is asked
        policy = CacheAware(instances, None, namespace, lookup_timeout_s=10)

        async def ask() -> dict:
            try:
                return await policy.kvtier_prefixes(instances, tokens(7000, 48).tolist(), None)
            finally:
                await policy.close()

        answers = asyncio.run(ask())
        assert answers[server.http]["prefix_tokens"] == 48 and policy.counts["kvtier_lookup_failures"] == 0
    finally:
        server.stop()


def test_a_server_starts_beside_the_usual_kvtier_cache_folder(tmp_path, monkeypatch):
    """Without XDG_RUNTIME_DIR the token goes to a folder of its own under ``~/.cache/kvtier``,
    which the demo and the test harness make with the usual modes (0755): that folder must not
    stop a server from starting (it did when the token's folder was ``~/.cache/kvtier`` itself)."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home" / ".cache" / "kvtier").mkdir(mode=0o755, parents=True)
    os.chmod(tmp_path / "home" / ".cache" / "kvtier", 0o755)
    server = ServerProcess(tmp_path).start()
    try:
        made = token_path(server.http_port)
        assert made.parent == tmp_path / "home" / ".cache" / "kvtier" / "admin-tokens"
        assert made.parent.stat().st_mode & 0o777 == 0o700 and made.read_text() == token_for(server.http)
    finally:
        server.stop()
