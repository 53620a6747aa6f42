"""The ``kvtier`` command: ``server``, ``status``, ``kvcache clear`` and ``demo``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import urllib.error
import urllib.request

from kvtier.errors import ConfigError


def _server(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvtier.config import server_config_from_args

    try:
        config = server_config_from_args(args, os.environ)
    except ConfigError as exc:
        parser.error(str(exc))  # exits with status 2
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvtier").info("effective config: %s", json.dumps(config.redacted(), sort_keys=True))
    from kvtier.server.main import run

    try:
        return run(config)
    except ConfigError as exc:
        parser.error(str(exc))
    except OSError as exc:  # a port in use, an unwritable directory
        print(f"kvtier server: {exc}", file=sys.stderr)
        return 1


def _http(url: str, path: str, method: str = "GET", token: str = "") -> dict:
    request = urllib.request.Request(url.rstrip("/") + path, method=method)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def _status(args: argparse.Namespace) -> int:
    status = _http(args.url, "/status")
    print(f"kvtier {status['version']}  up {status['uptime_s']:.0f} s  clients {status.get('connected_clients', '?')}"
          f"  shared memory {'on' if status['shared_memory'] else 'off'}")
    for tier in status["tiers"]:
        if "error" in tier:
            print(f"  {tier['name']:<8} unavailable ({tier['error']})")
            continue
        share = tier["used_bytes"] / tier["capacity_bytes"] if tier["capacity_bytes"] else 0
        stats = tier["stats"]
        print(f"  {tier['name']:<8} {tier['used_bytes'] / 2**30:8.2f} / {tier['capacity_bytes'] / 2**30:.2f} GiB"
              f" ({share:5.1%})  {tier['objects']} objects  hits {stats['hits']}  misses {stats['misses']}"
              f"  evictions {stats['evictions']}  corrupt {stats['corrupt']}")
    return 0


def _clear(args: argparse.Namespace) -> int:
    token = args.token if args.token is not None else os.environ.get("KVTIER_ADMIN_TOKEN", "")
    result = _http(args.url, "/clear-cache", method="POST", token=token)
    print(f"cleared: {result['removed']} objects removed")
    return 0


def main(argv: list[str] | None = None) -> int:
    from kvtier.config import add_server_flags

    parser = argparse.ArgumentParser(prog="kvtier", description="A tiered KV-cache layer for LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True)
    server = commands.add_parser("server", help="run the cache server for the engines of this host")
    add_server_flags(server)
    status = commands.add_parser("status", help="a server's tiers, usage and counters")
    status.add_argument("--url", default="http://127.0.0.1:8080", help="the server's HTTP address")
    kvcache = commands.add_parser("kvcache", help="act on a server's cache").add_subparsers(dest="action", required=True)
    clear = kvcache.add_parser("clear", help="remove every cached object from every tier")
    clear.add_argument("--url", default="http://127.0.0.1:8080", help="the server's HTTP address")
    clear.add_argument("--token", default=None, help="admin token (or env KVTIER_ADMIN_TOKEN)")
    commands.add_parser("demo", help="prefix reuse on a tiny local model: TTFT cold vs warm", add_help=False)

    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from kvtier.demo import main as demo

        return demo(rest) or 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
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
