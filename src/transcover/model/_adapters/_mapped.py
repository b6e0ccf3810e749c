"""A layout no adapter knows, read through a mapping file that names the role of each tensor.

The file (JSON; ``--roles roles.json``, ``load(..., roles=...)``, or ``transcover_roles.json``
beside the weights) describes blocks of the decomposition's form (separate q/k/v/o projections,
an FFN, gated or not, two norms per layer)::

    {
      "layers": "blocks.{i}.",              # the prefix of layer i's tensors ({i} = 0, 1, ...)
      "n_heads": 4, "n_kv_heads": 2,        # n_kv_heads, d_head optional (d_head = width / n_heads)
      "placement": "pre",                   # or "post"
      "norm": "rmsnorm", "eps": 1e-5,       # or "layernorm"
      "activation": "silu",                 # an HF hidden_act name (gelu, gelu_new, relu, silu, ...)
      "causal": true, "rope_theta": 10000.0, "max_position": 2048, "window": null,
      "orientation": "linear",              # "linear": weights stored (d_out, d_in); "conv1d": (d_in, d_out)
      "roles": {"W_Q": "attn.wq.weight", "W_K": "attn.wk.weight", "W_V": "attn.wv.weight",
                "W_O": "attn.wo.weight", "W_gate": "ffn.w1.weight", "W_1": "ffn.w3.weight",
                "W_2": "ffn.w2.weight", "norm_attn.weight": "attn_norm.weight",
                "norm_ffn.weight": "ffn_norm.weight"},
      "final_norm": {"weight": "norm.weight"},   # optional; "input_norm" likewise
      "embeddings": {"token_embedding": "tok.weight"}
    }

A role's value is a tensor name relative to the layer prefix, or ``"re:<regex>"``, which must match
exactly one of that layer's tensor names (full match).  Roles: ``W_Q W_K W_V W_O W_1 W_2`` (required),
``W_gate``, the biases ``b_Q b_K b_V b_O b_1 b_2 b_gate`` and ``norm_attn.weight/.bias``,
``norm_ffn.weight/.bias`` (optional).  Everything the forward pass reads is named by the file:
nothing is guessed (``placement``, ``norm``, ``eps``, ``activation``, ``causal`` and ``rope_theta`` must be stated;
``null``/``"none"`` say none), a declared norm without named tensors is the non-parametric one (gain 1), and a
tensor no role names is a warning (``strict``: refused) in every layer, and outside them where it is a vector.
"""

from __future__ import annotations

import math
import re

from ..._errors import InputError
from .._sources import TensorSource
from .._spec import (
    AttentionSpec, FFNSpec, LayerSequence, LayerSpec, NormKind, NormSpec, Placement, RopeSpec, TransformerSpec,
)
from ._common import activation_from_name, heads_bias, heads_in, heads_out, lazy_embeddings, summary

__all__ = ["build_mapped", "ROLE_NAMES"]

_REQUIRED = ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2")
ROLE_NAMES = _REQUIRED + ("W_gate", "b_Q", "b_K", "b_V", "b_O", "b_1", "b_2", "b_gate",
                          "norm_attn.weight", "norm_attn.bias", "norm_ffn.weight", "norm_ffn.bias")
_KEYS = {"layers", "n_layers", "n_heads", "n_kv_heads", "d_head", "placement", "norm", "eps", "activation",
         "causal", "rope_theta", "max_position", "window", "orientation", "roles", "input_norm", "final_norm",
         "embeddings", "scale"}


def _bad(name: str, what: str) -> InputError:
    return InputError(f"roles mapping for {name}: {what}")


def _enum(cls, value: object, field: str, name: str):
    try:
        return cls(value)
    except ValueError:
        raise _bad(name, f"{field}={value!r}; expected one of {[m.value for m in cls]}") from None


def _number(config: dict, key: str, name: str, default: object = None, *, integer: bool = False,
            positive: bool = True) -> object:
    """``config[key]`` checked: a finite number (an ``int`` where ``integer``), > 0 (``positive``) or >= 0, or
    ``default`` where absent or null.  A string or a negative value reached ``float()``/``int()`` and stopped
    as an internal error (red team 37g)."""
    v = config.get(key)
    if v is None:
        return default
    ok = not isinstance(v, bool) and isinstance(v, int if integer else (int, float)) and math.isfinite(v) and \
        (v > 0 if positive else v >= 0)
    if not ok:
        kind = "an integer" if integer else "a finite number"
        raise _bad(name, f"'{key}' must be {kind} {'> 0' if positive else '>= 0'}, got {v!r}")
    return v if integer else float(v)


