"""G.3 between two models: structural differences refused or bounded, either array backend (issue 10).

Regression tests for defects 2 (causal masking ignored), 3 (numpy specs crashed) of issue 10,
and property tests: for pairs differing only in weights (and in the layouts the lemma charges
exactly: softmax scale, grouped-query sharing, head dimension, bias presence), the certified bound
is >= the output change found by a float64 gradient ascent over inputs, stronger than the
project's own ``perturbation_lower`` (more restarts, more steps, repeated-token starts).
"""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lipschitz_testkit import ACTS, random_spec
from transcover import InputError
from transcover.lipschitz import (
    lipschitz_bounds, perturbation_bound, perturbation_coefficients, perturbation_deltas, perturbation_lower,
)
from transcover.lipschitz._empirical import _metric_norm, _project
from transcover.model import (
    Activation, NormKind, NormSpec, Placement, RopeSpec, structural_differences, transformer_forward,
)


# -- helpers ----------------------------------------------------------------------------------------
def _layers(spec, f):
    return replace(spec, layers=[f(layer) for layer in spec.layers])


def _attn(spec, **kw):
    return _layers(spec, lambda la: replace(la, attention=replace(la.attention, **kw)))


def _ffn(spec, **kw):
    return _layers(spec, lambda la: replace(la, ffn=replace(la.ffn, **kw)))


