"""Benchmark harness: `weir bench throughput` (offline, with Hugging Face baselines) and `weir bench serve` (online)."""

import argparse
import sys

from weir.services.bench.serve import add_serve_parser
from weir.services.bench.throughput import add_throughput_parser
from weir.services.launcher import ChildFailedError


def add_bench_subcommands(
    subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]",
) -> None:
    """Register `bench throughput` and `bench serve`; each sets `func(args) -> int` (the exit code)."""
    bench = subparsers.add_parser("bench", help="measure throughput and latency")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_throughput_parser(bench_sub)
    add_serve_parser(bench_sub)


def run_cli(argv: list[str]) -> int:
    """Run `weir bench <argv...>` without the rest of the weir CLI."""
    parser = argparse.ArgumentParser(prog="weir")
    add_bench_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    try:
        exit_code: int = args.func(args)
        return exit_code
    except ChildFailedError as exc:  # e.g. a model that cannot be split N ways: its message
        print(f"weir bench: {exc}", file=sys.stderr)
        return 1
