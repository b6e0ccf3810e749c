"""The reference model's configuration and its spec, built from named arrays (no torch needed).

:class:`ReferenceConfig` describes :class:`~transcover.model.ReferenceTransformer` (``_reference``,
the torch module); :func:`build_reference_spec` is the one definition of its decomposition, fed by
the module's parameters (``reference_spec``) or by a safetensors file's arrays (the ``reference``
adapter, which therefore never imports torch).  Parameter names are the module's ``state_dict``
keys: ``blocks.{i}.W_Q`` ... ``blocks.{i}.b_2``, ``blocks.{i}.ln_attn.weight`` (LayerNorm only),
``head.{j}.weight`` (an ``nn.Linear`` weight, ``(out, in)``), ``embed.weight``, ``pos``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ._spec import (
    Activation,
    AttentionSpec,
    FFNSpec,
    LayerSpec,
    MLPHeadSpec,
    NormKind,
    NormSpec,
    Placement,
    TransformerSpec,
)

__all__ = ["ReferenceConfig", "build_reference_spec", "reference_shapes"]

_NORMS = {"ball": NormKind.BALL, "layernorm": NormKind.LAYERNORM, "none": NormKind.NONE}


@dataclass(frozen=True)
class ReferenceConfig:
    """Shape and choices of the reference model.

    Every field is a choice the theory cares about; defaults are small enough for exhaustive tests.
    """

    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 2
    d_ff: int = 64
    d_head: int | None = None  # None: d_model // n_heads
    activation: str = "relu"  # relu | gelu | gelu_tanh | silu
    # Pi_norm ("ball") is the seed's choice and keeps every layer's input in the unit ball (B_X = 1);
    # "layernorm" gives the common practice, "none" the bare residual stream.
    norm: str = "ball"
    # "dot": softmax(X W_KQ X^T); "l2": Kim et al. 2021 L2 attention with W_K = W_Q (globally Lipschitz).
    attention: str = "dot"
    d_input: int | None = None  # None: inputs are already d_model-dimensional, no embedding
    max_len: int | None = None  # learned positional embedding of this many positions, if set
    head_hidden: tuple[int, ...] = (64,)  # widths of the MLP head's hidden layers (d_m); () for none
    n_outputs: int = 1
    readout: str = "mean"  # "mean" over tokens or "first" token
    ffn_bias: bool = True
    causal: bool = False
    init_scale: float = 1.0  # multiplies the default initialisation (for random norm sweeps)

    def __post_init__(self) -> None:
        problems = []
        for name in ("d_model", "n_heads", "n_layers", "d_ff", "n_outputs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                problems.append(f"{name} must be a positive integer, but got {name}={v!r}")
        widths = self.head_hidden if isinstance(self.head_hidden, (tuple, list)) else (self.head_hidden,)
        if any(isinstance(w, bool) or not isinstance(w, int) or w <= 0 for w in widths):
            problems.append(f"head_hidden widths must be positive integers, but got head_hidden={self.head_hidden!r}")
        if self.d_head is None and self.d_model % max(self.n_heads, 1):
            problems.append(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set d_head")
        if self.activation not in {a.value for a in Activation}:
            problems.append(f"unknown activation={self.activation!r}")
        if self.norm not in _NORMS:
            problems.append(f"norm must be one of {sorted(_NORMS)}, but got norm={self.norm!r}")
        if self.attention not in ("dot", "l2"):
            problems.append(f"attention must be 'dot' or 'l2', but got attention={self.attention!r}")
        if self.attention == "l2" and self.causal:
            problems.append("attention='l2' has no causal form (Kim et al. 2021); use causal=False")
        if self.readout not in ("mean", "first"):
            problems.append(f"readout must be 'mean' or 'first', but got readout={self.readout!r}")
        if problems:  # InputError (a ValueError): the CLI's one line and exit 2, not "internal error" (red team 171)
            from .._errors import InputError

            raise InputError("; ".join(problems))
        object.__setattr__(self, "head_hidden", tuple(self.head_hidden))

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_heads

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ReferenceConfig:
        data = json.loads(text)
        data["head_hidden"] = tuple(data.get("head_hidden", ()))
        return cls(**data)


def reference_shapes(cfg: ReferenceConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of a :class:`~transcover.model.ReferenceTransformer` of ``cfg`` and its shape."""
    d, H, dh, dff = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.d_input is not None:
        shapes["embed.weight"] = (d, cfg.d_input)
    if cfg.max_len:
        shapes["pos"] = (cfg.max_len, d)
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        shapes.update({p + "W_Q": (H, d, dh), p + "W_K": (H, d, dh), p + "W_V": (H, d, dh),
                       p + "W_O": (H, dh, d), p + "W_1": (d, dff), p + "W_2": (dff, d)})
        if cfg.ffn_bias:
            shapes.update({p + "b_1": (dff,), p + "b_2": (d,)})
        if cfg.norm == "layernorm":
            for which in ("attn", "ffn"):
                shapes.update({f"{p}ln_{which}.weight": (d,), f"{p}ln_{which}.bias": (d,)})
    widths = (d, *cfg.head_hidden, cfg.n_outputs)
    for j, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        shapes.update({f"head.{j}.weight": (b, a), f"head.{j}.bias": (b,)})
    return shapes


