"""The one exception family transcover raises for problems a user can fix.

Every user-facing error is a :class:`TranscoverError` (a ``ValueError``) whose message is one line
that names the offending file, tensor, argument or value.  The CLI prints exactly that line and
exits non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import math
import re

__all__ = ["TranscoverError", "InputError", "UnsupportedArchitectureError", "WeightError", "TranscoverWarning",
           "CertificateViolation", "check_radius", "check_positive_int", "check_number"]


class TranscoverError(ValueError):
    """Base class: a problem with what the user asked for or supplied."""


class InputError(TranscoverError):
    """A missing, unreadable or corrupted file, or an invalid argument value."""


class UnsupportedArchitectureError(TranscoverError):
    """The model's architecture has no adapter; the message lists the supported ones."""


class WeightError(TranscoverError):
    """A tensor is missing, has the wrong shape, or holds NaN/Inf; the message names it."""


class TranscoverWarning(UserWarning):
    """Something the user should know that does not stop the computation (one line, naming it).

    E.g. a checkpoint tensor inside a layer that no adapter role reads.  The CLI prints each as
    ``transcover: warning: ...`` on stderr; ``strict=True`` / ``--strict`` turns the loader's into errors.
    """


# ANSI escape sequences (torch colours parts of its messages) and every other control character
_ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def clean_line(text: str) -> str:
    """``text`` for a terminal: escape sequences and control characters removed, whitespace collapsed."""
    return " ".join(_CONTROL.sub(" ", _ANSI.sub("", text)).split())


class CertificateViolation(RuntimeError):
    """A measured lower value exceeds the certified upper bound it sits beside: a false certificate.

    Not a :class:`TranscoverError`: the user did nothing wrong, the bound (or its implementation) is
    wrong.  The CLI reports it as an internal error (one line, exit code 1), never as a table row.
    Raised by :func:`transcover._results.check_certified`.
    """


def check_radius(radius: float, name: str = "radius") -> float:
    """``float(radius)``, or :class:`InputError` naming ``name`` when it is not a finite number > 0.

    The one check of every radius, bound and positive scale argument (lipschitz, constrain, train).
    """
    try:
        r = float(radius)
    except (TypeError, ValueError, OverflowError):
        raise InputError(f"{name} must be a finite number > 0, but got {name}={radius!r}") from None
    if isinstance(radius, bool) or not (r > 0.0) or r == float("inf"):  # True is no radius
        raise InputError(f"{name} must be a finite number > 0, but got {name}={radius!r}")
    return r


def radius_in(radius: float, dtype, name: str = "radius") -> float:  # noqa: ANN001  (a torch dtype)
    """``check_radius(radius)``, also refused when the dtype its buffer lives in cannot hold it: a float16 cap at
    radius 1e5 was stored as inf, and its export failed with "got radius=inf" (red team 171)."""
    r = check_radius(radius, name)
    import torch

    top = torch.finfo(dtype).max
    if r > top:
        # the advice fits the dtype: "cast to float32" was given for float32 weights (red team 188); a staged schedule's
        # loose stage is loose_factor x the target, so a smaller factor or target also helps
        wider = "float32" if torch.finfo(dtype).bits < 32 else "float64"
        raise InputError(f"{name}={radius!r} is above the largest {str(dtype).replace('torch.', '')} number "
                         f"({top:g}); a cap on such weights cannot hold it: use a smaller radius (a staged schedule's "
                         f"loose stage is loose_factor x the target) or cast the module to {wider}")
    return r


def check_positive_int(value, name: str) -> int:  # noqa: ANN001  (any object; refused unless an integer)
    """``value``, or :class:`InputError` naming ``name`` unless ``value`` is a Python ``int`` >= 1.

    The one check of every count argument (sizes, samples, restarts, workers).  ``bool`` (an ``int``
    subclass: ``True`` counted as 1), floats, strings and numpy scalars (whose arithmetic wraps or
    is not exact downstream) are refused.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be a positive integer, but got {name}={value!r}")
    return value


def check_finite_tensor(t, name: str):  # noqa: ANN001, ANN201  (a torch.Tensor; torch stays a lazy import here)
    """``t``, or :class:`InputError` naming ``name`` when it holds NaN or infinite entries.

    The one refusal of non-finite weights in the enforcement routines (projections, clipping, caps):
    a NaN passes every ``norm > c`` test as False, so without it the constraint was silently not met.
    """
    if t.is_floating_point() and t.numel() and not bool(t.detach().isfinite().all()):
        raise InputError(f"{name} has NaN or infinite entries; a norm constraint cannot be enforced on it")
    return t


def check_number(x: float, name: str, *, low: float = -math.inf, strict: bool = False,
                 below: float = math.inf) -> float:
    """``float(x)``, or :class:`InputError` unless ``x`` is a finite real number ``>= low`` (``> low`` if ``strict``)
    and ``< below``.

    ``bool`` and strings are refused (``True`` is no factor; ``"2"`` failed later with a ``TypeError``).
    """
    v = _real(x)
    if math.isfinite(v) and (v > low if strict else v >= low) and v < below:
        return v
    if below < math.inf and low > -math.inf:
        bound = f" in {'(' if strict else '['}{low:g}, {below:g})"
    else:
        bound = "" if low == -math.inf else f" {'>' if strict else '>='} {low:g}"
        bound += "" if below == math.inf else f" < {below:g}"
    raise InputError(f"{name} must be a finite number{bound}, but got {name}={x!r}")


def _real(x: object) -> float:
    """``float(x)`` for a real number (a 0-d tensor or numpy scalar too); NaN for anything else."""
    if isinstance(x, (bool, str, bytes)):
        return math.nan
    try:
        return float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return math.nan
