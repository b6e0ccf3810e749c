"""The local certified route at power-of-two scales where float64 squares under- or overflow (the audit after the
``certified_spectral`` / ``certified_block_norms`` fixes): Frobenius norms and Grams formed at a power of two, and the
routes' refusals where their factors leave float64's range (Note [local data range] in ``_local_rows``, Note [local
head data range] in ``_local_attention``).

Each function-level test scales an input by ``2^e`` (exact) and asks for the unscaled result times the matching power
of two, exactly where that is a normal float (the scaled forms are bit-identical in the normal range), or at least
the exact value (mpmath) below it.  The route-level tests take a layer whose map is exactly conjugate to one at scale
1 (tokens and radius ``x 2^k`` with ``W_Q``, ``W_K`` at ``2^-k``: the same scores) and ask every local route for a
bound at least the attained (2,inf) norm of the scale-1 Jacobian times ``2^-k`` (or a one-line refusal).  On main
each test below failed: the first two routes certified 0.014 and 0.971 of the attained, ``attention_local_bound``
4.55 against 5.78, and the functions returned 0 (or dropped the term) at ``2^-600``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import mpmath
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from l2_attack import full_jacobian, jacobian_2inf
from lipschitz_testkit import random_spec
from transcover import InputError
from transcover.lipschitz import attention_local_bound, layer_local, stack_local
from transcover.lipschitz._local import _sym_top
from transcover.lipschitz._local_jacobian import (
    _mixed_norms, _row_block_norms, centre_tokens, pow2_norm, root_sum_squares,
)
from transcover.lipschitz._rounding import product_row_error, product_row_norms
from transcover.lipschitz._local_rows import _head_gram, _heads_combined, _sandwich
from transcover.lipschitz._local_stack_aligned import ellipsoid_gram
from transcover.lipschitz._local_stack_joint import block_lmax
from transcover.lipschitz._local_struct import NormJac
from transcover.model import NormKind, NormSpec
from transcover.model._functional import attention_forward, layer_forward

TINY = torch.finfo(torch.float64).tiny
SCALES = [-1060, -1000, -600, -540, -300, 0, 300, 511, 600, 1000]


def _two(W, k: float):  # noqa: ANN001, ANN202
    return None if W is None else torch.ldexp(torch.as_tensor(W, dtype=torch.float64),
                                              torch.tensor(float(k), dtype=torch.float64))


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _scaled_ok(got: torch.Tensor, base: torch.Tensor, e: int, rel: float = 0.0) -> None:
    """``got`` is ``base x 2^e``: exactly (``rel`` 0) or within ``rel`` where that is a normal float, and never below the
    exact product otherwise.  Grams (``rel`` 1e-12): LAPACK rescales a matrix of norm below about ``2^-485`` by a factor
    that is not a power of two, a few ulps; a flushed Gram is off by all of it."""
    for x, y in zip(got.flatten().tolist(), base.flatten().tolist()):
        exact = mpmath.ldexp(mpmath.mpf(y), e)
        if TINY <= exact <= 1e308:
            assert abs(x - math.ldexp(y, e)) <= rel * math.ldexp(y, e), (x, y, e)
        else:
            assert mpmath.mpf(x) >= exact, (x, y, e)


# -- the Frobenius norms and roots of squares ---------------------------------------------------------------------


@settings(max_examples=20, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), e=st.sampled_from(SCALES))
def test_pow2_norm_and_root_sum_squares_scale_exactly(seed, e):
    """``torch``'s norm of a ``2^-600`` matrix is 0 (its squares flush); ``pow2_norm`` is the same floats in the normal
    range and scales exactly; ``root_sum_squares`` likewise (a column at ``2^e`` beside one at 1)."""
    A = _randn(seed, 3, 4, 5)
    assert torch.equal(pow2_norm(A, (1, 2)), A.norm(dim=(1, 2)))
    assert torch.equal(pow2_norm(A, -1), A.norm(dim=-1)) and torch.equal(pow2_norm(A), A.norm())
    v = _randn(seed + 1, 3, 2).abs()
    plain = torch.sqrt((v * v).sum(dim=0))
    assert torch.equal(root_sum_squares(v, 0), plain)
    got = root_sum_squares(v * torch.tensor([1.0, math.ldexp(1.0, e)], dtype=torch.float64), 0)
    assert float(got[0]) == float(plain[0])
    if e > -1000:
        _scaled_ok(pow2_norm(_two(A, e), (1, 2)), A.norm(dim=(1, 2)), e)
        _scaled_ok(got[1:], plain[1:], e)
        return
    # subnormal entries (the scaling rounds them): against the exact norm of the entries as stored, less the sum's
    # own rounding (the callers pad it)
    As = _two(A, e)
    for blk, g in zip(As, pow2_norm(As, (1, 2)).tolist()):
        exact = mpmath.sqrt(mpmath.fsum(mpmath.mpf(x) ** 2 for x in blk.flatten().tolist()))
        assert g > 0 and mpmath.mpf(g) >= exact * (1 - 64 * mpmath.mpf(2) ** -53), (g, exact)
    col = (v[:, 1] * math.ldexp(1.0, e)).tolist()
    exact = mpmath.sqrt(mpmath.fsum(mpmath.mpf(x) ** 2 for x in col))
    assert float(got[1]) > 0 and mpmath.mpf(float(got[1])) >= exact * (1 - 64 * mpmath.mpf(2) ** -53)


@pytest.mark.parametrize("e", [-600, -540, 600])
def test_heads_combined_keeps_a_small_move(e):
    """``min(sum_h ||M W_O^hT|| dZ_h, ||M W_O^T|| (sum_h dZ_h^2)^{1/2})``: at ``dZ = 2^-600`` the root flushed to 0 and
    the bound with it."""
    per = torch.tensor([[1.0, 2.0], [3.0, 0.5]], dtype=torch.float64)
    full = torch.tensor([2.5, 2.0], dtype=torch.float64)
    dZ = torch.tensor([[0.3, 0.7], [0.4, 0.1]], dtype=torch.float64)
    _scaled_ok(_heads_combined(per, full, _two(dZ, e)), _heads_combined(per, full, dZ), e)


# -- Gram-based norms, at a power of two ---------------------------------------------------------------------------


@settings(max_examples=12, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), e=st.sampled_from([-1000, -600, -540, -300, 0, 300, 600]))
def test_gram_norms_scale_exactly(seed, e):
    """``_local._sym_top`` (the layer route's ``||M||``), ``_row_block_norms`` with one exact block a row (the others
    by their Frobenius norms) and ``_mixed_norms``' ``||M_i W_OV^hT||``: at ``2^-600`` each was 0."""
    B = _randn(seed, 4, 6, 5)
    _scaled_ok(_sym_top(_two(B, e)), _sym_top(B), e, 1e-12)
    _scaled_ok(_row_block_norms(_two(B, e), 1), _row_block_norms(B, 1), e, 1e-12)
    layer = random_spec(seed % 7, L=1, norm="layernorm", placement="post").layers[0]
    heads = [(None, None, None, None, None, W[2].double(), W[3].double()) for W in map(layer.attention.head, range(2))]
    M = _randn(seed + 1, 3, 6, 6)
    norms = {"V": [1.0, 1.0]}
    (a, b), (c, d) = _mixed_norms(M, heads, norms), _mixed_norms(_two(M, e), heads, norms)
    _scaled_ok(c, a, e, 1e-12)
    _scaled_ok(d, b, e, 1e-12)


