"""Encoders whose blocks the decomposition expresses as they are: DistilBERT, CLIP's two towers, Whisper's encoder.

Every one has separate ``nn.Linear`` q/k/v/out projections with biases, softmax scale
``head_dim ** -0.5``, an un-gated two-layer FFN and LayerNorms; they differ in tensor names,
norm placement, activation and what sits outside the layers (transformers 5 modelling code):

* **DistilBERT** (``models/distilbert/modeling_distilbert.py``, ``TransformerBlock``): post-norm,
  ``Y = LN_sa(X + Attn(X))``, ``Z = LN_out(Y + lin2(act(lin1 Y)))``; the embedding LayerNorm
  (word + position embeddings, then ``embeddings.LayerNorm``) is the spec's ``input_norm``.
* **CLIP text tower** (``models/clip/modeling_clip.py``, ``CLIPEncoderLayer``): pre-norm,
  ``Y = X + Attn(LN_1 X)``, ``Z = Y + fc2(act(fc1 LN_2 Y))``, causal attention
  (``CLIPTextTransformer`` builds a causal mask), ``final_layer_norm`` after the last layer;
  ``hidden_act`` "quick_gelu" is ``x sigmoid(1.702 x)``.
* **CLIP vision tower**: the same layers, bidirectional; ``pre_layrnorm`` is applied to the patch +
  class + position embeddings before layer 0 (the spec's ``input_norm``); the last hidden state is
  the last layer's output (``post_layernorm`` acts on the pooled class token only, so it is not
  part of the analysed function; its scale is reported with the embeddings' notes).
* **Whisper encoder** (``models/whisper/modeling_whisper.py``, ``WhisperEncoderLayer``): pre-norm
  (``self_attn_layer_norm``, ``final_layer_norm``), ``k_proj`` without bias, ``encoder.layer_norm``
  after the last layer.  Covered: the encoder's layers and final norm, on the sequence that enters
  layer 0.  Outside: the convolutional front-end (``conv1``, ``conv2`` with GELU, stride 2) and the
  sinusoidal ``embed_positions`` that produce that sequence, and the whole decoder (its
  cross-attention is not self-attention); the convolution kernels are reported as matrices
  outside the decomposition (flattened ``(d_out, d_in * k)``).

A ``CLIPModel`` checkpoint holds both towers; ``arch="clip_text"`` or ``"clip_vision"`` picks one
(``clip`` alone is refused with that advice).  Whisper checkpoints are read with ``arch="whisper"``.
"""

from __future__ import annotations

from ..._errors import InputError
from .._sources import TensorSource
from .._spec import LayerSequence, LayerSpec, Placement, TransformerSpec
from ._common import (
    activation_from_name, count_layers, find_prefix, layer_norm, lazy_embeddings, no_layers, require,
    separate_projections_layer, summary, transpose, unexpected_layer_tensors, without_roles,
)

__all__ = ["build_distilbert", "build_clip_text", "build_clip_vision", "build_clip", "build_whisper_encoder",
           "check_layer_count"]

_DISTILBERT = {
    "W_Q": "attention.q_lin.weight", "b_Q": "attention.q_lin.bias",
    "W_K": "attention.k_lin.weight", "b_K": "attention.k_lin.bias",
    "W_V": "attention.v_lin.weight", "b_V": "attention.v_lin.bias",
    "W_O": "attention.out_lin.weight", "b_O": "attention.out_lin.bias",
    "W_1": "ffn.lin1.weight", "b_1": "ffn.lin1.bias", "W_2": "ffn.lin2.weight", "b_2": "ffn.lin2.bias",
    "norm_attn.weight": "sa_layer_norm.weight", "norm_attn.bias": "sa_layer_norm.bias",
    "norm_ffn.weight": "output_layer_norm.weight", "norm_ffn.bias": "output_layer_norm.bias",
}
_ATTN = {
    "W_Q": "self_attn.q_proj.weight", "b_Q": "self_attn.q_proj.bias",
    "W_K": "self_attn.k_proj.weight", "b_K": "self_attn.k_proj.bias",
    "W_V": "self_attn.v_proj.weight", "b_V": "self_attn.v_proj.bias",
    "W_O": "self_attn.out_proj.weight", "b_O": "self_attn.out_proj.bias",
}
_CLIP = {**_ATTN,
         "W_1": "mlp.fc1.weight", "b_1": "mlp.fc1.bias", "W_2": "mlp.fc2.weight", "b_2": "mlp.fc2.bias",
         "norm_attn.weight": "layer_norm1.weight", "norm_attn.bias": "layer_norm1.bias",
         "norm_ffn.weight": "layer_norm2.weight", "norm_ffn.bias": "layer_norm2.bias"}
