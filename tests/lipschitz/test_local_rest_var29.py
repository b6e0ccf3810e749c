"""F81's joint spread (THEORY F81a-c) read once per head (mend29): ``_rest_rows`` asks ``head_rest_sups`` for the
model-space and the value-space gaps of a head together, and ``spread.var`` is formed once for both, in the same
floats as one ``head_rest_sup`` per gap."""

from __future__ import annotations

import torch

from test_local_attn_rest import _case
from transcover.lipschitz import _local_attn_rest
from transcover.lipschitz._local_attn_rest import (
    JointSpread, _head_factors, _joint_spread, head_rest_sup, head_rest_sups, joint_rest_rows,
)


def test_spread_var_once_per_head(monkeypatch):
    data = _case(13, 30.0)[3]
    E = torch.tensor([0.0, 0.02, 0.02], dtype=torch.float64)
    calls = []
    var = JointSpread.var
    monkeypatch.setattr(JointSpread, "var", lambda self, lo, hi: calls.append(1) or var(self, lo, hi))
    joint_rest_rows(data, 0.05, E, 1e-3, 1e-4)
    assert len(calls) == data.S.shape[0]  # one per head (was two: the gaps through W_O and before it)


def test_shared_parts_give_the_same_floats():
    for seed, kw in ((13, dict(qscale=30.0)), (7, dict(causal=True, t=4)), (5, dict(xscale=2.0**300))):
        data = _case(seed, **kw)[3]
        x = kw.get("xscale", 1.0)
        e = torch.linspace(0.0, 0.03, data.S.shape[1], dtype=torch.float64) * x + 0.05 * x * 1e-3
        for h in range(data.S.shape[0]):
            U, sig, lo, hi, mV, gap, gapv, key, cross = _head_factors(data, h, 0.05 * x, e, e + 1e-4 * x)
            for sp in (None, _joint_spread(data, h, 0.05 * x, e, lo, hi, key, cross)):
                pairs = ((gap, data.nO[h] * mV), (gapv, mV))
                together = head_rest_sups(lo, hi, U, sig, pairs, sp)
                for got, (g, W) in zip(together, pairs):
                    assert torch.equal(got, head_rest_sup(lo, hi, U, sig, g, W, sp))
                    assert torch.all(torch.isfinite(got)) and torch.any(got > 0)  # not a vacuous comparison
    assert _local_attn_rest.head_rest_sups is head_rest_sups