@pytest.mark.parametrize("e", [-600, -300, 300])
def test_sandwich_and_block_lmax_keep_their_rounding_terms(e):
    """``_sandwich``'s ``gamma ||A||_F^2 ||S||_F`` and ``block_lmax``'s pads: with ``S`` (or the map) at ``2^-600`` the
    Frobenius norms read 0 and the terms were lost; ``block_lmax``'s ``||MO||_F`` read 0, past its underflow refusal."""
    A, S = _randn(1, 3, 4, 4), _randn(2, 3, 4, 4)
    S = S @ S.transpose(1, 2)
    err, eA = torch.full((3,), 1e-12, dtype=torch.float64), torch.full((3,), 1e-13, dtype=torch.float64)
    out, new = _sandwich(A, S, err, eA)
    out2, new2 = _sandwich(A, _two(S, e), _two(err, e), eA)
    _scaled_ok(out2, out, e)
    _scaled_ok(new2, new, e)
    W = _randn(3, 2, 3, 3, 3)
    W = W @ W.transpose(-1, -2)
    MO = _randn(4, 3, 5, 6)
    zero = torch.zeros(3, dtype=torch.float64)
    lam, f = block_lmax(W, zero, MO, zero)
    lam2, f2 = block_lmax(W, zero, _two(MO, e), zero)
    _scaled_ok(f2, f, e)
    if e >= -300:  # the Gram itself at 2^2e: representable
        _scaled_ok(lam2, lam, 2 * e, 1e-9)


