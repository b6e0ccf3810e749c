"""The per-matrix norms every Lipschitz and perturbation bound reads (private).

A *class* of parameter sets is described by one number per matrix (spectral norms), bias
(l2 norms) and normalisation scale (max |gamma|, ||beta||_2): every parameter set whose norms are
at most these numbers belongs to it.  Bounds computed from a :class:`LayerNorms` hold for *every*
member of the class, which is what the covering-number work needs (THEORY F8, F10) and what lets
:func:`~transcover.lipschitz.perturbation_bound` treat two models symmetrically (the class of the
elementwise maximum of their norms contains both).

Note [rounding]: spectral norms are the certified upper ends of ``transcover.norms`` intervals
(Cholesky certificates with rounding accounted for; products ``W_Q W_K^T``, ``W_V W_O`` through
their low-rank factors).  Bias norms are float64 l2 norms (relative error < d * 1.1e-16).  Every
certified upper bound is multiplied once by ``1 + ROUNDING_PAD`` (1e-9), which dominates the
bias-norm error and the float64 rounding of the closed-form arithmetic that follows (a few dozen
operations at 1.1e-16 each).  This is the certification of rounding, not a test tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from torch import Tensor

from .._errors import InputError, UnsupportedArchitectureError
from ..model._arrays import to_tensor
from ..model._spec import AttentionSpec, FFNSpec, LayerSpec, NormKind, NormSpec, Placement, TransformerSpec

__all__ = [
    "ROUNDING_PAD", "NormBounds", "LayerNorms", "SpecNorms", "spectral", "spectral_product", "layer_norms", "spec_norms",
    "class_max", "attention_kind", "check_radius",
]

ROUNDING_PAD = 1e-9


def _f64(W) -> Tensor:  # noqa: ANN001
    """A float64 torch copy of a spec array of either backend (numpy from files, torch from modules)."""
    import torch

    return to_tensor(W, dtype=torch.float64).detach()


def spectral(W: Tensor) -> float:
    """Certified upper end of ||W||_2 (``transcover.norms.spectral_norm_interval``, rounding included)."""
    from ..norms import spectral_norm_interval

    W = _f64(W)
    if W.numel() == 0 or not bool(W.any()):
        return 0.0
    return float(spectral_norm_interval(W, rtol=1e-6).upper)


def spectral_product(A: Tensor, B: Tensor) -> float:
    """Certified upper end of ||A B||_2 without forming A B (rank <= inner dimension)."""
    from ..norms import product_norm_interval

    A, B = _f64(A), _f64(B)
    if A.numel() == 0 or B.numel() == 0:
        return 0.0
    return float(product_norm_interval(A, B, rtol=1e-6).upper)


def _l2(v: Tensor | None) -> float:
    return 0.0 if v is None else float(_f64(v).norm())


@dataclass(frozen=True)
class NormBounds:
    """A normalisation map's class bounds: kind, max|gamma|, ||beta||_2, and the range of eps."""

    kind: NormKind
    gamma_max: float = 1.0
    beta_norm: float = 0.0
    eps: float = 0.0  # the smallest eps of the class (the largest Lipschitz constant)
    eps_hi: float | None = None  # the largest eps of a class of two models (None: eps only)

    @property
    def eps_max(self) -> float:
        return self.eps if self.eps_hi is None else self.eps_hi


@dataclass(frozen=True)
class LayerNorms:
    """Class bounds of one layer (per-head lists indexed by query head).

    ``B_KQ[h] = ||scale W_Q^h W_K^hT||_2``, ``B_bKQ[h] = ||scale b_Q^h W_K^hT||_2`` (the only part of
    the query/key biases that survives the softmax, Note [attention biases] in ``model._spec``),
    ``B_OV[h] = ||W_V^h W_O^h||_2``, ``B_V[h] = ||W_V^h||_2``, ``B_O = ||W_O||_2`` (stacked
    ``(H d_head, d)``), ``B_bout = ||b_O + sum_h b_V^h W_O^h||_2``.
    """

    index: int
    placement: Placement
    d_model: int
    B_KQ: tuple[float, ...]
    B_bKQ: tuple[float, ...]
    B_OV: tuple[float, ...]
    B_V: tuple[float, ...]
    B_O: float
    B_bout: float
    B_W1: float
    B_W2: float
    B_b1: float
    B_b2: float
    B_Wg: float | None  # gated FFN only
    B_bg: float
    activation: str
    norm_attn: NormBounds
    norm_ffn: NormBounds
    attention_kind: str = "dot"  # "dot" or "l2" (Kim et al. 2021)
    B_Q: tuple[float, ...] = ()  # ||W_Q^h||_2, read by the L2-attention bound only
    d_head: int = 0
    has_query_bias: bool = False
    has_output_bias: bool = False
    has_b1: bool = False
    has_b2: bool = False
    has_bg: bool = False
    residual: str = "sequential"  # "parallel": x + attn(N_1 x) + ffn(N_2 x), THEORY F19
    has_rope_qk_bias: bool = False  # RoPE with query/key biases: Lemma G.3 is not derived (refused)
    # query/key normalisation (THEORY F21): per query head ||W_K^h||, ||b_Q^h||, ||b_K^h||, and each
    # norm's max|gamma|/sqrt(eps) (Lipschitz) and max|gamma| sqrt(d_head) (output size); all "larger is
    # worse", so class_max's elementwise maximum is the class of both
    has_q_norm: bool = False
    has_k_norm: bool = False
    B_K: tuple[float, ...] = ()
    B_bQ: tuple[float, ...] = ()
    B_bK: tuple[float, ...] = ()
    qn_lip: float = 0.0
    qn_out: float = 0.0
    kn_lip: float = 0.0
    kn_out: float = 0.0
    softmax_scale: float = 0.0  # s, read with the norms above


