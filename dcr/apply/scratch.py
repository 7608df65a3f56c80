"""The reusable scratch buffer handed to the native loader (paper §6.1, Figure C.2).

One byte buffer, sized at prewarm for the largest canonical tensor, is viewed as each item's
canonical dtype and shape.  Items on bit-preserving paths never fill it (their entries are
mapped through the copy geometry instead); only transforming paths write the placeholder and
the overwrite values into it.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from dcr.tensors.bits import bits_dtype
from dcr.tensors.records import TensorSpec

__all__ = ["Scratch", "torch_bits", "torch_index"]

_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def torch_bits(values: npt.NDArray[np.generic], device: torch.device | str = "cpu") -> torch.Tensor:
    """A numpy bit array as the torch integer type of the same width (see ``bits_dtype``)."""
    arr = values.view(_SIGNED[values.dtype.itemsize])
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = arr.copy()
    return torch.from_numpy(arr).to(device)


def torch_index(indices: npt.NDArray[np.int64], device: torch.device | str = "cpu") -> torch.Tensor:
    """An int64 numpy index array as a torch tensor on ``device``."""
    arr = indices
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = arr.copy()
    return torch.from_numpy(arr).to(device)


class Scratch:
    """A byte buffer viewed as one canonical tensor at a time."""

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        # At least one word, so the buffer has a storage of its own to recognise.
        self._buffer = torch.zeros(max(nbytes, 8), dtype=torch.uint8, device=device)

    @property
    def nbytes(self) -> int:
        return int(self._buffer.numel())

    @property
    def device(self) -> torch.device:
        return self._buffer.device

    @property
    def ptr(self) -> int:
        return int(self._buffer.untyped_storage().data_ptr())

    def view(self, spec: TensorSpec) -> torch.Tensor:
        """The buffer's first ``spec.nbytes`` bytes as ``spec.dtype`` in ``spec.shape``."""
        return self._buffer[: spec.nbytes].view(spec.dtype).view(spec.shape)

    def fill(
        self,
        spec: TensorSpec,
        placeholder: float | None,
        indices: npt.NDArray[np.int64] | slice,
        values: torch.Tensor,
    ) -> torch.Tensor:
        """``placeholder`` everywhere (kept as is when ``None``), then ``values`` (bits) at the
        flat ``indices`` (listed, or a slice for a run: one block copy)."""
        view = self.view(spec)
        if placeholder is not None:
            view.fill_(placeholder)
        flat = view.view(-1).view(bits_dtype(spec.dtype))
        if isinstance(indices, slice):
            flat[indices].copy_(values)
        else:
            flat.index_put_((torch_index(indices, flat.device),), values.to(flat.device))
        return view
