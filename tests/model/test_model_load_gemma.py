"""Gemma 1/2/3 (text) and OLMo 2 through their adapters, against HF (transformers 5), random weights.

HF reference points, ``m = <Family>ForCausalLM`` in float64, eager attention:
  model      <-> ``m.model(inputs_embeds=X).last_hidden_state`` (HF's RMSNorms compute in float32 --
                 ``x.float()`` in GemmaRMSNorm, ``.to(float32)`` in Olmo2RMSNorm -- as do its rotary
                 module and eager softmax, so float32's tolerance, as the reference's precision dictates)
  embedding  <-> ``m.model.embed_tokens(ids)``: Gemma's scaled embedding, compared exactly
Tiny configs (d=32, 4 query / 2 key-value heads of head_dim 12, 4 layers) exercise every feature:
sandwich norms, soft-capping, query_pre_attn_scalar, alternating windows, Gemma 3's q/k norms and
per-layer RoPE bases (with linear scaling on the global layers), OLMo 2's whole-projection q/k norm.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import randomize

from transcover import InputError, UnsupportedArchitectureError
from transcover.model import load, transformer_forward

D, H, H_KV, DH, DFF, L, T, V = 32, 4, 2, 12, 48, 4, 9, 64
FAMILIES = ("gemma", "gemma2", "gemma3", "olmo2")


def _model(tm, family: str):
    common = dict(hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=H_KV, head_dim=DH,
                  intermediate_size=DFF, vocab_size=V, max_position_embeddings=64, attn_implementation="eager",
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "gemma":
        return tm.GemmaForCausalLM(tm.GemmaConfig(**common))
    if family == "gemma2":
        return tm.Gemma2ForCausalLM(tm.Gemma2Config(**common, sliding_window=4, query_pre_attn_scalar=20,
                                                    attn_logit_softcapping=3.0, final_logit_softcapping=5.0))
    if family == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}}
        return tm.Gemma3ForCausalLM(tm.Gemma3TextConfig(**common, sliding_window=4, query_pre_attn_scalar=20,
                                                        sliding_window_pattern=2, rope_parameters=rope))
    return tm.Olmo2ForCausalLM(tm.Olmo2Config(**common))


@pytest.fixture(scope="module")
def models(tmp_path_factory, transformers_mod):
    out = {}
    for k, family in enumerate(FAMILIES):
        torch.manual_seed(k)
        m = randomize(_model(transformers_mod, family), seed=10 + k).double().eval()
        path = tmp_path_factory.mktemp(family)
        m.save_pretrained(path)
        out[family] = (m, path)
    return out


@pytest.mark.parametrize("via", ["directory", "module"])
@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_matches_hf(models, family, via, assert_close):
    m, path = models[family]
    spec = load(path) if via == "directory" else load(m)
    assert spec.arch == ("olmo2" if family == "olmo2" else "gemma") and spec.n_layers == L and not spec.warnings
    X = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = m.model(inputs_embeds=X).last_hidden_state
    got = transformer_forward(spec, X)
    assert_close(got, ref, L * DFF, torch.float32, what=f"{family} model")
    # the input is the scaled embedding (Gemma), read exactly as HF embeds token ids
    ids = torch.tensor([[1, 5, 7, 63, 0]])
    with torch.no_grad():
        emb = m.model.embed_tokens(ids)
    assert torch.equal(torch.as_tensor(spec.embeddings["token_embedding"])[ids], emb)


def test_gemma_features_are_read(models):
    g1, g2, g3 = (load(models[f][1]) for f in ("gemma", "gemma2", "gemma3"))
    hf = models["gemma"][0].model
    a1 = g1.layers[0]
    # (1 + gamma): the spec's gain is one plus the stored weight
    assert torch.equal(torch.as_tensor(a1.norm_attn.weight), 1.0 + hf.layers[0].input_layernorm.weight.detach())
    assert a1.post_norm_attn is None and a1.attention.scale is None and a1.ffn.activation.value == "gelu_tanh"
    assert g1.config["embedding_scale"] == float(np.float32(math.sqrt(D)))
    assert [la.attention.window for la in g2.layers] == [4, None, 4, None]
    lay = g2.layers[1]
    assert lay.post_norm_attn is not None and lay.post_norm_ffn is not None
    assert lay.attention.softcap == 3.0 and lay.attention.scale == pytest.approx(20 ** -0.5, rel=1e-15)
    assert g2.config["final_logit_softcapping"] == 5.0
    # Gemma 3: sliding layers rotate with base 100, global ones with base 1000 scaled linearly by 2
    local, glob = g3.layers[0].attention, g3.layers[1].attention
    assert local.window == 4 and glob.window is None and local.q_norm is not None
    assert local.rope.theta == 100.0 and local.rope.inv_freq_values is None
    inv = 1000.0 ** (-np.arange(0, DH, 2) / DH) / 2.0
    assert np.allclose(glob.rope.inv_freq_values, inv, rtol=1e-15, atol=0)


def test_the_offset_and_the_post_norms_matter(models):
    """Without the (1 + gamma) offset or without the sandwich norms the spec is another function."""
    m, path = models["gemma2"]
    spec = load(m)
    X = torch.randn(1, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    base = transformer_forward(spec, X)

    def minus_one(n):
        return replace(n, weight=n.weight - 1.0)

    no_offset = replace(spec, layers=[replace(la, norm_attn=minus_one(la.norm_attn)) for la in spec.layers])
    no_post = replace(spec, layers=[replace(la, post_norm_attn=None, post_norm_ffn=None) for la in spec.layers])
    for other in (no_offset, no_post):
        assert float((transformer_forward(other, X) - base).abs().max()) > 1e-2


def test_olmo2_layout(models):
    spec = load(models["olmo2"][1])
    lay = spec.layers[0]
    a = lay.attention
    assert lay.norm_attn.kind.value == "none" and lay.norm_ffn.kind.value == "none"
    assert a.qk_norm_scope == "all" and tuple(a.q_norm.weight.shape) == (H * DH,) and tuple(a.k_norm.weight.shape) == (H_KV * DH,)


def test_refusals(models, transformers_mod):
    from transcover.model._adapters._gemma import build_gemma
    from transcover.model._sources import StateDictSource

    m, _ = models["gemma3"]
    cfg = m.config.to_dict()
    sd = m.state_dict()
    with pytest.raises(UnsupportedArchitectureError) as e:
        build_gemma(StateDictSource(sd, "g3"), {**cfg, "use_bidirectional_attention": True}, "g3")
    assert "\n" not in str(e.value) and "bidirectional" in str(e.value)
    # a Gemma 2 configuration over Gemma 1 tensors (no sandwich norms): the config contradicts the tensors
    g1, _ = models["gemma"]
    with pytest.raises(InputError, match="sandwich"):
        build_gemma(StateDictSource(g1.state_dict(), "g1"), {**g1.config.to_dict(), "model_type": "gemma2"}, "g1")


def test_windows_and_layer_types_default_as_hf(models):
    """An older config.json without layer_types: Gemma 2 alternates from layer 0, Gemma 3 windows five
    layers of six (sliding_window_pattern), as HF's config classes fill them in."""
    from transcover.model._adapters._gemma import _layer_types

    g2 = {"model_type": "gemma2", "sliding_window": 8}
    assert _layer_types(g2, "gemma2", 4, "gemma", "g2")["layer_types"] == ["sliding_attention", "full_attention"] * 2
    g3 = _layer_types({"model_type": "gemma3_text", "sliding_window": 8}, "gemma3_text", 7, "gemma", "g3")
    g3 = g3["layer_types"]
    assert g3 == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "olmo2"])
