"""The control-message codec: every message type round-trips, and damaged frames are either
well-typed canonical messages or a :class:`ControlMessageRejected` -- never anything else."""

from __future__ import annotations

import dataclasses
import random
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr.adapters.control.codec import FORMAT_VERSION, MAX_BYTES, ControlCodec, tag_of
from dcr.errors import ConfigError, ControlMessageRejected, LocalProtocolError
from dcr.protocol import messages as msg
from dcr.protocol.types import CommitRecord
from dcr.testing.control import EXAMPLES, message_strategy

CODEC = ControlCodec()
FUZZ_MINIMUM = 10_000


def _frame(version: Any, tag: Any, epoch: Any, sender: Any, body: Any) -> bytes:
    """A frame built by hand (``body`` as builtins or as raw MessagePack)."""
    return msgspec.msgpack.encode([version, tag, epoch, sender, body])


def _body(message: object) -> dict[str, Any]:
    """The body of ``message`` as builtins (frozensets as sorted lists, as the codec sends)."""
    out: dict[str, Any] = msgspec.msgpack.decode(msgspec.msgpack.encode(message, order="sorted"))
    return out


# -- round trips ---------------------------------------------------------------------------------


def test_examples_cover_every_message_type() -> None:
    assert [type(m) for m in EXAMPLES] == list(msg.MESSAGES)
    assert CODEC.types == msg.MESSAGES
    assert [tag_of(cls) for cls in msg.MESSAGES] == [cls.__name__ for cls in msg.MESSAGES]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: object) -> None:
    data = CODEC.encode(message, epoch=7, sender="rx-0")
    envelope = CODEC.decode(data)
    assert envelope.message == message and type(envelope.message) is type(message)
    assert (envelope.epoch, envelope.sender) == (7, "rx-0")
    assert CODEC.encode(envelope.message, epoch=7, sender="rx-0") == data
    assert msgspec.msgpack.decode(data)[:4] == [FORMAT_VERSION, type(message).__name__, 7, "rx-0"]


@settings(max_examples=400, deadline=None)
@given(
    message=st.sampled_from(msg.MESSAGES).flatmap(message_strategy),
    epoch=st.integers(min_value=0, max_value=(1 << 64) - 1),
    sender=st.text(max_size=8),
)
def test_random_messages_round_trip(message: object, epoch: int, sender: str) -> None:
    data = CODEC.encode(message, epoch=epoch, sender=sender)
    envelope = CODEC.decode(data)
    assert envelope.message == message and type(envelope.message) is type(message)
    assert (envelope.epoch, envelope.sender) == (epoch, sender)
    assert CODEC.encode(envelope.message, epoch=epoch, sender=sender) == data


def _colliding_names() -> tuple[str, str]:
    """Two names whose frozenset's iteration order depends on insertion order, as the order of
    one set differs between processes with different hash seeds."""
    first = "rx-0"
    for i in range(1, 10_000):
        name = f"rx-{i}"
        if list(frozenset([first, name])) != list(frozenset([name, first])):
            return first, name
    raise AssertionError("no colliding name found")


def test_frozensets_encode_independently_of_iteration_order() -> None:
    a, b = _colliding_names()
    one, two = frozenset([a, b]), frozenset([b, a])
    assert list(one) != list(two)
    record = CommitRecord(version=1, candidate="g1")
    frames = {
        CODEC.encode(
            msg.DenseRefit(job=1, record=record, owners=(), receivers=s), epoch=1, sender="c"
        )
        for s in (one, two)
    }
    assert len(frames) == 1


def test_set_members_out_of_order_or_repeated_are_rejected() -> None:
    record = _body(CommitRecord(version=1, candidate="g1"))
    for receivers in (["b", "a"], ["a", "a"]):
        body = {"job": 1, "record": record, "owners": [], "receivers": receivers}
        with pytest.raises(ControlMessageRejected) as info:
            CODEC.decode(_frame(FORMAT_VERSION, "DenseRefit", 1, "c", body))
        assert info.value.check == "schema"


# -- codec configuration and encoding errors -----------------------------------------------------


