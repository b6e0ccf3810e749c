"""The assembled Transformer / Transformer+MLP bounds: soundness of the inequalities they are built
from, agreement with transcover.lipschitz, deep models without overflow, log(mT) growth, bad input."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transcover import InputError
from transcover.covering import (
    MatrixTerm,
    matrix_linf_log_covering,
    mlp_terms,
    model_bound,
    model_terms,
    transformer_log_covering,
)
from transcover.lipschitz import perturbation_coefficients, perturbation_deltas
from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec, transformer_forward


def _pair(seed: int, rel: float, **cfg):
    torch.manual_seed(seed)
    a = ReferenceTransformer(ReferenceConfig(**cfg))
    b = copy.deepcopy(a)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(rel * torch.randn_like(p) * (p.std() if p.numel() > 1 and p.std() > 0 else 1.0))
    return a, b


def _deltas(sa, sb) -> dict[tuple[int, str], float]:
    """||W_i - W~_i|| in each role's norm, from explicit float64 differences (the public measurement)."""
    return perturbation_deltas(sa, sb)


def _tokens(gen: torch.Generator, B: int, T: int, d: int, R: float) -> torch.Tensor:
    X = torch.randn(B, T, d, generator=gen, dtype=torch.float64)
    r = R * torch.rand(B, T, 1, generator=gen, dtype=torch.float64) ** (1.0 / d)
    r[:, 0] = R  # some tokens on the sphere itself
    return X / X.norm(dim=-1, keepdim=True) * r


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), rel=st.floats(1e-3, 0.5), init_scale=st.floats(0.3, 3.0),
       n_layers=st.integers(1, 3), norm=st.sampled_from(["ball", "layernorm"]), R=st.floats(0.2, 2.0))
def test_assembled_perturbation_inequality_is_sound(seed, rel, init_scale, n_layers, norm, R):
    """measured max_t ||g(W)(X)_t - g(W~)(X)_t|| <= sum_i c_i ||W_i - W~_i|| with the assembly's log c_i."""
    a, b = _pair(seed, rel, d_model=8, n_heads=2, n_layers=n_layers, d_ff=16, init_scale=init_scale, norm=norm)
    sa, sb = reference_spec(a), reference_spec(b)
    terms, _, _ = model_terms(sa, radius=R, other=sb)
    deltas = _deltas(sa, sb)
    bound = math.fsum(math.exp(t.log_c) * deltas[(t.layer, t.role)] for t in terms)
    gen = torch.Generator().manual_seed(seed)
    X = _tokens(gen, 16, 6, 8, R)
    with torch.no_grad():
        ga = transformer_forward(sa, X, with_head=False)
        gb = transformer_forward(sb, X, with_head=False)
    measured = float((ga - gb).norm(dim=-1).max())
    assert measured <= bound


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), rel=st.floats(1e-3, 1.0), widths=st.lists(st.integers(1, 6), min_size=0, max_size=2),
       R=st.floats(0.1, 3.0))
