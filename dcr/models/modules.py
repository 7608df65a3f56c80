"""Plain torch modules shaped like a checkpoint, for tests and examples."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = ["module_from_state_dict"]


def module_from_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    *,
    tied: Iterable[tuple[str, str]] = (),
    buffers: Iterable[str] = (),
) -> torch.nn.Module:
    """A module whose parameters carry the dotted names and copies of the values of
    ``state_dict``.

    ``tied`` pairs ``(alias, target)`` register ``alias`` as the very same Parameter as
    ``target`` (like a tied output head); names in ``buffers`` become buffers instead of
    parameters.
    """
    root = torch.nn.Module()
    as_buffer = set(buffers)

    def parent(name: str) -> tuple[torch.nn.Module, str]:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = getattr(mod, part, None)
            if not isinstance(child, torch.nn.Module):
                child = torch.nn.Module()
                mod.add_module(part, child)
            mod = child
        return mod, leaf

    for name, t in state_dict.items():
        mod, leaf = parent(name)
        value = t.detach().clone()
        if name in as_buffer:
            mod.register_buffer(leaf, value)
        else:
            mod.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=False))
    for alias, target in tied:
        tmod, tleaf = parent(target)
        amod, aleaf = parent(alias)
        amod.register_parameter(aleaf, getattr(tmod, tleaf))
    return root
