"""The Transformer covering bound (THEORY F9): per-matrix covers + G.3 coefficients + Lemma G.1.

.. math::

    \\log N_\\infty(\\mathcal G_{TF}, \\varepsilon, mT) \\le \\min_{\\sum_i c_i \\varepsilon_i \\le \\varepsilon}
    \\sum_i \\log N_i(\\varepsilon_i)

Note [why the sum is a cover]: cover the matrices layer by layer, matrix i on the inputs produced
by the already-chosen cover elements of the layers before it (a tree of covers, Edelman et al.
2022 multi-layer argument; BFT 2017 Lemma A.7).  By the perturbation inequality of Lemma G.3
(THEORY F6-F8), ``||g(W) - g(W^)|| <= sum_i c_i eps_i`` on every one of the m*T token positions,
and the tree has ``prod_i N_i`` leaves.  The N_i are uniform over input sets of size mT, which is
where ``log(mT)`` enters.

Note [internal covers]: the tree argument feeds cover *centres* into later layers and applies
Lemma G.3 to them, so every centre must be a member of the class.  F1's volumetric covers are
internal (a maximal eps-separated subset of the class).  Zhang's F2 cover is not, so it is
internalised: replace each centre by a class member within eps of it; every member is then within
2 eps of a chosen one.  The matrix terms therefore pay F2 at scale ``eps_i / 2`` (4x the
``a/eps^2`` constant).

Note [units]: coefficients ``c_i`` are per unit of *spectral* perturbation, ``||dW_i||_2``.  The
data-dependent cover controls ``max_t ||x_t dW_i||_2`` instead; for inputs of radius r_i that
coefficient is ``c_i / r_i`` while the cover's cost scales with ``(r_i ||W_i||_{2,1})^2``; r_i cancels
in the product the allocation uses, so the bound needs only ``c_i`` and the matrix norms.  This
relies on every ``c_i`` having the form (input radius of matrix i) x (downstream factor), which is
how F6-F8 derive them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .._errors import InputError
from .._results import Kind
from ._allocation import (CoverCost, _arrays, _ScalesAt, allocate_mixed, bisect_log_multiplier, fit_to_budget,
                          kkt_split)
from ._matrix_covers import _zhang_log_factor, profile_multiplier

__all__ = ["MatrixTerm", "TermContribution", "TransformerCovering", "transformer_log_covering", "CoveringCurve",
           "NORM_FAMILIES"]

# "l21": norm-based 1/eps^2 covers for matrices (THEORY F2, the seed's G.5 form);
# "spectral": only spectral norms are trusted, so F1 parameter-count covers (THEORY 4.5).
# "best": per matrix, whichever of the two is cheaper at its allocated scale (the class is the
# intersection of both norm balls, so either cover is valid for each matrix).
NORM_FAMILIES = ("l21", "spectral", "best")


@dataclass(frozen=True)
class MatrixTerm:
    """One covered object: a matrix (``x -> x W``) or a vector (a bias) of one layer.

    ``l21`` and ``spectral`` are norms of ``W - M`` (M the reference matrix: 0 or the
    initialisation) and define the class ``{W : norms of W - M <= these}``; ``log_c`` is the log of
    the G.3 coefficient of this object (per unit spectral / l2 perturbation).
    """

    layer: int
    role: str  # e.g. "W_KQ.h3", "W_OV.h3", "W_1", "W_2", "b_1", "b_2", "head.W_0"
    shape: tuple[int, int]  # (rows, cols); a vector is (1, d)
    log_c: float
    l21: float
    spectral: float
    vector: bool = False
    group: str = ""  # "attention" | "ffn" | "head": the eta / eta~ split of Theorem G.5

    @property
    def name(self) -> str:
        return f"layer{self.layer}.{self.role}"


@dataclass(frozen=True)
class TermContribution:
    """How much one matrix adds to ``log N`` at the chosen split."""

    name: str
    layer: int
    role: str
    group: str
    cover: str  # "inverse_square (F2)" | "parametric (F1)"
    log_c: float
    log_eps_i: float
    log_cost: float
    share: float  # cost / total


@dataclass(frozen=True)
class TransformerCovering:
    """``log N_inf(G_TF, eps, n_points)`` with its per-matrix breakdown.

    ``log_log_N`` is ``ln(ln N)``: finite even when ``ln N`` exceeds float64.  ``log_gamma`` is the
    log of F4's gamma over the inverse-square terms (their leading ``gamma^3/eps^2`` form);
    ``log_eta`` / ``log_eta_tilde`` split it into attention and FFN groups (Theorem G.5).
    """

    eps: float
    n_points: int
    family: str
    log_log_N: float
    contributions: tuple[TermContribution, ...]
    log_gamma: float
    log_eta: float
    log_eta_tilde: float
    kind: Kind = Kind.CERTIFIED_UPPER
    assumptions: tuple[str, ...] = field(default_factory=tuple)

    @property
    def log_N(self) -> float:
        """``ln N`` (``inf`` only when it exceeds float64; ``log_log_N`` stays finite)."""
        return math.inf if self.log_log_N > 709.0 else math.exp(self.log_log_N)

    @property
    def log10_log_N(self) -> float:
        return self.log_log_N / math.log(10.0)

    def top(self, k: int = 3) -> list[TermContribution]:
        return sorted(self.contributions, key=lambda t: t.log_cost, reverse=True)[:k]

    def by_layer(self) -> dict[int, float]:
        """Share of ``log N`` per layer."""
        out: dict[int, float] = {}
        for t in self.contributions:
            out[t.layer] = out.get(t.layer, 0.0) + t.share
        return out


def _lse(x: Sequence[float]) -> float:
    arr = np.asarray(list(x), dtype=np.float64)
    if arr.size == 0 or np.max(arr) == -math.inf:
        return -math.inf
    m = float(np.max(arr))
    return m + math.log(float(np.sum(np.exp(arr - m))))


def _lse_up(x: Sequence[float]) -> float:
    """``ln sum_i exp(x_i)`` rounded up: the float sum of k terms errs by < (k + 4) u relative
    (u = 2^-53; exp, log and the additions), so pad by that in the log before one step up."""
    v = _lse(x)
    if not math.isfinite(v):
        return v
    k = len(x)
    return math.nextafter(v + (abs(v) + 1.0) * (k + 4) * 2.3e-16, math.inf)


def _lse_up_rows(X: np.ndarray) -> np.ndarray:
    """:func:`_lse_up` of each row of ``X``, the same floats: numpy's max, exp and sum of a contiguous row (the sum
    over the last axis of a C-ordered array sums each row as the 1-D sum does), ``math.log`` and the pad per row."""
    X = np.ascontiguousarray(X, dtype=np.float64)
    if X.shape[1] == 0:
        return np.full(X.shape[0], -math.inf)
    m = X.max(axis=1)
    plain = np.isfinite(m)
    out = np.empty(X.shape[0], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        sums = np.sum(np.exp(X - np.where(plain, m, 0.0)[:, None]), axis=1)
    k = X.shape[1]
    for i in range(X.shape[0]):
        if not plain[i]:  # -inf (every term dead), or the scalar rule's own handling of +inf / NaN
            out[i] = _lse_up(X[i])
            continue
        v = float(m[i]) + math.log(float(sums[i]))
        out[i] = v if not math.isfinite(v) else math.nextafter(v + (abs(v) + 1.0) * (k + 4) * 2.3e-16, math.inf)
    return out


def _parametric(terms: Sequence[MatrixTerm], family: str) -> list[bool]:
    """Which terms get the F1 (parameter-count) cover under a fixed family."""
    return [t.vector or family == "spectral" for t in terms]


def _costs(terms: Sequence[MatrixTerm], par: Sequence[bool], log_eps_ref: Sequence[float], n_points: int, *,
           slope: bool = False) -> list[CoverCost]:
    """The per-matrix costs for :func:`allocate_mixed`, F2's log factor taken at ``log_eps_ref``;
    with ``slope``, F2's constant also carries the log factor's own slope there (Note [slope of
    the log factor])."""
    # the F2 radius A_c = a(1 + 1/c) at each term's reference scale (the union's own cost does not depend on the
    # split, so the allocation leaves it out; the certified costs of _exact_loglog include it)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_2a = np.log(np.array([max(t.l21, 0.0) for t in terms], dtype=np.float64)) + math.log(2.0)
        le_arr = np.array(log_eps_ref, dtype=np.float64)
        live = np.isfinite(log_2a) & np.isfinite(le_arr)
        cols = np.log(np.array([t.shape[1] for t in terms], dtype=np.float64))
        grow = np.where(live, _f2_profile(np.where(live, log_2a - le_arr, 0.0), cols, n_points)[0], 0.0)
    out = []
    for t, pr, le, g in zip(terms, par, log_eps_ref, grow):
        if pr:
            norm = t.l21 if t.vector else t.spectral  # a vector's l2 norm is stored in both fields
            p = t.shape[0] * t.shape[1]
            out.append(CoverCost(t.log_c, "parametric", p=p,
                                 log_k=math.log(2.0 * norm) if norm > 0 else -math.inf))
        else:
            if t.l21 <= 0:
                out.append(CoverCost(t.log_c, "inverse_square"))
                continue
            # F2 at scale e/2 (Note [internal covers]): A = 144 a^2 ln(2 ceil(8a/e + 2) N + 1), the log
            # factor taken at the reference scale.
            la = math.log(t.l21) + math.log(2.0) + float(g)
            log_A0 = math.log(36.0) + 2.0 * la
            if slope and math.isfinite(le):  # Note [slope of the log factor]: the smooth cost's KKT constant
                x = la - le  # ln u, u = 2a/e
                log_den = float(np.logaddexp(math.log(8.0 * n_points) + x, math.log(4.0 * n_points + 1.0)))
                log_g = math.log(4.0 * n_points) + x - log_den  # ln(g/2)
                log_B = float(np.logaddexp(log_A0, math.log(t.shape[1]) + 2.0 * le)) + log_g
                log_A = float(np.logaddexp(log_A0 + math.log(log_den), log_B))
            else:
                log_A = log_A0 + math.log(_zhang_log_factor(la - le, n_points))
            out.append(CoverCost(t.log_c, "inverse_square", log_A=log_A))
    return out


def _term_arrays(terms: Sequence[MatrixTerm], par_list: Sequence[bool]) -> dict[str, np.ndarray]:
    par = np.array(par_list, dtype=bool)
    norm = np.array([(t.spectral if (pr and not t.vector) else t.l21) for t, pr in zip(terms, par_list)],
                    dtype=np.float64)
    with np.errstate(divide="ignore"):
        return {
            "par": par,
            "log_norm": np.log(norm),
            "log_p": np.log(np.array([t.shape[0] * t.shape[1] for t in terms], dtype=np.float64)),
            "log_cols": np.log(np.array([t.shape[1] for t in terms], dtype=np.float64)),
            "log_c": np.array([t.log_c for t in terms], dtype=np.float64),
        }


def _f2_main(log_A: np.ndarray, log_cols: np.ndarray, n_points: int) -> np.ndarray:
    """``ln((36 A^2 + k) ln(2 ceil(4A + 2) N + 1))`` per term (F2's cost for one column-norm profile), in floats:
    :func:`_exact_loglog` pads the result."""
    log_k = np.logaddexp(math.log(36.0) + 2.0 * log_A, log_cols)
    t = np.logaddexp(math.log(4.0) + log_A, math.log(2.0))
    # Note [ceil of a rounded log]: t carries a few ulps of error (absolute up to ~1e-13 for
    # t ~ 700), so exp(t) may land just below an integer the true 4x + 2 reaches: pad by 1e-12
    # relative before the ceiling (issue 10, defect 6); beyond t = 36, ceil adds < e^-36.
    small = t < 36.0
    pad = 1.0 + 1e-12
    ceil_t = np.where(small, np.log(np.ceil(np.exp(np.minimum(t, 36.0)) * pad)), t * pad + 1e-15)
    factor = np.logaddexp(math.log(2.0) + ceil_t + math.log(n_points), 0.0)
    return log_k + np.log(factor)


def _f2_profile(log_ab: np.ndarray, log_cols: np.ndarray, n_points: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ln(1 + 1/c), ln(k (1 + ln(c + 2))))`` per term at the profile grid's multiplier ``c`` (THEORY F2, matrix
    version; ``profile_multiplier``, the one the exact evaluation takes): the radius ``A_c = a(1 + 1/c)`` and the
    union's cost over ``C(ck + 2k, k)`` column-norm profiles.  One column has no profile: ``(0, -inf)``."""
    c = profile_multiplier(log_ab, n_points, log_cols)
    one = np.isnan(c)
    c = np.where(one, 1.0, c)
    return np.where(one, 0.0, np.log1p(1.0 / c)), np.where(one, -np.inf, log_cols + np.log1p(np.log(c + 2.0)))


def _exact_loglog(ar: dict[str, np.ndarray], log_e: np.ndarray, n_points: int) -> np.ndarray:
    """``ln ln N_i(e_i)`` per term, vectorised: F2 (with its ``+k`` and log factor) or F1.

    F2 at ``e/2`` (Note [internal covers]): ``k(1 + ln(c + 2)) + (144 A_c^2/e^2 + k) ln(2 ceil(8A_c/e + 2) N + 1)``,
    ``A_c = a(1 + 1/c)``, ``c`` the profile grid's multiplier (one column: ``a`` itself, no union);
    F1: ``p ln(1 + 2 r/e)`` (norm r).
    A term with norm 0 or coefficient 0 (or ``e = inf``) costs nothing.
    """
    ln = ar["log_norm"]
    with np.errstate(invalid="ignore", over="ignore"):
        # F1 (parametric), r = norm: p * softplus(ln(2r) - ln e); below z = -30 ln softplus(z) = z - e^z/2 + ... and z
        # bounds it above (log1p(x) <= x): softplus underflowed there (nan for 2r/e below 2^-1074, 0.25 under
        # where it was subnormal; red team of stop 35)
        z = math.log(2.0) + ln - log_e
        par = ar["log_p"] + np.where(z < -30.0, z, np.log(np.logaddexp(0.0, np.maximum(z, -30.0))))
        # F2 (inverse square) at scale e/2: a = norm, with the union over column-norm profiles at the grid
        # multiplier of _f2_profile (THEORY F2, matrix version)
        log_ab = ln + math.log(2.0) - log_e
        log_grow, log_union = _f2_profile(log_ab, ar["log_cols"], n_points)
        inv = np.logaddexp(_f2_main(log_ab + log_grow, ar["log_cols"], n_points), log_union)
    # each entry above carries a few ulps of error; 1e-12 (relative, plus absolute) moves it above
    # the true ln ln N_i (issue 10: rounding goes in the direction of the claim)
    out = np.where(ar["par"], par, inv)
    with np.errstate(invalid="ignore"):  # -inf (a zero norm) + inf: NaN, replaced by "dead" below
        out = out + (np.abs(out) + 1.0) * 1e-12
    dead = (ln == -math.inf) | (ar["log_c"] == -math.inf) | (log_e == math.inf)
    if np.isnan(out[~dead]).any():  # a NaN is only ever a dead term's -inf arithmetic
        raise AssertionError(f"internal error: a live matrix term's covering cost is NaN at log eps_i = {log_e}")
    return np.where(dead, -math.inf, out)


def _allocate(terms: Sequence[MatrixTerm], par: Sequence[bool], eps: float, n_points: int) -> np.ndarray:
    """Lemma G.1's split for fixed cover forms, certified to meet the budget.

    Note [slope of the log factor]: F2's cost ``f(e) = (A0/e^2 + k) L(e)``, ``A0 = 144 a^2``,
    ``L(e) = ln(2 ceil(8a/e + 2) N + 1)``, is not of the form ``A/e^2``.  With the ceiling dropped
    (``L(e) = ln(2(4u + 2)N + 1)``, ``u = 2a/e``: the *smooth cost*) its KKT condition
    ``-e f'(e) = lambda c e`` reads ``2 A_eff / e^2`` with
    ``A_eff = A0 L + (A0 + k e^2) g / 2``, ``g = -e L'(e) = 8N u / (2(4u + 2)N + 1)``.  The first
    pass freezes ``L`` (with its ceiling) at ``e = eps``; later passes give each F2 term ``A_eff``
    at the previous split.  The fixed point is the KKT point of the smooth cost, which for fixed
    forms is convex (a product of positive, decreasing, convex functions), so it is the minimum;
    the passes contract by about 100x each.  Freezing ``L`` alone (two passes, before stop
    36) sat above that minimum where ``N`` or ``u`` is small: 1.2 % on test_covering_min_covers'
    example with ``N = 3``.  The passes run in floats (:func:`kkt_split`); only the final split is
    certified (``allocate_mixed``), so they choose among splits and never decide soundness.
    """
    le = kkt_split(_costs(terms, par, [math.log(eps)] * len(terms), n_points), eps)
    if not all(par):  # F1 costs do not depend on the reference scale
        for _ in range(_SLOPE_PASSES):
            new = kkt_split(_costs(terms, par, le, n_points, slope=True), eps)
            live = np.isfinite(new) & np.isfinite(le)
            done = not live.any() or float(np.max(np.abs(new[live] - le[live]))) < 1e-7
            le = new
            if done:
                break
    return np.array(allocate_mixed(_costs(terms, par, le, n_points, slope=True), eps).log_eps_i)


_SLOPE_PASSES = 8


def _dual_forms(terms: Sequence[MatrixTerm], eps: float, n_points: int,
                log_eps_ref: np.ndarray) -> list[list[bool]]:
    """Forms from Lemma G.1's Lagrangian with the form chosen inside it (Note [min of two covers]).

    For a multiplier ``lambda`` the Lagrangian ``sum_i min_form min_e (f_i(e) + lambda c_i e)``
    separates: each matrix takes its KKT scale under each form and keeps the form whose
    ``f + lambda c e`` is smaller.  ``lambda`` is bisected until the chosen scales meet the budget.
    Unlike the alternation, a matrix may move to a form that is dearer at its *current* scale but
    frees budget for the others.  Costs as :func:`_costs` at ``log_eps_ref`` (with the slope).
    """
    par1, par2 = _parametric(terms, "spectral"), [t.vector for t in terms]
    s1, s2 = (_ScalesAt(_arrays(_costs(terms, p, log_eps_ref, n_points, slope=True))) for p in (par1, par2))
    a1, a2 = _term_arrays(terms, par1), _term_arrays(terms, par2)
    lc = a1["log_c"]
    live = lc > -math.inf
    vec = np.array([t.vector for t in terms])

    def at(log_lam: float) -> tuple[np.ndarray, float]:
        e1, e2 = s1(log_lam), s2(log_lam)
        with np.errstate(invalid="ignore", over="ignore"):
            g1 = np.logaddexp(_exact_loglog(a1, e1, n_points), log_lam + lc + e1)
            g2 = np.logaddexp(_exact_loglog(a2, e2, n_points), log_lam + lc + e2)
        par = vec | ~(g2 < g1)  # NaN (dead terms) keeps F1, which costs them nothing either
        le = np.where(par, e1, e2)
        return par, _lse(lc[live] + le[live]) - math.log(eps)

    sides = [[bool(x) for x in at(v)[0]] for v in reversed(bisect_log_multiplier(lambda v: at(v)[1]))]
    return sides[:1] if sides[0] == sides[1] else sides


def _min_cover_split(terms: Sequence[MatrixTerm], eps: float, n_points: int) -> tuple[list[bool], np.ndarray]:
    """Forms and split for ``min(F1, F2)`` per matrix inside Lemma G.1 (issue 12 item 3).

    Note [min of two covers]: each matrix may use whichever cover is cheaper at its own scale, so
    the objective is ``sum_i min(f1_i(e_i), f2_i(e_i))``; a minimum of convex functions is not
    convex, but for a *fixed* choice of forms it is (``allocate_mixed``).  Alternate: allocate for
    the current forms, then give each matrix the form that is cheaper at its allocated scale;
    neither step increases the total (the re-allocation is optimal for the new forms, whose total
    at the old split is already no larger), so the loop stops.  It runs from all-F1 (the
    ``spectral`` family) and all-F2 (``l21``), so its result is never worse than either family, and
    then from the forms the Lagrangian chooses (:func:`_dual_forms`), which can leave a local
    minimum of the alternation: at stop 35 both starts stopped at all-F1 on two 2-matrix examples
    where F1 + F2 is 1.2 % cheaper.  Still a search, not a proof of optimality over the 2^m forms;
    tested against the exhaustive enumeration on 2-3 matrices (1 100 random cases matched).
    Whatever the search returns, the reported value is the exact per-matrix bound at a split that
    :func:`~transcover.covering._allocation.budget_holds` certified, so it is a valid cover.
    """
    a1 = _term_arrays(terms, _parametric(terms, "spectral"))
    a2 = _term_arrays(terms, _parametric(terms, "l21"))
    best: tuple[float, list[bool], np.ndarray] | None = None
    starts = [_parametric(terms, "l21"), _parametric(terms, "spectral")]
    seen: set[tuple[bool, ...]] = set()
    k = 0
    while k < len(starts):
        par = starts[k]
        while tuple(par) not in seen:
            seen.add(tuple(par))
            le = _allocate(terms, par, eps, n_points)
            f1, f2 = _exact_loglog(a1, le, n_points), _exact_loglog(a2, le, n_points)
            par = [t.vector or bool(x <= y) for t, x, y in zip(terms, f1, f2)]
            total = _lse(np.where(par, f1, f2))
            if best is None or total < best[0]:
                best = (total, list(par), le)
        if k == 1:  # then the Lagrangian's forms, at the split the two families' searches reached
            starts += _dual_forms(terms, eps, n_points, best[2])
        k += 1
    assert best is not None
    return best[1], best[2]


def transformer_log_covering(
    terms: Sequence[MatrixTerm],
    eps: float,
    n_points: int,
    *,
    family: str = "l21",
    assumptions: Sequence[str] = (),
) -> TransformerCovering:
    """Upper bound on ``log N_inf(G_TF, eps, n_points)`` from per-matrix norms and coefficients.

    .. math::

        \\log N_\\infty(\\mathcal G_{TF},\\varepsilon, mT) \\le \\sum_i \\log N_i(\\varepsilon_i),
        \\quad \\sum_i c_i\\varepsilon_i \\le \\varepsilon,
        \\qquad \\approx \\frac{\\gamma^3}{\\varepsilon^2},\\ \\gamma = \\sum_i (a_i c_i^2)^{1/3}

    THEORY F9 (Edelman et al. 2022 multi-layer structure), built from F2 (matrix l_inf cover,
    internalised at scale e/2: ``a_i = 144 ||W_i - M_i||_{2,1}^2 ln(2 ceil(8 a/e + 2) mT + 1)``) or, for ``family="spectral"``,
    F1 (``p_i log(1 + 2||W_i - M_i||_2 / e)``); biases always use F1.  The split ``eps_i`` is
    Lemma G.1's (mixed form: :func:`allocate_mixed`), computed twice so that F2's log factor is
    evaluated at the allocated scales; the reported value is the *exact* per-matrix bound at the
    final split, so it is certified whatever the optimiser did.

    Assumptions: the coefficients satisfy Lemma G.3 for every pair of models in the class (they are
    computed from the class's norm bounds); see Notes [why the sum is a cover] and [units].

    Args:
        terms: the covered matrices and vectors, with log coefficients and norms.
        eps: the covering scale ``> 0`` (in the output metric ``max_t ||.||_2`` over mT tokens).
        n_points: ``m * T``, the number of token positions the cover is uniform over.
        family: ``"l21"`` (default), ``"spectral"`` or ``"best"`` (per matrix the cheaper of F1
            and F2 at its own allocated scale, the split searched as in Note [min of two covers]).
        assumptions: extra lines recorded in the result.

    Raises:
        InputError: bad ``eps``, ``n_points``, ``family``, or no terms.
    """
    if family not in NORM_FAMILIES:
        raise InputError(f"family must be one of {NORM_FAMILIES}, but got family={family!r}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise InputError(f"eps must be a finite number > 0, but got eps={eps!r}")
    if not isinstance(n_points, int) or n_points < 1:
        raise InputError(f"n_points (samples x sequence length) must be a positive integer, but got {n_points!r}")
    if not terms:
        raise InputError("transformer_log_covering needs at least one matrix term")
    for t in terms:
        if not (t.l21 >= 0 and t.spectral >= 0 and not math.isnan(t.log_c)):
            raise InputError(f"{t.name}: norms must be >= 0 and the coefficient defined, "
                             f"but got l21={t.l21}, spectral={t.spectral}, log_c={t.log_c}")
    if family == "best":
        par, log_eps_i = _min_cover_split(terms, eps, n_points)
    else:
        par = _parametric(terms, family)
        log_eps_i = _allocate(terms, par, eps, n_points)
    # log_costs[i] = ln(ln N_i), so total = ln(sum_i ln N_i) = ln ln N.
    log_costs = [float(v) for v in _exact_loglog(_term_arrays(terms, par), log_eps_i, n_points)]
    total = _lse_up(log_costs)  # ln of sum_i ln N_i, each term already rounded up
    contributions = tuple(
        TermContribution(
            name=t.name, layer=t.layer, role=t.role, group=t.group,
            cover="parametric (F1)" if pr else "inverse_square (F2)",
            log_c=t.log_c, log_eps_i=le, log_cost=lc,
            share=0.0 if lc == -math.inf else math.exp(lc - total),
        )
        for t, pr, le, lc in zip(terms, par, map(float, log_eps_i), log_costs)
    )
    # gamma, eta, eta~ of the inverse-square terms: (a_i c_i^2)^{1/3} with a_i at the final split.
    costs = _costs(terms, par, log_eps_i, n_points)
    w = {"attention": [], "ffn": [], "all": []}
    for t, c in zip(terms, costs):
        if c.form == "inverse_square" and c.log_A > -math.inf and c.log_c > -math.inf:
            v = (c.log_A + 2.0 * c.log_c) / 3.0
            w["all"].append(v)
            w.setdefault(t.group, []).append(v)
    base = (f"output metric: max over {n_points} token positions of ||.||_2 (THEORY section 2)",
            f"norm family: {family}",)
    return TransformerCovering(
        eps=float(eps), n_points=n_points, family=family, log_log_N=total,
        contributions=contributions, log_gamma=_lse(w["all"]), log_eta=_lse(w["attention"]),
        log_eta_tilde=_lse(w["ffn"]), assumptions=base + tuple(assumptions),
    )


def _anchor_key(log_eps: float) -> float:
    """The half-decade of ``eps`` whose anchor allocation :class:`CoveringCurve` uses, kept inside float64's range
    (10^key of a scale such as eps / (2C) with a tiny C overflowed: stop 38 red team)."""
    return min(max(round(log_eps / math.log(10.0) * 2.0) / 2.0, -300.0), 300.0)


class CoveringCurve:
    """``eps -> ln ln N(eps)`` for many ``eps`` and sample sizes, fast and still certified.

    Note [fixed splits]: any split with ``sum_i c_i eps_i <= eps`` gives a valid cover, so the
    fractions ``w_i = eps_i / eps`` of an allocation made at one anchor scale stay valid at every
    ``eps`` (scaled with it).  The curve computes Lemma G.1's allocation once per half-decade of
    ``eps`` (cached) and evaluates the exact per-matrix bounds with those fractions: one vectorised
    pass per call, which is what Dudley's integral and sample-size searches need.
    """

    def __init__(self, terms: Sequence[MatrixTerm], *, family: str = "l21", anchor_n_points: int = 10**6):
        if family not in NORM_FAMILIES:
            raise InputError(f"family must be one of {NORM_FAMILIES}, but got family={family!r}")
        if not terms:
            raise InputError("a covering curve needs at least one matrix term")
        self.terms = tuple(terms)
        self.family = family
        self._anchor_n = anchor_n_points
        self._anchors: dict[float, tuple[np.ndarray, dict[str, np.ndarray]]] = {}

    def _anchor(self, log_eps: float) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        # the anchor only picks the split (any split inside the certified budget is valid)
        key = _anchor_key(log_eps)
        if key not in self._anchors:
            eps_anchor = 10.0 ** key
            cov = transformer_log_covering(self.terms, eps_anchor, self._anchor_n, family=self.family)
            par = [c.cover.startswith("parametric") for c in cov.contributions]
            fractions = np.array([t.log_eps_i for t in cov.contributions]) - math.log(eps_anchor)
            # Note [fixed splits]: certify sum_i c_i w_i <= 1 - 1e-12 for the rounded fractions, which
            # leaves room for the rounding of log(eps) + log w_i in __call__ (see there)
            log_c = [t.log_c for t in self.terms]
            fractions = fit_to_budget(log_c, fractions, 1.0 - 1e-12)
            self._anchors[key] = (fractions, _term_arrays(self.terms, par))
        return self._anchors[key]

    def __call__(self, eps: float, n_points: int) -> float:
        """``ln ln N(eps)`` on ``n_points`` token positions (a certified upper bound)."""
        log_eps = math.log(eps)
        fractions, ar = self._anchor(log_eps)
        # fl(log eps) errs by < 1 ulp and the sum by < 1/2 ulp: a pad of 1e-15 (|x| + 1) keeps every
        # exp(log_eps_i) <= eps w_i (1 + 1e-13), inside the 1e-12 margin of the anchor's certificate
        le = log_eps + fractions
        with np.errstate(invalid="ignore"):  # a dead term's -inf fraction: NaN here, "dead" in _exact_loglog
            le = le - (np.abs(le) + 1.0) * 1e-15
        return _lse_up(_exact_loglog(ar, le, n_points))

    def many(self, eps: np.ndarray, n_points: int) -> np.ndarray:
        """``[self(e, n_points) for e in eps]``, the same floats, for a whole grid of scales at once.

        Note [curve on a grid]: Dudley's quadrature and every sample-size search evaluate the curve on
        hundreds of scales, each call a handful of numpy operations on arrays of one entry per matrix:
        the calls' overhead was most of the suite's covering time.  Here the scales sharing an anchor
        are one ``(scales, terms)`` array through :func:`_exact_loglog`, whose operations are all
        elementwise (a row gets the very operations the single call gives its vector), and each row
        is summed by :func:`_lse_up` as in ``__call__``; ``log eps`` by ``math.log``, as there.
        """
        eps = np.asarray(eps, dtype=np.float64).reshape(-1)
        log_eps = np.array([math.log(float(e)) for e in eps], dtype=np.float64)
        out = np.empty(eps.shape, dtype=np.float64)
        groups: dict[float, list[int]] = {}
        for i, le in enumerate(log_eps):
            groups.setdefault(_anchor_key(float(le)), []).append(i)
        for idx in groups.values():
            fractions, ar = self._anchor(float(log_eps[idx[0]]))
            le = log_eps[idx][:, None] + fractions[None, :]
            with np.errstate(invalid="ignore"):  # as in __call__
                le = le - (np.abs(le) + 1.0) * 1e-15
            out[idx] = _lse_up_rows(_exact_loglog(ar, le, n_points))
        return out
