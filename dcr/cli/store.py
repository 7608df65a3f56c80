"""``dcr commit-store``: an operator's view of the commit store a fleet file names -- ``show``
prints the record, ``reset`` deletes it (and the marker beside it) so that the store reads as
never written.  A record deleted or expired after a commit is an error every role stops at
(it never reads as version 0); ``reset`` is the explicit way back to a fresh fleet."""

from __future__ import annotations

import argparse
import json
from typing import Any

from dcr.cli.arguments import _err


def add_store_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    store = sub.add_parser(
        "commit-store",
        help="show or reset the commit store of a fleet file",
        description=(
            "The commit store of a fleet file ([commit_store]): 'show' prints the commit "
            "record; 'reset' deletes it and its marker, so the fleet starts afresh at version "
            "0 (the way out of a record that was deleted or expired after the fleet committed)."
        ),
    )
    ssub = store.add_subparsers(dest="store_command", required=True)
    show = ssub.add_parser("show", help="print the commit record")
    reset = ssub.add_parser(
        "reset",
        help="delete the commit record and its marker: a fresh fleet at version 0",
        description=(
            "Deletes what the commit store holds of the fleet's record (S3: the record object "
            "and its marker <key>.written; SQLite: the policy's row and the marker file beside "
            "the database) and prints each deleted item. Refused while a coordinator's lease "
            "runs (--force overrides); never run it while the fleet is up."
        ),
    )
    reset.add_argument("--dry-run", action="store_true",
                       help="print what would be deleted; delete nothing")  # fmt: skip
    reset.add_argument("--force", action="store_true",
                       help="reset even while a coordinator's lease runs")  # fmt: skip
    for p in (show, reset):
        p.add_argument("--fleet", required=True, help="the fleet file (TOML)")
        p.add_argument("--json", action="store_true", help="print one JSON object")


def run_store_command(args: argparse.Namespace) -> int:
    import anyio

    from dcr.errors import DcrError

    try:
        result = anyio.run(_run, args, backend="asyncio")
    except DcrError as exc:
        _err(f"dcr commit-store {args.store_command}: {type(exc).__name__}: {exc}")
        return 2
    if args.json:
        print(json.dumps(result))
    elif args.store_command == "show":
        print(json.dumps(result, indent=1))
    else:
        verb = "would delete" if args.dry_run else "deleted"
        if not result["deleted"]:
            print(f"{result['store']}: nothing stored, nothing {verb}")
        for item in result["deleted"]:
            print(f"{verb} {item}")
    return 0


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    from dcr.errors import CommitStoreError
    from dcr.fleet.config import load_fleet
    from dcr.fleet.runtime import make_store

    store = make_store(load_fleet(args.fleet))
    try:
        if args.store_command == "show":
            s = await store.read()
            return {"store": repr(store), "version": s.record.version,
                    "candidate": s.record.candidate, "epoch": s.epoch, "attempt": s.attempt,
                    "address": s.address, "lease": s.lease}  # fmt: skip
        if not args.force:
            try:
                s = await store.read()
            except CommitStoreError as exc:
                if exc.check != "missing":
                    raise
            else:
                if s.lease is not None and s.lease > store.clock():
                    raise CommitStoreError(
                        f"coordinator epoch {s.epoch} at {s.address or '?'} holds a lease on "
                        f"{store!r} for {s.lease - store.clock():.0f} s more: stop the fleet "
                        "first (or pass --force if that coordinator is gone)",
                        retryable=True,
                        check="reset",
                    )
        deleted = await store.reset(dry_run=args.dry_run)
        return {"store": repr(store), "dry_run": args.dry_run, "deleted": deleted}
    finally:
        await store.close()
