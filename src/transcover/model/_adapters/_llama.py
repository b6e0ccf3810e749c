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
Qwen3 adds ``q_norm``/``k_norm``: an RMSNorm over each head's ``head_dim`` coordinates of the
projected queries and keys, before RoPE (the spec's ``AttentionSpec.q_norm``/``k_norm``, THEORY F23).
Sliding-window attention (Mistral; Qwen2 layers ``>= max_window_layers`` when
``use_sliding_window``; ``layer_types`` when the config lists them) is the spec's ``window`` mask.
RoPE types "default", "linear", "llama3" and "yarn" set fixed frequencies (``_rope_scaling``,
THEORY F22); "dynamic" (NTK) recomputes them from each sequence's length in the forward, and
"longrope" (two factor lists switched by length) is refused.
"""

from __future__ import annotations

from ..._errors import UnsupportedArchitectureError
from .._rope_scaling import rope_from_config
from .._sources import TensorSource
from .._spec import LayerSequence, LayerSpec, NormKind, Placement, TransformerSpec
from ._common import (
    ATTENTION_BIASES, DECODER_ROLES, MLP_BIASES, activation_from_name, decoder_attention, decoder_dims, find_prefix,
    gated_ffn, layer_count, layer_norm, lm_embeddings, summary, unexpected_layer_tensors, without_roles,
)
from ._windows import sliding_windows

__all__ = ["build_llama", "llama_family"]

_ROLES = {
    **DECODER_ROLES,
    "norm_attn.weight": "input_layernorm.weight",
    "norm_ffn.weight": "post_attention_layernorm.weight",
}


# ``architectures`` class-name stems of the model types the adapter reads, for a config.json without model_type
_STEMS = (("Mixtral", "mixtral"), ("Mistral", "mistral"), ("Qwen2Moe", "qwen2_moe"), ("Qwen3Moe", "qwen3_moe"),
          ("Qwen2", "qwen2"), ("Qwen3", "qwen3"))


def llama_family(config: dict) -> str:
    """The model type whose transformers modules compute the checkpoint: ``model_type`` (spelled as the registry's
    keys by ``with_hf_defaults``), else the one its ``architectures`` class names, else "llama"."""
    model_type = config.get("model_type")
    if isinstance(model_type, str):
        return model_type
    stems = " ".join(str(c) for c in config.get("architectures") or [])
    return next((family for stem, family in _STEMS if stem in stems), "llama")


def _absent_biases(config: dict, family: str) -> tuple[str, ...]:
    """The bias roles the model has not, as transformers 5.25's modules of ``family`` build their projections
    (Note [absent biases]); every other bias is required (Note [missing biases]): Llama's ``attention_bias`` and
    ``mlp_bias``; Qwen3 (and Qwen3-MoE) ``attention_bias``, no MLP bias; Mistral and Mixtral no bias at all (their
    modules ignore ``attention_bias``); Qwen2 q/k/v biases always, none on ``o_proj`` or the MLP; Qwen2-MoE the
    same with ``qkv_bias`` (default true) deciding the q/k/v ones."""
    attn, mlp = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
    if family in ("mistral", "mixtral"):
        return (*ATTENTION_BIASES, *MLP_BIASES)
    if family in ("qwen2", "qwen2_moe"):
        qkv = family == "qwen2" or bool(config.get("qkv_bias", True))
        return ("b_O", *MLP_BIASES) if qkv else (*ATTENTION_BIASES, *MLP_BIASES)
    if family in ("qwen3", "qwen3_moe"):
        mlp = False
    return (*(() if attn else ATTENTION_BIASES), *(() if mlp else MLP_BIASES))


def build_llama(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "llama"
    d, H, H_kv, dh, d_ff = decoder_dims(config, arch=arch, name=name)
    eps = float(config.get("rms_norm_eps", 1e-6))
    act = activation_from_name(config.get("hidden_act", "silu"), arch=arch)
    rope, score_factor = rope_from_config(config, arch, dh)  # YaRN's m^2 multiplies every score
    found = find_prefix(src, ["layers.0.self_attn.q_proj.weight", "embed_tokens.weight"])
    prefix = found[0] if found else ""
    # Qwen3 normalises each head's query and key (RMSNorm over head_dim, before RoPE; THEORY F23);
    # OLMo 2 normalises the whole projection, which the spec does not express.
    qk_norm = prefix + "layers.0.self_attn.q_norm.weight" in src
    if qk_norm and src.shape(prefix + "layers.0.self_attn.q_norm.weight") != (dh,):
        raise UnsupportedArchitectureError(
            f"{arch}: q_norm of shape {src.shape(prefix + 'layers.0.self_attn.q_norm.weight')} normalises more than "
            f"one head (d_head={dh}); only per-head query/key normalisation (Qwen3) is supported")
    n = layer_count(config, "num_hidden_layers", src, prefix, "layers", name)
    family = llama_family(config)
    roles = without_roles(_ROLES, _absent_biases(config, family))
    windows = sliding_windows(config, n, family=family, arch=arch, name=name)

    def qk_names(i: int) -> dict[str, str]:
        return {f"{s}_norm.weight": f"{prefix}layers.{i}.self_attn.{s}_norm.weight" for s in "qk"} if qk_norm else {}

    def layer(i: int) -> LayerSpec:
        names = {role: f"{prefix}layers.{i}.{key}" for role, key in roles.items()}
        attn = decoder_attention(
            src, names, d=d, H=H, H_kv=H_kv, dh=dh, causal=True, rope=rope, window=windows[i],
            scale=None if score_factor == 1.0 else score_factor / dh ** 0.5,
            q_norm=layer_norm(src, f"{prefix}layers.{i}.self_attn.q_norm.weight", None, dh, eps, NormKind.RMSNORM)
            if qk_norm else None,
            k_norm=layer_norm(src, f"{prefix}layers.{i}.self_attn.k_norm.weight", None, dh, eps, NormKind.RMSNORM)
            if qk_norm else None,
        )
        ffn = gated_ffn(src, names, d=d, d_ff=d_ff, act=act)
        return LayerSpec(
            index=i, attention=attn, ffn=ffn,
            norm_attn=layer_norm(src, names["norm_attn.weight"], None, d, eps, NormKind.RMSNORM),
            norm_ffn=layer_norm(src, names["norm_ffn.weight"], None, d, eps, NormKind.RMSNORM),
            placement=Placement.PRE,
            names={r: v for r, v in {**names, **qk_names(i)}.items() if v in src},
        )

    # LlamaForCausalLM keeps lm_head beside ``model.``; its weight (V, d) un-embeds as x @ W^T.
    embeddings = lm_embeddings(src, prefix, "model.", "embed_tokens.weight")
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
        warnings=unexpected_layer_tensors(src, prefix, "layers", n, [*roles.values(), *(
            ["self_attn.q_norm.weight", "self_attn.k_norm.weight"] if qk_norm else [])],
                                          (r"self_attn\.rotary_emb\.inv_freq",), arch=arch, name=name),
    )
