"""Issue 12 (speed branch): the rows route's caches and blocked forms give the floats of forming everything afresh --
F54b/F70a's radius-free token forms, F72a's radius-free Schur terms, the weight-free diagonal blocks of the row Gram
and ``_weighted_lmax``'s blocked ``(M + M^T)/2``."""

from __future__ import annotations

import torch

from test_local_speed24 import _weights_case
from test_local_speed20r import _layer
from transcover.lipschitz import _local_ffn2 as f2
from transcover.lipschitz import _local_ffn_reach as fr
from transcover.lipschitz import _local_stages as st
from transcover.lipschitz._local_attention import head_norms
from transcover.lipschitz._local_ffn2 import ffn_hadamard, ffn_split_constants
from transcover.lipschitz._local_rows import _diag_blocks


def test_weighted_sym_is_the_whole_matrix_formed_at_once(monkeypatch):
    """``_weighted_sym`` (blocks of rows, odd block sizes and a last partial block) is ``fl(fl(M^T + M) 0.5)`` of the
    whole ``M = fl(fl(a_k G_kl) a_l)`` bit for bit, also with zero and huge weights."""
    for seed, scale, bias in ((1, 0.5, 0.0), (2, 6.0, -4.0)):
        const, a = _weights_case(seed, scale, bias)
        a[0] = 0.0
        a[1, 3] = 1e150
        G = const["H"]
        M = a[:, :, None] * G[None]
        M.mul_(a[:, None, :])
        want = M.transpose(1, 2).contiguous().add_(M).mul_(0.5)
        for block in (1, 7, 32, 1000):
            monkeypatch.setattr(f2, "SYM_BLOCK", block)
            assert torch.equal(f2._weighted_sym(G, a), want)


def _reach_case(seed: int):  # noqa: ANN202
    L, X = _layer(seed)
    at = st.layer_at_x(L, X.double(), float(head_norms(L.attention)["O"]))
    gram = st.attention_row_gram(at)
    const = ffn_hadamard(L.ffn, centred=True)
    n1 = L.ffn.W_1.double().norm(dim=0)
    Sa, ea = gram.S1
    remH = torch.full((at.T,), 0.01, dtype=torch.float64)
    return at, gram, const, n1, Sa, ea, remH


def test_reach_caches_give_the_fresh_floats():
    """F54b's remainder, F70a's drift and F72a's Schur bounds at two radii, with the caches warm (tokens in another
    order and batch), are the floats of the same calls with the caches emptied before each."""
    at, gram, const, n1, Sa, ea, remH = _reach_case(3)
    split = ffn_split_constants(const, rank=3, rank2=3)
    idx = torch.arange(at.T)

    def calls(r: float, order: torch.Tensor) -> list:
        rh = torch.full((at.T,), 4 * r, dtype=torch.float64)
        a = (const, n1, at.z[order], Sa[order], ea[order], gram.wsum[order], r, remH[order], rh[order], at.ez[order])
        return [fr.ffn_reach_remainder(*a), *fr.ffn_reach_drift(*a), *fr.ffn_reach_drift_schur(*a, split=split),
                *fr.ffn_reach_drift_schur(*a)]

    fresh = {}
    for r in (1e-3, 1e-1):
        fresh[r] = []
        for i in range(at.T):
            fr._FORMS_CACHE.clear()
            fr._SCHUR_CACHE.clear()
            fresh[r].append(calls(r, idx[i:i + 1]))
    for r in (1e-1, 1e-3):
        for order in (idx, idx.flip(0), idx[1::2]):
            got = calls(r, order)
            for k, i in enumerate(order.tolist()):
                assert all(torch.equal(g[k:k + 1], f) for g, f in zip(got, fresh[r][i])), (r, i)
    assert len(fr._SCHUR_CACHE) > 0 and len(fr._FORMS_CACHE) > 0


def test_diag_terms_are_formed_once_and_are_the_blocks():
    """``attention_row_gram`` with other weights reads the same ``_diag_terms`` object, whose blocks are
    ``_diag_blocks``' floats and whose ``B B^T`` is their product."""
    at, gram, *_ = _reach_case(4)
    terms = st._diag_terms(at)
    w = torch.rand(at.T, at.T, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    st.attention_row_gram(at, w)
    assert st._diag_terms(at) is terms
    Bii, eB = _diag_blocks(at.heads, at.Wo_all, at.D1, at.T, at.d, at.layer.attention.softmax_scale, at.eD1, None)
    assert torch.equal(terms[0], Bii) and torch.equal(terms[1], eB)
    assert torch.equal(terms[2], Bii @ Bii.transpose(1, 2))