# WhisperAttention builds k_proj without a bias (Note [absent biases]); every other bias is required
_WHISPER = without_roles({**_ATTN,
                          "W_1": "fc1.weight", "b_1": "fc1.bias", "W_2": "fc2.weight", "b_2": "fc2.bias",
                          "norm_attn.weight": "self_attn_layer_norm.weight",
                          "norm_attn.bias": "self_attn_layer_norm.bias",
                          "norm_ffn.weight": "final_layer_norm.weight", "norm_ffn.bias": "final_layer_norm.bias"},
                         ("b_K",))


def check_layer_count(src: TensorSource, container: str, n: int, *, arch: str, name: str) -> None:
    """Refuse a configuration whose layer count contradicts the tensors (fewer or more layers stored)."""
    stored = count_layers(src, "", container) if container else 0
    if stored != n:
        raise InputError(f"{arch} configuration of {name} declares {n} layers, but the checkpoint stores "
                         f"{stored} under {container!r}; refused")


def _check_width(src: TensorSource, key: str, d: int, *, arch: str, name: str) -> None:
    """Refuse a hidden size that contradicts the first query projection (one line, before any layer is read)."""
    if key in src and tuple(src.shape(key))[-1] != d:
        raise InputError(f"{arch} configuration of {name} says hidden size {d}, but {key!r} has input width "
                         f"{src.shape(key)[-1]}; refused")


def _preflight(src: TensorSource, container: str, d: int, n: int, *, arch: str, name: str) -> None:
    """The configuration's depth and width against the stored tensors, before any tensor is read."""
    check_layer_count(src, container, n, arch=arch, name=name)
    _check_width(src, f"{container}.0.{_ATTN['W_Q'] if arch != 'distilbert' else _DISTILBERT['W_Q']}", d,
                 arch=arch, name=name)


def _encoder(src: TensorSource, config: dict, name: str, *, arch: str, container: str, roles: dict[str, str],
             d: int, H: int, d_ff: int, n: int, eps: float, act_name: object, placement: Placement,
             causal: bool = False, prefix: str = "", **extra) -> TransformerSpec:
    """The spec of an encoder whose layers sit under ``container`` (``prefix`` is the model's own prefix)."""
    if n == 0:
        raise no_layers(name)
    if d % H:
        raise InputError(f"{arch} configuration of {name}: hidden size {d} is not a multiple of {H} heads")
    act = activation_from_name(act_name, arch=arch)
    dh = d // H

    def layer(i: int) -> LayerSpec:
        names = {role: f"{container}.{i}.{key}" for role, key in roles.items()}
        return separate_projections_layer(src, names, i, d=d, H=H, dh=dh, d_ff=d_ff, act=act, eps=eps,
                                          placement=placement, causal=causal)

    embeddings = lazy_embeddings(src, extra.pop("embeddings"))
    out = summary(config, src, n, H, H, dh, d_ff, act.value, prefix, embeddings.names)
    out.update(extra.pop("notes", {}))
    return TransformerSpec(
        arch=arch, name=name, d_model=d, layers=LayerSequence(n, layer), embeddings=embeddings,  # type: ignore[arg-type]
        config=out, warnings=unexpected_layer_tensors(src, "", container, n, roles.values(), arch=arch, name=name),
        **extra,
    )


