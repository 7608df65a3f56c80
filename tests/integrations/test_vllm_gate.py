"""The parts of the vLLM integration that need no engine: weight-version labels, the join
message, and the gate's calls between worker and engine process over real ZeroMQ sockets
(refusals and damaged frames; the closing and reopening of a real engine run in
``tests/vllm/test_vllm_engine.py``).  Importing the integration does not import vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from dcr.errors import (
    ConfigError,
    DcrError,
    LoaderPathUnsupported,
    LocalProtocolError,
    RemoteProtocolError,
)
from dcr.integrations.vllm.gate import EngineGate, GateClient, GateServer, serving
from dcr.integrations.vllm.generation import Generation
from dcr.integrations.vllm.join import JoinSpec, error_from_wire, error_to_wire
from dcr.integrations.vllm.versions import WeightSpan, label_of, record_of
from dcr.protocol.types import CommitRecord

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # pyzmq's asyncio sockets


V1 = CommitRecord(version=1, candidate="g2.8589934592")
V2 = CommitRecord(version=2, candidate="g3.12884901889")


def test_importing_the_integration_imports_no_engine() -> None:
    code = (
        "import sys, dcr.integrations.vllm as v, dcr.integrations.vllm.engine, "
        "dcr.integrations.vllm.gate, dcr.integrations.vllm.versions\n"
        "v.generate, v.join_fleet, v.weight_spans\n"
        "print(sorted(m for m in ('vllm', 'aiohttp') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_labels_name_the_commit_record_and_parse_back() -> None:
    assert label_of(V1) == "dcr:1:g2.8589934592"
    assert record_of(label_of(V1)) == V1
    assert record_of("default") is None  # the engine's label before a receiver confirmed one


@pytest.mark.parametrize("label", ["dcr:", "dcr:1", "dcr:x:g1", "dcr:-1:g1", "dcr:1:"])
def test_a_malformed_label_is_refused(label: str) -> None:
    with pytest.raises(ConfigError) as info:
        record_of(label)
    assert info.value.check == "weight-version"


def test_a_generation_reports_its_versions_and_where_they_changed() -> None:
    spans = (WeightSpan(record=V1, start=0, end=9), WeightSpan(record=V2, start=9, end=48))
    out = Generation(
        request_id="a", token_ids=tuple(range(48)), logprobs=None, finish_reason="length",
        spans=spans,
    )  # fmt: skip
    assert out.record is None and out.switches == (9,)
    as_dict = out.as_dict()
    assert as_dict["weight_versions"] == [
        {"version": 1, "candidate": V1.candidate, "start": 0, "end": 9},
        {"version": 2, "candidate": V2.candidate, "start": 9, "end": 48},
    ]
    assert (as_dict["version"], as_dict["switches"]) == (None, [9])
    single = Generation(
        request_id="b", token_ids=(1, 2), logprobs=(-1.0, -2.0), finish_reason="length",
        spans=(WeightSpan(record=V2, start=0, end=2),),
    )  # fmt: skip
    assert single.record == V2 and single.switches == ()
    assert (single.as_dict()["version"], single.as_dict()["candidate"]) == (2, V2.candidate)


def test_the_join_message_crosses_as_plain_data() -> None:
    spec = JoinSpec(fleet="/f.toml", names=("r0", "r1"), gate="tcp://127.0.0.1:5", held=V1)
    wire = spec.to_wire()
    assert msgspec.json.decode(msgspec.json.encode(wire)) == wire  # plain data only
    assert JoinSpec.from_wire(wire) == spec
    assert JoinSpec.from_wire({**wire, "held": None}).held is None
    # Relay addresses known from elsewhere than the fleet file (Ray) cross as plain data.
    ray = JoinSpec(fleet="/f.toml", names=("r0",), gate="tcp://127.0.0.1:5",
                   relay_addresses={"node0": "tcp://10.0.0.3:7000"})  # fmt: skip
    assert JoinSpec.from_wire(json.loads(json.dumps(ray.to_wire()))) == ray
    assert JoinSpec.from_wire({**wire, "relay_addresses": None}).relay_addresses == {}


def test_worker_errors_come_back_as_their_own_class() -> None:
    exc = LoaderPathUnsupported("weights repacked", tensor="w", check="repacked")
    back = error_from_wire(error_to_wire(exc), worker=1)
    assert type(back) is LoaderPathUnsupported
    assert (back.tensor, back.check) == ("w", "repacked") and "worker 1" in str(back)
    odd = error_from_wire({"type": "KeyboardInterrupt", "message": "m"}, worker=0)
    assert type(odd) is DcrError


def test_a_gate_needs_ranks_and_a_known_pause_mode() -> None:
    with pytest.raises(ConfigError):
        EngineGate(engine=None, ranks=0)
    with pytest.raises(ConfigError):
        EngineGate(engine=None, ranks=1, pause_mode="sleep")  # type: ignore[arg-type]


@pytest.fixture
async def gate_server() -> AsyncIterator[GateServer]:
    # No call below reaches the engine: each is refused before the gate would touch it.
    async with serving(GateServer(EngineGate(engine=None, ranks=2))) as server:
        yield server


async def test_calls_the_gate_refuses_come_back_as_errors(gate_server: GateServer) -> None:
    client = GateClient(gate_server.address, rank=5, timeout_s=10)
    try:
        with pytest.raises(RemoteProtocolError, match="outside the engine's 2 ranks"):
            await client.call("close")
    finally:
        client.close()
    client = GateClient(gate_server.address, rank=1, timeout_s=10)
    try:
        with pytest.raises(RemoteProtocolError, match="names no record"):
            await client.call("open")  # reopening needs the record the rank holds
        await client.call("invalidate")  # a serving engine's caches hold committed weights
    finally:
        client.close()


async def test_damaged_frames_are_dropped_and_counted(gate_server: GateServer) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(gate_server.address)
    try:
        await sock.send(b"\x93not a call")
        await sock.send(msgspec.msgpack.encode({"call": 1, "rank": 0, "op": "explode"}))
        await sock.send_multipart([b"a", b"b"])
        await sock.send(b"x" * 5000)
        with anyio.fail_after(10):
            while gate_server.drops < 4:
                await anyio.sleep(0.01)
        assert not gate_server.gate.closed
    finally:
        sock.close(linger=0)
        ctx.term()


async def test_a_gate_that_does_not_answer_times_the_call_out() -> None:
    ctx = zmq.asyncio.Context()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    client = GateClient(f"tcp://127.0.0.1:{port}", rank=0, timeout_s=0.2)
    try:
        with pytest.raises(LocalProtocolError, match="did not answer") as info:
            await client.call("open", V1)
        assert info.value.check == "gate-timeout"
    finally:
        client.close()
        silent.close(linger=0)
        ctx.term()
