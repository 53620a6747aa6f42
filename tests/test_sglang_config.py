"""The SGLang backend's config (``kvtier.integrations.sglang.config``): every bad key or value is an
error naming it at start, before SGLang attaches the backend. The backend itself is tested against
SGLang's classes in tests_sglang/ (``make test-sglang``)."""

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.sglang.config import parse_extra_config

SGLANG = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang.storage", "class_name": "KvtierStorage"}


def test_server_mode_and_sglang_keys():
    config = parse_extra_config({**SGLANG, "interface_v1": 1, "kvtier.url": "tcp://127.0.0.1:5555",
                                 "kvtier.timeout_s": 0.2, "kvtier.namespace": "team-a", "kvtier.tenant": "team-a"})
    assert (config.url, config.timeout_s, config.namespace, config.tenant) == ("tcp://127.0.0.1:5555", 0.2, "team-a", "team-a")


def test_embedded_store_keys_are_flat():
    config = parse_extra_config({**SGLANG, "kvtier.l1_size_gb": 0.25,
                                 "kvtier.l2_adapters": [{"type": "fs", "base_path": "/tmp/x", "max_capacity_gb": 1}]})
    assert config.url is None and config.store.l1.size_gb == 0.25 and len(config.store.l2_adapters) == 1


@pytest.mark.parametrize("extra, names", [
    ({"file_storage_path": "/tmp"}, "file_storage_path"),
    ({"kvtier.nope": 1}, "kvtier.nope"),
    ({"kvtier.url": "http://x"}, "kvtier.url"),
    ({"kvtier.url": "tcp://127.0.0.1:1", "kvtier.l1_size_gb": 1}, "kvtier.l1_size_gb"),
    ({"kvtier.timeout_s": 1}, "kvtier.timeout_s"),
    ({"kvtier.url": "tcp://127.0.0.1:1", "kvtier.timeout_s": -1}, "kvtier.timeout_s"),
    ({"kvtier.tenant": "a tenant"}, "kvtier.tenant"),
    ({"kvtier.url": "tcp://127.0.0.1:1", "kvtier.curve_secret_key": "k"}, "kvtier.curve_server_key"),
])
def test_bad_keys_and_values_are_named(extra, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        parse_extra_config({**SGLANG, **extra})
