"""T5's relative position bias and unscaled attention (THEORY F28): the input-Lipschitz chain is that
of the same model without the bias, G.3 charges a changed table per head, and an attacker (float64
projected gradient ascent through the decomposition's forward, which ``tests/model/test_model_load_t5``
proves equal to HF's T5 encoder) beats neither."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from _attack import Domain, attack_gap, attack_pairs, fuzz_spec
from _fuzzcase import perturbed
from transcover import InputError
from transcover.lipschitz import layer_local, lipschitz_bounds, perturbation_bound
from transcover.model import RelativeBiasSpec, attention_forward, transformer_forward

F64 = torch.float64


def _t5(seed=1, table_scale=3.0, gated=False, L=2):
    spec = fuzz_spec(seed, norm="rmsnorm", placement="pre", L=L, gated=gated, act="gelu_tanh" if gated else "relu",
                     final_norm=True, input_norm=False)
    g = torch.Generator().manual_seed(seed + 50)
    table = table_scale * torch.randn(8, 2, generator=g, dtype=F64)
    bias = RelativeBiasSpec(table, max_distance=16)
    return replace(spec, layers=[replace(lay, attention=replace(lay.attention, scale=1.0, position_bias=bias))
                                 for lay in spec.layers])


def _net(spec):
    return lambda X, s: transformer_forward(spec, X)


def _with_table(spec, table):
    return replace(spec, layers=[replace(lay, attention=replace(lay.attention, position_bias=replace(
        lay.attention.position_bias, table=table))) for lay in spec.layers])


@pytest.mark.parametrize("gated", [False, True])
def test_lipschitz_is_the_bias_free_chain_and_holds(gated):
    spec = _t5(gated=gated)
    plain = replace(spec, layers=[replace(lay, attention=replace(lay.attention, position_bias=None))
                                  for lay in spec.layers])
    b = lipschitz_bounds(spec, radius=2.0)
    assert b.upper.value == lipschitz_bounds(plain, radius=2.0).upper.value  # F28: the bias cancels in ds_ij
    w = attack_pairs(_net(spec), T=6, d=6, dom=Domain(2.0), metric="2,inf", restarts=4, steps=20, seed=1)
    assert w.ratio - w.slack <= b.upper.value


def test_a_changed_table_is_charged_by_its_own_terms_and_holds():
    a = _t5(seed=2)
    g = torch.Generator().manual_seed(9)
    table = a.layers[0].attention.position_bias.table
    b = _with_table(a, table + torch.randn(table.shape, generator=g, dtype=F64))
    pb = perturbation_bound(a, b, radius=2.0)
    charged = {e.role.split(".")[0] for e, d, c in pb.terms() if c > 0}
    assert charged == {"pos_bias"}
    w = attack_gap(_net(a), _net(b), T=6, d=6, dom=Domain(2.0), metric="2,inf", restarts=4, steps=20, seed=2)
    assert w.ratio > 0.1 and w.ratio - w.slack <= pb.total.value  # a real change, certified


@pytest.mark.parametrize("metric", ["2,inf", "fro"])
def test_every_weight_and_the_table_moved_is_certified(metric):
    a = _t5(seed=3, gated=True)
    b = perturbed(a, 4, 0.05)
    table = a.layers[0].attention.position_bias.table
    b = _with_table(b, table + 0.3 * torch.randn(table.shape, generator=torch.Generator().manual_seed(1), dtype=F64))
    T = 5
    pb = perturbation_bound(a, b, radius=1.5, metric=metric, seq_len=T if metric == "fro" else None)
    assert {"pos_bias.0", "W_KQ.0", "W_1"} <= {e.role for e, _, _ in pb.terms()}
    w = attack_gap(_net(a), _net(b), T=T, d=6, dom=Domain(1.5), metric=metric, restarts=4, steps=20, seed=5)
    assert w.ratio - w.slack <= pb.total.value


def test_table_term_follows_the_values_exponent():
    """Scaling W_V by lam multiplies the attention's change under a table change by lam exactly
    (P X W_OV is linear in W_V); the certified term follows with exponent 1."""
    a = _t5(seed=5, L=1)
    at = a.layers[0].attention
    table = at.position_bias.table
    moved = table + torch.randn(table.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    terms, gaps = [], []
    for lam in (1.0, 6.0):
        A = replace(a, layers=[replace(a.layers[0], attention=replace(at, W_V=at.W_V * lam))])
        B = _with_table(A, moved)
        pb = perturbation_bound(A, B, radius=1.0)
        terms.append(sum(c for e, d, c in pb.terms() if e.role.startswith("pos_bias")))
        fa = (lambda X, s, x=A.layers[0].attention: attention_forward(x, X))
        fb = (lambda X, s, x=B.layers[0].attention: attention_forward(x, X))
        w = attack_gap(fa, fb, T=5, d=6, dom=Domain(1.0), metric="2,inf", restarts=3, steps=15, seed=3)
        gaps.append(w.ratio)
    assert terms[1] == pytest.approx(6.0 * terms[0], rel=1e-5)
    assert gaps[1] == pytest.approx(6.0 * gaps[0], rel=0.05)


def test_local_bounds_refuse_the_relative_bias():
    spec = _t5(L=1)
    with pytest.raises(InputError, match="relative position bias"):
        layer_local(spec.layers[0], torch.randn(3, 6, dtype=F64), 0.1)


def test_covering_is_finite_and_covers_the_table():
    import math

    from transcover.covering import transformer_log_covering
    from transcover.covering._model_bound import model_terms

    a = _t5(seed=6)
    terms, _, _ = model_terms(a)
    roles = {t.role for t in terms}
    assert {"pos_bias.0", "pos_bias.1"} <= roles
    cov = transformer_log_covering(terms, 0.1, 128 * 1000, family="l21")
    assert math.isfinite(cov.log_log_N)
    b = _with_table(a, a.layers[0].attention.position_bias.table * 1.5)
    terms_ref, _, _ = model_terms(a, reference=b)
    assert {"pos_bias.0"} <= {t.role for t in terms_ref}


def test_member_stacks_carry_each_members_table():
    from transcover.model import stack_members

    a = _t5(seed=7, L=1)
    b = _with_table(a, a.layers[0].attention.position_bias.table * -2.0)
    X = torch.randn(1, 2, 5, 6, dtype=F64, generator=torch.Generator().manual_seed(4))
    out = transformer_forward(stack_members([a, b]), X)
    for m, spec in enumerate((a, b)):
        assert torch.allclose(out[m], transformer_forward(spec, X[0]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("n, max_distance, bidirectional", [(3, 16, True), (2, 16, True), (1, 16, False),
                                                            (8, 2, True), (8, float("inf"), True), (8, True, True)])
def test_degenerate_bucketings_are_refused_at_construction(n, max_distance, bidirectional):
    # fewer than 4 buckets (2 causal) or max_distance at or below the exact offsets divided by zero in T5's
    # bucketing: perturb ended in an internal ZeroDivisionError (red team 37i)
    with pytest.raises(InputError, match="T5's bucketing needs"):
        RelativeBiasSpec(torch.zeros(n, 2, dtype=F64), max_distance=max_distance, bidirectional=bidirectional)
    RelativeBiasSpec(torch.zeros(4 if bidirectional else 2, 2, dtype=F64), max_distance=16, bidirectional=bidirectional)
