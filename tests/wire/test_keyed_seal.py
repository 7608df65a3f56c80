"""Keyed payload seals (docs/wire-format.md, "Keyed seal"): the keys a fleet secret gives, the
MAC in the digest field, and every refusal of the decoder -- a seal under another key, a
payload without a seal where one is required, a sealed payload without a key, a header field
rewritten after sealing, a replay relabelled for a later attempt -- each before anything of
the body is parsed."""

from __future__ import annotations

import struct
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch

from dcr.errors import ConfigError, PayloadRejected
from dcr.tensors.records import Encoding, Item
from dcr.wire.decode import decode_payload, read_header
from dcr.wire.encode import encode_bucket, encode_payload
from dcr.wire.format import FLAG_BLAKE3, FLAG_FINAL, FLAG_KEYED, PayloadHeader
from dcr.wire.seal import seal_keys

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))
KP = seal_keys(SECRET).payload
HEADER = PayloadHeader(attempt=7, owner=2, payload_id=3)

# docs/wire-format.md, "Keyed seal": the test vector an independent implementation checks.
DOC_KP = "2427b8669fc8a2788a8e492f2853475d4ef5a2744110c44e4809d175195f10cf"
DOC_KM = "c4f4c6bff330318fc4147ddd06cab5fbe58cfc9fd4cdb6c48fbc884e9a48cef6"
DOC_ABC = "f08f56cba4b32a9d371f6dd754bde33f"
DOC_KP_BYTES = bytes.fromhex(DOC_KP)

# docs/wire-format.md, "Fixed header": offsets of the fields a seal binds.
FIELDS = {"flags": (6, "<H"), "attempt": (8, "<Q"), "owner": (16, "<I"), "payload_id": (20, "<I")}


def items() -> list[Item]:
    return [
        Item(
            name="w",
            shape=(64,),
            dtype=torch.bfloat16,
            encoding=Encoding.OVERWRITE,
            indices=np.array([1, 5, 9, 40], dtype=np.int64),
            values=np.array([0x3F80, 0x4000, 0xBF80, 0x0001], dtype=np.uint16),
        )
    ]


def sealed(key: bytes = KP, header: PayloadHeader = HEADER) -> bytes:
    return encode_payload(header, items(), seal_key=key)


def rejected(
    data: bytes, seal_key: bytes | None = None, *, by_header: bool = True
) -> PayloadRejected:
    """The decoder's refusal of ``data``; ``by_header``: :func:`read_header` refuses it
    alike, without decompressing anything."""
    with pytest.raises(PayloadRejected) as err:
        decode_payload(data, seal_key=seal_key)
    if by_header:
        with pytest.raises(PayloadRejected) as header_err:
            read_header(data, seal_key=seal_key)
        assert header_err.value.check == err.value.check
    return err.value


def rewrite(data: bytes, field: str, value: int) -> bytes:
    offset, fmt = FIELDS[field]
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def reseal_unkeyed(data: bytes) -> bytes:
    """What a forger without the secret can do: clear the keyed bit and write a valid unkeyed
    BLAKE3 digest."""
    out = bytearray(data)
    (flags,) = struct.unpack_from("<H", out, 6)
    struct.pack_into("<H", out, 6, flags & ~FLAG_KEYED)
    out[56:72] = blake3.blake3(bytes(out[:56]) + bytes(out[72:])).digest()[:16]
    return bytes(out)


# -- keys ------------------------------------------------------------------------------------


def test_seal_keys_are_the_documented_derivation() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "wire-format.md").read_text()
    assert all(v in doc for v in (DOC_KP, DOC_KM, DOC_ABC, "dcr 2026 payload seal"))
    keys = seal_keys(SECRET)
    assert keys.payload.hex() == DOC_KP
    assert keys.manifest.hex() == DOC_KM
    assert (
        keys.payload == blake3.blake3(SECRET, derive_key_context="dcr 2026 payload seal").digest()
    )
    assert (
        keys.manifest == blake3.blake3(SECRET, derive_key_context="dcr 2026 manifest seal").digest()
    )
    assert blake3.blake3(b"abc", key=keys.payload).digest()[:16].hex() == DOC_ABC
    other = seal_keys(OTHER)
    assert len({keys.payload, keys.manifest, other.payload, other.manifest}) == 4
    assert SECRET.hex() not in repr(keys) and DOC_KP not in repr(keys)


@pytest.mark.parametrize("secret", [bytes(31), bytes(33), SECRET.hex(), None])
def test_a_fleet_secret_is_32_bytes(secret: object) -> None:
    with pytest.raises(ConfigError, match="32 bytes"):
        seal_keys(secret)  # type: ignore[arg-type]


def test_encoder_refuses_a_key_of_another_size_or_a_keyed_blake2b() -> None:
    with pytest.raises(ConfigError, match="payload key"):
        encode_payload(HEADER, items(), seal_key=SECRET[:16])
    with pytest.raises(ConfigError, match="blake3"):
        encode_payload(HEADER, items(), seal_key=KP, digest="blake2b")


# -- the seal on the wire --------------------------------------------------------------------


