"""THEORY F107: RoPE attention on a ball around real data (per-pair score gradients, RoPE weights certified)."""

from __future__ import annotations

import math

import mpmath as mp
import pytest
import torch
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from _attack import Domain, attack_pairs, violates
from batched_grouped_ascents import batched_jvp_ascent
from transcover._errors import InputError
from transcover.lipschitz._local_attention import attention_local_bound, certified_weights
from transcover.lipschitz._local_rope import rotate_dd
from transcover.model import AttentionSpec, RopeSpec, apply_rope, attention_forward, attention_scores

F64 = torch.float64


def _attn(seed: int, *, scale: float = 1.0, causal: bool = True, bias: bool = False, theta: float = 10.0,
          rotary_dim: int | None = None, inv: tuple | None = None, d: int = 8, H: int = 4, Hkv: int = 2,
          dh: int = 4) -> AttentionSpec:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    return AttentionSpec(W_Q=r(H, d, dh) * scale / math.sqrt(d), W_K=r(Hkv, d, dh) * scale / math.sqrt(d),
                         W_V=r(Hkv, d, dh) / math.sqrt(d), W_O=r(H, dh, d) / math.sqrt(dh), causal=causal,
                         b_Q=r(H, dh) if bias else None, b_K=r(Hkv, dh) if bias else None,
                         rope=RopeSpec(theta=theta, rotary_dim=rotary_dim, inv_freq_values=inv))


VARIANTS = [dict(), dict(bias=True), dict(rotary_dim=2), dict(theta=1e4), dict(inv=(0.9, 0.01)),
            dict(causal=False), dict(theta=1.5, bias=True, causal=False)]


@pytest.mark.parametrize("kw", VARIANTS)
def test_rope_weights_match_forward(kw: dict) -> None:
    """The certified RoPE weights are the forward's softmax (to float64 rounding); without ``rope=True`` the weights
    stay refused for the routes not derived for RoPE."""
    attn = _attn(1, scale=3.0, **kw)
    X = torch.randn(7, 8, generator=torch.Generator().manual_seed(2), dtype=F64)
    for h in range(attn.n_heads):
        P = certified_weights(attn, X, h, rope=True)
        assert torch.allclose(P, torch.softmax(attention_scores(attn, X, h), -1), rtol=1e-11, atol=1e-14)
    with pytest.raises(InputError, match="RoPE"):
        certified_weights(attn, X, 0)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), T=st.integers(1, 9), mag=st.sampled_from([1e-3, 1.0, 1e3]),
       known=st.booleans())
def test_rotate_dd_error_covers_exact(seed: int, T: int, mag: float, known: bool) -> None:
    """``rotate_dd``'s error bound covers the exact rotation (mpmath, 60 digits) of every input within ``err`` of
    ``hi + lo``: exactly known inputs (``err = 0``), and inputs off by ``+-err`` in every entry, which the bound
    carries as ``err |C| + err~ |S|`` (red team 186: the test never gave an input error, so dropping that term
    passed)."""
    g = torch.Generator().manual_seed(seed)
    hi = torch.randn(T, 6, generator=g, dtype=F64) * mag
    lo = hi * torch.randn(T, 6, generator=g, dtype=F64) * 2.0**-54
    err = torch.zeros_like(hi) if known else hi.abs() * 2.0**-40
    sign = torch.where(torch.rand(T, 6, generator=g) < 0.5, -1.0, 1.0).to(F64)
    inv = torch.tensor([1.0, 0.1], dtype=F64)
    H, L, E = rotate_dd(hi, lo, err, inv)
    mp.mp.dps = 60

    def true(t: int, c: int):  # noqa: ANN202
        return mp.mpf(float(hi[t, c])) + mp.mpf(float(lo[t, c])) + mp.mpf(float(sign[t, c])) * mp.mpf(float(err[t, c]))

    for t in range(T):
        for c in range(4):
            k = c % 2
            a = mp.mpf(t) * mp.mpf(float(inv[k]))
            p = 2 + k if c < 2 else k
            exact = true(t, c) * mp.cos(a) + (-true(t, p) if c < 2 else true(t, p)) * mp.sin(a)
            assert abs(mp.mpf(float(H[t, c])) + mp.mpf(float(L[t, c])) - exact) <= mp.mpf(float(E[t, c]))
        for c in (4, 5):
            assert abs(mp.mpf(float(H[t, c])) + mp.mpf(float(L[t, c])) - true(t, c)) <= mp.mpf(float(E[t, c]))
    if known:
        assert float((E / (H.abs() + 1e-300)).max()) < 1e-25