def test_certified_intervals_enclose_float64_svd(models, family):
    from transcover.model._functional import apply_rope
    from transcover.norms import analyze_spec
    from transcover.norms._rope_sup import rope_offsets

    spec = load(models[family][0]).to_torch(torch.float64)
    # Gemma 3: a sliding and a global layer (their rotations differ); one layer elsewhere (analyze's
    # supremum over relative positions costs ~1 s a layer)
    spec = replace(spec, layers=list(spec.layers)[:2 if family == "gemma3" else 1])
    res = analyze_spec(spec, embeddings=False)
    eps = np.finfo(np.float64).eps

    def n2(M) -> float:
        return float(np.linalg.svd(np.asarray(M.detach().double()), compute_uv=False)[0])

    for got, lay in zip(res.layers, spec.layers):
        a, f = lay.attention, lay.ffn
        for h, hn in enumerate(got.heads):
            Wq, Wk, Wv, Wo = (t.double() for t in a.head(h))
            for delta in rope_offsets(a.rope.max_position).tolist()[:6] + [0, 3, 11, a.rope.max_position - 1]:
                rot = apply_rope(Wq, a.rope, torch.full((Wq.shape[0],), float(delta), dtype=torch.float64))
                assert n2(a.softmax_scale * rot @ Wk.T) <= hn.B_KQ.upper * (1 + 10 * D * eps)
            ov = n2(Wv @ Wo)
            assert hn.B_V.lower <= ov * (1 + 10 * D * eps) <= hn.B_V.upper * (1 + 20 * D * eps)
        for key, W in (("B_W1", f.W_1), ("B_W2", f.W_2)):
            iv, exact = getattr(got, key), n2(W)
            assert iv.lower <= exact * (1 + 10 * DFF * eps) and iv.upper >= exact * (1 - 10 * DFF * eps)


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3", "olmo2"])
def test_bounds_and_g3_coefficients(models, family):  # q/k norms: G.3 through the split scores (F23)
    """Every family gets finite global bounds and G.3 coefficients (the refusal branch this test once had was dead
    since F23 covered q/k norms: every case took the other branch, stop 40's test audit)."""
    from transcover.lipschitz import lipschitz_bounds, perturbation_coefficients

    spec = load(models[family][0])
    b = lipschitz_bounds(spec, radius=1.0)
    assert math.isfinite(b.upper.value)
    if family != "gemma":  # the post norms cap every branch's output: radii grow by max|gain| sqrt(d) per branch
        assert all(s.radius_out <= s.radius_in + 20 * math.sqrt(D) for s in b.stages if s.name in ("attention", "ffn"))
    entries = perturbation_coefficients(spec).entries
    assert entries and all(math.isfinite(e.coefficient) for e in entries)
    assert family == "gemma" or any(e.role.startswith("post_norm_") for e in entries)


