"""What an adapter needs to know to build itself from a section of a fleet file.

A fleet file names each adapter by ``kind`` and gives its options beside it::

    [transport]
    kind = "directory"        # a registered name, or "package.module:Class"
    path = "objects"          # options of that kind
    poll_s = 0.2

The process that reads the file looks the kind up in :mod:`dcr.adapters.registry` and calls
the class's ``from_config(options, context)`` with the section's other keys and an
:class:`AdapterContext`: where relative paths start, the run directory, which rollout node
this process serves, how to reach the relay nodes, the commit store.  The adapter turns them
into its own constructor's arguments (defaults, relative paths, per-node settings), so the
code that reads the fleet file never needs to know which kinds exist, and a kind that comes
from another distribution (an entry point of group ``dcr.transports``, ...) is built exactly
like a built-in one.  :func:`known_options` and :func:`dataclass_options` refuse unknown keys
with a message that names the section and the keys it knows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dcr.adapters.security import Identity, Security
from dcr.errors import ConfigError

T = TypeVar("T")

if TYPE_CHECKING:
    from dcr.adapters.commit.base import CommitStore

__all__ = ["AdapterContext", "construct", "dataclass_options", "known_options"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterContext:
    """The process around an adapter built from a fleet file.

    Built once per adapter by the process that reads the fleet file
    (:func:`dcr.fleet.runtime.make_transport`, ``make_store``, ``make_control``); adapters
    read the fields they need and ignore the rest.
    """

    section: str
    """The fleet file section the options come from (``transport``, ``commit_store``,
    ``control``), for error messages: ``[transport] has unknown keys ...``."""
    base_dir: Path
    """The fleet file's directory: relative paths of the options start here."""
    run_dir: Path
    """The fleet's run directory (SQLite record, logs, events; default place of local
    state such as a directory transport's objects)."""
    host: str = "127.0.0.1"
    """The address this fleet's processes bind and connect on."""
    fleet: str = "fleet"
    """The fleet's name."""
    node: str | None = None
    """The rollout node hosting this process's receivers; ``None`` in a process that hosts
    none (owners, the coordinator, the launcher)."""
    node_receivers: int = 0
    """How many receivers ``node`` hosts (several: their processes may share downloads)."""
    nodes: tuple[str, ...] = ()
    """Every rollout node of the fleet, in file order; the first is the root of a relay
    tree."""
    address: Callable[[str], str] | None = None
    """Resolves a rollout node's name to its relay address (``tcp://host:port``); it reads
    the ports the launcher chose, so it raises :class:`~dcr.errors.ConfigError` in a fleet
    that has not been started."""
    store: CommitStore | None = None
    """The process's commit store (for control channels that find the coordinator through
    the commit record); ``None`` while the commit store itself is being built."""
    security: Security = field(default_factory=lambda: Security())
    """The fleet's key material (``[fleet] keys``, ``insecure``): CURVE on every socket and
    the fleet secret that seals payloads; without keys, loopback only."""
    identity: Identity | None = None
    """Who this process is on the fleet's sockets (``receiver:r0``, ``owner:o0``,
    ``relay:node0``, ``coordinator:main``); ``None`` in a process that opens no socket
    (the launcher)."""

    def path(self, value: object) -> Path:
        """``value`` (an option) as a path: relative ones start at :attr:`base_dir`."""
        if not isinstance(value, str | Path) or not str(value):
            raise ConfigError(f"[{self.section}]: a path must be a non-empty string, got {value!r}")
        return self.base_dir / value

    def node_address(self, node: str) -> str:
        """The relay address of rollout node ``node``."""
        if self.address is None:
            raise ConfigError(f"[{self.section}]: this process knows no relay node addresses")
        return self.address(node)

    @property
    def root(self) -> str:
        """The first rollout node: the root of a relay tree, where owners send."""
        if not self.nodes:
            raise ConfigError(f"[{self.section}]: the fleet names no rollout node")
        return self.nodes[0]


def known_options(options: Mapping[str, Any], known: Iterable[str], where: str) -> dict[str, Any]:
    """``options`` as a dict, or :class:`ConfigError` naming the unknown keys and the known
    ones of section ``where``."""
    allowed = set(known)
    unknown = set(options) - allowed
    if unknown:
        raise ConfigError(f"[{where}] has unknown keys {sorted(unknown)}; known: {sorted(allowed)}")
    return dict(options)


def dataclass_options(cls: type, options: Mapping[str, Any], where: str) -> Any:
    """An instance of the dataclass ``cls`` from the options of section ``where``: unknown
    keys and values its checks refuse raise :class:`ConfigError`."""
    raw = known_options(options, (f.name for f in fields(cls)), where)
    try:
        return cls(**raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[{where}]: {exc}") from exc


def construct(
    cls: Callable[..., T], options: Mapping[str, Any], where: str, *, required: Iterable[str] = ()
) -> T:
    """``cls(**options)`` for section ``where``: a missing required key, or a value the
    constructor refuses, raises :class:`ConfigError` naming the section."""
    missing = [k for k in required if k not in options]
    if missing:
        raise ConfigError(f"[{where}] needs a {' and a '.join(missing)}")
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[{where}]: {exc}") from exc
