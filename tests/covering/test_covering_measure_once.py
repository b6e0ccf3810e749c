"""``transcover bound`` measures every matrix once (issue 11): the certificate calls are counted.

Before issue 11 the Lipschitz chain (``lipschitz._weights.spec_norms``) and the covering terms
(``covering._model_bound._layer_role_norms``) each certified ``W_KQ^h``, ``W_OV^h``, ``W_1`` and
``W_2`` again (6H + 5 certificates per layer instead of 4H + 3).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import transcover.norms as norms_pkg
import transcover.norms._spectral as spectral_mod
from transcover.covering import BoundConfig, model_bound
from transcover.model import load


def _key(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a.detach().cpu() if hasattr(a, "detach") else a, dtype=np.float64))
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


@pytest.fixture
def certificate_calls(monkeypatch):
    """Every call of the two spectral certificates, by the matrix (or factor pair) it certified."""
    calls: list[str] = []
    single, product = spectral_mod.spectral_norm_interval, spectral_mod.product_norm_interval

    def count_single(W, **kw):
        calls.append("W:" + _key(W))
        return single(W, **kw)

    def count_product(A, B, **kw):
        calls.append("AB:" + _key(A, B))
        return product(A, B, **kw)

    for mod in (spectral_mod, norms_pkg):  # the package name (old call sites) and the module's own
        monkeypatch.setattr(mod, "spectral_norm_interval", count_single)
        monkeypatch.setattr(mod, "product_norm_interval", count_product)
    return calls


def _matrices_the_bound_reads(spec) -> int:
    """Per layer: W_KQ^h, W_OV^h, W_Q^h per query head, W_V^g per key/value head, the stacked W_O,
    the FFN's matrices; plus an MLP head's weights."""
    n = 0
    for layer in spec.layers:
        a, f = layer.attention, layer.ffn
        n += 3 * a.n_heads + a.n_kv_heads + 1 + sum(W is not None for W in (f.W_1, f.W_2, f.W_gate))
    return n + (0 if spec.head is None else len(spec.head.weights))


def test_bound_on_minilm_certifies_each_matrix_once(certificate_calls):
    """The call ``transcover bound`` makes: ``model_bound(spec, BoundConfig from the command line)``."""
    spec = load(None).to_torch()
    result = model_bound(spec, BoundConfig())
    assert result.log_log_N > 0
    repeated = {k for k in certificate_calls if certificate_calls.count(k) > 1}
    assert not repeated, f"{len(repeated)} matrices certified more than once"
    assert len(certificate_calls) == _matrices_the_bound_reads(spec) == 6 * (3 * 12 + 12 + 1 + 2)