def test_mlp_head_perturbation_and_lipschitz_are_sound(seed, rel, widths, R):
    """Note [MLP perturbation]: sup_z ||f(z) - f~(z)|| <= sum_j c_j ||dtheta_j|| and Lip(f) <= C."""
    torch.manual_seed(seed)
    dims = [5, *widths, 3]
    Ws = [torch.randn(i, o, dtype=torch.float64) for i, o in zip(dims[:-1], dims[1:])]
    bs = [torch.randn(o, dtype=torch.float64) for o in dims[1:]]
    Wt = [W + rel * torch.randn_like(W) for W in Ws]
    bt = [b + rel * torch.randn_like(b) for b in bs]
    spec_max = [max(float(torch.linalg.matrix_norm(x, 2)), float(torch.linalg.matrix_norm(y, 2))) for x, y in zip(Ws, Wt)]
    b_max = [max(float(x.norm()), float(y.norm())) for x, y in zip(bs, bt)]
    terms, log_C = mlp_terms([tuple(W.shape) for W in Ws], spec_max, b_max, input_radius=R, act_lipschitz=1.0)

    def f(Wl, bl, z):
        for j, (W, b) in enumerate(zip(Wl, bl)):
            z = z @ W + b
            if j < len(Wl) - 1:
                z = torch.relu(z)
        return z

    d = {f"head.W_{j}": float(torch.linalg.matrix_norm(W - V, 2)) for j, (W, V) in enumerate(zip(Ws, Wt))}
    d |= {f"head.b_{j}": float((b - c).norm()) for j, (b, c) in enumerate(zip(bs, bt))}
    bound = math.fsum(math.exp(t.log_c) * d[t.role] for t in terms)
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(256, 5, generator=gen, dtype=torch.float64)
    z = z / z.norm(dim=1, keepdim=True) * R
    assert float((f(Ws, bs, z) - f(Wt, bt, z)).norm(dim=1).max()) <= bound
    z2 = z + 1e-3 * torch.randn(256, 5, generator=gen, dtype=torch.float64)
    ratio = (f(Ws, bs, z) - f(Ws, bs, z2)).norm(dim=1) / (z - z2).norm(dim=1)
    assert float(ratio.max()) <= math.exp(log_C) * (1 + 1e-12)


def test_log_coefficients_match_lipschitz_api():
    torch.manual_seed(3)
    spec = reference_spec(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16, norm="layernorm")))
    terms, _, _ = model_terms(spec, radius=1.5, c_sm=2.0)
    api = perturbation_coefficients(spec, radius=1.5, c_sm=2.0)
    assert {(t.layer, t.role) for t in terms} == {e.key for e in api.entries}
    for t in terms:
        assert math.exp(t.log_c) == pytest.approx(api.coefficient(t.layer, t.role), rel=1e-12)


def test_single_matrix_reduces_to_F2():
    t = MatrixTerm(layer=0, role="W_1", shape=(6, 9), log_c=math.log(3.0), l21=2.5, spectral=1.0)
    got = transformer_log_covering([t], 0.2, 5000)
    e1 = math.exp(got.contributions[0].log_eps_i)
    assert 3.0 * e1 <= 0.2 and e1 == pytest.approx(0.2 / 3.0, rel=1e-10)  # the whole budget, soundly
    # F2 internalised at scale e/2 (Note [internal covers])
    ref = matrix_linf_log_covering(2.5, 1.0, e1 / 2, 5000, 9).value
    assert got.log_N == pytest.approx(ref, rel=1e-9)
    assert got.contributions[0].share == pytest.approx(1.0)


def test_covering_grows_like_log_mT_and_falls_with_eps():
    t = [MatrixTerm(0, "W_KQ.0", (8, 8), 0.5, 3.0, 1.0, group="attention"),
         MatrixTerm(0, "W_1", (8, 16), 1.0, 5.0, 2.0, group="ffn"),
         MatrixTerm(0, "b_1", (1, 16), 0.0, 0.5, 0.5, vector=True, group="ffn")]
    v = [transformer_log_covering(t, 0.1, n).log_N for n in (10**3, 10**6, 10**12)]
    assert v[0] < v[1] < v[2]
    # log N is affine in log(mT) to leading order: tripling... doubling log n at most doubles log N
    assert v[2] <= 2.0 * v[1]
    e = [transformer_log_covering(t, eps, 10**4).log_N for eps in (0.01, 0.1, 1.0)]
    assert e[0] > e[1] > e[2]


def test_48_layer_model_is_finite_with_breakdown():
    torch.manual_seed(0)
    spec = reference_spec(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=48, d_ff=16, init_scale=2.0)))
    b = model_bound(spec, eps=0.1, n_samples=(1e6,), seq_len=32)
    assert math.isfinite(b.log_log_N) and b.log_log_N > 0
    shares = [c.share for c in b.transformer.contributions]
    assert all(math.isfinite(s) for s in shares) and sum(shares) == pytest.approx(1.0, rel=1e-9)
    assert len(b.transformer.by_layer()) == 48
    assert math.isfinite(b.generalisation[0].log_gap) and math.isfinite(b.bft.log_R)
    assert all(math.isfinite(c.log_c) for c in b.transformer.contributions)


