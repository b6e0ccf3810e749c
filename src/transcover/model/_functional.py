"""The one forward pass: every model transcover evaluates is computed by these functions.

They compute a model's attention, FFN, whole layers and head from a
:class:`~transcover.model.TransformerSpec` alone.  The adapter tests compare them with the original
modules, which is what proves an adapter right; the reference module
(:class:`~transcover.model.ReferenceTransformer`) computes with them, the Lipschitz searches, the
Monte-Carlo classes and the approximation lab evaluate models through them.  Extensions of a block
(a parallel residual, a normalisation of queries and keys) belong in :func:`layer_forward` and
:func:`attention_scores`, the one place each structure is written down.

They compute in torch, in the dtype of ``X``; a spec read from files holds numpy arrays, which are
converted here (:func:`~transcover.model._arrays.to_tensor`).  torch is imported inside the
functions: ``transcover.norms`` imports :func:`apply_rope` on the CLI's start-up path.

Note [member stacks]: a spec's arrays may carry one leading *member* axis ``M``
(:func:`stack_members`; e.g. ``W_Q`` of shape ``(M, H, d, d_head)``): then ``X`` is
``(M or 1, batch..., T, d)`` and member ``m``'s weights act on ``X[m]`` (or on the shared ``X[0]``).
Every piece reads its shapes from the trailing axes and :func:`_w` lifts a stacked array so that
it broadcasts against ``X``; a spec without a member axis takes exactly the operations it always
took, so a single model's numbers do not depend on stacks existing.

Note [hooks]: :class:`ForwardHooks` lets a caller observe or replace the values the forward passes
through its normalisations and its attention probabilities, without a second copy of the forward.
Without hooks (``hooks=None``) nothing extra is computed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._arrays import to_tensor
from ._spec import (
    AttentionSpec,
    FFNSpec,
    LayerSpec,
    MLPHeadSpec,
    MoESpec,
    NormSpec,
    Placement,
    Residual,
    RopeSpec,
    TransformerSpec,
)

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "ForwardHooks", "attention_forward", "ffn_forward", "layer_forward", "transformer_forward",
    "head_forward", "moe_forward", "norm_forward", "l2_attention_forward", "apply_rope", "attention_scores",
]

NormSite = tuple[int, str]  # (layer, name) as in lipschitz's chain: (-1, "input_norm"), (i, "norm_attn"), ...


@dataclass(frozen=True)
class ForwardHooks:
    """Callbacks that observe or replace values inside :func:`transformer_forward` (Note [hooks]).

    Each returns ``None`` to leave the forward as it is, or a tensor of the same shape that takes
    the place of the value it was shown.

    * ``on_norm(site, norm, X)``: ``X`` is the input of the normalisation at ``site``
      (``(-1, "input_norm")``, ``(i, "norm_attn")``, ``(i, "norm_ffn")``, ``(i, "post_norm_attn")``,
      ``(i, "post_norm_ffn")``, ``(L, "final_norm")``);
      a returned tensor is used as the normalisation's *output*.
    * ``on_attention_probs(layer, head, P)``: ``P`` (``(..., T, T)``, rows summing to 1) is the
      attention of one head after the softmax (and its masks); a returned tensor is used instead.
    * ``on_head_output(layer, head, Y)``: ``Y`` (``(..., T, d)``) is the head's contribution
      ``P X W_OV^h`` before the heads are summed and the output bias added.

    Example:
        >>> seen = []
        >>> hooks = ForwardHooks(on_attention_probs=lambda layer, h, P: seen.append((layer, h)))
    """

    on_norm: Callable[[NormSite, NormSpec, Tensor], Tensor | None] | None = None
    on_attention_probs: Callable[[int, int, Tensor], Tensor | None] | None = None
    on_head_output: Callable[[int, int, Tensor], Tensor | None] | None = None


def _call(hook: Callable[..., Any] | None, value: Tensor, *key: Any) -> Tensor:
    if hook is None:
        return value
    out = hook(*key, value)
    return value if out is None else out


def _w(W: Any, X: Tensor, base: int = 2) -> Tensor:
    """A spec array (its own rank ``base``: 2 for a matrix, 1 for a vector) as a tensor of X's
    dtype; a stacked array ``(M, ...)`` gets singleton axes so it broadcasts against ``X``
    (Note [member stacks])."""
    t = to_tensor(W, X)
    if t.ndim == base:
        return t
    ones = X.ndim - t.ndim
    if t.ndim != base + 1 or ones < 0:
        raise ValueError(f"a stacked array of shape {tuple(t.shape)} does not broadcast against input "
                         f"{tuple(X.shape)}: stacked models take X of shape (M or 1, batch..., T, d)")
    return t.reshape(t.shape[:1] + (1,) * ones + t.shape[1:])


def _linear(X: Tensor, W: Any) -> Tensor:
    """``X @ W`` for a spec matrix ``W`` (converted to X's dtype).

    A stacked ``W`` (M, a, b) multiplies each member's rows of ``X`` (M or 1, batch..., a), folded
    into one matrix per member: one batched product of M matrices, where broadcasting would make
    one tiny product per member and sequence (Note [member stacks]).
    """
    t = to_tensor(W, X)
    if t.ndim == 2:
        return X @ t
    M, _, b = t.shape
    rows = X.reshape(X.shape[0], -1, X.shape[-1])  # (M or 1, batch * T, a)
    return (rows @ t).reshape((M,) + tuple(X.shape[1:-1]) + (b,))


def apply_rope(x: Tensor, rope: RopeSpec, positions: Tensor) -> Tensor:
    """Rotate pairs (i, i + d/2) of the last dimension by angle pos * inv_freq (Llama's layout).

    ``x`` is (..., T, d_head); ``positions`` is (T,).  Dynamic NTK scaling (THEORY F22) takes its
    frequencies from the sequence length ``max(positions) + 1``, as HF does.
    """
    import torch

    d_head = x.shape[-1]
    T = int(positions.max()) + 1 if positions.numel() else 0
    inv = rope.inv_freq(d_head, T).to(device=x.device, dtype=x.dtype)
    rd = inv.numel() * 2
    ang = positions.to(x.dtype)[:, None] * inv[None, :]  # (T, rd/2)
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1)
    sin = torch.cat([ang.sin(), ang.sin()], dim=-1)
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


def _mask(scores: Tensor, causal: bool, key_mask: Tensor | None, window: int | None = None) -> Tensor:
    """Scores ``(..., T, T)`` with the future (causal), keys beyond a sliding ``window`` and the keys
    ``key_mask`` forbids at -inf."""
    import torch

    T = scores.shape[-1]
    if causal:
        future = torch.ones(T, T, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    if window is not None:
        # Note [window mask]: key j is hidden from query i when j <= i - window (HF's
        # ``sliding_window_overlay``: visible iff j > i - window); every row keeps its diagonal, so
        # no row is empty.  The global attention bounds (THEORY F5-F6) only use that each row of P
        # is a probability vector over some non-empty key set, so they hold for any such row mask.
        far = torch.ones(T, T, dtype=torch.bool, device=scores.device).tril(-window)
        scores = scores.masked_fill(far, float("-inf"))
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[..., None, :], float("-inf"))
    return scores


def attention_scores(attn: AttentionSpec, X: Tensor, h: int, *, key_mask: Tensor | None = None) -> Tensor:
    """Pre-softmax scores of head h on X (..., T, d), using the exact bias folding, masks applied.

    Without RoPE: ``x~_i A~ x_j^T`` with ``A~ = scale [W_Q; b_Q] W_K^T`` (Note [attention biases]
    in ``_spec``); ``b_K`` is dropped because it cancels in the softmax.  With RoPE, query/key
    normalisation or soft-capping the key bias would not cancel, so the biases are applied as in the
    model.  ``key_mask`` (``(..., T)`` bool): the keys each query may read (True); None reads all.
    """
    import torch

    Wq, Wk, _, _ = attn.head(h)
    T = X.shape[-2]
    # the key bias cancels (and [X, 1] folds the query bias) only without RoPE, query/key
    # normalisation and soft-capping
    if attn.rope is None and attn.q_norm is None and attn.k_norm is None and attn.softcap is None:
        # [X, 1] per head, not once per block: sharing it would change the order in which the
        # heads' gradients reach X, and with it the Lipschitz searches' ascent paths bit by bit
        Xa = torch.cat([X, torch.ones_like(X[..., :1])], dim=-1)
        q = _linear(Xa, attn.W_Q_augmented(h))
        k = _linear(X, Wk)
    else:
        g = attn.kv_index(h)
        if attn.qk_norm_scope == "all":  # OLMo 2: one RMSNorm over every head's coordinates (F23)
            q = _joint_normalised(X, attn.W_Q, attn.b_Q, attn.q_norm, h)
            k = _joint_normalised(X, attn.W_K, attn.b_K, attn.k_norm, g)
        else:
            q = _linear(X, Wq) + (0 if attn.b_Q is None else _w(attn.b_Q[..., h, :], X, 1))
            k = _linear(X, Wk) + (0 if attn.b_K is None else _w(attn.b_K[..., g, :], X, 1))
            if attn.q_norm is not None:  # per-head RMSNorm before the rotation (Qwen3; THEORY F23)
                q = norm_forward(attn.q_norm, q)
            if attn.k_norm is not None:
                k = norm_forward(attn.k_norm, k)
        if attn.rope is not None:
            pos = torch.arange(T, device=X.device)
            q = apply_rope(q, attn.rope, pos)
            k = apply_rope(k, attn.rope, pos)
    scores = attn.softmax_scale * (q @ k.transpose(-1, -2))
    if attn.position_bias is not None:  # T5: an input-independent bias per (i, j) and head (THEORY F28)
        scores = scores + attn.position_bias.bias(T, h, scores)
    if attn.softcap is not None:  # Gemma 2: c tanh(s / c), before the mask (THEORY F24)
        scores = attn.softcap * torch.tanh(scores / attn.softcap)
    return _mask(scores, attn.causal, key_mask, attn.window)


def _joint_normalised(X: Tensor, W: Any, b: Any, norm: NormSpec | None, h: int) -> Tensor:
    """Head ``h``'s columns of ``norm(X W_all + b_all)``, the norm over all heads' coordinates at once
    (OLMo 2's q_norm/k_norm act on the whole projection before it is split into heads)."""
    t = to_tensor(W, X)  # (..., H, d, d_head)
    n_heads, dh = t.shape[-3], t.shape[-1]
    full = t.movedim(-3, -2).reshape(t.shape[:-3] + (t.shape[-2], n_heads * dh))  # (..., d, H * d_head)
    u = _linear(X, full)
    if b is not None:
        u = u + _w(to_tensor(b, X).reshape(tuple(b.shape[:-2]) + (n_heads * dh,)), X, 1)
    if norm is not None:
        u = norm_forward(norm, u)
    return u[..., h * dh:(h + 1) * dh]


def l2_attention_forward(X: Tensor, W_Q: Tensor, W_V: Tensor, W_O: Tensor, *, key_mask: Tensor | None = None,
                         layer: int = 0, hooks: ForwardHooks | None = None) -> Tensor:
    """Multi-head L2 self-attention (no residual), Kim, Papamakarios, Mnih 2021 eq. (L2-MHA).

    .. math::

        \\sum_h \\mathrm{softmax}_j\\big(-\\|x_i W_Q^h - x_j W_Q^h\\|_2^2/\\sqrt{d_h}\\big)\\, X A_h W_V^h W_O^h,
        \\qquad A_h = W_Q^h W_Q^{hT}/\\sqrt{d_h}

    Its Lipschitz bound is :func:`transcover.lipschitz.l2_attention_lipschitz` (THEORY F13).

    Args:
        X: ``(B, T, d)`` (or ``(T, d)``); ``(M or 1, B, T, d)`` for a member stack.
        W_Q: ``(H, d, d_h)``, tied query/key map (``(M, H, d, d_h)`` stacked).
        W_V: ``(H, d, d_h)``.
        W_O: ``(H, d_h, d)``.
        key_mask, layer, hooks: as in :func:`attention_forward`.

    Returns:
        ``(B, T, d)`` (or ``(T, d)``, or ``(M, B, T, d)``).
    """
    import torch

    dh = W_Q.shape[-1]
    m = "m" if W_Q.ndim == 4 else ""  # Note [member stacks]: einsum names the member axis
    if m:
        X = X.expand(W_Q.shape[0], *X.shape[1:])
    q = torch.einsum(f"{m}...td,{m}hde->{m}...hte", X, W_Q)  # (B, H, T, dh)
    # ||q_i - q_j||^2 = ||q_i||^2 - 2 q_i.q_j + ||q_j||^2; the ||q_i||^2 term is constant in j and
    # cancels in the softmax, but keeping the exact distance costs nothing and mirrors the paper.
    sq = (q * q).sum(-1)
    dist2 = sq[..., :, None] - 2.0 * q @ q.transpose(-1, -2) + sq[..., None, :]
    scores = -dist2 / math.sqrt(dh)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[..., None, None, :], float("-inf"))
    P = torch.softmax(scores, dim=-1)  # (B, H, T, T)
    if hooks is not None and hooks.on_attention_probs is not None:
        P = torch.stack([_call(hooks.on_attention_probs, P[..., h, :, :], layer, h)
                         for h in range(P.shape[-3])], dim=-3)
    A = W_Q @ W_Q.transpose(-1, -2) / math.sqrt(dh)  # (H, d, d)
    value_map = A @ W_V @ W_O  # (H, d, d): A_h W_V^h W_O^h
    PX = torch.einsum("...hts,...sd->...htd", P, X)  # (B, H, T, d)
    if hooks is None or hooks.on_head_output is None:
        return torch.einsum(f"{m}...htd,{m}hde->{m}...te", PX, value_map)
    heads = torch.einsum(f"{m}...htd,{m}hde->{m}...hte", PX, value_map)  # (B, H, T, d)
    return sum(_call(hooks.on_head_output, heads[..., h, :, :], layer, h) for h in range(heads.shape[-3]))


def attention_forward(attn: AttentionSpec, X: Tensor, *, key_mask: Tensor | None = None, layer: int = 0,
                      hooks: ForwardHooks | None = None) -> Tensor:
    """Multi-head self-attention output (before the residual) on X of shape (..., T, d).

    ``sum_h softmax(scores_h) X W_OV^h + b`` with the folded output bias ``b``
    (:meth:`AttentionSpec.effective_output_bias`); L2 attention goes to :func:`l2_attention_forward`.
    ``key_mask`` (``(..., T)`` bool) hides keys from every query (a query with no key left gets
    NaN); ``layer`` is the index the hooks are told.
    """
    import torch

    if attn.kind == "l2":
        return l2_attention_forward(X, to_tensor(attn.W_Q, X), to_tensor(attn.W_V, X), to_tensor(attn.W_O, X),
                                    key_mask=key_mask, layer=layer, hooks=hooks)
    on_probs = None if hooks is None else hooks.on_attention_probs
    on_head = None if hooks is None else hooks.on_head_output
    out = None
    for h in range(attn.n_heads):
        _, _, Wv, Wo = attn.head(h)
        P = _call(on_probs, torch.softmax(attention_scores(attn, X, h, key_mask=key_mask), dim=-1), layer, h)
        W_OV = to_tensor(Wv, X) @ to_tensor(Wo, X)  # (d, d), or (M, d, d) stacked
        term = _call(on_head, _linear(P @ X, W_OV), layer, h)  # (..., T, d): P X W_OV^h
        out = term if out is None else out + term
    bias = attn.effective_output_bias()
    if bias is not None:
        out = out + _w(bias, X, 1)
    return out


def moe_forward(moe: MoESpec, X: Tensor) -> Tensor:
    """A mixture-of-experts FFN (before the residual) on X (..., d), with its top-k routing.

    Every expert is evaluated on every token and weighted by its routing weight, which is 0 for an
    expert not among the token's top k: the same sum as HF's dispatch, in one code path.
    """
    import torch

    if to_tensor(moe.W_router, X).ndim != 2:
        raise ValueError("mixture-of-experts layers are not evaluated as member stacks")
    p = torch.softmax(_linear(X, moe.W_router), dim=-1)  # (..., E)
    top, idx = torch.topk(p, moe.top_k, dim=-1)
    if moe.normalize_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    weight = torch.zeros_like(p).scatter(-1, idx, top)  # the routing weight of every expert, 0 if unselected
    out = None
    for e in range(moe.n_experts):
        term = weight[..., e:e + 1] * ffn_forward(moe.expert(e), X)
        out = term if out is None else out + term
    if moe.shared is not None:
        shared = ffn_forward(moe.shared, X)
        if moe.shared_gate is not None:
            shared = torch.sigmoid(X @ to_tensor(moe.shared_gate, X)[:, None]) * shared
        out = out + shared
    return out


def ffn_forward(ffn: FFNSpec | MoESpec, X: Tensor) -> Tensor:
    """The FFN (before the residual) on X of shape (..., d); a mixture of experts routes (:func:`moe_forward`)."""
    if isinstance(ffn, MoESpec):
        return moe_forward(ffn, X)
    u = _linear(X, ffn.W_1)
    if ffn.b_1 is not None:
        u = u + _w(ffn.b_1, X, 1)
    if ffn.gated:
        g = _linear(X, ffn.W_gate)
        if ffn.b_gate is not None:
            g = g + _w(ffn.b_gate, X, 1)
        hidden = ffn.activation(g) * u
    else:
        hidden = ffn.activation(u)
    y = _linear(hidden, ffn.W_2)
    if ffn.b_2 is not None:
        y = y + _w(ffn.b_2, X, 1)
    return y


def norm_forward(norm: NormSpec, X: Tensor) -> Tensor:
    """``norm(X)``; a stacked scale and shift ``(M, d)`` are lifted to broadcast against X first."""
    stacked = [v is not None and v.ndim == 2 for v in (norm.weight, norm.bias)]
    if not any(stacked):
        return norm(X)
    lift = lambda v: None if v is None else _w(v, X, 1)  # noqa: E731
    return NormSpec(norm.kind, lift(norm.weight), lift(norm.bias), norm.eps)(X)


def _norm(norm: NormSpec, X: Tensor, site: NormSite, hooks: ForwardHooks | None) -> Tensor:
    if hooks is not None and hooks.on_norm is not None:
        out = hooks.on_norm(site, norm, X)
        if out is not None:
            return out
    return norm_forward(norm, X)


def layer_forward(layer: LayerSpec, X: Tensor, *, key_mask: Tensor | None = None,
                  hooks: ForwardHooks | None = None) -> Tensor:
    """One block, with its residuals and normalisations in their places (``LayerSpec.placement``).

    The hooks are told ``layer.index`` (norm sites ``(layer.index, "norm_attn" | "norm_ffn")``).
    """
    i = layer.index

    def attend(Z: Tensor) -> Tensor:
        return attention_forward(layer.attention, Z, key_mask=key_mask, layer=i, hooks=hooks)

    if layer.residual is Residual.PARALLEL:  # both branches read the block's input (THEORY F21)
        return (X + attend(_norm(layer.norm_attn, X, (i, "norm_attn"), hooks))
                + ffn_forward(layer.ffn, _norm(layer.norm_ffn, X, (i, "norm_ffn"), hooks)))
    if layer.placement is Placement.PRE:
        def post(site: str, Y: Tensor) -> Tensor:  # Gemma 2/3, OLMo 2: a norm on the branch output (F26)
            norm = getattr(layer, site)
            return Y if norm is None else _norm(norm, Y, (i, site), hooks)

        X = X + post("post_norm_attn", attend(_norm(layer.norm_attn, X, (i, "norm_attn"), hooks)))
        return X + post("post_norm_ffn", ffn_forward(layer.ffn, _norm(layer.norm_ffn, X, (i, "norm_ffn"), hooks)))
    X = _norm(layer.norm_attn, X + attend(X), (i, "norm_attn"), hooks)
    return _norm(layer.norm_ffn, X + ffn_forward(layer.ffn, X), (i, "norm_ffn"), hooks)


def head_forward(head: MLPHeadSpec, X: Tensor) -> Tensor:
    """The MLP head on the sequence X (..., T, d): read-out (mean or first token), then the MLP."""
    z = X.mean(dim=-2) if head.readout == "mean" else X[..., 0, :]
    for i, (W, b) in enumerate(zip(head.weights, head.biases)):
        z = _linear(z, W)
        if b is not None:
            z = z + _w(b, z, 1)
        if i < len(head.weights) - 1:
            z = head.activation(z)
    return z


def transformer_forward(spec: TransformerSpec, X: Tensor, *, with_head: bool = True,
                        key_mask: Tensor | None = None, hooks: ForwardHooks | None = None,
                        layers: Sequence[LayerSpec] | None = None) -> Tensor:
    """Input norm, all layers, final norm and MLP head (if present) on embedded input X (..., T, d).

    Args:
        spec: the model; its arrays may carry a member axis (Note [member stacks]).
        X: ``(..., T, d)``; ``(M or 1, batch..., T, d)`` for a member stack.
        with_head: apply ``spec.head`` (else return the token rows of ``g_L``).
        key_mask: ``(..., T)`` bool, keys every query may read (padding); None reads all.
        hooks: observe or replace norms and attention (Note [hooks]).
        layers: replaces ``spec.layers`` (e.g. a materialised copy of a lazy sequence).
    """
    layers = spec.layers if layers is None else layers
    if spec.input_norm is not None:
        X = _norm(spec.input_norm, X, (-1, "input_norm"), hooks)
    for layer in layers:
        X = layer_forward(layer, X, key_mask=key_mask, hooks=hooks)
    if spec.final_norm is not None:
        X = _norm(spec.final_norm, X, (len(layers), "final_norm"), hooks)
    if with_head and spec.head is not None:
        return head_forward(spec.head, X)
    return X
