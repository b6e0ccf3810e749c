"""GPT-NeoX (Pythia) in the seed's decomposition, with its parallel residual and partial rotary.

transformers ``models/gpt_neox/modeling_gpt_neox.py``: ``GPTNeoXLayer`` is pre-norm and causal,

.. math::

    \\text{parallel (use_parallel_residual, the default):}\\quad
    Z = X + \\mathrm{Attn}(\\mathrm{LN}_1 X) + \\mathrm{MLP}(\\mathrm{LN}_2 X),

    \\text{sequential:}\\quad Y = X + \\mathrm{Attn}(\\mathrm{LN}_1 X),\\; Z = Y + \\mathrm{MLP}(\\mathrm{LN}_2 Y),

(``LN_1 = input_layernorm``, ``LN_2 = post_attention_layernorm``) and ``final_layer_norm`` follows
the last layer.  The spec's ``LayerSpec.residual`` says which (THEORY F21 for the parallel block).

Attention: ``query_key_value`` is one ``nn.Linear(d, 3d)`` whose output is viewed as
``(H, 3 * d_head)`` and chunked into q, k, v *per head*: output row ``h*3*d_head + j*d_head + c``
is coordinate ``c`` of head ``h``'s q (j=0), k (j=1) or v (j=2) -- interleaved, unlike GPT-2's
``[Q | K | V]``.  ``dense`` is ``W_O``; scale ``d_head ** -0.5``.  RoPE (``apply_rotary_pos_emb``)
rotates only the first ``rotary_ndims = int(d_head * partial_rotary_factor)`` coordinates of each
head with ``rotate_half`` on them and ``inv_freq = theta^(-2i/rotary_ndims)``: the spec's
``RopeSpec(rotary_dim=rotary_ndims)`` layout.  Biases on q, k and v enter *before* the rotation,
which the forward (``_functional.attention_scores``) applies as the model does.
MLP: ``dense_4h_to_h(act(dense_h_to_4h(x)))``.  Scaled RoPE types as in ``_rope_scaling`` (THEORY F22).
"""

from __future__ import annotations

from ..._errors import UnsupportedArchitectureError
from .._rope_scaling import rope_from_config
from .._sources import TensorSource
from .._spec import AttentionSpec, LayerSequence, LayerSpec, Placement, Residual, TransformerSpec
from ._common import (
    activation_from_name, find_prefix, grouped_qkv, heads_out, layer_count, layer_norm, lazy_embeddings,
    linear_weight, optional_role, outer_prefix, plain_ffn, present, require, summary, transpose,
    unexpected_layer_tensors, without_roles,
)

__all__ = ["build_gpt_neox"]

_LAYER_KEYS = {
    "W_QKV": "attention.query_key_value.weight", "b_QKV": "attention.query_key_value.bias",
    "W_O": "attention.dense.weight", "b_O": "attention.dense.bias",
    "W_1": "mlp.dense_h_to_4h.weight", "b_1": "mlp.dense_h_to_4h.bias",
    "W_2": "mlp.dense_4h_to_h.weight", "b_2": "mlp.dense_4h_to_h.bias",
    "norm_attn.weight": "input_layernorm.weight", "norm_attn.bias": "input_layernorm.bias",
    "norm_ffn.weight": "post_attention_layernorm.weight", "norm_ffn.bias": "post_attention_layernorm.bias",
}
# buffers older checkpoints store and the spec recomputes (causal mask, RoPE frequencies)
_HARMLESS = (r"attention\.(masked_)?bias", r"attention\.rotary_emb\.inv_freq")


