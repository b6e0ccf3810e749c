"""Falcon (old and new decoder architecture) in the seed's decomposition.

transformers ``models/falcon/modeling_falcon.py``: ``FalconDecoderLayer`` is pre-norm and causal,

* new decoder architecture (Falcon-40B/180B, Falcon 2): always parallel,
  ``Z = X + Attn(LN_a X) + MLP(LN_m X)`` with two norms ``ln_attn``/``ln_mlp``
  (``num_ln_in_parallel_attn = 2``, the default) or one ``input_layernorm`` for both (``= 1``);
* old architecture (Falcon-7B, RW): ``parallel_attn`` gives ``Z = X + Attn(LN X) + MLP(LN X)`` with
  the one ``input_layernorm``; without it, sequential ``Y = X + Attn(LN_1 X)``,
  ``Z = Y + MLP(LN_2 Y)`` (``post_attention_layernorm``).

The parallel forms are THEORY F21 (one or two LayerNorms).  ``ln_f`` follows the last layer.

Attention: ``query_key_value`` is one ``nn.Linear`` whose output is grouped per key/value head:
``(n_kv, H/n_kv + 2, d_head)`` in the new architecture, ``(H, 3, d_head)`` in the old one and
``[q_0 .. q_{H-1}, k, v]`` with ``multi_query`` (one key/value head); all three are
:func:`~._common.grouped_qkv`'s layout.  Scale ``d_head ** -0.5``; RoPE with ``rotate_half`` on the
whole head (``RopeSpec``'s layout, rope types as in ``_rope_scaling``).  ``dense`` is ``W_O``;
MLP ``dense_4h_to_h(act(dense_h_to_4h(x)))``; every projection has a bias when ``config.bias``.
ALiBi (``alibi=True``) adds ``-slope_h |i - j|``-type terms to the scores, which the spec's attention
does not have: refused with one line.
"""

from __future__ import annotations

from ..._errors import UnsupportedArchitectureError
from .._rope_scaling import rope_from_config
from .._sources import TensorSource
from .._spec import AttentionSpec, LayerSequence, LayerSpec, Placement, Residual, TransformerSpec
from ._common import (
    activation_from_name, find_prefix, grouped_qkv, heads_out, layer_count, layer_norm, linear_weight, lm_embeddings,
    optional_role, plain_ffn, present, require, summary, unexpected_layer_tensors, without_roles,
)

__all__ = ["build_falcon", "ALIBI_REASON"]

ALIBI_REASON = ("ALiBi adds a per-head linear bias in |i - j| to every score, which the decomposition's "
                "attention does not have; bounding it would need that bias term in B_KQ and in the attention "
                "Lipschitz bound (it does not depend on the input, so it would enter like a fixed mask)")

_ATTN = {"W_QKV": "self_attention.query_key_value.weight", "b_QKV": "self_attention.query_key_value.bias",
         "W_O": "self_attention.dense.weight", "b_O": "self_attention.dense.bias",
         "W_1": "mlp.dense_h_to_4h.weight", "b_1": "mlp.dense_h_to_4h.bias",
         "W_2": "mlp.dense_4h_to_h.weight", "b_2": "mlp.dense_4h_to_h.bias"}


def _norm_keys(new: bool, parallel: bool, n_ln: int) -> dict[str, str]:
    """The norms' tensor names (without the layer prefix) for the attention and the MLP branch."""
    if new and n_ln == 2:
        attn, mlp = "ln_attn", "ln_mlp"
    elif parallel or new:
        attn = mlp = "input_layernorm"
    else:
        attn, mlp = "input_layernorm", "post_attention_layernorm"
    return {"norm_attn.weight": f"{attn}.weight", "norm_attn.bias": f"{attn}.bias",
            "norm_ffn.weight": f"{mlp}.weight", "norm_ffn.bias": f"{mlp}.bias"}


