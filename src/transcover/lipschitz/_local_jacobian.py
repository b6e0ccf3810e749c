"""A layer's exact Jacobian at the data and its certified drift over a ball (issue 12; THEORY F17).

Note [exact layer Jacobian].  Column convention, one layer, tokens ``i`` (output) and ``j``
(input).  Per head ``h`` (weights in the spec's row convention): ``P`` the softmax matrix,
``xbar_i = sum_j P_ij x_j``, ``y_ij = x_j - xbar_i``, ``q_i = scale W_K W~_Q^T x~_i`` (the
gradient of ``s_ij`` in ``x_j``), ``G = scale W_Q W_K^T`` (``ds_ij/dx_i = G x_j`` up to a constant
that the softmax drops), ``W_OV = W_V W_O``.  The attention Jacobian is

    A_ij = sum_h W_OV^T [ P_ij (I + y_ij q_i^T) + delta_ij Sigma_i G^T ],
    Sigma_i = sum_k P_ik y_ik y_ik^T

(``sum_k P_ik y_ik = 0`` removes every term constant in ``k``).  Post-LN: ``J_ij = M_i (delta_ij I
+ A_ij)`` with ``M_i = D2_i (I + F_i) D1_i``; pre-LN: ``J_ij = M_i (delta_ij I + A_ij(Y) D1_j)``
with ``M_i = I + F_i D2_i`` and ``Y`` the normalised input; ``F_i = W_2^T diag(sigma'(z_i)) W_1^T``,
``D`` the normalisations' Jacobians.  The blocks are built from ``C_i^h = M_i W_OV^hT`` (the heads
combined through ``W_O`` inside every block, never summed as norms) and the certified (2,inf) norm
at X is ``max_i sum_j ||J_ij||_2`` (triangle inequality over the input tokens, each ``||dx_j|| <= 1``),
each ``||J_ij||_2`` from the float64 Gram eigenvalues, padded (``_sym_top``).

Note [Jacobian drift].  For ``X'`` in ``B(X, r)`` (every token moved by ``<= r``) the row operator
``nu_i(J) = sup_{||v_j|| <= 1} ||sum_j J_ij v_j||`` obeys ``nu_i(J') <= nu_i(J) + nu_i(J' - J)``,
and ``J' - J = (M'_i - M_i)(E_i + A'_i) + M_i (A'_i - A_i)`` (post-LN).  Bounds, per token:

* LayerNorm/RMSNorm: ``||dD|| <= 2 max|gamma| ||dx|| / (sqrt(d) s^2)`` along any direction (with
  ``u = P x/(sqrt(d) s)``, ``ds = u.(P dx)/sqrt(d)``, ``du = (I - u u^T) P dx/(sqrt(d) s)``:
  ``||dD|| <= max|gamma| ||dx|| |u| (3 - |u|^2)/(sqrt(d) s^2)`` and ``|u| <= 1``); integrated over the
  segment with the certified floor ``s >= s_floor`` (Note [local norm floor]).
* FFN: ``|sigma'(z') - sigma'(z)| <= sup|sigma''| |z' - z|`` and ``|z'_k - z_k| <= ||W_1[:, k]|| r_h``,
  so ``||F' - F|| <= sup|sigma''| r_h ||diag(n)^{1/2} W_2|| ||W_1 diag(n)^{1/2}||``, ``n_k = ||W_1[:, k]||``
  (``||A^T diag(c) B|| <= ||diag(c)^{1/2} A|| ||diag(c)^{1/2} B||`` for ``c >= 0``; signs of the
  difference only shrink it).
* softmax: the shifted score change is ``e_i^T G y_ij + q_i^T e_j + e_i^T G e_j``, at most
  ``Delta_ij = r (||G y_ij|| + ||q_i|| + ||G|| r)``; hence ``|P'_ij - P_ij| <= P_ij (exp(Delta_ij +
  max_k Delta_ik) - 1) =: P_ij eps_ij``.  With ``m_i = r + sum_j P_ij eps_ij ||y_ij||`` (the weighted
  mean's move), ``||y'_ij - y_ij|| <= r + m_i`` and ``||q'_i - q_i|| <= ||G|| r``, each head's inner
  operator ``Q_ij = P_ij (I + y_ij q_i^T) + delta_ij Sigma_i G^T`` moves in ``nu_i`` by at most
  ``sum_j P eps + sum_j [P eps ||y'|| ||q'|| + P ||dy|| ||q'|| + P ||y|| ||dq||] + ||G|| ||dSigma_i||``,
  ``||dSigma_i|| <= sum_j [P eps ||y'||^2 + P (||y'|| + ||y||) ||dy||]``.
* heads: ``nu_i(M_i (A' - A)) <= min(sum_h ||M_i W_OV^hT|| dQ_h, ||M_i W_O^T|| (sum_h ||W_V^h||^2 dQ_h^2)^{1/2})``.

Every bound is ``sup`` over the whole ball (the radii at the inner stages come from certified
local constants), so ``max_i (sum_j ||J_ij|| + drift_i)`` bounds the Jacobian's (2,inf) norm at every
point of the convex ball: a Lipschitz constant on it (mean-value theorem).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .._errors import InputError
from ..model import Activation, LayerSpec, NormKind, NormSpec, Placement, attention_forward, ffn_forward
from ._local_attention import certified_weights, check_head_scales
from ._rounding import _gamma, pow2_exponent, pow2_norm, product_row_error, product_row_norms, root_sq_plus
from ._weights import ROUNDING_PAD, spectral, spectral_product

__all__ = ["LayerJacobian", "layer_jacobian", "layer_jacobians", "certified_spectral", "gelu2_sup", "row_norm_lower", "gelu_second_sup",
           "pre_activations", "point_slope_err"]

GRAM_PAD = 1e-9
# float64 evaluation of the blocks: each entry is a sum of at most K products; |error| <= K u
# sum|terms|, and the spectral error <= Frobenius error <= K u ||A||_F ||B||_F per product.  The
# pad below is that bound with K <= 4 (d + d_ff + H d_head + T) and a factor 4 for the chained
# products, applied to the Frobenius norms of the factors (Higham, Accuracy and Stability, 3.5).
_U = 2.0**-53


def _f64(W) -> Tensor:  # noqa: ANN001
    return torch.as_tensor(W, dtype=torch.float64).detach()


def _sym_top(B: Tensor) -> Tensor:
    """Certified largest singular value of each (n, m, k) matrix (``certified_spectral`` on the
    smaller side)."""
    return certified_spectral(B if B.shape[-1] <= B.shape[-2] else B.transpose(-1, -2))


# relative rungs above the candidate when the first (residual-based) Cholesky test fails
_LADDER = (1e-6, 1e-4, 1e-3, 1e-2, 5e-2, 0.25, 1.0)
# block Krylov candidate (Note [certified lambda_max]): blocks of this many vectors, this many steps
KRYLOV_BLOCK = 4
KRYLOV_STEPS = 8


def certified_spectral(B: Tensor, *, iters: int = 12) -> Tensor:
    """Certified upper bounds on ``||B_k||_2`` for a batch (n, m, d) (Note [certified lambda_max]).

    ``lambda_max`` of the Gram of the smaller side (``B^T B`` or ``B B^T``, the same top
    eigenvalue), certified by ``certified_lmax``; the Gram's own rounding, ``<= k u ||B||_F^2`` for
    inner products of length ``k <= 10^6``, is covered by ``GRAM_PAD`` of the Frobenius mass.
    ``iters`` is kept for callers of the older power-iteration version and ignored.  Each matrix is first scaled by a
    power of two to a largest entry in [1/2, 1) (exact; undone at the end): its Gram then neither underflows (a 1e-170
    matrix had the Gram 0, hence the bound 0) nor overflows; what underflows in it is below ``2^-1074`` per product, far
    inside ``GRAM_PAD`` of a Frobenius mass of at least 1/4."""
    top = B.abs().amax(dim=(1, 2)) if B.numel() else B.new_zeros(B.shape[0])
    ex = pow2_exponent(top)
    B = torch.ldexp(B, -ex[:, None, None])
    G = B.transpose(1, 2) @ B if B.shape[-1] <= B.shape[-2] else B @ B.transpose(1, 2)
    fro2 = G.diagonal(dim1=1, dim2=2).sum(-1)
    return torch.ldexp(torch.sqrt(certified_lmax(G) + GRAM_PAD * fro2) * (1 + GRAM_PAD), ex)


def certified_lmax(G: Tensor, *, iters: int = 12, start: Tensor | None = None) -> Tensor:
    """Certified upper bounds on ``lambda_max`` of a batch of symmetric PSD (n, d, d) matrices, as
    evaluated (Note [certified lambda_max]): a Lanczos candidate, then Cholesky tests; trace
    fallback.  ``start`` (n, d): optional warm-start vectors; ``iters`` is ignored (kept for callers)."""
    return certified_lmax_vec(G, start=start)[0]


def _candidate(G: Tensor, start: Tensor | None, steps: int, rounds: int = 3) -> tuple[Tensor, Tensor, Tensor]:
    """(theta, res, x): the top Ritz value, a residual-based pad and the Ritz vector per matrix.
    Small matrices: eigh; larger: a block Krylov space of ``steps`` blocks of ``KRYLOV_BLOCK``
    vectors (full reorthogonalisation) from ``start`` (default a fixed vector) and fixed random
    vectors, Rayleigh-Ritz with the stored products ``G Q``; the matrices whose Ritz residual is
    above ``1e-9 theta`` restart from their top Ritz block, up to ``rounds`` times.  Only a
    candidate: nothing here is certified, the Cholesky test is."""
    n, _, d = G.shape
    if d <= 64:
        ev, V = torch.linalg.eigh(G)
        return ev[:, -1].clamp(min=0.0), torch.zeros(n, dtype=G.dtype), V[:, :, -1]
    b = KRYLOV_BLOCK
    V = torch.randn(d, b, generator=torch.Generator().manual_seed(0), dtype=G.dtype).expand(n, d, b).clone()
    V[:, :, 0] = (torch.ones(n, d, dtype=G.dtype) / math.sqrt(d) + 1e-3 * torch.arange(d, dtype=G.dtype) / d
                  if start is None else start)
    th = torch.zeros(n, dtype=G.dtype)
    pad = torch.zeros(n, dtype=G.dtype)
    x = torch.zeros(n, d, dtype=G.dtype)
    idx = torch.arange(n)
    for _ in range(rounds):
        Gi = G if idx.numel() == n else G[idx]
        t, p, Vb = _block_krylov(Gi, V, steps)
        th[idx], pad[idx], x[idx] = t, p, Vb[:, :, -1]
        more = p > 1e-9 * t
        if not bool(more.any()):
            break
        idx, V = idx[more], Vb[more]
    return th, pad, x


def _block_krylov(G: Tensor, V: Tensor, steps: int) -> tuple[Tensor, Tensor, Tensor]:
    """One block-Krylov Rayleigh-Ritz pass: (theta, pad, top Ritz block (n, d, b), largest last)."""
    V, _ = torch.linalg.qr(V)
    Qs, Ws = [], []
    for j in range(steps):
        W = G @ V
        Qs.append(V)
        Ws.append(W)
        if j == steps - 1:
            break
        Q = torch.cat(Qs, dim=2)
        before = W.norm(dim=(1, 2))
        for _ in range(2):  # full reorthogonalisation, twice
            W = W - Q @ (Q.transpose(1, 2) @ W)
        V, R = torch.linalg.qr(W)
        # breakdown (G of rank below the space's width): a column of W left with only rounding noise after the
        # reorthogonalisation (a small pivot of R) becomes, scaled up by QR, a unit column that is not orthogonal to
        # Q, and the Ritz values could exceed lambda_max (rank 5 at d = 150: a candidate 4.9x lambda_max, failing
        # every rung, so the result was the trace).  Those blocks are made orthogonal to Q once more (F32 item 1);
        # the others keep their floats.
        low = (R.diagonal(dim1=1, dim2=2).abs() <= 1e-8 * before[:, None]).any(dim=1)
        if bool(low.any()):
            Vl, Ql = V[low], Q[low]
            for _ in range(2):
                Vl = Vl - Ql @ (Ql.transpose(1, 2) @ Vl)
            V[low] = torch.linalg.qr(Vl)[0]
    Q, W = torch.cat(Qs, dim=2), torch.cat(Ws, dim=2)
    Hm = Q.transpose(1, 2) @ W
    th, Y = torch.linalg.eigh(torch.nan_to_num(0.5 * (Hm + Hm.transpose(1, 2))))
    y = Y[:, :, -1:]
    x = Q @ y
    res = (W @ y - th[:, -1, None, None] * x).norm(dim=(1, 2))
    gap = (th[:, -1] - th[:, -2]).clamp(min=1e-300)
    top = Q @ Y[:, :, -V.shape[2]:]
    return th[:, -1].clamp(min=0.0), torch.minimum(res, 4 * res * res / gap), top


def certified_lmax_vec(G: Tensor, *, start: Tensor | None = None, steps: int = KRYLOV_STEPS) -> tuple[Tensor, Tensor]:
    r"""(certified ``lambda_max`` (n,), candidate top eigenvectors (n, d)) of a batch of symmetric
    PSD matrices as evaluated (Note [certified lambda_max]).

    .. math:: \lambda_{\max}(G) \le \mu\,(1 + 2(d+1)d\,u)\ \text{ when Cholesky of } \mu I - G \text{ succeeds}

    Source: THEORY F32.  Candidate ``mu`` from the Ritz value ``theta`` and residual ``res``:
    ``theta (1 + 1e-9) + res``, then ``theta (1 + delta)`` up the ladder; an element no rung
    certifies gets its trace (PSD), and every result is at most the trace, padded ``1 + 4 d u`` for its sum.
    Assumptions: ``G`` symmetric PSD as stored (the trace is no bound on an indefinite matrix; callers that form a
    Gram pad for its rounding, e.g. ``GRAM_PAD``)."""
    n, _, d = G.shape
    fro2 = G.diagonal(dim1=1, dim2=2).sum(-1)
    out = torch.full_like(fro2, math.inf)
    if n == 0:
        return out, torch.zeros(0, d, dtype=G.dtype)
    fin = torch.isfinite(G.sum(dim=(1, 2)))  # one reduction, no (n, d, d) mask; an overflow counts as inf
    if not bool(fin.all()):
        lam, x = certified_lmax_vec(G[fin], start=None if start is None else start[fin], steps=steps)
        out[fin] = lam
        xs = torch.zeros(n, d, dtype=G.dtype)
        xs[fin] = x
        return out, xs
    lam, res, x = _candidate(G, start, steps)
    # the trace bounds lambda_max of a PSD matrix; its float sum of d non-negative terms is padded for its rounding
    # (unpadded it was 1.45 ulp under lambda_max of an exactly rank-one Gram: the red team of stop 35)
    fro2 = fro2 * (1 + 4 * d * _U)
    out = fro2.clone()
    todo = torch.ones(n, dtype=torch.bool)
    for k, delta in enumerate((1e-9,) + _LADDER):
        idx = todo.nonzero()[:, 0]
        if idx.numel() == 0:
            break
        mu = lam[idx] * (1 + delta) + (torch.minimum(res[idx], 1e-6 * lam[idx]) if k == 0 else 0.0) + 1e-300
        A = -(G if idx.numel() == n else G[idx])
        A.diagonal(dim1=1, dim2=2).add_(mu[:, None])
        _, info = torch.linalg.cholesky_ex(A)
        ok = info == 0
        out[idx[ok]] = torch.minimum(mu[ok] * (1 + 2 * (d + 1) * d * _U), fro2[idx[ok]])
        todo[idx[ok]] = False
    return out, x


def sphere_ascent(step, z: Tensor, steps: int, tol: float) -> Tensor:  # noqa: ANN001
    """The normalised ascent ``z <- zn / ||zn||`` of a convex ``phi`` on the sphere (THEORY F67a), ``step(z) -> (zn,
    phi(z))`` batched over the leading dimensions: at most ``steps`` steps, stopped where ``zn`` is not finite or zero, or
    once no batch element's ``phi`` rises by more than ``tol`` (relative; ``-inf``: every step).  Only chooses weights
    (F92, F93, F95): nothing certified depends on where it stops."""
    phi = torch.zeros(z.shape[:-1], dtype=z.dtype)
    for _ in range(steps):
        zn, val = step(z)
        nz = zn.norm(dim=-1, keepdim=True)
        if not bool(torch.isfinite(zn).all()) or bool((nz == 0).any()):
            break
        z, phi0, phi = zn / nz, phi, val
        if bool((phi - phi0 <= tol * phi).all()):
            break
    return z


# |GELU''(z)| as float64 evaluates it is within this (absolute) of the exact value at the same z (near the zeros
# +-sqrt 2 the rounding of ``2 - z^2`` is absolute: ~1e-16); it also covers ``gelu2_sup``'s rounded interval ends
GELU2_ABS_ERR = 1e-13


def gelu_second(z: Tensor) -> Tensor:
    """``GELU''(z) = phi(z)(2 - z^2)`` (exact-erf GELU ``z Phi(z)``) as float64 evaluates it; F38 and F40 bound
    the evaluation's error by ``GELU2_ABS_ERR``."""
    return torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi) * (2 - z * z)


