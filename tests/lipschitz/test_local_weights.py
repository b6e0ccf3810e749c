"""Attention weights from scores formed to twice the precision (THEORY F99, Note [formed attention weights]).

The local routes take the softmax weights ``P`` at X with float64's relative accuracy.  Scores formed as plain float64
products are off by Higham's ``gamma_K sc |x~||W~_Q||W_K|^T|x|``, relative to the magnitudes, so where queries and keys
cancel the weights moved by far more than that (``test_plain_scores_miss_the_bound`` shows it on the same cases).
``accurate_product`` forms the products to about ``u^2``; ``certified_weights`` shifts each row by its largest score
before rounding and certifies ``P`` against the exact softmax, or refuses in one line.

References are exact: products and softmax in mpmath at 80 digits from the same float64 inputs.
"""

from __future__ import annotations

import dataclasses
import math

import mpmath
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from test_local_cancel import _cancelling_layer
from transcover import InputError
from transcover.lipschitz._local_attention import WEIGHT_REL, certified_weights
from transcover.model import AttentionSpec
from transcover.lipschitz._rounding import accurate_product, accurate_product_dd

mpmath.mp.dps = 80
_U = 2.0**-53


def _mp(A: torch.Tensor) -> mpmath.matrix:
    return mpmath.matrix([[mpmath.mpf(v) for v in row] for row in A.tolist()])


def _check_product(A: torch.Tensor, B: torch.Tensor, hi, lo, err, e, extra=None) -> float:  # noqa: ANN001
    """Assert ``|2^e (hi + lo) - exact| <= 2^e err`` entrywise, ``exact`` = ``A B`` in mpmath (or ``extra``); the
    largest ratio of the distance to the bound."""
    exact = extra if extra is not None else _mp(A) * _mp(B)
    s, worst = mpmath.mpf(2) ** e, 0.0
    for i in range(hi.shape[0]):
        for j in range(hi.shape[1]):
            d = abs((mpmath.mpf(float(hi[i, j])) + mpmath.mpf(float(lo[i, j]))) * s - exact[i, j])
            b = mpmath.mpf(float(err[i, j])) * s
            assert d <= b, (i, j, float(d), float(b))
            worst = max(worst, float(d / b) if b else 0.0)
    return worst


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(0, 14), e=st.sampled_from([0, -7, 9, -600, 600, -1000]),
       n=st.integers(1, 40))
def test_accurate_product_is_within_its_bound_where_the_product_cancels(seed, k, e, n):
    """``A = [x, x (1 + 10^-k)]``, ``B = [y; -y]``: ``A B = 10^-k x y``, far below ``|A||B|``; scaled by ``2^e`` (to the
    edges of the range: the scaling and the underflow charges)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, n, generator=g, dtype=torch.float64)
    y = torch.randn(n, 4, generator=g, dtype=torch.float64)
    A = torch.cat([x, x * (1 + 10.0**-k)], 1) * 2.0**e
    B = torch.cat([y, -y], 0)
    hi, lo, err, ex = accurate_product(A, B)
    _check_product(A, B, hi, lo, err, ex)
    if e == 0:  # about u^2 of the magnitudes, where the plain product's bound is n u of them
        mag = (A.abs() @ B.abs()) * 2.0**-ex
        assert bool((err <= 2 * n * _U * _U * mag * 8 + 2 * n * 2.0**-1012).all())


def test_accurate_product_is_exactly_homogeneous_in_powers_of_two():
    """Scaling ``A`` by ``2^k`` shifts the exponent by ``k`` and leaves ``hi``, ``lo``, ``err`` bit for bit."""
    g = torch.Generator().manual_seed(3)
    A, B = torch.randn(5, 30, generator=g, dtype=torch.float64), torch.randn(30, 6, generator=g, dtype=torch.float64)
    base = accurate_product(A, B)
    for k in (-300, -1, 1, 17, 500):
        hi, lo, err, e = accurate_product(A * 2.0**k, B)
        assert e == base[3] + k
        assert torch.equal(hi, base[0]) and torch.equal(lo, base[1]) and torch.equal(err, base[2])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(0, 12))
def test_accurate_product_dd_covers_every_input_within_its_error(seed, k):
    """Inputs ``(hi, lo, err)``: the product of the corner ``hi + lo + err sign(..)`` (any matrix within ``err`` is
    covered the same way: the bound is linear in it) against the bound."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, generator=g, dtype=torch.float64)
    Ah = torch.cat([x, x * (1 + 10.0**-k)], 1)
    Al = Ah * _U * torch.rand(3, 10, generator=g, dtype=torch.float64)
    eA = Ah.abs() * 1e-20
    y = torch.randn(5, 2, generator=g, dtype=torch.float64)
    Bh = torch.cat([y, -y], 0)
    Bl = Bh * _U * torch.rand(10, 2, generator=g, dtype=torch.float64)
    eB = Bh.abs() * 1e-25
    hi, lo, err, e = accurate_product_dd((Ah, Al, eA), (Bh, Bl, eB))
    sA, sB = torch.sign(torch.randn(3, 10, generator=g)), torch.sign(torch.randn(10, 2, generator=g))
    At = _mp(Ah) + _mp(Al) + _mp(eA * sA)
    Bt = _mp(Bh) + _mp(Bl) + _mp(eB * sB)
    _check_product(Ah, Bh, hi, lo, err, e, extra=At * Bt)