def _layer_names(src: TensorSource, prefix: str, roles: dict[str, str], name: str) -> dict[str, str]:
    """role -> full tensor name in layer ``prefix`` (exact names, or ``re:`` patterns matching one key)."""
    out = {}
    under = [k[len(prefix):] for k in src.keys() if k.startswith(prefix)]
    for role, rel in roles.items():
        if rel.startswith("re:"):
            try:
                pat = re.compile(rel[3:])
            except re.error as err:
                raise _bad(name, f"role {role} pattern {rel[3:]!r} is not a regular expression ({err})") from None
            hits = [k for k in under if pat.fullmatch(k)]
            if len(hits) != 1:
                raise _bad(name, f"role {role} pattern {rel[3:]!r} matches {len(hits)} tensors under {prefix!r} "
                                 f"(it must match exactly one){': ' + ', '.join(hits[:4]) if hits else ''}")
            out[role] = prefix + hits[0]
        else:
            out[role] = prefix + rel
    twice = sorted({k for k in out.values() if list(out.values()).count(k) > 1})
    if twice:  # one tensor in two roles (b_O read from norm_attn.weight went unnoticed; red team 37g)
        roles_of = [r for r, k in out.items() if k == twice[0]]
        raise _bad(name, f"tensor {twice[0]!r} is named by two roles ({', '.join(roles_of)}); "
                         "each role reads its own tensor")
    return out


def _norm(src: TensorSource, entry: object, d: int, kind: NormKind, eps: float, name: str) -> NormSpec | None:
    if entry is None:
        return None
    if not isinstance(entry, dict) or "weight" not in entry:
        raise _bad(name, f"a norm entry must be {{'weight': name, 'bias': name?}}, got {entry!r}")
    bias = entry.get("bias")
    return NormSpec(kind, src.get(entry["weight"], (d,)), None if bias is None else src.get(bias, (d,)), eps)