def gelu2_sup(a: Tensor, b: Tensor) -> Tensor:
    """sup of ``|GELU''|`` on each interval ``[a, b]``: ``GELU'' = phi(z)(2 - z^2)`` has its extrema at
    ``z = 0`` (``2 phi(0)``) and ``z = +-2`` (``2 phi(2)``) and is monotone in between, so the sup is
    the largest of the endpoint values and of the extrema inside, padded for float64 rounding: ``1e-12`` relative
    and ``GELU2_ABS_ERR`` absolute (red17: near ``z = sqrt 2`` the evaluation's error is absolute, and with a
    relative pad alone the sup at ``z = 1.4142135623730956`` was 1.15x below the exact ``|GELU''(z)|``; the ends
    ``fl(z +- h)`` may lie inside the exact interval by half an ulp, which moves ``|GELU''|`` by ``0.78`` times that)."""
    out = torch.maximum(gelu_second(a).abs(), gelu_second(b).abs())
    zero = (a <= 0) & (b >= 0)
    two = ((a <= 2) & (b >= 2)) | ((a <= -2) & (b >= -2))
    out = torch.where(zero, torch.full_like(out, 2 / math.sqrt(2 * math.pi)), out)
    out = torch.where(two, torch.maximum(out, torch.full_like(out, 2 * math.exp(-2) / math.sqrt(2 * math.pi))), out)
    return out * (1 + 1e-12) + GELU2_ABS_ERR


