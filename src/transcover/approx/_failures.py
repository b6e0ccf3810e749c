"""When the assumptions of Lemma H.1 fail (seed section 7.2), measured one at a time.

* **Weak dependence outside I**: ``g_ε(Z) = h(z_I) + ε · mean_{j∉I} z_j``.  A construction for h
  cannot see the extra term, so ``sup|F - g_ε| >= ε - sup|F - h|`` and ``<= budget + ε``: the error
  floor grows linearly in ε whatever the width or temperature.
* **Δ → 1/2**: at fixed R the lemma's attention bound ``2γ n e^{-R(1-2Δ)}`` tends to ``2γ n``
  (vacuous).  With content cross-terms of size ``RΔ/2`` (``key_leak = Δ/2``, the lemma's worst
  case) the measured read-out error follows it up; without them (λ = 0) the gap is ``R(1-Δ)``.
* **Shifted test distribution**: contents ``z ~ U[-(1+τ), 1+τ]`` instead of ``U[-1, 1]``: the
  read-out leaves the MLP's interpolation box for the construction, and a trained model
  extrapolates; both errors grow with τ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._errors import InputError
from ._construction import Construction, build_construction
from ._decomposition import attention_candidates
from ._encodings import equiangular_encoding
from ._targets import SparseTarget, holder_ridge
from ._threads import single_thread

__all__ = ["FailureCurve", "weak_dependence_curve", "delta_to_half_curve", "shift_curve"]


@dataclass(frozen=True)
class FailureCurve:
    """One failure mode: rows of measured errors and bounds against the knob ``x``."""

    name: str
    x_label: str
    rows: tuple[dict[str, float], ...]

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "x_label": self.x_label, "rows": list(self.rows)}

    def plot(self, ax=None):
        """every column except ``x`` against x (bounds dashed, measured solid), on ``ax`` (the current
        axes by default; :class:`transcover.report.FailureCurveDisplay`); returns ``self``."""
        from .._views import render

        render("failure_curve.plot", self, ax=ax)
        return self

def _check_knobs(values: Sequence[float], what: str) -> None:
    """InputError unless every value is a finite number >= 0 (a NaN passed ``v < 0`` and gave NaN rows)."""
    for v in values:
        try:
            ok = 0.0 <= float(v) < math.inf
        except (TypeError, ValueError):
            ok = False
        if not ok or isinstance(v, bool):
            raise InputError(f"{what} must be finite numbers >= 0, but got {list(values)}")


def _default_construction(n: int = 12, s: int = 2, R: float = 20.0, grid: int = 8, delta: float = 0.2,
                          key_leak: float = 0.0) -> Construction:
    target = holder_ridge(tuple(range(1, 1 + 2 * s, 2)), 1.0, seed=0)
    return build_construction(target, equiangular_encoding(n, delta), R=R, grid=grid, key_leak=key_leak)


def weak_dependence_curve(epsilons: Sequence[float], construction: Construction | None = None, *,
                          n_random: int = 500) -> FailureCurve:
    """sup over inputs of ``|F - g_ε|`` for a construction built for ``h`` (see module docstring)."""
    _check_knobs(epsilons, "dependence strengths")
    c = construction or _default_construction()
    I = list(c.target.indices)
    out = [j for j in range(c.n) if j not in I]
    budget = c.bound().total.value
    cand = attention_candidates(c.n, c.target.indices, n_random, seed=1)
    rows = []
    with single_thread(), torch.no_grad():
        F = c(cand)
        base = c.target(cand)
        extra = cand[:, out].mean(dim=1) if out else torch.zeros(cand.shape[0], dtype=torch.float64)
        for eps in epsilons:
            err = float((F - (base + eps * extra)).abs().max())
            rows.append({"x": float(eps), "measured |F - g_eps|": err, "bound (budget + eps)": budget + eps})
    return FailureCurve("weak dependence outside I", "ε (weight of the tokens outside I)", tuple(rows))


def delta_to_half_curve(deltas: Sequence[float], *, n: int = 16, R: float = 10.0, gamma: float = 1.0
                        ) -> FailureCurve:
    """sup read-out error at fixed (n, R) as Δ → 1/2, with and without the lemma's cross-terms."""
    for d in deltas:
        if not (0.0 <= d < 0.5):
            raise InputError(f"delta must be in [0, 1/2), but got delta={d!r}")
    target = holder_ridge((n // 2,), 1.0, seed=0)
    cand = attention_candidates(n, target.indices, 64, seed=0)
    rows = []
    with single_thread(), torch.no_grad():
        for d in deltas:
            row = {"x": float(d)}
            for lam, tag in ((d / 2, "λ=Δ/2"), (0.0, "λ=0")):
                c = build_construction(target, equiangular_encoding(n, d), R=R, grid=1, gamma=gamma, key_leak=lam)
                row[f"measured {tag}"] = float((c.readout(cand) - c.ideal_readout(cand)).abs().max())
            row["lemma bound 2γ n e^{-R(1-2Δ)}"] = 2 * gamma * n * math.exp(-R * (1 - 2 * d))
            rows.append(row)
    return FailureCurve(f"Δ → 1/2 (n={n}, R={R:g})", "coherence Δ of the positional encodings", tuple(rows))


def shift_curve(taus: Sequence[float], construction: Construction | None = None, *, trained=None,
                trained_target: SparseTarget | None = None, margin_gamma: float | None = None,
                n_samples: int = 2000, seed: int = 0) -> FailureCurve:
    """Errors under ``z ~ U[-(1+τ), 1+τ]``: construction sup-error and, if given, a trained model's.

    With ``γ = 1`` the read-out fills the MLP's interpolation box and any shift leaves it (the hats
    of the boundary nodes fall off with slope 1/δ); ``margin_gamma = γ' < 1`` adds the same
    construction with read-out γ', which tolerates shifts up to ``1/γ' - 1`` at the price of the
    ``(2/γ')^β`` factor of the MLP error (seed section 4.2).
    """
    _check_knobs(taus, "shifts")
    c = construction or _default_construction()
    budget = c.bound().total.value
    cm = None
    if margin_gamma is not None:
        cm = build_construction(c.target, c.encoding, R=c.R, grid=c.mlp.N, gamma=margin_gamma, key_leak=c.key_leak,
                                norm=c.model.cfg.norm)
    g = torch.Generator().manual_seed(seed)
    rows = []
    with single_thread(), torch.no_grad():
        for tau in taus:
            Z = (torch.rand(n_samples, c.n, generator=g, dtype=torch.float64) * 2 - 1) * (1 + tau)
            row = {"x": float(tau), "construction sup |F - g*|": float((c(Z) - c.target(Z)).abs().max()),
                   "bound on [-1,1]^n (budget)": budget}
            if cm is not None:
                row[f"construction γ={cm.gamma:g} sup |F - g*|"] = float((cm(Z) - cm.target(Z)).abs().max())
            if trained is not None and trained_target is not None:
                T = trained.cfg.max_len
                Zt = (torch.rand(n_samples, T, generator=g) * 2 - 1) * (1 + tau)
                pred = trained(Zt[..., None])[:, 0]
                row["trained RMSE"] = float((pred - trained_target(Zt)).pow(2).mean().sqrt())
                row["trained sup"] = float((pred - trained_target(Zt)).abs().max())
            rows.append(row)
    return FailureCurve("shifted test distribution z ~ U[-(1+τ), 1+τ]", "shift τ", tuple(rows))
