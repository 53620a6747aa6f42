"""CurveZMQ on the data port: a server others can reach admits only clients whose key it lists,
refused peers disturb nobody, and missing or too open keys stop a start before anything binds.

Tests bind loopback only: Curve is forced on there with ``--curve`` (what a non-loopback host
implies), and the non-loopback checks run on the config, which is validated before binding.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import pytest

from kvtier.cache import TokenCache
from kvtier.cli import main as cli
from kvtier.client import KvtierClient
from kvtier.config import ServerConfig, convert
from kvtier.errors import ConfigError
from kvtier.server.main import KvtierServer
from kvtier.wire.curve import generate
from kvtier_testing.kvtier_processes import ServerProcess, free_port
from kvtier_testing.workload import NS, fill_for, retrieved_is_exact, tokens

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)


#: A ZMTP 3.0 greeting offering the NULL mechanism: a peer that speaks ZeroMQ without Curve.
NULL_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)


def base_config(**overrides) -> dict:
    return {"store": {"l1": {"size_gb": 0.02}, "chunk_size": 16}, "port": free_port(), "http_port": free_port(),
            **overrides}


@pytest.fixture
def keys(tmp_path) -> dict[str, Path]:
    """Two servers' key pairs, an allowed engine, an intruder; ``allowed``: the engine's public key."""
    paths = {}
    for name in ("server1", "server2", "engine", "intruder"):
        public, secret = generate(tmp_path / name, name)
        paths[name], paths[name + "_secret"] = public, secret
    allowed = tmp_path / "allowed"
    allowed.mkdir(mode=0o700)
    (allowed / "engine.key").write_bytes(paths["engine"].read_bytes())
    paths["allowed"] = allowed
    return paths


def test_keys_generate_writes_owner_only_files_and_never_overwrites(tmp_path, capsys):
    assert cli(["keys", "generate", "--dir", str(tmp_path / "k"), "host1"]) == 0
    for name in ("host1.key", "host1.key_secret"):
        assert (tmp_path / "k" / name).stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o700
    with pytest.raises(SystemExit) as exit:
        cli(["keys", "generate", "--dir", str(tmp_path / "k"), "host1"])
    assert exit.value.code == 2 and "exists already" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "kv.internal", "eth0", "::", "*"])
def test_a_data_port_others_can_reach_refuses_to_start_without_keys(host, capsys):
    with pytest.raises(ConfigError, match=re.escape(f"on {host} (not loopback) requires CurveZMQ keys")):
        convert(base_config(host=host), ServerConfig)
    with pytest.raises(SystemExit) as exit:  # the command line says the same, and binds nothing
        cli(["server", "--l1-size-gb", "0.01", "--host", host, "--no-curve"])
    assert exit.value.code == 2 and "requires CurveZMQ keys" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_keys_unless_curve_is_asked_for(host):
    assert not convert(base_config(host=host), ServerConfig).uses_curve
    with pytest.raises(ConfigError, match="--curve requires CurveZMQ keys"):
        convert(base_config(host=host, curve=True), ServerConfig)


def test_missing_or_too_open_key_files_stop_the_server_before_it_binds(keys, tmp_path):
    def refused(message: str, **files) -> None:
        config = convert(base_config(host="10.1.2.3", **{
            "curve_secret_key": str(keys["server1_secret"]), "curve_clients_dir": str(keys["allowed"]), **files}),
            ServerConfig)
        with pytest.raises(ConfigError, match=message):
            KvtierServer(config)  # binding would fail on this host: the keys are refused first

    refused("does not exist", curve_secret_key=str(tmp_path / "nope.key_secret"))
    keys["server1"].with_name("only-public.key").write_bytes(keys["server1"].read_bytes())
    keys["server1"].with_name("only-public.key").chmod(0o600)
    refused("holds no secret key", curve_secret_key=str(keys["server1"].with_name("only-public.key")))
    junk = tmp_path / "junk.key_secret"
    junk.write_text("not a certificate")
    junk.chmod(0o600)
    refused("not a ZeroMQ certificate", curve_secret_key=str(junk))
    keys["server1_secret"].chmod(0o640)
    refused(r"readable by others \(mode 0640\); chmod 600")
    keys["server1_secret"].chmod(0o600)
    refused("folder .* does not exist", curve_clients_dir=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir(mode=0o700)
    refused("holds no client public key", curve_clients_dir=str(tmp_path / "empty"))
    keys["allowed"].chmod(0o777)
    refused(r"writable by others \(mode 0777\)")
    keys["allowed"].chmod(0o700)

    with pytest.raises(ConfigError, match="both"):
        KvtierClient("tcp://127.0.0.1:1", curve_secret_key=str(keys["engine_secret"]))
    keys["engine_secret"].chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        KvtierClient("tcp://127.0.0.1:1", curve_secret_key=str(keys["engine_secret"]),
                     curve_server_key=str(keys["server1"]))


def _intruders(url: str, keys: dict, server: str) -> list[KvtierClient]:
    """No key; a key the server does not list; the allowed key but another server's public key."""
    return [
        KvtierClient(url, timeout_s=0.3),
        KvtierClient(url, timeout_s=0.3, curve_secret_key=str(keys["intruder_secret"]),
                     curve_server_key=str(keys[server])),
        KvtierClient(url, timeout_s=0.3, curve_secret_key=str(keys["engine_secret"]),
                     curve_server_key=str(keys["server2" if server == "server1" else "server1"])),
    ]