# sup|GELU'''| = 0.77883 at z = +-0.7923 (F38a), rounded up: GELU'' moves by at most this per unit of z
GELU3_SUP = 0.7789


def pre_activations(ffn, H: Tensor) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    """(``z``, ``ez``): the FFN's pre-activations ``z = fl(H W_1 + b_1)`` (T, d_ff) float64 at the float64 ``H`` and
    ``ez >= |z - (H W_1 + b_1)|`` per unit against the exact value (THEORY F51a, red17-2): an inner product of
    length d and one addition, so ``gamma_{d+2}(|H| |W_1| + |b_1|)`` (the non-negative sum formed ``(1 + 10^-9)`` high
    covers its own rounding), plus ``(d + 1) 2^-1074`` for products below the normal range.  Every per-unit interval
    ``[z_k +- h_k]`` the local bounds take is widened by ``ez_k``, and every value used at the centre pays for it
    (``point_slope_err``, ``GELU3_SUP``)."""
    return affine_with_error(_f64(ffn.W_1), None if ffn.b_1 is None else _f64(ffn.b_1), H)


def affine_with_error(W: Tensor, b: Tensor | None, H: Tensor) -> tuple[Tensor, Tensor]:
    """(``z``, ``ez``): ``z = fl(H W + b)`` for float64 ``W`` (d, m), ``b`` (m,) or None, and ``ez >= |z - (H W + b)|``
    entrywise, ``gamma_{d+2}(|H| |W| + |b|)`` formed ``(1 + 10^-9)`` high plus ``(d + 1) 2^-1074`` (``pre_activations``;
    the gated FFN's two projections, THEORY F107)."""
    b = torch.zeros(W.shape[1], dtype=torch.float64) if b is None else b
    d = W.shape[0]
    g = (d + 2) * _U / (1 - (d + 2) * _U)
    ez = (H.abs() @ W.abs() + b.abs()) * (g * (1 + 1e-9)) + (d + 1) * 2.0**-1074
    return H @ W + b, ez


def point_slope_err(act, z: Tensor, ez: Tensor) -> Tensor:  # noqa: ANN001
    """(T,) ``max_k |sigma'(z*_k) - sigma'(z_k)|`` over ``|z*_k - z_k| <= ez_k`` (the slope at the centre against the
    exact pre-activation's, ``pre_activations``), so ``||F* - F|| <= ||W_1|| ||W_2||`` times it (spectral norms: the
    Frobenius ones cost MiniLM's point 1e-5 relative through ``_sandwich``'s pads): GELU ``max_k ez_k sup|GELU''|``
    on ``[z_k +- ez_k]`` (``gelu2_sup``), other activations ``sup|sigma''| max_k ez_k``; one without a bounded
    ``sigma''`` (ReLU) its slope range ``2 Lip`` where some ``|z_k| <= ez_k`` (its kink within reach), else 0."""
    from ._activations import activation_lipschitz
    from ._local import second_derivative_sup

    if Activation(act) is Activation.GELU:
        return (gelu2_sup(z - ez, z + ez) * ez).amax(dim=1) * (1 + 1e-12)
    s2 = second_derivative_sup(act)
    if math.isfinite(s2):
        return s2 * ez.amax(dim=1) * (1 + 1e-12)
    near = (z.abs() <= ez).any(dim=1)
    return torch.where(near, 2 * activation_lipschitz(act), 0.0).double()


def gelu_second_sup() -> float:
    """sup|GELU''| = 2 phi(0) = 2/sqrt(2 pi): GELU'' = phi(z)(2 - z^2), extrema at z = 0, +-2."""
    return 2.0 / math.sqrt(2.0 * math.pi) * (1 + ROUNDING_PAD)


def centre_tokens(X: Tensor, lay: bool) -> tuple[Tensor, Tensor, Tensor]:
    r"""(``Z``, ``sigma``, ``sigma_low``) per token of the float64 (T, d) ``X``: the centred rows (LayerNorm,
    ``lay``; RMSNorm: ``X`` itself), ``||Z||/sqrt(d)`` as computed and a certified lower bound on the exact
    ``||P x||/sqrt(d)`` of the same floats (Note [local norm floor]; THEORY F17e).

    Two passes: ``Z1 = fl(X - fl(mean X))``, then ``Z = fl(Z1 - fl(mean Z1))``.  One pass errs by
    ``~ d u max|x|`` per entry, which a token whose mean dwarfs its spread turns into any relative error
    (red14-1: ``x = 1e12 + 1e-3 N(0, 1)``, sigma 0.7 % high).  After the second pass every entry is within
    ``gamma_{d+3} max|Z1|`` of the exact centred one (the first pass's offset is removed up to the second
    mean's rounding, ``gamma_d max|Z1|``, and ``2 u max|Z1|`` from rounding ``Z1``'s entries; then ``u`` for the
    last subtraction, taken relative), so ``sigma >= (sigma_hat (1 - gamma_{d+4}) - gamma_{d+3} max|Z1|)(1 - 2u)``
    (the norm's own rounding ``gamma_{d+4}`` relative).  RMSNorm: ``sigma_hat (1 - gamma_{d+4})``.
    A spread that overflowed (a token near ``2^512``) is refused: its infinite sigma made the norm's local constant 0
    (Note [local weight range] in ``_local_attention``).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    d = X.shape[1]
    g = lambda k: k * _U / (1 - k * _U)  # noqa: E731
    Z1 = X - X.mean(dim=1, keepdim=True) if lay else X
    Z = Z1 - Z1.mean(dim=1, keepdim=True) if lay else X
    if not bool(torch.isfinite(Z.norm(dim=1)).all()):
        raise InputError("a token's spread overflows float64 (its squares pass 2^1024); the local bounds refuse this "
                         "input (Note [local weight range]); rescale the input or the weights before the norm")
    sigma = pow2_norm(Z, 1) / math.sqrt(d)  # a spread below 2^-537 no longer flushes to 0 (its squares would)
    if not lay:
        return X, sigma, sigma * (1 - g(d + 4))
    low = (sigma * (1 - g(d + 4)) - g(d + 3) * Z1.abs().amax(dim=1)) * (1 - 2 * _U)
    return Z, sigma, low.clamp(min=0.0)


def norm_jacobian_error(norm: NormSpec | None, X: Tensor, *, formed: bool) -> Tensor:
    r"""(T,) bound on ``||D_hat - D*||_2`` per token of the float64 (T, d) ``X``: ``D*`` the exact Jacobian of
    the norm at the stored floats, ``D_hat`` the one every route builds from ``centre_tokens``' ``Z`` and
    ``sigma_hat``, ``s = fl(sqrt(sigma_hat^2 + eps))``, ``u = fl(Z/(sqrt d s))``.  THEORY F17f.

    .. math:: \|\hat D - D^*\| \le \frac{G}{\hat s}\big[(\rho + u_a)(1 + 2\delta_Q + \delta_Q^2)
              + (1 + \rho)(2\delta_Q + \delta_Q^2)\big] + \text{formation}

    with ``E = sqrt(d) gamma_{d+3} max|Z1| + gamma_1 ||Z||`` (``||Z - Px||``, F17e; 0 for RMSNorm),
    ``e_s = gamma_{d+4} sigma_hat + E/sqrt d + gamma_3 s`` (``|s - s*|``), ``rho = e_s/(s - e_s)``,
    ``delta_u = (E/sqrt d + e_s)/s + gamma_4 ||u||`` (``||u - u*||``, ``||u*|| <= 1``), ``delta_Q`` with the
    rounded ``1/sqrt d`` column (``gamma_3``) in the factored form, ``G = max|gamma|``.  ``formed``: the dense
    ``diag(gamma)(P - u u^T)/s`` of ``_norm_parts`` (exact ``P``, ``u_a = 0``) plus its entry rounding
    ``gamma_5 (G/s)(sqrt d + ||u||^2)``; otherwise ``NormJac``'s factored ``fl(gamma/s)`` and ``Q`` (``u_a = u``).
    Relative accuracy of ``u`` is not assumed: a spiky ``gamma`` on a one-hot token has ``||D_hat||_F << G/s``
    while the error is ``~ G/s ||u - u*||`` (red15).  Assumptions: LayerNorm or RMSNorm, ``T d`` floats.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T, d = X.shape
    if norm is None or norm.kind is NormKind.NONE:
        return torch.zeros(T, dtype=torch.float64)
    g = lambda k: k * _U / (1 - k * _U)  # noqa: E731
    lay = norm.kind is NormKind.LAYERNORM
    Z, sig_hat, _ = centre_tokens(X, lay)
    s = root_sq_plus(sig_hat, float(norm.eps))
    u_norm = pow2_norm(Z / (math.sqrt(d) * s[:, None]), 1) * (1 + g(d + 2))
    E = (math.sqrt(d) * g(d + 3) * (X - X.mean(dim=1, keepdim=True)).abs().amax(dim=1) + g(1) * pow2_norm(Z, 1) * (1 + g(d))
         if lay else torch.zeros_like(s))
    e_s = (g(d + 4) * sig_hat + E / math.sqrt(d) + g(3) * s) * (1 + 4 * _U)
    rho = torch.where(e_s < s, e_s / (s - e_s).clamp(min=1e-300), torch.full_like(s, math.inf)) * (1 + 4 * _U)
    du = ((E / math.sqrt(d) + e_s) / s + g(4) * u_norm) * (1 + 4 * _U)
    dQ = torch.sqrt(du * du + (0.0 if formed or not lay else g(3) ** 2)) * (1 + 4 * _U)
    dC = 2 * dQ + dQ * dQ
    G = (norm.gamma_max_abs * (1 + ROUNDING_PAD) if norm.weight is not None else 1.0) / s
    err = G * ((rho + (0.0 if formed else _U)) * (1 + dC) + (1 + rho) * dC)
    if formed:
        err = err + g(5) * G * (math.sqrt(d) + u_norm * u_norm)
    return err * (1 + 1e-12)


