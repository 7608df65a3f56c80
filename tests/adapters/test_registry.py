"""The adapter registry: dcr's own adapters, entry points of other distributions and
``module:attr`` targets, and adapters that build themselves from a fleet file.

A third party is played by ``plugin_pkg/dcr_test_plugin``: :func:`install` writes it into a
directory on ``sys.path`` beside a ``*.dist-info`` holding its ``METADATA`` and
``entry_points.txt``, as ``pip install`` would.  Its transport and commit store then build from
a fleet file through :mod:`dcr.fleet.runtime` like dcr's own, carry payloads, compare and set,
and pass the same conformance suites (:mod:`dcr.testing.transport`,
:mod:`dcr.testing.commit_store`).
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import itertools
import shutil
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

import dcr.fleet.runtime
from dcr.adapters import registry
from dcr.adapters.commit.base import INITIAL_RECORD, CommitStore
from dcr.adapters.commit.sqlite import SqliteCommitStore
from dcr.adapters.context import AdapterContext
from dcr.adapters.registry import GROUPS, available, load, load_factory, register, resolve
from dcr.adapters.transport.base import Transport, TransportStats
from dcr.adapters.transport.directory import DirectoryTransport
from dcr.adapters.transport.objstore import ObjectStoreTransport
from dcr.errors import CommitConflict, ConfigError
from dcr.fleet.config import FleetConfig, load_fleet
from dcr.fleet.runtime import (
    adapter_context,
    make_control,
    make_store,
    make_transport,
    relayed,
)
from dcr.protocol.types import CommitOutcome, CommitRecord, PayloadKey
from dcr.testing.commit_store import CommitStoreTests, ManualClock
from dcr.testing.transport import ProcessHarness, TransportHarness, TransportTests

PLUGIN = Path(__file__).resolve().parent / "plugin_pkg" / "dcr_test_plugin"
SPOOL = "dcr_test_plugin.transport:SpoolTransport"
JSONFILE = "dcr_test_plugin.store:JsonFileCommitStore"
ENTRY_POINTS = {
    "dcr.transports": {"spool": SPOOL},
    "dcr.commit_stores": {"jsonfile": JSONFILE},
    "dcr.trainers": {"echo": "dcr_test_plugin.factories:make_trainer"},
}
G1 = CommitRecord(version=1, candidate="g1")


# -- a distribution installed at run time ---------------------------------------------------


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on ``sys.path`` that plays site-packages; the registry reads entry points
    afresh while it is there and after it is gone."""
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    registry.clear_entry_points()
    yield path
    registry.clear_entry_points()
    for name in [m for m in sys.modules if m.partition(".")[0] == PLUGIN.name]:
        del sys.modules[name]


