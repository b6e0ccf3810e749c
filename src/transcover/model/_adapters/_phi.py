"""Phi-1 / Phi-1.5 / Phi-2 in the seed's decomposition: parallel residual with one LayerNorm, partial rotary.

transformers ``models/phi/modeling_phi.py``: ``PhiDecoderLayer`` computes

.. math::

    Z = X + \\mathrm{Attn}(\\mathrm{LN}\\,X) + \\mathrm{MLP}(\\mathrm{LN}\\,X),

one ``input_layernorm`` feeding both branches -- THEORY F21 with ``N_1 = N_2`` (the spec's
``norm_attn`` and ``norm_ffn`` are the same norm, as for GPT-J) -- and ``final_layernorm`` after the
last layer.  Attention (``PhiAttention``): ``q_proj``/``k_proj``/``v_proj``/``dense`` are
``nn.Linear`` with biases, heads split as every HF ``view(..., H, head_dim)``, grouped-query when
``num_key_value_heads < num_attention_heads``, causal, scale ``head_dim ** -0.5``; RoPE rotates the
first ``int(head_dim * partial_rotary_factor)`` coordinates of each head with ``rotate_half``
(the spec's ``RopeSpec(rotary_dim=...)``), after the biases (the spec's order, THEORY F22).
MLP (``PhiMLP``): ``fc2(act(fc1(x)))`` with biases, ``gelu_new`` in every released checkpoint.
``lm_head`` (with a bias) un-embeds outside the decomposition; only its weight is recorded.

Refused: ``qk_layernorm=True`` (see :data:`QK_LAYERNORM_REASON`) and Phi-3 (:data:`PHI3_REASON`).
"""

from __future__ import annotations

from ..._errors import UnsupportedArchitectureError
from .._rope_scaling import rope_from_config
from .._sources import TensorSource
from .._spec import LayerSequence, LayerSpec, TransformerSpec
from ._common import (
    activation_from_name, decoder_attention, find_prefix, layer_count, layer_norm, lm_embeddings, require,
    shared_norm_parallel_layer, summary, unexpected_layer_tensors,
)
from ._refused import OutsideDecompositionError

__all__ = ["build_phi", "build_phi3", "QK_LAYERNORM_REASON", "PHI3_REASON"]

_LAYER_KEYS = {
    "W_Q": "self_attn.q_proj.weight", "b_Q": "self_attn.q_proj.bias",
    "W_K": "self_attn.k_proj.weight", "b_K": "self_attn.k_proj.bias",
    "W_V": "self_attn.v_proj.weight", "b_V": "self_attn.v_proj.bias",
    "W_O": "self_attn.dense.weight", "b_O": "self_attn.dense.bias",
    "W_1": "mlp.fc1.weight", "b_1": "mlp.fc1.bias", "W_2": "mlp.fc2.weight", "b_2": "mlp.fc2.bias",
    "norm.weight": "input_layernorm.weight", "norm.bias": "input_layernorm.bias",
}

#: Why ``qk_layernorm=True`` is refused: the spec's q/k normalisation (THEORY F23) is an RMSNorm, whose
#: output has norm sqrt(d_head) * max|gamma| at most and which every bound uses in that form.  Phi's
#: ``q_layernorm``/``k_layernorm`` are LayerNorms: they centre each head's vector (a different map,
#: so the forward itself would not match) and add a shift beta, which enlarges the normalised
#: queries' radius by ||beta|| and enters every score bound and the attention Lipschitz bound.
QK_LAYERNORM_REASON = (
    "qk_layernorm=True (a per-head LayerNorm with centring and shift beta on q and k) is refused: the "
    "decomposition's query/key normalisation (THEORY F23) is an RMSNorm; reading it would need a LayerNorm "
    "q/k norm in the spec and F23's radius sqrt(d_head) max|gamma| + ||beta|| in B_KQ and the attention bound"
)

#: Why Phi-3 is refused: it is a Llama block, but its checkpoints fuse the projections.
PHI3_REASON = (
    "Phi-3 (model_type 'phi3') is refused: its Llama-like block stores fused self_attn.qkv_proj "
    "([Q; K; V] rows) and mlp.gate_up_proj ([gate; up] rows) tensors, which the llama adapter does not split "
    "(its 128k variants' longrope scaling also depends on the sequence length); reading it would need those "
    "splits onto the llama spec, with longrope still refused"
)

# buffers some checkpoints store and the spec recomputes
_HARMLESS = (r"self_attn\.rotary_emb\.inv_freq",)


def build_phi(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "phi"
    d = int(require(config, "hidden_size", arch=arch, name=name))
    H = int(require(config, "num_attention_heads", arch=arch, name=name))
    H_kv = int(config.get("num_key_value_heads") or H)
    dh = int(config.get("head_dim") or d // H)
    if H * dh != d and not config.get("head_dim"):
        raise UnsupportedArchitectureError(f"{arch}: hidden_size={d} is not a multiple of num_attention_heads={H}")
    if H % H_kv:
        raise UnsupportedArchitectureError(f"{arch}: num_attention_heads={H} is not a multiple of "
                                           f"num_key_value_heads={H_kv}")
    found = find_prefix(src, ["layers.0.self_attn.q_proj.weight", "embed_tokens.weight"])
    prefix = found[0] if found else ""
    if config.get("qk_layernorm") or f"{prefix}layers.0.self_attn.q_layernorm.weight" in src:
        raise UnsupportedArchitectureError(f"{arch}: {QK_LAYERNORM_REASON} ({name})")
    d_ff = int(config.get("intermediate_size") or 4 * d)
    eps = float(config.get("layer_norm_eps", 1e-5))
    act = activation_from_name(config.get("hidden_act", "gelu_new"), arch=arch)
    # PhiConfig's partial_rotary_factor (0.5 by default and in the released Phi-1/1.5/2 configs) sits at
    # the top level of older config.json files and in rope_parameters in transformers 5; both are read.
    rope, score_factor = rope_from_config(config, arch, dh, default_factor=0.5, partial=True)
    n = layer_count(config, "num_hidden_layers", src, prefix, "layers", name)

    def layer(i: int) -> LayerSpec:
        names = {role: f"{prefix}layers.{i}.{key}" for role, key in _LAYER_KEYS.items()}
        attn = decoder_attention(src, names, d=d, H=H, H_kv=H_kv, dh=dh, causal=True, rope=rope,
                                 scale=None if score_factor == 1.0 else score_factor / dh ** 0.5)
        return shared_norm_parallel_layer(src, names, i, attn, d=d, d_ff=d_ff, act=act, eps=eps)

    embeddings = lm_embeddings(src, prefix, "model.", "embed_tokens.weight")
    final_norm = layer_norm(src, prefix + "final_layernorm.weight", prefix + "final_layernorm.bias", d, eps)
    out = summary(config, src, n, H, H_kv, dh, d_ff, act.value, prefix, embeddings.names)
    out.update(rope_theta=rope.theta, rotary_dim=rope.rotary_dim or dh, residual="parallel")
    return TransformerSpec(
        arch=arch, name=name, d_model=d, layers=LayerSequence(n, layer), final_norm=final_norm,
        embeddings=embeddings,  # type: ignore[arg-type]  # a read-on-access Mapping
        config=out,
        warnings=unexpected_layer_tensors(src, prefix, "layers", n, _LAYER_KEYS.values(), _HARMLESS,
                                          arch=arch, name=name),
    )


def build_phi3(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    # OutsideDecompositionError: analyze still reports per-matrix norms; every bound refuses with this line
    raise OutsideDecompositionError(f"phi3: {PHI3_REASON} ({name})")