def norm_jacobian_entry_error(norm: NormSpec, X: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""Entrywise form of ``norm_jacobian_error`` for the map ``r -> gamma (P r - u (u.r))/s`` on the computed ``u``,
    ``s`` (exact ``P``; the stack's ``_NormLin``): (``c1``, ``c2``, ``beta``, ``ustar``), each (T, d), with

    .. math:: |((\hat D - D^*) r)_j| \le c_{1,j}\big(|r_j| + [\text{LN}]\,\overline{|r|} + |\hat u_j|\,(|\hat u|\cdot|r|)\big)
              + c_{2,j}\big(\beta_j\,(|\hat u|\cdot|r|) + u^*_j\,(\beta\cdot|r|)\big),

    linear in ``|r|``: ``c1 = |gamma| rho/s``, ``c2 = |gamma| (1 + rho)/s``, ``beta_j >= |u_j - u*_j|``, ``ustar_j >= |u*_j|``
    (``D - D* = diag(gamma (1/s - 1/s*)) (P - u u^T) + diag(gamma/s*) (u* u*^T - u u^T)``, ``u u^T - u* u*^T =
    du u^T + u* du^T``).  Per entry, with F17f's pieces: ``|Z_j - (P x)_j| <= e_j = gamma_{d+3} max|Z1| + gamma_1 |Z_j|``
    (0 for RMSNorm), ``|u*_j| <= (|Z_j| + e_j)(1 + rho)/(sqrt d s)``, ``beta_j = gamma_4 |u_j| + e_j/(sqrt d s) + |u*_j| e_s/s``.
    THEORY F17f.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    T, d = X.shape
    g = lambda k: k * _U / (1 - k * _U)  # noqa: E731
    lay = norm.kind is NormKind.LAYERNORM
    Z, sig_hat, _ = centre_tokens(X, lay)
    s = root_sq_plus(sig_hat, float(norm.eps))
    u = (Z / (math.sqrt(d) * s[:, None])).abs()
    eZ = (g(d + 3) * (X - X.mean(dim=1, keepdim=True)).abs().amax(dim=1, keepdim=True) + g(1) * Z.abs()
          if lay else torch.zeros_like(Z))
    E = pow2_norm(eZ, 1) * (1 + g(d + 2))
    e_s = (g(d + 4) * sig_hat + E / math.sqrt(d) + g(3) * s) * (1 + 4 * _U)
    rho = torch.where(e_s < s, e_s / (s - e_s).clamp(min=1e-300), torch.full_like(s, math.inf)) * (1 + 4 * _U)
    ustar = (Z.abs() + eZ) * ((1 + rho) / (math.sqrt(d) * s))[:, None] * (1 + 4 * _U)
    beta = (g(4) * u + eZ / (math.sqrt(d) * s[:, None]) + ustar * (e_s / s)[:, None]) * (1 + 4 * _U)
    ga = (torch.ones(d, dtype=torch.float64) if norm.weight is None else _f64(norm.weight).abs())[None, :] / s[:, None]
    return ga * rho[:, None] * (1 + 4 * _U), ga * (1 + rho[:, None]) * (1 + 4 * _U), beta, ustar


def _norm_parts(norm: NormSpec | None, X: Tensor):  # noqa: ANN202
    """(D (T, d, d) Jacobians, s (T,) with s^2 = sigma^2 + eps, sigma (T,) certified low (``centre_tokens``),
    gamma_max, kind) at X."""
    T, d = X.shape
    eye = torch.eye(d, dtype=torch.float64)
    if norm is None or norm.kind is NormKind.NONE:
        return eye.expand(T, d, d).clone(), None, None, 1.0
    if norm.kind is NormKind.BALL:
        raise InputError("the exact-Jacobian route does not cover Pi_norm; the product route does")
    lay = norm.kind is NormKind.LAYERNORM
    Z, sig_hat, sigma = centre_tokens(X, lay)
    s = root_sq_plus(sig_hat, float(norm.eps))
    u = Z / (math.sqrt(d) * s[:, None])
    P = eye - (1.0 / d if lay else 0.0)
    D = (P[None] - u[:, :, None] * u[:, None, :]) / s[:, None, None]
    if norm.weight is not None:
        D = _f64(norm.weight)[None, :, None] * D
    return D, s, sigma, norm.gamma_max_abs


def _floor(norm: NormSpec, sigma: Tensor, r: Tensor, d: int) -> Tensor:
    """Certified per-token ``s`` floor on the balls of radii ``r`` (Note [local norm floor])."""
    d_sqrt = math.sqrt(d)
    f = torch.clamp(sigma * (1 - 1e-12) - r / d_sqrt * (1 + 1e-12), min=0.0)
    return root_sq_plus(f, float(norm.eps)) * (1 - 1e-12)


def _norm_drift(norm: NormSpec | None, sigma: Tensor | None, r: Tensor, d: int) -> tuple[Tensor, Tensor]:
    """(``sup ||D'|| - ||D||`` bound, sup ||D'|| bound by the floor) per token on balls of radii r."""
    if sigma is None:
        return torch.zeros_like(r), torch.ones_like(r)
    s_f = _floor(norm, sigma, r, d)
    g = norm.gamma_max_abs * (1 + ROUNDING_PAD)
    if bool((s_f <= 0).any()):
        return torch.full_like(r, math.inf), torch.full_like(r, math.inf)
    return 2.0 * g * r / (math.sqrt(d) * s_f * s_f), g / s_f





def root_sum_squares(v: Tensor, dim: int) -> Tensor:
    """``sqrt((v * v).sum(dim))`` as before where the largest ``|v|`` along ``dim`` lies in ``[2^-400, 2^400]`` (the
    very same floats), else ``pow2_norm``: the plain squares of a ``2^-540`` vector flushed to 0 (and past ``2^512``
    overflowed)."""
    plain = torch.sqrt((v * v).sum(dim=dim))
    m = v.abs().amax(dim=dim) if v.numel() else plain
    far = (m > 0) & torch.isfinite(m) & ((m < 2.0**-400) | (m > 2.0**400))
    return torch.where(far, pow2_norm(v, dim), plain) if bool(far.any()) else plain

@dataclass
class LayerJacobian:
    """The exact-Jacobian route for one layer: certified row sums at X and over ``B(X, r)``."""

    point_rows: Tensor  # (T,) certified upper bound on nu_i(J(X)) (block sums)
    drift_rows: Tensor  # (T,) certified bound on sup over the ball of nu_i(J(X') - J(X))
    blocks: Tensor | None  # (T, T, d, d) J_ij at X (only when asked)
    attention_rows: Tensor  # (T,) sup on the ball of nu_i(A) (attention alone)
    parts: dict  # per-term maxima of the drift (where the gap sits)
    radius: float = math.nan  # the ball's radius r (every token within r of X)
    stage_radii: dict = field(default_factory=dict)  # stage name -> (T,) certified radius at its output
    stage_remainders: dict = field(default_factory=dict)  # post-LN, _local_stages.stage_remainders (THEORY F59b)
    ball_rows: Tensor | None = None  # (T,) certified sup over the ball of nu_i(J) when below point + drift (caps)
    lower_rows: Tensor | None = None  # (T,) attained row norms at X (empirical lower; NaN: not searched)
    lower_V: tuple | None = None  # (token, V) attaining the largest of them

    @property
    def output_radii(self) -> Tensor:
        """(T,) certified ``sup_{X' in B(X, r)} ||f(X')_i - f(X)_i||``: ``r`` times the row bound on
        the ball (mean-value theorem on the convex ball), rounding included; for whole-network
        composition (``_local_stack``)."""
        return self.radius * self.total_rows * (1 + ROUNDING_PAD)

    @property
    def point(self) -> float:
        return float(self.point_rows.max())

    @property
    def total_rows(self) -> Tensor:
        """(T,) certified sup over the ball of ``nu_i(J(X'))``: ``point + drift`` or the capped ``ball_rows``."""
        total = self.point_rows + self.drift_rows
        return total if self.ball_rows is None else torch.minimum(total, self.ball_rows)

    @property
    def ball(self) -> float:
        return float(self.total_rows.max()) * (1 + ROUNDING_PAD)


def _head_data(attn, Xin: Tensor):  # noqa: ANN001, ANN202
    """Per head: P, y (T, T, d), q (T, d), Wq, Wk, Wv, Wo (float64).
    A head outside Note [local head data range] is refused (InputError)."""
    T, d = Xin.shape
    Xa = torch.cat([Xin, torch.ones(T, 1, dtype=torch.float64)], dim=1)
    out = []
    for h in range(attn.n_heads):
        Wq, Wk, Wv, Wo = (_f64(W) for W in attn.head(h))
        Wqa = _f64(attn.W_Q_augmented(h))
        # the scores with the query bias folded in, formed to twice the precision (Note [formed attention weights])
        P = certified_weights(attn, Xin, h)
        Y = Xin[None, :, :] - (P @ Xin)[:, None, :]
        q = attn.softmax_scale * (Xa @ Wqa) @ Wk.T
        check_head_scales(attn, h, Y, q)  # Note [local head data range]
        hd = HeadData((P, Y, q, Wq, Wk, Wv, Wo))
        hd.q_err = 2 * attn.softmax_scale * product_row_error(Xa, Wqa, Wk.T)  # the scaling rounds once more
        hd.scale = attn.softmax_scale
        out.append(hd)
    return out


class HeadData(tuple):
    """``(P, Y, q, W_Q, W_K, W_V, W_O)`` of one head at X (float64), ``q_err`` (T,): a bound on the distance of the
    formed ``q_i`` from the exact ``sc W_K W_Q^T x_i`` (Higham's, THEORY F97), the softmax ``scale``, and the products
    several routes read, formed once per head: ``values`` ``Y W_V`` and the bounds on the formed rows' distance from
    the exact ``W_V^T y_ij`` and ``sc W_Q W_K^T y_ij`` (twice Higham's: ``Y``'s subtraction and the scaling round once
    more)."""

    q_err: Tensor
    scale: float

    @functools.cached_property
    def values(self) -> Tensor:
        """(T, T, d_h) the formed ``v_ij = W_V^T y_ij`` as rows."""
        return self[1] @ self[5]

    @functools.cached_property
    def value_err(self) -> Tensor:
        """(T, T) bounds on ``||fl(v_ij) - W_V^T y_ij||`` (THEORY F97)."""
        return 2 * product_row_error(self[1], self[5])

    @functools.cached_property
    def score_err(self) -> Tensor:
        """(T, T) bounds on ``||fl(G y_ij) - sc W_Q W_K^T y_ij||`` (THEORY F97)."""
        return 2 * self.scale * product_row_error(self[1], self[4], self[3].T)


# Note [exact route budget]: the blocks route forms T^2 blocks of d x d (T^2 d^2 entries and their
# certified norms); the rows route (``_local_rows``) never does.  Both are certified; by default the
# rows route runs and the blocks route joins it (the smaller bound per token is kept) when the
# blocks are asked for or T*d is at most this many entries.
BLOCKS_ROUTE_MAX = 256


def layer_jacobians(layer: LayerSpec, X: Tensor, radii, *, keep_blocks: bool = False,  # noqa: ANN001
                    norms: dict | None = None, head_norms_: dict | None = None, exact: int = 8,
                    route: str = "auto", lower: int = 0, tiers: bool = False) -> list[LayerJacobian]:
    r"""Certified (2,inf) bound of one layer's Jacobian at every point of ``B(X, r)``, for each ``r``
    in ``radii``: the rows route (``_local_rows.layer_rows``, no T^2 d^2 blocks) and/or the blocks
    route (``route``: "rows", "blocks" or "auto", Note [exact route budget]); with both, the
    smaller bound per token.  ``tiers``: F45's cheap N2 tier and F61b's rule in the rows route (the same ball and drift
    maxima, the part ``ffn (dF)`` a certified upper bound of its refined maximum; other tokens' rows looser, so only
    for callers that read the maxima).  Source: THEORY F17, F17b-F17d; see ``_blocks_route``."""
    if route not in ("auto", "rows", "blocks"):
        raise InputError(f"route must be 'auto', 'rows' or 'blocks', but got {route!r}")
    X = X.detach().double()
    use_blocks = route == "blocks" or (route == "auto" and (keep_blocks or X.shape[0] * X.shape[1] <= BLOCKS_ROUTE_MAX))
    rows = None
    if route != "blocks":
        from ._local_rows import layer_rows

        rows = layer_rows(layer, X, radii, norms=norms, head_norms_=head_norms_, lower=lower, tiers=tiers)
    if not use_blocks:
        return rows
    blocks = _blocks_route(layer, X, radii, keep_blocks=keep_blocks, norms=norms, head_norms_=head_norms_, exact=exact)
    for r, b in zip(radii, blocks):
        b.radius = float(r)
    if rows is None:
        return blocks
    return [_smaller(a, b) for a, b in zip(rows, blocks)]


def _smaller(a: LayerJacobian, b: LayerJacobian) -> LayerJacobian:
    """Per token the smaller point bound and the smaller ball bound of two certified routes."""
    # both drifts bound the same sup of nu_i(J' - J): the smaller one does too
    point = torch.minimum(a.point_rows, b.point_rows)
    parts = a.parts if a.ball <= b.ball else b.parts
    out = LayerJacobian(point, torch.minimum(a.drift_rows, b.drift_rows), b.blocks if b.blocks is not None else a.blocks,
                        torch.minimum(a.attention_rows, b.attention_rows), parts,
                        ball_rows=torch.minimum(a.total_rows, b.total_rows))
    out.radius = a.radius
    out.stage_radii, out.stage_remainders = (a.stage_radii, a.stage_remainders) if a.stage_radii \
        else (b.stage_radii, b.stage_remainders)
    out.lower_rows, out.lower_V = a.lower_rows, a.lower_V
    return out


def _blocks_route(layer: LayerSpec, X: Tensor, radii, *, keep_blocks: bool = False,  # noqa: ANN001
                  norms: dict | None = None, head_norms_: dict | None = None, exact: int = 8) -> list[LayerJacobian]:
    r"""Certified (2,inf) bound of one layer's Jacobian at every point of ``B(X, r)``, for each ``r``
    in ``radii`` (the blocks at X are computed once).

    .. math:: \|J(X')\|_{(2,\infty)} \le \max_i \Big(\sum_j \|J_{ij}(X)\|_2 + \mathrm{drift}_i(r)\Big)

    Source: THEORY F17, Notes [exact layer Jacobian], [Jacobian drift].  ``attention_rows`` are
    computed here: certified per-query bounds of ``nu_i(A)`` on the attention's input ball
    (``attention_local_bound``; radius ``r`` post-LN, ``r max_j sup||D1_j||`` pre-LN).  ``exact`` blocks per row get certified spectral norms, the rest their Frobenius norms
    (``_row_block_norms``).  Assumptions: dot attention without RoPE,
    non-gated FFN whose ``sup|sigma''|`` is finite, every token within ``r`` of X.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""

    ffn, attn = layer.ffn, layer.attention
    if ffn.gated:
        raise InputError("the exact-Jacobian route does not cover gated FFNs")
    X = X.detach().double()
    T, d = X.shape
    post = layer.placement is Placement.POST
    norms = _weight_norms(layer) if norms is None else norms
    W1, W2 = _f64(ffn.W_1), _f64(ffn.W_2)
    if post:
        Xin = X
        D1 = None
        S1 = X + attention_forward(attn, X)
        Da, sa, siga, _ = _norm_parts(layer.norm_attn, S1)
        H = layer.norm_attn(S1) if layer.norm_attn is not None else S1
        S2 = H + ffn_forward(ffn, H)
        Db, sb, sigb, _ = _norm_parts(layer.norm_ffn, S2)
    else:
        D1, s1, sig1, _ = _norm_parts(layer.norm_attn, X)
        Xin = layer.norm_attn(X) if layer.norm_attn is not None else X
        S1 = X + attention_forward(attn, Xin)
        Db, sb, sigb, _ = _norm_parts(layer.norm_ffn, S1)
        H = layer.norm_ffn(S1) if layer.norm_ffn is not None else S1
    z, ez = pre_activations(ffn, H)
    z = z.clone().requires_grad_(True)
    (slope,) = torch.autograd.grad(ffn.activation(z).sum(), z)
    F = (W2.T[None] * slope.detach()[:, None, :]) @ W1.T  # (T, d, d)
    eFz = point_slope_err(ffn.activation, z.detach(), ez) * norms["W1"] * norms["W2"]  # the exact z's F (F51a)
    eye = torch.eye(d, dtype=torch.float64)
    IF = eye + F
    M = Db @ IF @ Da if post else eye + F @ Db
    heads = _head_data(attn, Xin)
    # -- the exact blocks and their certified norms, one output token at a time --------------------
    fro = lambda A: float(pow2_norm(A, (-2, -1)).max()) if A.dim() == 3 else float(pow2_norm(A))  # noqa: E731
    K = 4 * (d + W1.shape[1] + attn.n_heads * attn.d_head + T)
    ymax = max(float(pow2_norm(hd[1], -1).max()) for hd in heads)
    qmax = max(float(pow2_norm(hd[2], -1).max()) for hd in heads)
    fV = sum(fro(hd[5]) * fro(hd[6]) for hd in heads)
    fM = fro(M) + 4 * K * _U * (fro(Db) * (math.sqrt(d) + fro(W2) * float(slope.abs().max()) * fro(W1))
                                * (fro(Da) if post else 1.0) + math.sqrt(d))
    fD1 = 1.0 if post else fro(D1)
    # THEORY F97: the formed q_i and G y_ij against the exact ones, q's by its ``q_err``, G y's by gamma_{d + dh} times
    # ||y|| ||W_K||_F ||W_Q||_F (inside 4 K u with ``gF``)
    gF = attn.softmax_scale * max(fro(hd[3]) * fro(hd[4]) for hd in heads)
    eqmax = max(float(hd.q_err.max()) for hd in heads)
    block_pad = (4 * K * _U * fM * (1 + fV * (1 + ymax * qmax + ymax * ymax * (max(norms["G"]) + gF)) * fD1)
                 + fM * fV * fD1 * ymax * eqmax * (1 + 1e-12))
    from ._local_attention import attention_local_bound, head_norms

    hn = head_norms(attn) if head_norms_ is None else head_norms_
    point_rows = torch.zeros(T, dtype=torch.float64)
    att_point = torch.zeros(T, dtype=torch.float64)
    h_point = torch.full((T,), math.inf, dtype=torch.float64)
    g_point = torch.full((T,), math.inf, dtype=torch.float64)
    kept = torch.zeros(T, T, d, d, dtype=torch.float64) if keep_blocks else None
    for i in range(T):
        Ai = _attention_row(heads, eye, i, attn.softmax_scale)
        att_point[i] = (_row_block_norms(Ai, exact) + block_pad).sum()
        Bi = _attention_row(heads, M[i], i, attn.softmax_scale)
        if not post:
            Bi = Bi @ D1  # the attention sees D1_j dx_j; the residual does not
        Bi[i] += M[i]
        if kept is not None:
            kept[i] = Bi
        point_rows[i] = (_row_block_norms(Bi, exact) + block_pad).sum()
        if post:  # the first stage's row constant nu_i(D1_i (E_i + A_i)): radii and drift use it
            Ni = _attention_row(heads, Da[i], i, attn.softmax_scale)
            Ni[i] += Da[i]
            h_point[i] = (_row_block_norms(Ni, exact) + block_pad).sum()
            # the second stage's row constant nu_i((I + F_i) D1_i (E_i + A_i)) (the FFN residual's output)
            Gi = _attention_row(heads, IF[i] @ Da[i], i, attn.softmax_scale)
            Gi[i] += IF[i] @ Da[i]
            g_point[i] = (_row_block_norms(Gi, exact) + block_pad * (1 + float(pow2_norm(F[i])))).sum()
    # F17f: the formed norm Jacobians against the true ones, carried into M, the rows and the memo's norms
    fro3 = lambda A: pow2_norm(A, (1, 2)) * (1 + 1e-12)  # noqa: E731
    eDb = norm_jacobian_error(layer.norm_ffn, S2 if post else S1, formed=True)
    eDa = norm_jacobian_error(layer.norm_attn, S1 if post else X, formed=True)
    Dn = Da if post else D1
    if post:
        eM = (eDb * (fro3(IF) + eFz) * (fro3(Da) + eDa) + fro3(Db) * fro3(IF) * eDa
              + fro3(Db) * eFz * (fro3(Da) + eDa)) * (1 + 1e-12)
        point_rows = point_rows + eM * (att_point + 1) * (1 + 1e-12)
        h_point = h_point + eDa * (att_point + 1) * (1 + 1e-12)
        g_point = g_point + (fro3(IF) * eDa + eFz * (fro3(Da) + eDa)) * (att_point + 1) * (1 + 1e-12)
    else:
        eM = (fro3(F) * eDb + eFz * (fro3(Db) + eDb)) * (1 + 1e-12)
        point_rows = point_rows + (eM * (1 + att_point * float((fro3(D1) + eDa).max()))
                                   + (fro3(M) + eM) * att_point * float(eDa.max())) * (1 + 1e-12)
    memo = _Memo()
    memo.store.update({"D1": _sym_top(Dn) + eDa, "Db": _sym_top(Db) + eDb, "M": _sym_top(M) + eM})
    MOV, MO = _mixed_norms(M, heads, norms)
    nOV = torch.tensor([float(pow2_norm(hd[6]) * pow2_norm(hd[5])) for hd in heads], dtype=torch.float64)[:, None]
    memo.store["mixed"] = (MOV + nOV * eM[None] * (1 + 1e-12),
                           MO + float(pow2_norm(torch.cat([hd[6] for hd in heads], dim=0))) * eM * (1 + 1e-12))
    out = []
    for r in radii:
        if post:
            ry = float(r)
        else:
            d1, sup1 = _norm_drift(layer.norm_attn, sig1, torch.full((T,), float(r), dtype=torch.float64), d)
            ry = float(r * torch.minimum(sup1, memo("D1", D1) + d1).max()) * (1 + 1e-12)
        dQ = _attention_drift(heads, ry, norms, attn.softmax_scale)  # (H, T)
        nV = torch.tensor(norms["V"], dtype=torch.float64)[:, None]
        dA_alone = torch.minimum((torch.tensor(hn["OV"], dtype=torch.float64)[:, None] * dQ).sum(dim=0),
                                 hn["O"] * torch.sqrt(((nV * dQ) ** 2).sum(dim=0)))
        # the attention alone on its input ball: exact at the point plus its drift, or the older bound
        attention_rows = torch.minimum(attention_local_bound(attn, Xin, ry, norms=hn).per_query,
                                       (att_point + dA_alone) * (1 + ROUNDING_PAD))
        drift, parts = _drift(memo, layer, X, (z.detach(), ez), r, post, dQ, heads, M, IF, F, Da if post else D1, Db,
                              (siga, sa) if post else (sig1, s1), (sigb, sb), S1, attention_rows, norms,
                              h_point * (1 + ROUNDING_PAD), dA_alone, g_point * (1 + ROUNDING_PAD))
        out.append(LayerJacobian(point_rows * (1 + ROUNDING_PAD), drift, kept, attention_rows, parts))
    return out


def layer_jacobian(layer: LayerSpec, X: Tensor, r: float, **kw) -> LayerJacobian:
    r"""Certified (2,inf) bound of one layer's Jacobian at every point of ``B(X, r)``.

    .. math:: \|J(X')\|_{(2,\infty)} \le \max_i \Big(\sum_j \|J_{ij}(X)\|_2 + \mathrm{drift}_i(r)\Big)

    Source: THEORY F17, Notes [exact layer Jacobian], [Jacobian drift]; see ``layer_jacobians``.
    """
    return layer_jacobians(layer, X, [r], **kw)[0]



class _Memo:
    """Certified norms of the r-independent per-token matrices, computed once per layer call."""

    def __init__(self) -> None:
        self.store: dict = {}

    def __call__(self, name: str, A: Tensor) -> Tensor:
        if name not in self.store:
            self.store[name] = _sym_top(A)
        return self.store[name]


def _attention_row(heads, Mi: Tensor, i: int, scale: float) -> Tensor:  # noqa: ANN001
    """Blocks ``M_i A_ij`` (T, d, d) of output token ``i`` (Note [exact layer Jacobian])."""
    T, d = heads[0][2].shape[0], Mi.shape[0]
    Bi = torch.zeros(T, d, Mi.shape[1], dtype=torch.float64)
    diag = torch.zeros(d, Mi.shape[1], dtype=torch.float64)
    for P, Y, q, Wq, Wk, Wv, Wo in heads:
        MO = Mi @ Wo.T  # (d, dh)
        C = MO @ Wv.T  # (d, d): M_i W_OV^hT
        p = P[i]
        Vy = Y[i] @ Wv  # (T, dh): W_V^T y_ij as rows
        U = Vy @ MO.T  # (T, d): C y_ij
        Bi += p[:, None, None] * C[None] + (p[:, None] * U)[:, :, None] * q[i][None, None, :]
        Gy = scale * (Y[i] @ Wk) @ Wq.T  # (T, d): (G y_ij)^T as rows
        diag += MO @ ((p[:, None] * Vy).T @ Gy)  # M_i W_OV^T Sigma_i G^T
    Bi[i] += diag
    return Bi


def _row_block_norms(Bi: Tensor, exact: int) -> Tensor:
    """Certified ``||J_ij||_2`` for one output row: the ``exact`` blocks largest in Frobenius norm
    by ``certified_spectral``, the others by their Frobenius norm (an upper bound).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    fro = pow2_norm(Bi, (1, 2)) * (1 + 1e-12)  # at a power of two: a 1e-170 block's torch norm is 0
    if exact >= Bi.shape[0]:
        return certified_spectral(Bi)
    top = fro.topk(exact).indices
    fro[top] = certified_spectral(Bi[top])
    return fro


def _ffn_weight_norms(ffn) -> dict:  # noqa: ANN001
    """Certified FFN weight norms the drift uses: ``W_1``'s column norms ``n1``, ``||W_1||``, ``||W_2||`` and
    the curvature constant ``ffn_curv``.
    The column norms at powers of two (``pow2_norm``; a column below ``2^-537`` had norm 0)."""
    W1, W2 = _f64(ffn.W_1), _f64(ffn.W_2)
    n = pow2_norm(W1, 0) * (1 + 1e-12)
    ffn_curv = spectral(n.sqrt()[:, None] * W2) * spectral(W1 * n.sqrt()[None, :]) * (1 + ROUNDING_PAD) ** 2
    return {"ffn_curv": ffn_curv, "n1": n, "W1": spectral(W1), "W2": spectral(W2)}


def score_norm(Wq: Tensor, Wk: Tensor, scale: float) -> float:
    """Certified ``||scale W_Q W_K^T||_2`` (float64 factors, (d, d_head) each): the smaller of the formed product's
    certified norm plus its rounding, ``||fl(W_Q W_K^T) - W_Q W_K^T||_2 <= gamma_k || |W_Q| |W_K|^T ||_F`` (Higham
    Lemma 3.5, ``k = d_head``; THEORY F97), and the low-rank route of ``spectral_product`` (never formed).  The formed
    norm alone, padded relative to itself, was up to 7.4e-5 below the exact value where the product cancels
    (``W_K ~ -W_Q``); a product that overflows is left to the low-rank route (``inf`` where the norm itself does)."""
    P = Wq @ Wk.T
    low_rank = spectral_product(Wq, Wk.T)
    if not bool(torch.isfinite(P).all()):
        return scale * low_rank * (1 + ROUNDING_PAD)
    e = _gamma(Wq.shape[1]) * float(pow2_norm(Wq.abs() @ Wk.abs().T)) * (1 + 1e-12)
    return scale * min(spectral(P) + e, low_rank) * (1 + ROUNDING_PAD) * (1 + 1e-12)


def score_rows(Y: Tensor, Wk: Tensor, Wq: Tensor) -> Tensor:
    """Certified ``||(Y W_K W_Q^T)_ij||`` per row of ``Y`` (..., d): ``product_row_norms`` (THEORY F97)."""
    return product_row_norms(Y, Wk, Wq.T)


def _weight_norms(layer: LayerSpec) -> dict:
    """Certified weight norms the drift uses (they do not depend on the data); ``G`` by ``score_norm``."""
    attn = layer.attention
    G, V = [], []
    for h in range(attn.n_heads):
        Wq, Wk, Wv, _ = (_f64(W) for W in attn.head(h))
        G.append(score_norm(Wq, Wk, attn.softmax_scale))
        V.append(spectral(Wv) * (1 + ROUNDING_PAD))
    return {"G": G, "V": V, "O": spectral(_f64(attn.W_O).reshape(-1, attn.d_model)), **_ffn_weight_norms(layer.ffn)}


def _attention_drift(heads, r: float, norms: dict, scale: float) -> Tensor:  # noqa: ANN001
    """(H, T): per head and query the bound on ``nu_i(Q'^h - Q^h)`` over ``B(X, r)`` (Note [Jacobian drift]).
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    out = []
    for h, (P, Y, q, Wq, Wk, _, _) in enumerate(heads):
        nG = norms["G"][h]
        yn = pow2_norm(Y, -1)  # (T_i, T_j); at powers of two (the squares of a 2^-540 spread flush)
        qn = pow2_norm(q, -1) * (1 + 1e-12) + heads[h].q_err  # the formed q_i's rounding (THEORY F97)
        Gy = score_rows(Y, Wk, Wq) * scale * (1 + 1e-12)
        delta = r * (Gy + qn[:, None] * (1 + 1e-12) + nG * r)
        delta = torch.where(P > 0, delta, torch.zeros_like(delta))  # masked keys keep P' = 0
        eps = torch.expm1(delta + delta.max(dim=1, keepdim=True).values) * (1 + 1e-12)
        dP = P * eps
        m = r + (dP * yn).sum(dim=1)  # the weighted mean's move, (T,)
        dy = r + m[:, None]
        yp = yn + dy
        qp = qn + nG * r
        term_a = dP.sum(dim=1)
        term_b = (dP * yp).sum(dim=1) * qp + (P * dy).sum(dim=1) * qp + (P * yn).sum(dim=1) * nG * r
        dSigma = (dP * yp * yp).sum(dim=1) + (P * (yp + yn) * dy).sum(dim=1)
        out.append((term_a + term_b + nG * dSigma) * (1 + 1e-10))
    return torch.stack(out)


def _drift(memo, layer, X, z, r, post, dQ, heads, M, IF, F, D1, Db, nA, nB, S1, att_rows, norms, h_point, dA_alone, g_point):  # noqa: ANN001, ANN202, PLR0913
    """Per-token drift bound of the row operator over ``B(X, r)`` and the per-term maxima."""
    T, d = X.shape
    ffn = layer.ffn
    from ._local import second_derivative_sup

    rr = torch.full((T,), float(r), dtype=torch.float64)
    curv = second_derivative_sup(ffn.activation) * norms["ffn_curv"]
    from ._activations import activation_lipschitz

    lffn = activation_lipschitz(ffn.activation) * norms["W1"] * norms["W2"] * (1 + ROUNDING_PAD) ** 2
    nIF = memo("IF", IF)
    nM = memo("M", M)
    if post:
        siga, _ = nA
        sigb, _ = nB
        r1 = rr * (1 + att_rows) * (1 + 1e-12)
        dDa, supDa = _norm_drift(layer.norm_attn, siga, r1, d)
        nDa = memo("D1", D1)
        # sup over the ball of nu_i(D1'(E + A')) <= nu_i(D1(E + A)) + dD1 (1 + a_i) + ||D1|| dA
        h = h_point + dDa * (1 + att_rows) + nDa * dA_alone
        rh = torch.minimum(r1 * torch.minimum(supDa, nDa + dDa), rr * h) * (1 + 1e-12)
        dF = _ffn_drift(ffn, z, rh, norms, curv)
        hb0 = torch.minimum(h, (nDa + dDa) * (1 + att_rows))
        # sup over the ball of nu_i((I+F')D1'(E + A')) <= g_i + ||dF|| h' + ||I+F|| (dD1 (1 + a_i) + ||D1|| dA)
        gb = torch.minimum(g_point + dF * hb0 + nIF * (dDa * (1 + att_rows) + nDa * dA_alone),
                           torch.minimum(nIF + dF, torch.full_like(rh, 1 + lffn)) * hb0)
        r2 = torch.minimum(rh * torch.minimum(nIF + dF, torch.full_like(rh, 1 + lffn)), rr * gb) * (1 + 1e-12)
        dDb, _ = _norm_drift(layer.norm_ffn, sigb, r2, d)
        nDb = memo("Db", Db)
        hb = torch.minimum(h, (nDa + dDa) * (1 + att_rows))  # sup nu_i(D1'(E + A'))
        dM = None  # the post-LN drift of M (E + A') is bounded term by term below
        dMA = dDb * torch.minimum(gb, (nIF + dF) * hb) + nDb * dF * hb + nDb * nIF * dDa * (1 + att_rows)
        a_in = att_rows
        dA_scale = torch.ones(T, dtype=torch.float64)
        ry = float(r)
    else:
        sig1, _ = nA
        sigb, _ = nB
        d1, sup1 = _norm_drift(layer.norm_attn, sig1, rr, d)
        nD1 = memo("D1", D1)
        sup1 = torch.minimum(sup1, nD1 + d1)
        ry = float(r * sup1.max()) * (1 + 1e-12)
        r1 = rr + att_rows * ry
        dDb, supDb = _norm_drift(layer.norm_ffn, sigb, r1, d)
        nDb = memo("Db", Db)
        rh = r1 * torch.minimum(supDb, nDb + dDb)
        dF = _ffn_drift(ffn, z, rh, norms, curv)
        nF = memo("F", F)
        dM = dF * (nDb + dDb) + nF * dDb
        a_in = att_rows * float(sup1.max())
        dA_scale = torch.full((T,), float(sup1.max()), dtype=torch.float64)
    if "mixed" not in memo.store:
        memo.store["mixed"] = _mixed_norms(M, heads, norms)
    MOV, MO = memo.store["mixed"]
    summed = (MOV * dQ).sum(dim=0)
    concat = MO * torch.sqrt(((torch.tensor(norms["V"], dtype=torch.float64)[:, None] * dQ) ** 2).sum(dim=0))
    dA = torch.minimum(summed, concat) * dA_scale
    if post:
        parts = {"norm_ffn (dD2)": float((dDb * torch.minimum(gb, (nIF + dF) * hb)).max()), "ffn (dF)": float((nDb * dF * hb).max()),
                 "norm_attn (dD1)": float((nDb * nIF * dDa * (1 + att_rows)).max()), "attention (dA)": float(dA.max())}
    else:
        dMA = dM * (1 + a_in)
        parts = {"norm_ffn/ffn (dM)": float(dMA.max()), "attention (dA)": float(dA.max())}
    drift = dMA + dA
    if not post:  # M_i A_i (D1' - D1): the pre-LN input norm moves under the attention
        extra = nM * att_rows * float(d1.max())
        drift = drift + extra
        parts["norm_attn (pre, dD1)"] = float(extra.max())
    drift = torch.where(torch.isfinite(drift), drift, torch.full_like(drift, math.inf))
    return drift * (1 + ROUNDING_PAD), parts


def _ffn_drift(ffn, zz: tuple, rh: Tensor, norms: dict, curv: float) -> Tensor:  # noqa: ANN001
    """Per token ``||F'_t - F_t||`` on the FFN input balls of radii ``rh`` (Note [Jacobian drift]):
    ``|sigma'(z'_k) - sigma'(z_k)| <= c_k = sup_{[z_k - h_k - ez_k, z_k + h_k + ez_k]} |sigma''| h_k``, ``h_k = n_k rh``
    (``zz = (z, ez)``, ``pre_activations``: the interval holds the exact pre-activation's),
    and ``||W_2^T diag(delta) W_1^T|| <= (lambda_max(W_2^T diag(c) W_2) lambda_max(W_1 diag(c) W_1^T))^{1/2}``.
    GELU gets the per-unit interval sup (``gelu2_sup``), other activations the global one.  Every
    ``c_k`` is also capped by the range of ``sigma'`` (GELU: ``GELU'(sqrt 2) - GELU'(-sqrt 2) = erf(1) +
    2 sqrt(2) phi(sqrt 2)``, the extrema of ``GELU' = Phi + z phi``; otherwise ``2 sup|sigma'|``), and
    the whole bound by that range times ``||W_1|| ||W_2||``.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    from ._activations import activation_lipschitz

    act = Activation(ffn.activation)
    if act is Activation.GELU:
        cap = (math.erf(1.0) + 2 * math.sqrt(2) * math.exp(-1.0) / math.sqrt(2 * math.pi)) * (1 + 1e-9)
    else:
        cap = 2 * activation_lipschitz(act)
    glob = torch.minimum(curv * rh, torch.full_like(rh, cap * norms["W1"] * norms["W2"] * (1 + ROUNDING_PAD)))
    glob = torch.where(rh == 0, 0.0, glob)  # a ball of radius 0: F does not move (inf curv times 0 is nan)
    if act is not Activation.GELU:
        return glob
    W1, W2 = _f64(ffn.W_1), _f64(ffn.W_2)
    z, ez = zz
    half = norms["n1"][None, :] * rh[:, None] * (1 + 1e-12)
    c = torch.clamp(gelu2_sup(z - half - ez, z + half + ez) * half * (1 + ROUNDING_PAD), max=cap)
    l2 = certified_lmax((W2.T[None] * c[:, None, :]) @ W2[None])
    l1 = certified_lmax((W1[None] * c[:, None, :]) @ W1.T[None])
    fro = float(pow2_norm(W1) * pow2_norm(W2)) * float(c.max())
    return torch.minimum(glob, torch.sqrt(l1 * l2) * (1 + GRAM_PAD) + GRAM_PAD * fro)


def _mixed_norms(M: Tensor, heads, norms: dict) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    """(H, T) certified ``||M_i W_OV^hT||`` and (T,) ``||M_i W_O^T||`` (Gram eigenvalues, padded).

    ``||A W_V^T||^2 = lambda_max(L^T A^T A L)`` with ``W_V^T W_V = L L^T`` (Cholesky, d_head x d_head);
    a singular ``W_V`` falls back to ``||A|| ||W_V||``.  A token's ``A`` whose largest entry is outside ``[2^-400,
    2^400]`` is first scaled by a power of two to one in ``[1/2, 1)`` (exact; undone on the root): its Gram flushed to
    0 below ``2^-537`` (a post-LN ``M`` at ``2^-580`` had ``||M W_OV^T||`` 0); the others are the very same floats."""
    Wo_all = torch.cat([hd[6] for hd in heads], dim=0)  # (H dh, d)
    MO = _sym_top(M @ Wo_all.T[None])
    out = []
    for h, (_, _, _, _, _, Wv, Wo) in enumerate(heads):
        A = M @ Wo.T[None]  # (T, d, dh)
        try:
            Lc = torch.linalg.cholesky(Wv.T @ Wv)
        except RuntimeError:
            out.append(_sym_top(A) * norms["V"][h])
            continue
        A, ex = _pow2_far(A)
        K = Lc.T[None] @ (A.transpose(1, 2) @ A) @ Lc[None]
        fro2 = (A * A).sum(dim=(1, 2)) * float((Wv * Wv).sum())
        out.append(torch.ldexp(torch.sqrt(torch.linalg.eigvalsh(K)[:, -1].clamp(min=0.0) + GRAM_PAD * fro2) * (1 + GRAM_PAD),
                               ex))
    return torch.stack(out), MO


def _pow2_far(A: Tensor, lim: int = 400) -> tuple[Tensor, Tensor]:
    """``(A 2^-e, e)`` per matrix of the batch ``A`` (n, m, k): ``e`` the exponent of the largest ``|entry|`` (so that it
    lies in ``[1/2, 1)``) where that is outside ``[2^-lim, 2^lim]``, else 0 (exact; those matrices unchanged)."""
    top = A.abs().amax(dim=(-2, -1)) if A.numel() else A.new_zeros(A.shape[:-2])
    ex = pow2_exponent(top, lim)
    return torch.ldexp(A, -ex[..., None, None]), ex


def row_norm_lower(blocks: Tensor, *, iters: int = 30, restarts: int = 3, seed: int = 0) -> Tensor:
    """Per output token, an attained value of ``nu_i(J) = max_{||v_j|| <= 1} ||sum_j J_ij v_j||``
    (alternating maximisation: ``v_j = J_ij^T u/||J_ij^T u||``, ``u`` the normalised image; each step
    cannot decrease it).  A lower estimate of the (2,inf) norm of ``J`` (kind: empirical lower)."""
    T, _, d, _ = blocks.shape
    g = torch.Generator().manual_seed(seed)
    best = torch.zeros(T, dtype=torch.float64)
    for k in range(restarts):
        u = torch.randn(T, d, generator=g, dtype=torch.float64)
        u = u / u.norm(dim=-1, keepdim=True).clamp(min=1e-300)
        for _ in range(iters):
            v = torch.einsum("ia,ijab->ijb", u, blocks)
            v = v / v.norm(dim=-1, keepdim=True).clamp(min=1e-300)
            w = torch.einsum("ijab,ijb->ia", blocks, v)
            val = w.norm(dim=-1)
            best = torch.maximum(best, val)
            u = w / val[:, None].clamp(min=1e-300)
    return best