def _exact_weights(A, X: torch.Tensor, h: int) -> list:  # noqa: ANN001
    """The exact softmax of the exact scores ``sc (x~_i W~_Q)(x_j W_K)^T`` (masked keys 0), in mpmath."""
    T = X.shape[0]
    Xa = torch.cat([X, torch.ones(T, 1, dtype=torch.float64)], 1)
    S = (_mp(Xa) * _mp(A.W_Q_augmented(h).double())) * (_mp(X) * _mp(A.head(h)[1].double())).T
    out = []
    for i in range(T):
        vis = range(i + 1) if A.causal else range(T)
        row = [mpmath.mpf(A.softmax_scale) * S[i, j] for j in vis]
        m = max(row)
        z = mpmath.fsum(mpmath.exp(v - m) for v in row)
        out.append([mpmath.exp(v - m) / z for v in row] + [mpmath.mpf(0)] * (T - len(row)))
    return out


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(2, 12), causal=st.booleans())
def test_certified_weights_are_within_float64_accuracy_of_the_exact_softmax(seed, k, causal):
    """On heads whose scores cancel to ``10^-k`` of their magnitudes: every weight within ``WEIGHT_REL`` (and the
    softmax's own ``4 (T + 8) u``, the envelopes' pad) of the exact one."""
    _, A, X = _cancelling_layer(seed, 10.0**-k, causal)
    T = X.shape[0]
    for h in range(A.n_heads):
        P = certified_weights(A, X, h)
        ex = _exact_weights(A, X, h)
        for i in range(T):
            for j in range(T):
                if ex[i][j] == 0:
                    assert P[i, j] == 0
                    continue
                rel = abs(mpmath.mpf(float(P[i, j])) / ex[i][j] - 1)
                assert rel <= WEIGHT_REL + 4 * (T + 8) * _U, (h, i, j, float(rel))


def _plain_weights(A, X: torch.Tensor, h: int) -> torch.Tensor:  # noqa: ANN001
    """The weights as main formed them before F99: plain float64 products."""
    T = X.shape[0]
    Xa = torch.cat([X, torch.ones(T, 1, dtype=torch.float64)], 1)
    S = A.softmax_scale * (Xa @ A.W_Q_augmented(h).double()) @ (X @ A.head(h)[1].double()).T
    if A.causal:
        S = S.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(S, -1)


def test_plain_scores_miss_the_bound():
    """The same check on the plainly formed weights fails at ``10^-11`` cancellation (the weights move by about
    ``1e-5`` relative): the case the bound is for."""
    _, A, X = _cancelling_layer(7, 1e-11)
    ex = _exact_weights(A, X, 0)
    P = _plain_weights(A, X, 0)
    worst = max(abs(mpmath.mpf(float(P[i, j])) / ex[i][j] - 1) for i in range(5) for j in range(5))
    assert worst > 100 * WEIGHT_REL, float(worst)


def test_weights_of_a_real_model_are_certified():
    """MiniLM's second layer on a real sentence: no refusal, and the weights equal the plain ones to ``1e-9``."""
    from transcover.model import load
    from transcover.model._data import load_inputs
    from transcover.model._functional import layer_forward

    spec = load(None).to_torch(torch.float64)
    X = layer_forward(spec.layers[0], spec.input_norm(load_inputs(spec, "sklearn-descr", max_len=32, limit=4)[3].double()))
    A = spec.layers[1].attention
    for h in range(A.n_heads):
        P = certified_weights(A, X, h)
        assert torch.allclose(P, _plain_weights(A, X, h), rtol=1e-9, atol=1e-13)


