"""THEORY F19: the covering/Dudley margin bound of a sparse Transformer; every constant checked against
an adversarial search, a brute-force grid, a Monte-Carlo Rademacher estimate or an enumeration."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call

from transcover._errors import InputError
from transcover.covering._data_route import (
    box_sensitivities,
    chaining_rademacher,
    class_prior_nats,
    covering_margin_bound,
    margin_change_bound,
    margin_log_cover,
    pair_norms,
)
from transcover.model import ReferenceConfig, ReferenceTransformer


def _cfg(d=4, heads=1, layers=1, d_input=1, T=5, outputs=2, readout="first"):
    return ReferenceConfig(d_model=d, n_heads=heads, n_layers=layers, d_ff=d, d_input=d_input, max_len=T,
                           n_outputs=outputs, norm="none", head_hidden=(), readout=readout)


def _pair_gap(model, pa, pb, X):
    """max over inputs and class pairs of |(z_a - z_b)(x; pb) - (z_a - z_b)(x; pa)| (float64)."""
    za, zb = functional_call(model, pa, (X,)), functional_call(model, pb, (X,))
    dz = zb - za
    return (dz[:, :, None] - dz[:, None, :]).abs().amax()


def _inputs(gen, B, T, d_input, xi):
    X = torch.randn(B, T, d_input, generator=gen, dtype=torch.float64)
    norms = X.norm(dim=-1, keepdim=True)
    return X / norms * xi * torch.rand(B, T, 1, generator=gen, dtype=torch.float64) ** 0.1


def _box_pair(model, gen, boxes, r):
    """Two parameter sets on random supports: |theta| <= B_W, |theta' - theta| <= r_W entrywise."""
    pa, pb, supports = {}, {}, {}
    for name, w in model.state_dict().items():
        S = torch.rand(w.shape, generator=gen) < 0.6
        B = boxes[name]
        a = (2 * torch.rand(w.shape, generator=gen, dtype=torch.float64) - 1) * B * S
        step = (2 * torch.rand(w.shape, generator=gen, dtype=torch.float64) - 1) * r[name]
        b = torch.clamp(a + step, -B, B) * S
        pa[name], pb[name], supports[name] = a, b, S
    return pa, pb, supports


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10**6), heads=st.sampled_from([1, 2]), layers=st.sampled_from([1, 2]),
       d_input=st.sampled_from([1, 3]), outputs=st.sampled_from([2, 3]), readout=st.sampled_from(["first", "mean"]))
def test_box_sensitivities_bound_random_and_adversarial_pairs(seed, heads, layers, d_input, outputs, readout):
    gen = torch.Generator().manual_seed(seed)
    cfg = _cfg(heads=heads, layers=layers, d_input=d_input, outputs=outputs, readout=readout)
    model = ReferenceTransformer(cfg).double()
    boxes = {k: 2.0 ** int(torch.randint(-2, 2, (1,), generator=gen)) for k in model.state_dict()}
    r = {k: boxes[k] * float(torch.rand(1, generator=gen)) * 0.3 for k in boxes}
    pa, pb, supports = _box_pair(model, gen, boxes, r)
    xi = 1.5
    kappa = box_sensitivities(cfg, supports, boxes, xi)
    bound = sum(kappa[k] * r[k] for k in kappa)
    X = _inputs(gen, 64, cfg.max_len, d_input, xi)
    assert float(_pair_gap(model, pa, pb, X)) <= bound
    # float64 gradient ascent on the gap over inputs and the second parameter set, projected on the class
    Xv = X[:8].clone().requires_grad_(True)
    qb = {k: v.clone().requires_grad_(True) for k, v in pb.items()}
    opt = torch.optim.Adam([Xv, *qb.values()], lr=0.05)
    for _ in range(40):
        loss = -_pair_gap(model, pa, qb, Xv)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            Xv.mul_(torch.clamp(xi / Xv.norm(dim=-1, keepdim=True), max=1.0))
            for k, v in qb.items():
                v.copy_(torch.clamp(torch.clamp(v, pa[k] - r[k], pa[k] + r[k]), -boxes[k], boxes[k]) * supports[k])
            assert float(_pair_gap(model, pa, qb, Xv)) <= bound


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10**6), heads=st.sampled_from([1, 2]), layers=st.sampled_from([1, 2]),
       readout=st.sampled_from(["first", "mean"]), scale=st.sampled_from([1e-3, 0.1, 1.0]))
