"""``analyze`` is a view of ``measure_model``'s engine (issue 11): one certificate per matrix.

Before, ``analyze_spec`` measured every head again with its own batched-Gram route, beside the
``ModelNorms`` that ``bound``, ``lipschitz`` and ``report`` read (``report`` measured the model twice),
and with RoPE its ``_kq_head`` certified ``W_Q^h``, ``W_K^g`` once more.  Now every spectral interval
``analyze`` shows is the one in ``result.norms``, and each matrix is certified once (counted).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import transcover.norms as norms_pkg
import transcover.norms._spectral as spectral_mod
from transcover.norms import analyze_spec, measure_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lipschitz"))
from lipschitz_testkit import random_spec  # noqa: E402


def _key(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a.detach() if hasattr(a, "detach") else a, dtype=np.float64))
        h.update(str(a.shape).encode() + a.tobytes())
    return h.hexdigest()


@pytest.fixture
def calls(monkeypatch):
    seen: list[str] = []
    single, product = spectral_mod.spectral_norm_interval, spectral_mod.product_norm_interval

    def count_single(W, **kw):
        seen.append("W:" + _key(W))
        return single(W, **kw)

    def count_product(A, B, **kw):
        seen.append("AB:" + _key(A, B))
        return product(A, B, **kw)

    for mod in (spectral_mod, norms_pkg):
        monkeypatch.setattr(mod, "spectral_norm_interval", count_single)
        monkeypatch.setattr(mod, "product_norm_interval", count_product)
    import transcover.norms._analyze as analyze_mod

    monkeypatch.setattr(analyze_mod, "spectral_norm_interval", count_single)
    monkeypatch.setattr(analyze_mod, "product_norm_interval", count_product)
    return seen


@pytest.mark.parametrize("rope", [False, True])
def test_analyze_shows_the_model_norms_it_read_and_certifies_each_matrix_once(calls, rope):
    spec = random_spec(7, d=8, H=2, L=2, biases=not rope, rope=rope)
    result = analyze_spec(spec, embeddings=False)
    repeated = {k for k in calls if calls.count(k) > 1}
    assert not repeated, f"{len(repeated)} matrices certified more than once"
    mn = result.norms
    assert mn is not None and mn.n_layers == spec.n_layers
    for view, lm, layer in zip(result.layers, mn.layers, spec.layers):
        assert view.B_W1 == lm.W_1 and view.B_W2 == lm.W_2 and view.W_O == lm.W_O
        for hv, hm in zip(view.heads, lm.heads):
            assert hv.B_V == hm.W_OV and hv.W_V == hm.W_V
            assert hv.B_KQ == hm.W_KQ(lm.scale)  # with RoPE the sup over offsets, measured once (tidy12)
        # and the numbers are true: float64 SVD of the explicit matrices inside the intervals
        a = layer.attention
        for h, hv in enumerate(view.heads):
            Wq, Wk, Wv, Wo = (torch.as_tensor(x, dtype=torch.float64) for x in a.head(h))
            ov = float(torch.linalg.matrix_norm(Wv @ Wo, 2))
            assert hv.B_V.lower <= ov * (1 + 1e-13) and ov <= hv.B_V.upper * (1 + 1e-13)
            kq = a.softmax_scale * float(torch.linalg.matrix_norm(Wq @ Wk.T, 2))
            assert kq <= hv.B_KQ.upper * (1 + 1e-13)
    # the same engine as measure_model: identical intervals for the matrices both read
    direct = measure_model(spec)
    assert [h.W_OV for L in direct.layers for h in L.heads] == [h.W_OV for L in mn.layers for h in L.heads]
    assert [L.W_1 for L in direct.layers] == [L.W_1 for L in mn.layers]
