"""GPT-2 in the seed's decomposition.

transformers ``models/gpt2/modeling_gpt2.py``: ``GPT2Block`` is pre-norm and causal,

.. math::

    Y = X + \\mathrm{Attn}(\\mathrm{LN}_1 X),\\qquad Z = Y + \\mathrm{MLP}(\\mathrm{LN}_2 Y),

and ``ln_f`` follows the last block (the spec's ``final_norm``).  Its ``Conv1D`` computes
``x @ W + b`` with ``W`` stored ``(d_in, d_out)``, already the spec's orientation.  ``c_attn`` is the
fused ``[W_Q | W_K | W_V]`` of shape ``(d, 3d)`` (``split(d, dim=2)`` in ``GPT2Attention.forward``);
``c_proj`` is ``W_O``.  Scale: ``1/sqrt(d_head)`` when ``scale_attn_weights`` (else 1), divided by
``layer_idx + 1`` when ``scale_attn_by_inverse_layer_idx`` (``GPT2Attention.__init__``).
``activation_function`` "gelu_new" is the tanh GELU.  The LM head is tied to ``wte``.
"""

from __future__ import annotations

import math

from ..._errors import UnsupportedArchitectureError
from .._sources import TensorSource
from .._spec import AttentionSpec, FFNSpec, LayerSequence, LayerSpec, Placement, TransformerSpec
from ._common import (
    split_fused_qkv,
    activation_from_name, count_layers, find_prefix, heads_out, layer_norm,
    lazy_embeddings, no_layers, require, summary, unexpected_layer_tensors,
)

__all__ = ["build_gpt2"]

_LAYER_KEYS = ("attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
               "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias",
               "ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias")


def _first(config: dict, *keys: str) -> object:
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return None


def build_gpt2(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "gpt2"
    if config.get("add_cross_attention"):
        raise UnsupportedArchitectureError(f"{arch}: cross-attention layers are not supported ({name})")
    config = dict(config)
    # GPT2Config.attribute_map: hidden_size -> n_embd, num_attention_heads -> n_head, ...
    for short, long in (("n_embd", "hidden_size"), ("n_head", "num_attention_heads"),
                        ("n_layer", "num_hidden_layers")):
        if config.get(short) is None and config.get(long) is not None:
            config[short] = config[long]
    d = int(require(config, "n_embd", arch=arch, name=name))
    H = int(require(config, "n_head", arch=arch, name=name))
    d_ff = int(_first(config, "n_inner") or 4 * d)
    eps = float(config.get("layer_norm_epsilon", 1e-5))
    act = activation_from_name(config.get("activation_function", "gelu_new"), arch=arch)
    found = find_prefix(src, ["h.0.attn.c_attn.weight", "wte.weight"])
    prefix = found[0] if found else ""
    n = config.get("n_layer")
    n = count_layers(src, prefix, "h") if n is None else int(n)
    if n == 0:
        raise no_layers(name)
    dh = d // H
    scale0 = 1.0 / math.sqrt(dh) if config.get("scale_attn_weights", True) else 1.0
    by_layer = bool(config.get("scale_attn_by_inverse_layer_idx", False))

    def layer(i: int) -> LayerSpec:
        p = f"{prefix}h.{i}."
        qkv_w, qkv_b = p + "attn.c_attn.weight", p + "attn.c_attn.bias"
        W = src.get(qkv_w, (d, 3 * d))  # (d, 3d) = [W_Q | W_K | W_V]
        b = src.get(qkv_b, (3 * d,))  # Conv1D always has its bias (Note [missing biases])
        parts, names = split_fused_qkv(W, b, H, w_name=qkv_w, b_name=qkv_b, stacked_rows=False)
        keys = {
            "W_O": p + "attn.c_proj.weight", "b_O": p + "attn.c_proj.bias",
            "W_1": p + "mlp.c_fc.weight", "b_1": p + "mlp.c_fc.bias",
            "W_2": p + "mlp.c_proj.weight", "b_2": p + "mlp.c_proj.bias",
            "norm_attn.weight": p + "ln_1.weight", "norm_attn.bias": p + "ln_1.bias",
            "norm_ffn.weight": p + "ln_2.weight", "norm_ffn.bias": p + "ln_2.bias",
        }
        names.update(keys)
        attn = AttentionSpec(
            W_Q=parts["Q"][0], W_K=parts["K"][0], W_V=parts["V"][0],
            W_O=heads_out(src.get(keys["W_O"], (d, d)), H),
            b_Q=parts["Q"][1], b_K=parts["K"][1], b_V=parts["V"][1],
            b_O=src.get(keys["b_O"], (d,)),
            scale=scale0 / (i + 1) if by_layer else scale0, causal=True,
        )
        ffn = FFNSpec(
            W_1=src.get(keys["W_1"], (d, d_ff)), W_2=src.get(keys["W_2"], (d_ff, d)), activation=act,
            b_1=src.get(keys["b_1"], (d_ff,)), b_2=src.get(keys["b_2"], (d,)),
        )
        return LayerSpec(
            index=i, attention=attn, ffn=ffn,
            norm_attn=layer_norm(src, keys["norm_attn.weight"], keys["norm_attn.bias"], d, eps),
            norm_ffn=layer_norm(src, keys["norm_ffn.weight"], keys["norm_ffn.bias"], d, eps),
            placement=Placement.PRE, names=names,
        )

    embeddings = lazy_embeddings(src, {
        "token_embedding": (prefix + "wte.weight", None),
        "position_embedding": (prefix + "wpe.weight", None),
    })
    # GPT2Model always ends with ln_f: a checkpoint without it is incomplete, not a variant.
    final_norm = layer_norm(src, prefix + "ln_f.weight", prefix + "ln_f.bias", d, eps)
    return TransformerSpec(
        arch=arch, name=name, d_model=d, layers=LayerSequence(n, layer), final_norm=final_norm,
        embeddings=embeddings,  # type: ignore[arg-type]  # a read-on-access Mapping
        config=summary(config, src, n, H, H, dh, d_ff, act.value, prefix, embeddings.names),
        # attn.bias / attn.masked_bias: the causal-mask buffers older checkpoints store (causal=True here)
        warnings=unexpected_layer_tensors(src, prefix, "h", n, _LAYER_KEYS, (r"attn\.(masked_)?bias",),
                                          arch=arch, name=name),
    )
