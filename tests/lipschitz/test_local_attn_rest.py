"""The attention stage's own Taylor rest for moves along the prefix's rows (issue 12, ``lipschitz._local_attn_rest``,
THEORY F78, F81): a float64 projected Adam ascent of the exact rest ``||A(x + D) - A(x) - A'(x) D||_i`` over the moves
``D = P delta + e`` never beats the rows (plain, sharp and causal heads, near-flat tokens, ``e = 0`` and ``e != 0``); the
rows are linear in ``W_V`` and second order in the move, as the rest is.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lipschitz_testkit import random_spec
from transcover.lipschitz._local_attention import head_norms
from transcover.lipschitz._local_attn_rest import (
    JointSpread, _head_factors, _joint_spread, attention_rest_rows, attn_rest_data, head_rest_sup, joint_rest_rows,
    piecewise_rest_rows, segment_rest_heads, weight_box,
)
from transcover.lipschitz._local_drift import hessian_ball_sup
from transcover.lipschitz._local_jacobian import _weight_norms
from transcover.lipschitz import _local_stack_attn, _local_stack_hadamard, _local_stack_query
from transcover.lipschitz._local_stack_attn import AttentionAligned
from transcover.lipschitz._local_stack_stages import _attn_stage
from transcover.model import attention_forward

T, D_MODEL = 3, 8


def _case(seed: int, qscale: float = 1.0, causal: bool = False, flat: bool = False, vscale: float = 1.0,  # noqa: ANN202
          oscale: float = 1.0, t: int = T, d: int = D_MODEL, heads: int = 2, pscale: float = 1.0, diag: bool = False,
          xscale: float = 1.0):
    """A post-LN layer's attention with biases (``qscale`` > 1: sharp heads), its input X (t, d) and a prefix P (blocks;
    ``diag``: the identity, every row moved by its own token only); ``xscale``: X times it and ``W_Q``, ``W_K``, ``W_V``
    over it (the same attention of the same points)."""
    L = random_spec(seed, act="gelu", norm="layernorm", d=d, H=heads, dh=d // heads, dff=8, biases=True,
                    causal=causal).layers[0]
    A = L.attention
    attn = dataclasses.replace(A, W_Q=A.W_Q * qscale / xscale, W_K=A.W_K / xscale, W_V=A.W_V * vscale / xscale,
                               W_O=A.W_O * oscale)
    layer = dataclasses.replace(L, attention=attn)
    g = torch.Generator().manual_seed(seed + 1)
    X = torch.randn(t, d, generator=g, dtype=torch.float64) * 1.5 * xscale
    if flat:  # near-flat tokens: one token repeated, 1e-12 apart
        X = X[:1].expand(t, d) + 1e-12 * torch.randn(t, d, generator=g, dtype=torch.float64)
    P = torch.randn(t, t, d, d, generator=g, dtype=torch.float64) / d**0.5 * pscale
    if diag:
        P = torch.eye(t, dtype=torch.float64)[:, :, None, None] * torch.eye(d, dtype=torch.float64)
    st, _ = _attn_stage("a", 0, layer, X, None, {"w": _weight_norms(layer), "h": head_norms(attn)})
    aa = AttentionAligned(st.attn, P)
    data = attn_rest_data(X, aa.p["heads"], aa.p["Wqa"], aa.p["scale"], aa.proj, aa.nQ, aa.nK, aa.p["norms"]["V"],
                          aa.p["mom"])
    return attn, X, P, data, aa, st


def _segment_rows(aa: AttentionAligned, P: torch.Tensor, rho: float, E: torch.Tensor) -> torch.Tensor:
    """F78c's rows through ``W_O`` (the radius of the segment's points from the prefix's row norms, padded)."""
    nu = torch.linalg.matrix_norm(P, ord=2).sum(dim=1) * (1 + 1e-9)
    sup = lambda t: (aa.sup(t), aa.sup(t, True), hessian_ball_sup(aa.p["mom"], t, aa.p["norms"]))  # noqa: E731
    return aa.combined(segment_rest_heads(sup, rho, float(E.max()), float((rho * nu + E).max()), 0.0))


