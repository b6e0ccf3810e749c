"""OLMo 2 in the seed's decomposition.

transformers ``models/olmo2/modeling_olmo2.py``: ``Olmo2DecoderLayer`` has no norm before its
branches and one on each branch's output, inside the residual (THEORY F26)::

    y = x + post_attention_layernorm(attn(x)),     z = y + post_feedforward_layernorm(mlp(y)),

the spec's ``norm_attn``/``norm_ffn`` of kind NONE with ``post_norm_attn``/``post_norm_ffn``.  The
attention normalises the *whole* query and key projections (``q_norm`` over ``H * head_dim``
coordinates, ``k_norm`` over ``H_kv * head_dim``) before splitting them into heads and rotating them
(``Olmo2Attention``): the spec's ``qk_norm_scope = "all"`` (THEORY F23).  The MLP is Llama's gated
SiLU; RMSNorm is ``gamma * x / rms`` (no offset); RoPE as in Llama (``rope_from_config``).
"""

from __future__ import annotations

from .._rope_scaling import rope_from_config
from .._sources import TensorSource
from .._spec import LayerSequence, LayerSpec, NormKind, NormSpec, Placement, TransformerSpec
from ._common import (
    ATTENTION_BIASES, DECODER_ROLES, MLP_BIASES, activation_from_name, decoder_attention, decoder_dims, find_prefix,
    gated_ffn, layer_count, layer_norm, lm_embeddings, summary, unexpected_layer_tensors, without_roles,
)

__all__ = ["build_olmo2"]

_NORMS = {
    "q_norm.weight": "self_attn.q_norm.weight", "k_norm.weight": "self_attn.k_norm.weight",
    "post_norm_attn.weight": "post_attention_layernorm.weight",
    "post_norm_ffn.weight": "post_feedforward_layernorm.weight",
}


def build_olmo2(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "olmo2"
    d, H, H_kv, dh, d_ff = decoder_dims(config, arch=arch, name=name)
    eps = float(config.get("rms_norm_eps", 1e-5))
    act = activation_from_name(config.get("hidden_act", "silu"), arch=arch)
    rope, score_factor = rope_from_config(config, arch, dh)
    found = find_prefix(src, ["layers.0.self_attn.q_proj.weight", "embed_tokens.weight"])
    prefix = found[0] if found else ""
    n = layer_count(config, "num_hidden_layers", src, prefix, "layers", name)
    attn_bias = bool(config.get("attention_bias", False))
    # no MLP bias, attention biases only with attention_bias (Note [absent biases])
    roles = without_roles({**DECODER_ROLES, **_NORMS}, (*MLP_BIASES, *(() if attn_bias else ATTENTION_BIASES)))

    def layer(i: int) -> LayerSpec:
        names = {role: f"{prefix}layers.{i}.{key}" for role, key in roles.items()}
        rms = lambda role, width: layer_norm(src, names[role], None, width, eps, NormKind.RMSNORM)  # noqa: E731
        attn = decoder_attention(
            src, names, d=d, H=H, H_kv=H_kv, dh=dh, causal=True, rope=rope,
            scale=None if score_factor == 1.0 else score_factor / dh ** 0.5,
            q_norm=rms("q_norm.weight", H * dh), k_norm=rms("k_norm.weight", H_kv * dh), qk_norm_scope="all")
        return LayerSpec(
            index=i, attention=attn, ffn=gated_ffn(src, names, d=d, d_ff=d_ff, act=act),
            norm_attn=NormSpec(NormKind.NONE), norm_ffn=NormSpec(NormKind.NONE), placement=Placement.PRE,
            post_norm_attn=rms("post_norm_attn.weight", d), post_norm_ffn=rms("post_norm_ffn.weight", d),
            names={r: v for r, v in names.items() if v in src},
        )

    embeddings = lm_embeddings(src, prefix, "model.", "embed_tokens.weight")
    out = summary(config, src, n, H, H_kv, dh, d_ff, act.value, prefix, embeddings.names)
    out.update(rope_theta=rope.theta, qk_norm_scope="all", post_norms_only=True)
    return TransformerSpec(
        arch=arch, name=name, d_model=d, layers=LayerSequence(n, layer),
        final_norm=layer_norm(src, prefix + "norm.weight", None, d, eps, NormKind.RMSNORM),
        embeddings=embeddings,  # type: ignore[arg-type]  # a read-on-access Mapping
        config=out,
        warnings=unexpected_layer_tensors(src, prefix, "layers", n, roles.values(),
                                          (r"self_attn\.rotary_emb\.inv_freq",), arch=arch, name=name),
    )
