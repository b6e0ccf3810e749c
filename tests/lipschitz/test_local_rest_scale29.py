"""F78a's rest bound at any scale of one query's score velocity (mend29, THEORY F80/F81d): the power of two is taken per
query row, so a query whose ``U`` is ``2^-540`` below another's keeps its squares (they flushed to 0 and its row with
them: a false 0); the scalings back are one exact step each way, rounded outward below the normal range (``U`` at
``2^-600`` with the gaps at ``2^600`` divided by ``a`` twice first and flushed); the heads' norm per query likewise.  The local attention routes refuse value-side norms outside ``[2^-400, 2^400]``
(Note [local norm range] in ``_local_attention``)."""

from __future__ import annotations

import dataclasses
import math

import mpmath
import pytest
import torch

from lipschitz_testkit import random_spec
from transcover import InputError
from transcover.lipschitz import attention_local_bound, layer_local
from transcover.lipschitz._local_attn_rest import JointSpread, _heads_norm, head_rest_sup, weight_box

T = 4
TINY = torch.finfo(torch.float64).tiny


def _inputs(seed: int, causal: bool = False):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(T, T, generator=g, dtype=torch.float64)
    if causal:
        S = S.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    lo, hi = weight_box(S, 0.1 * torch.rand(T, T, generator=g, dtype=torch.float64))
    U = torch.rand(T, T, generator=g, dtype=torch.float64) + 0.1
    sig = torch.rand(T, T, generator=g, dtype=torch.float64) * U
    gap = torch.rand(T, T, generator=g, dtype=torch.float64) + 0.5
    W = torch.rand(T, generator=g, dtype=torch.float64) * 0.5
    return lo, hi, U, sig, gap + gap.T, W


def _spread(U: torch.Tensor) -> JointSpread:
    return JointSpread(0.3 * U[:, 0], (0.2 * U, 0.1 * U))


@pytest.mark.parametrize("k", [60, 300, 540, 600, 1000])
@pytest.mark.parametrize("joint", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_a_query_row_does_not_depend_on_the_other_rows_scale(k, joint, causal):
    """Rows 1.. at ``2^-k`` of row 0 give the same floats as with row 0 at that scale too (each row reads its own)."""
    lo, hi, U, sig, gap, W = _inputs(k, causal)
    s = torch.full((T, 1), 2.0**-k, dtype=torch.float64)
    rows = []
    for s0 in (1.0, 2.0**-k):
        s[0] = s0
        Us = U * s
        rows.append(head_rest_sup(lo, hi, Us, sig * s * s, gap, W, _spread(Us) if joint else None))
    assert torch.equal(rows[0][1:], rows[1][1:]), (rows, k)
    assert torch.all(rows[0][1:] > 0)  # a visible second key in every row from 1 on: a positive rest


@pytest.mark.parametrize("ku,kg", [(-500, 600), (500, -600), (-300, 300), (-500, 0), (0, 600), (-500, -100)])
@pytest.mark.parametrize("joint", [False, True])
def test_rows_scale_as_a_squared_b(ku, kg, joint):
    """(``sig`` at ``2^2ku`` stays normal for ``|ku| <= 500``) ``U -> 2^ku U``, ``sig -> 2^2ku sig``, ``gap -> 2^kg gap``, ``W -> 2^(ku+kg) W``, the spread ``-> 2^ku``: the rows
    times ``2^(2ku + kg)`` exactly where that is a normal float, and never below it (mpmath) where it is not."""
    lo, hi, U, sig, gap, W = _inputs(1)
    base = head_rest_sup(lo, hi, U, sig, gap, W, _spread(U) if joint else None)
    a, b = 2.0**ku, 2.0**kg
    got = head_rest_sup(lo, hi, U * a, sig * a * a, gap * b, W * a * b, _spread(U * a) if joint else None)
    for x, y in zip(got.tolist(), base.tolist()):
        exact = mpmath.ldexp(mpmath.mpf(y), 2 * ku + kg)
        if TINY <= exact <= 1e308:
            assert x == math.ldexp(y, 2 * ku + kg), (x, y, ku, kg)
        else:
            assert mpmath.mpf(x) >= exact, (x, y, ku, kg)


@pytest.mark.parametrize("k", [-1000, -600, -540, 0, 300, 600])
def test_heads_norm_per_query(k):
    """``(sum_h v_h^2)^{1/2}`` of a query at ``2^k`` next to one at 1: exactly ``2^k`` times its norm at 1 (it flushed
    to 0 below ``2^-537`` with the power of two of the largest entry), never below the exact norm."""
    v = torch.tensor([[3.0, 0.75], [4.0, 1.0]], dtype=torch.float64)
    got = _heads_norm(v * torch.tensor([1.0, 2.0**k], dtype=torch.float64))
    assert float(got[0]) == float(_heads_norm(v[:, :1])[0])
    one = float(_heads_norm(v[:, 1:])[0])
    assert one >= 1.25 and (float(got[1]) == math.ldexp(one, k) or mpmath.mpf(float(got[1])) >= mpmath.ldexp(1.25, k))


def _layer_scaled(kv: int, ko: int):  # noqa: ANN202
    """A pre-LN layer with ``W_V x 2^kv`` and ``W_O x 2^ko`` (for ``kv = -ko`` the same map) and its input."""
    L = random_spec(3, L=1, norm="layernorm", placement="pre").layers[0]
    A = L.attention
    two = lambda k: torch.tensor(float(k), dtype=torch.float64)  # noqa: E731
    attn = dataclasses.replace(A, W_V=torch.ldexp(A.W_V, two(kv)), W_O=torch.ldexp(A.W_O, two(ko)))
    X = torch.randn(5, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return dataclasses.replace(L, attention=attn), X


@pytest.mark.parametrize("kv,ko", [(-300, 300), (300, -300), (-200, 0)])
def test_local_attention_is_homogeneous_in_the_value_side(kv, ko):
    """Note [local norm range]: inside ``[2^-400, 2^400]`` the local attention bound scales exactly by ``2^(kv+ko)``."""
    base = attention_local_bound(_layer_scaled(0, 0)[0].attention, _layer_scaled(0, 0)[1], 0.01)
    layer, X = _layer_scaled(kv, ko)
    got = attention_local_bound(layer.attention, X, 0.01)
    assert got.upper == math.ldexp(base.upper, kv + ko) and got.linear == math.ldexp(base.linear, kv + ko)


@pytest.mark.parametrize("kv,ko", [(-540, 540), (-600, 600), (600, -600), (0, 500)])
def test_local_routes_refuse_value_norms_outside_the_range(kv, ko):
    """``W_V x 2^-540`` with ``W_O x 2^540`` (the map at scale 1, constant 13.4) was certified 0 by
    ``attention_local_bound`` (every ``L_h^2`` flushed), and ``layer_local`` raised a raw LinAlgError at ``2^-+600``."""
    layer, X = _layer_scaled(kv, ko)
    for route in (lambda: attention_local_bound(layer.attention, X, 0.01), lambda: layer_local(layer, X, 0.01)):
        with pytest.raises(InputError, match=r"in \[2\^-400, 2\^400\]"):
            route()
