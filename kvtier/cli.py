"""The ``kvtier`` command: ``server``, ``status``, ``kvcache clear``, ``keys generate``, ``router`` (and
``pd-proxy``, ``router --policy pd`` by its older name). The demos are
the harness's own commands (``kvtier-demo``, ``kvtier-demo-transformers``, in ``kvtier_testing``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import urllib.error
import urllib.request

from kvtier.errors import ConfigError
from kvtier.router.policies import POLICIES


def _server(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvtier.config import ServerConfig
    from kvtier.schema import from_args

    try:
        config = from_args(ServerConfig, args, os.environ)
    except ConfigError as exc:
        parser.error(str(exc))  # exits with status 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvtier").info("effective config: %s", json.dumps(config.redacted(), sort_keys=True))
    from kvtier.server.main import run

    try:
        return run(config)
    except ConfigError as exc:
        parser.error(str(exc))
    except OSError as exc:  # a port in use, an unwritable directory
        print(f"kvtier server: {exc}", file=sys.stderr)
        return 1


def _router(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import uvicorn

    from kvtier.router.app import Router, create_app

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per upstream request
    try:
        router = Router(*_router_parts(args), timeout_s=args.timeout_s)
    except (ValueError, ConfigError, OSError) as exc:
        parser.error(str(exc))
    uvicorn.run(create_app(router), host=args.host, port=args.port, log_level="warning")
    return 0


def _router_parts(args: argparse.Namespace):
    """The instances and the policy the flags describe; ValueError names what is wrong."""
    from kvtier.router.instances import parse_instance
    from kvtier.router.policies import LeastLoaded, PrefillDecode, RoundRobin

    instances = [parse_instance(spec, args.kvtier) for spec in args.instance]
    if not instances:
        raise ValueError("give the instances to route to: --instance URL (repeatable)")
    if args.policy == "pd":
        if not args.prefill:
            raise ValueError("--policy pd needs --prefill URL ...")
        return instances, PrefillDecode([parse_instance(spec) for spec in args.prefill])
    if args.prefill:
        raise ValueError("--prefill is for --policy pd")
    if args.policy == "round-robin":
        return instances, RoundRobin()
    if args.policy == "least-loaded":
        return instances, LeastLoaded()
    return instances, _cache_aware(args, instances)


def _cache_aware(args: argparse.Namespace, instances):
    import msgspec

    from kvtier.router.cache_aware import CacheAware
    from kvtier.wire.curve import ClientKeys
    from kvtier.server.lookup import BadLookup, NamespaceFields, parse_namespace

    if args.tokenizer is None or not os.path.isdir(args.tokenizer):
        raise ValueError("--policy cache-aware needs --tokenizer: the model's tokenizer folder (local)")
    if not any(i.events for i in instances):
        raise ValueError("--policy cache-aware needs each instance's KV events: --instance URL,events=tcp://HOST:PORT")
    for instance in instances:
        if instance.events_key is not None:  # a ConfigError names a missing or too open key file
            instance.events_curve = ClientKeys.load(args.curve_secret_key, instance.events_key)
    namespace = None
    if args.kvtier_namespace is not None:
        if not any(i.kvtier for i in instances):
            raise ValueError("--kvtier-namespace needs the kvtier servers: --kvtier URL or --instance URL,kvtier=URL")
        try:
            fields = msgspec.json.decode(args.kvtier_namespace, type=NamespaceFields)
            parse_namespace(fields)
        except (msgspec.DecodeError, msgspec.ValidationError, BadLookup) as exc:
            raise ValueError(f"--kvtier-namespace: {exc}") from None
        namespace = msgspec.to_builtins(fields)
    costs = {}
    for item in args.tier_cost:
        medium, sep, value = item.partition("=")
        try:
            costs[medium] = float(value)
        except ValueError:
            sep = ""
        if not sep or costs[medium] < 0:
            raise ValueError(f"--tier-cost {item!r}: expected MEDIUM=TOKENS (a number >= 0), e.g. disk=0.1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    token = args.admin_token if args.admin_token is not None else os.environ.get("KVTIER_ADMIN_TOKEN", "")
    return CacheAware(instances, tokenizer, namespace, args.hash_algorithm, args.queue_cost_tokens, costs,
                      args.lookup_timeout_s, token)


def _pd_proxy_as_router(args: argparse.Namespace) -> argparse.Namespace:
    """``kvtier pd-proxy --prefill ... --decode ...``: ``kvtier router --policy pd``."""
    return argparse.Namespace(**{**vars(args), "policy": "pd", "instance": args.decode, "kvtier": None})


def _http(url: str, path: str, method: str = "GET", token: str = "") -> dict:
    request = urllib.request.Request(url.rstrip("/") + path, method=method)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def _duration(s: float) -> str:
    if s < 3600:
        return f"{s:.0f} s" if s < 60 else f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h" if s < 86400 else f"{s / 86400:.1f} d"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def _status(args: argparse.Namespace) -> int:
    from rich import box
    from rich.console import Console
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    status = _http(args.url, "/status")
    traffic, tiers = status.get("traffic", {}), status["tiers"]
    console = Console(highlight=False)
    console.print(
        f"[bold]kvtier {status['version']}[/]  up {_duration(status['uptime_s'])}"
        f"  clients [bold]{status.get('connected_clients', '?')}[/]"
        f"  shared memory {'on' if status['shared_memory'] else '[yellow]off[/]'}  [dim]{args.url}[/]"
    )
    requested, hit_by_tier = traffic.get("requested_tokens", 0), traffic.get("hit_tokens", {})
    hit = sum(hit_by_tier.values())
    if requested:
        rate = hit / requested
        color = "green" if rate >= 0.5 else "yellow" if rate >= 0.2 else "red"
        per_tier = ", ".join(f"{name} {n / requested:.1%}" for name, n in hit_by_tier.items())
        console.print(f"hit rate [bold {color}]{rate:.1%}[/] ({per_tier})  {hit:,} of {requested:,} tokens from cache")
    else:
        console.print("hit rate [dim]no lookups yet[/]")

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=0)
    for name, justify in (("tier", "left"), ("usage", "left"), ("", "right"), ("objects", "right"),
                          ("hit tokens", "right"), ("evictions", "right"), ("corrupt", "right"), ("errors", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    warn = lambda n: Text(f"{n:,}", style="bold red" if n else "")  # noqa: E731
    for tier in tiers:
        if "error" in tier:
            table.add_row(tier["name"], Text(f"unavailable ({tier['error']})", style="red"), "", "", "", "", "", "")
            continue
        used, capacity, stats = tier["used_bytes"], tier["capacity_bytes"], tier["stats"]
        share = used / capacity if capacity else 0.0
        color = "red" if share > 0.9 else "yellow" if share > 0.75 else "blue"
        bar = ProgressBar(total=capacity or 1, completed=used, width=12, complete_style=color, finished_style=color)
        table.add_row(tier["name"], bar, f"{share:6.1%} of {_size(capacity)}", f"{tier['objects']:,}",
                      f"{hit_by_tier.get(tier['name'], 0):,}", f"{stats['evictions']:,}", warn(stats["corrupt"]),
                      warn(stats["errors"]))
    console.print(table)
    store = status["store"]
    console.print(Text.assemble(
        f"lookups {traffic.get('lookups', 0):,}  stored tokens {traffic.get('stored_tokens', 0):,}",
        "  dropped writes ", warn(store["dropped_writes"]), "  failed writes ", warn(store["failed_writes"]),
        f"  promotions {store['promotions']:,}  held back from lower tiers {store.get('held_back_writes', 0):,}",
    ))
    return 0


def _admin_token(given: str | None, url: str) -> str:
    """The flag's token, else KVTIER_ADMIN_TOKEN, else the one a server of this user on this host
    made for ``url``'s port (kvtier/server/admin_token.py)."""
    from kvtier.server.admin_token import token_for

    if given is not None:
        return given
    return os.environ.get("KVTIER_ADMIN_TOKEN") or token_for(url)


