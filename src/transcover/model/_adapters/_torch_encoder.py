"""``torch.nn.TransformerEncoder`` / ``TransformerEncoderLayer`` in the seed's decomposition.

``TransformerEncoderLayer._sa_block`` runs ``nn.MultiheadAttention``: ``in_proj_weight`` is the fused
``[W_Q; W_K; W_V]`` stored ``(3d, d)`` (``F._in_projection_packed`` chunks its output in three),
``in_proj_bias`` ``(3d,)``, ``out_proj`` is ``W_O``; heads are ``view(T, H, d_head)`` blocks, scale
``1/sqrt(d_head)``.  ``_ff_block`` is ``linear2(activation(linear1(x)))``.  Placement:
``norm_first=True``: ``x + sa(norm1(x))``, ``x + ff(norm2(x))`` (PRE); else
``norm1(x + sa(x))``, ``norm2(x + ff(x))`` (POST).  ``TransformerEncoder.norm`` is the final norm.

Note [encoder fast path]: in eval mode without gradients, torch may run the fused
``torch._transformer_encoder_layer_fwd``, which knows only "relu" and "gelu" and computes an
``nn.GELU(approximate="tanh")`` activation as exact GELU.  The spec follows the module's own
definition (``_sa_block``/``_ff_block``, the path taken in training), i.e. the tanh GELU.

The module carries what its tensors cannot say (heads, placement, activation, eps); from a
safetensors file that information comes from the ``transcover_config`` metadata, whose fields are
those :func:`torch_encoder_config` returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._errors import InputError, UnsupportedArchitectureError
from .._sources import TensorSource
from .._spec import (
    Activation, AttentionSpec, LayerSequence, LayerSpec, NormKind, NormSpec, Placement, TransformerSpec,
)
from ._common import (
    split_fused_qkv,
    count_layers, heads_out, layer_norm, linear_weight, no_layers, optional_role, plain_ffn, require,
    summary, unexpected_layer_tensors,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["build_torch_encoder", "torch_encoder_config"]

_ARCH = "torch_encoder"
# role -> layer-relative parameter name (weights always, the rest where the layer has them)
_ROLES = {"W_O": "self_attn.out_proj.weight", "b_O": "self_attn.out_proj.bias", "W_1": "linear1.weight",
          "b_1": "linear1.bias", "W_2": "linear2.weight", "b_2": "linear2.bias",
          "norm_attn.weight": "norm1.weight", "norm_attn.bias": "norm1.bias",
          "norm_ffn.weight": "norm2.weight", "norm_ffn.bias": "norm2.bias"}


def exact_type(mod: object, base: type, where: str, base_name: str, *also: type) -> None:
    """Refuse ``mod`` unless its type is exactly ``base`` (or one of ``also``): a subclass may compute something
    else (red team 210: a LoRA ``nn.Linear`` subclass was certified as its base weight, 0.0 against 20.15)."""
    kind = type(mod)
    if kind is base or kind in also:
        return
    if "quantized" in kind.__module__:
        raise UnsupportedArchitectureError(
            f"{where} is a quantised {kind.__module__}.{kind.__qualname__}: its weights are packed integers, not "
            f"the float {base_name} weights transcover reads; analyse the float model (before quantize_dynamic)")
    raise UnsupportedArchitectureError(
        f"{where}: a subclass of {base_name} ({kind.__qualname__}) may compute something else: transcover reads "
        f"only {base_name} itself; rebuild the model with {base_name} or name its tensors' roles (roles=)")


# every layer-relative tensor a role reads
_READ = frozenset(_ROLES.values()) | {"self_attn.in_proj_weight", "self_attn.in_proj_bias"}


def _activation(fn: object) -> Activation:
    """The spec activation of a ``TransformerEncoderLayer.activation`` (function, module or string)."""
    import torch
    from torch import nn

    if isinstance(fn, str):
        table = {"relu": Activation.RELU, "gelu": Activation.GELU}
        if fn in table:
            return table[fn]
    elif fn in (torch.relu, nn.functional.relu) or type(fn) is nn.ReLU:  # exact types: red team 210
        return Activation.RELU
    elif fn is nn.functional.gelu:
        return Activation.GELU
    elif type(fn) is nn.GELU:
        return Activation.GELU_TANH if fn.approximate == "tanh" else Activation.GELU
    elif fn is nn.functional.silu or type(fn) is nn.SiLU:
        return Activation.SILU
    raise UnsupportedArchitectureError(
        f"{_ARCH}: activation {fn!r} has no exact counterpart; use relu, gelu or silu"
    )


def _norm(mod: object, where: str, dtype: object) -> tuple[str, float]:
    """``(kind, eps)`` of a norm submodule: ``nn.LayerNorm`` / ``nn.RMSNorm`` over the last dimension, or
    ``nn.Identity`` (kind ``"Identity"``, eps 0); anything else refused, naming the submodule.

    ``nn.RMSNorm(eps=None)`` divides by ``sqrt(mean(x^2) + finfo(x.dtype).eps)``: the eps of the dtype the
    module runs in, its parameters' (``dtype``), which is what is recorded.
    """
    import torch
    from torch import nn

    if type(mod) is nn.Identity:
        return "Identity", 0.0
    if type(mod) not in (nn.LayerNorm, nn.RMSNorm):
        raise UnsupportedArchitectureError(
            f"{_ARCH}: {where} is {type(mod).__name__}; supported: nn.LayerNorm, nn.RMSNorm, nn.Identity")
    if len(mod.normalized_shape) != 1:
        raise UnsupportedArchitectureError(
            f"{_ARCH}: {where} normalises over {tuple(mod.normalized_shape)}; only the last dimension is supported")
    eps = mod.eps if mod.eps is not None else torch.finfo(dtype).eps
    return type(mod).__name__, float(eps)


def _check_submodules(layer: nn.Module, where: str) -> None:
    """Refuse, naming it, a submodule the decomposition does not read as the layer's forward uses it."""
    from torch import nn

    from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

    exact_type(layer, nn.TransformerEncoderLayer, f"{_ARCH}: {where}", "nn.TransformerEncoderLayer")
    sa = layer.self_attn
    if not isinstance(sa, nn.MultiheadAttention):
        raise UnsupportedArchitectureError(f"{_ARCH}: {where}.self_attn is {type(sa).__name__}; supported: "
                                           "nn.MultiheadAttention")
    exact_type(sa, nn.MultiheadAttention, f"{_ARCH}: {where}.self_attn", "nn.MultiheadAttention")
    if not sa._qkv_same_embed_dim or sa.in_proj_weight is None:
        raise UnsupportedArchitectureError(f"{_ARCH}: {where}.self_attn has separate q/k/v projections (kdim or vdim "
                                           "other than embed_dim); only the packed in_proj_weight is supported")
    if sa.bias_k is not None or sa.add_zero_attn:
        raise UnsupportedArchitectureError(
            f"{_ARCH}: MultiheadAttention with add_bias_kv or add_zero_attn adds a key; not supported"
        )
    for sub, mod in (("self_attn.out_proj", sa.out_proj), ("linear1", layer.linear1), ("linear2", layer.linear2)):
        if not isinstance(mod, nn.Linear) and "quantized" not in type(mod).__module__:
            raise UnsupportedArchitectureError(f"{_ARCH}: {where}.{sub} is {type(mod).__name__}; supported: nn.Linear")
        # MultiheadAttention's own out_proj is a NonDynamicallyQuantizableLinear: nn.Linear with another name
        exact_type(mod, nn.Linear, f"{_ARCH}: {where}.{sub}", "nn.Linear", NonDynamicallyQuantizableLinear)