def test_support_table_lists_the_families():
    from transcover.model._adapters._registry import adapter_for
    from transcover.model._adapters._support import support_table

    table = support_table()
    assert "| `gemma` |" in table and "| `olmo2` |" in table and "(F26)" in table
    assert "OLMo 2" not in table.split("| `llama` |")[1].split("\n")[0]  # no longer refused under llama
    for mt in ("gemma", "gemma2", "gemma3_text", "gemma3"):
        assert adapter_for(mt)[0] == "gemma"
    assert adapter_for("olmo2")[0] == "olmo2"


@pytest.mark.parametrize("family", ["gemma2", "llama"])
def test_covering_terms_on_rmsnorm_models(models, transformers_mod, family):
    """Regression: the covering bound's terms raised "no weights found for role 'norm_attn.beta'" on
    every RMSNorm model (Llama included): an RMSNorm has no shift, so beta is fixed and not covered.
    Gemma 2's post-norm gains are covered like the other gains."""
    from transcover.covering._model_bound import model_terms

    if family == "llama":
        cfg = transformers_mod.LlamaConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                                           intermediate_size=DFF, vocab_size=V)
        spec = load(randomize(transformers_mod.LlamaForCausalLM(cfg), seed=2).double())
    else:
        spec = load(models[family][0])
    terms = model_terms(spec)[0]
    roles = {t.role for t in terms}
    assert not any(r.endswith(".beta") for r in roles) and "norm_attn.gamma" in roles
    if family == "gemma2":
        assert {"post_norm_attn.gamma", "post_norm_ffn.gamma"} <= roles
        assert all(t.group == "attention" for t in terms if t.role.startswith("post_norm_attn"))


def test_embedding_scale_is_rounded_as_hf():
    """HF multiplies by ``tensor(sqrt(d))`` (a float32 buffer) cast to the weights' dtype: the
    adapter's normaliser is the same number for every stored dtype."""
    from transcover.model._adapters._gemma import round_to_dtype

    for d in (32, 2048, 2304, 3072, 3840, 5376):
        buf = torch.tensor(d ** 0.5)
        assert round_to_dtype(round_to_dtype(d ** 0.5, "float32"), "float32") == float(buf)
        for name, dt in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            assert round_to_dtype(round_to_dtype(d ** 0.5, "float32"), name) == float(buf.to(dt)), (d, name)


