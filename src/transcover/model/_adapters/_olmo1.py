"""OLMo (the first generation, ``model_type="olmo"``) in the seed's decomposition.

transformers ``models/olmo/modeling_olmo.py``: ``OlmoDecoderLayer`` is Llama's pre-norm causal block,

.. math::

    Y = X + \\mathrm{Attn}(\\mathrm{LN} X),\\qquad
    Z = Y + W_{down}^T\\big(\\mathrm{act}(W_{gate}^T \\mathrm{LN} Y) \\odot W_{up}^T \\mathrm{LN} Y\\big),

except that every norm (``input_layernorm``, ``post_attention_layernorm`` and the final ``norm``) is
``OlmoLayerNorm``: a LayerNorm *without* learnable scale or shift, ``eps = 1e-5`` fixed in the code
(the spec's ``NormSpec(LAYERNORM, None, None, 1e-5)``: gamma = 1, beta = 0 in every bound, F14).
Attention: separate ``q/k/v/o_proj`` (biases when ``attention_bias``), grouped-query heads, scale
``head_dim ** -0.5``, RoPE with ``rotate_half`` on the whole head (rope types as in ``_rope_scaling``).

``clip_qkv = c`` clamps every coordinate of the projected q, k and v to ``[-c, c]``.  The clamp is
1-Lipschitz elementwise (so it could only shrink every Lipschitz constant and bound every score by
``s c^2 d_head``), but the spec's attention does not compute it, so a spec would be another function:
refused with one line rather than approximated.  OLMo 2 (``olmo2``: post-norms, query/key RMSNorm
over the whole projection) is another block, read by ``_olmo``.
"""

from __future__ import annotations

from ..._errors import UnsupportedArchitectureError
from .._rope_scaling import rope_from_config
from .._sources import TensorSource
from .._spec import AttentionSpec, FFNSpec, LayerSequence, LayerSpec, NormKind, NormSpec, Placement, TransformerSpec
from ._common import (
    ATTENTION_BIASES, activation_from_name, decoder_dims, find_prefix, heads_bias, heads_in, heads_out, layer_count,
    linear_weight, lm_embeddings, present, summary, unexpected_layer_tensors, without_roles,
)

__all__ = ["build_olmo1", "CLIP_QKV_REASON"]

CLIP_QKV_REASON = ("clip_qkv clamps each coordinate of q, k and v to [-c, c]; the clamp is 1-Lipschitz elementwise, "
                   "but the decomposition's attention does not compute it, so the spec would be another function "
                   "(supporting it needs the clamp in the spec's attention and |score| <= s c^2 d_head in B_KQ)")

_ROLES = {
    "W_Q": "self_attn.q_proj.weight", "b_Q": "self_attn.q_proj.bias",
    "W_K": "self_attn.k_proj.weight", "b_K": "self_attn.k_proj.bias",
    "W_V": "self_attn.v_proj.weight", "b_V": "self_attn.v_proj.bias",
    "W_O": "self_attn.o_proj.weight", "b_O": "self_attn.o_proj.bias",
    "W_gate": "mlp.gate_proj.weight", "W_1": "mlp.up_proj.weight", "W_2": "mlp.down_proj.weight",
}
_OLMO_EPS = 1e-5  # OlmoLayerNorm passes eps=1e-5 to F.layer_norm; the configuration has no field for it


def build_olmo1(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "olmo"
    if config.get("clip_qkv") is not None:
        raise UnsupportedArchitectureError(f"{arch}: clip_qkv={config['clip_qkv']!r} is refused: {CLIP_QKV_REASON}")
    d, H, H_kv, dh, d_ff = decoder_dims(config, arch=arch, name=name)
    if H % H_kv:
        raise UnsupportedArchitectureError(f"{arch}: num_attention_heads={H} is not a multiple of num_key_value_heads={H_kv}")
    act = activation_from_name(config.get("hidden_act", "silu"), arch=arch)
    rope, score_factor = rope_from_config(config, arch, dh)
    found = find_prefix(src, ["layers.0.self_attn.q_proj.weight", "embed_tokens.weight"])
    prefix = found[0] if found else ""
    n = layer_count(config, "num_hidden_layers", src, prefix, "layers", name)
    bias = bool(config.get("attention_bias", False))
    norm = NormSpec(NormKind.LAYERNORM, None, None, _OLMO_EPS)  # no parameters: one spec serves every norm
    roles = without_roles(_ROLES, () if bias else ATTENTION_BIASES)  # Note [absent biases]

    def layer(i: int) -> LayerSpec:
        names = {role: f"{prefix}layers.{i}.{key}" for role, key in roles.items()}

        def b(role: str, shape: tuple[int, ...]):
            return src.get(names[role], shape) if bias else None

        attn = AttentionSpec(
            W_Q=heads_in(linear_weight(src, names["W_Q"], d, H * dh), H),
            W_K=heads_in(linear_weight(src, names["W_K"], d, H_kv * dh), H_kv),
            W_V=heads_in(linear_weight(src, names["W_V"], d, H_kv * dh), H_kv),
            W_O=heads_out(linear_weight(src, names["W_O"], H * dh, d), H),
            b_Q=heads_bias(b("b_Q", (H * dh,)), H), b_K=heads_bias(b("b_K", (H_kv * dh,)), H_kv),
            b_V=heads_bias(b("b_V", (H_kv * dh,)), H_kv), b_O=b("b_O", (d,)),
            causal=True, rope=rope, scale=None if score_factor == 1.0 else score_factor / dh ** 0.5,
        )
        ffn = FFNSpec(W_1=linear_weight(src, names["W_1"], d, d_ff), W_2=linear_weight(src, names["W_2"], d_ff, d),
                      W_gate=linear_weight(src, names["W_gate"], d, d_ff), activation=act)
        return LayerSpec(index=i, attention=attn, ffn=ffn, norm_attn=norm, norm_ffn=norm, placement=Placement.PRE,
                         names=present(names, src))

    embeddings = lm_embeddings(src, prefix, "model.", "embed_tokens.weight")
    out = summary(config, src, n, H, H_kv, dh, d_ff, act.value, prefix, embeddings.names)
    out["rope_theta"] = rope.theta
    return TransformerSpec(
        arch=arch, name=name, d_model=d, layers=LayerSequence(n, layer), final_norm=norm,
        embeddings=embeddings,  # type: ignore[arg-type]  # a read-on-access Mapping
        config=out,
        warnings=unexpected_layer_tensors(src, prefix, "layers", n, roles.values(),
                                          (r"self_attn\.rotary_emb\.inv_freq",), arch=arch, name=name),
    )
