"""Certified spectral norms ``||W||_2 = sigma_max(W)`` of matrices and of low-rank products.

Two routes, both returning :class:`~transcover.Interval`:

* :func:`spectral_norm_interval` -- a certified enclosure ``lower <= sigma_max(W) <= upper``.
  Orient ``W`` tall (m >= n), form the float64 Gram ``G = W^T W`` with its rounding error
  bounded, estimate its top eigenpair, then (i) the *lower* end is ``||W v|| / ||v||`` for the
  estimated top eigenvector ``v``, evaluated with its rounding error subtracted -- attained by a
  witness, so it is below sigma_max whatever the estimate's quality; (ii) the *upper* end is a
  ``mu`` for which ``mu I - G`` is proven positive semidefinite by a floating-point Cholesky
  factorisation with an a-posteriori error bound (Note [Cholesky certificate] in ``_certify``).
  The gap is set by how tightly ``mu`` is placed above the estimate; the default places it at a
  relative distance far below ``rtol`` and widens it only if the certificate fails.
* :func:`product_norm_interval` -- the same for ``||A B||_2`` with ``A`` (p, r), ``B`` (r, q),
  ``r`` small (a head's ``W_Q W_K^T`` or ``W_V W_O``): never forms the p x q product.
  ``||AB||_2^2 = lambda_max(G_A G_B)`` with ``G_A = A^T A``, ``G_B = B B^T`` (r x r); with a
  certified upper Cholesky factor ``L L^T >= G_A`` and ``U_B >= G_B``,
  ``lambda_max(G_A G_B) <= lambda_max(L^T U_B L)`` (congruence and Loewner monotonicity), an
  explicit r x r symmetric matrix certified as above.  Cost O((p + q) r^2 + r^3) instead of a
  p x q SVD.

Estimates for ``--fast`` mode (:func:`spectral_norm_estimate`) use Lanczos on ``W^T W`` in float32
without forming it; they carry ``Kind.ESTIMATE``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.linalg import eigh, eigh_tridiagonal

from .._results import Interval, Kind
from ._certify import certify_lambda_max_at_most, gram_with_error, psd_cholesky_upper
from ._floating import U64, down, gamma, sqrt_up, up

__all__ = [
    "spectral_norm_interval",
    "product_norm_interval",
    "spectral_norm_estimate",
    "product_norm_estimate",
    "scale_interval",
]

# Note [slack]: the certificate needs mu strictly above lambda_max of the (perturbed) Gram
# matrix.  We first try mu = theta (1 + slack) with a slack that is tiny compared with any
# sensible rtol (the eigen-solver's estimate theta is accurate to ~n u ||G||), and double it
# until the Cholesky certificate succeeds.  A slack on sigma^2 of s moves sigma by ~s/2.
_FIRST_SLACK = 1e-9


def as_array(W, dtype=np.float64) -> np.ndarray:
    """A numpy array of ``dtype`` from a numpy array or a torch tensor (torch is never imported here)."""
    if hasattr(W, "detach"):  # a torch tensor
        W = W.detach().cpu()
        W = W.double() if dtype == np.float64 else W.float()
        return W.numpy()
    return np.asarray(W, dtype=dtype)


def _as_f64(W) -> np.ndarray:
    return as_array(W, np.float64)


def _amax(W: np.ndarray) -> float:
    return max(float(W.max(initial=0.0)), -float(W.min(initial=0.0)))  # no |W| copy


def _pow2_exponent(amax: float, lim: int = 300) -> int:
    """0 when ``amax`` is 0 or in ``[2^-lim, 2^lim]``; else the ``e`` with ``amax 2^-e`` in [0.5, 1)."""
    if amax == 0.0 or 2.0**-lim <= amax <= 2.0**lim:
        return 0
    return math.frexp(amax)[1]


def _pow2_scale(W: np.ndarray, amax: float | None = None, lim: int = 300) -> tuple[np.ndarray, int]:
    """Scale W by an exact power of two so that max|W| is in [0.5, 1); return (W 2^-e, e).

    Note [scaling]: the error analysis ignores underflow, which is only sound for entries far from
    the subnormal range.  Scaling by a power of two is exact (barring underflow of entries ~1e-300
    times smaller than the largest, whose contribution is covered by the absolute term
    ``_UNDERFLOW`` added to every Gram error bound).  ``W`` is used as it is (``e = 0``, no copy)
    when max|W| is in [2^-lim, 2^lim]: its Gram can neither overflow nor lose mass there.  The
    result is scaled back by :func:`_unscale`, outward where that leaves the normal range.
    """
    e = _pow2_exponent(_amax(W) if amax is None else amax, lim)
    return (W, 0) if e == 0 else (np.ldexp(W, -e), e)


_TINY = float(np.finfo(np.float64).tiny)  # the smallest normal float64
_MAX = float(np.finfo(np.float64).max)


def _unscale(lower: float, upper: float, e: int) -> tuple[float, float]:
    """``(lower 2^e, upper 2^e)`` rounded outward (Note [scaling]): exact in the normal range; a
    subnormal result is rounded to nearest, so it is moved one ulp outward; an upper end past the
    largest float is ``inf`` (the value itself overflows float64) and a lower end there the largest float."""
    if e == 0:
        return lower, upper

    def ldexp(x: float) -> float:
        try:
            return math.ldexp(x, e)
        except OverflowError:
            return math.inf

    lo, hi = ldexp(lower), ldexp(upper)
    lo = max(0.0, down(lo)) if lo < _TINY else min(lo, _MAX)
    return lo, up(hi) if hi < _TINY and upper > 0.0 else hi


_UNDERFLOW = 1e-290


def _lanczos_eigpair(matvec, n: int, dtype=np.float64, *, tol: float, max_steps: int = 200,
                     min_steps: int = 0, check_every: int = 4) -> tuple[float, np.ndarray]:
    """Top eigenpair of a symmetric PSD operator by Lanczos with full reorthogonalisation.

    Only an *estimate*: the certificate does not trust it (Note [slack]), and ``--fast`` labels it
    so.  Every ``check_every`` steps the top Ritz value is computed (the tridiagonal eigen-solve is
    the loop's only non-BLAS cost); the loop stops when it moved by < ``tol`` (relative) since the
    last check, but not before ``min_steps``: with the nearly flat top spectrum of random-like
    weights the Ritz value creeps up slowly and a change test alone can stop too early.
    """
    k_max = min(max_steps, n)
    Q = np.zeros((k_max + 1, n), dtype=dtype)
    q = np.random.default_rng(0).standard_normal(n).astype(dtype)
    Q[0] = q / np.linalg.norm(q)
    breakdown = 50 * float(np.finfo(dtype).eps)
    alphas: list[float] = []
    betas: list[float] = []
    hist: list[float] = []
    for j in range(k_max):
        w = matvec(Q[j])
        alphas.append(float(w @ Q[j]))
        for _ in range(2):  # full reorthogonalisation, twice ("twice is enough")
            w -= Q[: j + 1].T @ (Q[: j + 1] @ w)
        b = float(np.linalg.norm(w))
        last = j + 1 == k_max or b <= breakdown * max(abs(alphas[-1]), 1e-300)
        if last or (j + 1) % check_every == 0:
            hist.append(alphas[0] if j == 0 else float(eigh_tridiagonal(
                np.array(alphas), np.array(betas), eigvals_only=True, select="i", select_range=(j, j))[-1]))
            settled = len(hist) > 1 and abs(hist[-1] - hist[-2]) <= tol * abs(hist[-1])
            if last or (settled and j + 1 >= min_steps):
                if j == 0:
                    return hist[-1], Q[0].copy()
                _, y = eigh_tridiagonal(np.array(alphas), np.array(betas), select="i", select_range=(j, j))
                return hist[-1], Q[: j + 1].T @ y[:, -1]  # the Ritz vector, once
        betas.append(b)
        Q[j + 1] = w / b
    raise AssertionError("unreachable: the last step always returns")


def _top_eigpair(K: np.ndarray) -> tuple[float, np.ndarray]:
    n = K.shape[0]
    if n > 256:  # Lanczos: O(k n^2) instead of the O(n^3) tridiagonalisation
        return _lanczos_eigpair(lambda x: K @ x, n, tol=1e-11)
    w, V = eigh(K, subset_by_index=[n - 1, n - 1], check_finite=False, driver="evr")
    if w.size == 0:  # dsyevr can return no eigenvalue for clustered spectra; the full solver cannot
        w, V = np.linalg.eigh(K)
        return float(w[-1]), V[:, -1]
    return float(w[0]), V[:, 0]


def _upper_from_certificate(K_hat: np.ndarray, err: float, theta: float, rtol: float) -> tuple[float, bool]:
    """The smallest mu = theta(1 + slack) + err we can certify, trying slack up to ~rtol."""
    base = max(theta, 0.0)
    floor = max(err, 1e-300) + gamma(K_hat.shape[0] + 1) * float(np.abs(np.diag(K_hat)).sum())
    slack = _FIRST_SLACK
    while True:
        mu = up(base * (1.0 + slack) + 2.0 * err + floor * slack / _FIRST_SLACK)
        if certify_lambda_max_at_most(K_hat, err, mu):
            return mu, slack <= rtol
        if slack > 1.0:  # give up tightening: the trace is always a certified bound for PSD K
            return up(float(np.abs(np.diag(K_hat)).sum()) * (1 + gamma(K_hat.shape[0])) + K_hat.shape[0] * err), False
        slack *= 8.0


def _norm_lower(x: np.ndarray) -> float:
    """A lower bound on ||x||_2 from float64 evaluation (scaled by a power of two where its squares
    could overflow or underflow, Note [scaling])."""
    x, e = _pow2_scale(x, lim=_VECTOR_LIM)
    v = float(np.sqrt(np.dot(x, x)))
    return _unscale(max(0.0, down(v * (1.0 - gamma(x.size + 2)))), 0.0, e)[0]


def _norm_upper(x: np.ndarray) -> float:
    """An upper bound on ||x||_2 (scaled as in :func:`_norm_lower`)."""
    x, e = _pow2_scale(x, lim=_VECTOR_LIM)
    v = float(np.sqrt(np.dot(x, x)))
    return _unscale(0.0, up(v * (1.0 + gamma(x.size + 2))), e)[1]


# a vector's entries up to 2^450 square to at most 2^900, far from overflow for any length below 2^120;
# entries down to 2^-450 square to normal numbers, and squares that underflow relative to the largest
# lose at most n 2^-1074 of a sum >= 2^-900 (far inside gamma_{n+2})
_VECTOR_LIM = 450


def _fro(X: np.ndarray) -> float:
    return sqrt_up(float(np.einsum("ij,ij->", X, X)) * (1.0 + gamma(X.size)))


def spectral_norm_interval(W, *, rtol: float = 1e-3, gram: tuple[np.ndarray, float] | None = None) -> Interval:
    """Certified enclosure of ``sigma_max(W)`` (the spectral norm ``||W||_2``).

    .. math::

        \\|W v\\|_2 / \\|v\\|_2 \\;\\le\\; \\sigma_{\\max}(W) \\;\\le\\; \\sqrt{\\mu},
        \\qquad \\mu I - W^\\top W \\succeq 0 \\text{ (proven by Cholesky)}

    Source: the variational characterisation of sigma_max and the Cholesky certificate of
    ``_certify`` (Rump 2006; Higham 2002, Thm 10.3); seed section 2.1 quantities.
    Assumptions: ``W`` is given exactly by its float values (bf16/fp16/float32 upcast to float64 is
    exact); no overflow (entries far below 1e150).

    Args:
        W: a 2-D tensor or array.
        rtol: the target relative gap ``(upper - lower) / upper``.
        gram: optionally ``(G, err)`` with ``G`` the float64 Gram of the *small side* of ``W`` and
            ``err >= ||G - exact||_2`` (e.g. from a batched computation); then ``W`` must be in the
            safe range of :func:`in_safe_range`.

    Returns:
        Interval of kind ``CERTIFIED_INTERVAL`` with ``method`` naming the route.

    Example:
        >>> import numpy as np
        >>> iv = spectral_norm_interval(np.diag([3.0, 1.0]))
        >>> iv.lower <= 3.0 <= iv.upper and iv.relative_gap < 1e-6
        True
    """
    W = _as_f64(W)
    if W.ndim != 2:
        raise ValueError(f"spectral_norm_interval needs a matrix, but got shape {W.shape}")
    if W.size == 0:
        return Interval(0.0, 0.0, Kind.CERTIFIED_INTERVAL, "empty")
    if W.shape[0] < W.shape[1]:
        W = W.T  # tall: the Gram matrix is the small side
    m, n = W.shape
    wmax, wmin = float(W.max()), float(W.min())  # NaN and Inf show up here: no separate pass
    if not (math.isfinite(wmax) and math.isfinite(wmin)):
        raise ValueError("spectral_norm_interval: matrix has NaN or Inf entries")
    if gram is not None and gram[0].shape != (n, n):
        gram = None  # a Gram of the other side (W was wide): compute the small one here
    if gram is not None:
        e = 0
        G, err = gram
    else:
        W, e = _pow2_scale(W, max(wmax, -wmin))
    if max(wmax, -wmin) == 0.0:
        return Interval(0.0, 0.0, Kind.CERTIFIED_INTERVAL, "zero matrix")
    if n == 1:  # a vector: ||w||_2 directly
        col = W[:, 0]
        return Interval(*_unscale(_norm_lower(col), _norm_upper(col), e), Kind.CERTIFIED_INTERVAL, "vector norm")
    if gram is None:
        G, err = gram_with_error(W)
    # Note [scaling]: LAPACK's eigensolver is not scale-equivariant bit for bit (dsyevr's top eigenvector moves by an
    # ulp under G -> 4^k G for about half of random Grams), so the certificate runs on G 4^-g with max|W 2^-g| in
    # [1/2, 1) (exact; a given Gram is copied, ours scaled in place): the interval is then the same floats times 2^(e+g)
    # at every scale of W.  Entries that underflow in the scaling are covered by _UNDERFLOW, added after it.
    g = math.frexp(math.ldexp(max(wmax, -wmin), -e))[1]
    if g:
        G = np.ldexp(G, -2 * g, out=G if gram is None else None)
        err = math.ldexp(err, -2 * g)
    err += _UNDERFLOW
    theta, v = _top_eigpair(G)
    # lower end: a witness vector, rounding error of W v subtracted (|fl(Wv) - Wv| <= gamma_n |W||v|)
    y = W @ v
    # ||W||_F^2 = trace(W^T W) <= trace(fl(G)) / (1 - gamma_m): no extra pass over W (G and err at 4^-g)
    fro_W = math.ldexp(sqrt_up(float(np.trace(G)) * (1.0 + 2.0 * gamma(m)) + n * err), g)
    slack_abs = gamma(n) * fro_W * _norm_upper(v)
    lower = math.ldexp(max(0.0, down((_norm_lower(y) - slack_abs) / _norm_upper(v))), -g)  # at 2^-g: exact
    mu, _ = _upper_from_certificate(G, err, theta, rtol)
    upper = max(sqrt_up(mu), lower)
    return Interval(*_unscale(lower, upper, e + g), Kind.CERTIFIED_INTERVAL, "gram+cholesky certificate")


def in_safe_range(*arrays: np.ndarray) -> bool:
    """True when no power-of-two rescaling is needed (Note [scaling]): max|x| in [2^-300, 2^300]."""
    return all(_pow2_exponent(_amax(a)) == 0 for a in arrays)


def product_norm_interval(A, B, *, rtol: float = 1e-3,
                          grams: tuple[np.ndarray, float, np.ndarray, float] | None = None) -> Interval:
    """Certified enclosure of ``||A B||_2`` for ``A`` (p, r), ``B`` (r, q) without forming ``A B``.

    .. math::

        \\|AB\\|_2^2 = \\lambda_{\\max}(G_A G_B) \\le \\lambda_{\\max}(L^\\top U_B L),\\quad
        L L^\\top \\succeq A^\\top A,\\; U_B \\succeq B B^\\top

    Used for ``W_KQ^h = W_Q^h (W_K^h)^T`` and ``W_OV^h = W_V^h W_O^h`` (rank <= d_head), the
    structure exploitation asked for by issue 2: an r x r problem instead of a d x d SVD.
    Lower end: ``||A B z|| / ||z||`` at ``z = B^T L y`` with ``y`` the top eigenvector of
    ``L^T U_B L``, rounding subtracted.  Same assumptions as :func:`spectral_norm_interval`.
    ``grams`` optionally gives ``(G_A, e_A, G_B, e_B)`` computed elsewhere (batched over heads),
    with errors bounded as in ``_certify``; the factors must then be :func:`in_safe_range`.
    """
    A = _as_f64(A)
    B = _as_f64(B)
    if A.ndim != 2 or B.ndim != 2 or A.shape[1] != B.shape[0]:
        raise ValueError(f"product_norm_interval needs A (p, r) and B (r, q), but got {A.shape} and {B.shape}")
    if not (np.isfinite(A).all() and np.isfinite(B).all()):
        raise ValueError("product_norm_interval: a factor has NaN or Inf entries")
    # Note [scaling]: each factor is scaled to max|x| in [1/2, 1) (exact; copies of these thin factors), so that
    # neither K = L^T U_B L nor the witness A B z can overflow or underflow (factors at 2^223 and 2^292 overflowed K),
    # and the interval is the same floats times 2^(ea + eb) at every scale (LAPACK's eigensolver is not
    # scale-equivariant bit for bit); given Grams by 4^-ea, 4^-eb (copies; entries that underflow there are covered
    # by _UNDERFLOW, added after)
    ea, eb = math.frexp(_amax(A))[1], math.frexp(_amax(B))[1]
    A, B = (np.ldexp(A, -ea) if ea else A), (np.ldexp(B, -eb) if eb else B)
    if not A.any() or not B.any():
        return Interval(0.0, 0.0, Kind.CERTIFIED_INTERVAL, "zero factor")
    p, r = A.shape
    q = B.shape[1]
    if grams is None:
        G_A, e_A = gram_with_error(A)  # A^T A, r x r
        G_B, e_B = gram_with_error(B.T)  # B B^T, r x r
    else:
        G_A, e_A, G_B, e_B = grams
        G_A, e_A = np.ldexp(G_A, -2 * ea), math.ldexp(e_A, -2 * ea)
        G_B, e_B = np.ldexp(G_B, -2 * eb), math.ldexp(e_B, -2 * eb)
    e_A += _UNDERFLOW
    e_B += _UNDERFLOW
    L = psd_cholesky_upper(G_A, e_A)
    U_B = G_B.copy()
    bump = up(e_B + 2 * U64 * (float(np.abs(np.diag(G_B)).max(initial=0.0)) + e_B))
    U_B[np.diag_indices(r)] += bump
    P = U_B @ L
    K = L.T @ P
    K = 0.5 * (K + K.T)  # exact symmetrisation is not needed for the bound; keeps eigh happy
    fro_L, fro_P, fro_U = _fro(L), _fro(P), _fro(U_B)
    # |fl(U L) - U L| <= gamma_r |U||L|;  |fl(L^T P_fl) - L^T P_fl| <= gamma_r |L^T||P_fl|;
    # symmetrising averages K and K^T, which moves it by at most that much again.
    err_K = up(2.0 * gamma(r) * (fro_L * fro_P + fro_L * fro_L * fro_U) * (1.0 + gamma(4)))
    theta, y = _top_eigpair(K)
    mu, _ = _upper_from_certificate(K, err_K, theta, rtol)
    upper = sqrt_up(mu)
    # lower end: witness z = B^T (L y)
    z = B.T @ (L @ y)
    t = B @ z
    w = A @ t
    z_up = _norm_upper(z)
    if z_up == 0.0:
        lower = 0.0
    else:
        A_f, B_f = _fro(A), _fro(B)
        slack_abs = up(A_f * gamma(q) * B_f * z_up + gamma(r) * A_f * _norm_upper(t))
        lower = max(0.0, down((_norm_lower(w) - slack_abs) / z_up))
    upper = max(upper, lower)
    return Interval(*_unscale(lower, upper, ea + eb), Kind.CERTIFIED_INTERVAL, "low-rank gram+cholesky certificate")


def scale_interval(iv: Interval, c: float) -> Interval:
    """``c * iv`` for ``c >= 0``, rounded outward (keeps the certificate)."""
    if c < 0:
        raise ValueError(f"scale_interval needs c >= 0, but got c={c}")
    return Interval(max(0.0, down(iv.lower * c)), up(iv.upper * c), iv.kind, iv.method)


# ---------------------------------------------------------------------------------------------
# Estimates (--fast): no certificate, Kind.ESTIMATE.


def spectral_norm_estimate(W, *, rtol: float = 1e-3) -> Interval:
    """Lanczos estimate of ``sigma_max(W)`` in float32 (``--fast``); no guarantee (Kind.ESTIMATE).

    Lanczos on ``W^T W`` (small side) without forming it; stops when the Ritz value settles to
    ``rtol / 100``.  Small sides (<= 128) take the float32 Gram's top eigenvalue directly.
    """
    # W^T W overflowed float32 for entries above ~1e19 (and float64 ones are cast): the estimate runs on W / 2^k
    # with the largest entry in [1/2, 1), exact in binary, and is scaled back (red team 37f)
    k = _unit_exponent(W)
    W = as_array(W if k == 0 else W * 2.0**-k, np.float32)
    if W.shape[0] < W.shape[1]:
        W = W.T
    n = W.shape[1]
    if n <= 128:
        G = W.T @ W
        s = math.sqrt(max(float(eigh(G, eigvals_only=True, subset_by_index=[n - 1, n - 1], driver="evr")[-1]), 0.0))
    else:
        lam, _ = _lanczos_eigpair(lambda x: W.T @ (W @ x), n, np.float32, tol=rtol / 1000, min_steps=30,
                                  check_every=2)
        s = math.sqrt(max(lam, 0.0))
    s = _ldexp_inf(s, k)
    return Interval(s, s, Kind.ESTIMATE, "lanczos float32")


def _ldexp_inf(x: float, k: int) -> float:
    """``x * 2^k``, inf where it overflows (math.ldexp raises)."""
    try:
        return math.ldexp(x, k)
    except OverflowError:
        return math.inf


def _unit_exponent(W) -> int:  # noqa: ANN001  (numpy array or torch tensor)
    """``k`` with ``max|W| / 2^k`` in ``[1/2, 1)`` (0 for a zero, empty or non-finite W)."""
    m = float(abs(W).max()) if getattr(W, "size", 1) and (not hasattr(W, "numel") or W.numel()) else 0.0
    return math.frexp(m)[1] if 0.0 < m < math.inf else 0


def product_norm_estimate(A, B, *, rtol: float = 1e-3) -> Interval:
    """Estimate of ``||A B||_2`` from the r x r problem (in the inputs' precision), no certificate."""
    A = np.asarray(A)
    B = np.asarray(B)
    ka, kb = _unit_exponent(A), _unit_exponent(B)  # the Grams overflowed for entries above ~1e77 (37f)
    A, B = A * 2.0**-ka, B * 2.0**-kb
    G_A = A.T @ A
    G_B = B @ B.T
    lam = float(np.max(np.linalg.eigvals(G_A @ G_B).real))
    s = _ldexp_inf(math.sqrt(max(lam, 0.0)), ka + kb)
    return Interval(s, s, Kind.ESTIMATE, "low-rank eigenvalues")
