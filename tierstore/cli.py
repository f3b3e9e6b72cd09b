"""The ``tierstore`` command: ``info``, ``bench`` (and, as they land, ``demo`` and ``simulate``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .errors import TierStoreError


def _info(args: argparse.Namespace) -> int:
    from .inspect import describe_folder, format_description

    info = describe_folder(args.root)
    if args.json:
        print(json.dumps(info, indent=2, ensure_ascii=False))
    else:
        print(format_description(info, limit=None if args.all else args.limit))
    return 0


def _bench(argv: list[str]) -> int:
    from .bench.tiers import main as bench_main

    return bench_main(argv)


_PASSTHROUGH = {"bench": "tier and link throughput vs raw pread/pwrite (benchmarks/bench_tiers.py)"}
_PASSTHROUGH_RUN = {"bench": _bench}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstore", description="Tiered tensor store for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser("info", help="what a disk tier folder holds")
    info.add_argument("root", help="the DiskTier folder")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.add_argument("--limit", type=int, default=40, help="keys to list (default 40)")
    info.add_argument("--all", action="store_true", help="list every key")
    info.set_defaults(run=_info)

    # Benchmarks parse their own options: `tierstore bench --help` shows them.
    for name, help_text in _PASSTHROUGH.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in _PASSTHROUGH_RUN:
        try:
            return int(_PASSTHROUGH_RUN[argv[0]](argv[1:]))
        except TierStoreError as exc:
            print(f"tierstore {argv[0]}: {exc}", file=sys.stderr)
            return 1
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except (TierStoreError, FileNotFoundError) as exc:
        print(f"tierstore {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
