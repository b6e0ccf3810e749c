"""The attention stage's own Taylor rest for moves along the prefix's rows (issue 12, ``lipschitz._local_attn_rest``,
THEORY F78): a float64 projected Adam ascent of the exact rest ``||A(x + D) - A(x) - A'(x) D||_i`` over the moves
``D = P delta + e`` never beats the rows (plain, sharp and causal heads, near-flat tokens, ``e = 0`` and ``e != 0``); the
rows are linear in ``W_V`` and second order in the move, as the rest is.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lipschitz_testkit import random_spec
from transcover.lipschitz._local_attention import head_norms
from transcover.lipschitz._local_attn_rest import attention_rest_rows, attn_rest_data, segment_rest_heads
from transcover.lipschitz._local_drift import hessian_ball_sup
from transcover.lipschitz._local_jacobian import _weight_norms
from transcover.lipschitz._local_stack_attn import AttentionAligned
from transcover.lipschitz._local_stack_stages import _attn_stage
from transcover.model import attention_forward

T, D_MODEL = 3, 8


def _case(seed: int, qscale: float = 1.0, causal: bool = False, flat: bool = False, vscale: float = 1.0):  # noqa: ANN202
    """A post-LN layer's attention with biases (``qscale`` > 1: sharp heads), its input X and a prefix P (blocks)."""
    L = random_spec(seed, act="gelu", norm="layernorm", d=D_MODEL, H=2, dh=D_MODEL // 2, dff=8, biases=True,
                    causal=causal).layers[0]
    attn = dataclasses.replace(L.attention, W_Q=L.attention.W_Q * qscale, W_V=L.attention.W_V * vscale)
    layer = dataclasses.replace(L, attention=attn)
    g = torch.Generator().manual_seed(seed + 1)
    X = torch.randn(T, D_MODEL, generator=g, dtype=torch.float64) * 1.5
    if flat:  # near-flat tokens: one token repeated, 1e-12 apart
        X = X[:1].expand(T, D_MODEL) + 1e-12 * torch.randn(T, D_MODEL, generator=g, dtype=torch.float64)
    P = torch.randn(T, T, D_MODEL, D_MODEL, generator=g, dtype=torch.float64) / D_MODEL**0.5
    st, _ = _attn_stage("a", 0, layer, X, None, {"w": _weight_norms(layer), "h": head_norms(attn)})
    aa = AttentionAligned(st.attn, P)
    data = attn_rest_data(X, aa.p["heads"], aa.p["Wqa"], aa.p["scale"], aa.proj, aa.nQ, aa.nK, aa.p["norms"]["V"])
    return attn, X, P, data, aa


def _segment_rows(aa: AttentionAligned, P: torch.Tensor, rho: float, E: torch.Tensor) -> torch.Tensor:
    """F78c's rows through ``W_O`` (the radius of the segment's points from the prefix's row norms, padded)."""
    nu = torch.linalg.matrix_norm(P, ord=2).sum(dim=1) * (1 + 1e-9)
    sup = lambda t: (aa.sup(t), aa.sup(t, True), hessian_ball_sup(aa.p["mom"], t, aa.p["norms"]))  # noqa: E731
    return aa.combined(segment_rest_heads(sup, rho, float(E.max()), float((rho * nu + E).max()), 0.0))


