"""T5's encoder (T5EncoderModel, and the encoder of T5ForConditionalGeneration) in the decomposition.

transformers ``models/t5/modeling_t5.py``: ``T5Block`` of the encoder is pre-norm,

.. math::

    Y = X + \\mathrm{Attn}(\\mathrm{RMS}_1 X),\\qquad Z = Y + \\mathrm{FF}(\\mathrm{RMS}_2 Y),

``RMS(x) = gamma * x / sqrt(mean(x^2) + eps)`` (``T5LayerNorm``: no mean subtraction, no shift), and
``encoder.final_layer_norm`` follows the last block.  ``T5Attention`` scores are ``q k^T`` with
*no* ``1/sqrt(d_head)`` (the spec's ``scale = 1``) plus a relative position bias: layer 0's
``relative_attention_bias`` table ``(num_buckets, H)`` read at T5's bucket of ``j - i``; the encoder
computes it once and every block adds the same bias (the spec's ``RelativeBiasSpec``, shared by
all layers; THEORY F28).  No projection has a bias.  The FFN is ``wo(act(wi(x)))`` (T5: ReLU) or,
gated (T5 v1.1, mT5, Flan-T5: ``feed_forward_proj = "gated-gelu"``), ``wo(act(wi_0(x)) * wi_1(x))``,
the spec's gated FFN with ``W_gate = wi_0``, ``W_1 = wi_1``, ``W_2 = wo``.

The decoder (causal self-attention *and* cross-attention to the encoder's output) is not read:
cross-attention makes every block a function of two sequences, outside the decomposition.
"""

from __future__ import annotations

from ..._errors import UnsupportedArchitectureError
from .._sources import TensorSource
from .._spec import (
    AttentionSpec, FFNSpec, LayerSequence, LayerSpec, NormKind, Placement, RelativeBiasSpec, TransformerSpec,
)
from ._common import (
    activation_from_name, count_layers, find_prefix, heads_in, heads_out, layer_norm, lazy_embeddings,
    linear_weight, no_layers, require, summary, transpose, unexpected_layer_tensors,
)

__all__ = ["build_t5", "DECODER_REASON"]

#: Why the decoder is not analysed (one line, shown as a warning and in the support table).
DECODER_REASON = ("its blocks cross-attend to the encoder's output, a second input sequence that is "
                  "outside the decomposition (every bound would need it)")

_ROLES = {
    "W_Q": "layer.0.SelfAttention.q.weight", "W_K": "layer.0.SelfAttention.k.weight",
    "W_V": "layer.0.SelfAttention.v.weight", "W_O": "layer.0.SelfAttention.o.weight",
    "norm_attn.weight": "layer.0.layer_norm.weight", "norm_ffn.weight": "layer.1.layer_norm.weight",
}
_PLAIN = {"W_1": "layer.1.DenseReluDense.wi.weight", "W_2": "layer.1.DenseReluDense.wo.weight"}
_GATED = {"W_gate": "layer.1.DenseReluDense.wi_0.weight", "W_1": "layer.1.DenseReluDense.wi_1.weight",
          "W_2": "layer.1.DenseReluDense.wo.weight"}
_TABLE = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"


def _feed_forward(config: dict, arch: str):  # noqa: ANN202
    """(gated, activation) from ``feed_forward_proj`` ("relu", "gated-gelu", "gated-silu", ...)."""
    proj = str(config.get("feed_forward_proj", "relu"))
    gated = proj.startswith("gated-")
    # T5Config maps "gated-gelu" to dense_act_fn "gelu_new" (the tanh form); a config may state it
    act_name = config.get("dense_act_fn") or ("gelu_new" if proj == "gated-gelu" else proj.split("-")[-1])
    return gated, activation_from_name(act_name, arch=arch)


