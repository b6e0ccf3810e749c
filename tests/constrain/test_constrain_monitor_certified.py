"""The monitor's certified columns come from ``norms.measure_model`` of the forward weights (issue 11).

Before issue 11 the history held exact float64 norms only and the training result certified slot
by slot through ``constrain._projection``; now ``TrainingMonitor.log(certify=True)`` records the
certified intervals of the one measurement every other command reads (Note [certified columns]).
Independent reference: float64 SVD of the explicitly formed matrices of the forward weights.
"""

from __future__ import annotations

import math

import torch

from transcover.constrain import ConstraintConfig, TrainingMonitor, constrain, export_plain, read_history
from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec
from transcover.norms import measure_model


def _model() -> ReferenceTransformer:
    torch.manual_seed(3)
    return ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=12, d_input=3, max_len=5,
                                                n_outputs=2, head_hidden=(6,)))


def _svd(M: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(M.double(), 2))


def test_certified_columns_are_measure_model_of_the_forward_weights(tmp_path):
    model = _model()
    # a power-iteration cap: its forward weights differ from the raw parameters, and are what is certified
    cons = constrain(model, ConstraintConfig(method="spectral", radii={"OV": 0.3, "W1": 0.5}))
    mon = TrainingMonitor(model, tmp_path / "h", radii=cons.radii)
    rec = mon.log(step=0, certify=True)
    plain = export_plain(model, certify=False).eval()
    spec = reference_spec(plain)
    norms = measure_model(spec)
    # one source: the columns are measure_model's numbers, bit for bit
    assert rec["certified.OV"] == max(h.W_OV.upper for L in norms.layers for h in L.heads)
    assert rec["certified.W1"] == max(L.W_1.upper for L in norms.layers)
    assert rec["certified.KQ"] == max(h.W_KQ(L.scale).upper for L in norms.layers for h in L.heads)
    cert = rec["certified_norms"]
    assert cert["kind"] == "certified interval" and cert["source"] == "transcover.norms.measure_model"
    for L, row in zip(spec.layers, cert["layers"]):
        a = L.attention
        for h in range(a.n_heads):
            Wq, Wk, Wv, Wo = (torch.as_tensor(x, dtype=torch.float64) for x in a.head(h))
            lo, up = row["W_KQ"][h]
            assert lo <= a.softmax_scale * _svd(Wq @ Wk.T) <= up
            lo, up = row["W_OV"][h]
            assert lo <= _svd(Wv @ Wo) <= up
        assert row["W_1"][0] <= _svd(torch.as_tensor(L.ffn.W_1)) <= row["W_1"][1]
    # certified upper ends never below the exact per-step columns (same forward weights)
    for g in mon.groups:
        assert rec[f"sigma.{g}"] <= rec[f"certified.{g}"] * (1 + 1e-12)
    # and the forward weights hold the caps' values: the power-iteration cap is near its radius
    assert rec["certified.OV"] <= 0.3 * 1.5
    # JSONL keeps the per-layer intervals; the CSV has the group columns
    back = read_history(tmp_path / "h.jsonl")[0]
    assert back["certified_norms"] == cert
    header = (tmp_path / "h.csv").read_text().splitlines()[0].split(",")
    assert {f"certified.{g}" for g in mon.groups} <= set(header) and "certified_norms" not in header


def test_uncertified_steps_leave_the_columns_empty_and_cost_nothing():
    model = _model()
    mon = TrainingMonitor(model)
    rec = mon.log(step=1)
    assert all(rec[f"certified.{g}"] is None for g in mon.groups) and "certified_norms" not in rec
    assert math.isfinite(rec["sigma.KQ"])
