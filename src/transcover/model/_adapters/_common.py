"""Pieces every adapter shares: prefix detection, head splitting, norms, activations, layer counts.

Orientation (the spec's row-vector convention, ``x @ W``): a ``torch.nn.Linear`` weight is stored
``(d_out, d_in)`` and enters the spec transposed; GPT-2's ``Conv1D`` weight is stored ``(d_in, d_out)``
and enters as it is.  A projection onto ``H`` heads of width ``d_head`` has ``H * d_head`` output
columns, head ``h`` owning columns ``h*d_head : (h+1)*d_head`` (the ``view(..., H, d_head)`` of every
HF attention module), so :func:`heads_in` reshapes ``(d, H*d_head)`` to ``(H, d, d_head)`` and
:func:`heads_out` reshapes the output projection ``(H*d_head, d)`` to ``(H, d_head, d)``.

Arrays are numpy (files) or torch (modules) alike; the helpers use only operations both have
(``.T``, ``.reshape``, slicing) or the backend-neutral ones of ``.._arrays``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from ..._errors import InputError, UnsupportedArchitectureError
from .._arrays import contiguous, permute
from .._sources import LazyTensors, TensorSource
from .._spec import Activation, AttentionSpec, FFNSpec, LayerSpec, NormKind, NormSpec, Placement, Residual

Tensor = Any  # a numpy array (files) or a torch tensor (modules)

__all__ = [
    "activation_from_name", "find_prefix", "count_layers", "heads_in", "heads_out", "heads_bias",
    "linear_weight", "layer_norm", "require", "no_layers", "lazy_embeddings", "transpose",
    "summary", "unexpected_layer_tensors", "grouped_qkv", "outer_prefix", "present", "layer_count", "plain_ffn",
    "DECODER_ROLES", "decoder_attention", "gated_ffn", "ATTENTION_BIASES", "MLP_BIASES", "without_roles",
    "optional_role", "model_type_key",
]

# HF ``hidden_act`` strings -> the spec's activations (transformers/activations.py, ACT2CLS):
# "gelu_new" and "gelu_pytorch_tanh" are 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3))); "gelu_fast" writes
# sqrt(2/pi) as 0.7978845608 (3.6e-13 relative below it): one model is bounded as tanh GELU (the bounds' rounding pads
# are far wider than that), and two models that differ in it are refused as structurally different (_compare).
_ACTIVATIONS = {
    "gelu": Activation.GELU,
    "gelu_python": Activation.GELU,
    "gelu_new": Activation.GELU_TANH,
    "gelu_pytorch_tanh": Activation.GELU_TANH,
    "gelu_fast": Activation.GELU_TANH,
    "relu": Activation.RELU,
    "silu": Activation.SILU,
    "swish": Activation.SILU,
    "quick_gelu": Activation.QUICK_GELU,  # x * sigmoid(1.702 x) (QuickGELUActivation, CLIP)
    "linear": Activation.IDENTITY,
}


def activation_from_name(name: object, *, arch: str) -> Activation:
    """The spec activation for an HF ``hidden_act`` / ``activation_function`` value."""
    act = _ACTIVATIONS.get(str(name).lower()) if isinstance(name, str) else None
    if act is None:
        raise UnsupportedArchitectureError(
            f"{arch}: activation {name!r} has no exact counterpart; supported: {sorted(_ACTIVATIONS)}"
        )
    return act


def find_prefix(src: TensorSource, suffixes: Iterable[str]) -> tuple[str, str] | None:
    """``(prefix, suffix)`` such that ``prefix + suffix`` is a key of ``src``, shortest prefix first.

    Checkpoints saved from task heads nest the base model (``bert.``, ``transformer.``, ``model.``,
    ``vit.``); the prefix is whatever precedes a key suffix the architecture is known to have.
    """
    best: tuple[str, str] | None = None
    for suffix in suffixes:
        for key in src.keys():
            if key.endswith(suffix) and (not key[: -len(suffix)] or key[: -len(suffix)].endswith(".")):
                prefix = key[: -len(suffix)]
                if best is None or len(prefix) < len(best[0]):
                    best = (prefix, suffix)
    return best


def count_layers(src: TensorSource, prefix: str, container: str) -> int:
    """1 + the largest ``i`` with a key ``{prefix}{container}.{i}.*`` (0 when there is none)."""
    pattern = re.compile(re.escape(prefix + container + ".") + r"(\d+)\.")
    indices = [int(m.group(1)) for k in src.keys() if (m := pattern.match(k))]
    return max(indices) + 1 if indices else 0


def no_layers(name: str) -> InputError:
    return InputError(f"model has no Transformer layers: {name}")


# Note [configuration values]: the adapters convert sizes with int() and divide by head counts; a
# negative, zero, fractional or textual size (or a width the heads do not divide) ended in
# ZeroDivisionError, "math domain error" or a failed reshape -- "internal error", exit 1 -- and a
# NaN eps in a certified NaN (red team of stop 36).  check_config refuses them in one line first.
_SIZE_KEYS = ("n_embd", "n_head", "n_layer", "n_inner", "n_positions", "n_ctx", "hidden_size", "num_attention_heads",
              "num_hidden_layers", "num_key_value_heads", "num_kv_heads", "n_head_kv", "intermediate_size",
              "head_dim", "d_model", "num_heads", "num_layers", "num_decoder_layers", "d_ff", "d_kv",
              "max_position_embeddings", "vocab_size", "num_local_experts", "num_experts_per_tok",
              "moe_intermediate_size", "image_size", "patch_size", "num_channels", "rotary_dim")
_LAYER_KEYS = ("n_layer", "num_hidden_layers", "num_layers", "num_decoder_layers")
_EPS_KEYS = ("layer_norm_epsilon", "layer_norm_eps", "rms_norm_eps", "norm_eps", "norm_epsilon")
_HEADS = (("n_embd", "n_head"), ("hidden_size", "num_attention_heads"), ("d_model", "num_heads"))
_KV = (("num_attention_heads", "num_key_value_heads"), ("num_attention_heads", "num_kv_heads"), ("n_head", "n_head_kv"))


# Keys an adapter reads as numbers, for which a JSON null is no model (transformers' own layers fail on it, or it
# ended here in float(None): "internal error: TypeError", exit 1; red team 168).  A null where a null means
# something (head_dim, num_key_value_heads, intermediate_size: "derive it"; rotary_dim, sliding_window:
# "none") is left to the adapters.
_NOT_NULL = (*_EPS_KEYS, "rope_theta", "partial_rotary_factor", "rotary_pct", "rotary_emb_base",
             "rope_local_base_freq", "layer_norm_eps_2", "relative_attention_num_buckets",
             "relative_attention_max_distance", "query_pre_attn_scalar")

# Note [HF defaults]: a key missing from config.json means the default of transformers' config class for that
# model type, which is not always what an adapter's own fallback was (red team 168: GPT-NeoX rotates a quarter
# of each head by default, Gemma 2 soft-caps its scores at 50 and attends within 4096 tokens, Mixtral's RoPE
# base is 1e6 and its eps 1e-5, Mistral's window 4096, GPT-J rotates 64 coordinates).  These are the
# defaults of transformers 5.25's config classes for the keys whose absence the adapters would otherwise read
# differently; each agrees with transformers 4's (tests/model/test_model_hf_defaults.py checks them against
# the installed classes).  Where a model type's default changed between versions it would be refused instead.
HF_DEFAULTS: dict[str, dict[str, object]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "mistral": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "sliding_window": 4096},
    # Qwen's window is 4096 tokens when use_sliding_window is on and the key is absent (red team 173)
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_window_layers": 28, "use_sliding_window": False, "sliding_window": 4096},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_window_layers": 28, "head_dim": 128, "use_sliding_window": False, "sliding_window": 4096},
    "mixtral": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0},
    "qwen2_moe": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "max_window_layers": 28, "use_sliding_window": False, "sliding_window": 4096},
    "qwen3_moe": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "use_sliding_window": False, "sliding_window": 4096},
    "olmo": {"max_position_embeddings": 2048, "rope_theta": 10000.0},
    "olmo2": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    "falcon": {"max_position_embeddings": 2048, "layer_norm_epsilon": 1e-5, "rope_theta": 10000.0},
    "gpt_neox": {"max_position_embeddings": 2048, "layer_norm_eps": 1e-5},  # rotary_pct: _gpt_neox
    "gptj": {"n_positions": 2048, "layer_norm_epsilon": 1e-5, "rotary_dim": 64},
    "phi": {"max_position_embeddings": 2048, "layer_norm_eps": 1e-5, "rope_theta": 10000.0},
    "gemma": {"max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": 256},
    "gemma2": {"max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": 256,
               "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    "gemma3_text": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "head_dim": 256,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096},
}


def model_type_key(model_type: object) -> str:
    """An HF ``model_type`` (or an ``arch=`` value) as the registry spells its keys: lower case, ``-`` as ``_``."""
    return str(model_type).lower().replace("-", "_")


def _keyed(config: dict) -> dict:
    """``config`` with a textual ``model_type`` spelled as :func:`model_type_key` spells it."""
    model_type = config.get("model_type")
    return {**config, "model_type": model_type_key(model_type)} if isinstance(model_type, str) else dict(config)


def with_hf_defaults(config: dict) -> dict:
    """``config`` with its ``model_type`` spelled as the registry's keys (also inside a Gemma 3 ``text_config``)
    and the keys of :data:`HF_DEFAULTS` it lacks filled in for that model type; a key present (null included) is
    kept as it is (Note [HF defaults]).

    Every rule an adapter chooses by model type (biases, windows, defaults, RoPE) then sees the type that chose
    the adapter: ``"Qwen2"`` was read by the Qwen2 adapter with Llama's bias rules (red team 197).
    """
    out = _keyed(config)
    model_type = out.get("model_type")
    out = {**HF_DEFAULTS.get(model_type, {}), **out} if isinstance(model_type, str) else out
    if model_type == "gemma3" and isinstance(config.get("text_config"), dict):
        out["text_config"] = {**HF_DEFAULTS["gemma3_text"], **_keyed(config["text_config"])}
    return out


def check_config(config: dict, name: str) -> None:
    """Refuse configuration values no model has (Note [configuration values]), in one line naming the field."""
    def bad(key: str, v: object, want: str) -> InputError:
        return InputError(f"configuration of {name}: {key} must be {want}, but got {key}={v!r}")

    def size(key: str, v: object) -> None:
        if isinstance(v, list | tuple):
            for x in v:
                size(key, x)
            return
        ok = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
        least = 0 if key in _LAYER_KEYS else 1  # no layers: the adapters' own "model has no Transformer layers"
        if isinstance(v, bool) or not ok or v < least:
            raise bad(key, v, "a positive integer" if least else "an integer >= 0")

    for key in _SIZE_KEYS:
        if config.get(key) is not None:
            size(key, config[key])
    for key in _NOT_NULL:
        if key in config and config[key] is None:
            raise bad(key, None, "a number (not null)")
    for key in (*_EPS_KEYS, "rope_theta"):  # eps may be 0 (F14 refuses it where a bound needs more); theta may not
        v, strict = config.get(key), key == "rope_theta"
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)
                              or not (0 < v if strict else 0 <= v) or v == float("inf")):
            raise bad(key, v, "a finite number > 0" if strict else "a finite number >= 0")
    if config.get("head_dim") is None and config.get("d_kv") is None:
        for width, heads in _HEADS:
            if config.get(width) is not None and config.get(heads) is not None and int(config[width]) % int(config[heads]):
                raise bad(width, config[width], f"divisible by {heads}={config[heads]!r} (no head_dim is given)")
    for heads, kv in _KV:
        if config.get(heads) is not None and config.get(kv) is not None and int(config[heads]) % int(config[kv]):
            raise bad(heads, config[heads], f"a multiple of {kv}={config[kv]!r}")
    for sub in ("text_config",):  # a multimodal checkpoint's text tower (gemma3)
        if isinstance(config.get(sub), dict):
            check_config(config[sub], f"{name} ({sub})")


def require(config: dict, key: str, *, arch: str, name: str) -> object:
    """``config[key]`` or an InputError saying which configuration field is missing."""
    if key not in config or config[key] is None:
        raise InputError(f"{arch} configuration of {name} lacks {key!r}")
    return config[key]


def linear_weight(src: TensorSource, key: str, d_in: int, d_out: int) -> Tensor:
    """An ``nn.Linear`` weight (stored ``(d_out, d_in)``) in the spec's orientation ``(d_in, d_out)``."""
    return src.get(key, (d_out, d_in)).T


