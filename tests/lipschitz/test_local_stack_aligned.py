"""The FFN's first-order drift through the prefix's reachable rows (issue 12, ``lipschitz._local_stack_aligned``,
THEORY F40): the ellipsoid contains every reachable row, the certified norm ``NQ`` and the reach ``v`` are
never beaten by a float64 Adam ascent, their homogeneity in the weights and the prefix, and a regression on a
deep stack where F40 tightens the middle-product drift.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batched_bilinear_ascents import reach_lowers
from lipschitz_testkit import random_spec
from batched_drift_ascents import slope_jacobian
from test_lipschitz_local import adversary
from transcover.lipschitz._local_stack import certified_rows, stack_local
from transcover.lipschitz._local_stack_aligned import FFNAligned, ellipsoid_gram
from transcover.model import Activation, FFNSpec
from transcover.model._functional import transformer_forward

_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _case(seed: int, T: int = 3, d: int = 5, dff: int = 7, pscale: float = 1.0):
    """A GELU FFN, a centre H and prefix blocks P (T, T, d, d)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ffn = FFNSpec(W_1=r(d, dff) / d**0.5, W_2=r(dff, d) / dff**0.5, activation=Activation.GELU, b_1=0.3 * r(dff))
    return ffn, r(T, d), pscale * r(T, T, d, d) / d**0.5


