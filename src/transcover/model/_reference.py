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
parametrize them directly.  The module only holds the parameters: its numbers are computed by
:func:`~transcover.model.transformer_forward` on :meth:`ReferenceTransformer.functional_spec`, the one
forward pass every other part of transcover evaluates a spec with.
"""

from __future__ import annotations

import math
from functools import reduce
from pathlib import Path

import torch
from torch import Tensor, nn

from ._functional import transformer_forward
from ._reference_spec import ReferenceConfig, build_reference_spec
from ._spec import TransformerSpec

__all__ = ["ReferenceConfig", "ReferenceTransformer", "save_reference", "reference_spec"]

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

    def embed_inputs(self, X: Tensor) -> Tensor:
        """The rows the decomposition reads: the input embedding and positions, when present."""
        if self.embed is not None:
            X = self.embed(X)
        if self.pos is not None:
            X = X + self.pos[: X.shape[-2]]
        return X

    def functional_spec(self) -> TransformerSpec:
        """The spec :meth:`forward` evaluates: the parameters themselves, *not* detached, so
        gradients flow through :func:`~transcover.model.transformer_forward` into the module.

        Each parameter is read once (a parametrized weight, ``transcover.constrain``, computes its
        value on every read); :func:`reference_spec` is the detached counterpart.
        """
        read: dict[str, Tensor] = {}

        def get(key: str) -> Tensor:
            if key not in read:
                read[key] = reduce(getattr, key.split("."), self)
            return read[key]

        return build_reference_spec(self.cfg, get, "reference", self._eps)

    def _eps(self, i: int, which: str) -> float:
        return float(getattr(self.blocks[i], f"ln_{which}").eps)

    def features(self, X: Tensor) -> Tensor:
        """The Transformer part g_L(X): (B, T, d_model), every row in the unit ball when norm='ball'."""
        return transformer_forward(self.functional_spec(), self.embed_inputs(X), with_head=False)

    def forward(self, X: Tensor) -> Tensor:
        return transformer_forward(self.functional_spec(), self.embed_inputs(X))


def reference_spec(model: ReferenceTransformer, name: str = "reference", *, snapshot: bool = False) -> TransformerSpec:
    """The decomposition of a :class:`ReferenceTransformer`: its parameters themselves, detached.

    Parameters are read as attributes (not from ``state_dict()``), so a parametrized weight
    (``transcover.constrain``) enters the spec as the value the module computes with.

    ``snapshot``: every tensor (and eps) is read and cloned now, so the spec stays the function the module
    computed when it was taken, whatever in-place training does afterwards (``load(module)``: Note [module
    snapshot], red team 210); it holds the parameters twice.  Without it the spec's layers are read from the
    live module on each access (the internal callers pass a private copy, or read at once).
    """
    if not snapshot:
        def get(key: str) -> Tensor:
            return reduce(getattr, key.split("."), model).detach()

        return build_reference_spec(model.cfg, get, name, model._eps)
    read: dict[str, Tensor] = {}
    eps_read: dict[tuple[int, str], float] = {}

    def get_once(key: str) -> Tensor:
        if key not in read:
            read[key] = reduce(getattr, key.split("."), model).detach().clone()
        return read[key]

    def eps_once(i: int, which: str) -> float:
        if (i, which) not in eps_read:
            eps_read[i, which] = model._eps(i, which)
        return eps_read[i, which]

    spec = build_reference_spec(model.cfg, get_once, name, eps_once)
    for _ in spec.layers:  # reads every layer's tensors now
        pass
    return spec


def save_reference(model: ReferenceTransformer, path: str | Path) -> Path:
    """Save as safetensors with the config in the metadata, atomically."""
    from safetensors.torch import save

    from .._io import atomic_write_bytes

    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    meta = {"format": "pt", "transcover_arch": "reference", "transcover_config": model.cfg.to_json()}
    return atomic_write_bytes(path, save(tensors, metadata=meta))
