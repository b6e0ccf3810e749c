"""Forward passes computed from the decomposition alone.

These functions recompute a model's attention, FFN and whole layers from a
:class:`~transcover.model.TransformerSpec`; the adapter tests compare them with the original
modules, which is what proves an adapter right.  Later stages (Lipschitz estimates, covering
estimates) use them as the reference semantics of a spec.

They compute in torch, in the dtype of ``X``; a spec read from files holds numpy arrays, which are
converted here (:func:`~transcover.model._arrays.to_tensor`).  torch is imported inside the
functions: ``transcover.norms`` imports :func:`apply_rope` on the CLI's start-up path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ._arrays import to_tensor
from ._spec import AttentionSpec, FFNSpec, LayerSpec, NormSpec, Placement, Residual, RopeSpec, TransformerSpec

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["attention_forward", "ffn_forward", "layer_forward", "transformer_forward", "apply_rope"]


def _w(W, X):  # noqa: ANN001, ANN202  (a spec array as a tensor of X's dtype)
    return to_tensor(W, X)


def apply_rope(x: Tensor, rope: RopeSpec, positions: Tensor) -> Tensor:
    """Rotate pairs (i, i + d/2) of the last dimension by angle pos * inv_freq (Llama's layout).

    ``x`` is (..., T, d_head); ``positions`` is (T,).
    """
    import torch

    d_head = x.shape[-1]
    inv = rope.inv_freq(d_head).to(x.dtype)
    rd = inv.numel() * 2
    ang = positions.to(x.dtype)[:, None] * inv[None, :]  # (T, rd/2)
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1)
    sin = torch.cat([ang.sin(), ang.sin()], dim=-1)
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


def attention_scores(attn: AttentionSpec, X: Tensor, h: int) -> Tensor:
    """Pre-softmax scores of head h on X (..., T, d), using the exact bias folding.

    Without RoPE: ``x~_i A~ x_j^T`` with ``A~ = scale [W_Q; b_Q] W_K^T`` (Note [attention biases]
    in ``_spec``); ``b_K`` is dropped because it cancels in the softmax.  With RoPE, query/key
    normalisation or soft-capping the key bias would not cancel, so the biases are applied as in the model.
    """
    import torch

    Wq, Wk, _, _ = attn.head(h)
    T = X.shape[-2]
    if attn.rope is None and attn.q_norm is None and attn.k_norm is None and attn.softcap is None:
        Xa = torch.cat([X, torch.ones_like(X[..., :1])], dim=-1)
        q = Xa @ _w(attn.W_Q_augmented(h), X)
        k = X @ _w(Wk, X)
    else:
        g = attn.kv_index(h)
        q = X @ _w(Wq, X) + (0 if attn.b_Q is None else _w(attn.b_Q[h], X))
        k = X @ _w(Wk, X) + (0 if attn.b_K is None else _w(attn.b_K[g], X))
        if attn.q_norm is not None:  # per-head RMSNorm before the rotation (Qwen3; THEORY F21)
            q = attn.q_norm(q)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        if attn.rope is not None:
            pos = torch.arange(T)
            q = apply_rope(q, attn.rope, pos)
            k = apply_rope(k, attn.rope, pos)
    scores = attn.softmax_scale * (q @ k.transpose(-1, -2))
    if attn.softcap is not None:  # Gemma 2: c tanh(s / c), before the mask (THEORY F22)
        scores = attn.softcap * torch.tanh(scores / attn.softcap)
    if attn.causal:
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def attention_forward(attn: AttentionSpec, X: Tensor) -> Tensor:
    """Multi-head self-attention output (before the residual) on X of shape (..., T, d)."""
    import torch

    if attn.kind == "l2":
        from ..lipschitz import l2_attention_forward  # the L2 variant lives with its bound

        return l2_attention_forward(X, _w(attn.W_Q, X), _w(attn.W_V, X), _w(attn.W_O, X))
    out = None
    for h in range(attn.n_heads):
        _, _, Wv, Wo = attn.head(h)
        P = torch.softmax(attention_scores(attn, X, h), dim=-1)
        term = (P @ X) @ (_w(Wv, X) @ _w(Wo, X))  # (..., T, d): P X W_OV^h
        out = term if out is None else out + term
    bias = attn.effective_output_bias()
    if bias is not None:
        out = out + _w(bias, X)
    return out


def ffn_forward(ffn: FFNSpec, X: Tensor) -> Tensor:
    """The FFN (before the residual) on X of shape (..., d)."""
    u = X @ _w(ffn.W_1, X)
    if ffn.b_1 is not None:
        u = u + _w(ffn.b_1, X)
    if ffn.gated:
        g = X @ _w(ffn.W_gate, X)
        if ffn.b_gate is not None:
            g = g + _w(ffn.b_gate, X)
        hidden = ffn.activation(g) * u
    else:
        hidden = ffn.activation(u)
    y = hidden @ _w(ffn.W_2, X)
    if ffn.b_2 is not None:
        y = y + _w(ffn.b_2, X)
    return y


def _apply_norm(norm: NormSpec, X: Tensor) -> Tensor:
    return norm(X)


def layer_forward(layer: LayerSpec, X: Tensor, *,
                  apply_norm: Callable[[NormSpec, Tensor], Tensor] = _apply_norm) -> Tensor:
    """One block, with its residuals and normalisations in their places.

    ``apply_norm(norm, X)`` evaluates each normalisation; callers that must observe the inputs of
    the norms (the Lipschitz searches record LayerNorm input spreads) pass their own.
    """
    if layer.residual is Residual.PARALLEL:  # both branches read the block's input (THEORY F19)
        return (X + attention_forward(layer.attention, apply_norm(layer.norm_attn, X))
                + ffn_forward(layer.ffn, apply_norm(layer.norm_ffn, X)))
    if layer.placement is Placement.PRE:
        X = X + attention_forward(layer.attention, apply_norm(layer.norm_attn, X))
        return X + ffn_forward(layer.ffn, apply_norm(layer.norm_ffn, X))
    X = apply_norm(layer.norm_attn, X + attention_forward(layer.attention, X))
    return apply_norm(layer.norm_ffn, X + ffn_forward(layer.ffn, X))


def transformer_forward(spec: TransformerSpec, X: Tensor, *, with_head: bool = True,
                        apply_norm: Callable[[NormSpec, Tensor], Tensor] = _apply_norm,
                        layers: Sequence[LayerSpec] | None = None) -> Tensor:
    """Input norm, all layers, final norm and MLP head (if present) on embedded input X (..., T, d).

    ``layers`` replaces ``spec.layers`` (e.g. a materialised copy of a lazy sequence).
    """
    if spec.input_norm is not None:
        X = apply_norm(spec.input_norm, X)
    for layer in spec.layers if layers is None else layers:
        X = layer_forward(layer, X, apply_norm=apply_norm)
    if spec.final_norm is not None:
        X = apply_norm(spec.final_norm, X)
    if with_head and spec.head is not None:
        head = spec.head
        z = X.mean(dim=-2) if head.readout == "mean" else X[..., 0, :]
        for i, (W, b) in enumerate(zip(head.weights, head.biases)):
            z = z @ _w(W, z)
            if b is not None:
                z = z + _w(b, z)
            if i < len(head.weights) - 1:
                z = head.activation(z)
        return z
    return X
