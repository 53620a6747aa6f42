"""Tier identity and the adapter registry: every tier has a unique id that names its medium."""

import pytest

from kvtier.build import build_store
from kvtier.config import StoreConfig, parse_adapter
from kvtier.errors import ConfigError
from kvtier.events import Medium
from kvtier.schema import convert
from kvtier.tiers.base import medium_of
from kvtier.tiers.registry import ADAPTER_TYPES, tier_ids


def adapters(*items):
    return [parse_adapter(item) for item in items]


def test_every_medium_module_registers_its_adapter_type():
    assert {tag: cls.medium for tag, cls in ADAPTER_TYPES.items()} == {
        "fs": Medium.DISK, "redis": Medium.REDIS, "s3": Medium.S3,
    }


def test_a_tier_alone_on_its_medium_is_named_by_the_medium():
    assert tier_ids(adapters('{"type":"fs","base_path":"/a"}', '{"type":"s3","bucket":"abc"}')) == ["disk", "s3"]


def test_two_disk_tiers_are_told_apart_by_index_or_by_name():
    two = adapters('{"type":"fs","base_path":"/a"}', '{"type":"fs","base_path":"/b"}')
    assert tier_ids(two) == ["disk-0", "disk-1"]
    named = adapters('{"type":"fs","base_path":"/a","name":"nvme"}', '{"type":"fs","base_path":"/b"}')
    assert tier_ids(named) == ["disk-nvme", "disk"]
    assert [medium_of(t) for t in tier_ids(two + named)] == [Medium.DISK] * 4
    assert medium_of("memory") is Medium.MEMORY and medium_of("tape-1") is None


def test_clashing_ids_and_bad_names_are_config_errors():
    with pytest.raises(ConfigError, match="'disk-0'"):
        convert({"l1": {"size_gb": 1}, "l2_adapters": [
            {"type": "fs", "base_path": "/a", "name": "0"}, {"type": "fs", "base_path": "/b"},
            {"type": "fs", "base_path": "/c"}]}, StoreConfig)
    with pytest.raises(ConfigError, match="name"):
        parse_adapter('{"type":"fs","base_path":"/a","name":"no spaces"}')
    with pytest.raises(ConfigError, match=r"adapter type must be one of \['fs', 'redis', 's3'\]"):
        parse_adapter('{"type":"tape"}')


def test_store_tiers_carry_their_ids_and_media(tmp_path):
    config = convert({"l1": {"size_gb": 0.001}, "l2_adapters": [
        {"type": "fs", "base_path": str(tmp_path / "a")},
        {"type": "fs", "base_path": str(tmp_path / "b"), "name": "slow", "codec": "zstd"}]}, StoreConfig)
    store = build_store(config)
    try:
        assert [(t.name, t.medium) for t in store.tiers] == [
            ("memory", Medium.MEMORY), ("disk", Medium.DISK), ("disk-slow", Medium.DISK)]
    finally:
        store.close()


def test_a_tier_that_fails_to_build_releases_the_ones_built_before(tmp_path):
    config = convert({"l1": {"size_gb": 0.001}, "l2_adapters": [
        {"type": "fs", "base_path": str(tmp_path / "a")}, {"type": "fs", "base_path": str(tmp_path / "a")}]},
        StoreConfig)
    with pytest.raises(ConfigError, match="in use by another DiskTier"):
        build_store(config)
    build_store(config.__class__(l1=config.l1, l2_adapters=config.l2_adapters[:1])).close()  # lock released


@pytest.mark.parametrize(
    "adapter, message",
    [
        ('{"type": "redis", "url": "redis://:secret@127.0.0.1:6379"}', "password_env"),
        ('{"type": "redis", "url": "http://127.0.0.1:6379"}', "redis:// or rediss://"),
        ('{"type": "redis", "url": "redis://h", "ssl_ca_certs": "/ca.pem"}', "rediss://"),
        ('{"type": "redis", "url": "redis://h/3", "cluster": true}', "database 0"),
        ('{"type": "redis", "url": "redis://h", "startup_nodes": ["h2:6379"]}', "needs cluster: true"),
        ('{"type": "redis", "url": "redis://h", "cluster": true, "startup_nodes": ["h2"]}', "host:port, got 'h2'"),
        ('{"type": "redis", "url": "redis://h", "cluster": true, "startup_nodes": ["h2:0"]}', "host:port"),
        ('{"type": "redis", "url": "redis://h", "cluster": true, "startup_nodes": [":6379"]}', "host:port"),
        ('{"type": "redis", "url": "redis://h", "cluster": true, "startup_nodes": "h2:6379"}', "Expected `array`"),
        ('{"type": "redis", "url": "redis://h", "ttl_s": 0}', "ttl_s"),
        ('{"type": "redis", "url": "redis://h", "codec": "lz9"}', "unknown codec"),
        ('{"type": "redis", "url": "redis://h", "port": 1}', "port"),
        ('{"type": "s3", "bucket": "b"}', "length"),
        ('{"type": "s3", "bucket": "kv-bucket", "endpoint_url": "ftp://h"}', "http"),
        ('{"type": "s3", "bucket": "kv-bucket", "endpoint_url": "http://ak:sk@h"}', "credentials"),
        ('{"type": "s3", "bucket": "kv-bucket", "aws_secret_access_key": "x"}', "aws_secret_access_key"),
        ('{"type": "s3", "bucket": "kv-bucket", "multipart_threshold_mb": 1}', "multipart_threshold_mb"),
        ('{"type": "fs", "base_path": ""}', "length"),
    ],
)
def test_bad_adapters_are_config_errors(adapter, message):
    with pytest.raises(ConfigError, match=message):
        parse_adapter(adapter)


WITHOUT_REMOTE_EXTRA = """
import sys
for name in ("boto3", "botocore", "redis"):
    sys.modules[name] = None  # as in a base install, without the [remote] extra
from kvtier.build import build_store
from kvtier.config import StoreConfig, parse_adapter
from kvtier.errors import ConfigError
from kvtier.schema import convert
def config(adapter):
    return convert({"l1": {"size_gb": 0.01}, "l2_adapters": [parse_adapter(adapter)]}, StoreConfig)
store = build_store(config(sys.argv[1]))
print("built", [tier.name for tier in store.tiers])
store.close()
for adapter in ('{"type":"s3","bucket":"abc"}', '{"type":"redis","url":"redis://127.0.0.1:1"}'):
    try:
        build_store(config(adapter))
    except ConfigError as exc:
        print("refused", exc)
"""


def test_a_base_install_builds_local_tiers_and_names_the_extra_for_remote_ones(tmp_path):
    """Without redis-py and boto3 every adapter type still parses, local tiers build, and a
    remote tier is a ConfigError that says which extra to install (not an ImportError at start)."""
    import subprocess
    import sys

    fs = f'{{"type":"fs","base_path":"{tmp_path}","max_capacity_gb":0.01}}'
    run = subprocess.run([sys.executable, "-c", WITHOUT_REMOTE_EXTRA, fs], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "built ['memory', 'disk']"
    assert len(lines) == 3 and all(line.startswith("refused") and "kvtier[remote]" in line for line in lines[1:]), lines
