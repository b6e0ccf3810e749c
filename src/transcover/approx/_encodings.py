"""Positional encodings with a measured near-orthogonality Δ (THEORY F16a, F16b).

.. math::

    \\Delta(P) = \\max_{i \\ne j} |\\langle p_i, p_j \\rangle|,\\qquad \\|p_i\\|_2 = 1.

Lemma H.1 needs Δ < 1/2: the attention gap is then at least ``R (1 - 2Δ)``.  Families:
random signs (F16b), sinusoidal (Vaswani et al.), an equiangular family with *prescribed* Δ, and
a designed set whose coherence is pushed down by optimisation (with the Welch bound as the floor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import Tensor

from .._errors import InputError, check_number, check_positive_int
from .._results import Kind

__all__ = [
    "Encoding",
    "coherence",
    "random_sign_encoding",
    "sinusoidal_encoding",
    "equiangular_encoding",
    "designed_encoding",
    "make_encoding",
    "random_sign_dimension",
    "welch_bound",
    "welch_dimension",
    "ENCODING_KINDS",
]

ENCODING_KINDS = ("random", "sinusoidal", "equiangular", "designed", "orthogonal")


@dataclass(frozen=True)
class Encoding:
    """Unit positional encodings ``P`` (n, d_p) with their coherence Δ.

    ``delta`` is exact: a rational computed in integers for sign codes (``delta_fraction``), the
    float64 maximum of the Gram matrix otherwise (``kind`` says which).
    """

    P: Tensor
    delta: float
    kind: Kind
    family: str
    delta_fraction: Fraction | None = None

    def __post_init__(self) -> None:
        # a hand-built Encoding was trusted for its delta (stop 36, closed at stop 38): Lemma H.1's gap R(1 - 2Δ)
        # and every error bound read it, so a delta below the rows' coherence is refused (the Gram's float64
        # rounding, d ulps of an entry of size <= 1, allowed)
        measured = coherence(self.P)
        if not (isinstance(self.delta, (int, float)) and self.delta >= measured - 4 * self.P.shape[1] * 2.0**-52):
            raise InputError(f"delta={self.delta!r} is below the encodings' coherence max|<p_i, p_j>| = {measured!r}")

    @property
    def n(self) -> int:
        return self.P.shape[0]

    @property
    def dim(self) -> int:
        return self.P.shape[1]


def _check_n_d(n: int, d: int) -> None:
    for name, v in (("n", n), ("dim", d)):
        check_positive_int(v, name)


def coherence(P: Tensor) -> float:
    """Δ = max_{i≠j} |<p_i, p_j>| of the rows of ``P`` in float64 (0 for a single row).

    The rows must be unit vectors (checked to ``64 d eps``), since Δ is only meaningful for them.
    """
    if P.dim() != 2:
        raise InputError(f"encodings must be a matrix (n, d), but got shape {tuple(P.shape)}")
    P = P.double()
    n, d = P.shape
    norms = P.norm(dim=1)
    tol = 64 * d * torch.finfo(torch.float64).eps
    if (norms - 1).abs().max() > tol:
        raise InputError(f"encodings must have unit rows, but a row has norm {float(norms[(norms - 1).abs().argmax()]):.6g}")
    if n < 2:
        return 0.0
    G = P @ P.T
    G.fill_diagonal_(0.0)
    return float(G.abs().max())


def random_sign_encoding(n: int, dim: int, *, seed: int = 0) -> Encoding:
    """Rows ``p_i = ε_i / sqrt(d)``, ``ε_i`` uniform in {±1}^d (THEORY F16b).

    Δ is computed exactly: ``<ε_i, ε_j>`` is an integer, so ``Δ = max|S_ij| / d`` as a fraction.
    """
    _check_n_d(n, dim)
    g = torch.Generator().manual_seed(int(seed))
    signs = torch.randint(0, 2, (n, dim), generator=g, dtype=torch.int64) * 2 - 1
    S = signs @ signs.T  # exact integer inner products
    S.fill_diagonal_(0)
    m = int(S.abs().max()) if n > 1 else 0
    frac = Fraction(m, dim)
    return Encoding(signs.double() / math.sqrt(dim), float(frac), Kind.EXACT, "random", frac)


def sinusoidal_encoding(n: int, dim: int, *, base: float = 10000.0) -> Encoding:
    """Vaswani et al.'s sin/cos encoding, each row scaled to unit norm (dim even).

    ``p_t[2k] = sin(t ω_k), p_t[2k+1] = cos(t ω_k)``, ``ω_k = base^{-2k/d}``; every row has norm
    ``sqrt(d/2)`` before scaling.  Coherence is often large (neighbouring positions are similar).
    """
    _check_n_d(n, dim)
    if dim % 2:
        raise InputError(f"sinusoidal encodings need an even dim, but got dim={dim}")
    t = torch.arange(n, dtype=torch.float64)[:, None]
    omega = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    P = torch.empty(n, dim, dtype=torch.float64)
    P[:, 0::2] = torch.sin(t * omega)
    P[:, 1::2] = torch.cos(t * omega)
    P = P / math.sqrt(dim / 2)
    return Encoding(P, coherence(P), Kind.EXACT, "sinusoidal")


def equiangular_encoding(n: int, delta: float) -> Encoding:
    """``n`` unit vectors in ``R^{n+1}`` with ``<p_i, p_j> = Δ`` exactly for all ``i ≠ j``.

    .. math::

        p_i = \\sqrt{1 - \\Delta}\\, e_i + \\sqrt{\\Delta}\\, e_{n+1}.

    This is the family for sweeps over Δ: its coherence is the prescribed value (up to rounding).
    """
    _check_n_d(n, 1)
    if not (0.0 <= delta < 1.0):
        raise InputError(f"delta must be in [0, 1), but got delta={delta!r}")
    P = torch.zeros(n, n + 1, dtype=torch.float64)
    P[:, :n] = math.sqrt(1.0 - delta) * torch.eye(n, dtype=torch.float64)
    P[:, n] = math.sqrt(delta)
    return Encoding(P, coherence(P), Kind.EXACT, "equiangular")


def orthogonal_encoding(n: int) -> Encoding:
    """The standard basis of ``R^n`` (Δ = 0)."""
    _check_n_d(n, 1)
    return Encoding(torch.eye(n, dtype=torch.float64), 0.0, Kind.EXACT, "orthogonal")


def designed_encoding(n: int, dim: int, *, seed: int = 0, steps: int = 150) -> Encoding:
    """A low-coherence design: random signs refined by minimising a soft maximum of ``<p_i,p_j>^2``.

    Gradient descent on ``logsumexp(τ G_ij^2) / τ`` over off-diagonal entries, rows re-normalised
    after every step; the best iterate (by exact Δ) is returned, so the result is never worse than
    the random-sign start.  The floor for any design is :func:`welch_bound`.
    """
    _check_n_d(n, dim)
    if dim >= n:
        return Encoding(torch.eye(n, dim, dtype=torch.float64), 0.0, Kind.EXACT, "designed")
    from ._threads import single_thread

    start = random_sign_encoding(n, dim, seed=seed)
    with single_thread():
        best = _refine(start, steps, seed)
    return Encoding(best, coherence(best), Kind.EXACT, "designed")


def _refine(start: Encoding, steps: int, seed: int = 0) -> Tensor:
    n = start.n
    # the descent starts a little off the random signs: two rows equal up to sign (random signs repeat
    # in small dimensions) have a purely radial gradient, which the renormalisation removes, so they
    # never separated and the design kept Δ = 1 (n = 8, d = 3; red team of stop 36).  The start itself
    # stays the first candidate, so the result is still never worse than it.
    g = torch.Generator().manual_seed(seed)
    P = (start.P + 1e-3 * torch.randn(start.P.shape, generator=g, dtype=start.P.dtype)).requires_grad_(True)
    best, best_delta = start.P.clone(), start.delta
    opt = torch.optim.Adam([P], lr=0.02)
    mask = ~torch.eye(n, dtype=torch.bool)
    tau = 50.0 / max(best_delta, 1e-3) ** 2
    for _ in range(steps):
        Q = P / P.norm(dim=1, keepdim=True)
        G = (Q @ Q.T)[mask]
        loss = torch.logsumexp(tau * G**2, dim=0) / tau
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            Q = P / P.norm(dim=1, keepdim=True)
            d = float((Q @ Q.T)[mask].abs().max())  # the exact Δ is recomputed on the winner
            if d < best_delta:
                best, best_delta = Q.clone(), d
    return best.detach()


def make_encoding(kind: str, n: int, *, dim: int | None = None, delta: float | None = None,
                  seed: int = 0) -> Encoding:
    """Dispatch by family name (``ENCODING_KINDS``); ``equiangular`` takes ``delta``, the others ``dim``."""
    if kind == "equiangular":
        if delta is None:
            raise InputError("equiangular encodings need delta")
        return equiangular_encoding(n, delta)
    if kind == "orthogonal":
        return orthogonal_encoding(n)
    if dim is None:
        raise InputError(f"{kind} encodings need dim")
    if kind == "random":
        return random_sign_encoding(n, dim, seed=seed)
    if kind == "sinusoidal":
        return sinusoidal_encoding(n, dim)
    if kind == "designed":
        return designed_encoding(n, dim, seed=seed)
    raise InputError(f"encoding kind must be one of {list(ENCODING_KINDS)}, but got {kind!r}")


def random_sign_dimension(n: int, delta: float, failure_prob: float = 0.01) -> int:
    """Dimension that makes random-sign encodings Δ-orthogonal with probability ≥ 1 − δ (F16b).

    .. math::

        d_p \\ge \\frac{2 \\ln(n^2/\\delta)}{\\Delta^2}.

    Derivation: for i ≠ j, ``<p_i, p_j>`` is the mean of d independent Rademacher signs, so
    Hoeffding gives ``P(|<p_i,p_j>| >= Δ) <= 2 exp(-d Δ^2 / 2)``; a union bound over the
    ``n(n-1)/2`` pairs gives failure ``<= n^2 exp(-d Δ^2 / 2) <= δ``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise InputError(f"n must be an integer >= 2, but got n={n!r}")
    check_number(delta, "delta", low=0.0, strict=True, below=1.0)
    check_number(failure_prob, "failure_prob", low=0.0, strict=True, below=1.0)
    return math.ceil(2.0 * math.log(n * n / failure_prob) / delta**2)


def welch_bound(n: int, dim: int) -> float:
    """Welch's lower bound on the coherence of any n unit vectors in R^d (0 when n <= d).

    .. math::

        \\Delta \\ge \\sqrt{\\frac{n - d}{d (n - 1)}}.
    """
    _check_n_d(n, dim)
    if n <= dim:
        return 0.0
    return math.sqrt((n - dim) / (dim * (n - 1)))


def welch_dimension(n: int, delta: float) -> int:
    """Smallest d that the Welch bound allows for coherence Δ: ``d >= n / (1 + (n - 1) Δ^2)``."""
    _check_n_d(n, 1)
    if not (0.0 <= delta < 1.0):
        raise InputError(f"delta must be in [0, 1), but got delta={delta!r}")
    return max(1, math.ceil(n / (1.0 + (n - 1) * delta**2) - 1e-12))