def build_distilbert(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "distilbert"
    found = find_prefix(src, ["transformer.layer.0.attention.q_lin.weight", "embeddings.word_embeddings.weight"])
    prefix = found[0] if found else ""
    d = int(require(config, "dim", arch=arch, name=name))
    _preflight(src, prefix + "transformer.layer", d, int(require(config, "n_layers", arch=arch, name=name)),
               arch=arch, name=name)
    eps = 1e-12  # DistilBERT's LayerNorms are built with eps=1e-12 (not configurable)
    emb = prefix + "embeddings."
    return _encoder(
        src, config, name, arch=arch, container=prefix + "transformer.layer", roles=_DISTILBERT, d=d,
        H=int(require(config, "n_heads", arch=arch, name=name)),
        d_ff=int(require(config, "hidden_dim", arch=arch, name=name)),
        n=int(require(config, "n_layers", arch=arch, name=name)), eps=eps,
        act_name=config.get("activation", "gelu"), placement=Placement.POST, prefix=prefix,
        input_norm=layer_norm(src, emb + "LayerNorm.weight", emb + "LayerNorm.bias", d, eps),
        embeddings={"token_embedding": (emb + "word_embeddings.weight", None),
                    "position_embedding": (emb + "position_embeddings.weight", None)},
    )


def _clip_tower(src: TensorSource, config: dict, tower: str) -> tuple[dict, str]:
    """(the tower's configuration, the tower's key prefix) for ``tower`` "text" or "vision".

    A ``CLIPModel`` nests ``text_config``/``vision_config`` and stores ``text_model.*`` and
    ``vision_model.*``; a ``CLIPTextModel``/``CLIPVisionModel`` is one tower, its keys with or
    without the ``<tower>_model.`` prefix (transformers 5 modules drop it from ``state_dict()``).
    """
    cfg = dict(config.get(f"{tower}_config") or config)
    own = f"{tower}_model."
    if any(k.startswith(own) for k in src.keys()):
        return cfg, own
    found = find_prefix(src, ["encoder.layers.0.self_attn.q_proj.weight"])
    return cfg, found[0] if found else ""


def build_clip_text(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "clip_text"
    cfg, prefix = _clip_tower(src, config, "text")
    d = int(require(cfg, "hidden_size", arch=arch, name=name))
    _preflight(src, prefix + "encoder.layers", d, int(require(cfg, "num_hidden_layers", arch=arch, name=name)),
               arch=arch, name=name)
    eps = float(cfg.get("layer_norm_eps", 1e-5))
    return _encoder(
        src, cfg, name, arch=arch, container=prefix + "encoder.layers", roles=_CLIP, d=d,
        H=int(require(cfg, "num_attention_heads", arch=arch, name=name)),
        d_ff=int(require(cfg, "intermediate_size", arch=arch, name=name)),
        n=int(require(cfg, "num_hidden_layers", arch=arch, name=name)), eps=eps,
        act_name=cfg.get("hidden_act", "quick_gelu"), placement=Placement.PRE, causal=True, prefix=prefix,
        final_norm=layer_norm(src, prefix + "final_layer_norm.weight", prefix + "final_layer_norm.bias", d, eps),
        embeddings={"token_embedding": (prefix + "embeddings.token_embedding.weight", None),
                    "position_embedding": (prefix + "embeddings.position_embedding.weight", None),
                    "text_projection": ("text_projection.weight", transpose)},
    )


def build_clip_vision(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "clip_vision"
    cfg, prefix = _clip_tower(src, config, "vision")
    d = int(require(cfg, "hidden_size", arch=arch, name=name))
    _preflight(src, prefix + "encoder.layers", d, int(require(cfg, "num_hidden_layers", arch=arch, name=name)),
               arch=arch, name=name)
    eps = float(cfg.get("layer_norm_eps", 1e-5))
    emb = prefix + "embeddings."
    return _encoder(
        src, cfg, name, arch=arch, container=prefix + "encoder.layers", roles=_CLIP, d=d,
        H=int(require(cfg, "num_attention_heads", arch=arch, name=name)),
        d_ff=int(require(cfg, "intermediate_size", arch=arch, name=name)),
        n=int(require(cfg, "num_hidden_layers", arch=arch, name=name)), eps=eps,
        act_name=cfg.get("hidden_act", "quick_gelu"), placement=Placement.PRE, prefix=prefix,
        input_norm=layer_norm(src, prefix + "pre_layrnorm.weight", prefix + "pre_layrnorm.bias", d, eps),
        embeddings={
            # Conv2d (d, C, p, p) -> (C*p*p, d): a flattened patch x maps to x @ W (as for ViT)
            "patch_projection": (emb + "patch_embedding.weight", lambda t: t.reshape(t.shape[0], -1).T),
            "cls_token": (emb + "class_embedding", lambda t: t.reshape(1, -1)),
            "position_embedding": (emb + "position_embedding.weight", None),
            "visual_projection": ("visual_projection.weight", transpose),
        },
        notes={"outside_decomposition": "post_layernorm acts on the pooled class token only"},
    )


def build_clip(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    raise InputError(f"{name} is a CLIP model with two towers: pass arch='clip_text' or arch='clip_vision' "
                     "(--arch clip_text / --arch clip_vision) to analyse one")


def build_whisper_encoder(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    arch = "whisper"
    found = find_prefix(src, ["encoder.layers.0.self_attn.q_proj.weight", "encoder.conv1.weight"])
    prefix = found[0] if found else ""
    d = int(require(config, "d_model", arch=arch, name=name))
    enc = prefix + "encoder."
    _preflight(src, enc + "layers", d, int(require(config, "encoder_layers", arch=arch, name=name)),
               arch=arch, name=name)
    eps = 1e-5  # WhisperEncoderLayer's nn.LayerNorm default
    return _encoder(
        src, config, name, arch=arch, container=enc + "layers", roles=_WHISPER, d=d,
        H=int(require(config, "encoder_attention_heads", arch=arch, name=name)),
        d_ff=int(require(config, "encoder_ffn_dim", arch=arch, name=name)),
        n=int(require(config, "encoder_layers", arch=arch, name=name)), eps=eps,
        act_name=config.get("activation_function", "gelu"), placement=Placement.PRE, prefix=prefix,
        final_norm=layer_norm(src, enc + "layer_norm.weight", enc + "layer_norm.bias", d, eps),
        embeddings={
            # Conv1d (d_out, d_in, k) flattened to (d_in * k, d_out): one window of the input maps to x @ W
            "conv1": (enc + "conv1.weight", lambda t: t.reshape(t.shape[0], -1).T),
            "conv2": (enc + "conv2.weight", lambda t: t.reshape(t.shape[0], -1).T),
            "position_embedding": (enc + "embed_positions.weight", None),
        },
        notes={"covered": "encoder layers and encoder.layer_norm; the conv front-end, positions and the "
                          "decoder are outside the decomposition"},
    )