def test_theorem_g5_split_and_leading_term():
    torch.manual_seed(1)
    spec = reference_spec(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16)))
    b = model_bound(spec, eps=0.2, n_samples=(1e4,), seq_len=8)
    comp = b.covering
    assert comp.mlp.eps == pytest.approx(0.1)
    assert comp.transformer.eps == pytest.approx(0.2 / (2 * comp.mlp.C), rel=1e-12)
    assert comp.log_log_N == pytest.approx(float(np.logaddexp(comp.mlp.log_log_N, comp.transformer.log_log_N)))
    # 4 C^2 (eta + eta~)^3 / eps^2 is the inverse-square part at the allocated split, <= the exact total
    assert comp.log_leading <= comp.log_log_N + 1e-12


def test_distance_from_initialisation_shrinks_the_class():
    a, b = _pair(5, 0.05, d_model=8, n_heads=2, n_layers=2, d_ff=16)
    sa, sb = reference_spec(a), reference_spec(b)
    far = model_bound(sb, eps=0.1, n_samples=(1e6,), seq_len=8)
    near = model_bound(sb, eps=0.1, n_samples=(1e6,), seq_len=8, reference=sa)
    assert near.transformer.log_log_N < far.transformer.log_log_N


@pytest.mark.parametrize("bad", [dict(eps=0.0), dict(eps=-1.0), dict(n_samples=(0,)), dict(seq_len=0),
                                 dict(radius=-2.0), dict(family="frobenius"), dict(sigma_min=-1.0)])
def test_bad_inputs(bad):
    torch.manual_seed(0)
    spec = reference_spec(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16)))
    with pytest.raises(InputError):
        model_bound(spec, **bad)


def test_bound_is_never_below_the_empirical_covering_estimate():
    """Issue 5's Monte-Carlo lower estimate of log N on the same class <= our certified bound."""
    from _mc_case import monte_carlo_case

    from transcover.empirical import monte_carlo_covering

    terms, X, sample = monte_carlo_case()  # T = 1, radii the smallest norms of each kind
    for eps in (0.05, 0.2):
        est = monte_carlo_covering(sample, X, eps, q=2).log_packing_lower(0).value
        assert est > 0  # the estimate sees more than one function at this scale
        bound = transformer_log_covering(terms, eps, 6, family="spectral").log_N
        assert est <= bound


def test_best_family_is_no_worse_than_either():
    t = [MatrixTerm(0, "W_KQ.0", (4, 4), 3.0, 3.0, 1.0, group="attention"),  # small: F1 wins
         MatrixTerm(0, "W_1", (400, 400), 0.0, 0.5, 0.4, group="ffn"),  # big, small norm: F2 wins
         MatrixTerm(0, "b_1", (1, 16), 0.0, 0.5, 0.5, vector=True, group="ffn")]
    v = {f: transformer_log_covering(t, 0.1, 10**4, family=f) for f in ("l21", "spectral", "best")}
    assert v["best"].log_log_N <= min(v["l21"].log_log_N, v["spectral"].log_log_N) + 1e-9
    covers = [c.cover for c in v["best"].contributions]
    assert covers[0].startswith("parametric") and covers[1].startswith("inverse")


@pytest.mark.parametrize("where", ["blocks.0", "blocks.0.W_Q"])
def test_zero_weights_and_huge_weights_end_in_a_bound_or_one_line(where):
    """Stop 38 red team: a block of zero weights made a live matrix's cover at scale 0 reach exact() with inf (an
    internal OverflowError), and weights of 1e100 overflowed the attention constant's squares (OverflowError 34)."""
    torch.manual_seed(0)
    m = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16, head_hidden=())).double()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if where in name:
                p.zero_()
    b = model_bound(reference_spec(m), n_samples=(1e6,), seq_len=8)
    assert math.isfinite(b.log_log_N) and b.generalisation[0].gap <= 1.0
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1e100)
    with pytest.raises(InputError, match="overflows float64"):
        model_bound(reference_spec(m), n_samples=(1e6,), seq_len=8)
