"""In-memory modules whose forward is not the function of their stored tensors (red team 210).

Each was certified as something else, silently: pruned / parametrised biases read as absent (``perturb``
certified 0.0 where outputs differ by 4), a LoRA ``nn.Linear`` subclass read as its base weight, forward hooks
ignored, a spec that followed in-place training of the module it was loaded from (a live view).  Now: refused in
one line naming the submodule and the fix, or the spec is a snapshot, and ``perturb``'s certified bound is at
least the measured difference.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize, prune

import transcover
from transcover import InputError, TranscoverWarning, UnsupportedArchitectureError
from transcover.model import ReferenceConfig, ReferenceTransformer, load, spec_from_module

D, H, DFF = 16, 4, 32


def _encoder(n_layers: int = 1, seed: int = 0, dropout: float = 0.0) -> nn.TransformerEncoder:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(D, H, DFF, dropout, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False).double().eval()


def _unit_tokens(seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    X = torch.randn(1, 8, D, dtype=torch.float64)
    return X / X.norm(dim=-1, keepdim=True)  # radius 1


def _measured(a: nn.Module, b: nn.Module) -> float:
    X = _unit_tokens()
    with torch.enable_grad():  # the module's own _sa_block/_ff_block path, not the fused fast path
        return float((a(X) - b(X)).detach().norm(dim=-1).max())


def _refusal(fn, *args, match: str, **kwargs) -> str:
    with pytest.raises(UnsupportedArchitectureError, match=match) as err:
        fn(*args, **kwargs)
    line = str(err.value)
    assert "\n" not in line
    return line


class _Times5(nn.Module):
    def forward(self, W):
        return 5 * W


# -- item 1: parametrisations and pruning ----------------------------------------------------------------------


def test_pruned_bias_is_refused_where_perturb_certified_zero():
    def pruned(value: float) -> nn.TransformerEncoder:
        m = _encoder()
        with torch.no_grad():
            m.layers[0].linear2.bias.fill_(value)
        prune.identity(m.layers[0].linear2, "bias")  # a mask of ones: the forward still adds the bias
        return m

    A, B = pruned(0.0), pruned(1.0)
    assert _measured(A, B) > 3.0  # the outputs differ by 4 (red team 210: certified 0.0)
    line = _refusal(transcover.perturb, A, B, samples=1, steps=2, match=r"layers\.0\.linear2\.bias is pruned")
    assert "torch.nn.utils.prune.remove(model.get_submodule('layers.0.linear2'), 'bias')" in line
    for m in (A, B):  # the advice works: after prune.remove the certified bound covers the difference
        prune.remove(m.layers[0].linear2, "bias")
    r = transcover.perturb(A, B, samples=1, steps=2)
    assert r.bound.total.value >= _measured(A, B)


@pytest.mark.parametrize("apply", [
    pytest.param(lambda m: prune.identity(m.layers[0].norm1, "weight"), id="prune-norm-gain"),
    pytest.param(lambda m: prune.l1_unstructured(m.layers[0].self_attn, "in_proj_weight", 0.5), id="prune-in-proj"),
    pytest.param(lambda m: parametrize.register_parametrization(m.layers[0].linear1, "bias", _Times5()),
                 id="parametrize-bias"),
    pytest.param(lambda m: torch.nn.utils.parametrizations.spectral_norm(m.layers[0].linear1), id="spectral-norm"),
    pytest.param(lambda m: torch.nn.utils.spectral_norm(m.layers[0].linear1), id="old-spectral-norm"),
])
def test_every_load_path_refuses_rewritten_tensors(apply):
    m = _encoder()
    apply(m)
    _refusal(load, m, match=r"^layers\.0\.\S+ is (pruned|parametrised|reparametrised).*first, so the stored weights "
                            r"are the ones the forward uses$")
    _refusal(spec_from_module, m, match="stored weights are the ones the forward uses")
    _refusal(load, m, roles={"layers": "layers.{i}."}, match="stored weights are the ones the forward uses")


def test_hf_parametrised_bias_names_the_reason_not_a_missing_tensor(transformers_mod):
    cfg = transformers_mod.BertConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                                      intermediate_size=DFF, vocab_size=32, max_position_embeddings=8)
    model = transformers_mod.BertModel(cfg).eval()
    parametrize.register_parametrization(model.encoder.layer[0].intermediate.dense, "bias", _Times5())
    line = _refusal(load, model, match=r"encoder\.layer\.0\.intermediate\.dense\.bias is parametrised")
    assert "missing" not in line and "remove_parametrizations" in line


def test_a_capped_reference_transformer_is_still_read_exactly():
    """``reference_spec`` reads a parametrised weight as the value the forward uses: not refused there."""
    model = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16)).double().eval()
    parametrize.register_parametrization(model.blocks[0], "W_1", _Times5())
    spec = load(model)
    assert torch.equal(torch.as_tensor(spec.layers[0].ffn.W_1), model.blocks[0].W_1.detach())


# -- item 2: subclasses and tensors no role reads ----------------------------------------------------------------


class _LoRALinear(nn.Linear):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.lora_A = nn.Parameter(torch.randn(4, self.in_features))
        self.lora_B = nn.Parameter(torch.randn(self.out_features, 4))

    def forward(self, x):
        return super().forward(x) + x @ self.lora_A.T @ self.lora_B.T


class _DoubledFFN(nn.TransformerEncoderLayer):
    def _ff_block(self, x):
        return 2 * super()._ff_block(x)


class _TripledEncoder(nn.TransformerEncoder):
    def forward(self, x, *a, **k):
        return 3 * super().forward(x, *a, **k)


def test_a_lora_linear_subclass_is_refused_naming_its_class():
    A = _encoder()
    B = copy.deepcopy(A)
    lora = _LoRALinear(D, DFF).double()
    lora.load_state_dict(B.layers[0].linear1.state_dict(), strict=False)
    B.layers[0].linear1 = lora
    assert _measured(A, B) > 1.0  # red team 210: certified 0.0 against 20.15
    line = _refusal(transcover.perturb, A, B, samples=1, steps=2, match=r"a subclass of nn\.Linear \(_LoRALinear\)")
    assert "layers.0.linear1" in line or "layer.linear1" in line


def test_encoder_and_layer_subclasses_are_refused():
    layer = _DoubledFFN(D, H, DFF, 0.0, batch_first=True, norm_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double().eval()
    _refusal(load, enc, match=r"a subclass of nn\.TransformerEncoderLayer \(_DoubledFFN\)")
    _refusal(load, layer, match=r"a subclass of nn\.TransformerEncoderLayer \(_DoubledFFN\)")
    base = nn.TransformerEncoderLayer(D, H, DFF, 0.0, batch_first=True, norm_first=True)
    tripled = _TripledEncoder(base, 2, enable_nested_tensor=False).double().eval()
    _refusal(load, tripled, match=r"a subclass of nn\.TransformerEncoder \(_TripledEncoder\)")


def test_a_dynamically_quantised_linear_says_so():
    m = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, H, DFF, 0.0, batch_first=True), 1,
                              enable_nested_tensor=False).eval()
    with warnings.catch_warnings():  # torch's own deprecation notices of quantisation
        warnings.simplefilter("ignore")
        q = torch.ao.quantization.quantize_dynamic(m, {nn.Linear}, dtype=torch.qint8)
        _refusal(load, q, match=r"linear1 is a quantised .*packed integers.*analyse the float model")


def test_a_layer_tensor_no_role_reads_is_warned_and_refused_under_strict():
    m = _encoder()
    m.layers[0].linear1.lora_A = nn.Parameter(torch.zeros(4, D, dtype=torch.float64))
    with pytest.warns(TranscoverWarning, match=r"unexpected tensor 'layers\.0\.linear1\.lora_A'"):
        spec = load(m)
    assert any("lora_A" in w for w in spec.warnings)
    with pytest.raises(InputError, match="lora_A"):
        load(m, strict=True)


# -- item 3: a snapshot, not a live view -------------------------------------------------------------------------


def test_a_spec_loaded_before_fine_tuning_stays_the_before_function():
    m = _encoder()
    before_module = copy.deepcopy(m)
    before = load(m)
    held = before.layers[0]
    W1_then = m.layers[0].linear1.weight.detach().clone()
    torch.manual_seed(3)
    with torch.no_grad():  # "fine-tune" in place
        for p in m.parameters():
            p.add_(0.5 * torch.randn_like(p))
    r = transcover.perturb(before, m, samples=1, steps=2)
    assert r.bound.total.value >= _measured(before_module, m)  # red team 210: 0.0 against 33.1
    assert torch.equal(torch.as_tensor(held.ffn.W_1), W1_then.T)
    assert torch.equal(torch.as_tensor(before.layers[0].ffn.W_1), W1_then.T)
    live = {p.untyped_storage().data_ptr() for p in m.parameters()}
    assert torch.as_tensor(before.layers[0].ffn.W_1).untyped_storage().data_ptr() not in live


def test_reference_and_hf_specs_are_snapshots_too(transformers_mod):
    ref = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16)).double().eval()
    spec = load(ref)
    W1 = ref.blocks[0].W_1.detach().clone()
    with torch.no_grad():
        ref.blocks[0].W_1.mul_(10)
    assert torch.equal(torch.as_tensor(spec.layers[0].ffn.W_1), W1)
    cfg = transformers_mod.BertConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=H,
                                      intermediate_size=DFF, vocab_size=32, max_position_embeddings=8)
    bert = transformers_mod.BertModel(cfg).eval()
    spec = load(bert)
    W1 = bert.encoder.layer[0].intermediate.dense.weight.detach().clone()
    with torch.no_grad():
        bert.encoder.layer[0].intermediate.dense.weight.mul_(10)
    assert torch.equal(torch.as_tensor(spec.layers[0].ffn.W_1), W1.T)


# -- item 4: hooks and training mode -----------------------------------------------------------------------------


def test_a_forward_hook_is_refused_where_perturb_certified_zero():
    A = _encoder()
    B = copy.deepcopy(A)
    B.layers[0].register_forward_hook(lambda mod, inp, out: 2 * out)
    assert _measured(A, B) > 1.0  # red team 210: certified 0.0 against 1.97
    line = _refusal(transcover.perturb, A, B, samples=1, steps=2, match=r"^layers\.0 \(TransformerEncoderLayer\) "
                                                                         "has a forward hook")
    assert "handle.remove()" in line


def test_pre_hooks_and_global_hooks_are_refused():
    m = _encoder()
    handle = m.layers[0].linear1.register_forward_pre_hook(lambda mod, inp: (3 * inp[0],))
    _refusal(load, m, match=r"layers\.0\.linear1 \(Linear\) has a forward pre-hook")
    handle.remove()
    load(m)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, inp, out: out)
    try:
        _refusal(load, m, match="a global forward hook is registered")
    finally:
        handle.remove()


def test_training_mode_with_dropout_is_warned_not_refused():
    m = _encoder(n_layers=2, dropout=0.5).train()
    with pytest.warns(TranscoverWarning, match=r"training mode with dropout p=0\.5 .*eval-mode function"):
        r = transcover.analyze(m)
    assert any("eval-mode function" in w for w in r.warnings)
    with pytest.warns(TranscoverWarning, match="eval-mode function"):
        load(m, strict=True)  # a warning of the module's mode, not an unexpected tensor: strict does not refuse it
    spec = _no_warning(load, m.eval())
    assert not spec.warnings


def _no_warning(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kwargs)


def test_a_float64_llama_or_vit_says_its_forward_rounds_to_float32_inside(transformers_mod):
    """Red team 216: after ``.double()`` an HF Llama still casts to float32 in RMSNorm, its rotary tables and its eager
    softmax, so ``module(x)`` is not the float64 function certified (a pair ratio of 6e9 beside a certified 8.9e6).
    Loading such a module says so, naming the places; a float32 module, and a family without such casts, do not."""
    tf = transformers_mod
    cfg = tf.LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, attn_implementation="eager")
    llama = tf.LlamaModel(cfg).eval()
    with pytest.warns(TranscoverWarning, match=r"LlamaModel's own forward rounds to float32 inside \(.*LlamaRMSNorm"
                                               r"\.forward.*\).*exact function of its weights") as got:
        load(copy.deepcopy(llama).double())
    assert "eager_attention_forward" in str(got[0].message) and "LlamaRotaryEmbedding" in str(got[0].message)
    vit = tf.ViTModel(tf.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                   image_size=8, patch_size=4, attn_implementation="eager")).double().eval()
    with pytest.warns(TranscoverWarning, match=r"ViTModel's own forward rounds to float32 inside "
                                               r"\(eager_attention_forward\)"):
        load(vit)
    assert not _no_warning(load, llama).warnings  # float32 weights: module(x) rounds at float32 everywhere anyway
    bert = tf.BertModel(tf.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32), add_pooling_layer=False).double().eval()
    assert not _no_warning(load, bert).warnings


def test_a_tanh_gelu_encoder_says_torch_fast_path_computes_exact_gelu():
    """Red team 216: in eval mode without gradients a batch_first encoder runs torch's fused fast path, which computes
    ``nn.GELU(approximate='tanh')`` as exact GELU (outputs 2.7e-4 apart); the spec is the tanh GELU of its definition,
    which the module computes with the fast path off."""
    from transcover.model import transformer_forward

    layer = nn.TransformerEncoderLayer(D, H, DFF, 0.0, activation=nn.GELU(approximate="tanh"), batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double().eval()
    with pytest.warns(TranscoverWarning, match=r"nn\.GELU\(approximate='tanh'\).*fast path.*exact GELU.*"
                                               r"set_fastpath_enabled\(False\)"):
        spec = load(enc)
    X = torch.randn(1, 6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            assert torch.allclose(enc(X)[0], transformer_forward(spec.to_torch(torch.float64), X[0]), atol=1e-12)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    slow = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, H, DFF, 0.0, activation=nn.GELU(approximate="tanh")),
                                 2, enable_nested_tensor=False).eval()  # batch_first=False: never the fast path
    assert not _no_warning(load, slow).warnings
