"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE with a shared expert, Qwen3-MoE): the decomposition's
forward, with the same top-k routing, reproduces HF's module in float64; ``analyze`` reports per-expert
and router norms as certified intervals that enclose float64 SVD; every bound that needs a Lipschitz
constant refuses in one line (THEORY F25: top-k routing is discontinuous).

HF reference points (transformers 5): model <-> ``XModel(inputs_embeds=X).last_hidden_state``; the
router's softmax is computed in float32 (``router_logits.float()``) and the RMSNorms' variance too,
so float32's tolerance.
"""

from __future__ import annotations

import json

import pytest
import torch

from transcover import UnsupportedArchitectureError, WeightError
from transcover.cli import main
from transcover.model import MoESpec, load, transformer_forward
from transcover.norms import analyze_spec

D, FF, E, K, T = 16, 24, 4, 2, 7


def _configs(tm):
    common = dict(experts_implementation="eager", hidden_size=D, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  vocab_size=32, max_position_embeddings=16, num_experts_per_tok=K)
    return {
        "mixtral": (tm.MixtralConfig(intermediate_size=FF, num_local_experts=E, **common), tm.MixtralModel),
        "qwen2_moe": (tm.Qwen2MoeConfig(intermediate_size=20, moe_intermediate_size=FF, num_experts=E,
                                        shared_expert_intermediate_size=12, norm_topk_prob=False,
                                        decoder_sparse_step=1, mlp_only_layers=[1], **common), tm.Qwen2MoeModel),
        "qwen3_moe": (tm.Qwen3MoeConfig(intermediate_size=20, moe_intermediate_size=FF, num_experts=E,
                                        norm_topk_prob=True, head_dim=8, **common), tm.Qwen3MoeModel),
        # transformers 5 saves num_experts as num_local_experts: no sign of Mixtral's renormalisation (red team 168)
        "qwen3_moe_unnormalised": (tm.Qwen3MoeConfig(intermediate_size=20, moe_intermediate_size=FF, num_experts=E,
                                                     norm_topk_prob=False, head_dim=8, **common), tm.Qwen3MoeModel),
    }


@pytest.fixture(scope="module")
def moe_models(transformers_mod, tmp_path_factory):
    from conftest import randomize

    out = {}
    for k, (cfg, cls) in _configs(transformers_mod).items():
        torch.manual_seed(0)
        model = randomize(cls(cfg), seed=4).double().eval()
        path = tmp_path_factory.mktemp(k)
        model.save_pretrained(path)
        out[k] = (model, path)
    return out


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_unnormalised"])
@pytest.mark.parametrize("via", ["module", "files"])
def test_moe_forward_matches_hf(moe_models, kind, via, assert_close):
    model, path = moe_models[kind]
    spec = load(model if via == "module" else path)
    assert spec.arch == "moe" and spec.n_layers == 2 and not spec.warnings
    moe = spec.layers[0].ffn
    assert isinstance(moe, MoESpec) and moe.n_experts == E and moe.top_k == K and moe.d_ff == FF
    assert moe.normalize_topk == (kind in ("mixtral", "qwen3_moe"))
    assert (moe.shared is not None) == (kind == "qwen2_moe")
    assert isinstance(spec.layers[1].ffn, MoESpec) != (kind == "qwen2_moe")  # mlp_only_layers=[1]: dense
    X = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(inputs_embeds=X).last_hidden_state
    assert_close(transformer_forward(spec, X), ref, FF, torch.float32, what=f"{kind} {via}")
    # the routing matters: every expert with equal weight is another function
    dense = spec.layers[0].ffn.__class__(**{**spec.layers[0].ffn.__dict__, "top_k": E, "normalize_topk": True})
    from dataclasses import replace

    other = replace(spec, layers=[replace(spec.layers[0], ffn=dense), spec.layers[1]])
    assert float((transformer_forward(other, X) - ref).abs().max()) > 1e-4


def test_per_expert_norms_are_certified_and_enclose_svd(moe_models):
    model, _ = moe_models["qwen2_moe"]
    spec = load(model)
    res = analyze_spec(spec, rtol=1e-3, embeddings=False)
    lay, moe = res.layers[0], spec.layers[0].ffn
    for e in range(E):
        for role in ("W_1", "W_2", "W_gate"):
            iv = lay.matrices[f"expert.{e}.{role}"].spectral
            exact = float(torch.linalg.matrix_norm(torch.as_tensor(getattr(moe, role)[e]).double(), 2))
            assert iv.kind.value.startswith("certified") and iv.lower <= exact <= iv.upper, (e, role)
    for name, W in (("router", moe.W_router), ("shared.W_1", moe.shared.W_1)):
        exact = float(torch.linalg.matrix_norm(torch.as_tensor(W).double(), 2))
        assert lay.matrices[name].spectral.lower <= exact <= lay.matrices[name].spectral.upper
    assert lay.B_W2.upper == max(lay.matrices[f"expert.{e}.W_2"].spectral.upper for e in range(E))
    assert any("mixture of experts" in n and "F25" in n for n in res.notes)


def test_moe_bounds_refuse_in_one_line_and_analyze_reports_experts(moe_models, tmp_path, capsys):
    model, path = moe_models["mixtral"]
    from transcover.lipschitz import lipschitz_bounds

    with pytest.raises(UnsupportedArchitectureError, match="top-k experts.*discontinuous.*F25.*dense router"):
        lipschitz_bounds(load(model))
    assert main(["lipschitz", str(path), "--no-lower", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "discontinuous" in err[0], err
    out = tmp_path / "a.json"
    assert main(["analyze", str(path), "--quiet", "--json", str(out)]) == 0
    capsys.readouterr()
    doc = json.loads(out.read_text())
    assert doc["schema"] != "transcover.analyze.per_matrix"
    text = json.dumps(doc)
    assert "expert.3.W_gate" in text and "router" in text


def test_every_bound_route_refuses_moe_in_one_line(moe_models, tmp_path, capsys):
    """G.3 against a reference, covering with a reference and the local routes took the norm of the
    stacked (E, d, d_ff) expert weights first: a ValueError, "internal error" in the CLI (red team of
    stop 36).  They refuse with F25's reason now."""
    from transcover.covering import model_bound
    from transcover.lipschitz import layer_local, network_local, perturbation_bound

    model, path = moe_models["mixtral"]
    a, b = load(model).to_torch(torch.float64), load(path).to_torch(torch.float64)
    X = torch.randn(4, a.d_model, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for call in (lambda: perturbation_bound(a, b), lambda: model_bound(a, reference=b, seq_len=16),  # 16 positions
                 lambda: layer_local(a.layers[0], X, 1e-3), lambda: network_local(a, X, 1e-3)):
        with pytest.raises(UnsupportedArchitectureError, match="mixture of experts.*F25") as e:
            call()
        assert "\n" not in str(e.value)
    assert main(["perturb", str(path), str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mixture of experts" in err[0] and "internal error" not in err[0], err


def test_a_shared_expert_without_its_gate_is_refused(moe_models, tmp_path, capsys):
    """Qwen2-MoE builds ``shared_expert_gate`` with every shared expert and scales the shared expert's output by
    ``sigmoid(gate(x))``: a checkpoint without it is another function, refused naming the tensor, not read with
    the gate left out (stop 43's note: the now-required tensor had no test of its own)."""
    from safetensors.torch import load_file, save_file

    _, path = moe_models["qwen2_moe"]
    spec = load(path)
    assert spec.layers[0].ffn.shared_gate is not None  # read from the file: the forward test checks its effect
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    key = next(k for k in tensors if k.endswith("layers.0.mlp.shared_expert_gate.weight"))
    del tensors[key]
    save_file(tensors, str(cut / "model.safetensors"))
    with pytest.raises(WeightError, match="tensor '.*layers.0.mlp.shared_expert_gate.weight' is missing") as e:
        load(cut).layers[0].ffn
    assert "\n" not in str(e.value)
    assert main(["analyze", str(cut), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "shared_expert_gate" in err[0] and "internal error" not in err[0], err
