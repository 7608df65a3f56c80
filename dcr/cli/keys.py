"""``dcr keys``: make and change a fleet's key directory (CURVE key pairs bound to identities,
the keyring, the fleet secret) and export what one host needs."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from typing import Any

from dcr.adapters.security import Identity, KeyDir
from dcr.adapters.security.keys import KEYRING, SECRET, SECRET_DIR
from dcr.errors import ConfigError

__all__ = ["add_keys_parser", "run_keys_command"]

_EPILOG = """\
A key directory holds keyring.json (identity -> public key; public), fleet.secret (seals
payloads and manifests; mode 0600) and secret/<role>.<name>.key_secret (one CURVE key pair per
identity; mode 0600).  Name it in the fleet file: [fleet] keys = "DIR".

Identities are role:name with role coordinator, owner, receiver or relay.  `--fleet FILE`
takes every identity a fleet file implies: coordinator:main, owner:o0.., receiver:<name> for
each receiver, relay:<node> for each [[rollout]] node.

Across hosts, give each host only what its processes need (`dcr keys export`): the keyring,
the fleet secret (owners and receivers), and its own identities' key pairs.

Rotation:
  * one identity's key (a host was lost or the key leaked): `dcr keys rotate DIR role:name`,
    copy keyring.json everywhere and the new key pair to that identity's host, restart that
    process.  Running processes re-read keyring.json when it changes: the old key is refused
    at its next connection.
  * remove an identity: `dcr keys revoke DIR role:name` (same: refused at once once
    keyring.json is copied).
  * the fleet secret: `dcr keys rotate DIR --secret`, copy fleet.secret to every owner and
    receiver host and restart them between two refits; payloads sealed under the old secret
    are refused from then on (a receiver restarted under the new secret restores by dense
    refit as usual).
"""


def add_keys_parser(sub: Any) -> None:
    keys = sub.add_parser(
        "keys",
        help="make and change a fleet's key directory (see `dcr keys -h`)",
        description="Key material of a fleet: CURVE identities and the fleet secret.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ksub = keys.add_subparsers(dest="keys", required=True)
    init = ksub.add_parser("init", help="make a new key directory")
    init.add_argument("dir")
    init.add_argument("identities", nargs="*", help="role:name ...")
    init.add_argument("--fleet", help="also every identity this fleet file implies")
    add = ksub.add_parser("add", help="give new identities key pairs")
    add.add_argument("dir")
    add.add_argument("identities", nargs="*", help="role:name ...")
    add.add_argument("--fleet", help="also every identity this fleet file implies")
    rotate = ksub.add_parser("rotate", help="a new key pair for an identity, or a new secret")
    rotate.add_argument("dir")
    rotate.add_argument("identity", nargs="?", help="role:name")
    rotate.add_argument("--secret", action="store_true", help="a new fleet secret")
    revoke = ksub.add_parser("revoke", help="remove an identity from the keyring")
    revoke.add_argument("dir")
    revoke.add_argument("identity", help="role:name")
    show = ksub.add_parser("list", help="the identities and public keys of a key directory")
    show.add_argument("dir")
    export = ksub.add_parser("export", help="copy what one host needs into a new directory")
    export.add_argument("dir")
    export.add_argument("out")
    export.add_argument(
        "--for",
        dest="identities",
        nargs="+",
        required=True,
        help="the identities whose processes run on that host",
    )
    for p in (init, add, rotate, revoke, show, export):
        p.add_argument("--json", action="store_true", help="print one JSON object")


def _wanted(args: argparse.Namespace) -> list[Identity]:
    wanted = [Identity.parse(text) for text in args.identities]
    if getattr(args, "fleet", None):
        from dcr.fleet.config import load_fleet

        wanted += load_fleet(args.fleet).identities()
    return wanted


def run_keys_command(args: argparse.Namespace) -> int:
    try:
        report = _run(args)
    except ConfigError as exc:
        print(f"dcr keys: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        for key, value in report.items():
            shown = value if not isinstance(value, list) else " ".join(map(str, value)) or "-"
            print(f"{key}: {shown}")
    return 0


def _run(args: argparse.Namespace) -> dict[str, Any]:
    if args.keys == "init":
        made = KeyDir.init(args.dir, _wanted(args))
        return {"dir": str(made.path), "identities": [str(i) for i in made.keyring().identities()]}
    keys = KeyDir(args.dir)
    if args.keys == "add":
        return {"added": [str(i) for i in keys.add(_wanted(args))]}
    if args.keys == "rotate":
        if args.secret == (args.identity is not None):
            raise ConfigError("rotate takes either an identity or --secret")
        if args.secret:
            keys.rotate_secret()
            return {"rotated": "fleet secret"}
        identity = Identity.parse(args.identity)
        keys.rotate(identity)
        return {"rotated": str(identity), "public_key": keys.keyring().public(identity).decode()}
    if args.keys == "revoke":
        identity = Identity.parse(args.identity)
        keys.revoke(identity)
        return {"revoked": str(identity)}
    if args.keys == "list":
        ring = keys.keyring()
        return {str(i): ring.public(i).decode() for i in ring.identities()}
    return _export(keys, args)


def _export(keys: KeyDir, args: argparse.Namespace) -> dict[str, Any]:
    from pathlib import Path

    wanted = [Identity.parse(text) for text in args.identities]
    for identity in wanted:
        keys.pair(identity)  # present and the keyring's
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{str(out)!r} exists and is not empty")
    (out / SECRET_DIR).mkdir(parents=True, mode=0o700, exist_ok=True)
    shutil.copy2(keys.path / KEYRING, out / KEYRING)
    copied = []
    if any(i.role in ("owner", "receiver") for i in wanted):
        keys.secret()  # readable and private
        shutil.copy2(keys.path / SECRET, out / SECRET)
        copied.append(SECRET)
    for identity in wanted:
        name = f"{SECRET_DIR}/{identity.filename}"
        shutil.copy2(keys.path / name, out / name)
        copied.append(name)
    return {"dir": str(out), "copied": [KEYRING, *copied]}
