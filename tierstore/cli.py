"""The ``tierstore`` command: ``info``, ``gc``, ``bench`` (and, as they land, ``demo`` and ``simulate``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .arguments import non_negative_float, non_negative_int
from .errors import TierStoreError
from .outputs import check_image_format, check_output_file, check_writable, plot_file


def _info(args: argparse.Namespace) -> int:
    from .inspect import describe_folder, format_description

    info = describe_folder(args.root, verify=args.verify, progress=args.verify and not args.json)
    if args.json:
        print(json.dumps(info, indent=2, ensure_ascii=False))
    else:
        print(format_description(info, limit=None if args.all else args.limit))
    return 0 if info["healthy"] else 1


#: Space beyond its files that ``tierstore gc`` lets a disk tier take (it only rewrites the index).
_GC_ROOM = 1 << 30


def _gc(args: argparse.Namespace) -> int:
    import asyncio

    from .inspect import describe_folder
    from .store import TierStore
    from .tiers import DiskTier
    from .units import format_bytes

    folder = describe_folder(args.root)  # refuses a folder that is no disk tier, before opening it
    # Room to rewrite the small namespace index; what is in the folder already counts as its own.
    capacity = folder["reserved_bytes"] + min(folder["filesystem_free"] // 2, _GC_ROOM)

    async def collect() -> list[Any]:
        async with TierStore([DiskTier(args.root, capacity, create=False)]) as store:
            return await store.gc(names=args.name or None, dry_run=args.dry_run)

    removed = asyncio.run(collect())
    verb = "would remove" if args.dry_run else "removed"
    for ns in removed:
        print(f"{verb} {ns.name!r} (owner {ns.owner}, {'auto' if ns.auto else 'named'}): {ns.keys} key{'' if ns.keys == 1 else 's'}, {format_bytes(ns.nbytes)}")
    if not removed:
        print("no orphaned namespaces" if not args.name else "nothing removed")
    return 0


def _repair(args: argparse.Namespace) -> int:
    from .disk.repair import repair_folder

    print(repair_folder(args.root, dry_run=args.dry_run, verify=args.verify, progress=args.verify).summary())
    return 0


def _bench(argv: list[str]) -> int:
    from .bench.tiers import main as bench_main

    return bench_main(argv)


def _demo(argv: list[str]) -> int:
    from .demo import main as demo_main

    return demo_main(argv)


_PASSTHROUGH = {
    "demo": "train a small GPT with its optimizer state paged through device, host and disk tiers",
    "bench": "tier and link throughput vs raw pread/pwrite (benchmarks/bench_tiers.py); --tune DIR: I/O settings for DIR's device",
}
_PASSTHROUGH_RUN = {"demo": _demo, "bench": _bench}


def _simulate(args: argparse.Namespace) -> int:
    from .sim.links import LinkModel
    from .sim.report import (
        format_table,
        open_trace,
        parse_capacities,
        parse_columns,
        plot_curves,
        plot_prefetch,
        run_all,
    )

    for output in (args.json, args.plot):  # (before the simulation runs, not after)
        if output:
            check_output_file(Path(output))
    if args.plot:
        check_image_format(Path(args.plot))
    plot = plot_file(Path(args.plot)) if args.plot else None  # (the name matplotlib writes: checked and said)
    if plot:
        check_output_file(plot)
    for option, output in (("--json", args.json), ("--plot", plot)):
        if output:
            check_writable(Path(output), option)
    capacities = parse_capacities(args.capacity)
    bench = Path(args.bench_json)
    links = LinkModel.from_bench(bench) if bench.exists() else LinkModel()
    if args.links:
        links.override(args.links, capacities)
    trace = open_trace(args.trace, parse_columns(args.columns))
    results = run_all(
        trace, capacities, _names(args.eviction), _names(args.prefetch), links, sweep=args.sweep, think=args.think,
        engines=tuple(_names(args.engine)),
    )
    print(format_table(results, trace))
    if args.json:
        out = Path(args.json)
        out.write_text(json.dumps([r.to_json() for r in results], indent=2))
        print(f"\nJSON: {out}")
    if plot:
        plot_curves(results, trace, plot)
        print(f"plot: {plot}")
        prefetch_png = plot.with_name(plot.stem + "_prefetch.png")
        if plot_prefetch(results, prefetch_png):
            print(f"prefetch plot: {prefetch_png}")
    return 0


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstore", description="Tiered tensor store for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser("info", help="what a disk tier folder holds")
    info.add_argument("root", help="the DiskTier folder")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.add_argument("--verify", action="store_true",
                      help="read every value and check its checksums (without it the values' bytes are not read: "
                           "a store checks them on every read)")
    info.add_argument("--limit", type=non_negative_int, default=40, help="keys to list (default 40)")
    info.add_argument("--all", action="store_true", help="list every key")
    info.set_defaults(run=_info)

    gc = commands.add_parser("gc", help="remove namespaces (and their keys) left by earlier runs")
    gc.add_argument("root", help="the DiskTier folder (not open elsewhere)")
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    gc.add_argument("--name", action="append", help="remove this namespace (named ones are only removed when named; repeatable)")
    gc.set_defaults(run=_gc)

    repair = commands.add_parser("repair", help="drop the entries of a damaged disk tier folder whose values are lost, so the rest opens")
    repair.add_argument("root", help="the DiskTier folder (not open elsewhere)")
    repair.add_argument("--dry-run", action="store_true", help="say what would be dropped and restored, change nothing")
    repair.add_argument("--verify", action="store_true", help="also read every value and drop those whose bytes fail their checksums")
    repair.set_defaults(run=_repair)

    sim = commands.add_parser("simulate", help="replay a trace against capacities and policies (no tensors)")
    sim.add_argument("trace", help="a .npz store trace, a key,size CSV, a libCacheSim oracleGeneral file, or e.g. optimizer:keys=64,steps=20,size=4MiB")
    sim.add_argument("--capacity", required=True, help="tier capacities, fastest first: host=2GiB or device=1GiB,host=4GiB")
    sim.add_argument("--eviction", default="lru", help="comma-separated: lru,fifo,lfu,arc,s3fifo,sieve,clock,slru,2q,lirs,tinylfu,min; "
                     "with --engine libcachesim also its own (lhd,lecar,gdsf,...) (default lru)")
    sim.add_argument("--prefetch", default="none", help="comma-separated: none,sequential,amp,schedule (default none)")
    sim.add_argument("--engine", default="tierstore", help="comma-separated: tierstore (ours), libcachesim (its policies; "
                     "pip install 'tierstore[libcachesim]') (default tierstore)")
    sim.add_argument("--columns", help="CSV columns to read, 0-based or by header name, e.g. key=1,size=3 (default key=0,size=1)")
    sim.add_argument("--sweep", action="store_true", help="sweep the first tier from 5%% to 100%% of the working set")
    sim.add_argument("--json", help="write one record per combination here")
    sim.add_argument("--plot", help="write miss-ratio curves here, in the format its suffix names (without one: PNG, .png added)")
    sim.add_argument("--links", help="link model overrides, e.g. disk->host=2.5GB/s@100us,host->device=20GB/s")
    sim.add_argument("--bench-json", default="benchmarks/results/bench_tiers.json", help="take disk link speeds from this bench output if present")
    sim.add_argument("--think", type=non_negative_float, default=None, help="compute seconds per access (default: the trace's own timing, else 0)")
    sim.set_defaults(run=_simulate)

    # Benchmarks parse their own options: `tierstore bench --help` shows them.
    for name, help_text in _PASSTHROUGH.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``tierstore`` command (``argv``: its arguments, default ``sys.argv[1:]``); the exit
    status. Ctrl-C prints one line; run as the program (no ``argv``), the ``KeyboardInterrupt``
    then goes on, without its traceback, so Python ends as an interrupted program does (exit
    handlers run, output is flushed, then SIGINT: a shell loop stops); else 130."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        if argv is None:
            sys.excepthook = _quiet_on_interrupt(sys.excepthook)
            raise
        return _INTERRUPTED
    except BrokenPipeError:
        # The reader of our output went away (``tierstore info ... | head``): what it did not read
        # is not wanted. Python's own recipe: point stdout at devnull so that the flush at exit
        # does not raise again; exit as a process ended by SIGPIPE does (128 + 13), not 1,
        # which ``info`` answers for a damaged store.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


#: The exit status of a command Ctrl-C ended (128 + SIGINT, as a shell reports it).
_INTERRUPTED = 130


def _quiet_on_interrupt(hook: Any) -> Any:
    """``sys.excepthook`` that prints nothing for a ``KeyboardInterrupt`` (its line was printed)."""

    def quiet(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            hook(kind, value, traceback)

    return quiet


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in _PASSTHROUGH_RUN:
        command, run = argv[0], lambda: _PASSTHROUGH_RUN[argv[0]](argv[1:])
        expected: tuple[type[BaseException], ...] = (TierStoreError, OSError)
    else:
        args = parser.parse_args(argv)
        command, run = args.command, lambda: args.run(args)
        expected = (TierStoreError, OSError, ValueError)
    try:
        return int(run())
    except KeyboardInterrupt:
        # Ctrl-C: what each command was writing is removed or left whole by its own cleanup;
        # a traceback would only say where it stopped.
        print(f"\ntierstore {command}: interrupted", file=sys.stderr)
        raise
    except BrokenPipeError:
        raise
    except expected as exc:
        # (the file system's refusals, a permission, a full disk, as one line: the errno's text
        # and the path say it all)
        print(f"tierstore {command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
