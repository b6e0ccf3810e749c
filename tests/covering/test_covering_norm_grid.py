"""THEORY F102: the gaps of ``model_bound`` pay for a class read off the trained weights.

Every norm the gap's class reads is rounded up to a grid level ``fl(2^(j/k))`` (or 0), and the level vector
is paid for by a prior fixed before the data (BFT 2017, Lemma A.9).  Checked here: the rounding (never
below, the smallest level), the prior (sums to at most 1; its cost against exact arithmetic), that every
number the gap's terms read is a level, and that the gap is the one of that class with that cost.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import mpmath
import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st

from transcover import InputError
from transcover.cli import main
from transcover.covering import concentration_term, generalisation_bound, model_bound
from transcover.covering._model_bound import model_terms
from transcover.covering._norm_grid import _LAYER_NORMS, NormGrid, grid_class_bounds
from transcover.lipschitz import class_bounds
from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec, save_reference
from transcover.norms import measure_model


@given(v=st.floats(min_value=0.0, allow_infinity=False, allow_nan=False), k=st.integers(1, 16))
@example(v=5e-324, k=4)
@example(v=1.7976931348623157e308, k=4)
@example(v=2.0 ** 0.25, k=4)
@example(v=math.nextafter(2.0 ** 0.25, math.inf), k=4)
def test_rounding_is_the_smallest_level_above(v, k):
    g = NormGrid(k)
    up = g.up(v)
    assert up >= v
    if v == 0:
        assert up == 0 and g.levels == [None]
        return
    (j,) = g.levels
    assert up == g.level(j) and g.level(j - 1) < v  # the smallest level that holds v
    assert g.up(up) == up  # a level rounds to itself
    if math.isfinite(up):
        assert Fraction(up) <= Fraction(v) * Fraction(2) ** 1 * 2  # at most one octave (and a ulp) above


def test_prior_sums_to_one():
    """``1/2`` on 0 and ``1/(3(|j|+1)(|j|+2))`` on level j: the partial sums over |j| <= J are
    ``1 - 2/(3(J + 2))`` exactly (-> 1), so every union over the grid pays at most delta in all."""
    total = Fraction(1, 2)
    for J in range(0, 400):
        total += sum(Fraction(1, 3 * (abs(j) + 1) * (abs(j) + 2)) for j in ({J, -J} if J else {0}))
        assert total == 1 - Fraction(2, 3 * (J + 2))


@given(levels=st.lists(st.one_of(st.none(), st.integers(-5000, 5000)), min_size=0, max_size=300))
def test_log_prior_against_exact_sums(levels):
    g = NormGrid(4, list(levels))
    with mpmath.workdps(60):
        ref = mpmath.fsum(mpmath.log(2) if j is None else mpmath.log(3 * (abs(j) + 1) * (abs(j) + 2)) for j in levels)
        assert g.log_prior >= ref  # never below
        assert g.log_prior <= ref * (1 + mpmath.mpf(2) ** -50) + mpmath.mpf(2) ** -1070


@pytest.mark.parametrize("bad", [-1.0, math.nan, -math.inf, "1"])
def test_bad_norms_refused(bad):
    with pytest.raises(InputError):
        NormGrid().up(bad)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, 2**20 + 1, 10**30])  # 10^30: the level search never ended
def test_bad_steps_refused(bad):
    with pytest.raises(InputError):
        NormGrid(bad)


def _spec(seed=0, **cfg):
    torch.manual_seed(seed)
    base = dict(d_model=8, n_heads=2, n_layers=2, d_ff=16)
    return reference_spec(ReferenceTransformer(ReferenceConfig(**{**base, **cfg})))


def _is_level(g: NormGrid, v: float) -> bool:
    return NormGrid(g.steps).up(v) == v


@pytest.mark.parametrize("cfg", [dict(), dict(head_hidden=(8,)), dict(norm="layernorm")])
def test_every_number_the_gap_reads_is_a_level(cfg):
    spec = _spec(**cfg)
    norms = measure_model(spec, entrywise=True)
    grid = NormGrid(4)
    bounds = grid_class_bounds(class_bounds(norms), grid)
    for L in bounds.layers:
        for name in _LAYER_NORMS:
            v = getattr(L, name)
            for x in (v if isinstance(v, tuple) else () if v is None else (v,)):
                assert _is_level(grid, x), (name, x)
        for site in (L.norm_attn, L.norm_ffn):
            assert _is_level(grid, site.gamma_max) and _is_level(grid, site.beta_norm)
    plain, _, _ = model_terms(spec, norms=norms)
    gterms, _, _ = model_terms(spec, norms=norms, grid=NormGrid(4))
    assert [t.name for t in plain] == [t.name for t in gterms]
    for a, b in zip(plain, gterms):
        assert _is_level(grid, b.l21) and _is_level(grid, b.spectral)
        for x, y in ((a.l21, b.l21), (a.spectral, b.spectral)):
            assert x <= y <= x * 2 ** 0.25 * (1 + 1e-15)  # one grid step at most
        assert b.log_c >= a.log_c  # the coefficients read the rounded class: never smaller


@pytest.mark.parametrize("cfg", [dict(), dict(head_hidden=(8,))])
def test_gap_is_the_gridded_class_with_its_prior(cfg):
    spec = _spec(1, **cfg)
    n = 1e7
    fixed = model_bound(spec, eps=0.1, n_samples=(n,), seq_len=8, norm_grid=0)
    mb = model_bound(spec, eps=0.1, n_samples=(n,), seq_len=8)
    assert mb.norm_grid == 4 and mb.grid_norms > 0 and mb.log_prior > 0
    assert fixed.log_prior == 0 and fixed.gap_curve is fixed.curve
    # the reported log N is the model's own class, the same either way
    assert mb.log_log_N == fixed.log_log_N
    g, g0 = mb.generalisation[0], fixed.generalisation[0]
    assert g.log_prior == mb.log_prior
    assert g.concentration == concentration_term(n, delta=0.05, log_prior=mb.log_prior) > g0.concentration
    assert g.raw_log_gap > g0.raw_log_gap
    # recomputed from the gridded class's curve and the prior
    ref = generalisation_bound(mb.gap_curve, n, delta=0.05, log_prior=mb.log_prior)
    assert ref.raw_log_gap == g.raw_log_gap
    assert mb.gap_curve(0.1, n) >= mb.curve(0.1, n)
    assert any("F102" in a for a in mb.assumptions) and any("norm_grid = 0" in a for a in fixed.assumptions)
    assert mb.gap_at(n).raw_log_gap == g.raw_log_gap
    d = mb.to_dict()
    assert d["log_prior"] == mb.log_prior and d["grid_norms"] == mb.grid_norms and d["generalisation"][0]["log_prior"]


def test_concentration_with_prior_against_mpmath():
    for n, b, delta, lp in ((1e3, 1.0, 0.05, 0.0), (7.0, 2.5, 1e-9, 123.456), (1e12, 1e-3, 0.5, 4457.0)):
        with mpmath.workdps(60):
            conc = (mpmath.log(2 / mpmath.mpf(delta)) + mpmath.mpf(lp)) / (2 * mpmath.mpf(n))
            ref = 3 * mpmath.mpf(b) * mpmath.sqrt(conc)
            c = concentration_term(n, loss_bound=b, delta=delta, log_prior=lp)
            assert c >= ref and c <= ref * (1 + mpmath.mpf(2) ** -50)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(InputError):
            concentration_term(1e3, log_prior=bad)


def test_cli_json_carries_the_prior(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    path = tmp_path / "ref.safetensors"
    torch.manual_seed(0)
    save_reference(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16)), path)
    for k in ("4", "0"):
        js = tmp_path / f"b{k}.json"
        assert main(["bound", str(path), "--seq-len", "8", "--json", str(js), "--norm-grid", k]) == 0
        out = " ".join(capsys.readouterr().out.split())  # rich folds long lines
        data = json.loads(js.read_text())
        assert data["norm_grid"] == int(k)
        assert (data["log_prior"] > 0) == (k == "4")
        assert ("levels per octave" in out) == (k == "4") and ("fixed before the data" in out)


@given(v=st.floats(min_value=1e-300, max_value=1e300), k=st.integers(1, 64), e=st.integers(-40, 40))
def test_scaling_a_norm_by_a_power_of_two_moves_its_level_exactly(v, k, e):
    """Homogeneity: the level of 2^e v is 2^e times the level of v (index + e k), so a weight scaled by 2^e is
    charged the same grid as the original, shifted; its prior cost moves only through |j|."""
    assume(1e-300 < v * 2.0**e < 1e300)  # both levels normal floats (ldexp of a level is exact there)
    a, b = NormGrid(k), NormGrid(k)
    up, up2 = a.up(v), b.up(math.ldexp(v, e))
    assert up2 == math.ldexp(up, e) and b.levels[0] == a.levels[0] + e * k
