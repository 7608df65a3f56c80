"""dcr: bit-exact delta-compressed refit of policy weights from RL trainers to rollout engines.

Only the names below are public API.  They are imported on first use, so ``import
dcr.protocol`` stays free of torch and anyio, and importing dcr never imports vLLM, Megatron,
pyzmq or botocore (adapters that need them import them lazily).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcr.adapters.faulty import FaultReport as FaultReport
    from dcr.adapters.faulty import Faults as Faults
    from dcr.adapters.loaders.torch_module import TorchModuleLoader as TorchModuleLoader
    from dcr.adapters.loaders.vllm import VllmLoader as VllmLoader
    from dcr.adapters.sources import ShardSource as ShardSource
    from dcr.adapters.sources import Source as Source
    from dcr.adapters.sources import StateDictSource as StateDictSource
    from dcr.apply.applier import Applier as Applier
    from dcr.apply.applier import ApplyConfig as ApplyConfig
    from dcr.apply.loader import Loader as Loader
    from dcr.delta.build import BuildConfig as BuildConfig
    from dcr.delta.dist import DistTrainingGroup as DistTrainingGroup
    from dcr.delta.group import LocalTrainingGroup as LocalTrainingGroup
    from dcr.delta.group import TrainingGroup as TrainingGroup
    from dcr.delta.layout import TrainLayout as TrainLayout
    from dcr.errors import DcrError as DcrError
    from dcr.fleet.trainer import PublishReport as PublishReport
    from dcr.fleet.trainer import TrainerContext as TrainerContext
    from dcr.fleet.trainer import TrainerRank as TrainerRank
    from dcr.fleet.trainer import committed_version as committed_version
    from dcr.fleet.trainer import join_trainer as join_trainer
    from dcr.local import LocalRefit as LocalRefit
    from dcr.local import RefitConfig as RefitConfig
    from dcr.local import RefitReport as RefitReport
    from dcr.local import TransitionFailed as TransitionFailed
    from dcr.protocol.receiver import QueueConfig as QueueConfig
    from dcr.protocol.types import Timeouts as Timeouts
    from dcr.tensors.records import Encoding as Encoding
    from dcr.tensors.records import Item as Item
    from dcr.tensors.records import Mode as Mode
    from dcr.tensors.records import TensorSpec as TensorSpec

__version__ = "0.1.0"

_EXPORTS = {
    "ApplyConfig": "dcr.apply.applier",
    "BuildConfig": "dcr.delta.build",
    "DcrError": "dcr.errors",
    "DistTrainingGroup": "dcr.delta.dist",
    "Encoding": "dcr.tensors.records",
    "FaultReport": "dcr.adapters.faulty",
    "Faults": "dcr.adapters.faulty",
    "Item": "dcr.tensors.records",
    "PublishReport": "dcr.fleet.trainer",
    "TrainerContext": "dcr.fleet.trainer",
    "TrainerRank": "dcr.fleet.trainer",
    "committed_version": "dcr.fleet.trainer",
    "join_trainer": "dcr.fleet.trainer",
    "Loader": "dcr.apply.loader",
    "LocalRefit": "dcr.local",
    "LocalTrainingGroup": "dcr.delta.group",
    "Mode": "dcr.tensors.records",
    "QueueConfig": "dcr.protocol.receiver",
    "Applier": "dcr.apply.applier",
    "RefitConfig": "dcr.local",
    "RefitReport": "dcr.local",
    "ShardSource": "dcr.adapters.sources",
    "Source": "dcr.adapters.sources",
    "StateDictSource": "dcr.adapters.sources",
    "TensorSpec": "dcr.tensors.records",
    "Timeouts": "dcr.protocol.types",
    "TorchModuleLoader": "dcr.adapters.loaders.torch_module",
    "TrainLayout": "dcr.delta.layout",
    "TrainingGroup": "dcr.delta.group",
    "TransitionFailed": "dcr.local",
    "VllmLoader": "dcr.adapters.loaders.vllm",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dcr' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
