"""The ``kvtier`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier", description="A tiered KV-cache layer for LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="prefix reuse on a tiny local model: TTFT cold vs warm", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from kvtier.demo import main as demo

        return demo(rest) or 0
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
