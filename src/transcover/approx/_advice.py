"""Design advice (seed section 5.1): width, heads, depth and temperature from the error budget.

For an (s, β)-sparse target on sequences of length n with N training samples, the advice picks
the grid size (hence the MLP width d_m) of the Lemma H.1 construction that minimises

.. math::

    \\underbrace{\\varepsilon_{att}(R) + \\varepsilon_{MLP}(d_m)}_{\\text{approximation}}
    + \\underbrace{2\\,\\hat{\\mathfrak R}_N(\\mathcal F_{d_m, R})}_{\\text{estimation}},

* ``ε_att = L_head · 2γ · n e^{-R(1-2Δ)}``, with R the smallest temperature making
  ``ε_att <= ε_MLP`` (seed 5.3: make attention focus precisely first; R costs capacity only
  through ``B_KQ = (3 + s) R``, ``R ≈ ln(n ...)/(1 - 2Δ)``), and ``ε_MLP = (L/max(1,β)) (2/γ)^β (√s/N_g)^β`` (the
  construction's budget, :mod:`._construction`), with the head's Lipschitz constant estimated as
  ``L_head = s L γ^{-β} δ^{min(β,1)-1}`` (grid spacing δ = 2/N_g);
* the Rademacher term from Dudley's integral (THEORY F11) over the composite covering curve
  (THEORY F10): ``log N(ε) <= P log(1 + 2 B_θ √P / (ε/2)) + (2 L_head)^2 A_TF / ε^2`` with P the
  MLP's non-zero parameter count (F1, ``B_θ = N_g`` the entry scale of its weights) and
  ``A_TF = s^3 (B_V^{2/3} + (2 B_V B_KQ)^{2/3})^3 ln(N n)`` (F9 with B_X = 1, c_sm = 2,
  ``B_KQ = (3 + s) R``, ``B_V = γ``: the construction's ``W_Q`` carries ``R √d_p / κ²`` with
  ``κ = 1/√(3 + s)``, so under its ball norm (B_X = 1) the score matrix has norm ``(3 + s) R``,
  measured by float64 SVD; "B_KQ = R" before stop 36 understated the attention capacity by 3 + s).

This is a *design heuristic* (``Kind.ESTIMATE``): the constants of F9 are [M] in THEORY, and the
head constant is an estimate.  The quadrature is a private vectorised left Riemann sum at the fixed
scale α = D/√m (:func:`_dudley_fixed_alpha`), the rule of ``covering.dudley_entropy_integral``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._errors import InputError
from .._results import Kind

__all__ = ["Advice", "advise", "simplicial_widths"]


def simplicial_widths(s: int, N: int) -> tuple[int, ...]:
    """Hidden widths of the simplicial MLP for ``s`` inputs and ``N`` cells per axis (no build)."""
    nodes = (N + 1) ** s
    widths = [2 * s * (N + 1)]
    c = s
    while c > 1:
        widths.append(nodes * 2 * (2 * (c // 2) + c % 2))
        c = (c + 1) // 2
    widths.append(nodes)
    return tuple(widths)


def _dudley_fixed_alpha(P: float, c_par: float, A: float, m: float, D: float, n_grid: int = 200) -> float:
    """``4α + (12/√m) ∫_α^D √(P ln(1 + c_par/ε) + A/ε²) dε`` at ``α = D/√m`` (THEORY F11).

    A left Riemann sum on a geometric grid (an upper bound: the integrand decreases in ε).  The
    scale is fixed at ``α = D/√m`` rather than optimised, so the term keeps decreasing in N even
    where the bound is vacuous: the advice needs the trade-off's *shape*, not a certificate.
    Private on purpose: ``transcover.covering`` exports no vectorised form of this integral yet.
    """
    alpha = D / math.sqrt(m)
    eps = np.geomspace(alpha, D, n_grid)
    e = eps[:-1]
    root = np.sqrt(P * np.log1p(c_par / e) + A / e**2)
    return float(4 * alpha + 12 / math.sqrt(m) * np.sum(np.diff(eps) * root))


@dataclass(frozen=True)
class Advice:
    """The recommended design and the trade-off curve behind it (all ``Kind.ESTIMATE``)."""

    sparsity: int
    smoothness: float
    seq_len: int
    n_samples: int
    grid: int
    d_m: int
    heads: int
    attention_layers: int
    mlp_hidden_layers: int
    R: float
    positional_dim: int  # random-sign d_p for the assumed Δ (F16b, failure prob 1%)
    approx_error: float
    estimation_error: float
    curve: tuple[dict[str, float], ...]  # per grid: d_m, best R, approx, estimation, total, range D
    kind: Kind = Kind.ESTIMATE
    note: str = ""  # set when the estimation term exceeds the target's range (every design's bound is vacuous)

    def to_dict(self) -> dict[str, object]:
        d = {k: getattr(self, k) for k in ("sparsity", "smoothness", "seq_len", "n_samples", "grid", "d_m",
                                           "heads", "attention_layers", "mlp_hidden_layers", "R",
                                           "positional_dim", "approx_error", "estimation_error")}
        d["curve"] = list(self.curve)
        d["kind"] = self.kind.value
        d["note"] = self.note
        return d

    def plot(self, ax=None):
        """approximation, estimation and total against d_m (log-log), optimum marked, on ``ax`` (the
        current axes by default; :class:`transcover.report.AdviceDisplay`); returns self."""
        from .._views import render

        render("advice.plot", self, ax=ax)
        return self

def advise(sparsity: int, smoothness: float, seq_len: int, n_samples: int, *, delta: float = 0.25,
           gamma: float = 1.0, holder_constant: float = 1.0, max_width: int = 200_000) -> Advice:
    """Recommend (d_m, heads, depth, R) for an (s, β)-sparse target; see the module docstring.

    Raises:
        InputError: s, n, N not positive integers, s > n, β outside (0, 2], Δ outside [0, 1/2),
            γ outside (0, 1], a Hölder constant that is not finite and > 0.
    """
    for name, v in (("sparsity", sparsity), ("seq_len", seq_len), ("n_samples", n_samples)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise InputError(f"{name} must be a positive integer, but got {name}={v!r}")
    if sparsity > seq_len:
        raise InputError(f"sparsity s must be <= seq_len n, but got s={sparsity} > n={seq_len}")
    if n_samples > 1e300:  # float(N) overflowed: an internal OverflowError (stop 39 red team)
        raise InputError(f"n_samples must be at most 1e300, but got a number of {len(str(n_samples))} digits")
    if n_samples < 2:  # Dudley's integral is empty at m = 1: the estimation term is 8D at every width (stop 38)
        raise InputError("n_samples must be >= 2: with one sample the estimation term is the trivial 8D for every "
                         "width, so no design is better than another")
    if not (0.0 < smoothness <= 2.0):
        raise InputError(f"smoothness beta must be in (0, 2], but got beta={smoothness!r}")
    if not (0.0 <= delta < 0.5):
        raise InputError(f"delta must be in [0, 1/2), but got delta={delta!r}")
    if not (0.0 < gamma <= 1.0):
        raise InputError(f"gamma must be in (0, 1], but got gamma={gamma!r}")
    if not 0 < holder_constant < math.inf:  # 0 divided 0 by 0 in R, inf made every figure NaN (stop 36)
        raise InputError(f"the Hölder constant must be a finite number > 0, but got {holder_constant!r}")
    s, beta, n, m = sparsity, float(smoothness), seq_len, n_samples
    L = holder_constant

    def design(N_g: int, m: float) -> dict[str, float]:
        widths = simplicial_widths(s, N_g)
        P = 4 * sum(widths) + (N_g + 1) ** s  # non-zero parameters (estimate: fan-in <= 3 + bias)
        dgrid = 2.0 / N_g
        L_head = s * L * gamma ** (-beta) * dgrid ** (min(beta, 1.0) - 1.0)
        e_mlp = L / max(1.0, beta) * (2.0 / gamma) ** beta * (math.sqrt(s) / N_g) ** beta
        D = max(1.0, L * (2.0 * math.sqrt(s)) ** beta)  # sup |h| scale on the box
        # Seed 5.3, "make attention focus precisely first": the smallest R whose attention error
        # is at most the MLP error; the capacity of R grows only like log n, so this is cheap.
        R = max(math.log(max(L_head * 2 * gamma * n / e_mlp, 1.0)) / (1 - 2 * delta), 1e-3)
        # one token: attention reads it with weight 1 whatever R, so its error is 0 (it was 2 gamma L_head e^-R)
        e_att = L_head * 2 * gamma * n * math.exp(-R * (1 - 2 * delta)) if n > 1 else 0.0
        A_tf = s**3 * (gamma ** (2 / 3) + (2 * gamma * (3 + s) * R) ** (2 / 3)) ** 3 * math.log(m * n)
        est = 2 * _dudley_fixed_alpha(P, 4 * N_g * math.sqrt(P), (2 * L_head) ** 2 * A_tf, m, D)
        return {"grid": N_g, "d_m": max(widths), "R": float(R), "attention": e_att, "mlp": e_mlp,
                "approx": e_att + e_mlp, "estimation": est, "total": e_att + e_mlp + est, "range": D}

    curve = []
    N_g = 1
    try:
        while max(simplicial_widths(s, N_g)) <= max_width:
            curve.append(design(N_g, m))
            N_g = N_g + 1 if N_g < 16 else int(N_g * 1.25)
    except OverflowError:  # gamma^-beta L or (2/gamma)^beta beyond float64: an internal error (red team 163)
        raise InputError(f"the design's figures overflow float64 at gamma={gamma!r}, beta={beta!r}, Hölder constant "
                         f"{L!r} (the head's Lipschitz constant grows like L gamma^-beta); use a larger gamma or a "
                         "smaller constant") from None
    if not curve:
        raise InputError(f"even the smallest MLP is wider than max_width={max_width}")
    opt = min(curve, key=lambda c: c["total"])
    from ._encodings import random_sign_dimension

    # one position needs no code beyond one coordinate (it was advised d_p = 192, red team 181)
    d_p = random_sign_dimension(n, max(delta, 1e-3), 0.01) if delta > 0 and n > 1 else n
    note = ""
    D = opt["range"]
    grids = [c["grid"] for c in curve]
    if min(c["approx"] for c in curve) >= D:  # no sample size helps: every design's approximation error alone is over
        note = (f"vacuous: every design's approximation error (the least {min(c['approx'] for c in curve):.4g}) "
                f"exceeds the target's scale D = max(1, L (2 sqrt(s))^beta) = {D:.4g} (gamma={gamma:g}, "
                f"beta={beta:g}); more samples do not help")
    elif opt["total"] >= D:
        # every design's bound exceeds the target's range at this N, and the advised one is only the least vacuous;
        # say so, and from which N (to about 1 %) the best design's total falls below D
        best = lambda N: min(design(g, N)["total"] for g in grids)  # noqa: E731
        hi = float(m)
        while best(hi) >= D and hi < 1e300:
            hi *= 2
        if hi < 1e300:
            lo = hi / 2
            while hi / lo > 1.01:
                mid = math.sqrt(lo * hi)
                lo, hi = (lo, mid) if best(mid) < D else (mid, hi)
        note = (f"vacuous at N={m}: approximation {opt['approx']:.4g} + estimation {opt['estimation']:.4g} exceed the "
                f"target's scale D = max(1, L (2 sqrt(s))^beta) = {D:.4g}, so the advice is the least vacuous design, "
                "not a good one; "
                + (f"the best design's total falls below D from N={hi:.2g}" if hi < 1e300 else
                   "no design's total falls below D up to N=1e300"))
    return Advice(s, beta, n, m, opt["grid"], opt["d_m"], s, 1, len(simplicial_widths(s, opt["grid"])),
                  opt["R"], d_p, opt["approx"], opt["estimation"], tuple(curve), note=note)