def test_gemma3_multimodal_checkpoint_reads_its_text_tower(transformers_mod, tmp_path, assert_close):
    tc = dict(hidden_size=D, num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=H_KV, head_dim=DH,
              intermediate_size=DFF, vocab_size=300, sliding_window=4, query_pre_attn_scalar=20)
    vc = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
    cfg = transformers_mod.Gemma3Config(text_config=tc, vision_config=vc, mm_tokens_per_image=4, image_token_index=299,
                                        boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    m = randomize(transformers_mod.Gemma3ForConditionalGeneration(cfg), seed=5).double().eval()
    m.save_pretrained(tmp_path)
    X = torch.randn(1, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = m.model.language_model(inputs_embeds=X).last_hidden_state
    for src in (m, tmp_path):
        spec = load(src)
        assert spec.arch == "gemma" and spec.n_layers == 2 and not spec.warnings
        assert_close(transformer_forward(spec, X), ref, 2 * DFF, torch.float32, what="gemma3 text tower")


def test_gemma3_scaling_only_global_layers_lengthens_every_layers_offsets():
    """Dynamic NTK scaling on Gemma 3's global layers accepts sequences of factor x L0 tokens; the
    sliding layers' B_KQ supremum must range over those offsets too (it used to stop at L0)."""
    from transcover.model._adapters._gemma import _ropes

    cfg = {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 32,
           "rope_theta": 1e6, "rope_local_base_freq": 1e4}
    ropes = _ropes(cfg, "gemma3_text", 16)
    assert ropes["full_attention"][0].dynamic == (2.0, 32)
    assert ropes["sliding_attention"][0].dynamic is None
    assert ropes["full_attention"][0].max_position == ropes["sliding_attention"][0].max_position == 64


def test_gemma3_ignores_the_soft_cap_its_attention_never_applies(models, assert_close):
    # transformers' Gemma3Attention accepts attn_logit_softcapping and never passes it on; capping the spec's
    # scores made a different function (0.49 apart at c = 1; red team 37a)
    from transcover.model._adapters._gemma import build_gemma
    from transcover.model._sources import StateDictSource

    m, _ = models["gemma3"]
    m.config.attn_logit_softcapping = 1.0
    try:
        spec = build_gemma(StateDictSource(m.state_dict(), "g3"), m.config.to_dict(), "g3")
        X = torch.randn(1, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            ref = m.model(inputs_embeds=X).last_hidden_state
    finally:
        m.config.attn_logit_softcapping = None
    assert all(la.attention.softcap is None for la in spec.layers)
    assert "does not apply it" in spec.config["attn_logit_softcapping_ignored"]
    assert_close(transformer_forward(spec, X), ref, L * DFF, torch.float32, what="gemma3 with a configured soft-cap")


@pytest.mark.parametrize("key", ["attn_logit_softcapping", "query_pre_attn_scalar"])
@pytest.mark.parametrize("bad", [float("nan"), 0.0, -5.0, float("inf"), "x", True])
def test_gemma2_refuses_a_soft_cap_or_score_scalar_that_is_not_positive(models, key, bad):
    # a NaN cap went into the spec (NaN forward, a certified bound beside it); qpas = 0 or < 0 reached x ** -0.5
    from transcover.model._adapters._gemma import build_gemma
    from transcover.model._sources import StateDictSource

    m, _ = models["gemma2"]
    with pytest.raises(InputError, match=f"{key} must be a finite number > 0") as e:
        build_gemma(StateDictSource(m.state_dict(), "g2"), {**m.config.to_dict(), key: bad}, "g2")
    assert "\n" not in str(e.value)


def test_gemma_embedding_scale_in_the_embeddings_dtype(tmp_path, transformers_mod):
    """sqrt(d) is rounded to the embedding table's dtype (HF: ``embed_scale.to(embed_tokens.weight.dtype)``), not to
    the dtype of the first tensor in the header: float32 norms listed before a bfloat16 embedding made the scale
    float32's and the certified interval of ||E sqrt(d)||_2 excluded the true value (red team 219).  A single file
    (float32 first) and shards of the same tensors give one interval, containing the float64 reference."""
    import transcover as tc
    from transcover.model import open_safetensors

    torch.manual_seed(0)
    m = _model(transformers_mod, "gemma").eval()
    for name, p in m.named_parameters():  # bf16 weights, float32 norms: a common mixed layout
        if "norm" not in name:
            p.data = p.data.to(torch.bfloat16)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    m.save_pretrained(single)
    m.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert open_safetensors(single / "model.safetensors").storage_dtype() == "float32"  # the case refuted
    emb = m.model.embed_tokens
    scale = emb.embed_scale.to(emb.weight.dtype)
    truth = torch.linalg.matrix_norm(emb.weight.double() * scale.double(), 2).item()
    ids = torch.arange(V)[None]
    with torch.no_grad():
        hf = emb(ids)[0]  # transformers' own embedding output, rounded to bfloat16
    got = []
    for path in (single, sharded):
        spec = load(path)
        assert spec.config["embedding_scale"] == scale.item() != math.sqrt(D)
        table = torch.as_tensor(spec.embeddings["token_embedding"])
        assert torch.equal(table.to(torch.bfloat16), hf)
        iv = tc.analyze(path).to_dict()["embeddings"][0]["spectral"]
        assert iv["lower"] <= truth <= iv["upper"], (path.name, iv, truth)
        got.append((iv["lower"], iv["upper"]))
    assert got[0] == got[1]