def build_t5(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "t5"
    d = int(require(config, "d_model", arch=arch, name=name))
    H = int(require(config, "num_heads", arch=arch, name=name))
    dh = int(require(config, "d_kv", arch=arch, name=name))
    d_ff = int(require(config, "d_ff", arch=arch, name=name))
    eps = float(config.get("layer_norm_epsilon", 1e-6))
    gated, act = _feed_forward(config, arch)
    found = find_prefix(src, ["encoder." + _TABLE, _TABLE])
    if found is None:
        raise UnsupportedArchitectureError(
            f"{arch}: no encoder relative_attention_bias table ({_TABLE}) in {name}; only T5's encoder is read "
            f"(the decoder: {DECODER_REASON})")
    prefix = found[0] + ("encoder." if found[1].startswith("encoder.") else "")
    n = count_layers(src, prefix, "block")
    declared = config.get("num_layers")
    if declared is not None and int(declared) != n:
        raise UnsupportedArchitectureError(
            f"{arch}: the configuration of {name} declares num_layers={declared} but the encoder has {n} blocks")
    if n == 0:
        raise no_layers(name)
    n_buckets = int(config.get("relative_attention_num_buckets", 32))
    table = src.get(prefix + _TABLE, (n_buckets, H))
    bias = RelativeBiasSpec(table, max_distance=int(config.get("relative_attention_max_distance", 128)),
                            bidirectional=True)  # the encoder's bias is bidirectional (is_decoder=False)
    ffn_roles = _GATED if gated else _PLAIN
    own = [k for k in src.keys() if k.startswith(prefix + "block.") and k.endswith("relative_attention_bias.weight")
           and not k.startswith(prefix + "block.0.")]
    if own:  # UMT5 gives every block its own table; T5 shares layer 0's (the spec's one bias)
        raise UnsupportedArchitectureError(f"{arch}: {own[0]!r} is a per-block relative position bias table; "
                                           "T5 shares layer 0's, and per-block tables are not read")

    def layer(i: int) -> LayerSpec:
        names = {role: f"{prefix}block.{i}.{key}" for role, key in {**_ROLES, **ffn_roles}.items()}
        attn = AttentionSpec(
            W_Q=heads_in(linear_weight(src, names["W_Q"], d, H * dh), H),
            W_K=heads_in(linear_weight(src, names["W_K"], d, H * dh), H),
            W_V=heads_in(linear_weight(src, names["W_V"], d, H * dh), H),
            W_O=heads_out(linear_weight(src, names["W_O"], H * dh, d), H),
            scale=1.0, position_bias=bias,  # T5 does not scale its scores (THEORY F28)
        )
        ffn = FFNSpec(W_1=linear_weight(src, names["W_1"], d, d_ff), W_2=linear_weight(src, names["W_2"], d_ff, d),
                      W_gate=linear_weight(src, names["W_gate"], d, d_ff) if gated else None, activation=act)
        return LayerSpec(
            index=i, attention=attn, ffn=ffn,
            norm_attn=layer_norm(src, names["norm_attn.weight"], None, d, eps, NormKind.RMSNORM),
            norm_ffn=layer_norm(src, names["norm_ffn.weight"], None, d, eps, NormKind.RMSNORM),
            placement=Placement.PRE,
            names={**{r: v for r, v in names.items() if v in src},
                   **({"position_bias": prefix + _TABLE} if i == 0 else {})},
        )

    outer = prefix[: -len("encoder.")] if prefix.endswith("encoder.") else prefix
    embeddings = lazy_embeddings(src, {
        "token_embedding": (outer + "shared.weight", None),
        "unembedding": (outer + "lm_head.weight", transpose),
    })
    out = summary(config, src, n, H, H, dh, d_ff, act.value, prefix, embeddings.names)
    out["relative_attention_num_buckets"] = n_buckets
    warnings = unexpected_layer_tensors(src, prefix, "block", n, [*_ROLES.values(), *ffn_roles.values()],
                                        (r"layer\.0\.SelfAttention\.relative_attention_bias\.weight",),
                                        arch=arch, name=name)
    if any(k.startswith(outer + "decoder.") for k in src.keys()):
        warnings += (f"{name}: the T5 decoder is not analysed: {DECODER_REASON}; the spec is the encoder",)
    return TransformerSpec(
        arch=arch, name=name, d_model=d, layers=LayerSequence(n, layer),
        final_norm=layer_norm(src, prefix + "final_layer_norm.weight", None, d, eps, NormKind.RMSNORM),
        embeddings=embeddings,  # type: ignore[arg-type]  # a read-on-access Mapping
        config=out, warnings=warnings,
    )
