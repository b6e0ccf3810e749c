"""Rate checks (seed section 4.2): attention error vs (n, R, Δ) and MLP error vs d_m for (β, s).

* Attention: the read-out error of the construction against ``2γ m(R(1 - Δ_k - 2λ))`` (exact gap)
  and the lemma's ``2γ n e^{-R(1-2Δ)}``; the fitted decay rate in R is compared with the gap's
  coefficient (``1 - Δ`` for λ = 0, ``1 - 2Δ`` for the lemma's worst case λ = Δ/2).
* MLP: the sup-error of the simplicial network against its bound; the fitted exponent of the error
  in ``d_m`` (the widest hidden layer, ``∝ (N+1)^s``) is compared with ``-β/s``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .._errors import InputError
from ._construction import build_construction
from ._decomposition import attention_candidates
from ._encodings import equiangular_encoding
from ._simplicial import simplicial_error_bound, simplicial_interpolate, simplicial_mlp
from ._targets import holder_ridge
from ._threads import single_thread

__all__ = ["AttentionRate", "MLPRate", "attention_rate_sweep", "mlp_rate_sweep", "fit_loglog", "fit_decay"]


def fit_loglog(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of log y against log x (the fitted exponent)."""
    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    return float(np.polyfit(lx, ly, 1)[0])


