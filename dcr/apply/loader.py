"""The native-loader interface a receiver applies deltas through (paper §6.1, App. A.2).

A :class:`Loader` wraps a serving runtime's own weight loader -- vLLM's ``model.load_weights``,
``load_state_dict``-style copies for plain modules -- together with the module whose parameter
and buffer storage it writes.  dcr never places values itself: it hands the loader canonical
tensors (its scratch) and intercepts the loader's final storage copies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping

import torch

__all__ = ["Loader"]


class Loader(ABC):
    """A native weight loader plus the storage it writes.

    Subclasses implement :meth:`load_weights` and :attr:`module`; the rest has defaults.
    """

    @property
    @abstractmethod
    def module(self) -> torch.nn.Module:
        """The module whose parameters and buffers hold this receiver's resident weights."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str] | None:
        """Run the native loader on ``(canonical name, tensor)`` pairs.

        Returns the names the loader reports as loaded (in whatever naming the runtime uses),
        or ``None`` when the runtime does not report.  A reported load must correspond to at
        least one storage write; a name the loader neither reports nor writes is a *native
        skip* (e.g. another rank's experts).
        """

    def storage_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor whose storage the loader may write: parameters, then buffers."""
        yield from self.module.named_parameters(remove_duplicate=False)
        yield from self.module.named_buffers(remove_duplicate=False)

    def check_ready(self) -> None:  # noqa: B027 - optional hook, most loaders are always ready
        """Raise :class:`~dcr.errors.LoaderPathUnsupported` when in-place writes to the storage
        would not reach what the runtime computes with (e.g. repacked weights)."""

    def dense_load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load every tensor of ``state_dict`` through the native loader (a dense refit)."""
        with torch.no_grad():
            self.load_weights(state_dict.items())
