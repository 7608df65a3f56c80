"""The catalog of a Hugging Face checkpoint directory, read from its safetensors headers.

A catalog maps every canonical tensor name to its shape and dtype (:class:`~dcr.tensors.records.
TensorSpec`); owners build payloads against it and receivers admit them against it, so both
sides must hold the same one.  :func:`read_catalog` reads it from the checkpoint a rollout
engine serves: the JSON header at the start of each ``*.safetensors`` file (an 8-byte
little-endian length, then that many bytes of JSON naming every tensor's dtype, shape and byte
range).  Only headers are read -- never tensor data, and nothing is unpickled -- so a catalog
of a checkpoint of any size costs a few small reads.

A sharded checkpoint's ``model.safetensors.index.json`` says which file holds each tensor;
every file it names must hold exactly those tensors.  Without an index, every
``*.safetensors`` file of the directory belongs to the checkpoint and no name may appear twice.
Every header is checked as strictly as the safetensors library checks it (known dtype, byte
range of ``numel * itemsize`` bytes, ranges tiling the data without gaps or overlaps, the data
present in the file), and a problem raises :class:`~dcr.errors.CheckpointError` naming the
file, the tensor and the check.

:func:`catalog_differences` and :func:`check_catalog` compare two catalogs (the training
side's with a checkpoint's, say) and say which tensors differ and how;
:func:`uncovered_parameters` checks a prewarmed receiver's model against its catalog.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dcr.errors import CheckpointError, ConfigError
from dcr.tensors.bits import dtype_name
from dcr.tensors.records import TensorSpec

if TYPE_CHECKING:
    from dcr.apply.applier import Applier

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "catalog_differences",
    "check_catalog",
    "read_catalog",
    "read_config",
    "read_header",
    "uncovered_parameters",
]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"

MAX_HEADER_BYTES = 100 * (1 << 20)
"""Longest safetensors header accepted (the safetensors library's own limit)."""

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
"""safetensors dtype codes of the dtypes dcr carries (the payload format's dtypes)."""

_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _is_uint(value: object) -> bool:
    return type(value) is int and value >= 0


def read_header(path: str | os.PathLike[str]) -> dict[str, TensorSpec]:
    """The tensors of one ``.safetensors`` file by name, in the order of their data.

    Reads the file's header only.  Raises :class:`~dcr.errors.CheckpointError` for a file
    that is missing (``missing``), shorter than its header says (``truncated``), whose header
    is not a valid safetensors header (``header``), or that holds a dtype dcr does not carry
    (``dtype``).
    """
    path = Path(path)

    def fail(message: str, check: str, tensor: str | None = None) -> CheckpointError:
        return CheckpointError(f"{path}: {message}", tensor=tensor, check=check)

    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise fail(f"{size} bytes, shorter than the 8-byte header length", "truncated")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise fail(
                    f"header length {length} exceeds {MAX_HEADER_BYTES} bytes "
                    "(not a safetensors file?)",
                    "header",
                )
            if 8 + length > size:
                raise fail(f"header of {length} bytes, but the file has {size}", "truncated")
            raw = f.read(length)
    except FileNotFoundError as exc:
        raise fail("no such file", "missing") from exc
    except IsADirectoryError as exc:
        raise fail("a directory, not a safetensors file", "missing") from exc
    except OSError as exc:
        raise fail(f"cannot be read: {exc}", "missing") from exc
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_object)
    except (UnicodeDecodeError, ValueError) as exc:
        raise fail(f"the header is not valid JSON: {exc}", "header") from exc
    if not isinstance(header, dict):
        raise fail("the header is not a JSON object", "header")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise fail("__metadata__ must map strings to strings", "header")
    data_bytes = size - 8 - length
    ranges: list[tuple[int, int, str]] = []
    specs: dict[str, TensorSpec] = {}
    for name, entry in header.items():
        if not name:
            raise fail("a tensor without a name", "header")
        if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
            raise fail(f"an entry needs exactly the keys {sorted(_ENTRY_KEYS)}", "header", name)
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise fail(f"shape {shape!r} is not a list of sizes", "header", name)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_uint(o) for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise fail(f"data_offsets {offsets!r} is not a byte range", "header", name)
        dtype = SAFETENSORS_DTYPES.get(code) if isinstance(code, str) else None
        if dtype is None:
            carried = ", ".join(SAFETENSORS_DTYPES)
            raise fail(f"dtype {code!r} is not one dcr carries ({carried})", "dtype", name)
        spec = TensorSpec(name=name, shape=tuple(shape), dtype=dtype)
        begin, end = offsets
        if end - begin != spec.nbytes:
            raise fail(
                f"byte range [{begin}, {end}) holds {end - begin} bytes, but "
                f"{dtype_name(dtype)} {list(shape)} needs {spec.nbytes}",
                "header",
                name,
            )
        ranges.append((begin, end, name))
        specs[name] = spec
    ranges.sort()
    position = 0
    for begin, end, name in ranges:
        if begin != position:
            what = "overlaps the previous tensor" if begin < position else "leaves a gap"
            raise fail(f"byte range [{begin}, {end}) {what}", "header", name)
        position = end
    if position > data_bytes:
        raise fail(
            f"the tensors need {position} bytes of data, the file holds {data_bytes}",
            "truncated",
            ranges[-1][2],
        )
    if position < data_bytes:
        raise fail(f"{data_bytes - position} bytes after the last tensor", "header")
    return {name: specs[name] for _, _, name in ranges}