def test_codec_configuration_is_checked() -> None:
    with pytest.raises(ConfigError):
        ControlCodec((msg.Prepare, msg.Prepare))
    with pytest.raises(ConfigError):
        ControlCodec((int,))
    with pytest.raises(ConfigError):
        ControlCodec(max_bytes=8)


def test_unencodable_messages_raise_local_errors() -> None:
    huge = msg.AttemptFailed(attempt=1, endpoint="e", check="c", message="x" * MAX_BYTES)
    cases: list[tuple[object, int, str]] = [
        (CommitRecord(version=1, candidate="g"), 1, "type"),
        (msg.StartStreaming(attempt=1 << 64), 1, "encode"),
        (msg.StartStreaming(attempt=1), -1, "encode"),
        (huge, 1, "oversized"),
        (msg.StartStreaming(attempt="1"), 1, "encode"),  # type: ignore[arg-type]
        (msg.Flush(attempt=1, expected=(("o", 1.5),)), 1, "encode"),  # type: ignore[arg-type]
        (msg.DenseRefit(job=1, record=None, owners=(), receivers=frozenset()), 1, "encode"),  # type: ignore[arg-type]
        (msg.Cleanup(attempt=1), True, "encode"),
    ]
    for message, epoch, check in cases:
        with pytest.raises(LocalProtocolError) as info:
            CODEC.encode(message, epoch=epoch, sender="s")
        assert info.value.check == check


# -- hostile input ---------------------------------------------------------------------------------


def test_huge_declared_lengths_are_rejected_fast_without_allocating() -> None:
    """A few bytes that declare 2**32-1 elements fail on the declared length, not on memory."""
    head = b"\x95\x01\xacCheckArrival\x01\xa1c"
    tiny = [
        b"\xdd\xff\xff\xff\xff",
        b"\xdf\xff\xff\xff\xff",
        b"\x95\x01\xdb\xff\xff\xff\xff",
        head + b"\x82\xa7attempt\x01\xa8expected\xdd\xff\xff\xff\xff",
        head + b"\x82\xa7attempt\x01\xa8expected\x91\xdd\xff\xff\xff\xff",
        head + b"\xdf\xff\xff\xff\xff",
        head + b"\xc6\xff\xff\xff\xff",
    ]
    tracemalloc.start()
    try:
        start = time.perf_counter()
        for data in tiny:
            with pytest.raises(ControlMessageRejected) as info:
                CODEC.decode(data)
            assert info.value.check in ("truncated", "malformed"), data
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 0.1
    assert peak < 1 << 20


def test_decoding_cost_is_bounded_by_the_input() -> None:
    rng = random.Random(3)
    garbage = [rng.randbytes(MAX_BYTES), b"\x91" * MAX_BYTES, b"\x95" + b"\x91" * (MAX_BYTES - 1)]
    start = time.perf_counter()
    for data in garbage:
        with pytest.raises(ControlMessageRejected):
            CODEC.decode(data)
    assert time.perf_counter() - start < 1.0


def _encoded_examples() -> list[bytes]:
    return [
        CODEC.encode(m, epoch=e, sender=s)
        for m in EXAMPLES
        for e, s in ((3, "rx-0"), ((1 << 40) + 5, "owner-1"))
    ]


_WRONG_VALUES: tuple[Any, ...] = (
    None, True, -1, 1 << 63, 1.5, "x", b"x", [], {}, [["owner-0", "3"]], [["owner-0", 3, 4]],
)  # fmt: skip