def test_pair_bound_holds_for_two_specific_models(seed, heads, layers, readout, scale):
    gen = torch.Generator().manual_seed(seed)
    cfg = _cfg(heads=heads, layers=layers, d_input=2, outputs=3, readout=readout)
    torch.manual_seed(seed)
    model = ReferenceTransformer(cfg).double()
    pa = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pb = {k: v + scale * torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in pa.items()}
    N, D = pair_norms(cfg, pa, pb)
    bound = margin_change_bound(cfg, N, D, 1.0)
    X = _inputs(gen, 128, cfg.max_len, 2, 1.0)
    assert float(_pair_gap(model, pa, pb, X)) <= bound


def test_pair_bound_is_homogeneous_in_the_head():
    # scaling both heads by lam scales every logit difference by lam; the bound must follow exactly
    cfg = _cfg(heads=2, layers=1, d_input=2, outputs=3)
    torch.manual_seed(3)
    pa = {k: v.double() for k, v in ReferenceTransformer(cfg).state_dict().items()}
    pb = {k: v + 0.01 * torch.randn_like(v) for k, v in pa.items()}
    base = margin_change_bound(cfg, *pair_norms(cfg, pa, pb), 1.0)
    for lam in (1e-3, 7.0, 1e4):
        sa, sb = dict(pa), dict(pb)
        for k in ("head.0.weight", "head.0.bias"):
            sa[k], sb[k] = pa[k] * lam, pb[k] * lam
        assert margin_change_bound(cfg, *pair_norms(cfg, sa, sb), 1.0) == pytest.approx(lam * base, rel=1e-12)


def test_the_cover_count_is_a_real_grid_cover():
    # brute force: build the grid the count describes and check every sampled class member has a
    # grid point whose margins are within t on every sampled input
    cfg = _cfg(d=2, T=3)
    model = ReferenceTransformer(cfg).double()
    gen = torch.Generator().manual_seed(0)
    state = model.state_dict()
    supports = {k: torch.zeros(v.shape, dtype=torch.bool) for k, v in state.items()}
    supports["embed.weight"][0, 0] = supports["blocks.0.W_V"][0, 0, 0] = supports["blocks.0.W_O"][0, 0, 0] = True
    supports["head.0.weight"][1, 0] = supports["blocks.0.W_Q"][0, 0, 0] = supports["blocks.0.W_K"][0, 0, 0] = True
    boxes = {k: 1.0 for k in state}
    kappa = box_sensitivities(cfg, supports, boxes, 1.0)
    p = {k: int(S.sum()) for k, S in supports.items()}
    P, t = sum(p[k] for k in kappa), 0.5
    r = {k: t * p[k] / (P * kappa[k]) for k in kappa}
    counts = {k: math.ceil(boxes[k] / r[k]) for k in kappa}
    assert margin_log_cover(t, kappa, p, boxes) >= sum(math.log(c) for c in counts.values())
    X = _inputs(gen, 128, cfg.max_len, 1, 1.0)
    for _ in range(20):
        theta, centre = {}, {}
        for k, v in state.items():
            u = (2 * torch.rand(v.shape, generator=gen, dtype=torch.float64) - 1) * supports[k]
            theta[k] = u
            if k in kappa:  # nearest of the centres -B + r(2i - 1), i = 1..count (clipped to the box)
                i = torch.clamp(torch.floor((u + 1.0) / (2 * r[k])) + 1, 1, counts[k])
                centre[k] = torch.clamp(-1.0 + r[k] * (2 * i - 1), -1.0, 1.0) * supports[k]
                assert float((centre[k] - u).abs().max()) <= r[k] * (1 + 1e-12)
            else:
                centre[k] = u
        assert float(_pair_gap(model, theta, centre, X)) <= t


