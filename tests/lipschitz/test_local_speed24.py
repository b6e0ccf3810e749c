"""F74 (issue 12, speed24): F51a's two branches certified lazily and the per-layer forms taken once give the floats the
old code gave; the batch-independence these rely on (one token's float the same in any batch) checked directly."""

from __future__ import annotations

import math

import torch

from test_local_ffn2 import _ffn
from test_local_speed20r import _layer, _weights
from transcover.lipschitz import _local_ffn2 as f2
from transcover.lipschitz import _local_stages as st
from transcover.lipschitz._local_attention import head_norms
from transcover.lipschitz._local_ffn2 import _kappa_a, _kappa_branch, _kappa_lazy, ffn_hadamard, ffn_second_norms
from transcover.lipschitz._local_remg import first_norm_gamma
from transcover.lipschitz._local_row_weights import reweighted


def _weights_case(seed: int, scale: float, bias: float) -> tuple[dict, torch.Tensor]:
    ffn = _ffn(seed, 12, 40, scale)
    ffn.b_1.add_(bias)
    h = torch.randn(6, 12, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    return ffn_hadamard(ffn, centred=True), _weights(ffn, h @ ffn.W_1.double() + ffn.b_1.double(), 0.5)


def test_lazy_branches_give_kappa_a_and_skip_somewhere(monkeypatch):
    """``_kappa_lazy`` with F61a's branch lower bounds is ``_kappa_a`` float for float (units near 0, saturated,
    half-open), with a branch certified only where it can be the minimum: some branches skipped, and none where the
    lower bounds tie or are NaN (there both are certified: a NaN lower bound at one token, an all-zero weight row)."""
    skipped = 0
    for seed, scale, bias in ((1, 0.5, 0.0), (2, 6.0, -4.0), (3, 2.0, 3.0)):
        const, a = _weights_case(seed, scale, bias)
        a[5] = 0.0  # both branches 0: the lower bounds tie
        lows = torch.stack([_kappa_branch(const, a, b, lower=True) for b in (0, 1)])
        lows[1, 4] = math.nan
        calls = []
        monkeypatch.setattr(f2, "_kappa_branch", lambda c, x, b, lower=False: calls.append(len(x)) or
                            _kappa_branch(c, x, b, lower))
        lazy = _kappa_lazy(const, a, lows)
        monkeypatch.undo()
        assert torch.equal(lazy, _kappa_a(const, a)), (lazy, _kappa_a(const, a))
        assert sum(calls) >= len(a) + 2  # tokens 4 (NaN) and 5 (tie) certify both branches
        skipped += 2 * len(a) - sum(calls)
    assert skipped > 0


def test_per_layer_forms_are_the_per_radius_floats():
    """The row Gram's ``S1`` (after F56's per-token pick) is ``NormJac.sandwich`` of its ``S`` bit for bit, ``PostPoint``'s
    ``nIFG`` is ``first_norm_gamma`` of its ``I + F``, and F38b's ``N2`` of one token is the same float alone as in the
    batch of all tokens (what F54b/F70a read from ``FfnDrift``); post-LN layer with outlier gamma, T = 8."""
    L, X = _layer(4)
    at = st.layer_at_x(L, X.double(), float(head_norms(L.attention)["O"]))
    gram = st.attention_row_gram(at)
    gram, pt = reweighted(at, gram, st.post_point(at, gram))
    S, e = at.n1.sandwich(gram.S, gram.err)
    assert torch.equal(gram.S1[0], S) and torch.equal(gram.S1[1], e)
    assert torch.equal(pt.nIFG, first_norm_gamma(at, pt.IF))
    const = ffn_hadamard(L.ffn, centred=True)
    every = ffn_second_norms(const, at.z, at.ez)
    assert all(torch.equal(ffn_second_norms(const, at.z[i:i + 1], at.ez[i:i + 1]), every[i:i + 1]) for i in range(at.T))
