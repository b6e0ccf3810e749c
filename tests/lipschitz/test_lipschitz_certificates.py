"""Issue 10 defects 4 and 5: no certificate below the proven softmax constant, and no row whose
measured lower value exceeds its certified upper value (the check fails loudly instead)."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from lipschitz_testkit import random_spec
from transcover import InputError
from transcover._errors import CertificateViolation
from transcover._results import certificate_tolerance, check_certified
from transcover.cli import main
from transcover.lipschitz import (
    attention_lipschitz, attention_perturbation_coefficients, head_lipschitz, lipschitz_bounds, lipschitz_lower,
    perturbation_bound, perturbation_coefficients,
)
from transcover.model import ReferenceConfig, ReferenceTransformer, save_reference


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    m = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16))
    save_reference(m, d / "a.safetensors")
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_reference(m, d / "b.safetensors")
    return d


# -- defect 4: c_sm < 1 -----------------------------------------------------------------------------
def test_softmax_constant_one_is_attained_so_smaller_constants_are_false():
    """THEORY F5: ||sm(a) - sm(b)||_1 <= c ||a - b||_inf holds with c = 1 and no smaller c: at
    a = 0, b = (d, -d) the ratio is tanh(d) / d -> 1 (two logits, float64)."""
    for delta in (1e-2, 1e-4):
        a = torch.zeros(2, dtype=torch.float64)
        b = torch.tensor([delta, -delta], dtype=torch.float64)
        ratio = float((torch.softmax(a, 0) - torch.softmax(b, 0)).abs().sum() / (a - b).abs().max())
        assert ratio == pytest.approx(math.tanh(delta) / delta, rel=1e-9)
        assert ratio > 0.5 and ratio > 1 - delta


@pytest.mark.parametrize("c_sm", [0.5, 0.999, 0.0, -1.0, float("nan"), float("inf")])
def test_every_api_refuses_a_softmax_constant_below_one(c_sm):
    spec = random_spec(0)
    other = random_spec(1)
    calls = [
        lambda: lipschitz_bounds(spec, c_sm=c_sm),
        lambda: perturbation_coefficients(spec, c_sm=c_sm),
        lambda: perturbation_bound(spec, other, c_sm=c_sm),
        lambda: head_lipschitz(1.0, 1.0, 1.0, c_sm=c_sm),
        lambda: attention_lipschitz([1.0], [1.0], 1.0, c_sm=c_sm),
        lambda: attention_perturbation_coefficients([1.0], 1.0, c_sm=c_sm),
    ]
    from transcover.constrain._penalties import layer_lipschitz_factor
    from transcover.covering import model_bound

    one = torch.ones(1, dtype=torch.float64)
    calls += [lambda: model_bound(spec, seq_len=4, c_sm=c_sm),
              lambda: layer_lipschitz_factor(one, one, one[0], one[0], c_sm=c_sm)]
    for call in calls:
        with pytest.raises(InputError, match=r"c_sm must be a finite number >= 1 .*c_sm="):
            call()


def test_softmax_constants_from_one_up_are_certificates():
    spec = random_spec(0)
    ups = [lipschitz_bounds(spec, c_sm=c).upper.value for c in (1.0, 1.5, 2.0)]
    assert ups == sorted(ups) and lipschitz_bounds(spec, c_sm=2.0).upper.kind.value == "certified upper bound"


@pytest.mark.parametrize("cmd", ["lipschitz", "perturb", "bound"])
def test_command_line_refuses_c_sm_below_one(models, capsys, cmd):
    paths = [str(models / "a.safetensors")] + ([str(models / "b.safetensors")] if cmd == "perturb" else [])
    assert main([cmd, *paths, "--c-sm", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--c-sm must be a finite number >= 1" in err[0] and "--c-sm=0.5" in err[0]


# -- defect 5: the central check ------------------------------------------------------------------
def test_check_certified_tolerance_is_a_few_ulps():
    tol = certificate_tolerance()
    assert tol == 8 * np.finfo(np.float64).eps / 2
    check_certified("x", 1.0, 1.0)
    check_certified("x", 1.0, 1.0 + 2 * np.finfo(np.float64).eps)  # rounding of the comparison itself
    check_certified("x", 5, 5)
    check_certified("x", math.inf, 1e300)
    check_certified("x", 1.0, math.nan)
    with pytest.raises(CertificateViolation, match=r"measured x is 1.0000000000010001, above its certified "
                                                   r"upper bound 1 .*please report it"):
        check_certified("x", 1.0, 1.0 + 1e-12)
    with pytest.raises(CertificateViolation, match="measured net is 10, above its certified upper bound 5"):
        check_certified("net", 5, 10)
    # float32 tolerance is wider, and derived from the dtype, not chosen
    check_certified("x", 1.0, 1.0 + 1e-7, dtype=np.float32)
    assert not isinstance(CertificateViolation("x"), InputError)


def test_lipschitz_lower_refuses_a_broken_bound():
    spec = random_spec(2, L=1)
    bounds = lipschitz_bounds(spec, radius=1.0)
    lipschitz_lower(spec, bounds, seq_len=3, n_samples=2, n_steps=3)  # the true bound passes
    broken = replace(bounds, stages=tuple(replace(s, lipschitz=s.lipschitz * 1e-3) for s in bounds.stages))
    with pytest.raises(CertificateViolation, match="Lipschitz constant of .* above its certified upper bound"):
        lipschitz_lower(spec, broken, seq_len=3, n_samples=2, n_steps=3)


def _one_line_internal_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("transcover: internal error: CertificateViolation: false certificate: the measured ")
    return err[0]


def test_lipschitz_command_fails_loudly_on_a_broken_bound(models, capsys, monkeypatch, tmp_path):
    import transcover.lipschitz._compose as compose_mod

    real = compose_mod.compose

    def broken(*args, **kwargs):
        b = real(*args, **kwargs)
        return replace(b, stages=tuple(replace(s, lipschitz=s.lipschitz * 1e-3) for s in b.stages))

    monkeypatch.setattr(compose_mod, "compose", broken)
    out = tmp_path / "l.json"
    code = main(["lipschitz", str(models / "a.safetensors"), "--samples", "1", "--steps", "2", "--seq-len", "2",
                 "--json", str(out)])
    assert code == 1 and "Lipschitz constant" in _one_line_internal_error(capsys)
    assert not out.exists()  # nothing half-written
    assert "empirical lower" not in capsys.readouterr().out


def test_perturb_command_fails_loudly_on_a_broken_bound(models, capsys, monkeypatch):
    import transcover.lipschitz as lip
    from transcover._results import Quantity

    real = lip.perturbation_bound

    def broken(*args, **kwargs):
        b = real(*args, **kwargs)
        return replace(b, total=Quantity(b.total.value * 1e-6, b.total.kind, b.total.source, b.total.assumptions))

    monkeypatch.setattr(lip, "perturbation_bound", broken)
    code = main(["perturb", str(models / "a.safetensors"), str(models / "b.safetensors"), "--samples", "2",
                 "--steps", "3", "--seq-len", "2"])
    assert code == 1 and "output change" in _one_line_internal_error(capsys)


def test_cover_finite_fails_loudly_when_a_net_is_smaller_than_a_packing(capsys, monkeypatch, tmp_path):
    import transcover.empirical as E

    Y = np.arange(10, dtype=np.float64)[:, None, None]
    np.save(tmp_path / "y.npy", Y)
    assert main(["cover", "finite", str(tmp_path / "y.npy"), "--eps", "0.5", "--exact"]) == 0
    capsys.readouterr()
    real = E.estimate_covering_number

    def broken(*args, **kwargs):
        return replace(real(*args, **kwargs), net_size=1)

    monkeypatch.setattr(E, "estimate_covering_number", broken)
    assert main(["cover", "finite", str(tmp_path / "y.npy"), "--eps", "0.5"]) == 1
    assert "covering number at eps=0.5" in _one_line_internal_error(capsys)
