"""transcover's reference Transformer: the seed's section 1.2 taken literally, plus an MLP head.

.. math::

    X_0 = \\Pi_{norm}(X E + P),\\qquad
    g_{l+1}(X) = \\Pi_{norm}\\big(Y + g_{ff}(Y)\\big),\\quad Y = \\Pi_{norm}\\big(X + g_{msa}(X)\\big)

with ``g_msa(X) = sum_h softmax(X W_KQ^h X^T) X W_OV^h`` (``W_KQ^h = W_Q^h W_K^hT / sqrt(d_head)``,
``W_OV^h = W_V^h W_O^h``), ``g_ff(x) = act(x W_1 + b_1) W_2 + b_2`` and
``Pi_norm(x) = x / max(1, ||x||_2)`` row-wise (THEORY section 2; Edelman et al. 2022).  The MLP head
``f`` reads the sequence (mean over tokens, or the first token) and maps it to ``n_outputs``:
the Transformer+MLP class ``F_MLP o G_TF`` of seed section 3.

The weights are stored in the decomposition's own layout (``W_Q`` is ``(H, d, d_head)``, ...), so
the spec is the module's parameters themselves and constraints (``transcover.constrain``) can
parametrize them directly.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

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

__all__ = ["ReferenceConfig", "ReferenceTransformer", "save_reference", "reference_spec"]

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
        if self.d_head is None and self.d_model % max(self.n_heads, 1):
            problems.append(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set d_head")
        if self.activation not in {a.value for a in Activation}:
            problems.append(f"unknown activation={self.activation!r}")
        if self.norm not in _NORMS:
            problems.append(f"norm must be one of {sorted(_NORMS)}, but got norm={self.norm!r}")
        if self.attention not in ("dot", "l2"):
            problems.append(f"attention must be 'dot' or 'l2', but got attention={self.attention!r}")
        if self.readout not in ("mean", "first"):
            problems.append(f"readout must be 'mean' or 'first', but got readout={self.readout!r}")
        if problems:
            raise ValueError("; ".join(problems))
        object.__setattr__(self, "head_hidden", tuple(self.head_hidden))

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_heads

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ReferenceConfig":
        data = json.loads(text)
        data["head_hidden"] = tuple(data.get("head_hidden", ()))
        return cls(**data)


class _Block(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        d, H, dh, dff = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff
        s = cfg.init_scale
        self.W_Q = nn.Parameter(torch.randn(H, d, dh) * s / math.sqrt(d))
        self.W_K = nn.Parameter(torch.randn(H, d, dh) * s / math.sqrt(d))
        self.W_V = nn.Parameter(torch.randn(H, d, dh) * s / math.sqrt(d))
        self.W_O = nn.Parameter(torch.randn(H, dh, d) * s / math.sqrt(H * dh))
        self.W_1 = nn.Parameter(torch.randn(d, dff) * s / math.sqrt(d))
        self.W_2 = nn.Parameter(torch.randn(dff, d) * s / math.sqrt(dff))
        self.b_1 = nn.Parameter(torch.zeros(dff)) if cfg.ffn_bias else None
        self.b_2 = nn.Parameter(torch.zeros(d)) if cfg.ffn_bias else None
        if cfg.norm == "layernorm":
            self.ln_attn = nn.LayerNorm(d)
            self.ln_ffn = nn.LayerNorm(d)


class ReferenceTransformer(nn.Module):
    """The seed-literal Transformer (+ MLP head). Input ``X`` is ``(B, T, d_input or d_model)``.

    Example:
        >>> model = ReferenceTransformer(ReferenceConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16))
        >>> model(torch.randn(3, 5, 8)).shape
        torch.Size([3, 1])
    """

    def __init__(self, cfg: ReferenceConfig = ReferenceConfig()):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.embed = nn.Linear(cfg.d_input, d, bias=False) if cfg.d_input is not None else None
        self.pos = nn.Parameter(torch.randn(cfg.max_len, d) * 0.02) if cfg.max_len else None
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        widths = (d, *cfg.head_hidden, cfg.n_outputs)
        self.head = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.act = Activation(cfg.activation)

    # -- pieces ---------------------------------------------------------------------------------
    def _norm(self, X: Tensor, block: _Block, which: str) -> Tensor:
        if self.cfg.norm == "ball":
            return X / torch.clamp(X.norm(dim=-1, keepdim=True), min=1.0)
        if self.cfg.norm == "layernorm":
            return getattr(block, f"ln_{which}")(X)
        return X

    def _attention(self, X: Tensor, b: _Block) -> Tensor:
        B, T, d = X.shape
        dh = self.cfg.head_dim
        if self.cfg.attention == "l2":
            from ..lipschitz import l2_attention_forward  # the L2 variant lives with its bound

            return l2_attention_forward(X, b.W_Q, b.W_V, b.W_O)
        q = torch.einsum("btd,hde->bhte", X, b.W_Q)  # (B, H, T, dh)
        k = torch.einsum("btd,hde->bhte", X, b.W_K)
        v = torch.einsum("btd,hde->bhte", X, b.W_V)
        scores = q @ k.transpose(-1, -2) / math.sqrt(dh)  # (B, H, T, T)
        if self.cfg.causal:
            mask = torch.ones(T, T, dtype=torch.bool, device=X.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        heads = torch.softmax(scores, dim=-1) @ v  # (B, H, T, dh)
        return torch.einsum("bhte,hed->btd", heads, b.W_O)

    def _ffn(self, X: Tensor, b: _Block) -> Tensor:
        u = X @ b.W_1 + (b.b_1 if b.b_1 is not None else 0)
        return self.act(u) @ b.W_2 + (b.b_2 if b.b_2 is not None else 0)

    def features(self, X: Tensor) -> Tensor:
        """The Transformer part g_L(X): (B, T, d_model), every row in the unit ball when norm='ball'."""
        if self.embed is not None:
            X = self.embed(X)
        if self.pos is not None:
            X = X + self.pos[: X.shape[-2]]
        if self.cfg.norm == "ball":
            X = X / torch.clamp(X.norm(dim=-1, keepdim=True), min=1.0)
        for b in self.blocks:
            X = self._norm(X + self._attention(X, b), b, "attn")
            X = self._norm(X + self._ffn(X, b), b, "ffn")
        return X

    def forward(self, X: Tensor) -> Tensor:
        z = self.features(X)
        z = z.mean(dim=-2) if self.cfg.readout == "mean" else z[..., 0, :]
        for i, lin in enumerate(self.head):
            z = lin(z)
            if i < len(self.head) - 1:
                z = self.act(z)
        return z


def _norm_spec(cfg: ReferenceConfig, ln: nn.LayerNorm | None) -> NormSpec:
    kind = _NORMS[cfg.norm]
    if kind is NormKind.LAYERNORM:
        assert ln is not None
        return NormSpec(kind, ln.weight.detach(), ln.bias.detach(), float(ln.eps))
    return NormSpec(kind)


def reference_spec(model: ReferenceTransformer, name: str = "reference") -> TransformerSpec:
    """The decomposition of a :class:`ReferenceTransformer` (its parameters, detached)."""
    cfg = model.cfg
    act = Activation(cfg.activation)

    def layer(i: int) -> LayerSpec:
        b = model.blocks[i]
        attn = AttentionSpec(
            W_Q=b.W_Q.detach(), W_K=b.W_K.detach(), W_V=b.W_V.detach(), W_O=b.W_O.detach(),
            causal=cfg.causal, kind=cfg.attention,
        )
        ffn = FFNSpec(
            W_1=b.W_1.detach(), W_2=b.W_2.detach(), activation=act,
            b_1=None if b.b_1 is None else b.b_1.detach(),
            b_2=None if b.b_2 is None else b.b_2.detach(),
        )
        prefix = f"blocks.{i}."
        names = {k: prefix + k for k in ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2", "b_1", "b_2")}
        return LayerSpec(
            index=i, attention=attn, ffn=ffn,
            norm_attn=_norm_spec(cfg, getattr(b, "ln_attn", None)),
            norm_ffn=_norm_spec(cfg, getattr(b, "ln_ffn", None)),
            placement=Placement.POST, names=names,
        )

    head = MLPHeadSpec(
        weights=tuple(lin.weight.detach().T for lin in model.head),
        biases=tuple(None if lin.bias is None else lin.bias.detach() for lin in model.head),
        activation=act, readout=cfg.readout,
    )
    embeddings: dict[str, Tensor] = {}
    if model.embed is not None:
        embeddings["input_embedding"] = model.embed.weight.detach().T
    if model.pos is not None:
        embeddings["position_embedding"] = model.pos.detach()
    layers = [layer(i) for i in range(cfg.n_layers)]
    return TransformerSpec(
        arch="reference", name=name, d_model=cfg.d_model, layers=layers, head=head,
        input_norm=NormSpec(NormKind.BALL) if cfg.norm == "ball" else None,
        embeddings=embeddings, config=json.loads(cfg.to_json()),
    )


def save_reference(model: ReferenceTransformer, path: str | Path) -> Path:
    """Save as safetensors with the config in the metadata, atomically."""
    from safetensors.torch import save

    from ..report import atomic_write_bytes

    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    meta = {"format": "pt", "transcover_arch": "reference", "transcover_config": model.cfg.to_json()}
    return atomic_write_bytes(path, save(tensors, metadata=meta))
