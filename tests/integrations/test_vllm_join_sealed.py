"""The fleet secret as a vLLM receiver option: ``join_fleet(fleet_secret=...)`` carries it to
the engine's workers in their ``JoinSpec`` (plain data across ``collective_rpc``), never in a
repr, and refuses a secret of another size before any worker is asked."""

from __future__ import annotations

import anyio
import pytest

from dcr.errors import ConfigError
from dcr.integrations.vllm.engine import join_fleet
from dcr.integrations.vllm.join import JoinSpec

SECRET = bytes(range(32))


def test_the_fleet_secret_crosses_to_the_workers_as_plain_data() -> None:
    spec = JoinSpec(fleet="/f.toml", names=("r0",), gate="tcp://127.0.0.1:5", fleet_secret=SECRET)
    wire = spec.to_wire()
    assert wire["fleet_secret"] == SECRET.hex()
    assert JoinSpec.from_wire(wire) == spec
    assert SECRET.hex() not in repr(spec)
    unsealed = JoinSpec(fleet="/f.toml", names=("r0",), gate="tcp://127.0.0.1:5")
    assert JoinSpec.from_wire(unsealed.to_wire()).fleet_secret is None
    # a spec of an engine process that predates the option joins unsealed
    old = {k: v for k, v in unsealed.to_wire().items() if k != "fleet_secret"}
    assert JoinSpec.from_wire(old) == unsealed


def test_join_fleet_refuses_a_secret_of_another_size_before_asking_any_worker() -> None:
    class NoEngine:
        """Anything the join touched would fail on it."""

    async def join() -> None:
        async with join_fleet(NoEngine(), "/nowhere/fleet.toml", ["r0"], fleet_secret=b"short"):
            pass

    with pytest.raises(ConfigError, match="32 bytes"):
        anyio.run(join)