@pytest.mark.parametrize("final", [False, True])
def test_a_keyed_payload_carries_the_documented_mac_and_decodes_with_its_key(final: bool) -> None:
    header = PayloadHeader(attempt=7, owner=2, payload_id=3, final=final)
    data = sealed(header=header)
    (flags,) = struct.unpack_from("<H", data, 6)
    assert flags == FLAG_BLAKE3 | FLAG_KEYED | (FLAG_FINAL if final else 0)
    assert data[56:72] == blake3.blake3(data[:56] + data[72:], key=DOC_KP_BYTES).digest()[:16]
    payload = decode_payload(data, seal_key=KP)
    assert payload.header.key == (7, 2, 3) and payload.header.final is final
    (it,) = payload.items
    assert it.indices.tolist() == [1, 5, 9, 40]
    assert it.values.view(np.int16).tolist() == items()[0].values.view(np.int16).tolist()
    assert read_header(data, seal_key=KP).digest == data[56:72]


def test_encode_bucket_seals_with_its_key() -> None:
    data = encode_bucket(items=items(), attempt=7, owner=2, payload_id=3, final=True, seal_key=KP)
    assert data == sealed(header=PayloadHeader(attempt=7, owner=2, payload_id=3, final=True))


def test_a_payload_sealed_under_key_a_is_refused_under_key_b() -> None:
    data = sealed(KP)
    err = rejected(data, seal_key=seal_keys(OTHER).payload)
    assert (err.check, err.attempt) == ("digest", 7)
    # the manifest key of the same secret is no payload key either
    assert rejected(data, seal_key=seal_keys(SECRET).manifest).check == "digest"


@pytest.mark.parametrize("digest", ["blake3", "blake2b"])
def test_an_unkeyed_payload_is_refused_where_a_key_is_configured(digest: str) -> None:
    data = encode_payload(HEADER, items(), digest=digest)
    decode_payload(data)  # a valid digest: accepted without a key, as before
    assert rejected(data, seal_key=KP).check == "unsealed"


def test_a_forger_without_the_secret_cannot_make_an_accepted_payload() -> None:
    forged = reseal_unkeyed(sealed())
    decode_payload(forged)  # its unkeyed BLAKE3 digest is valid
    assert rejected(forged, seal_key=KP).check == "unsealed"
    # keeping the keyed bit, it can only guess a MAC: its unkeyed digest is not one
    out = bytearray(forged)
    struct.pack_into("<H", out, 6, FLAG_BLAKE3 | FLAG_KEYED)
    out[56:72] = blake3.blake3(bytes(out[:56]) + bytes(out[72:])).digest()[:16]
    assert rejected(bytes(out), seal_key=KP).check == "digest"


def test_a_keyed_payload_is_refused_without_a_key() -> None:
    err = rejected(sealed())
    assert (err.check, err.attempt) == ("seal-key", 7)
    assert "fleet secret" in str(err)


@pytest.mark.parametrize(
    ("field", "value"),
    [("attempt", 8), ("owner", 1), ("payload_id", 4), ("flags", FLAG_BLAKE3 | FLAG_KEYED | 1)],
)
def test_a_header_field_changed_after_sealing_is_refused(field: str, value: int) -> None:
    data = sealed()
    assert rejected(rewrite(data, field, value), seal_key=KP).check == "digest"
    # the same rewrite resealed without the secret is not sealed at all
    assert rejected(reseal_unkeyed(rewrite(data, field, value)), seal_key=KP).check == "unsealed"


def test_a_replay_into_the_next_attempt_is_refused_by_the_seal_or_names_its_own_attempt() -> None:
    """Attempt N's sealed payload relabelled for attempt N+1 fails its seal (the attempt is a
    sealed header field); replayed unchanged it still names attempt N, which the receiver
    compares with its delivery's key (tests/engine/test_sealed_refit.py: check ``schema``)."""
    n = HEADER.attempt
    data = sealed()
    assert rejected(rewrite(data, "attempt", n + 1), seal_key=KP).check == "digest"
    assert read_header(data, seal_key=KP).attempt == n


def test_the_seal_is_verified_before_anything_of_the_body_is_parsed() -> None:
    data = sealed()
    garbage = data[:72] + b"\xff" * (len(data) - 72)  # no zstd frame: 'decompress' if parsed
    assert rejected(garbage, seal_key=KP).check == "digest"
    assert rejected(reseal_unkeyed(garbage), seal_key=KP).check == "unsealed"
    assert rejected(garbage).check == "seal-key"
    # the same garbage with a valid seal gets to the body, which refuses it
    resealed = garbage[:56] + blake3.blake3(garbage[:56] + garbage[72:], key=KP).digest()[:16]
    assert rejected(resealed + garbage[72:], KP, by_header=False).check == "decompress"


@pytest.mark.parametrize("key", [KP, None])
def test_the_keyed_bit_without_the_blake3_bit_is_a_schema_error(key: bytes | None) -> None:
    data = bytearray(sealed())
    struct.pack_into("<H", data, 6, FLAG_KEYED)
    assert rejected(bytes(data), seal_key=key).check == "schema"


def test_an_unknown_flag_bit_is_still_refused_with_a_key() -> None:
    data = bytearray(sealed())
    struct.pack_into("<H", data, 6, FLAG_BLAKE3 | FLAG_KEYED | 0x0008)
    data[56:72] = blake3.blake3(bytes(data[:56]) + bytes(data[72:]), key=KP).digest()[:16]
    assert rejected(bytes(data), seal_key=KP).check == "schema"
