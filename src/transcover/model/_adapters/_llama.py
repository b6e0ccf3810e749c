"""Llama (and Mistral / Qwen2, whose decoder layers are Llama's) in the seed's decomposition.

transformers ``models/llama/modeling_llama.py``: ``LlamaDecoderLayer`` is pre-norm and causal,

.. math::

    Y = X + \\mathrm{Attn}(\\mathrm{RMS}_1 X),\\qquad
    Z = Y + W_{down}^T\\big(\\mathrm{SiLU}(W_{gate}^T \\mathrm{RMS}_2 Y) \\odot W_{up}^T \\mathrm{RMS}_2 Y\\big),

``RMS(x) = gamma * x / sqrt(mean(x^2) + eps)`` (``LlamaRMSNorm``), and ``norm`` follows the last layer.
The spec's gated FFN is ``(act(x W_gate) * (x W_1)) W_2``, so ``W_gate = gate_proj``,
``W_1 = up_proj``, ``W_2 = down_proj``.  Attention: ``q_proj`` has ``H * head_dim`` outputs,
``k_proj``/``v_proj`` ``H_kv * head_dim`` (grouped-query; ``repeat_kv`` gives query head ``h`` the
key/value head ``h // (H / H_kv)``, the spec's ``kv_index``), scale ``head_dim ** -0.5``, RoPE with
``rotate_half`` on the whole head dimension and ``inv_freq = theta^(-2i/head_dim)``
(``LlamaRotaryEmbedding.compute_default_rope_parameters``), which is ``RopeSpec``'s layout.
Sliding-window attention (Mistral; Qwen2 layers ``>= max_window_layers`` when
``use_sliding_window``; ``layer_types`` when the config lists them) is the spec's ``window`` mask.
Only the "default" RoPE type is exact in the spec; scaled variants (llama3, linear, yarn, ...)
change the frequencies and are refused rather than approximated.
"""

from __future__ import annotations

from ..._errors import UnsupportedArchitectureError
from .._sources import TensorSource
from .._spec import (
    AttentionSpec, FFNSpec, LayerSequence, LayerSpec, NormKind, Placement, RopeSpec, TransformerSpec,
)
from ._common import (
    activation_from_name, count_layers, find_prefix, heads_bias, heads_in, heads_out, layer_norm,
    lazy_embeddings, linear_weight, no_layers, require, summary, transpose, unexpected_layer_tensors,
)
from ._windows import sliding_windows

__all__ = ["build_llama"]

_ROLES = {
    "W_Q": "self_attn.q_proj.weight", "b_Q": "self_attn.q_proj.bias",
    "W_K": "self_attn.k_proj.weight", "b_K": "self_attn.k_proj.bias",
    "W_V": "self_attn.v_proj.weight", "b_V": "self_attn.v_proj.bias",
    "W_O": "self_attn.o_proj.weight", "b_O": "self_attn.o_proj.bias",
    "W_gate": "mlp.gate_proj.weight", "b_gate": "mlp.gate_proj.bias",
    "W_1": "mlp.up_proj.weight", "b_1": "mlp.up_proj.bias",
    "W_2": "mlp.down_proj.weight", "b_2": "mlp.down_proj.bias",
    "norm_attn.weight": "input_layernorm.weight",
    "norm_ffn.weight": "post_attention_layernorm.weight",
}


