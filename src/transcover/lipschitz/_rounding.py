"""Rounding for the local routes (issue 12): Higham's ``gamma_k``, the relative error of ``k`` float64 roundings; norms
formed at powers of two (THEORY F96); and formed products with their rounding (THEORY F97).

One place for the unit roundoff these bounds read: a test that evaluates a stage in float32 sets ``_U`` here to
``2^-24`` and every ``gamma_k`` follows (``tests/lipschitz/test_local_stack.py``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_U = 2.0**-53
_TINY = torch.finfo(torch.float64).tiny
_TINY_SUB = 2.0**-1074  # the smallest subnormal float64


def _gamma(k: int, u: float | None = None) -> float:
    """``gamma_k = k u / (1 - k u)`` (Higham, *Accuracy and Stability of Numerical Algorithms*, Lemma 3.1): a product of
    ``k`` factors ``(1 + delta_i)^{+-1}``, ``|delta_i| <= u``, lies within ``gamma_k`` of 1 when ``k u < 1``.  ``u``: this
    module's ``_U`` unless given (the error-free products pass their own dtype's)."""
    u = _U if u is None else u
    return k * u / (1 - k * u)


def pow2_exponent(top: Tensor, lim: int = 0) -> Tensor:
    """The exponent ``e`` with ``top 2^-e`` in ``[1/2, 1)`` (``frexp``) where ``top`` (a largest ``|entry|``, >= 0) is
    positive and finite and, for ``lim > 0``, outside ``[2^-lim, 2^lim]``; else 0 (left as it is).  In ``top``'s
    dtype.  The one form of the power-of-two scalings of THEORY F96 (exact: ``ldexp`` by ``-e``, undone at the end)."""
    ok = (top > 0) & torch.isfinite(top)
    if lim:
        ok = ok & ((top < 2.0**-lim) | (top > 2.0**lim))
    return torch.where(ok, torch.frexp(top).exponent, 0).to(top.dtype)


def root_sq_plus(x: Tensor, c: float) -> Tensor:
    """``fl(sqrt(x^2 + c))`` per entry of ``x >= 0`` for a constant ``c >= 0`` (a norm's ``s = sqrt(sigma^2 + eps)``) with
    the relative error of the normal range (THEORY F96): where ``x^2 + c`` falls below ``2^-1000`` the square or the sum
    could round as subnormals (at ``x ~ 2^-530`` with ``eps = 0`` up to ``2^-15`` relative: ``norm_local`` certified
    0.2 % below the exact constant), so there the same operations run on ``x 2^-k`` and ``c 2^-2k`` (``k``, from
    ``pow2_exponent``, brings the larger of ``x`` and ``sqrt c`` to ``[1/2, 1)``; each scaling in steps of at most
    ``2^537``, exact) and the root is scaled back by ``2^k`` (exact unless the root itself is subnormal).  The same floats
    as the plain form wherever ``2^-1000 <= x^2 + c <= 2^1000``; above, where ``x^2`` overflowed for ``x >= 2^512`` and
    ``s`` came out ``inf`` (so a constant ``max|gamma|/s`` came out 0, below the exact one: stop 36, closed at stop 38),
    the same scaling."""
    x2c = x * x + c
    low = (x2c < 2.0**-1000) | (x2c > 2.0**1000)
    if not bool(low.any()):
        return torch.sqrt(x2c)
    k = pow2_exponent(torch.maximum(x, torch.full_like(x, math.sqrt(c)))).to(torch.int64)
    h = torch.div(k, 2, rounding_mode="floor")
    xs = torch.ldexp(torch.ldexp(x, -h), h - k)
    cs = torch.ldexp(torch.ldexp(torch.full_like(x, c), -k), -k)
    return torch.where(low, torch.ldexp(torch.sqrt(xs * xs + cs), k), torch.sqrt(x2c))


def pow2_norm(A: Tensor, dims: tuple | int | None = None) -> Tensor:
    """Frobenius norms of ``A`` over ``dims`` (default: all) as float64 computes them, each formed at the power of two
    that brings its largest entry to ``[1/2, 1)`` (exact scalings), so no square under- or overflows: ``torch``'s norm
    squares as it goes, and a matrix of entries ``2^-600`` had norm 0 (THEORY F81d).  In the normal range the very
    floats of ``torch``'s norm; a positive result below the smallest normal float (rounded to nearest when scaled
    back) is moved one ulp up.  Where every plain norm lies in ``[2^-400, 2^400]`` that is the result (one pass): no
    square overflowed, and the squares that flushed lose at most ``n 2^-1075`` of a sum above ``2^-800`` (``n`` entries),
    far inside any caller's relative pad.  Unpadded: the caller adds its sum's rounding."""
    dims = tuple(range(A.dim())) if dims is None else (dims,) if isinstance(dims, int) else tuple(dims)
    plain = torch.linalg.vector_norm(A, dim=dims)
    if A.numel() == 0 or bool(((plain >= 2.0**-400) & (plain <= 2.0**400)).all()):
        return plain
    m = A.abs().amax(dim=dims, keepdim=True)
    s = torch.ldexp(torch.ones_like(m), -pow2_exponent(m).clamp(-1000, 1000))
    r = torch.linalg.vector_norm(A * s, dim=dims)
    r = r / s.reshape(r.shape)
    return torch.where((r > 0) & (r < _TINY), torch.nextafter(r, torch.full_like(r, math.inf)), r)


def product_row_error(A: Tensor, *Ws: Tensor) -> Tensor:
    """Per row of ``A`` (..., k), a bound on ``||fl((A W_1) W_2 ...) - A W_1 W_2 ...||``, the formed product's
    rounding: ``gamma_K || |A| |W_1| |W_2| ... ||`` with ``K`` the sum of the inner dimensions (Higham Lemma 3.5 once
    per product, ``gamma_a + gamma_b + gamma_a gamma_b <= gamma_{a+b}``; THEORY F97), padded for its own evaluation
    (non-negative terms: relative ``gamma_K``), plus what underflow adds (``_underflow_rows``).  A norm of the formed
    product padded only relative to itself falls short of the exact one where the product cancels.  Norms at powers
    of two (``pow2_norm``, THEORY F96)."""
    R = A.abs()
    for W in Ws:
        R = R @ W.abs()
    return _gamma(sum(W.shape[0] for W in Ws)) * pow2_norm(R, -1) * (1 + 1e-12) + _underflow_rows(Ws)


def _underflow_rows(Ws: tuple[Tensor, ...]) -> float:
    """A bound on what gradual underflow adds to a row of ``fl((A W_1) W_2 ...)``'s error, and to the row of the
    ``|A||W_1|...`` chain that bounds the rest, beyond Higham's relative model (THEORY F97, closed at stop 35): each
    product of the ``s``-th step rounds by at most ``2^-1075`` absolute (Higham 2.2 with underflow; sums are exact
    there), so that step's row error is at most ``k_s 2^-1075 n_s^{1/2}`` in norm (``k_s`` its inner, ``n_s`` its outer
    dimension), carried by ``||W_t||_F`` through the later factors; twice that, for the chain of magnitudes.  Formed in
    base-2 logarithms (no over- or underflow; a positive value below ``2^-1074`` is given as ``2^-1074``).  On data of
    the normal range it is below ``2^-1000`` of every caller's values: it matters only where a product underflows
    (``2^-540 * 2^-540 * 2^1000`` was certified 0 against an exact ``2^-80``)."""
    norms = [float(pow2_norm(W)) * (1 + 1e-12) for W in Ws]
    total = 0.0
    for s, W in enumerate(Ws):
        later = norms[s + 1:]
        if W.shape[0] == 0 or W.shape[1] == 0 or any(v == 0.0 for v in later):
            continue
        if any(math.isinf(v) or math.isnan(v) for v in later):
            return math.inf
        lg = math.log2(W.shape[0]) + 0.5 * math.log2(W.shape[1]) - 1074 + sum(math.log2(v) for v in later) + 1e-9
        total += math.inf if lg > 1023 else math.nextafter(2.0**lg, math.inf) if lg > -1074 else _TINY_SUB
    return total * (1 + 1e-12) if total else 0.0


def product_row_norms(A: Tensor, *Ws: Tensor) -> Tensor:
    """Per row of ``A``, a certified upper bound on the exact product's row norm ``||(A W_1 W_2 ...)_i||``: the formed
    row's norm plus ``product_row_error`` (THEORY F97); ``inf`` where the formed product overflowed (a NaN norm)."""
    R = A
    for W in Ws:
        R = R @ W
    out = (pow2_norm(R, -1) * (1 + 1e-12) + product_row_error(A, *Ws)) * (1 + 1e-12)
    return torch.nan_to_num(out, nan=math.inf)