def test_chaining_against_monte_carlo_rademacher():
    # K fixed vectors with entries in [-1/2, 1/2]: ln N(eps) <= ln K at every scale; E sup must be below
    gen = torch.Generator().manual_seed(1)
    n, K = 200, 50
    F = torch.rand(K, n, generator=gen, dtype=torch.float64) - 0.5
    sigma = torch.randint(0, 2, (4000, n), generator=gen).double() * 2 - 1
    mc = float((sigma @ F.T / n).max(dim=1).values.mean())
    bound, _ = chaining_rademacher(lambda eps: math.log(K), n)
    assert mc <= bound
    # closed form for a constant log-cover, and a single function's complexity vanishes
    c = 3.0
    ref = min(2.0 ** -(J + 1) + 3 * math.sqrt(2 / n) * math.sqrt(c) * sum(2.0 ** -(j + 1) for j in range(1, J + 1))
              for J in range(1, 41))
    assert chaining_rademacher(lambda eps: c, n)[0] == pytest.approx(ref, rel=1e-8)
    assert chaining_rademacher(lambda eps: c, n)[0] >= ref
    assert chaining_rademacher(lambda eps: 0.0, n)[0] <= 2.0 ** -40


def test_the_class_prior_sums_to_at_most_one():
    # every support of two tiny tensors, box exponents and margins in a window: sum of pi <= 1
    shapes = {"a": (2,), "b": (3,)}
    total = 0.0
    for bits in itertools.product([0, 1], repeat=5):
        S = {"a": torch.tensor(bits[:2], dtype=torch.bool), "b": torch.tensor(bits[2:], dtype=torch.bool)}
        nz = [k for k in shapes if S[k].any()]
        for exps in itertools.product(range(-4, 5), repeat=len(nz)):
            for g in range(-5, 6):
                total += math.exp(-class_prior_nats(2, S, dict(zip(nz, exps)), g))
    assert total <= 1.0


def test_covering_bound_end_to_end_and_bad_input():
    cfg = _cfg(d=4, T=6)
    torch.manual_seed(0)
    model = ReferenceTransformer(cfg).double()
    X = torch.randint(0, 2, (2000, 6, 1)).double() * 2 - 1
    y = (X[:, :3, 0].sum(1) > 0).long()
    b = covering_margin_bound(model, X, y, menu_size=8, xi=1.0)
    assert 0.0 <= b.ramp_loss and b.value == min(1.0, b.value)
    assert b.value >= min(1.0, b.ramp_loss + 2 * b.rademacher + b.concentration)
    assert b.nonzeros == sum(int((v != 0).sum()) for v in model.state_dict().values())
    with pytest.raises(InputError, match="xi"):
        covering_margin_bound(model, X, y, menu_size=8, xi=0.0)
    # the sensitivities assume token norms <= xi: tokens of norm 50 with xi = 1 certified 0.119 against 0.172 (37j)
    with pytest.raises(InputError, match=r"a training token has l2 norm 50 > xi=1\.0"):
        covering_margin_bound(model, X * 50, y, menu_size=8, xi=1.0)
    with pytest.raises(InputError, match="norm"):
        covering_margin_bound(ReferenceTransformer(ReferenceConfig(d_model=4, n_heads=1, n_layers=1, d_ff=4,
                                                                   d_input=1, max_len=6, n_outputs=2)), X, y,
                              menu_size=8, xi=1.0)


def _one_line_input_error(call, text, kind=InputError):
    """``call()`` raises ``kind`` whose message is one line containing ``text`` (literally)."""
    with pytest.raises(kind) as info:
        call()
    message = str(info.value)
    assert text in message and "\n" not in message, message
    return message