def _piecewise_rows(st, aa: AttentionAligned, P: torch.Tensor, rho: float, E: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """F78d's rows from the stage's F35/F44e drift and F44c/F50 reach rows on the segment's pieces, as the stack reads
    them (the move outside the prefix's rows ``E = rho dP``)."""
    r = rho * torch.linalg.matrix_norm(P, ord=2).sum(dim=1) * (1 + 1e-9) + E
    dP = E / rho

    def rows_at(t: float) -> tuple:
        dj, _, _, hd = st.bounds(t * r)
        alt, _ = aa.drift(t * r, t * rho, dP, 0.0, 0.0, hd)
        reach = aa.combined(aa.reach_heads(t * r, t * rho, dP, 0.0, 0.0))
        return torch.minimum(reach, aa.joint(t * r, t * rho, dP, 0.0, 0.0)[0]), torch.minimum(dj, alt)
    return piecewise_rest_rows(rows_at, rho, float(E.max()))


def _rest(attn, X: torch.Tensor, D: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """The exact stage rest ``A(X + D) - A(X) - A'(X) D`` in float64 (the residual is linear and drops)."""
    f = lambda Z: attention_forward(attn, Z)  # noqa: E731
    return f(X + D) - f(X) - _jvp(f, X, D)


def _clip(V: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    n = V.norm(dim=-1, keepdim=True)
    return torch.where(n > r[:, None], V * (r[:, None] / n.clamp(min=1e-300)), V)


def _ascent(attn, X: torch.Tensor, P: torch.Tensor, rho: float, E: torch.Tensor, i: int,  # noqa: ANN001
            restarts: int = 2, steps: int = 30, pad: float = 0.0) -> float:
    """Projected Adam ascent of ``||R_i||`` over ``||delta_j|| <= rho``, ``||e_j|| <= E_j``, ``D = P delta + e``, and the
    exact centre ``X + c`` over ``||c_j|| <= pad``."""
    return _ascents(attn, X, P, rho, E, [i], restarts, steps, pad)[0]


def _ascents(attn, X: torch.Tensor, P: torch.Tensor, rho: float, E: torch.Tensor, queries: list,  # noqa: ANN001
             restarts: int = 2, steps: int = 30, pad: float = 0.0) -> list:
    """``_ascent(..., i, ...)`` for every query ``i`` of ``queries``, all their restarts run as one batch: each restart
    draws its starts from ``Generator(i)`` in the one-at-a-time order (``delta``, ``e``, ``c`` per restart), and Adam,
    acting entrywise, gives each restart the steps of its own optimiser (its gradient of the summed values is its own)."""
    t, d = X.shape
    R, Pd = torch.full((t,), rho, dtype=torch.float64), torch.full((t,), pad, dtype=torch.float64)
    dls, es, cs, rows = [], [], [], []
    for i in queries:
        g = torch.Generator().manual_seed(i)
        for _ in range(restarts):
            dls.append(_clip(torch.randn(t, d, generator=g, dtype=torch.float64) * rho, R))
            es.append(_clip(torch.randn(t, d, generator=g, dtype=torch.float64) * float(E.max()), E))
            cs.append(_clip(torch.randn(t, d, generator=g, dtype=torch.float64) * pad, Pd))
            rows.append(i)
    dl, e, c = (torch.stack(v).requires_grad_(True) for v in (dls, es, cs))
    at = torch.arange(len(rows))
    rows = torch.tensor(rows)
    opt = torch.optim.Adam([dl, e, c], lr=0.1 * max(rho, float(E.max()), pad))
    best = torch.zeros(len(rows), dtype=torch.float64)
    for _ in range(steps):
        with torch.no_grad():
            dl.copy_(_clip(dl, R))
            e.copy_(_clip(e, E))
            c.copy_(_clip(c, Pd))
        v = _rest(attn, X + c, torch.einsum("kjab,njb->nka", P, dl) + e)[at, rows].norm(dim=-1)
        best = torch.maximum(best, v.detach())
        opt.zero_grad()
        (-v.sum()).backward()
        opt.step()
    return [float(b) for b in best.reshape(len(queries), restarts).amax(dim=1)]


@pytest.mark.parametrize(("seed", "qscale", "causal", "flat", "rho", "efrac"), [
    (0, 1.0, False, False, 0.1, 0.0),  # plain, e = 0
    (1, 8.0, False, False, 0.05, 0.0),  # sharp heads
    (2, 1.0, True, False, 0.1, 0.3),  # causal, e != 0
    (3, 1.0, False, True, 0.1, 0.5),  # near-flat tokens, e != 0
    (4, 8.0, True, False, 0.02, 1.0),  # sharp causal heads, e as large as the prefix's part
])
def test_rest_rows_are_never_beaten(seed, qscale, causal, flat, rho, efrac):
    """The ascent's ``||R_i||`` stays below each of F78's, F78c's and F78d's rows for every query (up to the forward's
    own rounding), and reaches a fair share of F78's on some query of the plain case (the row is not vacuous)."""
    attn, X, P, data, aa, st = _case(seed, qscale, causal, flat)
    E = torch.full((T,), efrac * rho, dtype=torch.float64)
    rows = {"F78": attention_rest_rows(data, rho, E, 0.0, 0.0), "F78c": _segment_rows(aa, P, rho, E),
            "F78d": _piecewise_rows(st, aa, P, rho, E), "F81": joint_rest_rows(data, rho, E, 0.0, 0.0)}
    assert torch.all(rows["F81"] <= rows["F78"])
    tol = 1e-12 * float(attention_forward(attn, X).norm(dim=-1).max() + 1)
    got = _ascents(attn, X, P, rho, E, list(range(T)))  # _ascent(..., i) for every query, in one batch
    for name, row in rows.items():  # each branch on its own
        for i in range(T):
            assert got[i] <= float(row[i]) + tol, (name, i, got[i], float(row[i]))
    if seed == 0:
        assert max(g / float(r) for g, r in zip(got, rows["F78"])) > 1 / 200


def test_rest_row_is_attained_within_two_on_two_keys():
    """red26: two tokens in d = 2, one head, no prefix (``P = 0``), only token 0 moved (``||e_0|| <= 1e-3``): the ascent
    reaches more than half of F78's row at query 1 (0.77 of it), so F78's ``1/2`` is needed and a second halving (or any
    lost factor 2) fails here; and it never beats the row."""
    attn, X, _, data, _, _ = _case(0, t=2, d=2, heads=1)
    P = torch.zeros(2, 2, 2, 2, dtype=torch.float64)
    E = torch.tensor([1e-3, 0.0], dtype=torch.float64)
    row = float(attention_rest_rows(data, 0.0, E, 0.0, 0.0)[1])
    got = _ascent(attn, X, P, 0.0, E, 1, restarts=3, steps=40)
    assert 0.6 * row < got <= row, (got, row)


def test_rest_row_holds_at_the_worst_centre_within_the_pad():
    """red26: the same two keys, sharper (``W_Q x 4``), the exact centre searched within ``pad = 1`` of the stored input:
    the row with the pad holds, and the rest found there is above the row without it (so the pad's widening of the
    weights' box and of the value gaps is needed; dropping it failed no test before)."""
    attn, X, _, data, _, _ = _case(0, qscale=4.0, t=2, d=2, heads=1)
    P = torch.zeros(2, 2, 2, 2, dtype=torch.float64)
    E = torch.tensor([1e-3, 0.0], dtype=torch.float64)
    got = _ascent(attn, X, P, 0.0, E, 1, restarts=2, steps=40, pad=1.0)
    assert float(attention_rest_rows(data, 0.0, E, 0.0, 0.0)[1]) < got <= float(attention_rest_rows(data, 0.0, E, 0.0, 1.0)[1])


def test_rest_row_holds_for_the_prefix_error():
    """red26: the computed prefix 0 and its error ``eP = 1`` (every token free to move by ``rho eP``): the row holds
    against the ascent over those free moves and is not 0 (dropping ``rho eP`` failed no test before)."""
    attn, X, P, data, _, _ = _case(0, t=2, d=2, heads=1, pscale=0.0)
    E = torch.full((2,), 1e-3, dtype=torch.float64)
    row = float(attention_rest_rows(data, 1e-3, 0 * E, 1.0, 0.0)[1])
    assert 0 < _ascent(attn, X, P, 0.0, E, 1, restarts=2, steps=30) <= row


def test_rows_grow_with_the_prefix_error_and_the_pad():
    """``eP`` and ``pad`` only widen the set of moves and points: the rows never fall."""
    data = _case(5)[3]
    E = torch.full((T,), 0.01, dtype=torch.float64)
    base = attention_rest_rows(data, 0.05, E, 0.0, 0.0)
    assert torch.all(attention_rest_rows(data, 0.05, E, 0.1, 0.0) >= base)
    assert torch.all(attention_rest_rows(data, 0.05, E, 0.0, 0.01) >= base)


def test_rows_are_linear_in_the_output_map():
    """``W_O x c`` scales the rest by ``c``; F78's rows too (both head sums, one by one and jointly, carry ``W_O``)."""
    E = torch.full((T,), 0.02, dtype=torch.float64)
    rows = [attention_rest_rows(_case(9, oscale=c)[3], 0.05, E, 0.0, 0.0) for c in (1.0, 1e3)]
    assert torch.allclose(rows[1], 1e3 * rows[0], rtol=1e-9, atol=0)


def test_rows_are_linear_in_the_values():
    """``W_V x c`` scales the rest by ``c`` exactly; F78's, F81's and F78c's rows too, up to rounding."""
    E = torch.full((T,), 0.02, dtype=torch.float64)
    cases = [_case(6, vscale=c) for c in (1.0, 3.0)]
    for rows_of in (attention_rest_rows, joint_rest_rows):
        rows = [rows_of(cs[3], 0.05, E, 1e-3, 1e-6) for cs in cases]
        assert torch.allclose(rows[1], 3.0 * rows[0], rtol=1e-9, atol=0)
    seg = [_segment_rows(cs[4], cs[2], 0.05, E) for cs in cases]
    assert torch.allclose(seg[1], 3.0 * seg[0], rtol=1e-9, atol=0)


@pytest.mark.parametrize("rows_of", [attention_rest_rows, joint_rest_rows])
def test_rows_scale_without_underflow(rows_of):
    """red26 (THEORY F80, F81d): the move (``rho``, ``E``, ``pad``) scaled by ``2^-60`` and by ``2^-300`` gives rows in the
    ratio ``2^480`` (the rest's second order; both far below the rows' higher orders), where the heads' joint norm once
    squared ``~1e-181`` to 0 and the value term's ``V sum p W^2`` (four factors of the move squared) underflowed; F81's
    ``V^J`` is squared at ``head_rest_sup``'s power of two (at the move's own scale it would be ``2^-600`` against the
    rescaled F78 ``V`` of order one)."""
    data = _case(6)[3]
    E = torch.full((T,), 0.02, dtype=torch.float64)
    rows = [rows_of(data, 0.05 * c, E * c, 1e-3, 1e-6 * c) / c**2 for c in (2.0**-60, 2.0**-300)]
    assert torch.all(rows[1] > 0)
    assert torch.allclose(rows[1], rows[0], rtol=1e-9, atol=0)


@pytest.mark.parametrize("e", [-600, -300, 0, 300, 600])
def test_frobenius_norms_neither_underflow_nor_overflow(e):
    """THEORY F81d: every module's padded Frobenius norm of ``2^e A`` is ``2^e`` times that of ``A`` (exact scalings)
    and at least the exact norm (float64 norms of ``A``'s entries at 2^-600 squared to 0, at 2^600 to inf)."""
    A = torch.randn(3, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    c = 2.0**e
    exact = math.sqrt(math.fsum(float(a) ** 2 for a in A.flatten()))
    for fro, dims in ((_local_stack_attn._fro, (1, 2)), (_local_stack_query._fro, (1, 2))):
        got, ref = fro(A * c, dims), fro(A, dims)
        assert torch.equal(got / c, ref)
        assert bool((ref >= A.norm(dim=dims)).all())
    got = _local_stack_hadamard._fro(A * c)
    assert got / c == _local_stack_hadamard._fro(A) and got / c >= exact


@pytest.mark.parametrize("rows_of", [attention_rest_rows, joint_rest_rows])
def test_rows_are_scale_free_in_the_inputs(rows_of):
    """land28 (THEORY F81d): the tokens, the move and the pad times ``2^300`` with ``W_Q``, ``W_K``, ``W_V`` over it (the
    same attention of the same points, sharp heads ``W_Q x 30``) give the same rows to ``1e-12``; F44a's Frobenius
    norms of ``W_Q^T Q W_Q`` (entries ``2^-600``) once squared to 0 there, dropping the Grams' rounding terms (rows
    ``1.4e-6`` lower)."""
    E = torch.tensor([0.0, 0.02, 0.02], dtype=torch.float64)
    c = 2.0**300
    rows = [rows_of(_case(13, 30.0, xscale=x)[3], 0.05 * x, E * x, 1e-3, 1e-4 * x) for x in (1.0, c)]
    assert torch.allclose(rows[1], rows[0], rtol=1e-12, atol=0)


@pytest.mark.parametrize("rows_of", [attention_rest_rows, joint_rest_rows])
@pytest.mark.parametrize("part", ["prefix", "outside"])
def test_rows_are_second_order_in_the_move(part, rows_of):
    """With only the prefix's part (``E = 0``) or only the part outside it (``rho = 0``) scaled by ``tau``, the rest is
    ``tau^2`` times a form plus higher orders: the rows divided by ``tau^2`` fall as ``tau`` falls and settle."""
    data = _case(7)[3]
    taus = (1e-1, 1e-2, 1e-3, 1e-4)
    E = torch.full((T,), 0.1, dtype=torch.float64)
    if part == "prefix":
        q = [rows_of(data, 0.1 * t, 0 * E, 0.0, 0.0) / t**2 for t in taus]
    else:
        q = [rows_of(data, 0.0, t * E, 0.0, 0.0) / t**2 for t in taus]
    for a, b in zip(q, q[1:]):
        assert torch.all(b <= a * (1 + 1e-9))
    assert torch.all(q[-1] > 0)
    assert torch.allclose(q[-1], q[-2], rtol=1e-2)


def _softmax_second(p: torch.Tensor, u: torch.Tensor, sig: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_j p''_j y_j + 2 sum_j p'_j w_j`` for weights ``p``, score velocity ``u``, acceleration ``sig`` (F78a)."""
    ub = (p * u).sum()
    dp = p * (u - ub)
    ddp = p * ((u - ub) ** 2 - (p * (u - ub) ** 2).sum()) + p * (sig - (p * sig).sum())
    return ddp @ y + 2 * dp @ w


@pytest.mark.parametrize("term", ["velocity", "acceleration", "value move"])
def test_head_sup_is_attained_where_one_term_acts(term):
    """Two keys, weights ``(0.9, 0.1)``, one of F78a's three terms acting: ``head_rest_sup`` is never below the exact
    ``||sum p'' y + 2 sum p' w||`` and within 3 % of it (so no term, factor or weight of the bound can be lost)."""
    p = torch.tensor([0.9, 0.1], dtype=torch.float64)
    u = torch.tensor([1.3, 0.0], dtype=torch.float64) * (term != "acceleration")
    sig = torch.tensor([0.7, 0.0], dtype=torch.float64) * (term == "acceleration")
    y = torch.tensor([[0.0, 0.0], [2.0, 0.0]], dtype=torch.float64) * (term != "value move")
    w = torch.tensor([[0.0, 0.0], [0.0, 1.5]], dtype=torch.float64) * (term == "value move")
    exact = float(_softmax_second(p, u, sig, y, w).norm())
    gap = (y[:, None, :] - y[None, :, :]).norm(dim=-1)
    lo, hi, U, sg = (v[None].expand(2, 2) for v in (p * (1 - 1e-9), p * (1 + 1e-9), u.abs(), sig.abs()))  # two queries alike
    for sp in (None, JointSpread(torch.full((2,), math.inf, dtype=torch.float64), ())):  # F78; F81c's fill
        got = float(head_rest_sup(lo, hi, U, sg, gap, w.norm(dim=-1), sp)[0])
        assert exact > 0
        assert exact <= got <= 1.03 * exact, (exact, got)


def test_variance_fill_is_sound_and_tighter():
    """Three keys, the two heavy ones' velocities opposite and the light one far away (its value gap 10): F81c's fill of
    the variance's mass by the largest gaps first stays above the exact ``||sum p'' y||`` and is at least 5 % below
    F78's ``min(sum p C^2 Yb, V max Yb)``."""
    p = torch.tensor([0.45, 0.45, 0.1], dtype=torch.float64)
    u = torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64)
    y = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 10.0]], dtype=torch.float64)
    zero = torch.zeros(3, dtype=torch.float64)
    exact = float(_softmax_second(p, u, zero, y, torch.zeros(3, 2, dtype=torch.float64)).norm())
    gap = (y[:, None, :] - y[None, :, :]).norm(dim=-1)
    lo, hi, U, sg = (v[None].expand(3, 3) for v in (p * (1 - 1e-9), p * (1 + 1e-9), u.abs(), zero))
    f78 = float(head_rest_sup(lo, hi, U, sg, gap, zero)[0])
    f81 = float(head_rest_sup(lo, hi, U, sg, gap, zero, JointSpread(torch.full((3,), math.inf, dtype=torch.float64), ()))[0])
    assert exact <= f81 <= 0.95 * f78, (exact, f81, f78)


def test_the_taylor_weights_on_the_pieces():
    """With sups constant along the segment F78c is ``(rho^2 F + 2 rho e F^m + e^2 S) / 2``; with rows linear in the
    scale F78d is ``(n + 1) / (2n)`` of the top's ``rho reach + dj e``."""
    F, Fm, S = (torch.full((2, 3), v, dtype=torch.float64) for v in (1.0, 2.0, 3.0))
    seg = segment_rest_heads(lambda s: (F, Fm, S), 0.5, 0.25, 1.0, 0.0)
    assert torch.allclose(seg, torch.full((2, 3), (0.25 + 0.5 + 0.1875) / 2, dtype=torch.float64), rtol=1e-9)
    a, b = torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([4.0, 0.0], dtype=torch.float64)
    pw = piecewise_rest_rows(lambda t: (t * a, t * b), 0.5, 0.25)
    assert torch.allclose(pw, 5 / 8 * (0.5 * a + 0.25 * b), rtol=1e-9)


def _jvp(f, Z: torch.Tensor, D: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    return torch.autograd.functional.jvp(f, Z, D, create_graph=True)[1]


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm(dim=-1, keepdim=True).clamp(min=1e-300)


@pytest.mark.parametrize("efrac", [0.0, 1.0])
def test_score_and_value_moves_within_their_rows(efrac):
    """F78b's factors against the exact head at the points ``x + t D`` (t = 0, 1) of moves aligned with one pair's key
    part, query part or value move (``delta_m`` along ``P_jm^T q_i``, ``P_im^T G y_ij``, ``P_jm^T W_V W_O u``, ``e`` alike):
    the score velocities less the query's constant ``|s'_ij - D_i G xbar_i| <= U_ij``, ``|s''_ij| <= sig_ij``, the weights
    in their box, the value gaps ``||(z_j - z_k) W_V (W_O)|| <= gap_jk`` and ``||W_O^hT W_V^hT D_j|| <= W_j``."""
    from transcover.model import attention_scores

    attn, X, P, data, aa, _ = _case(8, qscale=3.0)
    rho = 0.5
    E = torch.full((T,), efrac * rho, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    for h, (Ph, Yc, q, Wq, Wk, Wv, Wo) in enumerate(aa.p["heads"]):
        U, sig, lo, hi, mV, gap, gapv, _, _ = _head_factors(data, h, rho, E, E)
        G = aa.p["scale"] * Wq @ Wk.T
        for i in range(T):
            for j in range(T):
                u = torch.randn(D_MODEL, generator=g, dtype=torch.float64)
                for a, v in ((j, q[i]), (i, G @ Yc[i, j]), (j, Wv @ Wo @ u)):  # the token moved, the direction
                    dl = torch.zeros(T, D_MODEL, dtype=torch.float64)
                    dl[:] = rho * _unit(torch.einsum("mab,a->mb", P[a], v))
                    D = torch.einsum("kjab,jb->ka", P, dl)
                    D[a] = D[a] + E[a] * _unit(v)
                    for t in (0.0, 1.0):
                        ds = _jvp(lambda Z: attention_scores(attn, Z, h), X + t * D, D)[i] - D[i] @ G @ (X[0] - Yc[i, 0])
                        dds = _jvp(lambda Z: _jvp(lambda W: attention_scores(attn, W, h), Z, D), X + t * D, D)[i]
                        s = lambda Z: attention_scores(attn, Z, h)  # noqa: E731
                        p = torch.softmax(s(X + t * D)[i], dim=-1)
                        assert torch.all(ds.abs() <= U[i] + 1e-12)  # less the query's constant D_i G xbar_i
                        Zd = (X + t * D)[:, None, :] - (X + t * D)[None, :, :]
                        assert torch.all((Zd @ Wv @ Wo).norm(dim=-1) <= gap + 1e-12)
                        assert torch.all((Zd @ Wv).norm(dim=-1) <= gapv + 1e-12)
                        assert torch.all(dds.abs() <= sig[i] + 1e-12)
                        assert torch.all((lo[i] <= p + 1e-15) & (p <= hi[i] + 1e-15))
                    assert torch.all((D @ Wv @ Wo).norm(dim=-1) <= data.nO[h] * mV + 1e-12)


@pytest.mark.parametrize(("seed", "qscale", "diag", "outside"), [
    (10, 1.0, True, False), (11, 6.0, True, False), (12, 1.0, False, False), (10, 1.0, True, True)])
def test_joint_variance_holds_and_is_tight(seed, qscale, diag, outside):
    """F81's joint ``var_p(u_i)`` of the score velocities at the data (small moves: the box is ``p``, the cross part
    second order) against a projected Adam ascent of the exact ``var_p(ds_i)`` over ``D = P delta`` (``outside``: over
    ``D = e``, ``||e_j|| <= E``, ``rho = 0``): never above it, and with every row moved by its own token (``diag``: exact
    ellipsoids) or by ``e`` within 2x of it on some query, so that half of F81's variance fails."""
    from transcover.model import attention_scores

    attn, X, P, data, aa, _ = _case(seed, qscale, diag=diag)
    size = 1e-6
    rho, E = (0.0, torch.full((T,), size, dtype=torch.float64)) if outside else (size, torch.zeros(T, dtype=torch.float64))
    if outside:
        P = torch.eye(T, dtype=torch.float64)[:, :, None, None] * torch.eye(D_MODEL, dtype=torch.float64)
    radius = torch.full((T,), size, dtype=torch.float64)
    ratio = 0.0
    for h in range(data.S.shape[0]):
        lo, hi = weight_box(data.S[h], data.eS[h])
        key, cross = _head_factors(data, h, rho, E, E)[7:]
        Vj = _joint_spread(data, h, rho, E, lo, hi, key, cross).var(lo, hi)
        s = lambda Z: attention_scores(attn, Z, h)  # noqa: E731
        p = torch.softmax(s(X), dim=-1)
        # every query's 3 restarts (Generator(i), drawn in the one-at-a-time order) as one batch of Adam ascents:
        # Adam acts entrywise and each restart's gradient of the summed values is its own
        starts = []
        for i in range(T):
            g = torch.Generator().manual_seed(i)
            starts += [_clip(torch.randn(T, D_MODEL, generator=g, dtype=torch.float64) * size, radius) for _ in range(3)]
        dl = torch.stack(starts).requires_grad_(True)
        q = torch.arange(T).repeat_interleave(3)
        opt = torch.optim.Adam([dl], lr=0.1 * size)
        best_all = torch.zeros(3 * T, dtype=torch.float64)
        for _ in range(40):
            with torch.no_grad():
                dl.copy_(_clip(dl, radius))
            u = _jvp(s, X.expand(3 * T, T, D_MODEL), torch.einsum("kjab,njb->nka", P, dl))[torch.arange(3 * T), q]
            v = (p[q] * (u - (p[q] * u).sum(-1, keepdim=True)) ** 2).sum(-1)
            best_all = torch.maximum(best_all, v.detach())
            opt.zero_grad()
            (-v.sum()).backward()
            opt.step()
        for i in range(T):
            best = float(best_all[3 * i:3 * i + 3].max())
            assert best <= float(Vj[i]) * (1 + 1e-9), (h, i, best, float(Vj[i]))
            ratio = max(ratio, best / float(Vj[i]))
    assert ratio > 0.5 or not diag, ratio