@pytest.mark.parametrize("kw", VARIANTS)
def test_rope_pair_terms_are_the_gradients(kw: dict) -> None:
    """``||p_ij||`` and ``||r_ij - m_i||`` are the norms of the exact score gradients (autograd on the forward's scores,
    ``m_i`` their P-weighted mean), certified from above and within 1e-8 relative."""
    from transcover.lipschitz._local_rope import rope_pair_terms

    attn = _attn(3, scale=2.0, **kw)
    T = 6
    X = torch.randn(T, 8, generator=torch.Generator().manual_seed(9), dtype=F64)
    for h in range(attn.n_heads):
        P = certified_weights(attn, X, h, rope=True)
        pn, rn = rope_pair_terms(attn, X, h, P)
        Wq, Wk = attn.head(h)[:2]
        bq = 0 if attn.b_Q is None else attn.b_Q[h]
        bk = 0 if attn.b_K is None else attn.b_K[attn.kv_index(h)]
        pos = torch.arange(T)
        S = lambda Zq, Zk: attn.softmax_scale * apply_rope(Zq @ Wq + bq, attn.rope, pos) @ apply_rope(  # noqa: E731
            Zk @ Wk + bk, attn.rope, pos).T
        Jq, Jk = torch.autograd.functional.jacobian(S, (X, X))  # (T, T, T, d): d s_ij / d (query side / key side) x_k
        idx = torch.arange(T)
        p = Jk[idx[:, None], idx[None, :], idx[None, :]]  # d s_ij / d x_j (key side)
        r = Jq[idx[:, None], idx[None, :], idx[:, None]]  # d s_ij / d x_i (query side)
        vis = torch.ones(T, T, dtype=torch.bool).tril() if attn.causal else torch.ones(T, T, dtype=torch.bool)
        m = (P[:, :, None] * r).sum(1)
        rr = (r - m[:, None, :]).norm(dim=-1)
        pp = p.norm(dim=-1)
        for got, want in ((pn, pp), (rn, rr)):
            sel = vis
            assert bool((got[sel] >= want[sel] * (1 - 1e-12)).all())
            assert bool((got[sel] <= want[sel] * (1 + 1e-8) + 1e-12).all())


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 10**6), kw=st.sampled_from(VARIANTS), scale=st.sampled_from([0.3, 1.0, 3.0, 6.0]),
       rho=st.sampled_from([1e-7, 1e-3, 0.05]), repeated=st.booleans())
def test_rope_attention_sound(seed: int, kw: dict, scale: float, rho: float, repeated: bool) -> None:
    """No pair in the ball, and no Jacobian on it, beats the certified RoPE attention constant: projected ascent on the
    (2,inf) pair ratio and on ``||J(X') V||`` (rows of V unit, every token within rho of X); repeated tokens (the
    rotation alone separates their scores) and large query/key weights included."""
    attn = _attn(seed, scale=scale, **kw)
    T = 5
    X = torch.randn(T, 8, generator=torch.Generator().manual_seed(seed + 1), dtype=F64) * 2
    if repeated:
        X[1:] = X[0]
    try:
        cert = attention_local_bound(attn, X, rho).upper
    except InputError as e:  # a visible weight underflowing float64 is refused (Note [underflowed attention weights])
        assert "underflows" in str(e)
        reject()
    w = attack_pairs(lambda Z, s: attention_forward(attn, X + Z), T=T, d=8, dom=Domain(rho), metric="2,inf",
                     restarts=6, steps=30, seed=seed, n_jacobian=2)
    assert not violates(w, cert), (w, cert)
    jv = batched_jvp_ascent(lambda Z: attention_forward(attn, Z), X, rho, seed=seed, starts=2, steps=40)
    assert jv <= cert * (1 + 1e-9), (jv, cert)


def test_rope_attention_monotone_limit_homogeneous() -> None:
    """Monotone in rho; at rho -> 0 above the attained Jacobian norm at X and within a factor 5 of it; W_V scaled by c
    scales the constant by c (the score terms do not see W_V)."""
    attn = _attn(7, scale=2.0)
    X = torch.randn(6, 8, generator=torch.Generator().manual_seed(3), dtype=F64)
    ups = [attention_local_bound(attn, X, r).upper for r in (0.0, 1e-9, 1e-6, 1e-3, 1e-2, 0.1)]
    assert all(a <= b for a, b in zip(ups, ups[1:])), ups
    jv = batched_jvp_ascent(lambda Z: attention_forward(attn, Z), X, 1e-9, seed=0, starts=3, steps=80)
    assert jv <= ups[1] <= 5 * jv, (jv, ups[1])
    for c in (0.25, 10.0):
        sc = AttentionSpec(W_Q=attn.W_Q, W_K=attn.W_K, W_V=attn.W_V * c, W_O=attn.W_O, causal=True, rope=attn.rope)
        assert attention_local_bound(sc, X, 1e-3).upper == pytest.approx(c * ups[3], rel=1e-9)


def test_rope_gradients_see_the_rotation() -> None:
    """Fast rotations make the per-pair gradients differ from the unrotated ones: the RoPE constant at X is not the
    one of the same weights without RoPE (the certificate reads the rotation)."""
    attn = _attn(5, scale=3.0, theta=1.2)
    plain = AttentionSpec(W_Q=attn.W_Q, W_K=attn.W_K, W_V=attn.W_V, W_O=attn.W_O, causal=True)
    X = torch.randn(6, 8, generator=torch.Generator().manual_seed(4), dtype=F64)
    a, b = attention_local_bound(attn, X, 1e-6).upper, attention_local_bound(plain, X, 1e-6).upper
    assert abs(a - b) > 1e-3 * b


def test_a_key_bias_beyond_the_data_range_is_refused() -> None:
    """Red team 186: under RoPE the key bias no longer cancels, but Note [local head data range]'s check saw the
    unrotated gradients without it: tokens of 1e-120 (inside the range) and a key bias of 1e121 (moderate scores)
    give query-side gradients ``r_ij`` of about 1e121, beyond the 2^400 the Note's squares are argued for, without the
    one-line refusal; the per-pair gradients are checked."""
    from dataclasses import replace

    attn = _attn(3, bias=True)
    attn = replace(attn, b_Q=None, b_K=attn.b_K * 1e121)
    X = torch.randn(5, 8, generator=torch.Generator().manual_seed(4), dtype=F64) * 1e-120
    with pytest.raises(InputError, match="score gradients p_ij, r_ij - m_i"):
        attention_local_bound(attn, X, 1e-3)
