"""transcover: the norm-based theory of Transformers, measured, certified and enforced on real models.

The public API mirrors the command line (``transcover analyze`` is ``transcover.analyze`` ...)::

    import transcover
    transcover.analyze()             # certified per-layer, per-head norms of all-MiniLM-L6-v2
    transcover.lipschitz(model)      # certified upper vs empirical lower Lipschitz constants
    transcover.perturb(a, b)         # Lemma G.3: how far two models' outputs can differ
    transcover.bound(model)          # covering number and generalisation bound
    transcover.cover(mode=...)       # empirical covering numbers
    transcover.approx(...)           # the Lemma H.1 construction and its error decomposition
    transcover.advise(s, beta, n, N) # design advice
    transcover.train(task=...)       # training under norm constraints

``lipschitz``, ``approx`` and ``train`` are subpackages too; calling one calls the API function
(Note [callable modules] in ``transcover._entry``), and they are imported on first use only.
"""

from ._api import advise as advise
from ._api import analyze as analyze
from ._api import bound as bound
from ._api import cover as cover
from ._api import describe as describe
from ._api import load as load
from ._api import perturb as perturb
from ._errors import InputError as InputError
from ._errors import TranscoverError as TranscoverError
from ._errors import TranscoverWarning as TranscoverWarning
from ._errors import UnsupportedArchitectureError as UnsupportedArchitectureError
from ._errors import WeightError as WeightError
from ._results import Interval as Interval
from ._results import Kind as Kind
from ._results import ClippedQuantity as ClippedQuantity
from ._results import Quantity as Quantity
from ._version import __version__ as __version__
from . import report as report  # registers the views result methods ask for (Note [views] in transcover._views)

__all__ = [
    "analyze", "lipschitz", "perturb", "bound", "cover", "approx", "advise", "train", "describe", "load",
    "TranscoverError", "InputError", "UnsupportedArchitectureError", "WeightError", "TranscoverWarning",
    "Interval", "Kind", "Quantity", "ClippedQuantity", "__version__",
]

_CALLABLE_SUBPACKAGES = ("lipschitz", "approx", "train")


def __getattr__(name: str):
    """``transcover.lipschitz`` / ``.approx`` / ``.train`` before anything imported them: import the
    subpackage (which makes itself callable) on first access, so ``import transcover`` stays fast."""
    if name in _CALLABLE_SUBPACKAGES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
