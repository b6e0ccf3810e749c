"""transcover: the norm-based theory of Transformers, measured, certified and enforced on real models."""

from ._api import analyze as analyze
from ._api import describe as describe
from ._api import load as load
from ._errors import InputError as InputError
from ._errors import TranscoverError as TranscoverError
from ._errors import TranscoverWarning as TranscoverWarning
from ._errors import UnsupportedArchitectureError as UnsupportedArchitectureError
from ._errors import WeightError as WeightError
from ._results import Interval as Interval
from ._results import Kind as Kind
from ._results import ClippedQuantity as ClippedQuantity
from ._results import Quantity as Quantity

__version__ = "0.1.0"

__all__ = [
    "analyze", "describe", "load",
    "TranscoverError", "InputError", "UnsupportedArchitectureError", "WeightError", "TranscoverWarning",
    "Interval", "Kind", "Quantity", "ClippedQuantity",
]