def test_scores_cancelling_beyond_twice_the_precision_are_refused_in_one_line():
    """Query and key rows ``[M_i, M_i, a]``, ``[M_j, -M_j, b]`` with ``M`` about ``1e10``: the scores ``a b`` (order one)
    are ``1e-20`` of the products, beyond the accurate product's ``u^2``: one line naming the cancellation."""
    spec_, A, X = _cancelling_layer(0, 1e-3)
    d, dh = 6, 4
    Wq, Wk = torch.zeros(2, d, dh, dtype=torch.float64), torch.zeros(2, d, dh, dtype=torch.float64)
    for h in range(2):
        for c in range(dh):
            Wq[h, c, c] = 1.0
            Wk[h, c, c] = -1.0 if c == 1 else 1.0
    A = dataclasses.replace(A, W_Q=Wq, W_K=Wk)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(5, d, generator=g, dtype=torch.float64)
    X[:, 0] = X[:, 1] = 1e10 * (1 + 0.3 * torch.rand(5, generator=g, dtype=torch.float64))  # inexact products
    with pytest.raises(InputError) as err:
        certified_weights(A, X, 0)
    assert "\n" not in str(err.value) and "cancel" in str(err.value)


def test_float32_and_bf16_data_give_the_weights_of_their_float64_values():
    """Data in float32 or bf16 is cast exactly to float64 first: the same ``P`` bit for bit as the float64
    copy of the same values (the double-length products and every bound are float64's)."""
    _, A, X = _cancelling_layer(5, 1e-6)
    for dt in (torch.float32, torch.bfloat16):
        Xd = X.to(dt)
        for h in range(A.n_heads):
            P, P64 = certified_weights(A, Xd, h), certified_weights(A, Xd.double(), h)
            assert P.dtype == torch.float64 and torch.equal(P, P64)


@pytest.mark.parametrize("k", [-300, -7, 5, 200])
def test_certified_weights_are_exactly_invariant_under_the_conjugate_scalings(k):
    """The same exact scores, hence the same weights: ``W_Q 2^-k``, ``W_K 2^k`` (the score product's factors), and ``X
    2^k`` with ``W_Q``, ``W_K`` at ``2^-k`` (the data's scale).  Every scaling of the double-length products is a power of
    two, so the certified weights are the same bit for bit."""
    _, A, X = _cancelling_layer(3, 1e-6)
    swap = dataclasses.replace(A, W_Q=A.W_Q * 2.0**-k, W_K=A.W_K * 2.0**k)
    data = dataclasses.replace(A, W_Q=A.W_Q * 2.0**-k, W_K=A.W_K * 2.0**-k)
    for h in range(A.n_heads):
        P = certified_weights(A, X, h)
        assert torch.equal(certified_weights(swap, X, h), P)
        assert torch.equal(certified_weights(data, X * 2.0**k, h), P)


def _range_head(c: int) -> tuple:
    """Stop 35's red team: weights of order one on data columns (queries from columns 1, 2; keys from 3, 4, which
    cancel to about ``10^-6`` of their size) beside a constant input column ``2^c`` that no weight reads.  The
    products are scaled by ``max |x|`` = ``2^c``, so the queries and keys sit near ``2^-c`` of their units."""
    g = torch.Generator().manual_seed(1)
    T, w1, w2 = 3, 1.2345678901234567, 0.7654321098765432
    X = torch.zeros(T, 5, dtype=torch.float64)
    X[:, 0] = 2.0**c
    X[:, 1] = (1 + 0.1 * torch.rand(T, generator=g, dtype=torch.float64)) / w1
    X[:, 2] = X[:, 1] * w1 / w2 * (1 + 1e-3 * torch.rand(T, generator=g, dtype=torch.float64))
    X[:, 3] = 1e6 * torch.rand(T, generator=g, dtype=torch.float64)
    X[:, 4] = -X[:, 3] + torch.rand(T, generator=g, dtype=torch.float64)
    Wq, Wk = torch.zeros(1, 5, 2, dtype=torch.float64), torch.zeros(1, 5, 2, dtype=torch.float64)
    Wq[0, 1, 0], Wq[0, 2, 1], Wk[0, 3, 0], Wk[0, 4, 1] = w1, w2, 1.0, 1.0
    A = AttentionSpec(W_Q=Wq, W_K=Wk, W_V=torch.zeros(1, 5, 2, dtype=torch.float64),
                      W_O=torch.zeros(1, 2, 5, dtype=torch.float64), scale=1.0)
    return A, X