def _read_index(directory: Path) -> dict[str, str]:
    """``weight_map`` of a sharded checkpoint's index: tensor name -> file name."""
    path = directory / INDEX_FILE
    try:
        index = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_unique_object)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc}", check="missing") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}", check="index") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{path}: no weight_map of tensor names to files", check="index")
    for name, file in weight_map.items():
        if (
            not name
            or not isinstance(file, str)
            or Path(file).name != file
            or not file.endswith(".safetensors")
        ):
            raise CheckpointError(
                f"{path}: {file!r} is not a .safetensors file of this directory",
                tensor=name,
                check="index",
            )
    return weight_map


def read_catalog(checkpoint: str | os.PathLike[str]) -> dict[str, TensorSpec]:
    """The catalog of the Hugging Face checkpoint directory ``checkpoint``.

    Names, shapes and dtypes come from the headers of its safetensors files: the files the
    index (``model.safetensors.index.json``) names when there is one, each holding exactly the
    tensors the index puts there; otherwise every ``*.safetensors`` file of the directory,
    no name in two of them.  The catalog lists files in name order and each file's tensors in
    the order of their data.  Raises :class:`~dcr.errors.CheckpointError` (see
    :func:`read_header`; ``index`` for an index that does not match the files).
    """
    directory = Path(checkpoint)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory", check="missing")
    catalog: dict[str, TensorSpec] = {}
    if (directory / INDEX_FILE).exists():
        weight_map = _read_index(directory)
        for shard in sorted(set(weight_map.values())):
            specs = read_header(directory / shard)
            listed = {n for n, f in weight_map.items() if f == shard}
            if set(specs) != listed:
                extra, missing = sorted(set(specs) - listed), sorted(listed - set(specs))
                raise CheckpointError(
                    f"{directory / shard}: holds tensors the index does not put there "
                    f"{extra[:3]} or lacks tensors it does {missing[:3]}",
                    tensor=(extra or missing)[0],
                    check="index",
                )
            catalog.update(specs)
        return catalog
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors file", check="missing")
    for file in files:
        for name, spec in read_header(file).items():
            if name in catalog:
                raise CheckpointError(
                    f"{file}: tensor also stored in another file of {directory} (a sharded "
                    f"checkpoint needs its {INDEX_FILE})",
                    tensor=name,
                    check="index",
                )
            catalog[name] = spec
    return catalog


def read_config(checkpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint directory as a dict (its ``model_type``, sizes)."""
    path = Path(checkpoint) / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: no such file", check="missing") from exc
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc}", check="missing") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}", check="config") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object", check="config")
    return config


def _describe(spec: TensorSpec) -> str:
    return f"{dtype_name(spec.dtype)} {list(spec.shape)}"


def catalog_differences(
    expected: Mapping[str, TensorSpec], found: Mapping[str, TensorSpec]
) -> list[str]:
    """Every difference between two catalogs, one line per tensor (names sorted): a tensor
    only in ``expected`` (``missing``), only in ``found`` (``unexpected``), or with another
    shape or dtype."""
    out = []
    for name in sorted(set(expected) | set(found)):
        a, b = expected.get(name), found.get(name)
        if b is None:
            out.append(f"{name}: missing")
        elif a is None:
            out.append(f"{name}: unexpected")
        elif (a.shape, a.dtype) != (b.shape, b.dtype):
            out.append(f"{name}: {_describe(b)} instead of {_describe(a)}")
    return out


def check_catalog(
    expected: Mapping[str, TensorSpec],
    found: Mapping[str, TensorSpec],
    *,
    expected_from: str,
    found_from: str,
) -> None:
    """Raise :class:`~dcr.errors.ConfigError` (``check="catalog"``) unless the catalogs are
    equal; the message names both sources, how many tensors differ and the first few."""
    differences = catalog_differences(expected, found)
    if differences:
        first = differences[0].split(":", 1)[0]
        shown = "; ".join(differences[:4]) + (" ..." if len(differences) > 4 else "")
        raise ConfigError(
            f"the catalog of {found_from} differs from the catalog of {expected_from} in "
            f"{len(differences)} tensors: {shown}",
            tensor=first,
            check="catalog",
        )


def uncovered_parameters(receiver: Applier) -> list[str]:
    """Parameters of a prewarmed receiver's model that its catalog does not fully write.

    Prewarm recorded, for every catalog name, the loader's writes into the model's storage.
    A parameter whose storage those writes do not fill (bytes written, each distinct write
    once, short of the storage's size) would keep stale bits through every refit: the model
    holds tensors the catalog lacks.  Returns their names (the first name of each storage).
    """
    written: dict[str, set[tuple[int, tuple[int, ...], tuple[int, ...], int]]] = {}
    for path in receiver.paths.values():
        for w in path.writes:
            d = w.dst
            written.setdefault(d.storage, set()).add((d.offset, d.shape, d.stride, d.itemsize))
    out = []
    seen: set[int] = set()
    for name, p in receiver.loader.module.named_parameters(remove_duplicate=False):
        storage = p.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen or storage.nbytes() == 0:
            continue
        seen.add(ptr)
        done = sum(math.prod(shape) * size for _, shape, _, size in written.get(name, ()))
        if done < storage.nbytes():
            out.append(name)
    return out
