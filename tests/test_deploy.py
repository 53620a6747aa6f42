"""deploy/'s Kubernetes manifests, checked offline. Every object passes the Kubernetes API schema
(strict: an unknown field is an error) that kubernetes-validate bundles; and what a schema cannot
know is checked against the programs themselves: the kvtier server's arguments, with the ConfigMap
and environment they expand from, through kvtier's own parser; vLLM's through vLLM's parser, and its
connector keys through the connector's; the router's through ``kvtier router``'s; probes on a real
server and the router's app; the CurveZMQ keys, as the Secret and the init containers lay them out,
on a real server and engine; ports, names, users and Secret keys that must agree across objects.
Each kind of check has a negative control."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import subprocess
import urllib.error
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from fastapi.testclient import TestClient
from kubernetes_validate.utils import ValidationError, validate
from packaging.requirements import Requirement

from kvtier.config import ServerConfig
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import parse_extra_config
from kvtier.schema import GB, add_flags, from_args
from kvtier.tiers.disk import FsAdapterConfig
from kvtier.tiers.redis import RedisAdapterConfig
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.workload import NS, fill_for, tokens

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.37"
#: What the downward API gives a pod, for expanding $(VAR) references.
FIELD_VALUES = {"status.hostIP": "10.0.0.7", "status.podIP": "10.244.1.9", "metadata.name": "pod-0"}


def load_manifests() -> dict[tuple[str, str], dict]:
    """Every object of deploy/'s kustomization, by (kind, name)."""
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    objects = {}
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((DEPLOY / resource).read_text()):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


@pytest.fixture
def manifests() -> dict[tuple[str, str], dict]:
    return load_manifests()  # a fresh copy per test: negative controls edit it


def pod_templates(manifests: dict) -> list[dict]:
    """The pod template of every workload (DaemonSet, StatefulSet, Deployment)."""
    return [doc["spec"]["template"] for doc in manifests.values() if "template" in doc.get("spec", {})]


def pod_spec(manifests: dict, kind: str, name: str) -> dict:
    return manifests[(kind, name)]["spec"]["template"]["spec"]


def port_of(container: dict, name: str) -> dict:
    return next(port for port in container.get("ports", ()) if port["name"] == name)