def build_mapped(src: TensorSource, config: dict, name: str) -> TransformerSpec:
    """The spec of a checkpoint laid out as the mapping ``config`` says (module docstring)."""
    arch = "mapped"
    unknown = sorted(set(config) - _KEYS)
    if unknown:
        raise _bad(name, f"unknown field(s) {unknown}; known: {sorted(_KEYS)}")
    roles = config.get("roles")
    if not isinstance(roles, dict) or not all(isinstance(v, str) for v in roles.values()):
        raise _bad(name, "'roles' must map role names to tensor names")
    missing = [r for r in _REQUIRED if r not in roles]
    extra = sorted(set(roles) - set(ROLE_NAMES))
    if missing or extra:
        raise _bad(name, f"missing roles {missing}" if missing else f"unknown roles {extra}; known: {list(ROLE_NAMES)}")
    # the fields that choose the function are stated, never defaulted (red team 175: an omitted rope_theta read a RoPE
    # model without RoPE, an omitted norm read layernorm); "rope_theta": null and "norm": "none" say "none"
    unstated = [k for k in ("placement", "norm", "activation", "causal", "rope_theta") if k not in config]
    if config.get("norm") not in (None, "none") and "eps" not in config:
        unstated.append("eps")
    if unstated:
        raise _bad(name, f"state {', '.join(repr(k) for k in unstated)}: the function depends on them and nothing is "
                         "guessed (\"rope_theta\": null for no rotary positions, \"norm\": \"none\" for no norms)")
    pattern = config.get("layers")
    if not isinstance(pattern, str) or "{i}" not in pattern:
        raise _bad(name, "'layers' must be a prefix pattern containing {i}, e.g. \"blocks.{i}.\"")
    regex = re.compile(re.escape(pattern).replace(re.escape("{i}"), r"(\d+)"))
    found = {int(m.group(1)) for k in src.keys() if (m := regex.match(k))}
    n = _number(config, "n_layers", name, integer=True) or (max(found) + 1 if found else 0)
    if n == 0 or sorted(found) != list(range(n)):
        raise _bad(name, f"layer prefix {pattern!r} matches layers {sorted(found)[:8]} of {name}; expected 0..{n - 1}")
    H = config.get("n_heads")
    H = H if isinstance(H, int) and not isinstance(H, bool) else 0
    if H <= 0:
        raise _bad(name, "'n_heads' (a positive integer) is required: it cannot be read from the tensors")
    H_kv = config.get("n_kv_heads") or H
    if not isinstance(H_kv, int) or H_kv <= 0 or H % H_kv:
        raise _bad(name, f"'n_kv_heads'={H_kv!r} must be a positive divisor of n_heads={H}")
    conv1d = {"linear": False, "conv1d": True}.get(config.get("orientation", "linear"))
    if conv1d is None:
        raise _bad(name, f"'orientation' must be 'linear' or 'conv1d', got {config.get('orientation')!r}")
    first = _layer_names(src, pattern.format(i=0), {"W_Q": roles["W_Q"]}, name)["W_Q"]
    if first not in src:
        raise _bad(name, f"role W_Q names {first!r}, which is not in the checkpoint")
    q_shape = tuple(src.shape(first))
    d, width = (q_shape if conv1d else q_shape[::-1]) if len(q_shape) == 2 else (0, 0)
    dh = _number(config, "d_head", name, integer=True) or (width // H if H else 0)
    if d == 0 or dh * H != width:
        raise _bad(name, f"W_Q {first!r} has shape {list(q_shape)}, which is not {H} heads of width d_head")
    d_ff_key = _layer_names(src, pattern.format(i=0), {"W_1": roles["W_1"]}, name)["W_1"]
    d_ff = (src.shape(d_ff_key)[1] if conv1d else src.shape(d_ff_key)[0]) if d_ff_key in src else 0
    act = activation_from_name(config.get("activation", "gelu"), arch=arch)
    placement = _enum(Placement, config.get("placement", "pre"), "placement", name)
    kind = _enum(NormKind, config.get("norm", "layernorm"), "norm", name)
    eps = _number(config, "eps", name, 1e-5, positive=False)
    theta = _number(config, "rope_theta", name)
    max_position = _number(config, "max_position", name, 2048, integer=True)
    rope = None if theta is None else RopeSpec(theta=theta, max_position=max_position)
    scale = _number(config, "scale", name)
    window = _number(config, "window", name, integer=True)
    causal = config.get("causal", False)
    if not isinstance(causal, bool):  # "false" (a string) was read as True
        raise _bad(name, f"'causal' must be true or false, got {causal!r}")
    emb = config.get("embeddings") or {}
    if not isinstance(emb, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in emb.items()):
        raise _bad(name, f"'embeddings' must map roles to tensor names, got {emb!r}")
    absent = [v for v in emb.values() if v not in src]
    if absent:  # an embedding named explicitly but missing was dropped without a word
        raise _bad(name, f"embeddings name {absent[0]!r}, which is not in the checkpoint")

    def w(key: str, d_in: int, d_out: int):
        return src.get(key, (d_in, d_out)) if conv1d else src.get(key, (d_out, d_in)).T

    def layer(i: int) -> LayerSpec:
        names = _layer_names(src, pattern.format(i=i), roles, name)

        def opt(role: str, shape: tuple[int, ...]):
            return src.get(names[role], shape) if role in names else None

        def norm(which: str) -> NormSpec:
            # a declared norm without tensors is the non-parametric one (gain 1, no bias: OLMo-1's), not no norm
            # (red team 175: a declared layernorm was dropped, certifying 243.9 where the model attains 355)
            return NormSpec(kind, opt(f"{which}.weight", (d,)), opt(f"{which}.bias", (d,)), eps)

        attn = AttentionSpec(
            W_Q=heads_in(w(names["W_Q"], d, H * dh), H), W_K=heads_in(w(names["W_K"], d, H_kv * dh), H_kv),
            W_V=heads_in(w(names["W_V"], d, H_kv * dh), H_kv), W_O=heads_out(w(names["W_O"], H * dh, d), H),
            b_Q=heads_bias(opt("b_Q", (H * dh,)), H), b_K=heads_bias(opt("b_K", (H_kv * dh,)), H_kv),
            b_V=heads_bias(opt("b_V", (H_kv * dh,)), H_kv), b_O=opt("b_O", (d,)),
            scale=scale, causal=causal, rope=rope, window=window,
        )
        ffn = FFNSpec(
            W_1=w(names["W_1"], d, d_ff), W_2=w(names["W_2"], d_ff, d), activation=act,
            W_gate=w(names["W_gate"], d, d_ff) if "W_gate" in names else None,
            b_1=opt("b_1", (d_ff,)), b_2=opt("b_2", (d,)), b_gate=opt("b_gate", (d_ff,)),
        )
        return LayerSpec(index=i, attention=attn, ffn=ffn, norm_attn=norm("norm_attn"), norm_ffn=norm("norm_ffn"),
                         placement=placement, names=dict(names))

    embeddings = lazy_embeddings(src, {role: (key, None) for role, key in emb.items()})
    per_layer = [set(_layer_names(src, pattern.format(i=i), roles, name).values()) for i in range(n)]
    read = {k[len(pattern.format(i=0)):] for k in per_layer[0]}
    # every layer's tensors, and those outside the layers, against what the mapping names (red team 175: only layer 0
    # was checked, so a bias or a norm in layer 1, or an unnamed final norm, was ignored even under strict)
    named = set(emb.values()).union(*per_layer, (v for key in ("input_norm", "final_norm")
                                                 if isinstance(config.get(key), dict)
                                                 for v in config[key].values() if isinstance(v, str)))
    in_layer = {k for k in src.keys() if regex.match(k)}  # layers 0..n-1 only: others were refused above
    # outside the layers only vectors count: a norm's gain or bias belongs to the analysed function, while a
    # matrix there (an unembedding, a classifier) is the input's or the output's side, outside g_L
    stray = sorted(k for k in src.keys() if k not in named and (k in in_layer or len(src.shape(k)) == 1))
    warnings = tuple(f"unexpected tensor {k!r} in {src.where(k)}: no role of the mapping names it, so the analysed "
                     "function ignores it (it would differ if the model uses it)" for k in stray)
    return TransformerSpec(
        arch=arch, name=name, d_model=d, layers=LayerSequence(n, layer),
        input_norm=_norm(src, config.get("input_norm"), d, kind, eps, name),
        final_norm=_norm(src, config.get("final_norm"), d, kind, eps, name),
        embeddings=embeddings,  # type: ignore[arg-type]
        config={**summary({"roles_mapping": config}, src, n, H, H_kv, dh, d_ff, act.value, "", embeddings.names),
                "roles_read_per_layer": sorted(read)},
        warnings=warnings,
    )
