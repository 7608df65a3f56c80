"""Key directories (``dcr keys``): what ``init`` writes and with which modes, the keyring's
one-key-one-identity rule, rotation and revocation as running processes see them, exports for
one host, and the refusals that keep a secret from being used carelessly."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from dcr.adapters.security import COORDINATOR, Identity, KeyDir, is_loopback
from dcr.cli import main
from dcr.errors import ConfigError

R0 = Identity("receiver", "r0")
O0 = Identity("owner", "o0")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_init_writes_private_keys_and_a_public_keyring(tmp_path: Path) -> None:
    keys = KeyDir.init(tmp_path / "keys", [COORDINATOR, R0, O0, R0])
    assert keys.keyring().identities() == sorted([COORDINATOR, R0, O0])
    assert _mode(tmp_path / "keys" / "fleet.secret") == 0o600
    for identity in (COORDINATOR, R0, O0):
        assert _mode(tmp_path / "keys" / "secret" / identity.filename) == 0o600
        public, secret = keys.pair(identity)
        assert keys.keyring().identity(public) == identity and len(secret) == 40
    assert _mode(tmp_path / "keys" / "secret") == 0o700
    assert len(keys.secret()) == 32
    other = KeyDir.init(tmp_path / "other", [R0])
    assert other.secret() != keys.secret()
    assert other.keyring().public(R0) != keys.keyring().public(R0)
    with pytest.raises(ConfigError, match="already holds a key directory"):
        KeyDir.init(tmp_path / "keys", [R0])


def test_rotation_and_revocation_are_seen_by_a_running_reader(tmp_path: Path) -> None:
    keys = KeyDir.init(tmp_path / "keys", [COORDINATOR, R0, O0])
    reader = KeyDir(tmp_path / "keys")  # another process's view
    old = reader.keyring().public(R0)
    keys.rotate(R0)
    new = keys.keyring().public(R0)
    assert new != old
    assert reader.keyring().identity(old) is None and reader.keyring().identity(new) == R0
    keys.revoke(O0)
    assert O0 not in reader.keyring()
    assert not (tmp_path / "keys" / "secret" / O0.filename).exists()
    with pytest.raises(ConfigError, match="no key pair for owner:o0"):
        reader.pair(O0)
    secret = keys.secret()
    keys.rotate_secret()
    assert reader.secret() != secret


def test_careless_key_material_is_refused(tmp_path: Path) -> None:
    keys = KeyDir.init(tmp_path / "keys", [COORDINATOR, R0])
    (tmp_path / "keys" / "fleet.secret").chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        keys.secret()
    pair = tmp_path / "keys" / "secret" / R0.filename
    pair.chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600"):
        keys.pair(R0)
    pair.chmod(0o600)
    # a key pair whose keyring entry was rotated elsewhere
    ring = json.loads((tmp_path / "keys" / "keyring.json").read_text())
    ring["identities"]["receiver:r0"] = ring["identities"]["coordinator:main"]
    (tmp_path / "keys" / "keyring.json").write_text(json.dumps(ring))
    with pytest.raises(ConfigError, match="same key"):
        KeyDir(tmp_path / "keys").keyring()
    with pytest.raises(ConfigError, match="no key directory"):
        KeyDir(tmp_path / "nothing")
    for bad in ("r0", "nobody:r0", "receiver:", "receiver:../x", "receiver:a b"):
        with pytest.raises(ConfigError):
            Identity.parse(bad)


def test_cli_init_from_a_fleet_file_and_export_for_one_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        '[fleet]\nrun_dir = "run"\nkeys = "keys"\n[trainer]\ntp = 1\ndp = 2\n'
        '[[rollout]]\nname = "node0"\nreceivers = [{ name = "r0" }, { name = "r1" }]\n'
    )
    assert main(["keys", "init", str(tmp_path / "keys"), "--fleet", str(fleet), "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["identities"] == [
        "coordinator:main", "owner:o0", "owner:o1", "receiver:r0", "receiver:r1", "relay:node0",
    ]
    out = tmp_path / "host-node0"
    assert main(["keys", "export", str(tmp_path / "keys"), str(out),
                 "--for", "relay:node0", "receiver:r1"]) == 0
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "fleet.secret", "keyring.json", "secret/receiver.r1.key_secret",
        "secret/relay.node0.key_secret",
    ]
    exported = KeyDir(out)
    exported.pair(Identity("relay", "node0"))
    with pytest.raises(ConfigError, match="no key pair for receiver:r0"):
        exported.pair(R0)
    relay_only = tmp_path / "relay-only"
    assert main(["keys", "export", str(tmp_path / "keys"), str(relay_only),
                 "--for", "relay:node0"]) == 0
    assert not (relay_only / "fleet.secret").exists()  # relay nodes never see the secret
    capsys.readouterr()
    assert main(["keys", "rotate", str(tmp_path / "keys")]) == 2
    assert "either an identity or --secret" in capsys.readouterr().err
    assert os.stat(tmp_path / "keys" / "keyring.json").st_size > 0


def test_loopback_addresses() -> None:
    for address in ("tcp://127.0.0.1:5", "tcp://127.8.0.1:0", "tcp://[::1]:7", "ipc:///tmp/x",
                    "inproc://a", "tcp://localhost:9"):
        assert is_loopback(address), address
    for address in ("tcp://0.0.0.0:5", "tcp://10.0.0.1:0", "tcp://*:5", "tcp://[::]:7",
                    "tcp://example.com:9"):
        assert not is_loopback(address), address