def container_env(manifests: dict, container: dict) -> dict[str, str]:
    """The container's environment as Kubernetes builds it (envFrom first, then env); secrets
    stand for themselves."""
    env = {}
    for source in container.get("envFrom", ()):
        env.update(manifests[("ConfigMap", source["configMapRef"]["name"])]["data"])
    for var in container.get("env", ()):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = FIELD_VALUES[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = f"<secret {ref['name']}/{ref['key']}>"
    return env


def expanded_args(manifests: dict, container: dict, part: str = "args") -> list[str]:
    """The container's args (or command) with $(VAR) expanded from its environment, as the kubelet does; a
    reference to a variable the container does not have is an error here (the kubelet would
    pass it on verbatim)."""
    env = container_env(manifests, container)

    def value(match: re.Match) -> str:
        assert match[1] in env, f"{container['name']}: $({match[1]}) is not in its environment"
        return env[match[1]]

    return [re.sub(r"\$\((\w+)\)", value, arg) for arg in container.get(part, ())]


def server_config(manifests: dict) -> ServerConfig:
    """The kvtier server's config, from its DaemonSet's args and environment, through kvtier's
    flags and their conversion (a ConfigError or an argparse exit when anything is wrong)."""
    container = pod_spec(manifests, "DaemonSet", "kvtier-server")["containers"][0]
    args = expanded_args(manifests, container)
    assert args[0] == "server"
    parser = argparse.ArgumentParser()
    add_flags(parser, ServerConfig)
    return from_args(ServerConfig, parser.parse_args(args[1:]), container_env(manifests, container))


def vllm_args(manifests: dict) -> argparse.Namespace:
    """The vLLM container's command line through vLLM's own parser (which checks the JSON of
    --kv-transfer-config and --kv-events-config against vLLM's config classes)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    container = pod_spec(manifests, "StatefulSet", "vllm")["containers"][0]
    assert container["command"] == ["vllm", "serve"]
    return make_arg_parser(FlexibleArgumentParser()).parse_args(expanded_args(manifests, container))


# -- the Kubernetes schemas ------------------------------------------------------------------------


def test_the_kustomization_lists_every_manifest_and_image():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
    images = {image["name"] for image in kustomization["images"]}
    used = {c["image"].partition(":")[0] for template in pod_templates(load_manifests())
            for c in template["spec"]["containers"] + template["spec"].get("initContainers", [])}
    assert used == images


def test_every_object_passes_the_kubernetes_schema(manifests):
    assert {kind for kind, _ in manifests} == {"Namespace", "ConfigMap", "DaemonSet", "StatefulSet", "Deployment", "Service"}
    for doc in manifests.values():
        validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("break_it", [
    lambda spec: spec["containers"][0].update(volumeMount=[]),  # a misspelt field
    lambda spec: port_of(spec["containers"][0], "http").update(containerPort="8080"),  # a string for a port
    lambda spec: spec["volumes"][0]["hostPath"].pop("path"),  # a required field left out
], ids=["unknown-field", "wrong-type", "missing-field"])
def test_a_broken_manifest_is_rejected(manifests, break_it):
    daemonset = manifests[("DaemonSet", "kvtier-server")]
    break_it(daemonset["spec"]["template"]["spec"])
    with pytest.raises(ValidationError):
        validate(daemonset, KUBERNETES_VERSION, strict=True)


def test_a_broken_manifest_string_is_rejected():
    text = (DEPLOY / "router.yaml").read_text().replace("containerPort: 8000", "containerPort: eight-thousand")
    assert text != (DEPLOY / "router.yaml").read_text()
    deployment = [doc for doc in yaml.safe_load_all(text) if doc["kind"] == "Deployment"][0]
    with pytest.raises(ValidationError):
        validate(deployment, KUBERNETES_VERSION, strict=True)


# -- the kvtier server per node ----------------------------------------------------------------


def test_the_server_config_is_kvtier_own(manifests):
    config = server_config(manifests)
    spec = pod_spec(manifests, "DaemonSet", "kvtier-server")
    container = spec["containers"][0]
    # Every ConfigMap key is used: in the args, or read by the server from its environment.
    data = manifests[("ConfigMap", "kvtier-server")]["data"]
    referenced = set(re.findall(r"\$\((\w+)\)", " ".join(container["args"])))
    assert set(data) - referenced == {"KVTIER_LOG_LEVEL"}
    assert config.log_level == data["KVTIER_LOG_LEVEL"]
    assert config.admin_token == "<secret kvtier-secrets/admin-token>"
    # Ports: the ones the server binds are the container's, the data port also the host's.
    assert config.port == port_of(container, "data")["containerPort"] == port_of(container, "data")["hostPort"]
    assert config.http_port == port_of(container, "http")["containerPort"]
    assert (config.host, config.http_host) == ("0.0.0.0", "0.0.0.0")  # the kubelet probes the pod's IP
    annotations = manifests[("DaemonSet", "kvtier-server")]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == config.http_port
    # The L1 arena's shared memory is charged to the container: the limit holds it.
    limit = quantity(container["resources"]["limits"]["memory"])
    assert limit >= config.store.l1.size_gb * GB + GB, "memory limit below the L1 arena plus 1 GiB"
    # Every disk tier is on a host path; /dev/shm is the node's.
    mounts = mounted_host_paths(spec, container)
    assert mounts["/dev/shm"] == "/dev/shm"
    disk = [a for a in config.store.l2_adapters if isinstance(a, FsAdapterConfig)]
    assert disk and all(any(Path(a.base_path).is_relative_to(m) for m in mounts) for a in disk)
    # The password of the shared tier comes from the Secret.
    redis = [a for a in config.store.l2_adapters if isinstance(a, RedisAdapterConfig)]
    env = container_env(manifests, container)
    assert redis and all(env[a.password_env].startswith("<secret ") for a in redis if a.password_env)


@pytest.mark.parametrize("key, value", [
    ("KVTIER_L1_SIZE_GB", "big"),
    ("KVTIER_L2_ADAPTER_NVME", '{"type": "fs", "base_path": "/var/lib/kvtier", "capacity_gb": 1}'),
    ("KVTIER_L2_ADAPTER_SHARED", '{"type": "valkey", "url": "redis://x"}'),
])
def test_a_bad_config_value_is_rejected_by_kvtier(manifests, key, value):
    manifests[("ConfigMap", "kvtier-server")]["data"][key] = value
    with pytest.raises(ConfigError):
        server_config(manifests)


def test_an_unknown_server_flag_is_rejected(manifests):
    pod_spec(manifests, "DaemonSet", "kvtier-server")["containers"][0]["args"].append("--l1-capacity-gb=8")
    with pytest.raises(SystemExit):  # argparse: "unrecognized arguments"
        server_config(manifests)


def test_an_undefined_variable_is_rejected(manifests):
    container = pod_spec(manifests, "DaemonSet", "kvtier-server")["containers"][0]
    container["args"] = [arg.replace("KVTIER_CHUNK_SIZE", "KVTIER_CHUNKSIZE") for arg in container["args"]]
    with pytest.raises(AssertionError, match="KVTIER_CHUNKSIZE"):
        server_config(manifests)


def test_a_memory_limit_below_l1_is_rejected(manifests):
    manifests[("ConfigMap", "kvtier-server")]["data"]["KVTIER_L1_SIZE_GB"] = "100"
    with pytest.raises(AssertionError, match="memory limit"):
        test_the_server_config_is_kvtier_own(manifests)


def quantity(text: str) -> int:
    """A Kubernetes memory quantity in bytes (binary and decimal suffixes)."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    number, unit = re.fullmatch(r"(\d+)([KMGT]i?)?", text).groups()
    return int(number) * units.get(unit, 1)


def mounted_host_paths(spec: dict, container: dict) -> dict[str, str]:
    """Mount path -> host path, for the container's hostPath volumes."""
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    return {m["mountPath"]: host[m["name"]] for m in container["volumeMounts"] if m["name"] in host}


def test_the_probes_and_metrics_are_served_by_a_real_kvtier_server(manifests, tmp_path):
    container = pod_spec(manifests, "DaemonSet", "kvtier-server")["containers"][0]
    paths = set()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        port_of(container, container[probe]["httpGet"]["port"])  # a named port of this container
        paths.add(container[probe]["httpGet"]["path"])
    annotations = manifests[("DaemonSet", "kvtier-server")]["spec"]["template"]["metadata"]["annotations"]
    paths.add(annotations["prometheus.io/path"])
    server = ServerProcess(tmp_path, l1_gb=0.001).start()
    try:
        for path in paths:
            server.get(path)  # an HTTPError unless it answers 200
        with pytest.raises(urllib.error.HTTPError):  # the negative control
            server.get("/healthz")
    finally:
        server.stop()


def test_the_curve_keys_as_the_init_containers_copy_them_let_an_engine_in(manifests, tmp_path):
    """The data port requires CurveZMQ. The Secret made as deploy/README.md says, mounted as
    Kubernetes mounts it (files readable by all), copied by each pod's init container: a real
    server started with the DaemonSet's key flags serves an engine with the vLLM pod's connector keys."""
    from kvtier.integrations.vllm.keystores import close_cache, open_cache
    from kvtier.wire.curve import generate

    secret = tmp_path / "secret"
    for _, name in generated_key_pairs():
        generate(secret, name)
    (mode,) = {v["secret"]["defaultMode"] for t in pod_templates(manifests) for v in t["spec"].get("volumes", ()) if "secret" in v}
    for path in secret.iterdir():
        path.chmod(mode)  # as the Secret volumes lay their files out
    node = {"curve-secret": secret, "curve-keys": tmp_path / "node"}
    server_spec = pod_spec(manifests, "DaemonSet", "kvtier-server")
    for _ in range(2):  # an init container runs again when its pod is restarted, on the same emptyDir
        run_init_container(init_container(server_spec, "curve-keys"), node)
    config, kvtier = server_config(manifests), server_spec["containers"][0]
    assert config.uses_curve  # the data port is not on loopback
    server = ServerProcess(tmp_path, "--curve", "--curve-secret-key", local_path(kvtier, config.curve_secret_key, node),
                           "--curve-clients-dir", local_path(kvtier, config.curve_clients_dir, node)).start()
    try:
        pod = {"curve-secret": secret, "curve-keys": tmp_path / "pod"}
        vllm_spec = pod_spec(manifests, "StatefulSet", "vllm")
        for _ in range(2):
            run_init_container(init_container(vllm_spec, "curve-keys"), pod)
        extra = vllm_args(manifests).kv_transfer_config.kv_connector_extra_config
        keys = {key: local_path(vllm_spec["containers"][0], extra[key], pod)
                for key in ("kvtier.curve_secret_key", "kvtier.curve_server_key")}
        cache = open_cache(parse_extra_config({"kvtier.url": server.url, "kvtier.timeout_s": 5.0, **keys}))
        try:
            toks = tokens(9_000, 64)
            assert cache.store(NS, toks, fill_for(toks)) == 4 and cache.lookup(NS, toks).hit_tokens == 64
        finally:
            close_cache(cache)
        # The control: the key pair as the Secret volume holds it is refused by kvtier.
        with pytest.raises(ConfigError, match="readable by others"):
            open_cache(parse_extra_config({**keys, "kvtier.url": server.url,
                                           "kvtier.curve_secret_key": str(secret / Path(keys["kvtier.curve_secret_key"]).name)}))
    finally:
        server.stop()


def init_container(spec: dict, name: str) -> dict:
    return next(c for c in spec["initContainers"] if c["name"] == name)


def local_path(container: dict, path: str, volumes: dict[str, Path]) -> str:
    """Where ``path`` in ``container`` is here, its volumes being the folders ``volumes`` names."""
    for mount in container["volumeMounts"]:
        if Path(path).is_relative_to(mount["mountPath"]) and mount["name"] in volumes:
            return str(volumes[mount["name"]] / Path(path).relative_to(mount["mountPath"]))
    raise AssertionError(f"{path} is on none of {container['name']}'s volumes")


def run_init_container(container: dict, volumes: dict[str, Path]) -> None:
    """Run an init container's ``sh -c`` script here, its volumes mapped to local folders."""
    assert container["command"][:2] == ["sh", "-c"]
    script = container["command"][2]
    for mount in sorted(container["volumeMounts"], key=lambda m: -len(m["mountPath"])):
        volumes[mount["name"]].mkdir(exist_ok=True)
        script = script.replace(mount["mountPath"], str(volumes[mount["name"]]))
    subprocess.run(["sh", "-c", script], check=True)


# -- vLLM on every node, connected to its node's server --------------------------------------------


def test_vllm_reaches_its_node_server_with_valid_connector_keys(manifests):
    args = vllm_args(manifests)  # vLLM's parser: every flag, and its config JSON, is vLLM's
    transfer = args.kv_transfer_config
    assert transfer.kv_connector == "KvtierConnector" and transfer.kv_load_failure_policy == "recompute"
    assert hasattr(importlib.import_module(transfer.kv_connector_module_path), transfer.kv_connector)
    connector = parse_extra_config(transfer.kv_connector_extra_config, transfer.kv_role)  # kvtier's keys
    server = server_config(manifests)
    url = urlsplit(connector.url)
    assert (url.hostname, url.port) == (FIELD_VALUES["status.hostIP"], server.port)
    assert server.store.chunk_size % (args.block_size or 16) == 0  # 16: vLLM's block size on CUDA
    # The arena: the node's /dev/shm, mapped by the same user that created it (mode 0600).
    spec = pod_spec(manifests, "StatefulSet", "vllm")
    assert mounted_host_paths(spec, spec["containers"][0])["/dev/shm"] == "/dev/shm"
    server_spec = pod_spec(manifests, "DaemonSet", "kvtier-server")
    assert spec["securityContext"]["runAsUser"] == server_spec["securityContext"]["runAsUser"]
    # Its KV events: published on the ports the Service names.
    container = spec["containers"][0]
    events = args.kv_events_config
    assert events.enable_kv_cache_events and events.publisher == "zmq"
    assert urlsplit(events.endpoint).port == port_of(container, "kv-events")["containerPort"]
    assert urlsplit(events.replay_endpoint).port == port_of(container, "kv-replay")["containerPort"]
    assert args.port == port_of(container, "http")["containerPort"]
    from vllm.entrypoints.serve.instrumentator.health import router as health

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # vLLM's own health route
        assert container[probe]["httpGet"]["path"] in {route.path for route in health.routes}
        port_of(container, container[probe]["httpGet"]["port"])


def test_a_bad_connector_key_is_rejected(manifests):
    container = pod_spec(manifests, "StatefulSet", "vllm")["containers"][0]
    container["args"] = [arg.replace('"kvtier.timeout_s"', '"kvtier.timeout"') for arg in container["args"]]
    with pytest.raises(ConfigError, match="kvtier.timeout"):
        test_vllm_reaches_its_node_server_with_valid_connector_keys(manifests)


def test_vllm_base_image_is_a_version_the_connector_supports():
    pyproject = (ROOT / "pyproject.toml").read_text()
    vllm_extra = re.search(r'^vllm = \["(vllm[^"]*)"', pyproject, re.M)[1]
    base = re.search(r"^FROM vllm/vllm-openai:v(\S+) AS vllm$", (DEPLOY / "Dockerfile").read_text(), re.M)[1]
    assert Requirement(vllm_extra).specifier.contains(base), (vllm_extra, base)


# -- the router ----------------------------------------------------------------------------------


def router_args(manifests: dict, monkeypatch) -> argparse.Namespace:
    """The router container's command line through ``kvtier``'s own parser (its run step replaced)."""
    from kvtier import cli

    container = pod_spec(manifests, "Deployment", "kvtier-router")["containers"][0]
    assert container["command"] == ["kvtier"]
    parsed = []
    monkeypatch.setattr(cli, "_router", lambda args, parser: parsed.append(args) or 0)
    assert cli.main(expanded_args(manifests, container)) == 0
    return parsed[0]


def test_the_router_routes_to_every_vllm_instance_by_its_events(manifests, monkeypatch):
    from kvtier.router.instances import parse_instance

    args = router_args(manifests, monkeypatch)
    vllm = vllm_args(manifests)
    assert args.policy == "cache-aware" and args.hash_algorithm == vllm.prefix_caching_hash_algo
    replicas = manifests[("StatefulSet", "vllm")]["spec"]["replicas"]
    service = manifests[("Service", "vllm")]["metadata"]["name"]
    events_port = urlsplit(vllm.kv_events_config.endpoint).port
    instances = [parse_instance(spec, args.kvtier) for spec in args.instance]  # the router's own reading
    assert [(i.url, i.events) for i in instances] == [
        (f"http://vllm-{n}.{service}:{vllm.port}", f"tcp://vllm-{n}.{service}:{events_port}") for n in range(replicas)
    ]
    # The tokenizer folder is the one the init container fills, for the model vLLM serves.
    spec = pod_spec(manifests, "Deployment", "kvtier-router")
    router, init = spec["containers"][0], spec["initContainers"][0]
    mounts = lambda c: {m["mountPath"]: m["name"] for m in c["volumeMounts"]}  # noqa: E731
    assert mounts(router)[args.tokenizer] == mounts(init)[args.tokenizer]
    downloaded = " ".join(expanded_args(manifests, init, "command"))
    assert f'"{vllm.model_tag}"' in downloaded and f'local_dir="{args.tokenizer}"' in downloaded
    assert args.port == port_of(router, "http")["containerPort"]


def test_a_router_missing_an_instance_is_rejected(manifests, monkeypatch):
    manifests[("StatefulSet", "vllm")]["spec"]["replicas"] += 1
    with pytest.raises(AssertionError):
        test_the_router_routes_to_every_vllm_instance_by_its_events(manifests, monkeypatch)


def test_the_router_probe_is_a_route_of_the_router():
    from kvtier.router.app import Router, create_app
    from kvtier.router.instances import parse_instance
    from kvtier.router.policies import RoundRobin

    manifests = load_manifests()
    container = pod_spec(manifests, "Deployment", "kvtier-router")["containers"][0]
    app = create_app(Router([parse_instance("http://127.0.0.1:1")], RoundRobin(), timeout_s=1.0))
    with TestClient(app) as client:
        for probe in ("readinessProbe", "livenessProbe"):
            assert client.get(container[probe]["httpGet"]["path"]).status_code == 200
        assert client.get("/healthz").status_code == 404  # the control


# -- what ties the pieces together -----------------------------------------------------------------


def test_every_service_targets_named_ports_of_its_pods(manifests):
    services = [doc for (kind, _), doc in manifests.items() if kind == "Service"]
    assert services
    for service in services:
        pods = [template for template in pod_templates(manifests)
                if service["spec"]["selector"].items() <= template["metadata"]["labels"].items()]
        assert len(pods) == 1, service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            assert any(p["name"] == port["targetPort"] for c in pods[0]["spec"]["containers"] for p in c.get("ports", ()))


def test_every_metrics_annotation_names_a_port_of_its_pod(manifests):
    scraped = [template for template in pod_templates(manifests)
               if template["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true"]
    assert len(scraped) >= 2  # the kvtier servers and vLLM
    for template in scraped:
        ports = {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", ())}
        assert int(template["metadata"]["annotations"]["prometheus.io/port"]) in ports


def test_a_service_port_its_pods_lack_is_rejected(manifests):
    manifests[("Service", "vllm")]["spec"]["ports"][0]["targetPort"] = "api"
    with pytest.raises(AssertionError):
        test_every_service_targets_named_ports_of_its_pods(manifests)


class _Parsed(Exception):
    """Carries the parser ``kvtier``'s main built, instead of parsing with it."""


def known_flags(monkeypatch) -> set[str]:
    """The flags of ``kvtier server``, ``kvtier router``, ``kvtier keys generate`` and ``vllm serve``."""
    from kvtier import cli
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parsed(parser, argv=None):
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parsed)
    with pytest.raises(_Parsed) as info:
        cli.main([])
    monkeypatch.undo()  # parse_args as it was, for vLLM's parser below
    subcommands = lambda parser: next(  # noqa: E731
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    commands = subcommands(info.value.args[0])
    parsers = (commands["server"], commands["router"], subcommands(commands["keys"])["generate"],
               make_arg_parser(FlexibleArgumentParser()))
    return {flag for parser in parsers for action in parser._actions for flag in action.option_strings}


def unknown_flags(text: str, known: set[str]) -> set[str]:
    """The flags ``text`` names that none of those programs (nor docker build, kubectl) has."""
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", text))
    return named - known - {"--target", "--from-file", "--from-literal"}


def test_every_flag_the_deploy_readme_names_is_a_real_one(monkeypatch):
    known = known_flags(monkeypatch)
    assert "--kv-events-port" in known and "--instance" in known and "--kv-transfer-config" in known
    assert unknown_flags((DEPLOY / "README.md").read_text(), known) == set()
    assert unknown_flags("add --kv-event-port=5556", known) == {"--kv-event-port"}  # the control


def generated_key_pairs() -> list[tuple[str, str]]:
    """(folder, name) of each ``kvtier keys generate`` of deploy/README.md."""
    return re.findall(r"kvtier keys generate --dir (\S+) (\S+)", (DEPLOY / "README.md").read_text())


def readme_secrets() -> dict[str, set[str]]:
    """Secret name -> its keys, as deploy/README.md's commands create them."""
    commands = (DEPLOY / "README.md").read_text().replace("\\\n", " ")
    generated = {}
    for folder, name in generated_key_pairs():
        generated.setdefault(folder.rstrip("/"), set()).update({f"{name}.key", f"{name}.key_secret"})
    secrets = {}
    for line in commands.splitlines():
        words = shlex.split(line.partition("#")[0]) if "create secret generic" in line else []
        if words:
            keys = secrets.setdefault(words[words.index("generic") + 1], set())
            for word in words:
                if word.startswith("--from-literal="):
                    keys.add(word.split("=")[1])
                elif word.startswith("--from-file="):
                    keys.update(generated[word.partition("=")[2].rstrip("/")])
    return secrets


def test_every_secret_referenced_is_one_the_readme_creates(manifests):
    created = readme_secrets()
    refs = [var["valueFrom"]["secretKeyRef"] for template in pod_templates(manifests)
            for c in template["spec"]["containers"] + template["spec"].get("initContainers", [])
            for var in c.get("env", ()) if "secretKeyRef" in var.get("valueFrom", {})]
    assert refs
    for ref in refs:
        assert ref.get("optional") or ref["key"] in created.get(ref["name"], ()), ref
    # A Secret volume's files, as the init containers read them.
    for template in pod_templates(manifests):
        secret_volumes = {v["name"]: v["secret"]["secretName"] for v in template["spec"].get("volumes", ()) if "secret" in v}
        for container in template["spec"].get("initContainers", ()):
            for mount in (m for m in container["volumeMounts"] if m["name"] in secret_volumes):
                read = set(re.findall(re.escape(mount["mountPath"]) + r"/([\w.-]+)", " ".join(container["command"])))
                assert read and read <= created[secret_volumes[mount["name"]]], (container["name"], read)


def test_a_secret_key_the_readme_does_not_create_is_rejected(manifests):
    init = init_container(pod_spec(manifests, "StatefulSet", "vllm"), "curve-keys")
    init["command"] = [part.replace("engine.key_secret", "vllm.key_secret") for part in init["command"]]
    with pytest.raises(AssertionError, match="curve-keys"):
        test_every_secret_referenced_is_one_the_readme_creates(manifests)


def test_a_bad_vllm_config_key_is_rejected_by_vllm(manifests):
    container = pod_spec(manifests, "StatefulSet", "vllm")["containers"][0]
    container["args"] = [arg.replace('"kv_load_failure_policy"', '"kv_failure_policy"') for arg in container["args"]]
    with pytest.raises(SystemExit):  # vLLM's parser: KVTransferConfig has no such field
        vllm_args(manifests)