def _jac(ffn, h: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """The FFN's Jacobian (column convention) at one token h."""
    return torch.autograd.functional.jacobian(lambda u: torch.nn.functional.gelu(u @ ffn.W_1 + ffn.b_1) @ ffn.W_2,
                                              h, create_graph=True)


@settings(max_examples=10, **_SETTINGS)
@given(seed=st.integers(0, 10_000), T=st.integers(1, 5))
def test_ellipsoid_contains_every_reachable_row(seed, T):
    """For random directions u, the row a = sum_j B_j h_j that maximises u.a (h_j = B_j^T u / ||B_j^T u||)
    has (u.a)^2 <= u^T Q u (+ the rounding eQ ||u||^2): the row lies in the ellipsoid (THEORY F40a)."""
    g = torch.Generator().manual_seed(seed)
    B = torch.randn(T, 6, 6, generator=g, dtype=torch.float64)
    B[0] *= 1e-3  # a small block: the weights need not be balanced
    Q, eQ = ellipsoid_gram(B)
    for _ in range(20):
        u = torch.randn(6, generator=g, dtype=torch.float64)
        Bu = torch.einsum("jab,a->jb", B, u)
        a = torch.einsum("jab,jb->a", B, Bu / Bu.norm(dim=1, keepdim=True))
        assert float(u @ a) ** 2 <= float(u @ Q @ u) + eQ * float(u @ u) + 1e-9 * float(u @ Q @ u)


@settings(max_examples=3, **_SETTINGS)
@given(seed=st.integers(0, 10_000), pscale=st.sampled_from([0.3, 1.0, 4.0]))
def test_aligned_norm_is_never_beaten(seed, pscale):
    """sup over (2,inf)-unit h, v of ||W_2^T D_k ((W_1^T (P h)_k) o (W_1^T (P v)_k))|| by Adam ascent stays
    below the certified NQ_k (THEORY F40b), and the ascent reaches a fair share of it (not vacuous)."""
    ffn, H, P = _case(seed, pscale=pscale)
    T = H.shape[0]
    al = FFNAligned(ffn, H, P, {})
    D = torch.exp(-0.5 * al.z**2) / math.sqrt(2 * math.pi) * (2 - al.z**2)

    def obj(h, v, k):  # noqa: ANN001, ANN202
        a, b = torch.einsum("jab,jb->a", P[k], h), torch.einsum("jab,jb->a", P[k], v)
        return (((a @ ffn.W_1) * (b @ ffn.W_1) * D[k]) @ ffn.W_2).norm()

    def values(h, v):  # noqa: ANN001, ANN202  (R, T, T, d) each -> (R, T): entry (s, k) obj(., ., k) alone
        a, b = torch.einsum("kjab,rkjb->rka", P, h), torch.einsum("kjab,rkjb->rka", P, v)
        return (((a @ ffn.W_1) * (b @ ffn.W_1) * D) @ ffn.W_2).norm(dim=-1)
    # bilinear_lower(obj k, H.shape, steps=150, seed=seed + k) (3 restarts) for every token k, in one batch
    los = reach_lowers(values, [lambda h, v, k=k: obj(h, v, k) for k in range(T)], H.shape,
                       [seed + k for k in range(T)], restarts=3, steps=150)
    for k, lo in enumerate(los):
        assert lo <= float(al.nq[k]), (k, lo, al.nq)
        assert lo >= 0.05 * float(al.nq[k]), (k, lo, al.nq)


@pytest.mark.parametrize("seed,rho", [(1, 0.05), (2, 0.3), (3, 1.0)])
def test_reach_is_never_beaten_behind_a_linear_prefix(seed, rho):
    """Behind a linear prefix (dP = 0 exactly), sup over ||h_j|| <= rho and (2,inf)-unit v of
    ||(J_k(H_k + (P h)_k) - J_k(H_k)) (P v)_k|| by Adam ascent stays below the reach v_k (THEORY F40c: first
    order through the ellipsoid, third order by F38c), from the Taylor regime (rho 0.05) to far outside it."""
    ffn, H, P = _case(seed)
    al = FFNAligned(ffn, H, P, {})
    nu = certified_rows(P)
    reach = al.reach(rho * nu * (1 + 1e-12), nu, rho, torch.zeros_like(nu), 0.0, 0.0)
    objs = []
    for k in range(H.shape[0]):
        J0 = _jac(ffn, H[k]).detach()

        def obj(h, v, k=k, J0=J0):  # noqa: ANN001, ANN202
            move = torch.einsum("jab,jb->a", P[k], rho * h)
            return ((_jac(ffn, H[k] + move) - J0) @ torch.einsum("jab,jb->a", P[k], v)).norm()
        objs.append(obj)
    J0s = slope_jacobian(ffn, H).detach()  # (T, d, d): _jac at every H[k]

    def values(h, v):  # noqa: ANN001, ANN202  (R, T, T, d) each -> (R, T): entry (s, k) objs[k] alone
        move = torch.einsum("kjab,rkjb->rka", P, rho * h)
        Pv = torch.einsum("kjab,rkjb->rka", P, v)
        return ((slope_jacobian(ffn, H + move) - J0s) @ Pv[..., None])[..., 0].norm(dim=-1)
    # bilinear_lower(objs[k], H.shape, restarts=2, steps=60, seed=seed + k) for every token k, in one batch (checked
    # against objs on the first step)
    los = reach_lowers(values, objs, H.shape, [seed + k for k in range(H.shape[0])], restarts=2, steps=60)
    for k, lo in enumerate(los):
        assert lo <= float(reach[k]), (k, lo, reach)
        assert lo > 0


def test_homogeneity_in_the_output_weights_and_the_prefix():
    """NQ (and N2) are 1-homogeneous in W_2; NQ is 2-homogeneous in the prefix (the ellipsoid scales by c^2,
    its Gram W_1^T Q W_1 by c^2, the Hadamard square by c^4, the norm by its square root)."""
    ffn, H, P = _case(7)
    base = FFNAligned(ffn, H, P, {}).nq
    for c in (0.5, 3.0):
        f2 = FFNSpec(W_1=ffn.W_1, W_2=c * ffn.W_2, activation=ffn.activation, b_1=ffn.b_1)
        assert torch.allclose(FFNAligned(f2, H, P, {}).nq, c * base, rtol=1e-6, atol=0.0)
        assert torch.allclose(FFNAligned(ffn, H, c * P, {}).nq, c * c * base, rtol=1e-6, atol=0.0)


CASES = [dict(norm="layernorm", placement="post"), dict(norm="layernorm", placement="pre", final_norm=True),
         dict(norm="rmsnorm", placement="pre", causal=True)]


@settings(max_examples=4, **_SETTINGS)
@given(seed=st.integers(0, 10_000), rho=st.sampled_from([1e-4, 1e-3, 1e-2]), case=st.sampled_from(CASES))
def test_middle_products_with_f40_are_never_beaten(seed, rho, case):
    """The point bound plus the middle-product drift of J (F40's reach for the post-LN GELU FFNs, the partial
    products inside the layers, the attention through the token-local product) against the adversary (Adam
    ascent on pair ratios and Jacobian norms in the ball), post- and pre-LN."""
    spec = random_spec(seed, act="gelu", L=3, biases=True, **case)
    X = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    r = stack_local(spec, X, [rho])[0]
    lo = adversary(lambda Z: transformer_forward(spec, Z, with_head=False), X, rho, restarts=2, steps=15, seed=seed)
    assert lo <= (r.point + r.parts["(middle products)"]) * (1 + 1e-12), (lo, r.point, r.parts)


def test_f40_tightens_a_deep_stack():
    """Regression (issue 12, THEORY F40): the 6-layer post-LN GELU stack of ``test_local_stack_middle``; before
    F40 the middle-product drift was 2.51 at rho = 1e-5 (drift 1.39) and the bound 9.9e13 at 1e-4; with the
    FFNs' reach through the prefix's ellipsoids (F40a-d) 2.36 (drift 1.35) and 3.4e8; with the exact partial
    products inside the layers (F40e, F40f) 1.166 (drift 1.119) and 549.7; with the layers' drift rows by them
    (F40g) 1.150 (drift 1.070) and 524.6."""
    spec = random_spec(1, act="gelu", L=6, norm="layernorm", placement="post", d=6, dff=8, eps=1e-5, biases=True)
    X = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    small, large = stack_local(spec, X, [1e-5, 1e-4])
    assert small.parts["(middle products)"] <= 1.150 and small.drift <= 1.070
    assert large.upper <= 524.6
    lo = adversary(lambda Z: transformer_forward(spec, Z, with_head=False), X, 1e-4, restarts=2, steps=15, seed=1)
    assert lo <= large.upper


def test_inner_partial_products_bound_the_autograd_ones():
    """The certified block norms (plus rounding) of the partial layer products ``middle_rows`` now also returns
    (THEORY F40e) bound the autograd blocks of the same sub-stage chains, post-LN (x + A(x), then LN1, then
    h + FFN(h))."""
    from transcover.lipschitz._local_stack import _col_blocks, _stages, certified_block_norms
    from transcover.lipschitz._local_stack_middle import layer_cuts, middle_rows
    from transcover.model import attention_forward, ffn_forward

    spec = random_spec(4, act="gelu", L=2, norm="layernorm", placement="post", biases=True)
    X = torch.randn(4, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    stages, _, groups = _stages(spec, X, {})
    cuts = layer_cuts(len(stages), groups)
    _, _, _, inner = middle_rows(stages, cuts, lambda K: certified_block_norms(_col_blocks(K), 4))
    for ly in spec.layers:
        a, b, _ = groups[ly.index]
        subs = [lambda Z, ly=ly: Z + attention_forward(ly.attention, Z), ly.norm_attn,
                lambda Z, ly=ly: Z + ffn_forward(ly.ffn, Z)]
        assert set(t for t in inner if a < t < b) == {a + 1, a + 2, a + 3}
        for t in range(a + 1, b):
            def chain(Z, t=t):  # noqa: ANN001, ANN202
                for f in subs[: t - a]:
                    Z = f(Z)
                return Z
            J = torch.autograd.functional.jacobian(chain, stages[a].x).permute(0, 2, 1, 3)
            N, e = inner[t]
            exact = torch.linalg.matrix_norm(J, ord=2)
            assert bool((exact <= N + e).all()), (t, exact, N)
            assert float((N - exact).max()) <= 1e-6 * float(exact.max()) + e
