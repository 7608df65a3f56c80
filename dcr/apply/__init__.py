"""Receiver data plane: scratch, dispatch hook, loader-path classification, prewarm."""

from dcr.apply.applier import Applier as Applier
from dcr.apply.applier import ApplyConfig as ApplyConfig
from dcr.apply.applier import ApplyReport as ApplyReport
from dcr.apply.applier import ItemReport as ItemReport
from dcr.apply.applier import PlaceholderScheme as PlaceholderScheme
from dcr.apply.applier import PrewarmReport as PrewarmReport
from dcr.apply.applier import xor_allowed_across as xor_allowed_across
from dcr.apply.loader import Loader as Loader
from dcr.apply.paths import CopyRecord as CopyRecord
from dcr.apply.paths import CopyStrategy as CopyStrategy
from dcr.apply.paths import FillRecord as FillRecord
from dcr.apply.paths import LoaderPath as LoaderPath
from dcr.apply.paths import PathKind as PathKind

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
    "Applier",
    "xor_allowed_across",
]