def build_falcon(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "falcon"
    config = dict(config)
    for short, long in (("n_embed", "hidden_size"), ("n_head", "num_attention_heads"), ("n_layer", "num_hidden_layers")):
        if config.get(long) is None and config.get(short) is not None:
            config[long] = config[short]
    if config.get("alibi"):
        raise UnsupportedArchitectureError(f"{arch}: alibi=True is refused: {ALIBI_REASON} ({name})")
    d = int(require(config, "hidden_size", arch=arch, name=name))
    H = int(require(config, "num_attention_heads", arch=arch, name=name))
    if d % H:
        raise UnsupportedArchitectureError(f"{arch}: hidden_size={d} is not a multiple of num_attention_heads={H}")
    dh = d // H
    new = bool(config.get("new_decoder_architecture", False))
    multi_query = bool(config.get("multi_query", True))
    parallel = bool(config.get("parallel_attn", True))
    n_ln = int(config.get("num_ln_in_parallel_attn") or 2)
    if new:
        H_kv = int(config.get("num_kv_heads") or H)
        if not parallel and n_ln == 2:  # HF builds input/post_attention norms but its forward reads ln_attn/ln_mlp
            raise UnsupportedArchitectureError(
                f"{arch}: new_decoder_architecture with parallel_attn=False has no consistent forward in "
                "transformers (the layer reads ln_attn/ln_mlp it never built); refused")
    elif multi_query:
        H_kv = 1
    else:
        H_kv = int(config.get("num_kv_heads") or H)
        if H_kv != H:  # the old fused view is (H, 3, d_head): one key/value head per query head
            raise UnsupportedArchitectureError(
                f"{arch}: num_kv_heads={H_kv} with the old architecture and multi_query=False; its fused "
                f"projection holds {H} key/value heads, so the configuration contradicts the layout")
    if H % H_kv:
        raise UnsupportedArchitectureError(f"{arch}: num_attention_heads={H} is not a multiple of num_kv_heads={H_kv}")
    d_ff = int(config.get("ffn_hidden_size") or 4 * d)
    eps = float(config.get("layer_norm_epsilon", 1e-5))
    act = activation_from_name(config.get("activation", "gelu"), arch=arch)
    rope, score_factor = rope_from_config(config, arch, dh)
    residual = Residual.PARALLEL if (new or parallel) else Residual.SEQUENTIAL
    found = find_prefix(src, ["h.0.self_attention.query_key_value.weight", "word_embeddings.weight"])
    prefix = found[0] if found else ""
    n = layer_count(config, "num_hidden_layers", src, prefix, "h", name)
    # ``bias`` (default false) gives every projection its bias (Note [absent biases])
    roles = without_roles({**_ATTN, **_norm_keys(new, parallel, n_ln)},
                          () if config.get("bias", False) else ("b_QKV", "b_O", "b_1", "b_2"))
    width = (H + 2 * H_kv) * dh

    def layer(i: int) -> LayerSpec:
        names = {role: f"{prefix}h.{i}.{key}" for role, key in roles.items()}
        W = linear_weight(src, names["W_QKV"], d, width)
        (Wq, bq), (Wk, bk), (Wv, bv) = grouped_qkv(W, optional_role(src, names, "b_QKV", (width,)), H_kv, dh)
        attn = AttentionSpec(
            W_Q=Wq, W_K=Wk, W_V=Wv, W_O=heads_out(linear_weight(src, names["W_O"], d, d), H),
            b_Q=bq, b_K=bk, b_V=bv, b_O=optional_role(src, names, "b_O", (d,)),
            causal=True, rope=rope, scale=None if score_factor == 1.0 else score_factor / dh ** 0.5,
        )
        norm_attn = layer_norm(src, names["norm_attn.weight"], names["norm_attn.bias"], d, eps)
        norm_ffn = norm_attn if names["norm_ffn.weight"] == names["norm_attn.weight"] else layer_norm(
            src, names["norm_ffn.weight"], names["norm_ffn.bias"], d, eps)
        return LayerSpec(index=i, attention=attn, ffn=plain_ffn(src, names, d, d_ff, act), norm_attn=norm_attn,
                         norm_ffn=norm_ffn, placement=Placement.PRE, residual=residual, names=present(names, src))

    embeddings = lm_embeddings(src, prefix, "transformer.", "word_embeddings.weight")
    final_norm = layer_norm(src, prefix + "ln_f.weight", prefix + "ln_f.bias", d, eps)
    out = summary(config, src, n, H, H_kv, dh, d_ff, act.value, prefix, embeddings.names)
    out.update(rope_theta=rope.theta, residual=residual.value, new_decoder_architecture=new)
    return TransformerSpec(
        arch=arch, name=name, d_model=d, layers=LayerSequence(n, layer), final_norm=final_norm,
        embeddings=embeddings,  # type: ignore[arg-type]  # a read-on-access Mapping
        config=out,
        warnings=unexpected_layer_tensors(src, prefix, "h", n, roles.values(),
                                          (r"self_attention\.rotary_emb\.inv_freq",), arch=arch, name=name),
    )
