"""BERT (and RoBERTa, whose blocks are BERT's) in the seed's decomposition.

transformers ``models/bert/modeling_bert.py``: ``BertLayer`` is post-norm,

.. math::

    Y = \\mathrm{LN}_1\\big(X + \\mathrm{Attn}(X)\\big),\\qquad
    Z = \\mathrm{LN}_2\\big(Y + W_2^T\\,\\mathrm{act}(W_1^T Y + b_1) + b_2\\big)

with ``Attn`` = ``BertSelfAttention`` (query/key/value ``nn.Linear`` with biases, scale
``1/sqrt(d_head)``) followed by ``BertSelfOutput.dense`` (``W_O``, ``b_O``); ``LN_1`` is
``attention.output.LayerNorm``, ``LN_2`` is ``output.LayerNorm``, ``act`` is ``hidden_act``.
The embedding LayerNorm (``embeddings.LayerNorm``) is the spec's ``input_norm``: it is applied to
word + position + token-type embeddings before layer 0.  ``is_decoder`` makes attention causal.
"""

from __future__ import annotations

from ..._errors import UnsupportedArchitectureError
from .._sources import TensorSource
from .._spec import LayerSequence, LayerSpec, Placement, TransformerSpec
from ._common import (
    separate_projections_layer,
    activation_from_name, count_layers, find_prefix, layer_norm,
    lazy_embeddings, no_layers, require, summary, transpose, unexpected_layer_tensors,
)

__all__ = ["build_bert"]

_LAYER = "encoder.layer.{i}."
_ROLES = {
    "W_Q": "attention.self.query.weight", "b_Q": "attention.self.query.bias",
    "W_K": "attention.self.key.weight", "b_K": "attention.self.key.bias",
    "W_V": "attention.self.value.weight", "b_V": "attention.self.value.bias",
    "W_O": "attention.output.dense.weight", "b_O": "attention.output.dense.bias",
    "norm_attn.weight": "attention.output.LayerNorm.weight",
    "norm_attn.bias": "attention.output.LayerNorm.bias",
    "W_1": "intermediate.dense.weight", "b_1": "intermediate.dense.bias",
    "W_2": "output.dense.weight", "b_2": "output.dense.bias",
    "norm_ffn.weight": "output.LayerNorm.weight", "norm_ffn.bias": "output.LayerNorm.bias",
}


# model types whose position ids start after the padding index (transformers' create_position_ids_from_input_ids),
# spelled as with_hf_defaults spells them ("xlm-roberta" is "xlm_roberta")
_PAD_OFFSET_TYPES = ("roberta", "xlm_roberta")


def _position_padding(config: dict) -> dict:
    """``{"position_padding_idx": p}`` for RoBERTa, whose positions are ``p + 1, p + 2, ...`` over the non-pad
    tokens (``p`` at a pad), not BERT's ``0, 1, ...``; empty for BERT (red team 172: RoBERTa's ids were embedded at
    BERT's rows, every local ball centred at a point the model never computes)."""
    if config.get("model_type") not in _PAD_OFFSET_TYPES:
        return {}
    pad = config.get("pad_token_id", 1)
    return {"position_padding_idx": 1 if pad is None else int(pad)}


def build_bert(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "bert"
    if config.get("add_cross_attention"):
        raise UnsupportedArchitectureError(f"{arch}: cross-attention layers are not supported ({name})")
    pet = config.get("position_embedding_type", "absolute")
    if pet not in (None, "absolute"):
        raise UnsupportedArchitectureError(
            f"{arch}: position_embedding_type={pet!r} adds relative-position terms to the scores; "
            "only 'absolute' is supported"
        )
    d = int(require(config, "hidden_size", arch=arch, name=name))
    H = int(require(config, "num_attention_heads", arch=arch, name=name))
    d_ff = int(require(config, "intermediate_size", arch=arch, name=name))
    eps = float(config.get("layer_norm_eps", 1e-12))
    act = activation_from_name(config.get("hidden_act", "gelu"), arch=arch)
    causal = bool(config.get("is_decoder", False))
    found = find_prefix(src, ["encoder.layer.0.attention.self.query.weight", "embeddings.word_embeddings.weight"])
    prefix = found[0] if found else ""
    n = config.get("num_hidden_layers")
    n = count_layers(src, prefix, "encoder.layer") if n is None else int(n)
    if n == 0:
        raise no_layers(name)
    dh = d // H

    def layer(i: int) -> LayerSpec:
        names = {role: prefix + _LAYER.format(i=i) + key for role, key in _ROLES.items()}
        return separate_projections_layer(src, names, i, d=d, H=H, dh=dh, d_ff=d_ff, act=act, eps=eps,
                                          placement=Placement.POST, causal=causal)

    emb = prefix + "embeddings."
    embeddings = lazy_embeddings(src, {
        "token_embedding": (emb + "word_embeddings.weight", None),
        "position_embedding": (emb + "position_embeddings.weight", None),
        "token_type_embedding": (emb + "token_type_embeddings.weight", None),
        "pooler": (prefix + "pooler.dense.weight", transpose),
    })
    # BertEmbeddings always ends with its LayerNorm: without it the checkpoint is incomplete.
    input_norm = layer_norm(src, emb + "LayerNorm.weight", emb + "LayerNorm.bias", d, eps)
    return TransformerSpec(
        arch=arch, name=name, d_model=d, layers=LayerSequence(n, layer), input_norm=input_norm,
        embeddings=embeddings,  # type: ignore[arg-type]  # a read-on-access Mapping
        config={**summary(config, src, n, H, H, dh, d_ff, act.value, prefix, embeddings.names),
                **_position_padding(config)},
        warnings=unexpected_layer_tensors(src, prefix, "encoder.layer", n, _ROLES.values(), arch=arch, name=name),
    )