def install(
    site: Path,
    name: str = "dcr-test-plugin",
    entry_points: Mapping[str, Mapping[str, str]] = ENTRY_POINTS,
    *,
    package: bool = True,
) -> None:
    """Install distribution ``name`` into ``site``: its dist-info (``METADATA``,
    ``entry_points.txt``) and, with ``package``, the plugin package's code."""
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = []
    for group, names in entry_points.items():
        lines += [f"[{group}]", *(f"{k} = {v}" for k, v in names.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    if package and not (site / PLUGIN.name).exists():
        shutil.copytree(PLUGIN, site / PLUGIN.name)
    importlib.invalidate_caches()
    registry.clear_entry_points()


FLEET = """
[fleet]
run_dir = "run"

[model]
size_mb = 0
refits = 1

[[rollout]]
name = "a"
receivers = [{{ name = "r0" }}, {{ name = "r1" }}]

[[rollout]]
name = "b"
receivers = [{{ name = "r2" }}]

{sections}
"""


def fleet(directory: Path, sections: str = "") -> FleetConfig:
    """A fleet file with two rollout nodes (``a`` hosts two receivers, ``b`` one)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "fleet.toml"
    path.write_text(FLEET.format(sections=sections))
    return load_fleet(path)


SPOOL_FLEET = """
[transport]
kind = "spool"
spool = "spooldir"
poll_s = 0.02
arrival_grace_s = 2.0
backoff_s = 0.01
backoff_max_s = 0.1
"""


# -- names: built-in, entry points, targets -------------------------------------------------


def test_every_kind_has_its_entry_point_group() -> None:
    assert dict(GROUPS) == {
        "transport": "dcr.transports",
        "commit_store": "dcr.commit_stores",
        "control": "dcr.control",
        "loader": "dcr.loaders",
        "trainer": "dcr.trainers",
        "receiver": "dcr.receivers",
    }
    assert available("transport") == ["directory", "memory", "relay", "s3"]


def test_plugin_kinds_resolve_by_name(site: Path) -> None:
    assert "spool" not in available("transport")
    install(site)
    assert "spool" in available("transport") and "jsonfile" in available("commit_store")
    assert "echo" in available("trainer")
    spec = resolve("transport", "spool")
    assert (spec.target, spec.origin) == (SPOOL, "distribution dcr-test-plugin")
    cls = load("transport", "spool")
    assert f"{cls.__module__}:{cls.__qualname__}" == SPOOL and issubclass(cls, Transport)
    store = load("commit_store", "jsonfile")
    assert issubclass(store, CommitStore)
    # Trainers and receiver runtimes are factories: any callable.
    make = load_factory("trainer", "echo")
    assert make(tp=2) == {"trainer": "echo", "tp": 2}
    # Built-in names still resolve to dcr's own adapters.
    assert load("transport", "directory") is DirectoryTransport
    assert resolve("transport", "directory").origin == "dcr"


def test_entry_points_are_read_once_per_group(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install(site)
    groups: list[str] = []
    real = importlib.metadata.entry_points

    def counting(**kwargs: Any) -> Any:
        groups.append(kwargs["group"])
        return real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "entry_points", counting)
    registry.clear_entry_points()
    for _ in range(3):
        load("transport", "spool")
        load("transport", "directory")
        available("transport")
    load("commit_store", "jsonfile")
    assert groups == ["dcr.transports", "dcr.commit_stores"]


def test_a_direct_target_needs_no_registration(site: Path, tmp_path: Path) -> None:
    install(site, entry_points={}, package=True)  # importable, but no entry points
    assert "spool" not in available("transport")
    assert load("transport", SPOOL).__name__ == "SpoolTransport"
    make = load_factory("trainer", "dcr_test_plugin.factories:make_trainer")
    assert make() == {"trainer": "echo"}
    # A fleet file names a class by its target, for every kind of section.
    cfg = fleet(
        tmp_path / "f",
        f'[transport]\nkind = "{SPOOL}"\n'
        '[commit_store]\nkind = "dcr.adapters.commit.sqlite:SqliteCommitStore"\n'
        '[control]\nkind = "dcr.adapters.control.zmq:ZmqControl"\n',
    )
    transport = make_transport(cfg)
    assert type(transport).__name__ == "SpoolTransport"
    assert transport.spool == str(cfg.run_dir / "spool")  # type: ignore[attr-defined]
    store = make_store(cfg)
    assert isinstance(store, SqliteCommitStore) and store.path == cfg.run_dir / "commit.db"
    from dcr.adapters.control.zmq import ZmqControl

    control = make_control(cfg, store)
    assert isinstance(control, ZmqControl) and control.store is store
    assert control.config.bind == "tcp://127.0.0.1:0"

    async def close() -> None:
        await transport.aclose()
        await control.aclose()
        await store.close()

    anyio.run(close, backend="asyncio")


# -- a third party's adapters built from a fleet file ---------------------------------------


def test_a_plugin_transport_builds_from_a_fleet_file_and_carries_payloads(
    site: Path, tmp_path: Path
) -> None:
    install(site)
    cfg = fleet(tmp_path, SPOOL_FLEET)
    assert relayed(cfg) is False
    key = PayloadKey(attempt=1, owner="o0", payload_id=0)
    data = bytes(range(256)) * 64

    async def main() -> None:
        owner = make_transport(cfg)
        node_a = make_transport(cfg, node="a")
        node_b = make_transport(cfg, node="b")
        try:
            assert type(owner).__name__ == "SpoolTransport"
            assert owner.spool == str(tmp_path / "spooldir")  # type: ignore[attr-defined]
            assert isinstance(owner, ObjectStoreTransport) and owner.config.poll_s == 0.02
            assert isinstance(node_a, ObjectStoreTransport)
            assert isinstance(node_b, ObjectStoreTransport)
            # dcr's node-cache rule, applied by the plugin's own from_config: node a hosts
            # two receivers, so their processes share downloads; b and owners do not.
            assert node_a.config.node_cache == str(cfg.run_dir / "fetches" / "a")
            assert node_b.config.node_cache is None and owner.config.node_cache is None
            assert node_a.built_for == "a"  # type: ignore[attr-defined]
            got: dict[str, bytes] = {}

            async def take(transport: Transport, name: str) -> None:
                async for delivery in transport.subscribe(name):
                    assert delivery.key == key
                    got[name] = delivery.data
                    await transport.taken(name, delivery.key)
                    return

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(take, node_a, "r0")
                    tg.start_soon(take, node_b, "r2")
                    await owner.send(key, data)
            assert got == {"r0": data, "r2": data}
            assert owner.stats().payload_bytes == len(data)
        finally:
            for t in (owner, node_a, node_b):
                await t.aclose()

    anyio.run(main, backend="asyncio")


class _FleetHarness(ProcessHarness):
    """Every owner and the coordinator build a transport of their own from the fleet file
    (as separate processes would); the receivers subscribe on node ``b``'s, which counts
    V_cross and V_payload as it fetches."""

    def __init__(self, cfg: FleetConfig) -> None:
        async def make(node: str | None = None) -> Transport:
            return make_transport(cfg, node=node)

        super().__init__(make, make_node=lambda: make("b"))

    def boundary_stats(self) -> TransportStats:
        assert isinstance(self.node, ObjectStoreTransport)
        return self.node.fetch_stats().traffic


class TestPluginTransport(TransportTests):
    """A plugin transport, built from a fleet file, passes the transport conformance suite."""

    # An object-store transport: a send returns once the payload and its manifest entry are
    # stored, and cleanup deletes an attempt's objects (see test_transport_objstore.py).
    credit = False
    keeps_sent_at_cleanup = False
    timeout_s = 30.0

    @pytest.fixture(autouse=True)
    def _fleet(self, site: Path, tmp_path: Path) -> None:
        install(site)
        self.cfg = fleet(tmp_path, SPOOL_FLEET)

    def make_harness(self) -> TransportHarness:
        return _FleetHarness(self.cfg)


def test_a_plugin_commit_store_builds_from_a_fleet_file_and_compares_and_sets(
    site: Path, tmp_path: Path
) -> None:
    install(site)
    cfg = fleet(tmp_path, '[commit_store]\nkind = "jsonfile"\nfile = "record.json"\n')

    async def main() -> None:
        coordinator, endpoint = make_store(cfg), make_store(cfg)  # two processes' stores
        assert type(coordinator).__name__ == "JsonFileCommitStore"
        assert coordinator.path == cfg.run_dir / "record.json"  # type: ignore[attr-defined]
        epoch = await coordinator.claim(address="tcp://x:1")
        await coordinator.register(epoch=epoch, attempt=1, base=INITIAL_RECORD)
        far = time.time() + 3600
        outcome = await coordinator.compare_and_set(
            epoch=epoch, attempt=1, expected=INITIAL_RECORD, new=G1, deadline=far
        )
        assert outcome is CommitOutcome.SUCCEEDED
        seen = await endpoint.read()
        assert (seen.record, seen.epoch, seen.address) == (G1, epoch, "tcp://x:1")
        # The record moved on: the same base can neither register nor commit again.
        with pytest.raises(CommitConflict):
            await endpoint.register(epoch=epoch, attempt=2, base=INITIAL_RECORD)
        newer = await endpoint.claim()
        stale = await coordinator.compare_and_set(
            epoch=epoch, attempt=1, expected=G1, new=CommitRecord(version=2, candidate="g2"),
            deadline=far,
        )  # fmt: skip
        assert stale is CommitOutcome.CONFLICT and newer == epoch + 1

    anyio.run(main, backend="asyncio")


class TestPluginCommitStore(CommitStoreTests):
    """A plugin commit store, built from a fleet file, passes the commit-store suite."""

    max_examples, steps = 15, 20

    @pytest.fixture(autouse=True)
    def _fleet(self, site: Path, tmp_path: Path) -> None:
        install(site)
        self.root = tmp_path
        self.fleets = itertools.count()

    def make_store(self, clock: ManualClock) -> CommitStore:
        directory = self.root / f"fleet{next(self.fleets)}"
        store = make_store(fleet(directory, '[commit_store]\nkind = "jsonfile"\n'))
        store.clock = clock
        return store


def test_the_context_a_fleet_gives_its_adapters(tmp_path: Path) -> None:
    cfg = fleet(tmp_path)
    cfg.run_dir.mkdir()
    cfg.ports_file.write_text('{"a": 41001, "b": 41002}')
    context = adapter_context(cfg, "transport", node="a")
    assert isinstance(context, AdapterContext)
    assert (context.section, context.base_dir, context.run_dir) == (
        "transport", tmp_path, tmp_path / "run"
    )  # fmt: skip
    assert (context.host, context.node, context.node_receivers) == ("127.0.0.1", "a", 2)
    assert (context.nodes, context.root, context.store) == (("a", "b"), "a", None)
    assert context.node_address("b") == "tcp://127.0.0.1:41002"
    assert context.path("x/y") == tmp_path / "x" / "y"
    assert adapter_context(cfg, "control").node_receivers == 0


def test_the_built_in_adapters_keep_their_fleet_file_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = fleet(tmp_path)
    store = make_store(cfg)
    assert isinstance(store, SqliteCommitStore) and store.path == cfg.run_dir / "commit.db"
    anyio.run(store.close)
    # The relay tree: the root at the first node, the process's own node, fan-out kept for
    # the relay processes; its addresses need the ports the launcher chose.
    assert relayed(cfg) is True
    monkeypatch.setattr("dcr.fleet.config.RELAY_PORT_WAIT_S", 0.0)
    with pytest.raises(ConfigError, match="start `dcr relay"):
        make_transport(cfg)
    cfg.ports_file.write_text('{"a": 41001, "b": 41002}')
    from dcr.adapters.transport.relay import RelayTransport

    relay = make_transport(cfg, node="b")
    assert isinstance(relay, RelayTransport)
    assert (relay.root, relay.node) == ("tcp://127.0.0.1:41001", "tcp://127.0.0.1:41002")
    objects = make_transport(fleet(tmp_path / "d", '[transport]\nkind = "directory"\n'))
    assert isinstance(objects, DirectoryTransport)
    assert objects.path == tmp_path / "d" / "run" / "objects"
    anyio.run(objects.aclose, backend="asyncio")


# -- what is refused, and how it is said ----------------------------------------------------


def test_unknown_kinds_name_what_is_available(site: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load("transport", "foo")
    assert str(info.value) == (
        "no transport named 'foo'; available: directory, memory, relay, s3 "
        "(entry points of group dcr.transports add more)"
    )
    install(site)
    with pytest.raises(ConfigError, match=r"available: directory, memory, relay, s3, spool \("):
        make_transport(fleet(tmp_path, '[transport]\nkind = "foo"\n'))
    with pytest.raises(ConfigError, match=r"no commit_store named 'nope'; available: jsonfile, "):
        make_store(fleet(tmp_path / "s", '[commit_store]\nkind = "nope"\n'))
    with pytest.raises(ConfigError, match=r"no trainer named 'x'; available: (\w+, )*echo\b"):
        load_factory("trainer", "x")
    with pytest.raises(ConfigError, match="unknown adapter kind 'widget'; kinds: commit_store"):
        load("widget", "x")


def test_unimportable_targets_say_what_failed(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError) as info:
        load_factory("trainer", "dcr_no_such_pkg.mod:fn")
    assert str(info.value).startswith(
        "cannot import 'dcr_no_such_pkg.mod:fn' named by trainer.kind: ModuleNotFoundError: "
    )
    with pytest.raises(ConfigError, match=r"named by transport\.kind: AttributeError: "):
        load("transport", "dcr.adapters.registry:Nothing")
    for bad in ("dcr.adapters:", "a b:c", ":Class", "pkg.mod:x:y"):
        with pytest.raises(ConfigError, match=r"must look like 'package\.module:attr'"):
            load("transport", bad)
    # A distribution whose entry point names a module it does not ship.
    install(site, "dcr-ghost", {"dcr.transports": {"ghost": "dcr_ghost.t:Ghost"}}, package=False)
    with pytest.raises(ConfigError, match=r"cannot import 'dcr_ghost.t:Ghost' \(transport "
                       r"'ghost'\) named by transport.kind: ModuleNotFoundError"):  # fmt: skip
        make_transport(fleet(tmp_path, '[transport]\nkind = "ghost"\n'))
    # A built-in adapter whose vendor library is missing says what to install.
    monkeypatch.setattr(registry, "_BUILTINS", dict(registry._BUILTINS))
    register("transport", "vendored", "dcr_missing_vendor.t:T", install="pip install vendor")
    with pytest.raises(ConfigError, match=r"; install it with: pip install vendor$"):
        load("transport", "vendored")
    # Something importable that is not what the section needs.
    install(site, entry_points={})
    with pytest.raises(ConfigError, match="an object of type int, not a class or function"):
        load_factory("trainer", "dcr_test_plugin.factories:NOT_CALLABLE")
    with pytest.raises(ConfigError, match=r"an object of type function, not a class$"):
        load("transport", "dcr_test_plugin.factories:make_trainer")
    with pytest.raises(
        ConfigError, match=r"which is not a dcr\.adapters\.transport\.base\.Transport"
    ):
        make_transport(fleet(tmp_path, f'[transport]\nkind = "{JSONFILE}"\n'))


def test_a_name_given_twice_is_refused_with_both_targets(site: Path, tmp_path: Path) -> None:
    install(site)
    install(site, "dcr-test-twin", {"dcr.transports": {"spool": "dcr_twin.t:Spool"}},
            package=False)  # fmt: skip
    with pytest.raises(ConfigError) as info:
        load("transport", "spool")
    message = str(info.value)
    assert "the transport name 'spool' is registered more than once" in message
    assert f"'{SPOOL}' (entry point of distribution dcr-test-plugin" in message
    assert "'dcr_twin.t:Spool' (entry point of distribution dcr-test-twin" in message
    with pytest.raises(ConfigError, match="registered more than once"):
        make_transport(fleet(tmp_path, SPOOL_FLEET))
    # Other names of the group are not ambiguous.
    assert load("transport", "directory") is DirectoryTransport


def test_a_plugin_cannot_take_a_built_in_name(site: Path) -> None:
    install(site, "dcr-usurper", {"dcr.commit_stores": {"sqlite": JSONFILE}})
    with pytest.raises(ConfigError) as info:
        load("commit_store", "sqlite")
    message = str(info.value)
    assert "'dcr.adapters.commit.sqlite:SqliteCommitStore' (built into dcr)" in message
    assert f"'{JSONFILE}' (entry point of distribution dcr-usurper" in message
    # Naming dcr's own target again is no conflict (a distribution may list it).
    same = {"dcr.transports": {"directory": "dcr.adapters.transport.directory:DirectoryTransport"}}
    install(site, "dcr-echo", same, package=False)
    assert load("transport", "directory") is DirectoryTransport


def test_register_refuses_a_taken_name_and_a_bad_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_BUILTINS", dict(registry._BUILTINS))
    with pytest.raises(ConfigError, match=r"already registered: 'dcr.adapters.transport"):
        register("transport", "directory", "x.y:Z")
    with pytest.raises(ConfigError, match="must look like"):
        register("transport", "fresh", "not-a-target")
    with pytest.raises(ConfigError, match="unknown adapter kind"):
        register("widget", "fresh", "x.y:Z")
    register("loader", "fresh", "dcr.adapters.loaders.torch_module:TorchModuleLoader")
    assert "fresh" in available("loader")


@pytest.mark.parametrize(
    ("sections", "needle"),
    [
        ('[transport]\nkind = "memory"\n', "does not reach other processes"),
        ('[commit_store]\nkind = "memory"\n', "does not reach other processes"),
        ('[control]\nkind = "memory"\n', "does not reach other processes; use 'zmq'"),
        ('[transport]\nkind = "directory"\nfanout = 2\n', "[transport] has unknown keys"),
        ('[transport]\nkind = "relay"\nfanot = 2\n', "known: ['fanout', 'grant_timeout_s', 'hwm'"),
        ('[commit_store]\nkind = "sqlite"\nfile = "x"\n', "known: ['name', 'path', 'poll_s'"),
        ('[commit_store]\nkind = "s3"\nprefix = "p"\n', "[commit_store] needs a bucket"),
        ('[transport]\nkind = "s3"\nbuckett = "b"\n', "[transport] has unknown keys ['buckett']"),
        ('[control]\nkind = "zmq"\nping = 1\n', "[control] has unknown keys ['ping']"),
        ('[control]\nkind = "zmq"\ncurve = { nope = "k" }\n', "curve is gone"),
        ("[transport]\nkind = 3\n", "kind must be a registered name"),
    ],
)
def test_fleet_file_sections_are_checked_by_their_adapters(
    tmp_path: Path, sections: str, needle: str
) -> None:
    cfg = fleet(tmp_path, sections)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    cfg.ports_file.write_text('{"a": 41001, "b": 41002}')
    with pytest.raises(ConfigError) as info:
        store = make_store(cfg)
        try:
            make_control(cfg, store)
            make_transport(cfg)
        finally:
            anyio.run(store.close)
    assert needle in str(info.value)


def test_runtime_names_no_adapter_kind() -> None:
    """``dcr.fleet.runtime`` looks kinds up and lets the classes build themselves: no string
    outside docstrings names a registered adapter, and no kind is compared with anything."""
    source = Path(dcr.fleet.runtime.__file__).read_text()
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    names = {name for kind in GROUPS for name in available(kind)}
    names |= {"sqlite", "zmq", "relay", "directory", "s3", "memory"}
    literals = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and id(node) not in docstrings
    ]  # fmt: skip
    assert not [s for s in literals if s in names or s.lower() in names]
    compared = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and "kind" in ast.unparse(node)
    ]
    assert not compared
    assert "OBJECT_STORES" not in source