def test_covering_bound_refuses_bad_delta_menu_size_and_data_up_front():
    # red team 204: delta >= 1 made ln(1/delta) negative (a *smaller* certified value), NaN returned 1.0, 0 divided
    # by zero; menu_size < 1 was a math domain error or a smaller value; bad labels / shapes were raw RuntimeErrors
    cfg = _cfg(d=4, T=6)
    torch.manual_seed(0)
    model = ReferenceTransformer(cfg).double()
    X = torch.randint(0, 2, (200, 6, 1)).double() * 2 - 1
    y = (X[:, :3, 0].sum(1) > 0).long()

    def bound(**kw):
        return covering_margin_bound(**{"model": model, "X": X, "y": y, "menu_size": 8, "xi": 1.0, **kw})

    for delta, shown in ((1.0, "1.0"), (2, "2"), (1.5, "1.5"), (math.nan, "nan"), (0, "0"), (-0.1, "-0.1"),
                         (math.inf, "inf"), (True, "True"), ("0.05", "'0.05'")):
        _one_line_input_error(lambda: bound(delta=delta), f"delta must be a finite number in (0, 1), but got delta={shown}")
    assert bound(delta=5e-324).value <= 1.0  # ln(1 / 5e-324) overflowed to inf; -ln(delta) = 744.4 does not
    for size in (0, -3, 0.5, 8.0, True):
        _one_line_input_error(lambda: bound(menu_size=size), f"menu_size must be a positive integer, but got "
                                                             f"menu_size={size!r}")
    _one_line_input_error(lambda: bound(y=y + 5), "labels must be class ids in [0, 1] (n_outputs=2), but got labels "
                                                  "from 5 to 6")
    _one_line_input_error(lambda: bound(y=y - 1), "labels must be class ids in [0, 1] (n_outputs=2), but got labels "
                                                  "from -1 to 0")
    _one_line_input_error(lambda: bound(y=y.double()), "y must be a 1-D tensor of integer class ids, but got "
                                                       "torch.float64 of shape (200,)")
    _one_line_input_error(lambda: bound(y=y[:, None]), "y must be a 1-D tensor of integer class ids")
    _one_line_input_error(lambda: bound(X=X[:, :, 0]), "X must be a tensor of shape (n, T, d_input=1) with "
                                                       "1 <= T <= max_len=6, but got (200, 6)")
    _one_line_input_error(lambda: bound(X=torch.ones(200, 7, 1, dtype=torch.float64)),
                          "X has T=7 tokens per sample, but the model takes (n, T, d_input=1) with 1 <= T <= max_len=6")
    _one_line_input_error(lambda: bound(X=X[:, :0]), "X has T=0 tokens per sample")
    assert bound(y=y.int()).value == bound().value  # int32 class ids are fine (made int64 for gather/scatter)
    broken = ReferenceTransformer(cfg).double()
    with torch.no_grad():
        broken.blocks[0].W_Q[0, 0, 0] = math.nan
    from transcover._errors import WeightError

    _one_line_input_error(lambda: bound(model=broken), "model weight blocks.0.W_Q has NaN or infinite entries",
                          WeightError)


def test_margin_change_bound_refuses_bad_xi_and_norms():
    # red team 204: a negative xi gave a negative bound (0.0 for -1 here) and NaN a NaN one, both "certified"
    cfg = _cfg(d=4, T=5)
    a, b = ReferenceTransformer(cfg).double(), ReferenceTransformer(cfg).double()
    N, D = pair_norms(cfg, a.state_dict(), b.state_dict())
    assert margin_change_bound(cfg, N, D, 1.0) > 0
    for xi in (-1.0, -0.5, 0.0, math.nan, math.inf, True, "1"):
        _one_line_input_error(lambda: margin_change_bound(cfg, N, D, xi),
                              f"xi must be a finite number > 0, but got xi={xi!r}")
    for bad in (-1.0, math.nan, math.inf):
        _one_line_input_error(lambda: margin_change_bound(cfg, N, {**D, "embed": bad}, 1.0),
                              f"D['embed'] must be a finite number >= 0, but got D['embed']={bad!r}")
        _one_line_input_error(lambda: margin_change_bound(cfg, {**N, "head.w": bad}, D, 1.0),
                              f"N['head.w'] must be a finite number >= 0, but got N['head.w']={bad!r}")


def test_class_prior_refuses_a_menu_below_one():
    # red team 204: ln(menu_size) of 0.5 is negative (a smaller prior cost), of 0 a math domain error
    S = {"a": torch.tensor([True, False])}
    assert class_prior_nats(1, S, {"a": 0}, 0) > 0
    for size in (0, -1, 0.5, 2.0):
        _one_line_input_error(lambda: class_prior_nats(size, S, {"a": 0}, 0),
                              f"menu_size must be a positive integer, but got menu_size={size!r}")
