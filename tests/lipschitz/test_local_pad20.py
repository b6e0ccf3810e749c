"""F64: the stack route's centre pad covers the computed centres' error (THEORY F64).

Attacks: tokens whose mean dwarfs their spread (mean/sigma 1e4..1e8, eps 0 or tiny, heterogeneous gains), where F17's
pad ``1e-13 max||xhat_s||`` is beaten by the float64 forward's own error (measured here against an 80-bit ``longdouble``
forward of the same stored floats): the one-pass LayerNorm bound ``norm_forward_error`` stays above the measured error;
``stack_local(centre="f64")``'s pads cover every sub-stage centre's error, and its radii at rho = 1e-20..1e-12 of the
token norm cover the exact moves of sampled network inputs in the ball (with F17's pads both fail); on an ordinary stack
the default's pads are F17's exactly and ``"f64"``'s never below them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lipschitz_testkit import random_spec
from transcover.lipschitz._local_centre import CENTRE_PAD_ASSUMPTION, centre_errors, norm_forward_error
from transcover.lipschitz._local_stack import _stages, stack_local
from transcover.model import NormKind, NormSpec

LD = np.longdouble
U_LD = float(np.finfo(LD).eps) / 2  # the reference's own unit roundoff (2^-64 on x86)
HAVE_LD = U_LD < 2.0**-60
needs_ld = pytest.mark.skipif(not HAVE_LD, reason="needs an extended-precision longdouble")


def _ld(t: torch.Tensor) -> np.ndarray:
    return np.asarray(t.detach().double().numpy(), dtype=LD)


def _norm_ld(norm: NormSpec, x: np.ndarray) -> np.ndarray:
    """The norm of ``NormSpec.__call__`` in longdouble."""
    if norm.kind is NormKind.LAYERNORM:
        c = x - x.mean(axis=-1, keepdims=True)
        y = c / np.sqrt((c * c).mean(axis=-1, keepdims=True) + LD(norm.eps))
    else:
        y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + LD(norm.eps))
    y = y * _ld(norm.weight) if norm.weight is not None else y
    return y + _ld(norm.bias) if norm.bias is not None else y


def _stages_ld(spec, X: np.ndarray) -> list:  # noqa: ANN001
    """The sub-stage inputs of a post-LN ReLU stack (input norm, per layer attention, first norm, FFN, second norm)
    in longdouble, dot attention with scale 1/sqrt(d_head) exact (d_head = 4), no biases."""
    out = [X]
    Z = _norm_ld(spec.input_norm, X)
    for ly in spec.layers:
        a = ly.attention
        S1 = Z.copy()
        for h in range(a.n_heads):
            Wq, Wk, Wv, Wo = (_ld(w) for w in a.head(h))
            s = (Z @ Wq) @ (Z @ Wk).T / LD(2)
            P = np.exp(s - s.max(axis=-1, keepdims=True))
            S1 = S1 + (P / P.sum(axis=-1, keepdims=True)) @ Z @ Wv @ Wo
        H = _norm_ld(ly.norm_attn, S1)
        S2 = H + np.maximum(H @ _ld(ly.ffn.W_1), 0) @ _ld(ly.ffn.W_2)
        out += [Z, S1, H, S2]
        Z = _norm_ld(ly.norm_ffn, S2)
    return out


def _offset_case(seed: int, offset: float, T: int, eps: float) -> tuple:
    spec = random_spec(seed, d=6, H=2, dh=4, dff=8, L=1, norm="layernorm", eps=eps)
    g = torch.Generator().manual_seed(seed)
    X = offset * (1 + torch.rand(T, 1, generator=g, dtype=torch.float64)) + torch.randn(T, 6, generator=g, dtype=torch.float64)
    return spec, X


def _centred(v: np.ndarray) -> np.ndarray:
    return v - v.mean(axis=-1, keepdims=True)


@needs_ld
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_forward_error_covers_the_measured_error(kind: str) -> None:
    """The one-pass norm's float64 output against the longdouble one: below ``norm_forward_error`` always (less the
    reference's own error, the same bound at 2^-64), above F17's 1e-13 max||y|| for LayerNorm at mean/sigma >= 1e5."""
    g = torch.Generator().manual_seed(0)
    gam = torch.exp(3 * torch.randn(16, generator=g, dtype=torch.float64))  # heterogeneous gains
    beaten = 0
    for off in [0.0, 1e2, 1e4, 1e5, 1e6, 1e8]:
        for eps in [0.0, 1e-12]:
            norm = NormSpec(NormKind(kind), gam, 0.1 * torch.randn(16, generator=g, dtype=torch.float64), eps)
            X = off * (1 + torch.rand(5, 1, generator=g, dtype=torch.float64)) + torch.randn(5, 16, generator=g, dtype=torch.float64)
            Y = norm(X)
            err = float(np.sqrt(((_ld(Y) - _norm_ld(norm, _ld(X))) ** 2).sum(axis=-1)).max())
            bound = norm_forward_error(norm, X)
            assert err <= bound * (1 - 2.0 ** -10), (kind, off, eps, err, bound)
            beaten += err > 1e-13 * float(Y.norm(dim=1).max())
    assert beaten >= (4 if kind == "layernorm" else 0)


def test_norm_forward_error_homogeneity() -> None:
    """Degree 1 in the gain (no bias), degree 0 in a power-of-two scale of the token (eps = 0): exact in float64."""
    g = torch.Generator().manual_seed(1)
    X = 1e6 + torch.randn(4, 8, generator=g, dtype=torch.float64)
    gam = torch.rand(8, generator=g, dtype=torch.float64) + 0.5
    e = norm_forward_error(NormSpec(NormKind.LAYERNORM, gam, None, 0.0), X)
    assert norm_forward_error(NormSpec(NormKind.LAYERNORM, 8 * gam, None, 0.0), X) == pytest.approx(8 * e, rel=1e-15)
    assert norm_forward_error(NormSpec(NormKind.LAYERNORM, gam, None, 0.0), X * 2.0**40) == pytest.approx(e, rel=1e-15)
    out = centre_errors([1.0, 2.0, 0.5], [3.0, 4.0, math.inf])
    assert out[:3] == pytest.approx([0.0, 1.0, 6.0], rel=1e-11) and out[3] == math.inf
    assert centre_errors([1.0], [math.inf])[1] == pytest.approx(1.0, rel=1e-11)  # 0 times inf is 0


@needs_ld
@pytest.mark.parametrize(("seed", "offset", "T", "eps"), [(0, 1e4, 1, 0.0), (1, 1e6, 2, 1e-12), (2, 1e8, 3, 0.0)])
def test_stack_pads_cover_the_centres_and_moves(seed: int, offset: float, T: int, eps: float) -> None:
    """Huge common offsets: the true ||x_s(X) - xhat_s|| (longdouble; centred at a LayerNorm) beats F17's pad at some
    stage and stays within ``centre="f64"``'s pad at every stage; the radii at rho = 1e-20, 1e-16, 1e-12 of the token norm
    cover the exact moves (a LayerNorm input's centred) of random inputs on the ball's boundary (6 per rho)."""
    spec, X = _offset_case(seed, offset, T, eps)
    ref = _stages_ld(spec, _ld(X))
    tn = float(X.norm(dim=1).median())
    rhos = [1e-20 * tn, 1e-16 * tn, 1e-12 * tn]
    res = stack_local(spec, X, rhos, layer_route=False, centre="f64")
    cent = [st.x for st in _stages(spec, X)[0]]
    lay = [st.endswith("norm_attn") or st.endswith("norm_ffn") or st == "input_norm" for st in res[0].stage_names]
    # a LayerNorm stage reads (and its pad bounds) the centred error; the input norm's input X is exact
    true = [float(np.sqrt(((_centred(_ld(c) - r) if ln else _ld(c) - r) ** 2).sum(axis=-1)).max())
            for c, r, ln in zip(cent, ref, lay)]
    old = [1e-13 * float(c.norm(dim=1).max()) for c in cent]
    assert any(t > o for t, o in zip(true, old)), (true, old)
    assert all(t <= p for t, p in zip(true, res[0].pads)), (true, res[0].pads)
    g = torch.Generator().manual_seed(seed)
    for rho, r in zip(rhos, res):
        for _ in range(6):
            D = torch.randn(T, 6, generator=g, dtype=torch.float64)
            D = D / D.norm(dim=1, keepdim=True) * rho * (1 - 1e-9)
            moved = _stages_ld(spec, _ld(X) + _ld(D))
            for s, (m, c) in enumerate(zip(moved, cent)):
                dv = _centred(m - _ld(c)) if lay[s] else m - _ld(c)
                mv = np.sqrt((dv ** 2).sum(axis=-1)).astype(float)
                assert (mv <= r.token_radii[s].numpy()).all(), (s, mv, r.token_radii[s])


def test_f64_never_below_f17_and_f17_unchanged() -> None:
    """An ordinary random post-LN stack: ``centre="f64"``'s pads, radii and bound are never below the default's, the
    default's pads are F17's ``1e-13 max||xhat_s||`` exactly, and only the default lists that pad as an assumption."""
    spec = random_spec(5, d=6, H=2, dh=4, dff=8, L=2, norm="layernorm", eps=1e-5)
    X = torch.randn(3, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    old = stack_local(spec, X, [1e-3], layer_route=False)[0]
    new = stack_local(spec, X, [1e-3], layer_route=False, centre="f64")[0]
    assert old.pads == [1e-13 * float(st.x.norm(dim=1).max()) for st in _stages(spec, X)[0]]
    assert all(p >= q for p, q in zip(new.pads, old.pads)) and new.pads != old.pads
    assert all(bool((a >= b).all()) for a, b in zip(new.token_radii, old.token_radii))
    assert new.upper >= old.upper
    # the default's certificate lists the pad as the assumption it is; F64's recursion needs none
    assert CENTRE_PAD_ASSUMPTION in old.quantity().assumptions
    assert CENTRE_PAD_ASSUMPTION not in new.quantity().assumptions
