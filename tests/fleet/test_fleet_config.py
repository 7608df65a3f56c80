"""The fleet file: defaults, validation with clear errors, ports chosen by the launcher."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dcr import ports as fleet_ports
from dcr.errors import ConfigError
from dcr.fleet.config import free_ports, load_fleet
from dcr.fleet.model import FleetModel
from dcr.fleet.runtime import make_transport
from dcr.protocol.proof import ProofConfig

MINIMAL = """
[model]
size_mb = 0
refits = 2

[[rollout]]
name = "a"
receivers = [{ name = "r0", tp = 1, rank = 0 }]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return path


def test_a_minimal_file_gets_the_documented_defaults(tmp_path: Path) -> None:
    cfg = load_fleet(write(tmp_path, MINIMAL))
    assert cfg.run_dir == tmp_path / "run"
    assert cfg.owners == ("o0", "o1", "o2", "o3")  # TP=2 x DP=2 by default
    assert cfg.commit_store["kind"] == "sqlite" and cfg.control["kind"] == "zmq"
    assert cfg.transport == {"kind": "relay", "fanout": 2}
    assert cfg.coordinator.standbys == 1 and cfg.coordinator.timeouts.baseline_s == 3.0
    assert cfg.node_of("r0").name == "a"
    assert (cfg.queue.groups, cfg.queue.group_size) == (32, 8)  # paper App. C
    small = load_fleet(write(tmp_path, MINIMAL + "[queue]\ngroups = 2\ngroup_size = 4\n"))
    assert (small.queue.groups, small.queue.group_size, small.queue.capacity) == (2, 4, 12)
    # The proof of the base version is on by default, like LocalRefit's.
    assert cfg.proof == ProofConfig()
    each = load_fleet(write(tmp_path, MINIMAL + "[proof]\nfingerprint_each_commit = true\n"))
    assert each.proof == ProofConfig(fingerprint_each_commit=True)
    assert load_fleet(write(tmp_path, MINIMAL + "[proof]\nenabled = false\n")).proof is None
    # Construction threads: the process's CPUs unless the file shares them out.
    assert cfg.trainer.build_threads == 0 and FleetModel(cfg).build.threads is None
    one = load_fleet(write(tmp_path, MINIMAL + "[trainer]\nbuild_threads = 1\n"))
    assert FleetModel(one).build.worker_threads == 1


def test_a_fleet_off_this_host_needs_keys_or_says_insecure(tmp_path: Path) -> None:
    off_host = '[fleet]\nhost = "10.0.0.7"\n'
    insecure = load_fleet(write(tmp_path, off_host + "insecure = true\n" + MINIMAL))
    assert insecure.insecure and insecure.security().insecure and not insecure.security().keyed
    keyed = load_fleet(write(tmp_path, '[fleet]\nhost = "10.0.0.7"\nkeys = "k"\n' + MINIMAL))
    assert keyed.keys == tmp_path / "k" and keyed.ensure_keys() == keyed.identities()
    assert keyed.security().keyed and keyed.ensure_keys() == []
    assert [str(i) for i in keyed.identities()] == [
        "coordinator:main",
        "owner:o0",
        "owner:o1",
        "owner:o2",
        "owner:o3",
        "receiver:r0",
        "relay:a",
    ]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[model]\nrefits = 1\n", "at least one [[rollout]]"),
        (MINIMAL + "[trainer]\ntpp = 2\n", "unknown keys ['tpp']"),
        (MINIMAL + "[nonsense]\n", "unknown sections"),
        (MINIMAL.replace("rank = 0", "rank = 3"), "rank 3 outside tp=1"),
        (MINIMAL + '[[rollout]]\nname = "b"\nreceivers = [{ name = "r0" }]\n', "unique"),
        ("[model\n", "not valid TOML"),
        (MINIMAL + "[coordinator.timeouts]\nprepare_s = -1\n", "prepare_s must be positive"),
        (MINIMAL + "[queue]\ngroups = 0\n", "groups"),
        (MINIMAL + "[queue]\ndepth = 4\n", "unknown keys ['depth']"),
        (MINIMAL + "[proof]\nsample = 4\n", "unknown keys ['sample']"),
        (MINIMAL + "[proof]\nsamples = -1\n", "samples must be >= 0"),
        (MINIMAL + '[proof]\nenabled = "no"\n', "enabled must be true or false"),
        (MINIMAL + "[trainer]\nbuild_threads = -1\n", "build_threads must be an integer >= 0"),
        (MINIMAL + "[trainer]\nbuild_threads = 1.5\n", "build_threads must be an integer >= 0"),
        (MINIMAL + "[trainer]\nbuild_threads = true\n", "build_threads must be an integer >= 0"),
        ('[fleet]\nhost = "10.0.0.7"\n' + MINIMAL, "the fleet has no keys"),
        ('[fleet]\nhost = "192.0.2.1"\ninsecure = "yes"\n' + MINIMAL, "insecure must be true"),
        ("[fleet]\nkeys = 3\n" + MINIMAL, "keys must name a key directory"),
    ],
)
def test_bad_fleet_files_raise_a_clear_config_error(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        load_fleet(write(tmp_path, text))
    assert needle in str(info.value)


def test_roles_need_the_ports_the_launcher_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_fleet(write(tmp_path, MINIMAL))
    monkeypatch.setattr("dcr.fleet.config.RELAY_PORT_WAIT_S", 0.0)
    with pytest.raises(ConfigError, match="start `dcr relay"):
        make_transport(cfg)
    cfg.run_dir.mkdir()
    cfg.ports_file.write_text('{"a": 41234}')
    assert cfg.address("a") == "tcp://127.0.0.1:41234"


def test_mixed_mode_xors_what_every_serving_layout_preserves(tmp_path: Path) -> None:
    text = MINIMAL.replace(
        'receivers = [{ name = "r0", tp = 1, rank = 0 }]',
        'receivers = [{ name = "r0", tp = 1, rank = 0 }, { name = "r1", tp = 2, rank = 1 }]',
    )
    model = FleetModel(load_fleet(write(tmp_path, text)))
    xor = model.xor_names
    # The sharded ranks keep the final norm in float32 (a cast): never XOR-encoded.
    assert "model.norm.weight" not in xor
    assert "model.layers.0.self_attn.q_proj.weight" in xor and len(xor) > 10


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_free_ports_lie_outside_the_ports_the_os_hands_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A port the OS hands out for outgoing connections or port-0 binds could be taken by
    # any process before the relay node binds it (or rebinds it after a restart).
    lo, _ = fleet_ports._ephemeral_range()
    ports = free_ports(12)
    assert len(set(ports)) == 12 and all(_bindable(p) for p in ports)
    if lo - 10000 >= 1000:
        assert all(10000 <= p < lo for p in ports)
    # An OS whose ephemeral range leaves no room: any free ports, still distinct.
    monkeypatch.setattr(fleet_ports, "_ephemeral_range", lambda: (1024, 65535))
    anywhere = free_ports(5)
    assert len(set(anywhere)) == 5 and all(0 < p < 65536 for p in anywhere)
    monkeypatch.setattr(fleet_ports, "_ephemeral_range", lambda: (1024, 60000))
    assert all(p > 60000 for p in free_ports(3))
