"""ViT in the seed's decomposition.

transformers ``models/vit/modeling_vit.py``: ``ViTLayer`` is pre-norm and bidirectional,

.. math::

    Y = X + \\mathrm{Attn}(\\mathrm{LN}_{before} X),\\qquad
    Z = Y + W_2^T\\,\\mathrm{act}(W_1^T\\,\\mathrm{LN}_{after} Y + b_1) + b_2,

attention with q/k/v biases (``qkv_bias``) and scale ``head_dim ** -0.5``; ``layernorm`` follows the
last layer.  The embedding is a patch projection (a ``Conv2d`` with kernel = stride = patch size, i.e.
a linear map of each flattened ``(C, p, p)`` patch), a CLS token and learned positions.

Two tensor layouts exist: checkpoints on disk use the original names
(``encoder.layer.N.attention.attention.query``, ``attention.output.dense``, ``intermediate.dense``,
``output.dense``); transformers 5 modules name the same tensors ``layers.N.attention.q_proj``,
``o_proj``, ``mlp.fc1``, ``mlp.fc2`` in ``state_dict()`` (and convert on save/load).  Both are read.
"""

from __future__ import annotations

from .._sources import TensorSource
from .._spec import LayerSequence, LayerSpec, Placement, TransformerSpec
from ._common import (
    separate_projections_layer,
    activation_from_name, find_prefix, count_layers, layer_norm,
    lazy_embeddings, no_layers, require, summary, transpose, unexpected_layer_tensors, without_roles,
)

__all__ = ["build_vit"]

_LEGACY = ("encoder.layer", {
    "W_Q": "attention.attention.query.weight", "b_Q": "attention.attention.query.bias",
    "W_K": "attention.attention.key.weight", "b_K": "attention.attention.key.bias",
    "W_V": "attention.attention.value.weight", "b_V": "attention.attention.value.bias",
    "W_O": "attention.output.dense.weight", "b_O": "attention.output.dense.bias",
    "W_1": "intermediate.dense.weight", "b_1": "intermediate.dense.bias",
    "W_2": "output.dense.weight", "b_2": "output.dense.bias",
})
_MODERN = ("layers", {
    "W_Q": "attention.q_proj.weight", "b_Q": "attention.q_proj.bias",
    "W_K": "attention.k_proj.weight", "b_K": "attention.k_proj.bias",
    "W_V": "attention.v_proj.weight", "b_V": "attention.v_proj.bias",
    "W_O": "attention.o_proj.weight", "b_O": "attention.o_proj.bias",
    "W_1": "mlp.fc1.weight", "b_1": "mlp.fc1.bias",
    "W_2": "mlp.fc2.weight", "b_2": "mlp.fc2.bias",
})
_NORMS = {
    "norm_attn.weight": "layernorm_before.weight", "norm_attn.bias": "layernorm_before.bias",
    "norm_ffn.weight": "layernorm_after.weight", "norm_ffn.bias": "layernorm_after.bias",
}


def build_vit(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "vit"
    d = int(require(config, "hidden_size", arch=arch, name=name))
    H = int(require(config, "num_attention_heads", arch=arch, name=name))
    dh = int(config.get("head_dim") or d // H)
    d_ff = int(require(config, "intermediate_size", arch=arch, name=name))
    eps = float(config.get("layer_norm_eps", 1e-12))
    act = activation_from_name(config.get("hidden_act", "gelu"), arch=arch)
    container, roles = _LEGACY
    found = find_prefix(src, ["encoder.layer.0.attention.attention.query.weight"])
    if found is None:
        modern = find_prefix(src, ["layers.0.attention.q_proj.weight"])
        if modern is not None:
            container, roles, found = *_MODERN, modern
    if found is None:
        found = find_prefix(src, ["embeddings.patch_embeddings.projection.weight"])
    prefix = found[0] if found else ""
    # qkv_bias (default true) gives q/k/v their biases; o and the MLP always have one (Note [absent biases])
    roles = without_roles({**roles, **_NORMS}, () if config.get("qkv_bias", True) else ("b_Q", "b_K", "b_V"))
    n = config.get("num_hidden_layers")
    n = count_layers(src, prefix, container) if n is None else int(n)
    if n == 0:
        raise no_layers(name)

    def layer(i: int) -> LayerSpec:
        names = {role: f"{prefix}{container}.{i}.{key}" for role, key in roles.items()}
        return separate_projections_layer(src, names, i, d=d, H=H, dh=dh, d_ff=d_ff, act=act, eps=eps,
                                          placement=Placement.PRE)

    emb = prefix + "embeddings."
    embeddings = lazy_embeddings(src, {
        # Conv2d weight (d, C, p, p) -> (C*p*p, d): a flattened patch x maps to x @ W.
        "patch_projection": (emb + "patch_embeddings.projection.weight", lambda t: t.reshape(t.shape[0], -1).T),
        "cls_token": (emb + "cls_token", lambda t: t.reshape(1, -1)),  # one extra token row (1, d)
        "position_embedding": (emb + "position_embeddings", lambda t: t.reshape(-1, t.shape[-1])),
        "pooler": (prefix + "pooler.dense.weight", transpose),
    })
    final_norm = layer_norm(src, prefix + "layernorm.weight", prefix + "layernorm.bias", d, eps)
    return TransformerSpec(
        arch=arch, name=name, d_model=d, layers=LayerSequence(n, layer), final_norm=final_norm,
        embeddings=embeddings,  # type: ignore[arg-type]  # a read-on-access Mapping
        config=summary(config, src, n, H, H, dh, d_ff, act.value, prefix, embeddings.names),
        warnings=unexpected_layer_tensors(src, prefix, container, n, roles.values(), arch=arch, name=name),
    )