def _norm_bounds(n: NormSpec | None) -> NormBounds:
    if n is None:
        return NormBounds(NormKind.NONE)
    return NormBounds(n.kind, n.gamma_max_abs, n.beta_norm, float(n.eps))


def _attention_norms(attn: AttentionSpec) -> dict[str, object]:
    if attn.softcap is not None and attn.b_K is not None:
        # c tanh(s / c) does not let the key bias cancel, and F6/F22 drop it (THEORY F22)
        raise UnsupportedArchitectureError("soft-capped attention with a key bias is not bounded (THEORY F22)")
    H = attn.n_heads
    s = attn.softmax_scale
    B_KQ, B_bKQ, B_OV, B_V, B_Q = [], [], [], [], []
    for h in range(H):
        Wq, Wk, Wv, Wo = (_f64(t) for t in attn.head(h))
        if attn.rope is not None:
            # With RoPE the score matrix is s W_Q R_{i-j} W_K^T for a rotation R: bound it by the
            # product of norms, valid for every relative position.
            # With biases (GPT-NeoX) s_ij = s (x_i W_Q + b_Q) R (x_j W_K + b_K)^T, and
            # |s_ij - s'_ij| <= s||W_Q|| (||W_K|| r + ||b_K||) ||dx_i|| + s||W_K|| (||W_Q|| r + ||b_Q||) ||dx_j||,
            # which F6's "2 B_KQ r + ||b||" dominates with ||b|| = s (||W_Q|| ||b_K|| + ||b_Q|| ||W_K||), in
            # both metrics (THEORY F6, RoPE with biases).
            nq, nk = spectral(Wq), spectral(Wk)
            B_KQ.append(s * nq * nk)
            g = attn.kv_index(h)
            bq = 0.0 if attn.b_Q is None else _l2(attn.b_Q[h])
            bk = 0.0 if attn.b_K is None else _l2(attn.b_K[g])
            B_bKQ.append(s * (nq * bk + bq * nk))
        else:
            B_KQ.append(s * spectral_product(Wq, Wk.T))
            B_bKQ.append(0.0 if attn.b_Q is None else s * _l2(_f64(attn.b_Q[h]) @ Wk.T))
        B_OV.append(spectral_product(Wv, Wo))
        B_V.append(spectral(Wv))
        B_Q.append(spectral(Wq))
    W_O = _f64(attn.W_O).reshape(-1, attn.d_model)
    bias = attn.effective_output_bias()
    return dict(B_KQ=tuple(B_KQ), B_bKQ=tuple(B_bKQ), B_OV=tuple(B_OV), B_V=tuple(B_V),
                B_Q=tuple(B_Q), B_O=spectral(W_O), B_bout=_l2(bias), **_qk_norms(attn))


def _qk_norms(attn: AttentionSpec) -> dict[str, object]:
    """The F21 inputs of a layer with query/key normalisation (empty without it)."""
    if attn.q_norm is None and attn.k_norm is None:
        return {}
    from ._normalisation import rmsnorm_lipschitz

    out: dict[str, object] = dict(has_q_norm=attn.q_norm is not None, has_k_norm=attn.k_norm is not None,
                                  softmax_scale=attn.softmax_scale)
    for side, n in (("q", attn.q_norm), ("k", attn.k_norm)):
        if n is None:
            continue
        if n.kind is not NormKind.RMSNORM or n.bias is not None:
            raise UnsupportedArchitectureError(f"query/key normalisation of kind {n.kind.value} with a shift: "
                                               "only RMSNorm (THEORY F21) is bounded")
        out[f"{side}n_lip"] = rmsnorm_lipschitz(n.gamma_max_abs, float(n.eps))
        out[f"{side}n_out"] = n.gamma_max_abs * math.sqrt(attn.d_head)
    H = attn.n_heads
    out["B_K"] = tuple(spectral(_f64(attn.W_K[attn.kv_index(h)])) for h in range(H))
    out["B_bQ"] = tuple(0.0 if attn.b_Q is None else _l2(attn.b_Q[h]) for h in range(H))
    out["B_bK"] = tuple(0.0 if attn.b_K is None else _l2(attn.b_K[attn.kv_index(h)]) for h in range(H))
    return out