def fit_decay(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares rate ``a`` in ``y ≈ C e^{-a x}`` (minus the slope of log y against x)."""
    return float(-np.polyfit(np.asarray(x, float), np.log(np.asarray(y, float)), 1)[0])


@dataclass(frozen=True)
class AttentionRate:
    """Rows ``(n, delta, key_leak, R, measured, bound, lemma)``, per-(n, Δ, λ) fitted decay rates, the points skipped
    under the float64 floor (``skipped``: their bound) and the (n, Δ, λ) with fewer than two radii in the exponential
    regime (``unfitted``): a sweep had printed an empty fit table and dropped points without a word (red team 181)."""

    rows: tuple[dict[str, float], ...]
    fits: tuple[dict[str, float], ...] = field(default_factory=tuple)
    skipped: tuple[dict[str, float], ...] = field(default_factory=tuple)
    unfitted: tuple[dict[str, float], ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, object]:
        return {"rows": list(self.rows), "fits": list(self.fits), "skipped": list(self.skipped),
                "unfitted": list(self.unfitted)}

    def plot(self, ax=None):
        """measured (markers) and both bounds (lines) against R, log scale, on ``ax`` (the current axes
        by default; :class:`transcover.report.AttentionRateDisplay`); returns ``self``."""
        from .._views import render

        render("attention_rate.plot", self, ax=ax)
        return self


def attention_rate_sweep(Rs: Sequence[float], ns: Sequence[int] = (16,), deltas: Sequence[float] = (0.0, 0.2, 0.4),
                         *, lemma_worst_case: bool = False, gamma: float = 1.0, floor: float = 1e-11
                         ) -> AttentionRate:
    """Measured sup read-out error of the construction (one relevant token, equiangular encodings).

    With equiangular encodings and the extreme contents of :func:`attention_candidates` the
    measured error *attains* ``2γ m(gap)`` (all n − 1 other scores sit exactly ``gap`` below the
    target), so the sweep shows the bound's tightness as well as the rate.  ``lemma_worst_case``
    sets λ = Δ/2, for which the gap is exactly ``R(1 − 2Δ)``.  Points whose bound is below
    ``floor`` are skipped (float64 cannot resolve them).
    """
    for R in Rs:
        if not R > 0:
            raise InputError(f"temperature R must be > 0, but got R={R!r}")
    for d in deltas:
        if not (0.0 <= d < 0.5):
            raise InputError(f"delta must be in [0, 1/2), but got delta={d!r}")
    for n in ns:
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise InputError(f"sequence length n must be an integer >= 2, but got n={n!r}")
    rows, fits, skipped, unfitted = [], [], [], []
    with single_thread():
        for n in ns:
            target = holder_ridge((n // 2,), 1.0, seed=0)
            cand = attention_candidates(n, target.indices, 64, seed=0)
            for delta in deltas:
                lam = delta / 2 if lemma_worst_case else 0.0
                enc = equiangular_encoding(n, delta)
                Rk, meas = [], []
                for R in Rs:
                    c = build_construction(target, enc, R=R, grid=1, gamma=gamma, key_leak=lam)
                    b = c.bound()
                    if b.readout_bound[0] < floor:
                        skipped.append({"n": n, "delta": delta, "key_leak": lam, "R": R, "bound": b.readout_bound[0]})
                        continue
                    with torch.no_grad():
                        m = float((c.readout(cand) - c.ideal_readout(cand)).abs().max())
                    lemma = 2 * gamma * n * math.exp(-R * (1 - 2 * delta))
                    rows.append({"n": n, "delta": delta, "key_leak": lam, "R": R, "measured": m,
                                 "bound": b.readout_bound[0], "lemma": lemma})
                    if b.readout_bound[0] < 1e-2:  # the exponential regime
                        Rk.append(R)
                        meas.append(m)
                if len(Rk) >= 2:
                    fits.append({"n": n, "delta": delta, "key_leak": lam, "fitted_rate": fit_decay(Rk, meas),
                                 "gap_rate": 1 - delta - 2 * lam, "lemma_rate": 1 - 2 * delta})
                else:
                    unfitted.append({"n": n, "delta": delta, "key_leak": lam, "points": len(Rk)})
    return AttentionRate(tuple(rows), tuple(fits), tuple(skipped), tuple(unfitted))


@dataclass(frozen=True)
class MLPRate:
    """Rows ``(beta, s, grid, d_m, measured, bound, net_vs_reference)`` and fitted exponents."""

    rows: tuple[dict[str, float], ...]
    fits: tuple[dict[str, float], ...]

    def to_dict(self) -> dict[str, object]:
        return {"rows": list(self.rows), "fits": list(self.fits)}

    def plot(self, ax=None):
        """measured sup error (markers) and bound (lines) against d_m, log-log, on ``ax`` (the current
        axes by default; :class:`transcover.report.MLPRateDisplay`); returns ``self``."""
        from .._views import render

        render("mlp_rate.plot", self, ax=ax)
        return self


def _dense_grid(s: int, budget: int) -> np.ndarray:
    per = max(3, int(budget ** (1.0 / s)))
    per += per % 2 == 0  # odd: includes the centre, stays off most knots
    axis = np.linspace(-1, 1, per)
    return np.stack(np.meshgrid(*([axis] * s), indexing="ij"), -1).reshape(-1, s)


def mlp_rate_sweep(cases: Sequence[tuple[float, int]], grids: dict[int, Sequence[int]] | None = None,
                   *, gamma: float = 1.0, eval_points: int = 200_000, n_targets: int = 8, seed: int = 0) -> MLPRate:
    """Sup-error of the simplicial MLP for each ``(β, s)`` over grids N (``grids[s]``).

    The measured error of each grid is the max over ``n_targets`` ridge targets (seeds
    ``seed..seed+n_targets-1``): the rate is a statement about the worst case over the Hölder
    class, and one kink alone oscillates with its position relative to the knots.  The sup is
    taken over a dense grid of ``eval_points`` read-out points through the sorting reference
    :func:`simplicial_interpolate`; the network itself is checked against that reference on 500
    random points per target (``net_vs_reference``, should be ~1e-15).  The fit is over all grids.
    """
    grids = grids or {1: (4, 8, 16, 32, 64, 128), 2: (4, 6, 8, 12, 16, 24), 3: (2, 3, 4, 5, 6)}
    if isinstance(n_targets, bool) or not isinstance(n_targets, int) or n_targets <= 0:
        raise InputError(f"n_targets must be a positive integer, but got n_targets={n_targets!r}")
    rows, fits = [], []
    rng = np.random.default_rng(seed)
    with single_thread():
        for beta, s in cases:
            if s not in grids:
                raise InputError(f"no grids given for s={s}")
            if len(set(grids[s])) < 2:  # a slope through one point (a LinAlgError for N = 1 before stop 36)
                raise InputError(f"the fitted exponent needs at least two distinct grids for s={s}, but got {tuple(grids[s])}")
            if any(isinstance(N, bool) or not isinstance(N, int) or N < 1 for N in grids[s]):
                raise InputError(f"grids must be positive integers, but got {tuple(grids[s])} for s={s}")
            targets = [holder_ridge(tuple(range(s)), beta, seed=seed + k) for k in range(n_targets)]
            U = _dense_grid(s, eval_points)
            d_ms, errs = [], []
            for N in grids[s]:
                err, gap, width, params = 0.0, 0.0, 0, 0
                for target in targets:
                    h = lambda V, t=target: t.h(V / gamma)
                    mlp = simplicial_mlp(h, s, N)
                    hU = h(torch.from_numpy(U)).numpy()
                    err = max(err, float(np.abs(simplicial_interpolate(mlp.node_values, U) - hU).max()))
                    Ur = rng.uniform(-1, 1, (500, s))
                    gap = max(gap, float(np.abs(mlp(torch.from_numpy(Ur)).numpy()
                                                - simplicial_interpolate(mlp.node_values, Ur)).max()))
                    width, params = mlp.width, mlp.n_nonzero_params
                bound = simplicial_error_bound(beta, targets[0].holder_constant, s, N, gamma=gamma)
                rows.append({"beta": beta, "s": s, "grid": N, "d_m": width, "params": params,
                             "measured": err, "bound": bound, "net_vs_reference": gap})
                d_ms.append(width)
                errs.append(err)
            # d_m ∝ (N+1)^s, so at small N the slope in d_m is steeper by (N+1)/N; the slope in the
            # number of cells N^s is the clean comparison with -β/s.
            cells = [N**s for N in grids[s]]
            fits.append({"beta": beta, "s": s, "fitted_exponent": fit_loglog(d_ms, errs),
                         "fitted_exponent_cells": fit_loglog(cells, errs), "theory_exponent": -beta / s})
    return MLPRate(tuple(rows), tuple(fits))