def _rope(config: dict, arch: str, dh: int) -> RopeSpec:
    """RoPE from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (4.x)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedArchitectureError(
            f"{arch}: rope_type={rope_type!r} rescales the RoPE frequencies, which the spec's RopeSpec "
            "cannot represent exactly; only 'default' is supported"
        )
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise UnsupportedArchitectureError(f"{arch}: partial_rotary_factor={factor!r} is not supported")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    return RopeSpec(theta=float(theta), rotary_dim=None,
                    max_position=int(config.get("max_position_embeddings") or 2048))


def build_llama(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "llama"
    d = int(require(config, "hidden_size", arch=arch, name=name))
    H = int(require(config, "num_attention_heads", arch=arch, name=name))
    H_kv = int(config.get("num_key_value_heads") or H)
    dh = int(config.get("head_dim") or d // H)
    d_ff = int(require(config, "intermediate_size", arch=arch, name=name))
    eps = float(config.get("rms_norm_eps", 1e-6))
    act = activation_from_name(config.get("hidden_act", "silu"), arch=arch)
    rope = _rope(config, arch, dh)
    found = find_prefix(src, ["layers.0.self_attn.q_proj.weight", "embed_tokens.weight"])
    prefix = found[0] if found else ""
    if any(k.startswith(prefix + "layers.0.self_attn.q_norm") for k in src.keys()):
        raise UnsupportedArchitectureError(f"{arch}: query/key normalisation (q_norm, k_norm) is not supported")
    n = config.get("num_hidden_layers")
    n = count_layers(src, prefix, "layers") if n is None else int(n)
    if n == 0:
        raise no_layers(name)
    # attention_bias / mlp_bias say the biases must be there; Qwen2 stores q/k/v biases without a flag.
    attn_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))

    windows = sliding_windows(config, n, arch=arch, name=name)

    def layer(i: int) -> LayerSpec:
        names = {role: f"{prefix}layers.{i}.{key}" for role, key in _ROLES.items()}

        def bias(role: str, shape: tuple[int, ...], required: bool):
            return src.get(names[role], shape) if required else src.get_optional(names[role], shape)

        attn = AttentionSpec(
            W_Q=heads_in(linear_weight(src, names["W_Q"], d, H * dh), H),
            W_K=heads_in(linear_weight(src, names["W_K"], d, H_kv * dh), H_kv),
            W_V=heads_in(linear_weight(src, names["W_V"], d, H_kv * dh), H_kv),
            W_O=heads_out(linear_weight(src, names["W_O"], H * dh, d), H),
            b_Q=heads_bias(bias("b_Q", (H * dh,), attn_bias), H),
            b_K=heads_bias(bias("b_K", (H_kv * dh,), attn_bias), H_kv),
            b_V=heads_bias(bias("b_V", (H_kv * dh,), attn_bias), H_kv),
            b_O=bias("b_O", (d,), attn_bias),
            causal=True, rope=rope, window=windows[i],
        )
        ffn = FFNSpec(
            W_1=linear_weight(src, names["W_1"], d, d_ff), W_2=linear_weight(src, names["W_2"], d_ff, d),
            W_gate=linear_weight(src, names["W_gate"], d, d_ff), activation=act,
            b_1=bias("b_1", (d_ff,), mlp_bias), b_2=bias("b_2", (d,), mlp_bias),
            b_gate=bias("b_gate", (d_ff,), mlp_bias),
        )
        return LayerSpec(
            index=i, attention=attn, ffn=ffn,
            norm_attn=layer_norm(src, names["norm_attn.weight"], None, d, eps, NormKind.RMSNORM),
            norm_ffn=layer_norm(src, names["norm_ffn.weight"], None, d, eps, NormKind.RMSNORM),
            placement=Placement.PRE,
            names={r: v for r, v in names.items() if v in src},
        )

    # LlamaForCausalLM keeps lm_head beside ``model.``; its weight (V, d) un-embeds as x @ W^T.
    outer = prefix[: -len("model.")] if prefix.endswith("model.") else prefix
    embeddings = lazy_embeddings(src, {
        "token_embedding": (prefix + "embed_tokens.weight", None),
        "unembedding": (outer + "lm_head.weight", transpose),
    })
    final_norm = layer_norm(src, prefix + "norm.weight", None, d, eps, NormKind.RMSNORM)
    out = summary(config, src, n, H, H_kv, dh, d_ff, act.value, prefix, embeddings.names)
    out["rope_theta"] = rope.theta
    if any(w is not None for w in windows):
        out["sliding_window"] = next(w for w in windows if w is not None)
    return TransformerSpec(
        arch=arch, name=name, d_model=d, layers=LayerSequence(n, layer), final_norm=final_norm,
        embeddings=embeddings,  # type: ignore[arg-type]  # a read-on-access Mapping
        config=out,
        # older checkpoints store RoPE's inv_freq buffer; the spec recomputes it from rope_theta
        warnings=unexpected_layer_tensors(src, prefix, "layers", n, _ROLES.values(),
                                          (r"self_attn\.rotary_emb\.inv_freq",), arch=arch, name=name),
    )