def torch_encoder_config(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """(state dict with keys ``layers.N.*`` and ``norm.*``, configuration) of an encoder (layer).

    Raises:
        UnsupportedArchitectureError: extra key/value biases, zero attention, unequal layers, or a submodule
            other than the ones the decomposition reads (named in the message).
    """
    from torch import nn

    if isinstance(module, nn.TransformerEncoderLayer):
        layers = [module]
        state = {f"layers.0.{k}": v for k, v in module.state_dict().items()}
        final = None
    else:
        layers = list(module.layers)
        state = dict(module.state_dict())
        final = module.norm
    per_layer = []
    for i, layer in enumerate(layers):
        where = f"layers.{i}" if len(layers) > 1 or final is not None else "layer"
        _check_submodules(layer, where)
        dtype = layer.self_attn.in_proj_weight.dtype
        (kind1, eps1), (kind2, eps2) = (_norm(getattr(layer, k), f"{where}.{k}", dtype) for k in ("norm1", "norm2"))
        per_layer.append({
            "n_heads": int(layer.self_attn.num_heads), "norm_first": bool(layer.norm_first),
            "activation": _activation(layer.activation).value,
            "layer_norm_eps": eps1, "layer_norm_eps_2": eps2, "norm_kind": kind1, "norm_kind_2": kind2,
            # only the tensors a role reads: any other (a LoRA factor) is an unexpected tensor (Note [recorded
            # parameters]; red team 210: every key was recorded, so none was ever reported)
            "parameters": sorted(k for k in layer.state_dict() if k in _READ),
        })
    if any(p != per_layer[0] for p in per_layer):
        raise UnsupportedArchitectureError(f"{_ARCH}: layers differ in heads, placement, activation, norms or "
                                           "parameters (biases)")
    config: dict[str, object] = dict(per_layer[0]) if per_layer else {}
    config["n_layers"] = len(layers)
    config["final_norm_eps"] = config["final_norm_kind"] = None
    if final is not None:
        dtype = layers[0].self_attn.in_proj_weight.dtype if layers else None
        config["final_norm_kind"], config["final_norm_eps"] = _norm(final, "norm", dtype)
        config["final_norm_parameters"] = sorted(final.state_dict())
    return state, config


_KINDS = {"LayerNorm": NormKind.LAYERNORM, "RMSNorm": NormKind.RMSNORM, "Identity": NormKind.NONE}


# Note [recorded parameters]: nn.LayerNorm(elementwise_affine=False) has no weight and bias, and torch >= 2.1's
# ``bias=False`` (TransformerEncoderLayer, nn.LayerNorm, nn.Linear) drops the biases, so the tensors alone cannot
# tell a bias-free layer from a checkpoint whose biases were lost.  torch_encoder_config records the parameters a
# layer (``parameters``: those a role reads, so any other is reported as an unexpected tensor, red team 210) and the
# final norm (``final_norm_parameters``) have; each is then required (Note [missing biases]: refused in one line
# when missing, not read as zero) and no other is read.  A file written before the
# record: the parameters layer 0 stores (and those stored under ``norm.``), which every layer must then hold.


def _parameters(src: TensorSource, config: dict, field: str, stored_under: str, name: str) -> frozenset[str]:
    """The parameter names (relative to ``stored_under``) the configuration records in ``field``, else those
    ``src`` stores under ``stored_under`` (Note [recorded parameters])."""
    recorded = config.get(field)
    if recorded is None:
        return frozenset(k[len(stored_under):] for k in src.keys() if k.startswith(stored_under))
    if not (isinstance(recorded, list) and all(isinstance(k, str) for k in recorded)):
        raise InputError(f"{_ARCH} configuration of {name}: {field} must be a list of parameter names, "
                         f"but got {field}={recorded!r}")
    return frozenset(recorded)


def _norm_spec(src: TensorSource, key: str, kind: object, eps: object, d: int, field: str, name: str,
               have: frozenset[str], rel: str) -> NormSpec:
    """The norm ``key`` (``layers.N.norm1``, ``norm``) of kind ``kind`` (a ``_KINDS`` name) and ``eps``; its
    parameters are those of ``have``, where the norm is named ``rel`` ("" when ``have`` is the norm's own)."""
    if kind not in _KINDS:
        raise InputError(f"{_ARCH} configuration of {name}: {field} must be one of {sorted(_KINDS)}, "
                         f"but got {field}={kind!r}")
    if kind == "Identity":
        return NormSpec(NormKind.NONE)
    weight, bias = (f"{key}.{p}" if (f"{rel}.{p}" if rel else p) in have else None for p in ("weight", "bias"))
    bias = bias if kind == "LayerNorm" else None
    return layer_norm(src, weight, bias, d, eps, _KINDS[kind])  # type: ignore[arg-type]


def build_torch_encoder(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    n = config.get("n_layers")
    n = count_layers(src, "", "layers") if n is None else int(n)
    if n == 0:
        raise no_layers(name)
    H = int(require(config, "n_heads", arch=_ARCH, name=name))
    d = src.shape("layers.0.self_attn.in_proj_weight")[1] if "layers.0.self_attn.in_proj_weight" in src \
        else int(require(config, "d_model", arch=_ARCH, name=name))
    d_ff = src.shape("layers.0.linear1.weight")[0] if "layers.0.linear1.weight" in src \
        else int(require(config, "d_ff", arch=_ARCH, name=name))
    dh = d // H
    act = Activation(str(require(config, "activation", arch=_ARCH, name=name)))
    placement = Placement.PRE if config.get("norm_first") else Placement.POST
    eps1 = float(config.get("layer_norm_eps", 1e-5))
    eps2 = float(config.get("layer_norm_eps_2", eps1))
    # files written before the norms' kinds were recorded hold LayerNorms
    kind1 = config.get("norm_kind", "LayerNorm")
    kind2 = config.get("norm_kind_2", kind1)

    have = _parameters(src, config, "parameters", "layers.0.", name)  # Note [recorded parameters]

    def layer(i: int) -> LayerSpec:
        p = f"layers.{i}."
        qkv_w, qkv_b = p + "self_attn.in_proj_weight", p + "self_attn.in_proj_bias"
        W = src.get(qkv_w, (3 * d, d))  # (3d, d) = [W_Q; W_K; W_V] as nn.Linear weights
        b = optional_role(src, {"b": qkv_b} if "self_attn.in_proj_bias" in have else {}, "b", (3 * d,))
        heads, names = split_fused_qkv(W, b, H, w_name=qkv_w, b_name=qkv_b, stacked_rows=True)
        keys = {role: p + rest for role, rest in _ROLES.items() if rest in have or role.startswith("W_")}
        names.update(keys)
        attn = AttentionSpec(
            W_Q=heads["Q"][0], W_K=heads["K"][0], W_V=heads["V"][0],
            W_O=heads_out(linear_weight(src, keys["W_O"], d, d), H),
            b_Q=heads["Q"][1], b_K=heads["K"][1], b_V=heads["V"][1],
            b_O=optional_role(src, keys, "b_O", (d,)),
        )
        return LayerSpec(
            index=i, attention=attn, ffn=plain_ffn(src, keys, d, d_ff, act),
            norm_attn=_norm_spec(src, p + "norm1", kind1, eps1, d, "norm_kind", name, have, "norm1"),
            norm_ffn=_norm_spec(src, p + "norm2", kind2, eps2, d, "norm_kind_2", name, have, "norm2"),
            placement=placement, names=names,
        )

    final_norm = None
    kind = config.get("final_norm_kind")
    # the recorded eps as it is: 0.0 is a LayerNorm without a variance floor (red team 168: `or 1e-5` read it
    # as 1e-5); a bound that needs eps > 0 refuses it downstream (F14), as for any other family
    final_eps = config.get("final_norm_eps")
    final_eps = 1e-5 if final_eps is None else final_eps
    if kind is not None:
        final_norm = _norm_spec(src, "norm", kind, final_eps, d, "final_norm_kind", name,
                                _parameters(src, config, "final_norm_parameters", "norm.", name), "")
    elif "norm.weight" in src:
        final_norm = layer_norm(src, "norm.weight", "norm.bias", d, final_eps)
    return TransformerSpec(
        arch=_ARCH, name=name, d_model=d, layers=LayerSequence(n, layer), final_norm=final_norm,
        config=summary(config, src, n, H, H, dh, d_ff, act.value, "", {}),
        warnings=unexpected_layer_tensors(src, "", "layers", n, have, arch=_ARCH, name=name),
    )
