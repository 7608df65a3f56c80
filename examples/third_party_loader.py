"""A third-party loader for dcr: a plain torch module that names its weights its own way.

``TinyLM`` plays a serving runtime's model: ``embed``, ``qkv.{i}`` (layer i's q, k and v
projections fused), ``out.{i}`` and ``norm`` (kept in float32); after loading it may
``pack()`` its attention weights into one tensor it computes with.  ``TinyLMLoader`` is its
native loader: it takes checkpoint (Hugging Face) names, places each tensor with a ``narrow``
view and one ``copy_`` per destination, reports the names it wrote, and refuses a packed
model in ``check_ready``: in-place deltas would not reach the packed copy.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from dcr import Loader, TensorSpec
from dcr.errors import LoaderPathUnsupported

_ATTENTION = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight")


def _weight(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)


class TinyLM(torch.nn.Module):
    """The runtime's model: ``layers`` attention blocks of width ``hidden``."""

    def __init__(self, layers: int = 2, hidden: int = 16, vocab: int = 48) -> None:
        super().__init__()
        self.embed = _weight(vocab, hidden)
        self.qkv = torch.nn.ParameterList(_weight(3 * hidden, hidden) for _ in range(layers))
        self.out = torch.nn.ParameterList(_weight(hidden, hidden) for _ in range(layers))
        self.norm = _weight(hidden, dtype=torch.float32)
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        """The runtime's post-load step: one packed copy of every attention weight."""
        self.packed = torch.cat([*self.qkv, *self.out])

    @staticmethod
    def catalog(layers: int = 2, hidden: int = 16, vocab: int = 48) -> dict[str, TensorSpec]:
        """The checkpoint's tensors, all bfloat16."""
        shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
        for i in range(layers):
            for p in "qkvo":
                shapes[f"model.layers.{i}.self_attn.{p}_proj.weight"] = (hidden, hidden)
        return {n: TensorSpec(name=n, shape=s, dtype=torch.bfloat16) for n, s in shapes.items()}


class TinyLMLoader(Loader):
    """``TinyLM``'s native loader: checkpoint names in, its own names reported."""

    def __init__(self, model: TinyLM) -> None:
        self._model = model

    @property
    def module(self) -> TinyLM:
        return self._model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                target = self._load(name, tensor)
                if target is not None:
                    loaded.add(target)
        return loaded

    def _load(self, name: str, w: torch.Tensor) -> str | None:
        m = self._model
        if name == "model.embed_tokens.weight":
            m.embed.copy_(w)
            return "embed"
        if name == "model.norm.weight":
            m.norm.copy_(w)  # bfloat16 -> float32, a cast: dcr overwrites this tensor
            return "norm"
        match = _ATTENTION.fullmatch(name)
        if match is None:
            return None  # not a tensor of this model: a native skip
        layer, part = int(match.group(1)), match.group(2)
        if part == "o":
            m.out[layer].copy_(w)
            return f"out.{layer}"
        rows = w.shape[0]
        m.qkv[layer].narrow(0, "qkv".index(part) * rows, rows).copy_(w)
        return f"qkv.{layer}"

    def check_ready(self) -> None:
        if self._model.packed is not None:
            raise LoaderPathUnsupported(
                "the attention weights were packed after loading; in-place deltas would not "
                "reach the packed copy",
                check="repacked",
            )