def _with_nested(body: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """Every field path of ``body``, top level and one level down (nested records)."""
    for key, value in body.items():
        yield body, key
        if isinstance(value, dict):
            for inner in value:
                yield value, inner


def _structured_mutants(frames: list[bytes]) -> Iterator[tuple[str, bytes]]:
    tags = [cls.__name__ for cls in msg.MESSAGES]
    for message in EXAMPLES:
        tag = type(message).__name__
        body = _body(message)
        for holder, key in list(_with_nested(body)):
            original = holder[key]
            for value in _WRONG_VALUES:
                holder[key] = value
                yield "wrong-type", _frame(FORMAT_VERSION, tag, 1, "s", body)
            del holder[key]
            yield "missing-field", _frame(FORMAT_VERSION, tag, 1, "s", body)
            holder[key] = original
            for extra in ("zz", "attempt_", "_"):
                holder[extra + key] = original
                yield "extra-field", _frame(FORMAT_VERSION, tag, 1, "s", body)
                del holder[extra + key]
        if body:
            first = next(iter(body))
            items = [*body.items(), (first, body[first])]  # a repeated key
            raw = bytes([0x80 | len(items)]) + b"".join(
                msgspec.msgpack.encode(k) + msgspec.msgpack.encode(v) for k, v in items
            )
            yield "extra-field", _frame(FORMAT_VERSION, tag, 1, "s", msgspec.Raw(raw))
        for other in tags:
            if other != tag:
                yield "swapped-tag", _frame(FORMAT_VERSION, other, 1, "s", body)
        for unknown in ("", "prepare", "Prepare ", "Hello", "Message", "x" * 300):
            yield "unknown-tag", _frame(FORMAT_VERSION, unknown, 1, "s", body)
        for version in (0, 2, 255, 1 << 32, -1, "1", 1.0, None, True, [1]):
            yield "version", _frame(version, tag, 1, "s", body)
        for epoch, sender in ((-1, "s"), (1.0, "s"), ("1", "s"), (1, 1), (1, b"s"), (1, None)):
            yield "envelope", _frame(FORMAT_VERSION, tag, epoch, sender, body)
        yield "envelope", msgspec.msgpack.encode([FORMAT_VERSION, tag, 1, "s", body, 0])
        yield "envelope", msgspec.msgpack.encode([FORMAT_VERSION, tag, 1, "s"])
        yield "envelope", msgspec.msgpack.encode({"v": FORMAT_VERSION, "tag": tag})
    for data in frames[:6]:
        yield "oversized", data + b"\x00" * (MAX_BYTES + 1 - len(data))
    yield "oversized", _frame(FORMAT_VERSION, "Cleanup", 1, "x" * MAX_BYTES, {"attempt": 1})


def _byte_mutants(frames: list[bytes], rng: random.Random) -> Iterator[tuple[str, bytes]]:
    for data in frames:
        for i in range(len(data)):
            yield "truncated", data[:i]
        for i in range(len(data)):
            flipped = bytearray(data)
            flipped[i] ^= rng.randrange(1, 256)
            yield "flip", bytes(flipped)
    for _ in range(2500):
        data = rng.choice(frames)
        at = rng.randrange(len(data) + 1)
        yield "insert", data[:at] + rng.randbytes(rng.randint(1, 3)) + data[at:]
        at = rng.randrange(len(data))
        yield "delete", data[:at] + data[at + rng.randint(1, 3) :]
    for _ in range(2000):
        yield "garbage", rng.randbytes(rng.randint(0, 96))
    for depth in (10, 100, 1000, 100_000):
        yield "garbage", b"\x95\x01\xa7Cleanup\x01\xa1s" + b"\x91" * depth + b"\xc0"
        yield "garbage", b"\x81\xa1a" * depth + b"\xc0"


def test_fuzz_damaged_frames_are_rejected_or_canonical() -> None:
    """At least 10,000 damaged frames: truncations at every offset, byte flips at every
    offset, random insertions and deletions, swapped and unknown tags and versions, fields of
    the wrong type, missing and extra fields, broken envelopes, oversized frames and garbage."""
    rng = random.Random(20260101)
    frames = _encoded_examples()
    counts: Counter[tuple[str, str]] = Counter()
    start = time.perf_counter()
    mutants = [*_structured_mutants(frames), *_byte_mutants(frames, rng)]
    for kind, data in mutants:
        try:
            envelope = CODEC.decode(data)
        except ControlMessageRejected as exc:
            assert exc.check in {"oversized", "truncated", "malformed", "version", "type", "schema"}
            counts[kind, exc.check] += 1
            continue
        assert type(envelope.message) in msg.MESSAGES
        assert dataclasses.is_dataclass(envelope.message)
        again = CODEC.encode(envelope.message, epoch=envelope.epoch, sender=envelope.sender)
        assert again == data, (kind, data)
        counts[kind, "accepted"] += 1
    elapsed = time.perf_counter() - start

    kinds = sorted({k for k, _ in counts})
    checks = sorted({c for _, c in counts})
    print(f"\ncontrol codec fuzz: {len(mutants)} damaged frames in {elapsed:.2f} s")
    print(f"{'':>14}" + "".join(f"{c:>11}" for c in checks))
    for kind in kinds:
        print(f"{kind:>14}" + "".join(f"{counts[kind, c]:>11}" for c in checks))

    assert sum(counts.values()) == len(mutants) >= FUZZ_MINIMUM
    assert {c for k, c in counts if k == "truncated"} == {"truncated"}
    assert {c for k, c in counts if k == "oversized"} == {"oversized"}
    assert {c for k, c in counts if k == "version"} == {"version"}
    assert {c for k, c in counts if k == "unknown-tag"} == {"type"}
    assert {c for k, c in counts if k in ("missing-field", "extra-field")} == {"schema"}
    assert counts["flip", "accepted"] < counts["flip", "schema"]


# -- optional fields added after the first format version (xor_refused) ------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _PrepareBefore:
    """``Prepare`` as senders that predate ``xor_refused`` declare it."""

    info: Any
    proof: Any = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _StatusBefore:
    """``EndpointStatus`` as senders that predate ``xor_refused`` declare it."""

    endpoint: str
    role: str
    incarnation: str
    record: Any
    candidate: bool = False


_OLD = msgspec.msgpack.Encoder(order="deterministic")


def _old_frame(tag: str, body: object) -> bytes:
    """A frame as a sender that predates the field writes it."""
    return _OLD.encode((FORMAT_VERSION, tag, 4, "c", body))


def _refused_examples() -> list[object]:
    prepare = next(m for m in EXAMPLES if isinstance(m, msg.Prepare))
    status = next(m for m in EXAMPLES if isinstance(m, msg.EndpointStatus))
    return [prepare, status]


@pytest.mark.parametrize("refused", [None, frozenset(), frozenset({"b.weight", "a.weight", "é"})])
@pytest.mark.parametrize("kind", [msg.Prepare, msg.EndpointStatus])
def test_xor_refused_round_trips_with_and_without_the_field(
    kind: type, refused: frozenset[str] | None
) -> None:
    [example] = [m for m in _refused_examples() if type(m) is kind]
    message = dataclasses.replace(example, xor_refused=refused)
    data = CODEC.encode(message, epoch=4, sender="c")
    assert CODEC.decode(data).message == message
    body = msgspec.msgpack.decode(data)[4]
    assert ("xor_refused" in body) is (refused is not None)
    if refused is not None:
        assert body["xor_refused"] == sorted(refused)


def test_frames_of_senders_that_predate_xor_refused_decode_unchanged() -> None:
    prepare, status = _refused_examples()
    assert isinstance(prepare, msg.Prepare) and isinstance(status, msg.EndpointStatus)
    cases = [
        ("Prepare", _PrepareBefore(info=prepare.info, proof=prepare.proof),
         dataclasses.replace(prepare, xor_refused=None)),
        ("EndpointStatus",
         _StatusBefore(endpoint=status.endpoint, role=status.role,
                       incarnation=status.incarnation, record=status.record, candidate=True),
         dataclasses.replace(status, candidate=True, xor_refused=None)),
    ]  # fmt: skip
    for tag, before, now in cases:
        old = _old_frame(tag, before)
        assert CODEC.decode(old).message == now
        # A message without the field is sent exactly as before the field existed.
        assert CODEC.encode(now, epoch=4, sender="c") == old


def test_malformed_or_non_canonical_xor_refused_is_rejected() -> None:
    prepare, _ = _refused_examples()
    body = _body(dataclasses.replace(prepare, xor_refused=frozenset({"a", "b"})))
    # _body sorts nested keys; rebuild the body in declaration order, as the codec sends it.
    info = msgspec.msgpack.decode(_OLD.encode(prepare.info))
    proof = msgspec.msgpack.decode(_OLD.encode(prepare.proof))
    assert set(body) == {"info", "proof", "xor_refused"}
    for value in (None, ["b", "a"], ["a", "a"], ["a", 1], "a", [["a"]], {"a": 1}, 5):
        frame = _frame(FORMAT_VERSION, "Prepare", 4, "c",
                       {"info": info, "proof": proof, "xor_refused": value})  # fmt: skip
        with pytest.raises(ControlMessageRejected) as exc:
            CODEC.decode(frame)
        assert exc.value.check == "schema", value
    good = _frame(FORMAT_VERSION, "Prepare", 4, "c",
                  {"info": info, "proof": proof, "xor_refused": ["a", "b"]})  # fmt: skip
    assert CODEC.decode(good).message == dataclasses.replace(prepare, xor_refused=frozenset("ab"))


def test_an_xor_refused_over_its_bound_is_rejected_on_both_sides() -> None:
    prepare, status = _refused_examples()
    width = 100
    count = msg.XOR_REFUSED_MAX_BYTES // (width + 1)
    fits = frozenset(f"{i:0{width}d}" for i in range(count))
    over = fits | {"x" * width}
    assert msg.refused_size(fits) <= msg.XOR_REFUSED_MAX_BYTES < msg.refused_size(over)
    for example in (prepare, status):
        at_bound = dataclasses.replace(example, xor_refused=fits)
        data = CODEC.encode(at_bound, epoch=4, sender="c")
        assert CODEC.decode(data).message == at_bound
        with pytest.raises(LocalProtocolError) as local:
            CODEC.encode(dataclasses.replace(example, xor_refused=over), epoch=4, sender="c")
        assert local.value.check == "encode"
        # A frame that carries it anyway (built by hand) is refused by the receiving codec.
        body = msgspec.msgpack.decode(data)[4]
        body["xor_refused"] = sorted(over)
        with pytest.raises(ControlMessageRejected) as remote:
            CODEC.decode(_frame(FORMAT_VERSION, type(example).__name__, 4, "c", body))
        assert remote.value.check == "schema"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Carrier:
    """A message that carries a status, as the ZeroMQ channel's ``Hello`` does."""

    name: str
    status: msg.EndpointStatus | None
    statuses: tuple[msg.EndpointStatus, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _CarrierBefore:
    name: str
    status: _StatusBefore | None
    statuses: tuple[_StatusBefore, ...] = ()


def test_a_status_nested_in_another_message_follows_the_same_rules() -> None:
    codec = ControlCodec((_Carrier,))
    _, status = _refused_examples()
    assert isinstance(status, msg.EndpointStatus)
    plain = dataclasses.replace(status, xor_refused=None)
    before = _StatusBefore(endpoint=status.endpoint, role=status.role,
                           incarnation=status.incarnation, record=status.record)  # fmt: skip
    old = _OLD.encode(
        (FORMAT_VERSION, "_Carrier", 4, "c",
         _CarrierBefore(name="e", status=before, statuses=(before, before)))
    )  # fmt: skip
    now = _Carrier(name="e", status=plain, statuses=(plain, plain))
    assert codec.decode(old).message == now
    assert codec.encode(now, epoch=4, sender="c") == old
    for message in (
        _Carrier(name="e", status=status, statuses=(plain, status)),
        _Carrier(name="e", status=None),
    ):
        assert codec.decode(codec.encode(message, epoch=4, sender="c")).message == message
    over = frozenset(f"{i:0100d}" for i in range(msg.XOR_REFUSED_MAX_BYTES // 100))
    with pytest.raises(LocalProtocolError):
        codec.encode(
            _Carrier(name="e", status=None,
                     statuses=(dataclasses.replace(status, xor_refused=over),)),
            epoch=4, sender="c",
        )  # fmt: skip
    # The ZeroMQ channel's Hello carries the endpoint's last status.
    zmq = pytest.importorskip("dcr.adapters.control.zmq")
    hello_codec = ControlCodec((*msg.MESSAGES, *zmq.LINK_MESSAGES))
    for example in (plain, status):
        hello = zmq.Hello(status=example)
        data = hello_codec.encode(hello, epoch=4, sender="c")
        assert hello_codec.decode(data).message == hello
        assert ("xor_refused" in msgspec.msgpack.decode(data)[4]["status"]) is (
            example.xor_refused is not None
        )
