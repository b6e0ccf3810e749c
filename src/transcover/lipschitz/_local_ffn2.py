"""The FFN's second-order term at the data point, one certified tensor norm per token (issue 12; THEORY F38).

F31d bounds the FFN Jacobian's change on ``||dh|| <= r`` unit by unit, every unit at its own worst move
``||w1_k|| r`` at once; one ``dh`` cannot align with all ``d_ff`` rows.  Here the change is split at the
centre into its exact first-order part ``W_2^T diag(sigma''(z) (W_1^T dh)) W_1^T``, bounded by one certified
spectral norm ``N2 = ||W_2^T D K||`` per token (``D = diag(sigma''(z))``, ``K`` the ``d_ff x d^2`` matrix with rows
``w1_k (x) w1_k``), and a third-order remainder bounded by two radius-free Hadamard Grams of the layer.
Row convention of the code: ``F(h) = sigma(h W_1 + b_1) W_2``, ``w1_k = W_1[:, k]``, ``w2_k = W_2[k]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..model import Activation
from ._local_jacobian import (
    GELU2_ABS_ERR, GELU3_SUP, _f64, certified_lmax, certified_spectral, gelu2_sup, gelu_second, pow2_norm,
)
from ._local_sharp import gram_lower

__all__ = ["gelu3_sup", "ffn_curvature_drift", "ffn_hadamard", "ffn_second_norms", "ffn_second_norms_flat", "ffn_second_split",
           "ffn_split_constants", "ffn_taylor_drift", "forms_in_range", "split_row_norm2"]

_U = 2.0**-53
# the extrema of GELU''' = z phi(z) (z^2 - 4): GELU'''' = phi(z)(-z^4 + 7 z^2 - 4) vanishes at z^2 = (7 -+ sqrt 33)/2
_GELU3_CRIT = (math.sqrt((7 - math.sqrt(33)) / 2), math.sqrt((7 + math.sqrt(33)) / 2))
_GELU2_ABS_ERR = GELU2_ABS_ERR  # |GELU''| as float64 evaluates it, absolute error
# F45a: the leading eigenvectors of H kept exactly in the cheap upper tier of N2 (cost ~ (m + d)/(d_ff + d) of N2's)
SPLIT_RANK = 256
SPLIT_RANK2 = 128  # and of W_2 W_2^T (rank d) for ||D W_2||


def _gelu3(z: Tensor) -> Tensor:
    return z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi) * (z * z - 4)


def gelu3_sup(a: Tensor, b: Tensor) -> Tensor:
    """sup of ``|GELU'''|`` on each interval ``[a, b]`` (THEORY F38a): ``GELU''' = z phi(z)(z^2 - 4)`` is monotone
    between the zeros ``+-0.7923, +-2.5243`` of ``GELU''''``, so the sup is the largest of the endpoint values and
    of the extrema inside (0.7788 at ``+-0.7923``, 0.0989 at ``+-2.5243``).  Padded: a relative ``1e-12`` and an
    absolute ``1e-14`` for the float64 evaluation (the cancellation in ``z^2 - 4`` near 2 is absolute)."""
    out = torch.maximum(_gelu3(a).abs(), _gelu3(b).abs())
    for c in _GELU3_CRIT:
        val = abs(float(_gelu3(torch.tensor(c, dtype=torch.float64))))
        inside = ((a <= c) & (b >= c)) | ((a <= -c) & (b >= -c))
        out = torch.where(inside, torch.maximum(out, torch.full_like(out, val)), out)
    return out * (1 + 1e-12) + 1e-14


def _gram_err(W: Tensor, V: Tensor) -> float:
    """Frobenius bound on the float64 rounding of ``(W^T W) o (V^T V)`` (W (d, n), V (m, n)): each Gram entry is
    within ``gamma_{d}`` of its sum of ``|terms|``, whose matrices have Frobenius norms at most ``||W||_F^2``,
    ``||V||_F^2``; the Hadamard product adds one rounding: ``4 (max(d, m) + 8) u ||W||_F^2 ||V||_F^2``."""
    return 4 * (max(W.shape[0], V.shape[0]) + 8) * _U * float((W * W).sum()) * float((V * V).sum())


def _in_range(W: Tensor) -> bool:
    """Whether ``W``'s largest ``|entry|`` is 0 or in [2^-100, 2^100]: then its Grams and their Hadamard products
    (degree 4 in the weights) stay far from float64's underflow and overflow, where the pads (relative to the
    Frobenius mass) hold."""
    m = float(W.abs().max()) if W.numel() else 0.0
    return m == 0.0 or 2.0**-100 <= m <= 2.0**100


def forms_in_range(const: dict, Q: Tensor) -> Tensor:
    """(...,) whether the forms ``G = W_1^T Q W_1`` of an ellipsoid ``Q`` (..., d, d) and their Hadamard products (degree
    4 in ``W_1``, 2 in ``Q``) stay in float64's normal range, where their pads (relative to the Frobenius masses) hold
    (red24-1, THEORY F75): the layer's weights in ``_in_range`` (``ffn_hadamard``'s ``eH`` finite) and ``Q`` 0 or
    ``max|Q| max|W_1|^2`` (the scale of ``G``) in [2^-200, 2^200]; nan or inf entries fail."""
    m = Q.abs().amax(dim=(-2, -1))
    s = m * float(const["W1"].abs().max()) ** 2
    return ((m == 0) | ((s >= 2.0**-200) & (s <= 2.0**200))) & math.isfinite(const["eH"])


def ffn_hadamard(ffn, *, centred: bool) -> dict:  # noqa: ANN001
    r"""Radius-free constants of one FFN for F38 (once per layer): ``H = (W_1^T W_1) o (W_1^T W_1)`` (``K K^T``) as
    formed and ``eH`` (a Frobenius bound on its rounding), certified ``lH >= lambda_max(H) = ||K||^2`` and ``l12 >=
    lambda_max((W_1^T W_1) o (W_2 W_2^T))``, ``W2`` the output weights (rows ``P w2_k`` when ``centred``, the map a
    following LayerNorm sees) and ``nW2 >= ||W_2||`` (``||P W_2^T|| <= ||W_2||``).  Weights outside ``_in_range``
    get infinite pads ``eH``, ``e12``: every F38/F45/F51a bound on them is then inf (a branch refused; F17c's
    ``kappa`` carries the FFN drift).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    W1, W2o = _f64(ffn.W_1), _f64(ffn.W_2)
    W2 = W2o - W2o.mean(dim=1, keepdim=True) if centred else W2o
    G1 = W1.T @ W1
    H = G1 * G1
    eH = _gram_err(W1, W1)
    # the centring's rounding: within 4 (d + 2) u ||W_2||_F^2 (Frobenius) on W_2 W_2^T, times max|G1| <= ||W_1||_F^2
    e12 = _gram_err(W1, W2.T) + (8 * W2.shape[1] * _U * float((W1 * W1).sum()) * float((W2o * W2o).sum())
                                 if centred else 0.0)
    H12 = G1 * (W2 @ W2.T)
    if not (_in_range(W1) and _in_range(W2o)):  # Grams near underflow: the relative pads do not hold, refuse F38/F51a
        eH = e12 = math.inf
    lams = certified_lmax(torch.stack([H, H12]))
    # the centred rows as formed are within 2 (d + 2) u ||W_2||_F (Frobenius) of the exact ones
    eW2 = 4 * (W2.shape[1] + 2) * _U * float(pow2_norm(W2o)) if centred else 0.0
    return {"H": H, "eH": eH, "lH": float(lams[0]) + eH, "H12": H12, "e12": e12, "l12": float(lams[1]) + e12, "W1": W1,
            "W2": W2, "eW2": eW2, "nW2": float(certified_spectral(W2o[None])[0]) * (1 + 1e-12),
            "nW1": float(certified_spectral(W1[None])[0]) * (1 + 1e-12)}


def ffn_second_norms(const: dict, z: Tensor, ez: Tensor | None = None) -> Tensor:
    r"""(T,) certified ``N2_i >= ||W_2^T D_i K||_2 = lambda_max(W_2^T D_i H D_i W_2)^{1/2}``, ``D_i = diag(GELU''(z_i))``
    signed, at the centre (THEORY F38b).  Rounding: ``A = D W_2`` as formed is within ``u|A|``, the two products add
    ``gamma_{d_ff}`` each of the ``|terms|`` (``||A||_F^2 ||H||_F``), ``H``'s own error ``eH`` enters as ``||A||_F^2 eH``;
    ``GELU''`` as evaluated is within ``_GELU2_ABS_ERR`` per unit of its exact value, which moves the norm by at most
    that times ``||W_2|| ||K||``, and the centred ``W_2`` as formed within ``eW2`` moves it by ``eW2 sup|GELU''| ||K||``;
    ``z`` within ``ez`` of the exact pre-activation (``pre_activations``; None: exact) adds ``GELU3_SUP max_k ez_k`` to
    ``GELU''``'s error (F51a).  Cost ``d d_ff^2`` flops a token."""
    n2 = _form_norm(gelu_second(z), const["W2"], const["H"], const["eH"]) + _n2_pert(const, ez)
    return torch.nan_to_num(n2 * (1 + 1e-12), nan=math.inf)


def ffn_second_norms_flat(const: dict, z: Tensor, ez: Tensor | None = None) -> Tensor:
    r"""(T,) certified ``N2e_i >= ||W_1 D_i Phi||_2 = lambda_max(W_1 D_i H_12 D_i W_1^T)^{1/2}``, ``Phi Phi^T = H_12 =
    (W_1^T W_1) o (W_2 W_2^T)`` (``ffn_hadamard``'s ``H12``, ``W_2`` as there), ``D_i = diag(GELU''(z_i))`` at the centre
    (THEORY F90): the same trilinear form ``T(v, e, u) = sum_k GELU''_k (w2_k . v)(w1_k . e)(w1_k . u)`` as F38b's
    ``N2`` flattened the other way (``e`` against ``v (x) u`` instead of ``v`` against ``e (x) u``), so
    ``sup_{|v| = |e| = |u| = 1} T <= min(N2, N2e)``: a bound for rank-one arguments only (``e u^T``, ``e e^T``), not
    for F38b's every unit-Frobenius ``X``.  Rounding as ``ffn_second_norms`` with ``H_12``'s ``e12``; ``GELU''``'s
    evaluation error (``centre_gelu2_err``, per token its largest unit) moves the norm by at most that times ``||W_1||
    ||Phi||``.  Cost ``d d_ff^2`` flops a token."""
    pert = _gelu2_err_max(ez) * const["nW1"] * math.sqrt(const["l12"]) * (1 + 1e-12)
    n2 = _form_norm(gelu_second(z), const["W1"].T, const["H12"], const["e12"]) + pert
    return torch.nan_to_num(n2 * (1 + 1e-12), nan=math.inf)


def _form_norm(D: Tensor, W: Tensor, H: Tensor, eH: float) -> Tensor:
    r"""(T,) certified ``lambda_max(A_i^T H A_i)^{1/2}`` for ``A_i = diag(D_i) W`` (``W`` (d_ff, d), ``H`` (d_ff, d_ff) as
    formed within ``eH``, Frobenius), the shared step of F38b's ``N2`` and F90's ``N2e``: ``A`` as formed is within
    ``u|A|``, the two products add ``gamma_{d_ff}`` each of the ``|terms|``, so ``||A||_F^2 (eH + 4 (d_ff + 4) u
    ||H||_F)`` is added to the certified ``lambda_max``.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    A = D[:, :, None] * W[None]
    S = A.transpose(1, 2) @ (H[None] @ A)
    fA = (A * A).sum(dim=(1, 2)) * (1 + 4 * W.numel() * _U)
    err = fA * (eH + 4 * (H.shape[0] + 4) * _U * float(pow2_norm(H)) * (1 + 1e-12))
    return torch.sqrt(certified_lmax(S) + err)


def _gelu2_err_max(ez: Tensor | None) -> Tensor | float:
    """Per token the largest unit's ``centre_gelu2_err`` (a float when ``ez`` is None)."""
    e2 = centre_gelu2_err(ez)
    return e2 if ez is None else e2.amax(dim=1)


def centre_gelu2_err(ez: Tensor | None) -> Tensor | float:
    """Per unit, ``|GELU''(z*) - fl(GELU''(z))|`` for the exact pre-activation ``z*`` within ``ez`` of ``z``
    (``pre_activations``; None: ``z`` exact): the evaluation's ``GELU2_ABS_ERR`` plus ``GELU3_SUP ez`` (F51a)."""
    return _GELU2_ABS_ERR if ez is None else _GELU2_ABS_ERR + GELU3_SUP * ez * (1 + 1e-12)


def _n2_pert(const: dict, ez: Tensor | None = None) -> Tensor | float:
    """What the evaluation of ``GELU''`` (at the exact centre: ``centre_gelu2_err``, per token its largest unit) and
    the centred ``W_2`` as formed can move ``||W_2^T D K||`` by (F38b)."""
    e2 = _gelu2_err_max(ez)
    return (e2 * const["nW2"] + const["eW2"] * 2 / math.sqrt(2 * math.pi)) * math.sqrt(const["lH"])


def _split_top(G: Tensor, rank: int, lam1: float, E: Tensor | None = None) -> tuple[Tensor, float]:
    r"""(``E``, ``lR``) for a symmetric PSD ``G`` as formed (n x n): ``E = Lambda_m^{1/2} U_m^T`` (m x n) from the top
    ``m = rank`` eigenpairs ``eigh`` returns, or the given ``E`` (nothing relies on their accuracy: any ``E`` is
    valid) and a certified
    ``lR >= lambda_max(G - E^T E)``: the formed rest plus ``tau = 1e-9 lam1`` is checked positive definite by one
    Cholesky (then ``certified_lmax``'s trace fallback is sound for it), and the rounding of ``E^T E`` and of the
    subtraction, ``4 (m + 8) u (||E||_F^2 + ||G||_F)`` (Frobenius, Higham 3.5), is added.  A failed check gives
    ``lR = inf``.  THEORY F45a.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    if E is None:
        ev, U = torch.linalg.eigh(G)
        E = (U[:, -rank:] * ev[-rank:].clamp(min=0.0).sqrt()[None, :]).T.contiguous()
    R = G - E.T @ E
    R.diagonal().add_(1e-9 * lam1)
    if int(torch.linalg.cholesky_ex(R)[1]) != 0:
        return E, math.inf
    return E, float(certified_lmax(R[None])[0]) + 4 * (rank + 8) * _U * (float((E * E).sum()) + float(pow2_norm(G)))


def ffn_split_constants(const: dict, rank: int = SPLIT_RANK, rank2: int = SPLIT_RANK2) -> dict:
    """Data-free constants of F45a's cheap tier of N2 (once per layer, from ``ffn_hadamard``'s ``const``): the
    split ``H = E^T E + R`` (``R <= lR I``) of rank ``rank`` and ``W_2 W_2^T = F^T F + R_2`` (``R_2 <= lR2 I``) of
    rank ``rank2`` (``_split_top``), with ``||E||_F^2`` (``fE``).  THEORY F45a."""
    W2 = const["W2"]
    E, lR = _split_top(const["H"], rank, const["lH"])
    # W_2 W_2^T has rank d: its top eigenvectors are W_2 v for the top ones of the d x d W_2^T W_2 (F = (W_2 V_m)^T)
    V = torch.linalg.eigh(W2.T @ W2)[1][:, -rank2:]
    F, lR2 = _split_top(W2 @ W2.T, rank2, const["nW2"] ** 2, E=(W2 @ V).T.contiguous())
    # W_2 W_2^T as formed is within 4 (d + 8) u ||W_2||_F^2 of the exact Gram of the W_2 used below
    return {"E": E, "fE": float((E * E).sum()), "lR": lR, "F": F,
            "lR2": lR2 + 4 * (W2.shape[1] + 8) * _U * float((W2 * W2).sum())}


def _norm_from_gram(X: Tensor, fX: Tensor | None = None) -> Tensor:
    """(n,) certified ``||X_k||_2`` of the formed (n, a, b) batch from its row Gram (``a <= b``): ``certified_lmax``
    of ``fl(X X^T)`` plus its rounding ``4 (b + 8) u ||X||_F^2`` (Frobenius).  ``fX``: the caller's ``fl(sum X^2)``,
    ``(X * X).sum(dim=(1, 2))`` (the same floats), else formed here."""
    fX = (X * X).sum(dim=(1, 2)) if fX is None else fX
    return torch.sqrt(certified_lmax(X @ X.transpose(1, 2)) + 4 * (X.shape[2] + 8) * _U * fX * (1 + 1e-12))


def ffn_second_split(const: dict, split: dict, z: Tensor, ez: Tensor | None = None) -> Tensor:
    r"""(T,) a certified upper bound on F38b's ``N2_i = ||W_2^T D_i K||`` at a fifth of its cost (THEORY F45a): with
    ``a = D W_2`` (exact product of the evaluated ``GELU''``), ``H = E^T E + R``, ``R <= lR I`` and the formed ``H``
    within ``eH`` of the exact one,

    .. math:: N2^2 = \lambda_{\max}(a^\top H a) \le \|E a\|^2 + (l_R + e_H)\,\|a\|^2,\qquad
              \|a\|^2 = \lambda_{\max}(D W_2 W_2^\top D) \le \|F D\|^2 + l_{R2} \max_k \delta_k^2,

    ``||E a||`` from the m x m Gram of ``C = fl(E A)`` (``A = fl(D W_2)``, within ``u|A|`` of ``a``; ``C`` within
    ``gamma_{d_ff} ||E||_F ||A||_F`` of ``E A``) and ``||F D||`` from the m2 x m2 Gram of ``fl(F D)`` (within ``u``
    relative): ``m d_ff d + (m^2 + m2^2) (d + d_ff)`` flops a token instead of ``d d_ff^2``.  ``GELU''``'s evaluation
    and the centred ``W_2`` as F38b, the pre-activations' rounding ``ez`` too.  Never below the true ``N2``; 1.2-2.5 x it
    on MiniLM."""
    E, lR, lR2 = split["E"], split["lR"], split["lR2"]
    if not (math.isfinite(lR) and math.isfinite(lR2)):
        return torch.full(z.shape[:1], math.inf, dtype=torch.float64)
    D = gelu_second(z)
    A = D[:, :, None] * const["W2"][None]
    fA = (A * A).sum(dim=(1, 2)) * (1 + 1e-12)
    dff = A.shape[1]
    nEa = _norm_from_gram(E[None] @ A) + 4 * (dff + 8) * _U * torch.sqrt(split["fE"] * fA)
    na2 = split_row_norm2(split, D)
    n2 = torch.sqrt((nEa * nEa + (lR + const["eH"]) * na2) * (1 + 1e-12)) + _n2_pert(const, ez)
    return torch.nan_to_num(n2 * (1 + 1e-12), nan=math.inf)


def split_row_norm2(split: dict, a: Tensor) -> Tensor:
    """(n,) certified ``||diag(a_i) W_2||^2`` for the rows ``W_2`` as formed and weights ``a`` (n, d_ff) by F45a's split
    ``W_2 W_2^T = F^T F + R_2``, ``R_2 <= lR2 I``: ``||F diag(a)||^2 + lR2 max a^2``, ``||F diag(a)||`` from the ``m2 x m2``
    Gram of ``fl(F diag(a))`` (within ``u`` relative); ``m2^2 d_ff`` flops a row instead of ``d^2 d_ff``."""
    Fa = split["F"][None] * a[:, None, :]
    fFa = (Fa * Fa).sum(dim=(1, 2))
    nFa = _norm_from_gram(Fa, fFa) * (1 + 4 * _U) + 4 * _U * fFa.sqrt()
    return (nFa * nFa + split["lR2"] * (a * a).amax(dim=1)) * (1 + 1e-12)


def ffn_taylor_drift(const: dict, n2: Tensor, z: Tensor, n1: Tensor, rh: Tensor,
                     ez: Tensor | None = None) -> tuple[Tensor, Tensor]:
    r"""Per token, on ``||dh|| <= rh``: ``sup ||P(F'(h + dh) - F'(h))||`` and its mean over the segment,
    ``int_0^1 sup_{||dh|| <= t rh} ||.|| dt`` (THEORY F38c):

    .. math:: \Delta F \le N2\,r_h + \tfrac12 s_3\,\lambda_{\max}(H_{12})^{1/2}\lambda_{\max}(H)^{1/2} r_h^2,\qquad
              \overline{\Delta F} \le N2\,r_h/2 + \tfrac16 s_3\,\lambda_{\max}(H_{12})^{1/2}\lambda_{\max}(H)^{1/2} r_h^2

    with ``s3 = max_k sup |GELU'''|`` on ``[z_k - ||w1_k|| rh, z_k + ||w1_k|| rh]`` (a smaller ball's is smaller).
    ``z`` (T, d_ff) the centre's preactivations, within ``ez`` of the exact ones (``pre_activations``; None: exact),
    which widens each interval by ``ez_k``; ``n1`` (d_ff,) the ``||w1_k||``, ``n2`` from ``ffn_second_norms`` (with
    the same ``ez``).  Assumptions: non-gated FFN with the exact (erf) GELU (else ``inf``)."""
    h = _reach(n1, rh, ez)
    s3 = gelu3_sup(z - h, z + h).amax(dim=1)
    c3 = 0.5 * s3 * math.sqrt(const["l12"] * const["lH"]) * (1 + 1e-12)
    r2 = rh * rh * (1 + 1e-12)
    full = (n2 * rh + c3 * r2) * (1 + 1e-12)
    half = (n2 * rh / 2 + c3 * r2 / 3) * (1 + 1e-12)
    return torch.nan_to_num(full, nan=math.inf), torch.nan_to_num(half, nan=math.inf)


# F51a: tokens per batch of the per-unit-weighted Hadamard Grams (each d_ff x d_ff, 19 MB at d_ff = 1536)
CURV_CHUNK = 4
# F61a: power steps of ``_lmax_lower`` and ``gram_lower`` in the test that spares F51a's certificates where they lose
# (MiniLM layers 0-1: each factor within 3 % of its certificate at 16 steps but one weighted norm at 6 %; 1 % at 32)
LMAX_LOWER_ITERS = 16


def _weighted_lmax(G: Tensor, eG: float, a: Tensor, lower: bool = False) -> Tensor:
    """(n,) certified ``lambda_max(diag(a_i) G_exact diag(a_i))`` for the formed ``G`` within ``eG`` (Frobenius) of
    ``G_exact`` and the weights ``a`` (n, m) (F51a): the formed ``fl(a_k G_kl a_l)``, symmetrised, is within
    ``3u|a_k G_kl a_l|`` of ``diag(a) G diag(a)`` entrywise, ``diag(a)(G - G_exact)diag(a)`` within ``max a^2 eG``.
    ``lower``: instead a lower bound on that value as computed (``_lmax_lower`` in place of ``certified_lmax``, the
    same float operations after it, each non-decreasing in its operands; THEORY F61a).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    amax2 = (a * a).amax(dim=1)
    if lower:
        lam = _lmax_lower(G, a)
    else:
        lam = certified_lmax(_weighted_sym(G, a))
    return lam + amax2 * (eG + 4 * _U * float(pow2_norm(G))) * (1 + 1e-12)


# rows of ``_weighted_sym``'s blocks: a block row and column of ``M`` stay in cache while they are summed
SYM_BLOCK = 32


def _weighted_sym(G: Tensor, a: Tensor) -> Tensor:
    """(n, m, m) ``fl(fl(M^T + M) / 2)`` for ``M = fl(fl(a_k G_kl) a_l)`` (``_weighted_lmax``'s matrix),
    ``SYM_BLOCK`` rows at a time: each block row of ``M`` and the block column it is summed with are formed by the same
    two products per entry, so the floats are those of forming ``M`` whole (F74), without the whole ``M``, its
    transposed copy and their passes over memory (2.7x faster at ``m = 1536``; THEORY F74d)."""
    n, m = a.shape
    S = torch.empty(n, m, m, dtype=torch.promote_types(a.dtype, G.dtype))
    for i in range(0, m, SYM_BLOCK):
        j = slice(i, min(i + SYM_BLOCK, m))
        rows = a[:, j, None] * G[None, j, :]  # M[:, j, :]
        rows.mul_(a[:, None, :])
        cols = a[:, :, None] * G[None, :, j]  # M[:, :, j]
        cols.mul_(a[:, None, j])
        torch.add(cols.transpose(1, 2), rows, out=S[:, j, :])
        S[:, j, :].mul_(0.5)
    return S


def _weighted_norm(W: Tensor, a: Tensor, lower: bool = False) -> Tensor:
    """(n,) certified ``||W diag(a_i)||`` for the exact ``W`` (d, m) and weights ``a`` (n, m), ``d <= m`` (F51a):
    ``fl(W diag(a))`` is within ``u|.|`` of the exact product, its norm from its d x d Gram (``_norm_from_gram``).
    ``lower``: a lower bound on that value as computed, the Gram's certified ``lambda_max`` replaced by ``gram_lower``
    of ``W diag(a^2) W^T`` (never formed; THEORY F61a)."""
    C = W[None] * a[:, None, :]
    fC = (C * C).sum(dim=(1, 2))
    if lower:
        nC = torch.sqrt(gram_lower(W, a * a, iters=LMAX_LOWER_ITERS) + 4 * (C.shape[2] + 8) * _U * fC * (1 + 1e-12))
    else:
        nC = _norm_from_gram(C, fC)
    return (nC + _U * fC.sqrt()) * (1 + 1e-12)


def _lmax_lower(G: Tensor, a: Tensor, iters: int = LMAX_LOWER_ITERS) -> Tensor:
    r"""(n,) a lower bound on what ``certified_lmax`` returns for ``M_i``, the formed ``fl(a_ik G_kl a_il)``
    symmetrised (``_weighted_lmax``), for a symmetric (m, m) ``G`` with a non-negative diagonal and weights ``a >= 0``
    (n, m) (THEORY F61a); ``M_i`` is never formed.  That certificate is ``min(mu (1 + 2(m+1)m u), fl(tr M_i))`` with
    ``mu`` passed by a Cholesky test (so ``>= lambda_max(M_i)``) or ``fl(tr M_i)`` alone, hence
    ``>= min(lambda_max(M_i), fl(tr M_i))``.  ``M_i`` is within ``3u |a_k G_kl a_l|`` (entrywise, ``<= 3u max a^2
    ||G||_F`` spectral) of ``A G A`` (``A = diag(a_i)``), whose Rayleigh quotient at the ``iters``-th power iterate
    ``v`` (from the normalised all-ones vector; ``u = a o v``, ``u^T G u`` by one product ``fl(G u)``, ``fl(v.v)``) is
    computed within ``2 gamma_m |u|^T|G||u| <= 2 gamma_m max a^2 ||G||_F ||v||^2`` and ``1e-10`` relative (the
    quotient), so

    .. math:: \lambda_{\max}(M_i) \ge \widehat{\mathrm{RQ}}\,(1 - 10^{-10}) - 12(m + 8)\,u\,\max_k a_k^2\,\|G\|_F;

    the trace as formed ``fl(a_k G_kk a_k)`` summed, less ``1e-10`` relative (non-negative terms: within ``gamma_m``
    of any other summation order's); clamped at 0 (``lambda_max(M_i) >= max_k (M_i)_kk >= 0``).  NaN where a
    weight is not finite (no comparison passes).  Cost ``2 m^2`` flops a step and token, batched over the tokens.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    n, m = a.shape
    v = torch.full((n, m), 1.0 / math.sqrt(m), dtype=a.dtype)
    for _ in range(iters):
        v = ((a * v) @ G) * a
        v = v / v.norm(dim=1, keepdim=True).clamp(min=1e-300)
    u = a * v
    vv = (v * v).sum(dim=1)  # 0 only for all-zero weights (then M_i = 0)
    rq = (u * (u @ G)).sum(dim=1) / torch.where(vv > 0, vv, 1.0)
    tr = (a * G.diagonal()[None, :] * a).sum(dim=1) * (1 - 1e-10)
    amax2 = (a * a).amax(dim=1)
    low = torch.minimum(rq * (1 - 1e-10) - 12 * (m + 8) * _U * amax2 * float(pow2_norm(G)) * (1 + 1e-9), tr)
    return torch.where(torch.isnan(low), low, low.clamp_min(0.0))


def _reach(n1: Tensor, rh: Tensor, ez: Tensor | None) -> Tensor:
    """(T, d_ff) half-widths ``||w1_k|| rh_t (1 + 10^-12) + ez_tk`` of the per-unit intervals around the computed
    ``z`` that hold the exact centre's ``[z*_k +- ||w1_k|| rh_t]`` (``ez`` from ``pre_activations``, THEORY F51a)."""
    h = n1[None, :] * rh[:, None] * (1 + 1e-12)
    return h if ez is None else h + ez


def ffn_curvature_drift(const: dict, z: Tensor, n1: Tensor, rh: Tensor, ez: Tensor | None = None,
                        above: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    r"""Per token, on ``||dh|| <= rh``: ``sup ||P(F'(h + dh) - F'(h))||`` and its segment mean (THEORY F51a): unit k's
    slope moves by ``|sigma'(z_k + s_k) - sigma'(z_k)| <= A_k |s_k|``, ``s_k = w1_k . dh``, ``A_k = sup |GELU''|`` on
    its reachable interval ``[z_k - ||w1_k|| rh, z_k + ||w1_k|| rh]`` (``gelu2_sup``), and with weights ``a_k^2 >= A_k``
    Cauchy-Schwarz over k pairs one ``|s_k|`` with either factor:

    .. math:: \Delta F \le \kappa_A r_h,\quad \kappa_A = \min\big(\|\mathrm{diag}(a)K\|\,\|\mathrm{diag}(a)PW_2\|,              \|\mathrm{diag}(a)K_{12}\|\,\|W_1\mathrm{diag}(a)\|\big),\qquad \overline{\Delta F} \le \kappa_A r_h/2

    (``K``'s rows ``w1_k (x) w1_k``, Gram ``H``; ``K_12``'s ``w1_k (x) P w2_k``, Gram ``H_12``; a smaller ball's
    intervals are nested, so its ``A`` is smaller and the mean halves).  F17c's ``kappa`` is this with every ``A_k``
    at ``sup|GELU''|``; saturated units (the heavy directions of ``H`` on MiniLM) get their own small curvature.
    ``z`` (T, d_ff) the centre's pre-activations, within ``ez`` of the exact ones (``pre_activations``; None: exact:
    each interval widened by ``ez_k``, red17-2), ``n1`` (d_ff,) the ``||w1_k||``, ``const`` ``ffn_hadamard``'s.
    Cost: two certified ``lambda_max`` of d_ff x d_ff matrices a token.  Exact (erf) GELU only.  ``above``: (T,) bounds
    ``(b, b_half)`` the caller takes the minimum with; a token whose bound is provably at least ``b`` and its half at
    least ``b_half`` (``_kappa_a``'s lower bound, THEORY F61a) gets ``(inf, inf)`` without the certificates: every
    ``min`` with the caller's bounds is the same float; the other tokens certify each branch of ``kappa_A`` only where
    it can be the minimum (``_kappa_lazy``, THEORY F74a; on MiniLM one ``lambda_max`` a token), the same floats."""
    h = _reach(n1, rh, ez)
    a = torch.sqrt(gelu2_sup(z - h, z + h)) * (1 + 1e-12)
    kap = torch.zeros(len(rh), dtype=torch.float64)
    skip = torch.zeros(len(rh), dtype=torch.bool)
    lows = None
    if above is not None:  # F61a: the certificates only where they can win
        lows = torch.stack([_kappa_branch(const, a, b, lower=True) for b in (0, 1)])  # no d_ff x d_ff batch
        low = torch.minimum(lows[0], lows[1]) * rh * (1 + 1e-12) * (1 - 1e-12)
        skip = torch.isfinite(low) & (low >= above[0]) & (low / 2 >= above[1])  # then min(above, .) is above
    form = (~skip).nonzero()[:, 0]
    kap[form] = _kappa_lazy(const, a[form], None if lows is None else lows[:, form])
    full = kap * rh * (1 + 1e-12)
    full, half = torch.nan_to_num(full, nan=math.inf), torch.nan_to_num(full / 2, nan=math.inf)
    full[skip], half[skip] = math.inf, math.inf
    return full, half


def _kappa_a(const: dict, a: Tensor, lower: bool = False) -> Tensor:
    """(n,) F51a's ``kappa_A`` for the weights ``a`` (n, d_ff) (``ffn_curvature_drift``), the smaller of its two
    branches (``_kappa_branch``); ``lower``: a lower bound on it as computed (THEORY F61a)."""
    return torch.minimum(_kappa_branch(const, a, 0, lower), _kappa_branch(const, a, 1, lower))


def _kappa_branch(const: dict, a: Tensor, branch: int, lower: bool = False) -> Tensor:
    """(n,) one branch of F51a's ``kappa_A``: 0 ``||diag(a)K|| ||diag(a)PW_2||``, 1 ``||diag(a)K_12|| ||W_1 diag(a)||``;
    ``lower``: a lower bound on it as computed (each factor's, ``_weighted_lmax``/``_weighted_norm``; the same float
    operations after them, THEORY F61a)."""
    if branch == 0:
        nK = torch.sqrt(_weighted_lmax(const["H"], const["eH"], a, lower))
        return nK * (_weighted_norm(const["W2"].T, a, lower) + a.amax(dim=1) * const["eW2"])
    return torch.sqrt(_weighted_lmax(const["H12"], const["e12"], a, lower)) * _weighted_norm(const["W1"], a, lower)


def _kappa_lazy(const: dict, a: Tensor, lows: Tensor | None) -> Tensor:
    """(n,) ``_kappa_a``'s floats, each branch certified (in batches of ``CURV_CHUNK`` tokens) only where it can be
    the minimum (THEORY F74a): with ``lows`` (2, n), lower bounds on the branches as computed (``_kappa_branch(...,
    lower=True)``), a token's branch of the smaller lower bound first, then the other only unless its lower bound is at
    least the first's value (then the other's value is too, and ``min(inf, v) = v`` is the minimum of the two; a NaN
    passes no comparison: both are certified).  ``lows`` None: both branches everywhere."""
    n = a.shape[0]
    val = torch.full((2, n), math.inf, dtype=torch.float64)
    first = torch.zeros(n, dtype=torch.long) if lows is None else (lows[1] <= lows[0]).long()
    other, tok = 1 - first, torch.arange(n)
    for b in (0, 1):
        _certify_branch(const, a, b, (first == b).nonzero()[:, 0], val)
    need = torch.ones(n, dtype=torch.bool) if lows is None else ~(lows[other, tok] >= val[first, tok])
    for b in (0, 1):
        _certify_branch(const, a, b, ((other == b) & need).nonzero()[:, 0], val)
    return torch.minimum(val[0], val[1])


def _certify_branch(const: dict, a: Tensor, branch: int, idx: Tensor, val: Tensor) -> None:
    """``val[branch, idx]`` = ``_kappa_branch``'s certified values of the tokens ``idx``, ``CURV_CHUNK`` at a time."""
    for s in range(0, len(idx), CURV_CHUNK):
        val[branch, idx[s:s + CURV_CHUNK]] = _kappa_branch(const, a[idx[s:s + CURV_CHUNK]], branch)


def gelu_ffn(ffn) -> bool:  # noqa: ANN001
    """Whether F38 applies: the exact (erf) GELU (``gelu3_sup`` is its third derivative)."""
    return Activation(ffn.activation) is Activation.GELU
