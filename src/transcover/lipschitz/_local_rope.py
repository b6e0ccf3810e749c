"""RoPE attention on a ball around real data: the rotated scores and per-pair score gradients (THEORY F107).

Note [local RoPE attention].  Row convention, one head: ``q_i = x_i W_Q + b_Q``, ``k_j = x_j W_K + b_K`` and the
rotation ``R_t`` of position ``t`` (``model.apply_rope``: planes ``(c, c + r/2)`` of the first ``r`` coordinates by
the angles ``t theta_c``, ``theta`` the spec's float64 frequencies ``inv_freq(d_head, T)``; the rest unrotated), so
``s_ij = sc q_i R_i R_j^T k_j^T = sc q_i R_{i-j} k_j^T`` (``R_i R_j^T = R_{i-j}``: the planes commute).  Its
gradients are per pair: ``d s_ij / d x_j = p_ij = sc (q_i R_{i-j}) W_K^T`` and ``d s_ij / d x_i = r_ij = sc (k_j
R_{j-i}) W_Q^T``.  Note [local attention bound]'s argument holds with them in place of ``q_i`` and ``G y_j``:

    ||d g_i|| <= ||W_V|| + S_V (S_G + Q_i),   S_G^2 = sum_j P_ij ||r_ij - m_i||^2,   Q_i^2 = sum_j P_ij ||p_ij||^2

(``sum_j P_ij y_j = 0`` lets any ``m_i`` independent of ``j`` be subtracted from ``r_ij``; Cauchy-Schwarz for the
``p_ij`` term).  On the ball the score of ``(i, j)``, shifted by ``e_i . m_i`` (the same for the whole row: softmax is
invariant), moves by ``e_i . (r_ij - m_i) + p_ij . e_j + sc e_i W_Q R_{i-j} W_K^T e_j``, at most ``Delta_ij =
rho (||r_ij - m_i|| + ||p_ij|| + G rho)`` with ``G = sc ||W_Q|| ||W_K||`` (every ``R`` is orthogonal); a moved
``r'_ij`` or ``p'_ij`` is within ``G rho`` of ``r_ij``, ``p_ij``, and the weighted second moments about the fixed
``m_i`` bound the moved variances as in that Note.  ``m_i`` is the P-weighted mean of the formed ``r_ij``.

Rounding: the rotated vectors are formed in float64 with libm's cos/sin of ``fl(delta theta_c)``; against the exact
rotation each coordinate pair errs by at most ``2 (eps_a + gamma_2 (1 + eps_a))`` of its norm, ``eps_a = u (|delta|
theta_max + 2)`` (the angle's rounding, and cos/sin within 2 ulps: an assumption on libm), so a rotated vector is
within ``eta ||v||`` of the exact one (``rotation_error``).  The weights' scores are formed to about twice the working
precision (``rotate_dd``: cos/sin of the exact angles to 106 bits by mpmath, then error-free products), so Note
[formed attention weights] applies unchanged.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from ..model import to_tensor
from ._rounding import _U, _gamma, _veltkamp, product_row_error, product_row_norms, two_sum

__all__ = ["rope_inv_freq", "rotate_dd", "rotation_error", "rope_pair_terms"]


def _f64(W) -> Tensor:  # noqa: ANN001
    return to_tensor(W, dtype=torch.float64).detach()


def rope_inv_freq(attn, T: int) -> Tensor:  # noqa: ANN001
    """The float64 frequencies a sequence of T tokens rotates with (``model.apply_rope``'s)."""
    return attn.rope.inv_freq(attn.d_head, T).to(torch.float64)


@lru_cache(maxsize=32)
def _cos_sin_dd(inv: tuple[float, ...], T: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """cos and sin of the exact angles ``t theta_c`` (t = 0..T-1), each as ``hi + lo`` within ``2^-100`` (mpmath at
    128 bits; ``theta_c`` the exact float64 frequencies)."""
    import mpmath as mp

    ch, cl, sh, sl = (torch.empty(T, len(inv), dtype=torch.float64) for _ in range(4))
    with mp.workprec(128):
        for c, th in enumerate(inv):
            for t in range(T):
                a = mp.mpf(t) * mp.mpf(th)
                for (h, l_), v in (((ch, cl), mp.cos(a)), ((sh, sl), mp.sin(a))):
                    hi = float(v)
                    h[t, c], l_[t, c] = hi, float(v - hi)
    return ch, cl, sh, sl


_CS_ERR = 2.0**-100


def _two_prod(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(p, r, lost)``: ``p + r = a b`` exactly where ``|p| >= 2^-960`` (Dekker on Veltkamp's halves; ``|a|, |b|`` far
    below overflow), elsewhere ``r = 0`` and ``lost = 2^-1012`` bounds the dropped part (as ``accurate_product``)."""
    p = a * b
    ah, al = _veltkamp(a)
    bh, bl = _veltkamp(b)
    r = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    ok = p.abs() >= 2.0**-960
    return p, torch.where(ok, r, torch.zeros_like(r)), torch.where(ok, 0.0, 2.0**-1012).to(p.dtype)


def _swap(x: Tensor, rd: int) -> Tensor:
    """``apply_rope``'s partner coordinates: ``[-x[half:rd], x[:half]]`` (exact), zeros beyond ``rd``."""
    half = rd // 2
    return torch.cat([-x[..., half:rd], x[..., :half], torch.zeros_like(x[..., rd:])], dim=-1)


def rotate_dd(hi: Tensor, lo: Tensor, err: Tensor, inv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""Rows ``t = 0..T-1`` of a matrix known as ``hi + lo`` within ``err`` (entrywise; e.g. ``accurate_product``'s,
    any common units), rotated by ``R_t`` (``apply_rope``'s layout, exact angles ``t theta``): ``(hi', lo', err')``
    with ``|hi' + lo' - (x R_t)| <= err'`` for every ``x`` within ``err`` of ``hi + lo`` (THEORY F107).

    Per coordinate ``x_c C_t + x~_c S_t`` (``x~`` the partner, ``C = Ch + Cl``, ``S = Sh + Sl`` within ``2^-100``):
    ``hi x Ch`` and ``hi~ x Sh`` error-free (``_two_prod``) and their sum by TwoSum; the nine correction terms
    summed in float64 within ``gamma_9 sum|terms|``; then ``TwoSum`` with the high part (exact).  The input's error
    adds ``err |C| + err~ |S|``, the tables' ``(|x| + |x~|) 2^-100``."""
    T, dh = hi.shape
    rd = 2 * inv.numel()
    ch, cl, sh, sl = _cos_sin_dd(tuple(float(v) for v in inv), T)
    pad = lambda A, fill: torch.cat([A, A, torch.full((T, dh - rd), fill, dtype=torch.float64)], dim=1)  # noqa: E731
    Ch, Cl, Sh, Sl = pad(ch, 1.0), pad(cl, 0.0), pad(sh, 0.0), pad(sl, 0.0)
    xh, xl, xe = hi, lo, err
    yh, yl, ye = _swap(hi, rd), _swap(lo, rd), _swap(err, rd).abs()
    p1, r1, l1 = _two_prod(xh, Ch)
    p2, r2, l2 = _two_prod(yh, Sh)
    s, e = two_sum(p1, p2)
    terms = [r1, r2, e, xh * Cl, xl * Ch, xl * Cl, yh * Sl, yl * Sh, yl * Sl]
    c = sum(terms[1:], terms[0])
    cabs = sum((t.abs() for t in terms[1:]), terms[0].abs())
    H, L = two_sum(s, c)
    g = _gamma(9)
    aC, aS = Ch.abs() + Cl.abs() + _CS_ERR, Sh.abs() + Sl.abs() + _CS_ERR
    ax, ay = xh.abs() + xl.abs() + xe, yh.abs() + yl.abs() + ye
    E = (g * (1 + 2 * g) * cabs + xe * aC + ye * aS + (ax + ay) * _CS_ERR + l1 + l2) * (1 + 4 * _U) + 9 * 2.0**-1074
    return H, L, E


def rotation_error(inv: Tensor, max_offset: int) -> float:
    """``eta``: a float64 rotation by ``R_delta`` (``|delta| <= max_offset``; ``fl(delta theta)``, libm cos/sin within
    2 ulps, one product and one sum per coordinate) is within ``eta ||v||`` of the exact one (Note [local RoPE
    attention])."""
    th = float(inv.abs().max()) if inv.numel() else 0.0
    ea = _U * (max_offset * th + 2.0) * (1 + 1e-9)
    return 2.0 * (ea + _gamma(2) * (1 + ea)) * (1 + 1e-9)


def _rotate(x: Tensor, ang: Tensor, rd: int) -> Tensor:
    """``x R`` in float64 for per-row angles ``ang`` (..., rd/2) broadcast against ``x`` (..., d_head)."""
    cos = torch.cat([ang.cos(), ang.cos(), torch.ones_like(x[..., rd:])], dim=-1)
    sin = torch.cat([ang.sin(), ang.sin(), torch.zeros_like(x[..., rd:])], dim=-1)
    return x * cos + _swap(x, rd) * sin


def rope_pair_terms(attn, X: Tensor, h: int, P: Tensor) -> tuple[Tensor, Tensor]:  # noqa: ANN001
    r"""``(pn, rn)`` (T, T) of head ``h`` at ``X`` (THEORY F107, Note [local RoPE attention]): certified upper bounds
    on ``||p_ij|| = sc ||(q_i R_{i-j}) W_K^T||`` and ``||r_ij - m_i|| = sc ||(k_j R_{j-i} - kbar_i) W_Q^T||`` with the
    fixed ``kbar_i = sum_j P_ij fl(k_j R_{j-i})`` (formed, so exactly independent of ``j``).  Each bound is the formed
    product's certified row norm (``product_row_norms``) plus ``||W|| (eta ||v|| + e_v)``: ``eta`` the rotation's
    error (``rotation_error``), ``e_v`` the projection's (``product_row_error``), and for ``r`` the subtraction's
    ``u`` relative.  ``sc >= 0``."""
    from ._weights import spectral

    X = X.detach().double()
    T = X.shape[0]
    Wq, Wk, _, _ = (_f64(W) for W in attn.head(h))
    bq = None if attn.b_Q is None else _f64(attn.b_Q)[h]
    bk = None if attn.b_K is None else _f64(attn.b_K)[attn.kv_index(h)]
    sc = attn.softmax_scale
    inv = rope_inv_freq(attn, T)
    rd = 2 * inv.numel()
    ones = torch.ones(T, 1, dtype=torch.float64)
    Xa = torch.cat([X, ones], dim=1)
    Wqa = torch.cat([Wq, (torch.zeros(1, Wq.shape[1], dtype=torch.float64) if bq is None else bq[None])], dim=0)
    Wka = torch.cat([Wk, (torch.zeros(1, Wk.shape[1], dtype=torch.float64) if bk is None else bk[None])], dim=0)
    q, k = Xa @ Wqa, Xa @ Wka
    eq, ek = product_row_error(Xa, Wqa), product_row_error(Xa, Wka)  # (T,) each
    nq, nk = q.norm(dim=-1) * (1 + 1e-12), k.norm(dim=-1) * (1 + 1e-12)
    eta = rotation_error(inv, T - 1)
    nWq, nWk = spectral(Wq) * (1 + 1e-12), spectral(Wk) * (1 + 1e-12)
    pos = torch.arange(T, dtype=torch.float64)
    off = pos[:, None] - pos[None, :]  # i - j
    ang = off[:, :, None] * inv[None, None, :]  # (T, T, rd/2)
    U = _rotate(q[:, None, :].expand(T, T, -1), ang, rd)  # q_i R_{i-j}
    V = _rotate(k[None, :, :].expand(T, T, -1), -ang, rd)  # k_j R_{j-i}
    pn = sc * (product_row_norms(U, Wk.T) + nWk * (eta * nq[:, None] + eq[:, None])) * (1 + 1e-12)
    kbar = (P[:, :, None] * V).sum(dim=1)  # (T, dh)
    D = V - kbar[:, None, :]
    eD = _U * D.norm(dim=-1) * (1 + 1e-9) + eta * nk[None, :] + ek[None, :]
    rn = sc * (product_row_norms(D, Wq.T) + nWq * eD * (1 + 1e-12)) * (1 + 1e-12)
    return pn, rn