@pytest.mark.parametrize("e", [-600, -540, -200, 200])
def test_ellipsoid_gram_scales_or_refuses(e):
    """F40a's ellipsoid of a prefix row (degree 2 in its blocks): at ``2^-200`` and ``2^200`` exactly ``4^e`` times the
    one at 1; a row of blocks below ``2^-537`` had ``torch``'s norms 0, every block left out as zero and the ellipsoid
    and its pad 0 (no move at all); its Gram is below float64's range, and its pad is now inf."""
    B = _randn(5, 4, 3, 3)  # one prefix row: (T, d, d)
    Q, eQ = ellipsoid_gram(B)
    Q2, eQ2 = ellipsoid_gram(_two(B, e))
    if e < -500:
        assert eQ2 == math.inf
        return
    _scaled_ok(Q2, Q, 2 * e)
    assert eQ2 >= math.ldexp(eQ, 2 * e) * (1 - 1e-12) and eQ2 > 0


@pytest.mark.parametrize("e", [-600, -540, -300, 300])
def test_norm_jacobian_frobenius_and_pads_scale(e):
    """``NormJac``: ``||D||_F`` (its squares flushed below ``2^-537``, leaving the ``1e-12 max|a|`` floor) scales with a
    gain ``x 2^e``, and the rounding terms of ``left`` and ``sandwich`` with their argument; ``centre_tokens``' spread
    with the tokens."""
    X = _randn(6, 4, 5)
    g = _randn(7, 5).abs() + 0.1
    n0 = NormJac(NormSpec(NormKind.LAYERNORM, weight=g, eps=1e-5), X)
    n1 = NormJac(NormSpec(NormKind.LAYERNORM, weight=_two(g, e), eps=1e-5), X)
    _scaled_ok(n1.fro, n0.fro, e)
    V = _randn(8, 4, 5, 3)
    _scaled_ok(n0.left(_two(V, e))[1], n0.left(V)[1], e)
    _scaled_ok(n0.right(_two(V.transpose(1, 2), e))[1], n0.right(V.transpose(1, 2))[1], e)
    S = _randn(9, 4, 5, 5)
    zero = torch.zeros(4, dtype=torch.float64)
    _scaled_ok(n0.sandwich(_two(S, e), zero)[1], n0.sandwich(S, zero)[1], e)
    _, s0, _ = centre_tokens(X, True)
    _scaled_ok(centre_tokens(_two(X, e), True)[1], s0, e)