def _ffn_norms(ffn: FFNSpec) -> dict[str, object]:
    return dict(
        B_W1=spectral(ffn.W_1), B_W2=spectral(ffn.W_2), B_b1=_l2(ffn.b_1), B_b2=_l2(ffn.b_2),
        B_Wg=None if ffn.W_gate is None else spectral(ffn.W_gate), B_bg=_l2(ffn.b_gate),
        activation=ffn.activation.value,
    )


def layer_norms(layer: LayerSpec) -> LayerNorms:
    """The class bounds of one layer, read from its weights."""
    return LayerNorms(
        index=layer.index, placement=layer.placement, d_model=layer.attention.d_model,
        norm_attn=_norm_bounds(layer.norm_attn), norm_ffn=_norm_bounds(layer.norm_ffn),
        attention_kind=layer.attention.kind, d_head=layer.attention.d_head,
        has_query_bias=layer.attention.b_Q is not None and layer.attention.rope is None,
        has_output_bias=layer.attention.b_V is not None or layer.attention.b_O is not None,
        has_b1=layer.ffn.b_1 is not None, has_b2=layer.ffn.b_2 is not None,
        has_bg=layer.ffn.b_gate is not None, residual=layer.residual.value,
        has_rope_qk_bias=layer.attention.rope is not None and layer.attention.q_norm is None
        and layer.attention.k_norm is None and (layer.attention.b_Q is not None or layer.attention.b_K is not None),
        **_attention_norms(layer.attention), **_ffn_norms(layer.ffn),
    )


@dataclass(frozen=True)
class SpecNorms:
    """Class bounds of a whole network: input norm, layers, final norm."""

    d_model: int
    input_norm: NormBounds
    layers: tuple[LayerNorms, ...]
    final_norm: NormBounds


def attention_kind(spec: TransformerSpec) -> str:
    """'l2' when the spec's attention is Kim et al.'s L2 attention (``AttentionSpec.kind``), else 'dot'."""
    return "l2" if any(layer.attention.kind == "l2" for layer in spec.layers) else "dot"


def spec_norms(spec: TransformerSpec) -> SpecNorms:
    """Read every class bound of ``spec`` (one layer at a time, so lazy specs stay lazy)."""
    spec = spec.to_torch()  # specs loaded from files hold numpy arrays
    return SpecNorms(
        d_model=spec.d_model, input_norm=_norm_bounds(spec.input_norm),
        layers=tuple(layer_norms(layer) for layer in spec.layers),
        final_norm=_norm_bounds(spec.final_norm),
    )


def _architecture(n: SpecNorms) -> tuple:
    """What two classes must share to have a common superclass (a backstop for
    ``model.require_same_structure``; the head dimension and bias presence may differ, Note
    [structural differences] in ``model._compare``)."""
    return (n.d_model, n.input_norm.kind, n.final_norm.kind,
            tuple((L.placement, L.residual, L.has_q_norm, L.has_k_norm, len(L.B_KQ), L.B_Wg is None, L.activation, L.attention_kind,
                   L.norm_attn.kind, L.norm_ffn.kind)
                  for L in n.layers))


def _max_norm(a: NormBounds, b: NormBounds) -> NormBounds:
    """The class of both: larger scale and shift, eps over [min, max] (Note [eps change] in ``_normalisation``)."""
    lo, hi = min(a.eps, b.eps), max(a.eps_max, b.eps_max)
    return replace(a, gamma_max=max(a.gamma_max, b.gamma_max), beta_norm=max(a.beta_norm, b.beta_norm),
                   eps=lo, eps_hi=None if hi == lo else hi)


def class_max(a: SpecNorms, b: SpecNorms) -> SpecNorms:
    """The smallest class containing both parameter sets (elementwise maximum of every bound).

    Raises:
        InputError: if the two networks do not have the same architecture.
    """
    if _architecture(a) != _architecture(b):
        raise InputError(
            "the two models have different architectures (layers, widths, heads, activation or "
            f"normalisation differ): {len(a.layers)} layers d_model={a.d_model} vs "
            f"{len(b.layers)} layers d_model={b.d_model}")
    layers = []
    for la, lb in zip(a.layers, b.layers):
        kw = {}
        for f in fields(LayerNorms):
            va, vb = getattr(la, f.name), getattr(lb, f.name)
            if f.name in ("norm_attn", "norm_ffn"):
                kw[f.name] = _max_norm(va, vb)
            elif f.name.startswith("has_"):  # a bias in either model is charged (absent = zero)
                kw[f.name] = va or vb
            elif isinstance(va, tuple):
                kw[f.name] = tuple(max(x, y) for x, y in zip(va, vb))
            elif isinstance(va, float) and not isinstance(va, bool):
                kw[f.name] = max(va, vb)
            else:
                kw[f.name] = va
        layers.append(LayerNorms(**kw))
    return SpecNorms(a.d_model, _max_norm(a.input_norm, b.input_norm), tuple(layers),
                     _max_norm(a.final_norm, b.final_norm))


def check_radius(radius: float, name: str = "radius") -> float:
    if not isinstance(radius, (int, float)) or not math.isfinite(radius) or radius <= 0:
        raise InputError(f"{name} must be a finite number > 0, but got {name}={radius!r}")
    return float(radius)
