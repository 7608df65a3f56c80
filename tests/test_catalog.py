"""The catalog of a checkpoint directory, read from the safetensors headers of checkpoints
written here by the safetensors library (sharded and not, in every dtype a model ships in),
and every way a checkpoint can be unreadable: a typed error naming the file, the tensor and
the check, never a partial catalog."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from dcr.adapters.loaders.sharded import ShardedServingLoader, ShardedServingModel
from dcr.apply.applier import Applier
from dcr.catalog import (
    INDEX_FILE,
    MAX_HEADER_BYTES,
    catalog_differences,
    check_catalog,
    read_catalog,
    read_config,
    read_header,
    uncovered_parameters,
)
from dcr.errors import CheckpointError, ConfigError
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.hf import WEIGHTS_FILE, write_checkpoint
from dcr.tensors.records import TensorSpec

FAMILY = "qwen3_moe"


def _state(dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config = tiny_config(FAMILY)
    sd = {n: t.to(dtype) for n, t in random_state_dict(config, FAMILY, seed=3).items()}
    return config, sd


def _specs(sd: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {n: TensorSpec.of(n, t) for n, t in sd.items()}


def _raw_file(path: Path, header: dict[str, Any], data: bytes) -> Path:
    """A safetensors file written byte by byte (for headers the library would not write)."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shard_bytes", [None, 40_000], ids=["one-file", "sharded"])
def test_the_catalog_is_every_tensor_s_name_shape_and_dtype(
    tmp_path: Path, dtype: torch.dtype, shard_bytes: int | None
) -> None:
    config, sd = _state(dtype)
    checkpoint = write_checkpoint(tmp_path / "ckpt", config, FAMILY, sd, shard_bytes=shard_bytes)
    files = sorted(p.name for p in checkpoint.glob("*.safetensors"))
    if shard_bytes is None:
        assert files == [WEIGHTS_FILE] and not (checkpoint / INDEX_FILE).exists()
    else:
        assert len(files) > 3 and (checkpoint / INDEX_FILE).exists()
    catalog = read_catalog(checkpoint)
    assert catalog == _specs(sd)
    # Files in name order, each one's tensors in the order of their data.
    order = []
    for f in files:
        data = (checkpoint / f).read_bytes()
        header = json.loads(data[8 : 8 + _header_length(checkpoint / f)])
        header.pop("__metadata__", None)
        order += sorted(header, key=lambda n: header[n]["data_offsets"])
    assert list(catalog) == order
    assert read_config(checkpoint)["model_type"] == FAMILY


def test_only_headers_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a catalog reads each file's 8-byte length and its header, no tensor data."""
    config, sd = _state(torch.bfloat16)
    checkpoint = write_checkpoint(tmp_path / "ckpt", config, FAMILY, sd, shard_bytes=40_000)
    read: dict[str, int] = {}
    real_open = Path.open

    def counting_open(self: Path, *args: Any, **kwargs: Any) -> Any:
        f = real_open(self, *args, **kwargs)
        if self.suffix != ".safetensors":
            return f
        real_read = f.read

        def counted(n: int = -1) -> bytes:
            data: bytes = real_read(n)
            read[self.name] = read.get(self.name, 0) + len(data)
            return data

        f.read = counted
        return f

    monkeypatch.setattr(Path, "open", counting_open)
    read_catalog(checkpoint)
    monkeypatch.undo()
    for path in checkpoint.glob("*.safetensors"):
        header = struct.unpack("<Q", path.read_bytes()[:8])[0]
        assert read[path.name] == 8 + header < path.stat().st_size


def test_a_dtype_dcr_does_not_carry_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "ckpt").mkdir()
    save_file(
        {
            "a.weight": torch.zeros(4, dtype=torch.bfloat16),
            "b.index": torch.zeros(3, dtype=torch.uint16),
        },
        str(tmp_path / "ckpt" / WEIGHTS_FILE),
    )
    with pytest.raises(CheckpointError, match="dtype 'U16' is not one dcr carries") as info:
        read_catalog(tmp_path / "ckpt")
    assert (info.value.check, info.value.tensor) == ("dtype", "b.index")
    assert isinstance(info.value, ConfigError)