def _rest(attn, X: torch.Tensor, D: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """The exact stage rest ``A(X + D) - A(X) - A'(X) D`` in float64 (the residual is linear and drops)."""
    f = lambda Z: attention_forward(attn, Z)  # noqa: E731
    return f(X + D) - f(X) - torch.autograd.functional.jvp(f, X, D, create_graph=True)[1]


def _clip(V: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    n = V.norm(dim=-1, keepdim=True)
    return torch.where(n > r[:, None], V * (r[:, None] / n.clamp(min=1e-300)), V)


def _ascent(attn, X: torch.Tensor, P: torch.Tensor, rho: float, E: torch.Tensor, i: int,  # noqa: ANN001
            restarts: int = 2, steps: int = 30) -> float:
    """Projected Adam ascent of ``||R_i||`` over ``||delta_j|| <= rho``, ``||e_j|| <= E_j``, ``D = P delta + e``."""
    g = torch.Generator().manual_seed(i)
    R = torch.full((T,), rho, dtype=torch.float64)
    best = 0.0
    for _ in range(restarts):
        dl = _clip(torch.randn(T, D_MODEL, generator=g, dtype=torch.float64) * rho, R).requires_grad_(True)
        e = _clip(torch.randn(T, D_MODEL, generator=g, dtype=torch.float64) * float(E.max()), E).requires_grad_(True)
        opt = torch.optim.Adam([dl, e], lr=0.1 * rho)
        for _ in range(steps):
            with torch.no_grad():
                dl.copy_(_clip(dl, R))
                e.copy_(_clip(e, E))
            v = _rest(attn, X, torch.einsum("kjab,jb->ka", P, dl) + e)[i].norm()
            best = max(best, float(v.detach()))
            opt.zero_grad()
            (-v).backward()
            opt.step()
    return best


@pytest.mark.parametrize(("seed", "qscale", "causal", "flat", "rho", "efrac"), [
    (0, 1.0, False, False, 0.1, 0.0),  # plain, e = 0
    (1, 8.0, False, False, 0.05, 0.0),  # sharp heads
    (2, 1.0, True, False, 0.1, 0.3),  # causal, e != 0
    (3, 1.0, False, True, 0.1, 0.5),  # near-flat tokens, e != 0
    (4, 8.0, True, False, 0.02, 1.0),  # sharp causal heads, e as large as the prefix's part
])
def test_rest_rows_are_never_beaten(seed, qscale, causal, flat, rho, efrac):
    """The ascent's ``||R_i||`` stays below F78's and F78c's rows for every query (up to the forward's own rounding), and
    reaches a fair share of F78's on some query of the plain case (the row is not vacuous)."""
    attn, X, P, data, aa = _case(seed, qscale, causal, flat)
    E = torch.full((T,), efrac * rho, dtype=torch.float64)
    row = torch.minimum(attention_rest_rows(data, rho, E, 0.0, 0.0), _segment_rows(aa, P, rho, E))
    tol = 1e-12 * float(attention_forward(attn, X).norm(dim=-1).max() + 1)
    got = [_ascent(attn, X, P, rho, E, i) for i in range(T)]
    for i in range(T):
        assert got[i] <= float(row[i]) + tol, (i, got[i], float(row[i]))
    if seed == 0:
        assert max(g / float(r) for g, r in zip(got, attention_rest_rows(data, rho, E, 0.0, 0.0))) > 1 / 200


def test_rows_grow_with_the_prefix_error_and_the_pad():
    """``eP`` and ``pad`` only widen the set of moves and points: the rows never fall."""
    data = _case(5)[3]
    E = torch.full((T,), 0.01, dtype=torch.float64)
    base = attention_rest_rows(data, 0.05, E, 0.0, 0.0)
    assert torch.all(attention_rest_rows(data, 0.05, E, 0.1, 0.0) >= base)
    assert torch.all(attention_rest_rows(data, 0.05, E, 0.0, 0.01) >= base)


def test_rows_are_linear_in_the_values():
    """``W_V x c`` scales the rest by ``c`` exactly; the rows too, up to rounding."""
    E = torch.full((T,), 0.02, dtype=torch.float64)
    rows = [attention_rest_rows(_case(6, vscale=c)[3], 0.05, E, 1e-3, 1e-6) for c in (1.0, 3.0)]
    assert torch.allclose(rows[1], 3.0 * rows[0], rtol=1e-9, atol=0)


@pytest.mark.parametrize("part", ["prefix", "outside"])
def test_rows_are_second_order_in_the_move(part):
    """With only the prefix's part (``E = 0``) or only the part outside it (``rho = 0``) scaled by ``tau``, the rest is
    ``tau^2`` times a form plus higher orders: the rows divided by ``tau^2`` fall as ``tau`` falls and settle."""
    data = _case(7)[3]
    taus = (1e-1, 1e-2, 1e-3, 1e-4)
    E = torch.full((T,), 0.1, dtype=torch.float64)
    if part == "prefix":
        q = [attention_rest_rows(data, 0.1 * t, 0 * E, 0.0, 0.0) / t**2 for t in taus]
    else:
        q = [attention_rest_rows(data, 0.0, t * E, 0.0, 0.0) / t**2 for t in taus]
    for a, b in zip(q, q[1:]):
        assert torch.all(b <= a * (1 + 1e-9))
    assert torch.all(q[-1] > 0)
    assert torch.allclose(q[-1], q[-2], rtol=1e-2)