@pytest.mark.parametrize("c", [0, 300, 440, 520])
def test_weights_beside_a_huge_unread_column_are_within_float64_accuracy(c):
    """The cross and input terms of ``accurate_product_dd`` on operands near ``2^-520`` of their units underflowed
    (before stop 35: weights off by ``3.1e-11`` relative, 137x ``WEIGHT_REL``, at ``c = 520``).  The weights do not
    depend on ``c``: every one within ``WEIGHT_REL`` (plus the softmax's pad) of the exact softmax."""
    A, X = _range_head(c)
    P = certified_weights(A, X, 0)
    ex = _exact_weights(A, X, 0)
    for i in range(3):
        for j in range(3):
            rel = abs(mpmath.mpf(float(P[i, j])) / ex[i][j] - 1)
            assert rel <= WEIGHT_REL + 4 * (3 + 8) * _U, (c, i, j, float(rel))


def test_queries_flushed_in_their_units_are_refused_not_certified():
    """Stop 35's minimal case: ``x = (2^400, x_1)``, ``W_Q`` row 1 ``(2^300, 2^1000)``, ``W_K`` row 1 ``(2^-300, 0)``:
    exact scores ``x_1 x_1'`` (1, 3; 3, 9).  Scaled by ``2^1401``, the query's first column (``2^300 x_1``) lies below
    the smallest subnormal and is left only as ``accurate_product``'s floor charge, which main lost in the cross
    terms: ``D = 0`` certified to ``1e-92``, uniform weights against the exact (0.119, 0.881; 0.0025, 0.9975).
    With that charge kept the scores' error is larger than the scores: refused, in one line."""
    X = torch.tensor([[2.0**400, 1.0], [2.0**400, 3.0]], dtype=torch.float64)
    A = AttentionSpec(W_Q=torch.tensor([[[0.0, 0.0], [2.0**300, 2.0**1000]]], dtype=torch.float64),
                      W_K=torch.tensor([[[0.0, 0.0], [2.0**-300, 0.0]]], dtype=torch.float64),
                      W_V=torch.tensor([[[0.0, 0.0], [1.0, 0.0]]], dtype=torch.float64),
                      W_O=torch.tensor([[[0.0, 1.0], [0.0, 0.0]]], dtype=torch.float64), scale=1.0)
    with pytest.raises(InputError, match="head 0, query 0") as err:
        certified_weights(A, X, 0)
    assert "\n" not in str(err.value)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), ka=st.integers(-1100, 0), kb=st.integers(-600, 0))
@example(seed=7420, ka=-1071, kb=0)  # within 6e-7 of its bound: fails if the reference runs at 30 digits (stop 37 CI)
def test_accurate_product_dd_keeps_the_charges_of_tiny_operands(seed, ka, kb):
    """Operands ``2^ka``, ``2^kb`` times a unit-scale triple whose error part is the floor of entries that flushed
    (``err`` only, ``hi = 0`` there): the product's bound covers the corner ``hi + lo + err sign`` at every scale
    (main's plain cross terms dropped the charges below ``2^-1074``)."""
    g = torch.Generator().manual_seed(seed)
    Ah = torch.randn(3, 4, generator=g, dtype=torch.float64)
    Ah[:, 0] = 0.0
    Al = Ah * _U * torch.rand(3, 4, generator=g, dtype=torch.float64)
    eA = torch.full((3, 4), 2.0**-40, dtype=torch.float64)
    Bh = torch.randn(4, 2, generator=g, dtype=torch.float64)
    Bl = Bh * _U * torch.rand(4, 2, generator=g, dtype=torch.float64)
    eB = Bh.abs() * 1e-25
    parts = [torch.ldexp(t, torch.tensor(ka)) for t in (Ah, Al, eA)], [torch.ldexp(t, torch.tensor(kb)) for t in (Bh, Bl, eB)]
    hi, lo, err, e = accurate_product_dd(tuple(parts[0]), tuple(parts[1]))
    sA, sB = torch.sign(torch.randn(3, 4, generator=g)), torch.sign(torch.randn(4, 2, generator=g))
    (ah, al, ea), (bh, bl, eb) = parts  # the floats passed (2^ka of a subnormal rounds): the corner of their boxes
    At = _mp(ah) + _mp(al) + _mp(ea * sA)
    Bt = _mp(bh) + _mp(bl) + _mp(eb * sB)
    _check_product(ah, bh, hi, lo, err, e, extra=At * Bt)