def build_reference_spec(
    cfg: ReferenceConfig, get: Callable[[str], Any], name: str,
    eps: Callable[[int, str], float] = lambda i, which: 1e-5,
) -> TransformerSpec:
    """The spec of the reference model whose parameter ``key`` is ``get(key)`` (numpy or torch).

    ``eps(i, "attn" | "ffn")`` is layer ``i``'s LayerNorm epsilon (``nn.LayerNorm``'s default 1e-5
    for a model read from a file, whose config does not store it).
    """
    act = Activation(cfg.activation)
    kind = _NORMS[cfg.norm]

    def norm(i: int, which: str) -> NormSpec:
        if kind is NormKind.LAYERNORM:
            p = f"blocks.{i}.ln_{which}."
            return NormSpec(kind, get(p + "weight"), get(p + "bias"), eps(i, which))
        return NormSpec(kind)

    def layer(i: int) -> LayerSpec:
        p = f"blocks.{i}."
        attn = AttentionSpec(
            # L2 attention ties W_K to W_Q (its stored W_K is unused): Note [L2 attention fields]
            W_Q=get(p + "W_Q"), W_K=get(p + ("W_Q" if cfg.attention == "l2" else "W_K")),
            W_V=get(p + "W_V"), W_O=get(p + "W_O"),
            causal=cfg.causal, kind=cfg.attention,
        )
        ffn = FFNSpec(
            W_1=get(p + "W_1"), W_2=get(p + "W_2"), activation=act,
            b_1=get(p + "b_1") if cfg.ffn_bias else None,
            b_2=get(p + "b_2") if cfg.ffn_bias else None,
        )
        names = {k: p + k for k in ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2", "b_1", "b_2")}
        return LayerSpec(index=i, attention=attn, ffn=ffn, norm_attn=norm(i, "attn"),
                         norm_ffn=norm(i, "ffn"), placement=Placement.POST, names=names)

    n_head = len(cfg.head_hidden) + 1
    head = MLPHeadSpec(
        weights=tuple(get(f"head.{j}.weight").T for j in range(n_head)),
        biases=tuple(get(f"head.{j}.bias") for j in range(n_head)),
        activation=act, readout=cfg.readout,
    )
    embeddings: dict[str, Any] = {}
    if cfg.d_input is not None:
        embeddings["input_embedding"] = get("embed.weight").T
    if cfg.max_len:
        embeddings["position_embedding"] = get("pos")
    layers = [layer(i) for i in range(cfg.n_layers)]
    return TransformerSpec(
        arch="reference", name=name, d_model=cfg.d_model, layers=layers, head=head,
        input_norm=NormSpec(NormKind.BALL) if cfg.norm == "ball" else None,
        embeddings=embeddings, config=json.loads(cfg.to_json()),
    )
