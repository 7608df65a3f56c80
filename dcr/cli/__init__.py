"""The ``dcr`` command line: the RL loop, the demo fleet, fleet roles, benchmarks, the commit
store.

Every subcommand prints a human-readable report; ``--json`` prints one JSON object instead
(progress goes to stderr, so stdout stays machine-readable).

This module holds the top-level parser and the dispatch; each group of subcommands lives in
its own module: ``bench`` (the benchmarks), ``fleet`` (the demo, the launcher and the fleet
roles), ``fp8`` (FP8 rollout checkpoints), ``keys`` (a fleet's key directory), ``rl`` (the
RL loop) and ``store`` (``dcr commit-store``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from dcr.cli.bench import add_bench_parser, run_bench
from dcr.cli.fleet import (
    add_demo_parser,
    add_fleet_parser,
    add_role_parsers,
    run_demo_command,
    run_fleet_command,
    run_role,
)
from dcr.cli.fp8 import add_fp8_parser, run_fp8_command
from dcr.cli.keys import add_keys_parser, run_keys_command
from dcr.cli.rl import add_rl_parser, run_rl_command
from dcr.cli.store import add_store_parser, run_store_command

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from dcr import __version__

    p = argparse.ArgumentParser(
        prog="dcr",
        description="Bit-exact delta-compressed refit: fleet roles, launcher, demo, benchmarks.",
    )
    p.add_argument("--version", action="version", version=f"dcr {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    add_demo_parser(sub)
    add_rl_parser(sub)
    add_fleet_parser(sub)
    add_fp8_parser(sub)
    add_keys_parser(sub)
    add_role_parsers(sub)
    add_store_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "demo":
        return run_demo_command(args)
    if args.command == "fleet":
        return run_fleet_command(args)
    if args.command == "rl":
        return run_rl_command(args)
    if args.command == "commit-store":
        return run_store_command(args)
    if args.command == "fp8":
        return run_fp8_command(args)
    if args.command == "keys":
        return run_keys_command(args)
    return run_role(args)