def build_gpt_neox(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "gpt_neox"
    d = int(require(config, "hidden_size", arch=arch, name=name))
    H = int(require(config, "num_attention_heads", arch=arch, name=name))
    if d % H:
        raise UnsupportedArchitectureError(f"{arch}: hidden_size={d} is not a multiple of num_attention_heads={H}")
    dh = d // H
    d_ff = int(config.get("intermediate_size") or 4 * d)
    eps = float(config.get("layer_norm_eps", 1e-5))
    act = activation_from_name(config.get("hidden_act", "gelu"), arch=arch)
    # transformers 4.x spells the rotary fraction and base rotary_pct / rotary_emb_base; 5.25's
    # GPTNeoXConfig.convert_rope_params_to_dict fills what rope_parameters (or rope_scaling) lacks from these,
    # else 0.25 and 10000 (4.x's defaults too), and never from a top-level partial_rotary_factor / rope_theta,
    # which the model ignores (red team 197: they were read, 0.41-0.62 apart; red team 168: a config.json
    # without any of them rotated the whole head here, a quarter of it in the model).  They stand in for the
    # top-level values rope_from_config falls back to.
    legacy = {"rope_theta": config.get("rotary_emb_base", 10000.0),
              "partial_rotary_factor": config.get("rotary_pct", 0.25)}
    rope, score_factor = rope_from_config({**config, **legacy}, arch, dh, partial=True)
    residual = Residual.PARALLEL if config.get("use_parallel_residual", True) else Residual.SEQUENTIAL
    found = find_prefix(src, ["layers.0.attention.query_key_value.weight", "embed_in.weight"])
    prefix = found[0] if found else ""
    n = layer_count(config, "num_hidden_layers", src, prefix, "layers", name)
    # attention_bias (default true) gives query_key_value and dense their biases (Note [absent biases])
    roles = without_roles(_LAYER_KEYS, () if config.get("attention_bias", True) else ("b_QKV", "b_O"))

    def layer(i: int) -> LayerSpec:
        names = {role: f"{prefix}layers.{i}.{key}" for role, key in roles.items()}
        W = linear_weight(src, names["W_QKV"], d, 3 * d)
        b = optional_role(src, names, "b_QKV", (3 * d,))
        (Wq, bq), (Wk, bk), (Wv, bv) = grouped_qkv(W, b, H, dh)  # interleaved (H, 3, d_head)
        attn = AttentionSpec(
            W_Q=Wq, W_K=Wk, W_V=Wv, W_O=heads_out(linear_weight(src, names["W_O"], d, d), H),
            b_Q=bq, b_K=bk, b_V=bv, b_O=optional_role(src, names, "b_O", (d,)),
            causal=True, rope=rope, scale=None if score_factor == 1.0 else score_factor / dh ** 0.5,
        )
        return LayerSpec(
            index=i, attention=attn, ffn=plain_ffn(src, names, d, d_ff, act),
            norm_attn=layer_norm(src, names["norm_attn.weight"], names["norm_attn.bias"], d, eps),
            norm_ffn=layer_norm(src, names["norm_ffn.weight"], names["norm_ffn.bias"], d, eps),
            placement=Placement.PRE, residual=residual,
            names=present(names, src),
        )

    # GPTNeoXForCausalLM keeps its LM head beside ``gpt_neox.`` (``embed_out`` in Pythia's checkpoints,
    # ``lm_head`` as transformers 5 saves it); its weight (V, d) un-embeds as x @ W^T.
    outer = outer_prefix(prefix, "gpt_neox.")
    head = next((outer + k for k in ("embed_out.weight", "lm_head.weight") if outer + k in src), outer + "embed_out.weight")
    embeddings = lazy_embeddings(src, {
        "token_embedding": (prefix + "embed_in.weight", None),
        "unembedding": (head, transpose),
    })
    final_norm = layer_norm(src, prefix + "final_layer_norm.weight", prefix + "final_layer_norm.bias", d, eps)
    out = summary(config, src, n, H, H, dh, d_ff, act.value, prefix, embeddings.names)
    out.update(rope_theta=rope.theta, rotary_dim=rope.rotary_dim or dh, residual=residual.value)
    return TransformerSpec(
        arch=arch, name=name, d_model=d, layers=LayerSequence(n, layer), final_norm=final_norm,
        embeddings=embeddings,  # type: ignore[arg-type]  # a read-on-access Mapping
        config=out,
        warnings=unexpected_layer_tensors(src, prefix, "layers", n, roles.values(), _HARMLESS,
                                          arch=arch, name=name),
    )