def _clear(args: argparse.Namespace) -> int:
    try:
        result = _http(args.url, "/clear-cache", method="POST", token=_admin_token(args.token, args.url))
    except urllib.error.HTTPError as exc:
        if exc.code != 401:
            raise
        print(f"kvtier: {args.url} refused the admin token: give --token (or KVTIER_ADMIN_TOKEN), or run this as "
              "the server's user on its host", file=sys.stderr)
        return 1
    print(f"cleared: {result['removed']} objects removed")
    return 0


def _generate_keys(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvtier.wire.curve import generate

    try:
        public, secret = generate(args.dir, args.name)
    except ConfigError as exc:
        parser.error(str(exc))
    print(f"public key {public} (give it to the other side)\nkey pair   {secret} (mode 0600: keep it here)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from kvtier.config import ServerConfig
    from kvtier.schema import add_flags

    parser = argparse.ArgumentParser(prog="kvtier", description="A tiered KV-cache layer for LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True)
    server = commands.add_parser("server", help="run the cache server for the engines of this host")
    add_flags(server, ServerConfig)
    status = commands.add_parser("status", help="a server's tiers, usage and counters")
    status.add_argument("--url", default="http://127.0.0.1:8080", help="the server's HTTP address")
    kvcache = commands.add_parser("kvcache", help="act on a server's cache").add_subparsers(dest="action", required=True)
    clear = kvcache.add_parser("clear", help="remove every cached object from every tier")
    clear.add_argument("--url", default="http://127.0.0.1:8080", help="the server's HTTP address")
    clear.add_argument("--token", default=None, help="admin token (or env KVTIER_ADMIN_TOKEN; without either, "
                       "the token the server made, for the server's user on its host)")
    keys = commands.add_parser("keys", help="CurveZMQ keys for a data port other hosts reach")
    generate = keys.add_subparsers(dest="action", required=True).add_parser(
        "generate", help="write NAME.key (public) and NAME.key_secret (key pair), both mode 0600")
    generate.add_argument("name", help="file name for the pair, e.g. the host's name")
    generate.add_argument("--dir", default=".", help="folder to write them in (made 0700 if new)")
    router = commands.add_parser("router", help="OpenAI-compatible front for N vLLM instances",
                                 description="Routes each completion or chat completion to one vLLM instance.")
    router.add_argument("--instance", action="append", default=[], metavar="URL[,events=EP][,events_key=FILE][,kvtier=URL]",
                        help="a vLLM instance, repeatable: its OpenAI server (http://host:port), its KV-events "
                             "endpoint (--kv-events-config), that publisher's CurveZMQ public key where it requires "
                             "one, and its kvtier server's HTTP address")
    router.add_argument("--curve-secret-key", default=None, metavar="FILE",
                        help="cache-aware: the router's CurveZMQ key pair (NAME.key_secret), for events endpoints "
                             "given with events_key=")
    router.add_argument("--policy", choices=POLICIES, default="cache-aware", help="how to pick (default cache-aware)")
    router.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="pd: the prefill instances")
    router.add_argument("--kvtier", default=None, metavar="URL", help="the kvtier server of every instance without one")
    router.add_argument("--tokenizer", default=None, metavar="DIR", help="cache-aware: the model's tokenizer folder")
    router.add_argument("--kvtier-namespace", default=None, metavar="JSON",
                        help='cache-aware: the namespace of the engines\' kvtier keys ({"model":..., "layout":{...}}, '
                             "as for POST /api/lookup); without it only vLLM's own caches count")
    router.add_argument("--hash-algorithm", default="sha256", help="cache-aware: the engines' --prefix-caching-hash-algo")
    router.add_argument("--queue-cost-tokens", type=float, default=64.0,
                        help="cache-aware: what a request in flight on an instance costs besides its own prefill,"
                             " in prompt tokens computed")
    router.add_argument("--tier-cost", action="append", default=[], metavar="MEDIUM=TOKENS",
                        help="cache-aware: cost of loading one token from a kvtier medium, in tokens computed")
    router.add_argument("--lookup-timeout-s", type=float, default=0.2, help="cache-aware: per kvtier lookup")
    router.add_argument("--admin-token", default=None, help="kvtier servers' admin token (or env KVTIER_ADMIN_TOKEN; "
                        "without either, the token each server on this host made, where it is this user's)")
    proxy = commands.add_parser("pd-proxy", help="kvtier router --policy pd, by its older name")
    proxy.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances (http://host:port)")
    proxy.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances (http://host:port)")
    for sub in (router, proxy):
        sub.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
        sub.add_argument("--port", type=int, default=8100, help="port to serve on (default 8100)")
        sub.add_argument("--timeout-s", type=float, default=600.0, help="per upstream request")

    args = parser.parse_args(argv)
    if args.command == "pd-proxy":
        return _router(_pd_proxy_as_router(args), proxy)
    if args.command == "router":
        return _router(args, router)
    if args.command == "keys":
        return _generate_keys(args, generate)
    try:
        if args.command == "server":
            return _server(args, server)
        return _status(args) if args.command == "status" else _clear(args)
    except urllib.error.HTTPError as exc:
        print(f"kvtier: {args.url} answered {exc.code} {exc.reason}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        print(f"kvtier: cannot reach {args.url}: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
