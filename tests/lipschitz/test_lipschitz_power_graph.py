"""``jacobian_operator_norm`` on one forward graph (Note [one forward graph]) gives the floats of the power iteration
built from ``torch.autograd.functional.jvp`` / ``vjp`` anew at every step, its form before: the same estimate and
the same direction, bit for bit, on MiniLM's components, a causal GPT-2 layer and functions without a Jacobian."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.functional import jvp as _jvp
from torch.autograd.functional import vjp as _vjp

from transcover.lipschitz import jacobian_operator_norm
from transcover.model import load
from transcover.model._functional import attention_forward, layer_forward


def _reference(fn, X, *, metric, n_iter, seed):  # noqa: ANN001, ANN202
    """The power iteration as it stood before: every jvp and vjp re-runs ``fn``."""
    X = X.detach().double()
    g = torch.Generator().manual_seed(seed)
    V = torch.randn(X.shape, generator=g, dtype=torch.float64)
    best = 0.0
    if metric == "fro":
        V = V / V.norm()
        for _ in range(n_iter):
            JV = _jvp(fn, X, V)[1]
            best = max(best, float(JV.norm()))
            V = _vjp(fn, X, JV)[1]
            nv = V.norm()
            if nv == 0:
                break
            V = V / nv
        return best, V
    V = V / V.norm(dim=-1, keepdim=True)
    for _ in range(n_iter):
        JV = _jvp(fn, X, V)[1]
        rows = JV.norm(dim=-1)
        t = int(rows.argmax())
        best = max(best, float(rows[t]))
        w = torch.zeros_like(JV)
        w[t] = JV[t] / max(float(rows[t]), 1e-300)
        G = _vjp(fn, X, w)[1]
        V = G / torch.clamp(G.norm(dim=-1, keepdim=True), min=1e-300)
    return best, V


@pytest.fixture(scope="module")
def minilm():
    return load(None).to_torch(torch.float64)


def _functions(spec):  # noqa: ANN001, ANN202
    L = spec.layers[2]
    return {"layer": lambda Z: layer_forward(L, Z), "attention": lambda Z: attention_forward(L.attention, Z),
            "norm": lambda Z: L.norm_ffn(Z), "constant": lambda Z: torch.ones_like(Z),
            "linear": lambda Z: 3.0 * Z, "unused": lambda Z: torch.zeros_like(Z) * Z.sum().detach()}


@pytest.mark.parametrize("metric", ["fro", "2,inf"])
@pytest.mark.parametrize("name", ["layer", "attention", "norm", "constant", "linear", "unused"])
def test_one_graph_is_the_functional_iteration_bit_for_bit(minilm, name, metric):
    fn = _functions(minilm)[name]
    g = torch.Generator().manual_seed(11)
    X = torch.randn(6, minilm.d_model, generator=g, dtype=torch.float64) * 1.7
    for seed in (0, 4):
        want = _reference(fn, X, metric=metric, n_iter=5, seed=seed)
        got = jacobian_operator_norm(fn, X, metric=metric, n_iter=5, seed=seed)
        assert got[0] == want[0]
        assert torch.equal(got[1], want[1])


def test_a_causal_gpt2_layer_too(tmp_path):
    import transformers
    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, n_positions=16, vocab_size=50)
    torch.manual_seed(0)
    transformers.GPT2Model(cfg).save_pretrained(tmp_path)
    spec = load(str(tmp_path)).to_torch(torch.float64)
    L = spec.layers[0]
    X = torch.randn(5, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for metric in ("fro", "2,inf"):
        want = _reference(lambda Z: layer_forward(L, Z), X, metric=metric, n_iter=4, seed=1)
        got = jacobian_operator_norm(lambda Z: layer_forward(L, Z), X, metric=metric, n_iter=4, seed=1)
        assert got[0] == want[0] and torch.equal(got[1], want[1])
