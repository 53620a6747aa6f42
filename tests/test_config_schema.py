"""One schema, every surface: ``kvtier server``'s flags and the connector's keys come from the
msgspec structs, with their defaults, bounds and help text, and nothing restated."""

import argparse

import msgspec
import pytest

from kvtier.config import ServerConfig, StoreConfig
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import parse_extra_config
from kvtier.schema import add_flags, from_args, options
from kvtier.tiers.disk import FsAdapterConfig


def server_config(argv, environ=None) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_flags(parser, ServerConfig)
    return from_args(ServerConfig, parser.parse_args(argv), environ or {})


def test_every_option_of_the_server_is_a_flag_with_help():
    parser = argparse.ArgumentParser()
    add_flags(parser, ServerConfig)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    for option in options(ServerConfig):
        assert option.flag in flags and option.description, option.key
    help_text = parser.format_help()
    assert "--l1-size-gb" in help_text and "(required)" in help_text and "(default 256)" in help_text


def test_defaults_come_from_the_structs():
    config = server_config(["--l1-size-gb", "2"])
    assert config == ServerConfig(store=msgspec.convert({"l1": {"size_gb": 2}}, StoreConfig))


def test_flags_and_their_older_names_set_the_nested_fields():
    config = server_config([
        "--l1-size-gb", "0.5", "--eviction-policy", "FIFO", "--l1-eviction-ratio", "0.1",
        "--eviction-trigger-watermark", "0.9", "--chunk-size", "128", "--port", "6000",
        "--l2-adapter", '{"type": "fs", "base_path": "/a"}', "--l2-adapter", '{"type": "fs", "base_path": "/b"}',
    ])
    l1 = config.store.l1
    assert (l1.size_gb, l1.eviction_policy, l1.eviction_ratio, l1.eviction_trigger_watermark) == (0.5, "FIFO", 0.1, 0.9)
    assert config.store.chunk_size == 128 and config.port == 6000
    assert config.store.l2_adapters == [FsAdapterConfig(base_path="/a"), FsAdapterConfig(base_path="/b")]


def test_environment_fills_what_flags_leave_out():
    environ = {"KVTIER_ADMIN_TOKEN": "from-env", "KVTIER_LOG_LEVEL": "debug"}
    config = server_config(["--l1-size-gb", "1"], environ)
    assert (config.admin_token, config.log_level) == ("from-env", "debug")
    assert server_config(["--l1-size-gb", "1", "--admin-token", "flag"], environ).admin_token == "flag"


@pytest.mark.parametrize("argv, message", [
    (["--l1-size-gb", "big"], "--l1-size-gb: Expected `float`"),
    (["--l1-size-gb", "1", "--eviction-ratio", "2"], "--l1-eviction-ratio: Expected `float` <= 1"),
    (["--l1-size-gb", "1", "--l2-adapter", '{"type": "fs"}'], "--l2-adapter: Object missing required field `base_path`"),
    (["--l1-size-gb", "1", "--lease-timeout-s", "0"], "--lease-timeout-s: Expected `float` > 0"),
])
def test_bad_values_name_their_flag(argv, message):
    with pytest.raises(ConfigError) as info:
        server_config(argv)
    assert message in str(info.value)


def test_connector_embeds_the_store_config_with_the_same_keys_as_the_flags():
    config = parse_extra_config({"kvtier.l1_eviction_trigger_watermark": 0.9, "kvtier.l1_eviction_ratio": 0.05})
    l1 = config.store.l1
    assert (l1.eviction_trigger_watermark, l1.eviction_ratio, l1.size_gb) == (0.9, 0.05, 1.0)  # size: the default
    assert parse_extra_config({}).store == StoreConfig(l1=msgspec.convert({"size_gb": 1.0}, type(l1)))
    server_keys = {option.key for option in options(ServerConfig) if option.path[0] == "store"}
    with pytest.raises(ConfigError, match="unknown kvtier connector keys") as info:
        parse_extra_config({"kvtier.nope": 1})
    assert all(f"kvtier.{key}" in str(info.value) for key in server_keys)


@pytest.mark.parametrize("extra, message", [
    ({"kvtier.l1_eviction_ratio": 1.5}, "kvtier.l1_eviction_ratio: Expected `float` <= 1"),
    ({"kvtier.l1_eviction_ratio": "0.5"}, "kvtier.l1_eviction_ratio: Expected `float`, got `str`"),
    ({"kvtier.url": "tcp://127.0.0.1:1", "kvtier.l1_eviction_ratio": 0.5}, "the server owns the tiers"),
])
def test_connector_keys_are_checked_like_flags(extra, message):
    with pytest.raises(ConfigError) as info:
        parse_extra_config(extra)
    assert message in str(info.value)