@pytest.mark.slow
def test_two_servers_admit_the_allowed_key_only_and_refused_peers_disturb_nobody(keys, tmp_path):
    first = KvtierServer(convert(base_config(curve=True, curve_secret_key=str(keys["server1_secret"]),
                                             curve_clients_dir=str(keys["allowed"])), ServerConfig))
    first.start()
    (tmp_path / "second").mkdir()
    second = ServerProcess(tmp_path / "second", "--curve", "--curve-secret-key", str(keys["server2_secret"]),
                           "--curve-clients-dir", str(keys["allowed"])).start()  # the command line's flags
    urls = {"server1": f"tcp://127.0.0.1:{first.config.port}", "server2": second.url}
    stop = threading.Event()
    intruder_results: list = []

    def intrude(url: str, server: str) -> None:
        clients = _intruders(url, keys, server)
        toks = tokens(0, 64)  # the prompt the engine stores: the intruders may neither read nor write it
        while not stop.is_set():
            for client in clients:
                cache = TokenCache(client)
                intruder_results.append(("ping", client.ping()))
                intruder_results.append(("store", cache.store(NS, tokens(5_000_000, 64), fill_for(tokens(5_000_000, 64)))))
                with cache.retrieve(NS, toks) as got:
                    intruder_results.append(("read", got.num_tokens))
                client._backoff.succeeded()  # no backoff: knock as often as possible
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=1) as raw:
                raw.sendall(NULL_GREETING)
        for client in clients:
            client.close()

    threads = [threading.Thread(target=intrude, args=(urls[s], s)) for s in urls]
    for thread in threads:
        thread.start()
    try:
        engines = {}
        for server, url in urls.items():
            for shared_memory in (True, False):  # frames: the KV itself crosses the encrypted link
                engine = KvtierClient(url, timeout_s=5, use_shared_memory=shared_memory,
                                      curve_secret_key=str(keys["engine_secret"]), curve_server_key=str(keys[server]))
                engines[server, shared_memory] = engine
        start, slowest, round = time.monotonic(), 0.0, 0
        while round < 20 or time.monotonic() - start < 3:  # long enough for the intruders to knock many times
            for (server, shared_memory), engine in engines.items():
                cache = TokenCache(engine)
                toks = tokens(0 if round == 0 else 100_000 * round + shared_memory * 50_000, 64)
                began = time.monotonic()
                cache.store(NS, toks, fill_for(toks))
                with cache.retrieve(NS, toks) as got:
                    assert got.num_tokens == 64 and retrieved_is_exact(got, toks), (server, shared_memory, round)
                if round:  # the first pair also makes each engine's CurveZMQ handshake and hellos
                    slowest = max(slowest, time.monotonic() - began)
            round += 1
        for (server, shared_memory), engine in engines.items():
            assert (engine._arena is not None) == shared_memory  # shared memory is as it was
            assert engine.stats.timeouts == 0 and engine.stats.server_errors == 0, engine.stats
            engine.close()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        refused = [first.service.status()["refused_peers"], second.get("/status")["refused_peers"]]
        first.stop()
        second.stop()
    print(f"{4 * round} authenticated store+read pairs (slowest {slowest * 1000:.0f} ms) beside "
          f"{len(intruder_results)} refused calls; refused handshakes {refused}")
    assert slowest < 2.0 and len(intruder_results) >= 20 and all(refused), (slowest, refused)  # a loaded host's stall, not a wedge
    assert {what for what, result in intruder_results if result} == set(), "an intruder got an answer"


def test_the_connector_config_gives_the_engine_its_keys(keys):
    from kvtier.integrations.vllm.config import parse_extra_config
    from kvtier.integrations.vllm.keystores import close_cache, open_cache

    server = KvtierServer(convert(base_config(curve=True, curve_secret_key=str(keys["server1_secret"]),
                                              curve_clients_dir=str(keys["allowed"])), ServerConfig))
    server.start()
    try:
        extra = {"kvtier.url": f"tcp://127.0.0.1:{server.config.port}", "kvtier.timeout_s": 5}
        keyed = {**extra, "kvtier.curve_secret_key": str(keys["engine_secret"]),
                 "kvtier.curve_server_key": str(keys["server1"])}
        toks = tokens(7_000, 64)
        cache = open_cache(parse_extra_config(keyed))
        assert cache.store(NS, toks, fill_for(toks)) == 4 and cache.lookup(NS, toks).hit_tokens == 64
        close_cache(cache)
        keyless = open_cache(parse_extra_config({**extra, "kvtier.timeout_s": 0.3}))
        assert keyless.lookup(NS, toks).hit_tokens == 0  # refused: a miss, never an error
        close_cache(keyless)
    finally:
        server.stop()
