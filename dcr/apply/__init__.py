"""Receiver data plane: scratch, dispatch hook, loader-path classification, prewarm."""

from dcr.apply.loader import Loader as Loader
from dcr.apply.paths import CopyRecord as CopyRecord
from dcr.apply.paths import CopyStrategy as CopyStrategy
from dcr.apply.paths import FillRecord as FillRecord
from dcr.apply.paths import LoaderPath as LoaderPath
from dcr.apply.paths import PathKind as PathKind
from dcr.apply.receiver import ApplyConfig as ApplyConfig
from dcr.apply.receiver import ApplyReport as ApplyReport
from dcr.apply.receiver import ItemReport as ItemReport
from dcr.apply.receiver import PlaceholderScheme as PlaceholderScheme
from dcr.apply.receiver import PrewarmReport as PrewarmReport
from dcr.apply.receiver import Receiver as Receiver
from dcr.apply.receiver import xor_allowed_across as xor_allowed_across

__all__ = [
    "ApplyConfig",
    "ApplyReport",
    "CopyRecord",
    "CopyStrategy",
    "FillRecord",
    "ItemReport",
    "Loader",
    "LoaderPath",
    "PathKind",
    "PlaceholderScheme",
    "PrewarmReport",
    "Receiver",
    "xor_allowed_across",
]
