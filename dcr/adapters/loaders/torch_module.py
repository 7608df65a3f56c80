"""Native loader of a plain torch module: ``load_state_dict``-style copies, one per name."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dcr.apply.loader import Loader
from dcr.errors import ConfigError

__all__ = ["TorchModuleLoader"]


class TorchModuleLoader(Loader):
    """Copies each named tensor into the parameter or buffer of that name.

    Like ``Module.load_state_dict``: ``target.copy_(tensor)`` under ``no_grad``, casting when the
    dtypes differ.  Names the module does not have are neither loaded nor reported.  Tied
    parameters (one ``Parameter`` under two names) are reachable by both names.  The module's
    structure is read once, at construction.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._targets: dict[str, torch.Tensor] = dict(
            module.named_parameters(remove_duplicate=False)
        )
        self._targets.update(module.named_buffers(remove_duplicate=False))

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                target = self._targets.get(name)
                if target is None:
                    continue
                if target.shape != tensor.shape:
                    raise ConfigError(
                        f"shape {list(tensor.shape)} does not match the module's "
                        f"{list(target.shape)}",
                        tensor=name,
                        check="shape",
                    )
                target.copy_(tensor)
                loaded.add(name)
        return loaded
