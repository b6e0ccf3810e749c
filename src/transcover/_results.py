"""What every number transcover reports *is*: certified, empirical, or an estimate.

Note [result kinds]: a reader of any table, JSON file or DataFrame must be able to tell a
guaranteed statement (a certified upper bound, or a certified interval that contains the true
value) from a measurement (an empirical lower bound: a value attained by some input, so the true
supremum is at least this) and from an estimate (no guarantee in either direction).  Results
therefore never travel as bare floats.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

__all__ = ["Kind", "Interval", "Quantity", "ClippedQuantity", "check_certified", "certificate_tolerance",
           "as_dict", "rounding_pad"]


def _plain(v: object) -> object:
    """A JSON-ready value: enums by value, dataclasses through their ``to_dict``, containers recursively."""
    if isinstance(v, Enum):
        return v.value
    if hasattr(v, "to_dict") and not isinstance(v, type):
        return v.to_dict()
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return as_dict(v)
    if isinstance(v, dict):
        return {(k.value if isinstance(k, Enum) else k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def as_dict(obj: object, *, exclude: tuple[str, ...] = (), **override: object) -> dict[str, object]:
    """The one serialiser of results: a dataclass's fields as a JSON-ready dict, ``kind`` always kept.

    Numbers stay Python floats, ``±inf`` and NaN included (users compute with them), so a dict is not strict
    JSON by itself: ``json.dumps(..., allow_nan=False)`` refuses it.  The CLI's envelope
    (``report._envelope``) writes non-finite floats as the strings "inf", "-inf", "nan" (red team 210).

    Note [result dicts]: every result's ``to_dict`` goes through here, so a number never leaves
    without its kind (Note [result kinds]): a ``kind`` attribute (field or property) is written as
    its value even when it is not a field.  ``exclude`` drops fields; ``override`` replaces or adds
    entries (already JSON-ready, e.g. a derived list).
    """
    out: dict[str, object] = {}
    for f in dataclasses.fields(obj):
        if f.name in exclude or f.name in override:
            continue
        out[f.name] = _plain(getattr(obj, f.name))
    out.update(override)
    if "kind" not in out and "kind" not in exclude:
        kind = getattr(obj, "kind", None)
        if kind is not None:
            out["kind"] = _plain(kind)
    return out


def rounding_pad(dtype: object = np.float64, terms: int = 0) -> float:
    """The one relative rounding pad of certified arithmetic in ``dtype`` (float64: 1e-9).

    Note [rounding pad]: a certified upper value computed by a closed form in floating point (a
    product of stage constants, a float64 vector norm, a scaled spectral bound) is multiplied once
    by ``1 + rounding_pad()``.  The pad dominates ``2^20`` roundings of the unit roundoff ``u`` of
    ``dtype`` (``2^20 u = 1.2e-10`` in float64), rounded up to a power of ten: far more operations
    than any closed form here performs, and the relative error ``gamma_n = n u / (1 - n u)`` of a
    sum of ``n <= 4.5e6`` non-negative terms (a squared norm).  ``terms`` asks for a sum of more
    terms than that: the pad is then ``2 gamma_terms``.  Every certified computation in transcover
    is float64 (weights of any storage dtype upcast exactly), so ``dtype`` is float64 in practice.
    """
    u = float(np.finfo(np.dtype(dtype)).eps) / 2.0
    base = 10.0 ** math.ceil(math.log10(2.0**20 * u))
    ku = terms * u
    return base if ku == 0.0 else max(base, 2.0 * ku / (1.0 - ku))


class Kind(str, Enum):
    """The epistemic status of a reported number."""

    CERTIFIED_INTERVAL = "certified interval"  # lower <= true <= upper, rounding accounted for
    CERTIFIED_UPPER = "certified upper bound"  # true <= value, guaranteed
    CERTIFIED_LOWER = "certified lower bound"  # value <= true, guaranteed by a proof (no witness), rounding included
    EMPIRICAL_LOWER = "empirical lower bound"  # attained by a witness: true sup >= value
    ESTIMATE = "estimate"  # no guarantee in either direction
    EXACT = "exact"  # computed exactly (up to float64 rounding of a closed form)


@dataclass(frozen=True)
class Interval:
    """An enclosure ``lower <= value <= upper`` of a real quantity.

    ``kind`` is :attr:`Kind.CERTIFIED_INTERVAL` when both ends are guaranteed (floating-point
    error included) and :attr:`Kind.ESTIMATE` when both ends are the same unguaranteed estimate
    (the ``--fast`` mode).
    """

    lower: float
    upper: float
    kind: Kind = Kind.CERTIFIED_INTERVAL
    method: str = ""

    def __post_init__(self) -> None:
        if not (self.lower <= self.upper) and not (math.isnan(self.lower) or math.isnan(self.upper)):
            raise ValueError(f"Interval needs lower <= upper, but got [{self.lower}, {self.upper}]")

    @property
    def mid(self) -> float:
        return 0.5 * (self.lower + self.upper)

    @property
    def relative_gap(self) -> float:
        """(upper - lower) / upper, and 0 for the zero interval."""
        if self.upper == 0.0:
            return 0.0
        return (self.upper - self.lower) / abs(self.upper)

    def __contains__(self, x: float) -> bool:
        return self.lower <= x <= self.upper

    def to_dict(self) -> dict[str, float | str]:
        return as_dict(self, exclude=("method",))


@dataclass(frozen=True)
class Quantity:
    """A single reported number with its kind, the formula it comes from, and its assumptions."""

    value: float
    kind: Kind
    source: str = ""  # e.g. "THEORY F6" or "Edelman et al. 2022, Lemma 4.2"
    assumptions: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, object]:
        return as_dict(self)


@dataclass(frozen=True)
class ClippedQuantity(Quantity):
    """A certified upper bound reported as ``min(raw, trivial)``, with the raw value kept and labelled.

    ``trivial`` is a bound that holds without any computation (e.g. the range ``b`` of a ``[0, b]``
    loss bounds every generalisation gap); ``vacuous`` says the computed ``raw`` did not beat it, so
    ``value`` then carries no information.  ``note`` says why, for tables.
    """

    raw: float = math.nan
    trivial: float = math.inf
    note: str = ""

    @property
    def vacuous(self) -> bool:
        return not (self.raw < self.trivial)

    def to_dict(self) -> dict[str, object]:
        raw = self.raw if math.isfinite(self.raw) else str(self.raw)
        return as_dict(self, raw=raw, vacuous=self.vacuous)


def certificate_tolerance(dtype: object = np.float64, ulps: int = 8) -> float:
    """Relative slack ``ulps * unit roundoff`` of ``dtype`` (float64: 8 * 2^-53 = 8.9e-16).

    Note [certificate check]: the empirical side of every comparison is a float64 evaluation (the
    witnesses of ``transcover.lipschitz``, the output changes of ``perturb``) or an exact integer
    (net and packing sizes), while every certified upper value already carries its own rounding
    pad (Note [rounding] in ``lipschitz._weights``).  A correct pair therefore never differs by more
    than the rounding of the final comparison itself, a few units in the last place; anything above
    that is a false certificate, not noise.
    """
    return ulps * float(np.finfo(np.dtype(dtype)).eps) / 2.0


def check_certified(what: str, upper: float, lower: float, *, dtype: object = np.float64, ulps: int = 8) -> None:
    """Raise :class:`~transcover._errors.CertificateViolation` when ``lower > upper`` beyond rounding.

    ``upper`` is a certified upper bound and ``lower`` a value attained by a witness (an empirical
    lower bound) of the same quantity ``what``; ``lower <= upper`` is then a theorem, and a
    violation means the certificate is false (Note [certificate check]).  The allowed slack is
    ``certificate_tolerance(dtype, ulps) * max(|upper|, |lower|)``.  A NaN on either side or an
    infinite upper value is not a violation (nothing is claimed).
    """
    from ._errors import CertificateViolation

    up, lo = float(upper), float(lower)
    if math.isnan(up) or math.isnan(lo) or up == math.inf:
        return
    if lo > up + certificate_tolerance(dtype, ulps) * max(abs(up), abs(lo)):
        raise CertificateViolation(
            f"false certificate: the measured {what} is {lo:.17g}, above its certified upper bound {up:.17g} "
            f"(ratio {lo / up if up > 0 else math.inf:.6g}); this is a bug in transcover, please report it "
            "with the command that produced it")