def _moved(spec, seed, size, names=None):
    """``spec`` with every (or every named) weight array moved by ``size`` times a random direction."""
    g = torch.Generator().manual_seed(seed)

    def mv(name, t):
        if t is None or (names is not None and name not in names):
            return t
        return t + size * torch.randn(t.shape, generator=g, dtype=t.dtype)

    def norm(n, prefix):
        if n is None or n.kind not in (NormKind.LAYERNORM, NormKind.RMSNORM):
            return n
        return replace(n, weight=mv(prefix + ".weight", n.weight), bias=mv(prefix + ".bias", n.bias))

    def layer(la):
        a, m = la.attention, la.ffn
        a = replace(a, **{k: mv(k, getattr(a, k)) for k in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")})
        m = replace(m, **{k: mv(k, getattr(m, k)) for k in ("W_1", "W_2", "b_1", "b_2", "W_gate", "b_gate")})
        return replace(la, attention=a, ffn=m, norm_attn=norm(la.norm_attn, "norm"), norm_ffn=norm(la.norm_ffn, "norm"))

    return replace(_layers(spec, layer), input_norm=norm(spec.input_norm, "norm"),
                   final_norm=norm(spec.final_norm, "norm"))


def _adversarial_gap(a, b, *, radius, T=3, metric="2,inf", restarts=6, steps=60, seed=0):
    """max over inputs (token norms <= radius) of ||g_a(X) - g_b(X)||, float64 projected Adam with
    restarts: half the starts repeat one token (where G.3's fixed-input terms are attained)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(restarts, T, a.d_model, generator=g, dtype=torch.float64)
    X[: restarts // 2] = X[: restarts // 2, :1]
    X = _project(X / X.norm(dim=-1, keepdim=True) * radius, radius).requires_grad_(True)
    opt = torch.optim.Adam([X], lr=0.05 * radius)
    best = 0.0
    for step in range(steps + 1):
        with torch.no_grad():
            X.copy_(_project(X, radius))
        gap = _metric_norm(transformer_forward(a, X, with_head=False) - transformer_forward(b, X, with_head=False),
                           metric)
        best = max(best, float(gap.detach().max()))
        if step == steps:
            break
        opt.zero_grad()
        (-gap.sum()).backward()
        opt.step()
    return best


# -- defect 2: structural differences ------------------------------------------------------------------
def test_causal_flip_is_refused_not_bounded_by_zero():
    """Issue 10 defect 2: B = A with causal=False gave a certified 0.0 beside a measured change > 0."""
    a = random_spec(0, causal=True, norm="layernorm", eps=0.1)
    b = _attn(a, causal=False)
    measured = perturbation_lower(a, b, n_samples=4, n_steps=20).value.value
    assert measured > 0.1  # the function really changes (4.97 on this spec)
    assert structural_differences(a, b) == ["masking: layer 0 causal=True vs False",
                                            "masking: layer 1 causal=True vs False"]
    with pytest.raises(InputError, match=r"^cannot bound the change between models that differ in masking: "
                                         r"layer 0 causal=True vs False \(and 1 more difference\)$"):
        perturbation_bound(a, b)
    with pytest.raises(InputError, match="masking"):
        perturbation_coefficients(a, other=b)
    with pytest.raises(InputError, match="masking"):
        perturbation_deltas(a, b)


def _second_layer_only(spec, f):
    return replace(spec, layers=[spec.layers[0], f(spec.layers[1])])


BASE = dict(norm="layernorm", eps=0.1, final_norm=True)
# one layer under Pi_norm keeps every radius <= 1, so the bound is within a small factor of the true
# change and the adversarial comparison has teeth (LayerNorm's outputs have norm ~ sqrt(d) max|gamma|,
# which G.3's R^3 terms turn into factors of 10^3); LayerNorm with eps = 1 where gamma is the point
TIGHT = dict(norm="ball", final_norm=True, L=1)
TIGHT_LN = dict(norm="layernorm", eps=1.0, final_norm=True, L=1)
STRUCTURAL = {
    "masking": lambda s: _attn(s, causal=True),
    "norm placement": lambda s: _layers(s, lambda la: replace(la, placement=Placement.PRE)),
    "normalisation kind": lambda s: _second_layer_only(s, lambda la: replace(
        la, norm_ffn=replace(la.norm_ffn, kind=NormKind.RMSNORM))),
    # a valid L2 spec (Note [L2 attention fields]: W_K tied, no biases, scale, mask or RoPE)
    "attention kind": lambda s: _layers(s, lambda la: replace(la, attention=replace(
        la.attention, kind="l2", W_K=la.attention.W_Q, b_Q=None, b_K=None, b_V=None, b_O=None,
        scale=None, causal=False, rope=None))),
    "rotary position embedding": lambda s: _attn(s, rope=RopeSpec(theta=10.0)),
    "activation": lambda s: _ffn(s, activation=Activation.GELU),
    "gated FFN": lambda s: _ffn(s, W_gate=s.layers[0].ffn.W_1.clone()),
    "FFN width": lambda s: _ffn(s, W_1=s.layers[0].ffn.W_1[:, :4], W_2=s.layers[0].ffn.W_2[:4]),
    "number of heads": lambda s: _attn(s, **{k: getattr(s.layers[0].attention, k)[:1]
                                             for k in ("W_Q", "W_K", "W_V", "W_O")}),
    "width": lambda s: random_spec(0, d=4, **BASE),
    "depth": lambda s: random_spec(0, L=3, **BASE),
}


@pytest.mark.parametrize("field", sorted(STRUCTURAL))
def test_each_structural_difference_is_refused_naming_the_field(field):
    a = random_spec(0, **BASE)
    b = STRUCTURAL[field](a)
    diffs = structural_differences(a, b)
    assert diffs and diffs[0].startswith(field + ":")
    with pytest.raises(InputError, match=f"differ in {field}:"):
        perturbation_bound(a, b)
    with pytest.raises(InputError, match=f"differ in {field}:"):
        perturbation_bound(b, a)


def test_input_and_final_norm_and_rope_details_are_structural():
    a = random_spec(1, norm="rmsnorm", eps=0.1, final_norm=True, rope=True)
    b = replace(a, final_norm=NormSpec(NormKind.NONE))
    assert structural_differences(a, b) == ["normalisation kind: final_norm rmsnorm vs none"]
    c = replace(a, input_norm=replace(a.input_norm, eps=1e-5))
    assert structural_differences(a, c) == []  # charged by its own term (test_eps_change_*)
    d = _attn(a, rope=RopeSpec(theta=10000.0))
    assert structural_differences(a, d)[0].startswith("rotary position embedding: layer 0 theta=10.0")
    # RoPE rotates inside the head dimension, so a different d_head is structural there
    e = _attn(a, **{k: getattr(a.layers[0].attention, k)[..., :2] for k in ("W_Q", "W_K", "W_V")},
              W_O=a.layers[0].attention.W_O[:, :2])
    assert any(x.startswith("head dimension: layer 0") for x in structural_differences(a, e))
    with pytest.raises(InputError, match=r"differ in rotary position embedding: .* \(and 3 more differences\)"):
        perturbation_bound(a, e)  # the rotary width follows the head dimension, so both are named
    # fields the forward pass never reads are not differences
    f = _attn(replace(a, name="other", arch="x", config={"k": 1}), rope=RopeSpec(theta=10.0, max_position=7,
                                                                                  rotary_dim=a.layers[0].attention.d_head))
    assert structural_differences(a, f) == []
    g = _attn(a, rope=RopeSpec(theta=10.0, rotary_dim=2))
    assert structural_differences(a, g)[0] == "rotary position embedding: layer 0 theta=10.0, rotary_dim=4 vs theta=10.0, rotary_dim=2"


def test_refused_from_the_command_line(tmp_path, capsys):
    from transcover.cli import main
    from transcover.model import ReferenceConfig, ReferenceTransformer, save_reference

    torch.manual_seed(0)
    save_reference(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16)), tmp_path / "a.safetensors")
    save_reference(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16, causal=True)),
                   tmp_path / "b.safetensors")
    code = main(["perturb", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--samples", "1",
                 "--steps", "0", "--seq-len", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0] == ("transcover: error: cannot bound the change between models that differ in masking: "
                      "layer 0 causal=False vs True")


def test_covering_reference_with_another_structure_is_refused():
    from transcover.covering import model_bound

    a = random_spec(2, **BASE)
    with pytest.raises(InputError, match="^the reference model differs from the model in activation: layer 0"):
        model_bound(a, seq_len=4, reference=STRUCTURAL["activation"](a))


# -- differences the lemma charges exactly: bounded, and the bound holds --------------------------------
def _gqa(spec):
    """Key/value heads shared by both query heads (H_kv = 1)."""
    return _attn(spec, W_K=spec.layers[0].attention.W_K[:1].clone(), W_V=spec.layers[0].attention.W_V[:1].clone())


def _with_biases_of(spec, donor):
    def layer(la, lb):
        return replace(la, attention=replace(la.attention, **{k: getattr(lb.attention, k) for k in ("b_Q", "b_K", "b_V", "b_O")}),
                       ffn=replace(la.ffn, b_1=lb.ffn.b_1, b_2=lb.ffn.b_2))

    return replace(spec, layers=[layer(la, lb) for la, lb in zip(spec.layers, donor.layers)])


# each makes b from a weight-moved copy of a; the weight move is tiny, so a bound that dropped the
# layout's own term would fall below the measured change
BOUNDED = {
    "softmax scale": lambda s: _attn(s, scale=0.9),
    "grouped-query sharing": _gqa,
    "head dimension": lambda s: _attn(s, **{k: torch.cat([getattr(s.layers[0].attention, k),
                                                          0.3 * getattr(s.layers[0].attention, k)[..., :1]], -1)
                                            for k in ("W_Q", "W_K", "W_V")},
                                      W_O=torch.cat([s.layers[0].attention.W_O, s.layers[0].attention.W_O[:, :1]], 1)),
    "biases in one model only": lambda s: _with_biases_of(s, random_spec(3, biases=True, **TIGHT)),
    "gamma missing": lambda s: _layers(s, lambda la: replace(la, norm_attn=replace(la.norm_attn, weight=None,
                                                                                   bias=None))),
    "identity norm as None": lambda s: replace(s, final_norm=None),
    "normalisation eps": lambda s: replace(_layers(s, lambda la: replace(la, norm_attn=replace(la.norm_attn, eps=0.25))),
                                           final_norm=replace(s.final_norm, eps=4.0)),
}


@pytest.mark.parametrize("kind", sorted(BOUNDED))
def test_charged_layout_differences_are_bounded(kind):
    a = random_spec(3, **(TIGHT_LN if kind in ("gamma missing", "normalisation eps") else TIGHT))
    if kind == "identity norm as None":
        a = replace(a, final_norm=NormSpec(NormKind.NONE))
    b = BOUNDED[kind](_moved(a, 4, 0.02 if kind == "identity norm as None" else 1e-4))
    assert structural_differences(a, b) == []
    for radius in (0.7, 2.0):
        bound = perturbation_bound(a, b, radius=radius).total.value
        measured = _adversarial_gap(a, b, radius=radius)
        assert 0 < measured <= bound, (kind, radius, measured, bound)


def test_rope_with_different_softmax_scales_is_bounded():
    """Was refused ('different attention scales'): now charged as ||s W_Q - s~ W~_Q|| ||W_K|| + ..."""
    a = random_spec(5, rope=True, **BASE)
    b = _attn(_moved(a, 6, 0.01), scale=0.4)
    bound = perturbation_bound(a, b, radius=1.5).total.value
    assert 0 < _adversarial_gap(a, b, radius=1.5, T=4) <= bound


# -- property: pairs differing only in weights ---------------------------------------------------------
@settings(max_examples=12, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), norm=st.sampled_from(["ball", "layernorm", "rmsnorm", "none"]),
       placement=st.sampled_from(["post", "pre"]), act=st.sampled_from(ACTS), causal=st.booleans(),
       gqa=st.booleans(), biases=st.booleans(), rope=st.booleans(), radius=st.floats(0.3, 2.5),
       size=st.sampled_from([1e-3, 3e-2, 0.3]), metric=st.sampled_from(["2,inf", "fro"]))
def test_weight_only_pairs_bound_the_adversarial_change(seed, norm, placement, act, causal, gqa, biases, rope,
                                                         radius, size, metric):
    a = random_spec(seed, norm=norm, placement=placement, act=act, causal=causal, biases=biases, rope=rope,
                    eps=0.1, final_norm=True)
    if gqa:
        a = _gqa(a)
    b = _moved(a, seed + 1, size)
    T = 3
    bound = perturbation_bound(a, b, radius=radius, metric=metric, seq_len=T if metric == "fro" else None)
    measured = _adversarial_gap(a, b, radius=radius, T=T, metric=metric, restarts=4, steps=40, seed=seed)
    assert 0 < measured <= bound.total.value


def test_homogeneity_in_the_weight_change():
    """Moving W_V, W_1 and the biases by lam * D: every delta is exactly linear in lam (up to the
    certified intervals' 1e-6 relative width), and the bound is at most lam times the bound at lam=1,
    since by convexity of norms the class of A + lam D lies inside the class of {A, A + D}."""
    a = random_spec(9, biases=True, **BASE)
    names = {"W_V", "W_1", "b_1", "b_2", "b_O"}
    b1 = _moved(a, 10, 0.1, names)
    d1 = perturbation_deltas(a, b1)
    coeffs = perturbation_coefficients(a, other=b1)
    full = perturbation_bound(a, b1).total.value
    for lam in (1e-3, 0.1, 0.5):
        blam = replace(_layers(a, lambda la: la), layers=[
            replace(la, attention=replace(la.attention, W_V=la.attention.W_V + lam * (lb.attention.W_V - la.attention.W_V),
                                          b_O=la.attention.b_O + lam * (lb.attention.b_O - la.attention.b_O)),
                    ffn=replace(la.ffn, **{k: getattr(la.ffn, k) + lam * (getattr(lb.ffn, k) - getattr(la.ffn, k))
                                           for k in ("W_1", "b_1", "b_2")}))
            for la, lb in zip(a.layers, b1.layers)])
        dlam = perturbation_deltas(a, blam)
        for key, v in d1.items():
            assert dlam[key] == pytest.approx(lam * v, rel=3e-6, abs=1e-300), key
        assert coeffs.bound(dlam) == pytest.approx(lam * coeffs.bound(d1), rel=3e-6)
        # each class bound is within 1e-6 of its true value and enters with degree < 50: slack 5e-5
        assert perturbation_bound(a, blam).total.value <= lam * full * (1 + 5e-5)


# -- defect 3: specs read from files ---------------------------------------------------------------------
def _numpy_spec(spec):
    """The same spec with every array a (read-only, like a memory map) float32 numpy array."""
    def cv(t):
        if t is None:
            return None
        x = np.array(t.detach().numpy(), dtype=np.float32)
        x.flags.writeable = False
        return x

    def norm(n):
        return None if n is None else replace(n, weight=cv(n.weight), bias=cv(n.bias))

    def layer(la):
        a, m = la.attention, la.ffn
        return replace(la, attention=replace(a, **{k: cv(getattr(a, k)) for k in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")}),
                       ffn=replace(m, **{k: cv(getattr(m, k)) for k in ("W_1", "W_2", "b_1", "b_2", "W_gate", "b_gate")}),
                       norm_attn=norm(la.norm_attn), norm_ffn=norm(la.norm_ffn))

    return replace(_layers(spec, layer), input_norm=norm(spec.input_norm), final_norm=norm(spec.final_norm))


def test_specs_loaded_from_files_are_accepted(tmp_path):
    """Issue 10 defect 3: ``perturbation_bound(load(a), load(b))`` raised AttributeError (numpy has no .detach)."""
    from transcover.model import ReferenceConfig, ReferenceTransformer, load, save_reference

    torch.manual_seed(0)
    cfg = ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16)
    save_reference(ReferenceTransformer(cfg), tmp_path / "a.safetensors")
    save_reference(ReferenceTransformer(cfg), tmp_path / "b.safetensors")
    A, B = load(tmp_path / "a.safetensors"), load(tmp_path / "b.safetensors")
    assert isinstance(A.layers[0].attention.W_Q, np.ndarray)
    from_files = perturbation_bound(A, B).total.value
    assert from_files == perturbation_bound(A.to_torch(), B.to_torch()).total.value
    assert perturbation_deltas(A, B) == perturbation_deltas(A.to_torch(), B.to_torch())
    assert lipschitz_bounds(A).upper.value == lipschitz_bounds(A.to_torch()).upper.value
    from transcover.covering import model_bound

    assert model_bound(A, seq_len=4, reference=B).log_log_N == model_bound(A.to_torch(), seq_len=4,
                                                                             reference=B.to_torch()).log_log_N


@pytest.mark.parametrize("mixed", [False, True])
def test_numpy_and_torch_backends_give_the_same_bound(mixed):
    a = random_spec(12, biases=True, gated=True, **BASE)
    a32 = _numpy_spec(a)
    b = _moved(a, 13, 0.05)
    b32 = _numpy_spec(b)
    torch_a = a32 if not mixed else a
    got = perturbation_bound(torch_a, b32).total.value
    want = perturbation_bound(*(s.to_torch() for s in (torch_a, b32))).total.value
    assert got == want and math.isfinite(got)


# -- LayerNorm / RMSNorm eps: bounded by its own term (Note [eps change]) -------------------------------
@settings(max_examples=40, deadline=None, derandomize=True)
@given(e1=st.floats(1e-8, 10.0), ratio=st.one_of(st.floats(1.0 + 1e-9, 1.0 + 1e-6), st.floats(1.0, 1e4)))
def test_eps_change_bound_is_the_supremum(e1, ratio):
    """Closed form against a brute-force float64 supremum over the variance v (dense log grid, then
    golden-section refinement): never below it, and attained to 1e-9 relative (it is the sup)."""
    from scipy.optimize import minimize_scalar

    from transcover.lipschitz._normalisation import eps_change_bound

    e2 = e1 * ratio
    got = eps_change_bound(e1, e2)
    assert got == eps_change_bound(e2, e1)

    def f(logv):
        v = math.exp(logv)
        # the difference written without cancellation: (e2 - e1) v^(1/2) / (s1 s2 (s1 + s2)), s = sqrt(v + e)
        s1, s2 = math.sqrt(v + e1), math.sqrt(v + e2)
        return (e2 - e1) * math.sqrt(v) / (s1 * s2 * (s1 + s2))

    grid = np.linspace(math.log(e1) - 30, math.log(e2) + 30, 4001)
    k = int(np.argmax([f(x) for x in grid]))
    res = minimize_scalar(lambda x: -f(x), bounds=(grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]),
                          method="bounded", options={"xatol": 1e-12})
    brute = max(f(grid[k]), -res.fun)
    assert brute <= got * (1 + 1e-12)
    assert got <= brute * (1 + 1e-9)


@settings(max_examples=300, deadline=None)
@given(lo=st.floats(1e-300, 1e300), ulps=st.one_of(st.integers(1, 64), st.integers(1, 2**52)))
def test_eps_change_bound_never_below_the_exact_value(lo, ulps):
    """Stop 38 (left open at stop 37): the bare float closed form was up to 1 ulp below the exact supremum; it is
    now rounded up.  Exact value at 80 digits (mpmath), eps pairs from one ulp apart to 2^52 ulps apart."""
    import mpmath

    from transcover.lipschitz._normalisation import eps_change_bound

    hi = lo
    for _ in range(min(ulps, 64)):
        hi = math.nextafter(hi, math.inf)
    if ulps > 64:
        hi = lo * (1 + ulps * 2.0**-52)
    if not math.isfinite(hi) or hi == lo:
        return
    got = eps_change_bound(lo, hi)
    with mpmath.workdps(80):
        k13 = mpmath.cbrt(mpmath.mpf(hi) / mpmath.mpf(lo))
        exact = (k13 - 1) / mpmath.sqrt(k13 * k13 + k13 + 1)
        assert got >= exact
        assert got <= exact * (1 + mpmath.mpf(2) ** -44)


def test_eps_change_bound_edge_cases():
    from transcover.lipschitz._normalisation import eps_change_bound

    assert eps_change_bound(0.1, 0.1) == 0.0
    assert eps_change_bound(0.0, 1e-5) == 1.0  # sup over v of sqrt(v/(v+e)) - 1 -> 1 as v -> 0
    assert eps_change_bound(1.0, 8.0) == pytest.approx(1.0 / math.sqrt(7.0), rel=1e-14)  # k^(1/3) = 2
    with pytest.raises(InputError, match="eps"):
        eps_change_bound(-1.0, 1.0)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_eps_only_pairs_bound_the_adversarial_change(norm):
    """Same weights, every variance floor different: the bound is the eps terms alone (> 0) and holds
    against the float64 adversary, including near-constant inputs where the floors matter most."""
    a = random_spec(21, norm=norm, eps=0.5, final_norm=True, L=1)
    b = replace(_layers(a, lambda la: replace(la, norm_attn=replace(la.norm_attn, eps=1.0),
                                              norm_ffn=replace(la.norm_ffn, eps=0.25))),
                input_norm=replace(a.input_norm, eps=2.0), final_norm=replace(a.final_norm, eps=0.3))
    bound = perturbation_bound(a, b, radius=1.0)
    assert {e.key[1] for e, d, c in bound.terms() if c > 0} == {"input_norm.eps", "norm_attn.eps",
                                                               "norm_ffn.eps", "final_norm.eps"}
    for radius in (0.05, 1.0):
        measured = _adversarial_gap(a, b, radius=radius)
        assert 0 < measured <= perturbation_bound(a, b, radius=radius).total.value
    # the final norm alone (eps 0.5 vs 0.05): nothing downstream, and the closed form is the exact
    # supremum -- the adversary reaches it to 1e-3 (1 - 1e-8 measured), so an inflated eps term, or
    # one below the truth, would show here
    c = replace(a, final_norm=replace(a.final_norm, eps=0.05))
    bound = perturbation_bound(a, c, radius=1.0).total.value
    measured = _adversarial_gap(a, c, radius=1.0, restarts=10, steps=150)
    assert (1 - 1e-3) * bound <= measured <= bound


def test_eps_term_is_linear_in_gamma_and_in_its_own_delta():
    """Homogeneity: scaling every gamma by lam scales the eps term's local coefficient by lam;
    the closed form's delta does not depend on gamma at all."""
    a = random_spec(22, norm="layernorm", eps=0.1, L=1, input_norm=False)
    b = _layers(a, lambda la: replace(la, norm_ffn=replace(la.norm_ffn, eps=0.3)))

    def scaled(spec, lam):
        return _layers(spec, lambda la: replace(la, norm_attn=replace(la.norm_attn, weight=lam * la.norm_attn.weight),
                                                norm_ffn=replace(la.norm_ffn, weight=lam * la.norm_ffn.weight)))

    def eps_entry(lam):
        c = perturbation_coefficients(scaled(a, lam), other=scaled(b, lam))
        return next(e for e in c.entries if e.role == "norm_ffn.eps")

    base = eps_entry(1.0)
    for lam in (0.5, 3.0):
        assert eps_entry(lam).local == pytest.approx(lam * base.local, rel=1e-12)
        assert perturbation_deltas(scaled(a, lam), scaled(b, lam))[(0, "norm_ffn.eps")] == \
            perturbation_deltas(a, b)[(0, "norm_ffn.eps")]
