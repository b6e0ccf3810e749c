"""L2 self-attention (Kim et al. 2021): forward against a naive loop, the reference model, and Thm 3.2."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lipschitz_testkit  # noqa: F401  (thread setting)
from transcover.lipschitz import l2_attention_forward, l2_attention_lipschitz, lipschitz_bounds, phi_inverse
from transcover.lipschitz._empirical import _lower
from transcover.lipschitz._weights import spectral
from transcover.model import ReferenceConfig, ReferenceTransformer, reference_spec


def _naive(X, W_Q, W_V, W_O):
    T, d = X.shape
    H, _, dh = W_Q.shape
    out = torch.zeros(T, d, dtype=X.dtype)
    for h in range(H):
        logits = torch.empty(T, T, dtype=X.dtype)
        for i in range(T):
            for j in range(T):
                logits[i, j] = -((X[i] @ W_Q[h] - X[j] @ W_Q[h]) ** 2).sum() / math.sqrt(dh)
        P = torch.softmax(logits, dim=-1)
        A = W_Q[h] @ W_Q[h].T / math.sqrt(dh)
        out += P @ X @ A @ W_V[h] @ W_O[h]
    return out


def test_forward_matches_naive_loop():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(5, 6, generator=g, dtype=torch.float64)
    W_Q, W_V = (torch.randn(2, 6, 3, generator=g, dtype=torch.float64) for _ in range(2))
    W_O = torch.randn(2, 3, 6, generator=g, dtype=torch.float64)
    torch.testing.assert_close(l2_attention_forward(X, W_Q, W_V, W_O), _naive(X, W_Q, W_V, W_O),
                               rtol=0, atol=1e-12)
    batched = l2_attention_forward(torch.stack([X, 2 * X]), W_Q, W_V, W_O)
    torch.testing.assert_close(batched[1], _naive(2 * X, W_Q, W_V, W_O), rtol=0, atol=1e-11)


def test_reference_model_with_l2_attention_runs_and_is_bounded():
    torch.manual_seed(1)
    model = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=2, d_ff=12, attention="l2")).double()
    X = torch.randn(3, 4, 8, dtype=torch.float64)
    assert model(X).shape == (3, 1)
    spec = reference_spec(model)
    from transcover.lipschitz._empirical import stage_functions

    with torch.no_grad():
        torch.testing.assert_close(stage_functions(spec)[(-2, "network")](X, None), model.features(X),
                                   rtol=0, atol=1e-12)
    b = lipschitz_bounds(spec, radius=100.0, seq_len=4)
    b_small = lipschitz_bounds(spec, radius=1.0, seq_len=4)
    assert b.upper.value == b_small.upper.value  # Pi_norm first: the radius does not matter
    with pytest.raises(Exception, match="seq_len"):
        lipschitz_bounds(spec, radius=1.0)


def test_phi_inverse_table():
    table = {2: 2.1139, 4: 3.4142, 16: 6.5338, 64: 10.2285, 256: 14.3455, 1024: 18.7595, 4096: 23.3822}
    for N, v in table.items():
        assert abs(4 * phi_inverse(N - 1.0) + 1 - v) < 5e-5
    x = phi_inverse(7.0)
    assert abs(x * math.exp(x + 1) - 7.0) < 1e-12


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), N=st.integers(2, 6), H=st.integers(1, 3), scale=st.floats(0.3, 3.0),
       radius=st.floats(0.5, 20.0), metric=st.sampled_from(["fro", "2,inf"]))
def test_kim_bound_dominates_adversarial_search(seed, N, H, scale, radius, metric):
    g = torch.Generator().manual_seed(seed)
    d, dh = 4, 2
    W_Q = torch.randn(H, d, dh, generator=g, dtype=torch.float64) * scale / 2
    W_V = torch.randn(H, d, dh, generator=g, dtype=torch.float64) / 2
    W_O = torch.randn(H, dh, d, generator=g, dtype=torch.float64) / 2
    upper = l2_attention_lipschitz([spectral(w) for w in W_Q], [spectral(w) for w in W_V],
                                   spectral(W_O.reshape(-1, d)), dh, N, metric=metric)
    fn = lambda X, t: l2_attention_forward(X, W_Q, W_V, W_O)  # noqa: E731
    lower = _lower(fn, T=N, d=d, radius=radius, metric=metric, sigma_min=0.0, n_samples=3, n_steps=20,
                   n_power=8, seed=seed)
    assert 0 < lower <= upper