def _checkpoint(tmp_path: Path) -> Path:
    config, sd = _state(torch.bfloat16)
    return write_checkpoint(tmp_path / "ckpt", config, FAMILY, sd)


def _header_length(path: Path) -> int:
    return int(struct.unpack("<Q", path.read_bytes()[:8])[0])


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path) / WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes(data[:-2])  # the last tensor's data cut short
    with pytest.raises(CheckpointError, match="the file holds") as info:
        read_catalog(path.parent)
    assert info.value.check == "truncated" and info.value.tensor is not None
    path.write_bytes(data[: 8 + _header_length(path) // 2])  # inside the header
    with pytest.raises(CheckpointError, match=r"header of \d+ bytes, but the file has") as info:
        read_catalog(path.parent)
    assert info.value.check == "truncated"
    path.write_bytes(data[:5])  # not even the header length
    with pytest.raises(CheckpointError, match="shorter than the 8-byte header length") as info:
        read_catalog(path.parent)
    assert info.value.check == "truncated"


def test_a_corrupted_header_is_refused(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path) / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    length = _header_length(path)
    damaged = bytearray(data)
    damaged[8 + length // 2 : 8 + length // 2 + 4] = b"\xff}\x00{"
    path.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match="not valid JSON") as info:
        read_catalog(path.parent)
    assert info.value.check == "header"
    # A length beyond any header: not a safetensors file at all.
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + bytes(data[8:]))
    with pytest.raises(CheckpointError, match="exceeds") as info:
        read_catalog(path.parent)
    assert info.value.check == "header"


HEADERS = {
    "byte-count": (
        {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}},
        8,
        "holds 8 bytes, but float32 \\[2, 2\\] needs 16",
    ),
    "overlap": (
        {
            "w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]},
            "v": {"dtype": "BF16", "shape": [4], "data_offsets": [6, 14]},
        },
        14,
        "overlaps the previous tensor",
    ),
    "gap": (
        {"w": {"dtype": "BF16", "shape": [4], "data_offsets": [2, 10]}},
        10,
        "leaves a gap",
    ),
    "trailing": (
        {"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}},
        12,
        "4 bytes after the last tensor",
    ),
    "keys": (
        {"w": {"dtype": "BF16", "shape": [4], "offsets": [0, 8]}},
        8,
        "needs exactly the keys",
    ),
    "shape": (
        {"w": {"dtype": "BF16", "shape": [4, -1], "data_offsets": [0, 8]}},
        8,
        "is not a list of sizes",
    ),
    "offsets": (
        {"w": {"dtype": "BF16", "shape": [4], "data_offsets": [8, 0]}},
        8,
        "is not a byte range",
    ),
    "metadata": (
        {
            "__metadata__": {"format": 1},
            "w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]},
        },
        8,
        "__metadata__ must map strings to strings",
    ),
    "not-an-object": ([1, 2], 0, "not a JSON object"),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_malformed_headers_are_refused(tmp_path: Path, case: str) -> None:
    header, data_bytes, message = HEADERS[case]
    path = _raw_file(tmp_path / "x.safetensors", header, bytes(data_bytes))
    with pytest.raises(CheckpointError, match=message) as info:
        read_header(path)
    assert info.value.check == "header"


def test_a_name_twice_in_one_header_is_refused(tmp_path: Path) -> None:
    entry = '{"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}'
    text = f'{{"w": {entry}, "w": {entry}}}'.encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(2))
    with pytest.raises(CheckpointError, match="'w' appears twice") as info:
        read_header(path)
    assert info.value.check == "header"


def test_missing_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint directory") as info:
        read_catalog(tmp_path / "nowhere")
    assert info.value.check == "missing"
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors file") as info:
        read_catalog(tmp_path / "empty")
    assert info.value.check == "missing"
    with pytest.raises(CheckpointError, match=r"config\.json: no such file") as info:
        read_config(tmp_path / "empty")
    assert info.value.check == "missing"
    config, sd = _state(torch.bfloat16)
    sharded = write_checkpoint(tmp_path / "ckpt", config, FAMILY, sd, shard_bytes=40_000)
    victim = sorted(sharded.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match="no such file") as info:
        read_catalog(sharded)
    assert info.value.check == "missing" and victim.name in str(info.value)


def test_an_index_that_does_not_match_its_files_is_refused(tmp_path: Path) -> None:
    config, sd = _state(torch.bfloat16)
    sharded = write_checkpoint(tmp_path / "ckpt", config, FAMILY, sd, shard_bytes=40_000)
    index_path = sharded / INDEX_FILE
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    moved = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][moved] = files[1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="the index") as info:
        read_catalog(sharded)
    assert (info.value.check, info.value.tensor) == ("index", moved)
    index["weight_map"][moved] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"not a \.safetensors file of this directory"):
        read_catalog(sharded)
    index_path.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON") as info:
        read_catalog(sharded)
    assert info.value.check == "index"
    index_path.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="no weight_map"):
        read_catalog(sharded)


