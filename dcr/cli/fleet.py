"""``dcr demo``, ``dcr fleet`` and the fleet roles (coordinator, owner, receiver, relay): a
fleet of processes from a fleet file, its arguments and its report."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from dcr.cli.arguments import _err, _positive

if TYPE_CHECKING:
    from dcr.errors import DcrError


def add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser(
        "demo",
        help="a refit fleet of real processes, every receiver checked bit for bit",
        description=(
            "Writes a fleet file under --dir and runs it: a TP=2 x DP=2 trainer (4 owner "
            "processes, gloo), two rollout nodes with receivers at serving TP 1 and 2 (one "
            "process per rank), a relay tree, a coordinator and a standby, a SQLite commit "
            "store. Receivers start empty and restore version 0 by dense refit over the relay "
            "tree; each refit is then applied in place and checked bit for bit against a "
            "dense load. Exits non-zero on any mismatch."
        ),
    )
    demo.add_argument("--size-mb", type=float, default=300.0, help="model size (default 300)")
    demo.add_argument("--refits", type=_positive, default=5, help="versions to refit")
    demo.add_argument("--rate", type=float, default=0.01, help="element change rate")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--dir", default="out/demo", help="fleet file, logs and commit store")
    demo.add_argument(
        "--faults",
        nargs="?",
        const="plan",
        choices=["plan", "random"],
        help="SIGKILL one process mid-refit in refits 2..N: 'plan' (the default) cycles a "
        "receiver, a trainer rank, the active coordinator, a relay node; 'random' draws the "
        "role each refit (seeded by --seed); each process is restarted and recovers",
    )
    demo.add_argument(
        "--no-keys",
        dest="keys",
        action="store_false",
        help="run without the fleet's keys (no CURVE, unsealed payloads; loopback only); "
        "by default <dir>/keys is made and every socket is authenticated and encrypted",
    )
    demo.add_argument("--json", action="store_true", help="print one JSON object")


def add_fleet_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fleet = sub.add_parser(
        "fleet",
        help="start every process of a fleet file, supervise them, stop them cleanly",
        description=(
            "Starts the relay nodes, coordinator and standbys, receivers and trainer ranks of "
            "the fleet file, each as its own process; restarts what dies; checks every "
            "receiver bit for bit after each commit; stops everything once the trainer's last "
            "version is committed and checked (or on Ctrl-C)."
        ),
    )
    fleet.add_argument("--fleet", required=True, help="the fleet file (TOML)")
    fleet.add_argument(
        "--faults", nargs="?", const="plan", choices=["plan", "random"],
        help="SIGKILL one process mid-refit per refit (see dcr demo --faults)",
    )  # fmt: skip
    fleet.add_argument("--seed", type=int, default=0, help="seed of --faults random")
    fleet.add_argument("--json", action="store_true", help="print one JSON object")


def add_role_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """One subcommand per fleet role; the launcher starts each process with one."""
    roles = (
        ("coordinator", "the coordinator (or a standby that takes over when its lease lapses)"),
        ("owner", "one trainer rank ([trainer] kind) and its owner"),
        ("receiver", "one serving rank (a receiver)"),
        ("relay", "one relay node of the tree"),
    )
    for role, text in roles:
        r = sub.add_parser(role, help=f"run {text} from a fleet file (the launcher uses it)")
        r.add_argument("--fleet", required=True, help="the fleet file (TOML)")
        if role == "coordinator":
            r.add_argument("--name", default="coordinator", help="process name (event file)")
        elif role == "owner":
            r.add_argument("--rank", type=int, required=True, help="training rank")
            r.add_argument("--store-port", type=int, default=None,
                           help="port of the launcher's rendezvous TCP store (default: the "
                           "MASTER_ADDR/MASTER_PORT environment)")  # fmt: skip
        elif role == "receiver":
            r.add_argument("--name", required=True, help="receiver name in the fleet file")
        else:
            r.add_argument("--node", required=True, help="rollout node name in the fleet file")


def run_demo_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dcr.demo import run_demo

    result: dict[str, Any] = run_demo(
        directory=Path(args.dir),
        size_mb=args.size_mb,
        refits=args.refits,
        rate=args.rate,
        seed=args.seed,
        faults=args.faults,
        quiet=args.json,
        keys=args.keys,
    )
    if args.json:
        print(json.dumps(result))
    return 0 if result["bit_exact"] else 1


def run_fleet_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dcr.errors import DcrError
    from dcr.fleet.config import load_fleet
    from dcr.fleet.faults import fault_plan
    from dcr.fleet.launcher import Launcher

    console = Console(stderr=True, quiet=args.json)
    try:
        cfg = load_fleet(args.fleet)
        launcher = Launcher(cfg, faults=fault_plan(cfg, args.faults, args.seed), say=console.print)
        report = launcher.run()
    except DcrError as exc:
        _err(f"dcr fleet: {type(exc).__name__}: {exc}")
        return 2
    print(json.dumps(report) if args.json else json.dumps(report, indent=1))
    return 0 if report["bit_exact"] else 1


def _dcr_error(exc: BaseException) -> DcrError | None:
    """The dcr error that ended a role: ``exc`` itself, or the one inside the exception
    groups anyio's task groups wrap it in."""
    from dcr.errors import DcrError

    if isinstance(exc, DcrError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _dcr_error(inner)
            if found is not None:
                return found
    return None


def run_role(args: argparse.Namespace) -> int:
    """Run one role of a fleet file; a configuration or protocol error ends it with one line
    on stderr (what is wrong and what to do) and status 2, not a traceback."""
    try:
        return _run_role(args)
    except BaseException as exc:
        error = _dcr_error(exc)
        if error is None:
            raise
        _err(f"dcr {args.command}: {type(error).__name__}: {error}")
        return 2


def _run_role(args: argparse.Namespace) -> int:
    import anyio

    from dcr.alloc import keep_freed_memory
    from dcr.fleet.config import load_fleet
    from dcr.fleet.runtime import die_with_parent, serve_until_signalled

    die_with_parent()
    keep_freed_memory()
    cfg = load_fleet(args.fleet)
    if args.command == "coordinator":
        from dcr.fleet.coordinator import run_coordinator

        main = lambda: run_coordinator(cfg, args.name)  # noqa: E731
    elif args.command == "owner":
        from dcr.fleet.trainer import run_trainer

        main = lambda: run_trainer(cfg, args.rank, args.store_port)  # noqa: E731
    elif args.command == "receiver":
        from dcr.fleet.receiver import run_receiver

        main = lambda: run_receiver(cfg, args.name)  # noqa: E731
    else:
        from dcr.fleet.relay import run_relay

        main = lambda: run_relay(cfg, args.node)  # noqa: E731
    anyio.run(serve_until_signalled, main, backend="asyncio")
    return 0