def test_head_gram_balances_values_against_gradients():
    """The head-space Gram's ``(q . q) v v^T``: values near ``2^-400`` with gradients near ``2^400`` (and the weights
    ``c`` near ``2^-300``) had ``c v v^T`` flushed; the Gram is unchanged by ``v x 2^k``, ``q x 2^-k`` and now comes out
    the same floats either way."""
    layer = random_spec(3, L=1, norm="layernorm", placement="post").layers[0]
    from transcover.lipschitz._local_jacobian import HeadData, _head_data

    heads = _head_data(layer.attention, _randn(1, 5, 6))
    c = torch.rand(5, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * (1 - torch.eye(5)) * 2.0**-300
    S0, e0 = _head_gram(heads, c)
    k = 400  # c P P v v^T near 2^-1100 (flushed on main) against q . q near 2^800

    def moved_head(hd):  # noqa: ANN001, ANN202
        P, Y, q, Wq, Wk, Wv, Wo = hd
        out = HeadData((P, _two(Y, -k), _two(q, k), Wq, Wk, Wv, Wo))
        out.q_err = _two(hd.q_err, k)  # the formed q's rounding bound moves with q (THEORY F97)
        return out

    S1, e1 = _head_gram([moved_head(hd) for hd in heads], c)
    assert torch.equal(S1, S0), float((S1 - S0).abs().max())
    assert bool((e1 >= e0 * (1 - 1e-12)).all())


# -- the routes at conjugate scales --------------------------------------------------------------------------------


def _conjugate(k: int, *, kg1: int = 0, kg2: int = 0, kv: int = 0):  # noqa: ANN202
    """A post-LN one-layer spec with tokens ``x 2^k``, ``W_Q``, ``W_K`` at ``2^-k`` (the same scores), ``b_V``, ``b_O``
    ``x 2^k`` and ``norm_attn``'s eps ``x 4^k`` (the layer's map conjugate to the one at ``k = 0``: its Jacobian ``x
    2^-k``); then both gains ``x 2^kg1``, ``2^kg2`` and ``W_V`` ``x 2^kv`` with ``W_O`` ``x 2^-kv`` (the same map)."""
    spec = random_spec(1, L=1, norm="layernorm", placement="post", act="gelu", biases=True, input_norm=False)
    L = spec.layers[0]
    A = L.attention
    A = dataclasses.replace(A, W_Q=_two(A.W_Q, -k), W_K=_two(A.W_K, -k), W_V=_two(A.W_V, kv),
                            b_V=_two(A.b_V, k + kv), W_O=_two(A.W_O, -kv), b_O=_two(A.b_O, k))
    n1 = dataclasses.replace(L.norm_attn, eps=math.ldexp(L.norm_attn.eps, 2 * k), weight=_two(L.norm_attn.weight, kg1),
                             bias=_two(L.norm_attn.bias, kg1))
    n2 = dataclasses.replace(L.norm_ffn, weight=_two(L.norm_ffn.weight, kg2), bias=_two(L.norm_ffn.bias, kg2))
    L = dataclasses.replace(L, attention=A, norm_attn=n1, norm_ffn=n2)
    X = _randn(1, 5, 6)
    return dataclasses.replace(spec, layers=[L]), L, _two(X, k)


@functools.lru_cache(maxsize=None)
def _attained(kg1: int, kg2: int, kv: int, part: str) -> float:
    """The attained (2,inf) norm of the scale-1 map's Jacobian (``jacobian_2inf``: an alternating ascent, float64
    autograd; a lower value of the exact norm up to its rounding) for the layer or its attention alone."""
    _, L, X = _conjugate(0, kg1=kg1, kg2=kg2, kv=kv)
    f = (lambda Z: layer_forward(L, Z)) if part == "layer" else (lambda Z: attention_forward(L.attention, Z))
    J = full_jacobian(f, X)
    m = float(J.abs().max())
    e = math.frexp(m)[1]
    val = jacobian_2inf(torch.ldexp(J, torch.tensor(float(-e), dtype=torch.float64)), *X.shape,
                        torch.Generator().manual_seed(0))
    return math.ldexp(val * (1 - 1e-12), e)


def _bound_or_refusal(route) -> float | None:  # noqa: ANN001
    try:
        return route()
    except InputError as err:
        assert "\n" not in str(err) and "Note [local" in str(err), str(err)
        return None


@pytest.mark.parametrize("k,kg1,kg2,kv", [(200, -190, -190, 0), (-100, 0, 0, -390), (-300, 0, 0, -100)])
def test_layer_routes_hold_at_conjugate_scales(k, kg1, kg2, kv):
    """Main certified 0.014 of the attained at ``(200, -190, -190)`` (the post-LN product ``M_i`` near ``2^-580``: the
    rows route's Grams flushed; now refused, Note [local data range], and the product route answers) and 0.971 at the
    other two (values ``W_V^T y`` near ``2^-490`` / ``2^-400`` beside gradients near ``2^100`` / ``2^300``: ``v v^T``
    flushed in the head Gram; now refused, resp. balanced)."""
    spec, L, X = _conjugate(k, kg1=kg1, kg2=kg2, kv=kv)
    lo = math.ldexp(_attained(kg1, kg2, kv, "layer"), -k)
    r = math.ldexp(1e-3, k)
    for name, route in (("layer_local", lambda: layer_local(L, X, r).upper),
                        ("stack_local", lambda: stack_local(spec, X, [r])[0].upper)):
        v = _bound_or_refusal(route)
        assert v is None or v >= lo, (name, v, lo, v / lo)


def test_attention_bound_holds_with_tiny_values_and_huge_gradients():
    """Tokens at ``2^-505``, ``W_Q``, ``W_K`` at ``2^505``, ``W_V`` at ``2^-395`` (``W_O`` at ``2^395``): the value terms'
    squares flushed and ``attention_local_bound`` certified 4.55 against an attained 5.78 (the same map at scale 1);
    now refused (Note [local head data range])."""
    A = random_spec(3, L=1, norm="layernorm", placement="post").layers[0].attention
    X = _randn(1, 5, 6)
    J = full_jacobian(lambda Z: attention_forward(A, Z), X)
    lo = jacobian_2inf(J, *X.shape, torch.Generator().manual_seed(0)) * (1 - 1e-12)
    k, kv = -505, -395
    As = dataclasses.replace(A, W_Q=_two(A.W_Q, -k), W_K=_two(A.W_K, -k), W_V=_two(A.W_V, kv), W_O=_two(A.W_O, -kv))
    v = _bound_or_refusal(lambda: attention_local_bound(As, _two(X, k), math.ldexp(0.01, k)).upper)
    assert v is None or v >= lo, (v, lo)


# -- the stack route's own rounding terms (``_local_stack``, ``_local_stack_move``) -----------------------------------

def _stack_stages():  # noqa: ANN202
    import transcover.lipschitz._local_stack as ls
    from test_local_move26 import CASES, _case

    spec, X, _, _ = _case(CASES[0])
    return ls, ls._stages(spec, X)[0]


@pytest.mark.parametrize("e", [-700, -600, -540, 300])
def test_stack_rounding_bounds_scale_exactly(e):
    """``_local_error`` (columns and rows), ``_row_errors`` and ``_suffix_heads`` (its pad) at ``2^e`` are the
    scale-1 floats times ``2^e``: their Frobenius norms squared as they went and read 0 from ``2^-540`` down."""
    ls, stages = _stack_stages()
    T, d = stages[0].x.shape
    K = _randn(3, T * d, T, d)  # a chain's columns (rows): one per input coordinate
    for st_ in stages:
        for cols in (True, False):
            _scaled_ok(torch.tensor(ls._local_error(st_, _two(K, e), cols=cols), dtype=torch.float64),
                       torch.tensor(ls._local_error(st_, K, cols=cols), dtype=torch.float64), e)
        _scaled_ok(ls._row_errors(st_, _two(K, e)), ls._row_errors(st_, K), e)
    att = next(s_.lin.att for s_ in stages if getattr(s_.lin, "att", None) is not None)
    C = _randn(4, T * d, T, d)
    _scaled_ok(ls._suffix_heads(_two(C, e), att), ls._suffix_heads(C, att), e)


@pytest.mark.parametrize("e", [-560, -300, 0, 300, 540])
def test_product_spectral_scales_exactly(e):
    """``_local_stack_move._spectral``'s ``sqrt(||N||_1 ||N||_inf)`` at block norms ``2^e``: the product of the two
    sums flushed to 0 below ``2^-537`` and overflowed past ``2^512``; the rounding ``sqrt(T) e`` is scaled alike."""
    from transcover.lipschitz._local_stack_move import _spectral

    N = _randn(5, 6, 6).abs()
    base = _spectral({(0, 1): (N, 1e-3)}, 0, 1)
    got = _spectral({(0, 1): (_two(N, e), math.ldexp(1e-3, e))}, 0, 1)
    assert math.isfinite(got) and got >= math.ldexp(base, e) * (1 - 4 * 2.0**-53)
    assert got <= math.ldexp(base, e) * (1 + 4 * 2.0**-53)


def _exact_row_norm(A: torch.Tensor, *Ws: torch.Tensor) -> mpmath.mpf:
    """The exact norm of row 0 of ``A W_1 W_2 ...`` (float64 inputs, exact rational products)."""
    from fractions import Fraction

    R = [[Fraction(v) for v in row] for row in A.tolist()]
    for W in Ws:
        Wf = [[Fraction(v) for v in row] for row in W.tolist()]
        R = [[sum(r[k] * Wf[k][j] for k in range(len(Wf))) for j in range(len(Wf[0]))] for r in R]
    with mpmath.workdps(60):
        return mpmath.sqrt(mpmath.fsum(mpmath.mpf(v.numerator) / v.denominator * mpmath.mpf(v.numerator) / v.denominator
                                       for v in R[0]))


@pytest.mark.parametrize("case", ["chain", "chain-big", "single", "sum64", "partial"])
def test_product_row_norms_cover_products_that_underflow(case):
    """Stop 35's red team of F97: Higham's relative model has no underflow, and the chain ``|A||W|...`` underflows
    with the product: ``2^-540 * 2^-540 * 2^1000`` was certified 0 against an exact ``2^-80``, and a partial loss
    27 % under.  The certified row norm and its error bound are at least the exact norm and the exact error."""
    t = lambda *rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    A, Ws = {"chain": (t([2.0**-540]), (t([2.0**-540]), t([2.0**1000]))),
             "chain-big": (t([2.0**-540]), (t([2.0**-540]), t([2.0**1000]), t([2.0**1023]))),
             "single": (t([2.0**-540]), (t([2.0**-540]),)),
             "sum64": (t([2.0**-538] * 64), (torch.full((64, 1), 2.0**-538, dtype=torch.float64),)),
             "partial": (t([1.375 * 2.0**-537]), (t([2.0**-537]), t([2.0**1000])))}[case]
    exact = _exact_row_norm(A, *Ws)
    formed = A
    for W in Ws:
        formed = formed @ W
    err = mpmath.mpf(float(product_row_error(A, *Ws)[0]))
    assert mpmath.mpf(float(product_row_norms(A, *Ws)[0])) >= exact > 0
    assert formed.shape[1] == 1 and err >= abs(exact - abs(mpmath.mpf(float(formed[0, 0]))))  # one column: |row|


def test_product_row_norms_of_an_overflowing_product_are_inf():
    """A formed product that overflows (``inf - inf``) had a NaN norm: now ``inf``, a (useless) upper bound."""
    A = torch.tensor([[2.0**600, 2.0**600]], dtype=torch.float64)
    W = torch.tensor([[2.0**600], [-(2.0**600)]], dtype=torch.float64)
    assert product_row_norms(A, W).tolist() == [math.inf]


def test_certified_lmax_of_exactly_rank_one_grams_is_not_below_the_trace():
    """``lambda_max`` of an exactly stored rank-one ``v v^T`` is its exact trace ``||v||^2``; the trace fallback's float
    sum was 1.45 ulp under it (stop 35's red team).  Padded for its sum: never below."""
    from transcover.lipschitz._local_jacobian import certified_lmax

    v11 = [float.fromhex(h) for h in ("0x1.2p-28", "0x1p+0", "0x1.cp-29", "0x1.cp-27", "0x1.cp-27", "0x1p+0",
                                       "0x1.8p-27", "0x1.cp-29", "0x1.2p-27", "0x1p+0", "0x1.2p-27")]
    for v in (v11, [1.0, 2.0**-28]):
        G = torch.tensor([[a * b for b in v] for a in v], dtype=torch.float64)
        assert all(mpmath.mpf(a) * b == mpmath.mpf(a * b) for a in v for b in v)  # stored exactly
        exact = mpmath.fsum(mpmath.mpf(a) ** 2 for a in v)
        assert mpmath.mpf(float(certified_lmax(G[None])[0])) >= exact