def test_pow2_scale_beyond_the_exponent_range():
    """``2^e`` for ``|e| > 1023`` is not a float64: ``pow2_scale`` steps (exact where the result is normal, inf past
    the top, 0 kept 0); a head whose score exponents pass ``2^1024`` is refused in one line, not an
    ``OverflowError``."""
    from transcover.lipschitz._rounding import pow2_scale

    x = torch.tensor([2.0**1020, 0.0, -3.0 * 2.0**1000], dtype=torch.float64)
    assert pow2_scale(x, -2500).tolist() == [0.0, 0.0, -0.0] and pow2_scale(x, -2000).tolist() == [
        2.0**-980, 0.0, -3.0 * 2.0**-1000]
    assert pow2_scale(torch.tensor([2.0**-1070, 0.0], dtype=torch.float64), 3000).tolist() == [math.inf, 0.0]
    assert pow2_scale(torch.tensor([2.0**-1074], dtype=torch.float64), 2000).tolist() == [2.0**926]
    A, X = _range_head(0)
    X = X.clone()
    X[0, 3] = 2.0**1023
    with pytest.raises(InputError, match="head 0"):
        certified_weights(A, X, 0)


def test_a_sliding_window_is_refused_by_every_local_route():
    """A window changes which keys a query sees; the local routes' weights and Jacobians see them all (or every
    earlier one): refused in one line (before stop 35 ``attention_local_bound`` certified the full softmax's bound
    for window = 1, whose exact weights are the identity)."""
    from transcover.lipschitz._local import layer_local
    from transcover.lipschitz._local_attention import attention_local_bound
    from transcover.lipschitz._local_jacobian import layer_jacobians

    spec, A, X = _cancelling_layer(0, 1e-2, False)
    Aw = dataclasses.replace(A, window=1)
    Lw = dataclasses.replace(spec.layers[0], attention=Aw)
    for call in (lambda: certified_weights(Aw, X, 0), lambda: attention_local_bound(Aw, X, 0.1),
                 lambda: layer_local(Lw, X, 0.1), lambda: layer_jacobians(Lw, X, [0.1])):
        with pytest.raises(InputError, match="sliding window"):
            call()


def test_a_negative_softmax_scale_is_refused_where_the_spec_is_built():
    """Stop 35's red team: the local bounds multiplied score terms by the raw scale, so ``scale = -0.3`` certified 3.50
    where the Jacobian at X reaches 7.50 (and ``layer_local`` certified below its own point value).  No model uses a
    negative scale: the spec refuses it (and any non-finite one), so no route can see it."""
    spec, A, X = _cancelling_layer(0, 1e-2, False)
    for bad in (-0.3, -1e-300, math.nan, math.inf):
        with pytest.raises(ValueError, match="softmax scale must be a finite number >= 0"):
            dataclasses.replace(A, scale=bad)
    dataclasses.replace(A, scale=0.0)  # uniform weights: a valid (constant-score) attention


def test_local_norm_and_attention_refuse_bad_radii_and_tokens_in_one_line():
    """The public component functions checked neither the radius nor the tokens: ``norm_local`` with ``rho = -0.5``
    returned 1.38 under the Jacobian's 1.66 at X itself, NaN radii gave NaN constants, and a batched or empty X, a
    wrong width or a negative eps crashed with IndexError, ValueError or RuntimeError."""
    from transcover.lipschitz._local import norm_local
    from transcover.lipschitz._local_attention import attention_local_bound

    spec, A, X = _cancelling_layer(0, 1e-2, False)
    norm = spec.layers[0].norm_attn
    for rho in (-0.5, math.nan, math.inf):
        with pytest.raises(InputError, match="rho must be a finite number >= 0"):
            norm_local(norm, X, rho)
    for bad in (X[:0], X[None], X[:, :-1], X[0]):
        for call in (lambda: norm_local(norm, bad, 0.1), lambda: attention_local_bound(A, bad, 0.1)):
            with pytest.raises(InputError, match="tensor of tokens") as err:
                call()
            assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="eps must be a finite number >= 0"):  # refused where the spec is built (stop 36)
        norm_local(dataclasses.replace(norm, eps=-1.0), X, 0.1)