def two_sum(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Knuth's TwoSum (*TAOCP* vol. 2, 4.2.2; Higham Alg. 4.4): ``s = fl(a + b)`` and ``e`` with ``s + e = a + b``
    exactly, for every pair of finite floats whose sum does not overflow (subnormals included).  THEORY F99."""
    s = a + b
    bv = s - a
    return s, (a - (s - bv)) + (b - bv)


def pow2_steps(e: int) -> int:
    """How many multiplications ``pow2_scale(A, e)`` makes: each by a power of two within ``2^+-1000``."""
    return max(1, -(-abs(e) // 1000))


def pow2_scale(A: Tensor, e: int) -> Tensor:
    """``A 2^e`` by ``pow2_steps(e)`` multiplications, each by ``2^k`` with ``|k| <= 1000`` (``2^e`` alone leaves
    float64 beyond ``|e| = 1023``: ``2.0**1024`` raised ``OverflowError``).  Exact wherever the result is a normal
    float; where it is subnormal each step rounds at most once, by ``2^-1075`` (``pow2_steps(e) 2^-1075`` in all);
    beyond the range it is ``+-inf`` (0 stays 0)."""
    n = pow2_steps(e)
    for i in range(n):
        A = A * 2.0 ** (e * (i + 1) // n - e * i // n)
    return A


def _veltkamp(a: Tensor) -> tuple[Tensor, Tensor]:
    """Veltkamp's split ``a = hi + lo`` (exactly), each half of at most ``ceil(p/2)`` significant bits (``p`` the
    precision of ``a``'s dtype); needs ``|a|`` far below the overflow threshold (the callers scale to ``[1/2, 1)``)."""
    p = round(-math.log2(torch.finfo(a.dtype).eps)) + 1
    c = (2.0 ** ((p + 1) // 2) + 1) * a
    hi = c - (c - a)
    return hi, a - hi


def accurate_product(A: Tensor, B: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    r"""``(hi, lo, err, e)`` with ``|2^e (hi + lo) - A B| <= 2^e err`` entrywise: the product of ``A`` (m, n) and ``B``
    (n, N) to about twice the working precision (THEORY F99).

    ``A`` and ``B`` are brought to ``[1/2, 1)`` by exact powers of two (``e`` their sum).  Every product ``a_k b_k`` is
    split exactly into ``p_k + r_k`` (Dekker's TwoProduct on Veltkamp's halves; exact where ``|p_k| >= 2^-960``, i.e.
    where no partial product loses a bit to underflow, Boldo's condition; elsewhere ``r_k`` is dropped and
    ``|p_k - a_k b_k| <= 2^-1012`` is charged).  The ``p_k`` are summed by a tree of TwoSums, which keeps every
    rounding ``e_t`` exactly: ``sum_k p_k = s + sum_t e_t``.  The corrections ``c = sum_t e_t + sum_k r_k`` (``M`` terms,
    each at most ``u`` of what it corrects) are summed in working precision, within ``gamma_M sum |terms|`` of their
    sum (Higham Lemma 3.5's argument for a sum), and ``(hi, lo) = TwoSum(s, fl(c))``.  So

    .. math:: |hi + lo - (AB)_{ij}| \le \gamma_M\,(1 + 2\gamma_M) \sum |c\text{-terms}| + n\,2^{-1012}

    in the scaled units: about ``n u^2 sum_k |a_k b_k|``, where the plain product's bound is ``n u sum_k |a_k b_k|``.
    An entry of ``A`` or ``B`` that the scaling takes below the normal range loses at most ``2^-1075`` there; that is
    charged too (``n 2^-1074`` times the other factor's column or row maximum).  Rows of ``A`` are taken in chunks."""
    fi = torch.finfo(A.dtype)
    u = (fi.eps / 2)
    m, n = A.shape
    N = B.shape[1]
    ea = int(pow2_exponent(A.abs().amax()) if A.numel() else 0)
    eb = int(pow2_exponent(B.abs().amax()) if B.numel() else 0)
    As, Bs = pow2_scale(A, -ea), pow2_scale(B, -eb)
    lost = 0.0  # the scaling's loss below the normal range, in scaled units (none for real data)
    if not torch.equal(pow2_scale(As, ea), A):
        lost += n * fi.tiny * fi.eps * float(Bs.abs().amax())
    if not torch.equal(pow2_scale(Bs, eb), B):
        lost += n * fi.tiny * fi.eps * float(As.abs().amax())
    ah, al = _veltkamp(As)
    bh, bl = _veltkamp(Bs)
    tiny = 2.0**-960 if A.dtype == torch.float64 else 2.0**-100
    floor = 2.0**-1012 if A.dtype == torch.float64 else 2.0**-120
    hi, lo, err = (torch.empty(m, N, dtype=A.dtype) for _ in range(3))
    step = max(1, (1 << 20) // max(1, n * N))
    for r0 in range(0, m, step):
        sl = slice(r0, r0 + step)
        a, b = As[sl, :, None], Bs[None]
        p = a * b
        r = ((ah[sl, :, None] * bh[None] - p) + ah[sl, :, None] * bl[None] + al[sl, :, None] * bh[None]) \
            + al[sl, :, None] * bl[None]
        r = torch.where(p.abs() >= tiny, r, torch.zeros_like(r))
        c, cabs, terms = r.sum(1), r.abs().sum(1), n
        x = p
        while x.shape[1] > 1:
            if x.shape[1] % 2:
                x = torch.cat([x, torch.zeros_like(x[:, :1])], dim=1)
            x, e = two_sum(x[:, 0::2], x[:, 1::2])
            c, cabs, terms = c + e.sum(1), cabs + e.abs().sum(1), terms + e.shape[1]
        s = x[:, 0] if n else torch.zeros(p.shape[0], N, dtype=A.dtype)
        g = _gamma(terms, u)
        hi[sl], lo[sl] = two_sum(s, c)
        err[sl] = g * (1 + 2 * g) * cabs * (1 + 4 * u) + n * floor + lost
    return hi, lo, err, ea + eb


def accurate_product_dd(A: tuple[Tensor, Tensor, Tensor], B: tuple[Tensor, Tensor, Tensor]
                        ) -> tuple[Tensor, Tensor, Tensor, int]:
    r"""``accurate_product`` of two matrices known as unevaluated sums: ``A = (hi, lo, err)`` stands for every matrix
    within ``err`` (entrywise) of ``hi + lo``, likewise ``B`` (``|lo| <= u |hi|``-sized parts).  ``A_hi B_hi`` is one
    accurate product; the cross terms ``A_hi B_lo + A_lo B_hi + A_lo B_lo`` (about ``u`` of the product's magnitudes)
    are formed plainly, within ``gamma_{3n} (|A_hi||B_lo| + |A_lo||B_hi| + |A_lo||B_lo|)`` (Higham 3.5), and joined by a
    TwoSum with the high part (``lo`` then rounds once: ``u |lo|``).  The inputs' errors add ``e_A |B~| + |A~| e_B +
    e_A e_B`` (``|A~| <= |A_hi| + |A_lo|``).  Every non-negative product is padded by ``1 + 2 gamma_{3n+3}``.  Returns
    ``(hi, lo, err, e)`` as ``accurate_product``, in units ``2^e`` (THEORY F99).

    Each operand (its three parts together) is first scaled up by the power of two that brings its largest
    ``|hi| + |lo| + err`` to ``[1/2, 1)`` (exact: only upwards, and below 1 nothing overflows; ``e`` carries it).
    Without it the cross and input terms of operands far below 1 -- an ``err`` that is all that is left of an entry
    ``accurate_product`` flushed -- underflowed to 0 and the certificate lost them (a query column at ``2^-1101`` of
    its units: weights of order one certified to ``1e-92``, the red team of stop 35).  What the plain products
    still lose below the normal range, ``2^-1075`` a product (Higham 2.2 with underflow) over the nine ``n``-term
    products here, and the final scaling's rounding, is charged as ``(9 n + 4) 2^-1075`` of the scaled units."""
    (Ah, Al, eA), ka = _unit_dd(A)
    (Bh, Bl, eB), kb = _unit_dd(B)
    n = Ah.shape[1]
    fi = torch.finfo(Ah.dtype)
    u = fi.eps / 2
    g = _gamma(3 * n + 3, u)
    hi, lo, err, e = accurate_product(Ah, Bh)
    aAl, aBl = Al.abs(), Bl.abs()
    cross = pow2_scale(Ah @ Bl + Al @ Bh + Al @ Bl, -e)
    ecross = (Ah.abs() @ aBl + aAl @ Bh.abs() + aAl @ aBl) * g * (1 + 2 * g)
    hi, t = two_sum(hi, cross)
    lo = lo + t
    aA, aB = Ah.abs() + aAl, Bh.abs() + aBl
    inp = (eA @ aB + aA @ eB + eA @ eB) * (1 + 2 * g)
    try:  # (9 n + 4) 2^-1075 in units 2^e, at least the true value (inf where the units are too small for it)
        under = math.ldexp(9 * n + 4, -1075 - e) if -1075 - e > -1074 else (9 * n + 4) * 2.0**-1074
    except OverflowError:
        under = math.inf
    err = err + u * lo.abs() * (1 + 2 * u) + pow2_scale(ecross + inp, -e) * (1 + fi.eps) + under
    return hi, lo, err, e + ka + kb


def _unit_dd(A: tuple[Tensor, Tensor, Tensor]) -> tuple[tuple[Tensor, Tensor, Tensor], int]:
    """``((hi 2^-k, lo 2^-k, err 2^-k), k)`` with ``k <= 0`` bringing the largest ``|hi| + |lo| + err`` to ``[1/2, 1)``
    where it lies below 1/2 (``k = 0`` otherwise, and for zero or non-finite operands): an exact scaling, upwards only
    (``accurate_product_dd``)."""
    hi, lo, err = A
    m = (hi.abs() + lo.abs() + err).amax() if hi.numel() else torch.zeros((), dtype=hi.dtype)
    k = min(int(pow2_exponent(m)), 0) if bool(torch.isfinite(m)) else 0
    if k == 0:
        return (hi, lo, err), 0
    return (pow2_scale(hi, -k), pow2_scale(lo, -k), pow2_scale(err, -k)), k
