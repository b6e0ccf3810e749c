"""Issue 10, defect 11: a generalisation-gap bound is never reported above the loss range.

A loss in ``[0, b]`` has ``E loss - empirical loss <= b`` for every function, so the reported gap
is ``min(formula, b)``; ``vacuous`` flags a formula that did not beat ``b`` and the formula's own
value stays available (``raw_gap``), labelled.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from transcover import InputError
from transcover.cli import main
from transcover.covering import concentration_term, generalisation_bound, generalisation_gap
from transcover.covering._dudley import DudleyBound, dudley_entropy_integral
from transcover.model import ReferenceConfig, ReferenceTransformer, save_reference


def _rich(e: float, n: float) -> float:
    """ln log N of a class far too rich for any n here (log N = 10^200 / eps^2)."""
    return 200 * math.log(10) - 2 * math.log(e)


def test_the_note_says_what_the_gap_is():
    """Red team 222: ``bound --json`` gave BFT's baseline gap ``"kind": "estimate"`` beside ``"note": "certified gap
    bound 0.004075 < loss range b=1"``; the note follows the kind."""
    from transcover._results import Kind
    from transcover.covering._model_bound import _bft_gap

    bft = _bft_gap(math.log(1e-6), 1e6, 1.0, 0.05)  # a small class at a large n: not vacuous
    assert bft.kind is Kind.ESTIMATE and not bft.vacuous
    assert "certified gap" not in bft.note and bft.note.startswith("estimate of the gap, not certified"), bft.note
    ours = generalisation_bound(lambda e, n: math.log(1e-6) - 2 * math.log(e), 1e6)
    assert ours.kind is Kind.CERTIFIED_UPPER and not ours.vacuous and ours.note.startswith("certified gap bound")


@pytest.mark.parametrize("b", [1.0, 0.25, 7.0])
def test_rich_class_reports_the_trivial_bound(b):
    g = generalisation_bound(_rich, 1e6, loss_bound=b)
    # old code: gap = 2 * 4b + conc (8.004 for b = 1), above the range of the loss
    assert g.gap == b and g.log_gap == math.log(b)
    assert g.vacuous
    assert g.rademacher.trivial and g.rademacher.alpha == pytest.approx(b, rel=1e-12)
    assert g.raw_gap == pytest.approx(8 * b + concentration_term(1e6, loss_bound=b), rel=1e-12)
    assert g.raw_gap > b
    d = g.to_dict()
    assert d["gap"] == b and d["vacuous"] is True and d["raw_gap"] > b and "vacuous" in d["note"]


def test_informative_bound_is_unchanged():
    curve = lambda e, n: math.log(50.0 / e**2)  # noqa: E731
    g = generalisation_bound(curve, 1e6)
    assert not g.vacuous and not g.rademacher.trivial
    assert g.gap == g.raw_gap < 1.0
    assert g.gap == pytest.approx(2 * g.rademacher.value + concentration_term(1e6), rel=1e-12)


@given(log_value=st.floats(-30, 800), n=st.floats(1.0, 1e12), b=st.floats(1e-3, 1e3),
       delta=st.floats(1e-6, 0.5))
def test_gap_never_exceeds_the_loss_range(log_value, n, b, delta):
    rad = DudleyBound(math.inf if log_value > 709 else math.exp(log_value), b, log_value)
    g = generalisation_gap(rad, n, loss_bound=b, delta=delta)
    assert g.gap <= b and math.isfinite(g.log_gap) and g.log_gap <= math.log(b)
    # the formula itself, before the clip (independent recomputation in logs)
    ref = math.log(2 * math.exp(min(log_value, 700)) + concentration_term(n, loss_bound=b, delta=delta)) \
        if log_value <= 700 else math.log(2) + log_value
    assert g.raw_log_gap >= ref - 1e-12 * (1 + abs(ref))
    assert g.vacuous == (g.raw_gap >= b)
    assert g.gap == (b if g.vacuous else g.raw_gap)
    assert g.test_loss_bound(0.0) <= b and g.test_loss_bound(b) == b


def test_test_loss_bound_clips_and_validates():
    g = generalisation_bound(_rich, 1e6)
    assert g.test_loss_bound(0.3) == 1.0
    curve = lambda e, n: math.log(50.0 / e**2)  # noqa: E731
    ok = generalisation_bound(curve, 1e6)
    assert ok.test_loss_bound(0.05) >= 0.05 + ok.gap and ok.test_loss_bound(0.05) < 1.0
    assert ok.test_loss_bound(0.3) == 1.0  # 0.3 + 0.85 > 1: the loss range is the better bound
    with pytest.raises(InputError):
        ok.test_loss_bound(1.5)


def test_dudley_flags_its_trivial_alpha():
    assert dudley_entropy_integral(lambda e: 2000.0 - 2 * math.log(e), 1e6, 1.0).trivial
    assert not dudley_entropy_integral(lambda e: math.log(50.0 / e**2), 1e6, 1.0).trivial


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("m") / "ref.safetensors"
    save_reference(ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16,
                                                        head_hidden=(8,))), path)
    return path


def test_cli_bound_reports_vacuous_gap_clipped(model_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    js = tmp_path / "b.json"
    rc = main(["bound", str(model_path), "--n-samples", "100", "--seq-len", "8", "--loss-bound", "2",
               "--json", str(js), "--top", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    data = json.loads(js.read_text())
    for g in data["generalisation"] + data["bft"]["generalisation"]:
        assert g["gap"] <= 2.0 and g["trivial_bound"] == 2.0
        assert g["vacuous"] is True and g["raw_gap"] > 2.0 and g["log10_gap"] == pytest.approx(math.log10(2))
    assert data["bft"]["generalisation"][0]["kind"] == "estimate"
    assert "vacuous" in out and "trivial" in out and "raw formula" in out