def heads_in(W: Tensor, n_heads: int) -> Tensor:
    """``(d, H*d_head)`` -> ``(H, d, d_head)``: head h owns columns h*d_head:(h+1)*d_head."""
    d, width = W.shape
    return permute(W.reshape(d, n_heads, width // n_heads), 1, 0, 2)


def heads_out(W: Tensor, n_heads: int) -> Tensor:
    """``(H*d_head, d)`` -> ``(H, d_head, d)``: head h owns rows h*d_head:(h+1)*d_head."""
    width, d = W.shape
    return contiguous(W.reshape(n_heads, width // n_heads, d))


def heads_bias(b: Tensor | None, n_heads: int) -> Tensor | None:
    """``(H*d_head,)`` -> ``(H, d_head)``."""
    return None if b is None else contiguous(b.reshape(n_heads, -1))


def layer_norm(
    src: TensorSource, weight_key: str | None, bias_key: str | None, d: int, eps: float,
    kind: NormKind = NormKind.LAYERNORM,
) -> NormSpec:
    """A LayerNorm / RMSNorm whose scale and shift are the tensors ``weight_key`` and ``bias_key``, both required
    (Note [missing biases]); ``None``: the norm has no such parameter (RMSNorm's shift, a non-affine norm)."""
    weight = None if weight_key is None else src.get(weight_key, (d,))
    bias = None if bias_key is None else src.get(bias_key, (d,))
    return NormSpec(kind, weight, bias, float(eps))


def lazy_embeddings(
    src: TensorSource, entries: dict[str, tuple[str, Callable[[Tensor], Tensor] | None]],
) -> LazyTensors:
    """The matrices outside the decomposition, read on access; absent keys are left out.

    Every value is 2-D in the row-vector orientation (a token, position or patch maps to a row, or a
    linear map is ``x @ W``); biases are left out, since ``TransformerSpec.embeddings`` holds matrices.

    ``entries`` maps a role (e.g. ``"token_embedding"``) to ``(key, transform)``; ``transform`` puts
    the stored tensor in the row-vector orientation (``None``: as stored).
    """

    def reader(key: str, transform: Callable[[Tensor], Tensor] | None) -> Callable[[], Tensor]:
        def read() -> Tensor:
            t = src.get(key, too_large="it lies outside the decomposition: --no-embeddings (embeddings=False) "
                                       "leaves the embeddings out")
            return t if transform is None else transform(t)

        return read

    return LazyTensors({
        role: (key, reader(key, transform))
        for role, (key, transform) in entries.items() if key in src
    })


def transpose(t: Tensor) -> Tensor:
    return t.T


def summary(config: dict, src: TensorSource, n: int, H: int, H_kv: int, dh: int, d_ff: int,
             act: str, prefix: str, embedding_names: dict[str, str]) -> dict[str, object]:
    """The spec's ``config``: uniform keys every adapter fills, then the source configuration."""
    return {
        "n_layers": n, "n_heads": H, "n_kv_heads": H_kv, "d_head": dh, "d_ff": d_ff,
        "activation": act, "storage_dtype": src.stored_dtypes(), "prefix": prefix,
        "embedding_names": embedding_names, "source_config": config,
    }


def separate_projections_layer(
    src: TensorSource, names: dict[str, str], i: int, *, d: int, H: int, dh: int, d_ff: int,
    act: Activation, eps: float, placement: Placement, causal: bool = False,
) -> LayerSpec:
    """A block with separate q/k/v/o ``nn.Linear`` projections (biases where named), an un-gated FFN
    and LayerNorms: BERT (post-norm) and ViT (pre-norm) differ only in ``names`` and ``placement``.

    ``names`` maps the roles W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O, W_1, W_2, b_1, b_2,
    norm_attn.weight/.bias, norm_ffn.weight/.bias to checkpoint tensor names; a bias role left out is a
    bias the model does not have (Note [absent biases]).
    """
    k = names.__getitem__
    attn = AttentionSpec(
        W_Q=heads_in(linear_weight(src, k("W_Q"), d, H * dh), H),
        W_K=heads_in(linear_weight(src, k("W_K"), d, H * dh), H),
        W_V=heads_in(linear_weight(src, k("W_V"), d, H * dh), H),
        W_O=heads_out(linear_weight(src, k("W_O"), H * dh, d), H),
        b_Q=heads_bias(optional_role(src, names, "b_Q", (H * dh,)), H),
        b_K=heads_bias(optional_role(src, names, "b_K", (H * dh,)), H),
        b_V=heads_bias(optional_role(src, names, "b_V", (H * dh,)), H),
        b_O=optional_role(src, names, "b_O", (d,)),
        causal=causal,
    )
    ffn = plain_ffn(src, names, d, d_ff, act)
    return LayerSpec(
        index=i, attention=attn, ffn=ffn,
        norm_attn=layer_norm(src, k("norm_attn.weight"), k("norm_attn.bias"), d, eps),
        norm_ffn=layer_norm(src, k("norm_ffn.weight"), k("norm_ffn.bias"), d, eps),
        placement=placement,
        names={r: v for r, v in names.items() if v in src},
    )


def split_fused_qkv(W, b, H: int, *, w_name: str, b_name: str, stacked_rows: bool) -> tuple[dict, dict[str, str]]:
    """Per-head (W, b) for Q, K and V out of one fused projection, and their checkpoint names.

    ``stacked_rows=False``: ``W`` is GPT-2's Conv1D ``(d, 3d) = [W_Q | W_K | W_V]`` (already
    ``x @ W``); ``True``: ``W`` is ``nn.MultiheadAttention.in_proj_weight``, ``(3d, d)`` with the
    three ``nn.Linear`` weights stacked, which are transposed into the ``x @ W`` convention.
    """
    d = W.shape[1] if stacked_rows else W.shape[0]
    parts, names = {}, {}
    for j, role in enumerate("QKV"):
        sl = slice(j * d, (j + 1) * d)
        Wj = W[sl].T if stacked_rows else W[:, sl]
        parts[role] = (heads_in(Wj, H), heads_bias(None if b is None else b[sl], H))
        names[f"W_{role}"] = f"{w_name}[{j * d}:{(j + 1) * d}, :]" if stacked_rows else f"{w_name}[:, {j * d}:{(j + 1) * d}]"
        if b is not None:
            names[f"b_{role}"] = f"{b_name}[{j * d}:{(j + 1) * d}]"
    return parts, names


def unexpected_layer_tensors(
    src: TensorSource, prefix: str, container: str, n_layers: int, expected: Iterable[str],
    harmless: Iterable[str] = (), *, arch: str, name: str,
) -> tuple[str, ...]:
    """One warning line per tensor inside a layer that the adapter does not read.

    A key ``{prefix}{container}.{i}.{rest}`` is unexpected when ``rest`` is none of ``expected``
    (the adapter's roles) and matches none of the ``harmless`` regular expressions (buffers an
    architecture is known to store and not to need, e.g. GPT-2's causal-mask ``attn.bias``), or
    when ``i`` is beyond the ``n_layers`` the configuration declares.  Such a tensor is ignored by
    the decomposition; if the model it came from used it (an extra gate, an extra layer), the
    spec's function differs from the model's, so it must not pass silently.  Tensors outside the
    layers (embeddings, pooler, task heads) are not part of the decomposition and not checked here.
    """
    pattern = re.compile(re.escape(prefix + container + ".") + r"(\d+)\.(.+)")
    expected = set(expected)
    harmless_re = [re.compile(h) for h in harmless]
    out = []
    for key in src.keys():
        m = pattern.fullmatch(key)
        if m is None:
            continue
        i, rest = int(m.group(1)), m.group(2)
        if i >= n_layers:
            out.append(f"unexpected tensor {key!r} in {src.where(key)}: layer {i} is beyond the {n_layers} "
                       f"layers the {arch} configuration of {name} declares; it is ignored")
        elif rest not in expected and not any(h.fullmatch(rest) for h in harmless_re):
            out.append(f"unexpected tensor {key!r} in {src.where(key)}: no {arch} layer role reads it, so the "
                       f"analysed function ignores it (it would differ if the model uses it)")
    return tuple(out)


# -- helpers shared by the decoder adapters (GPT-NeoX, GPT-J, Falcon, OLMo) ----------------------


def grouped_qkv(W: Tensor, b: Tensor | None, n_kv: int, dh: int) -> tuple[tuple[Tensor, Tensor | None], ...]:
    """``((W_Q, b_Q), (W_K, b_K), (W_V, b_V))`` from a fused projection laid out per key/value group.

    ``W`` is ``(d, n_kv * (m + 2) * dh)`` in the ``x @ W`` orientation (``b`` its bias) whose columns
    are, for each group g, ``m`` query heads, then g's key head, then g's value head, each ``dh`` wide:
    query head ``g*m + j`` reads key/value head ``g`` (the spec's ``kv_index``).  This one layout is
    GPT-NeoX's interleaved ``(H, 3, dh)`` (``n_kv = H``, ``m = 1``), Falcon's old fused ``(H, 3, dh)``,
    its multi-query ``[q_0..q_{H-1}, k, v]`` (``n_kv = 1``, ``m = H``) and its new decoder's grouped
    ``(n_kv, H/n_kv + 2, dh)`` view.  Returns ``(H, d, dh)`` / ``(n_kv, d, dh)`` weights and
    ``(H, dh)`` / ``(n_kv, dh)`` biases.
    """
    d, width = W.shape
    m = width // (n_kv * dh) - 2
    W4 = W.reshape(d, n_kv, m + 2, dh)
    b3 = None if b is None else b.reshape(n_kv, m + 2, dh)
    q = (permute(W4[:, :, :m, :].reshape(d, n_kv * m, dh), 1, 0, 2),
         None if b3 is None else contiguous(b3[:, :m, :].reshape(n_kv * m, dh)))
    k = (permute(W4[:, :, m, :], 1, 0, 2), None if b3 is None else contiguous(b3[:, m, :]))
    v = (permute(W4[:, :, m + 1, :], 1, 0, 2), None if b3 is None else contiguous(b3[:, m + 1, :]))
    return q, k, v


def outer_prefix(prefix: str, inner: str) -> str:
    """The prefix of a task model's own tensors (``lm_head``) beside its base model ``inner``
    (``"transformer."``, ``"model."``): ``prefix`` without that trailing component."""
    return prefix[: -len(inner)] if prefix.endswith(inner) else prefix


def decoder_dims(config: dict, *, arch: str, name: str) -> tuple[int, int, int, int, int]:
    """``(d, H, H_kv, d_head, d_ff)`` of a Llama-style decoder configuration: ``hidden_size``,
    ``num_attention_heads``, ``intermediate_size`` required; ``num_key_value_heads`` defaults to H
    (multi-head), ``head_dim`` to ``d // H``."""
    d = int(require(config, "hidden_size", arch=arch, name=name))
    H = int(require(config, "num_attention_heads", arch=arch, name=name))
    H_kv = int(config.get("num_key_value_heads") or H)
    dh = int(config.get("head_dim") or d // H)
    return d, H, H_kv, dh, int(require(config, "intermediate_size", arch=arch, name=name))


def lm_embeddings(src: TensorSource, prefix: str, inner: str, token: str) -> LazyTensors:
    """A causal LM's token embedding ``prefix + token`` and its un-embedding ``lm_head.weight`` (V, d),
    kept beside the base model ``inner`` (:func:`outer_prefix`) and read as ``x @ W^T``."""
    return lazy_embeddings(src, {"token_embedding": (prefix + token, None),
                                 "unembedding": (outer_prefix(prefix, inner) + "lm_head.weight", transpose)})


def shared_norm_parallel_layer(src: TensorSource, names: dict[str, str], i: int, attn: AttentionSpec, *, d: int,
                               d_ff: int, act: Activation, eps: float) -> LayerSpec:
    """``x + attn(LN x) + ffn(LN x)`` with one LayerNorm (roles ``norm.weight``, ``norm.bias``) feeding
    both branches and a plain FFN (GPT-J, Phi: THEORY F21 with ``N_1 = N_2``)."""
    norm = layer_norm(src, names["norm.weight"], names["norm.bias"], d, eps)
    return LayerSpec(index=i, attention=attn, ffn=plain_ffn(src, names, d, d_ff, act), norm_attn=norm,
                     norm_ffn=norm, placement=Placement.PRE, residual=Residual.PARALLEL, names=present(names, src))


def present(names: dict[str, str], src: TensorSource) -> dict[str, str]:
    """The role -> tensor-name entries whose tensor the checkpoint has (a layer's ``names``)."""
    return {role: key for role, key in names.items() if key in src}


def layer_count(config: dict, key: str, src: TensorSource, prefix: str, container: str, name: str) -> int:
    """The configuration's layer count (``key``), else the layers the checkpoint holds; none -> InputError."""
    n = config.get(key)
    n = count_layers(src, prefix, container) if n is None else int(n)
    if n == 0:
        raise no_layers(name)
    return n


def plain_ffn(src: TensorSource, names: dict[str, str], d: int, d_ff: int, act: Activation) -> FFNSpec:
    """``act(x W_1 + b_1) W_2 + b_2`` from the ``nn.Linear`` roles W_1, W_2 (biases b_1, b_2 where named)."""
    return FFNSpec(
        W_1=linear_weight(src, names["W_1"], d, d_ff), W_2=linear_weight(src, names["W_2"], d_ff, d),
        activation=act, b_1=optional_role(src, names, "b_1", (d_ff,)), b_2=optional_role(src, names, "b_2", (d,)),
    )


#: The per-layer tensor names of a Llama-style decoder block (q/k/v/o projections, gated MLP), shared
#: by the Gemma and OLMo 2 adapters; each adds its own normalisation names.
DECODER_ROLES = {
    "W_Q": "self_attn.q_proj.weight", "b_Q": "self_attn.q_proj.bias",
    "W_K": "self_attn.k_proj.weight", "b_K": "self_attn.k_proj.bias",
    "W_V": "self_attn.v_proj.weight", "b_V": "self_attn.v_proj.bias",
    "W_O": "self_attn.o_proj.weight", "b_O": "self_attn.o_proj.bias",
    "W_gate": "mlp.gate_proj.weight", "b_gate": "mlp.gate_proj.bias",
    "W_1": "mlp.up_proj.weight", "b_1": "mlp.up_proj.bias",
    "W_2": "mlp.down_proj.weight", "b_2": "mlp.down_proj.bias",
}


# Note [absent biases]: where the configuration (attention_bias, mlp_bias, qkv_bias, Falcon's bias, ...) or the
# architecture (Qwen2's o_proj, Mistral's projections, every Gemma and OLMo MLP) gives a projection no bias,
# transformers builds ``nn.Linear(..., bias=False)`` and a bias tensor in the checkpoint is an UNEXPECTED key it
# never reads.  Such a tensor was read here as a real bias (red team 195: outputs 0.26-1.48 apart).  The adapter
# leaves its role out of the layer's names (:func:`without_roles`): the spec has no bias there, and the tensor is
# reported by :func:`unexpected_layer_tensors` ("ignores it"; ``--strict`` refuses), as for GPT-J and T5.
#
# Note [missing biases]: the converse.  Where the architecture and its configuration give a projection or a
# LayerNorm its bias (its role is in the layer's names), the tensor is part of the model: a checkpoint without it
# is broken (a deleted key, a shard the index leaves out), not a bias-free variant, and transformers would fill it
# with fresh values.  It was read as zero (``get_optional``), exit 0 with B_b = 0 "exact" even under --strict
# (red team 201); :func:`optional_role` and :func:`layer_norm` now require every tensor they are given a name for,
# so it is refused in one line naming the tensor and its file.
ATTENTION_BIASES = ("b_Q", "b_K", "b_V", "b_O")
MLP_BIASES = ("b_gate", "b_1", "b_2")


def without_roles(roles: dict[str, str], absent: Iterable[str]) -> dict[str, str]:
    """``roles`` less the ``absent`` ones: the biases the model does not have (Note [absent biases])."""
    absent = set(absent)
    return {role: key for role, key in roles.items() if role not in absent}


def optional_role(src: TensorSource, names: dict[str, str], role: str, shape: tuple[int, ...]) -> Tensor | None:
    """The tensor of ``role``, required, if the layer has that role; None for a role the model does not have
    (left out of ``names``: Note [absent biases]).  A role it has but the checkpoint lacks is a WeightError
    (Note [missing biases])."""
    return src.get(names[role], shape) if role in names else None


def decoder_attention(src: TensorSource, names: dict[str, str], *, d: int, H: int, H_kv: int, dh: int,
                      **fields: Any) -> AttentionSpec:
    """Grouped-query attention from separate ``nn.Linear`` q/k/v/o projections (``names``: role ->
    tensor name, roles as in :data:`DECODER_ROLES`); a bias role in ``names`` is required, one missing from
    ``names`` is no bias (Notes [absent biases], [missing biases]).  ``fields`` are the remaining
    :class:`AttentionSpec` fields (causal, rope, scale, ...)."""
    return AttentionSpec(
        W_Q=heads_in(linear_weight(src, names["W_Q"], d, H * dh), H),
        W_K=heads_in(linear_weight(src, names["W_K"], d, H_kv * dh), H_kv),
        W_V=heads_in(linear_weight(src, names["W_V"], d, H_kv * dh), H_kv),
        W_O=heads_out(linear_weight(src, names["W_O"], H * dh, d), H),
        b_Q=heads_bias(optional_role(src, names, "b_Q", (H * dh,)), H),
        b_K=heads_bias(optional_role(src, names, "b_K", (H_kv * dh,)), H_kv),
        b_V=heads_bias(optional_role(src, names, "b_V", (H_kv * dh,)), H_kv),
        b_O=optional_role(src, names, "b_O", (d,)),
        **fields,
    )


def gated_ffn(src: TensorSource, names: dict[str, str], *, d: int, d_ff: int, act: Activation) -> FFNSpec:
    """``(act(x W_gate + b_gate) * (x W_1 + b_1)) W_2 + b_2`` from gate/up/down ``nn.Linear`` weights."""
    return FFNSpec(
        W_1=linear_weight(src, names["W_1"], d, d_ff), W_2=linear_weight(src, names["W_2"], d_ff, d),
        W_gate=linear_weight(src, names["W_gate"], d, d_ff), activation=act,
        b_1=optional_role(src, names, "b_1", (d_ff,)), b_2=optional_role(src, names, "b_2", (d,)),
        b_gate=optional_role(src, names, "b_gate", (d_ff,)),
    )