def test_a_tensor_in_two_files_without_an_index_is_refused(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path)
    (checkpoint / "copy.safetensors").write_bytes((checkpoint / WEIGHTS_FILE).read_bytes())
    with pytest.raises(CheckpointError, match="also stored in another file") as info:
        read_catalog(checkpoint)
    assert info.value.check == "index"


def test_a_malformed_config_is_refused(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path)
    (checkpoint / "config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match="not valid JSON") as info:
        read_config(checkpoint)
    assert info.value.check == "config"


def test_catalog_differences_name_each_tensor_and_how_it_differs() -> None:
    a = {
        "x": TensorSpec(name="x", shape=(4, 2), dtype=torch.bfloat16),
        "y": TensorSpec(name="y", shape=(3,), dtype=torch.bfloat16),
        "z": TensorSpec(name="z", shape=(2,), dtype=torch.float32),
    }
    b = {
        "x": TensorSpec(name="x", shape=(4, 2), dtype=torch.float16),
        "z": TensorSpec(name="z", shape=(2,), dtype=torch.float32),
        "w": TensorSpec(name="w", shape=(1,), dtype=torch.bfloat16),
    }
    assert catalog_differences(a, b) == [
        "w: unexpected",
        "x: float16 [4, 2] instead of bfloat16 [4, 2]",
        "y: missing",
    ]
    assert catalog_differences(a, dict(a)) == []
    check_catalog(a, dict(a), expected_from="here", found_from="there")
    with pytest.raises(ConfigError, match="the catalog of the trainer differs from the catalog of "
                       "ckpt in 3 tensors: w: unexpected; x: float16") as info:  # fmt: skip
        check_catalog(a, b, expected_from="ckpt", found_from="the trainer")
    assert (info.value.check, info.value.tensor) == ("catalog", "w")


def test_uncovered_parameters_are_what_the_catalog_does_not_write() -> None:
    """Checked after prewarm: every parameter storage of the model is filled by the loader's
    writes of the catalog's names (vocabulary padding rows by its fills)."""
    config = tiny_config("qwen3")
    catalog = _specs(random_state_dict(config, "qwen3", seed=1))
    for rank in (0, 1):
        model = ShardedServingModel(config, "qwen3", tp_size=2, tp_rank=rank)
        receiver = Applier(ShardedServingLoader(model), catalog)
        receiver.prewarm()
        assert uncovered_parameters(receiver) == []
    short = {n: s for n, s in catalog.items() if "layers.1.self_attn.k_proj" not in n}
    short = {n: s for n, s in short.items() if n != "model.layers.0.input_layernorm.weight"}
    model = ShardedServingModel(config, "qwen3", tp_size=2, tp_rank=1)
    receiver = Applier(ShardedServingLoader(model), short)
    receiver.prewarm()
    assert uncovered_parameters(receiver) == [
        "model.layers.0.input_layernorm.weight",
        "model.layers.1.self_attn.qkv_proj.weight",
    ]


def test_a_file_object_is_never_asked_for_more_than_the_header(tmp_path: Path) -> None:
    """The reader takes the header from a file it only opens: bytes after the header may be
    anything (here: absent from a sparse file of 4 GiB)."""
    header = {"w": {"dtype": "BF16", "shape": [1 << 31], "data_offsets": [0, 1 << 32]}}
    text = json.dumps(header).encode()
    path = tmp_path / "big.safetensors"
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + (1 << 32))
    assert read_header(path) == {"w": TensorSpec(name="w", shape=(1 << 31,), dtype=torch.bfloat16)}
