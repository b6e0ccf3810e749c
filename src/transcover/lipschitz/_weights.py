"""The class bounds every Lipschitz and perturbation bound reads, from ``norms.ModelNorms`` (private).

A *class* of parameter sets is described by one number per matrix (spectral norms), bias
(l2 norms) and normalisation scale (max |gamma|, ||beta||_2): every parameter set whose norms are
at most these numbers belongs to it.  Bounds computed from a :class:`LayerBounds` hold for *every*
member of the class, which is what the covering-number work needs (THEORY F8, F10) and what lets
:func:`~transcover.lipschitz.perturbation_bound` treat two models symmetrically (the class of the
elementwise maximum of their norms contains both).  The numbers are read from one measurement,
:func:`transcover.norms.measure_model` (Note [one route per matrix] there); nothing here measures.

Note [rounding]: spectral norms are the certified upper ends of ``transcover.norms`` intervals
(Cholesky certificates with rounding accounted for; products ``W_Q W_K^T``, ``W_V W_O`` through
their low-rank factors).  Bias norms are float64 l2 norms (relative error < d * 1.1e-16).  Every
certified upper bound is multiplied once by ``1 + ROUNDING_PAD`` (``transcover._results.rounding_pad``,
1e-9 for float64 arithmetic), which dominates the bias-norm error, the softmax scale's product
with the score norm, and the float64 rounding of the closed-form arithmetic that follows (a few
dozen operations at 1.1e-16 each).  This is the certification of rounding, not a test tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from .._errors import InputError, UnsupportedArchitectureError, check_radius
from .._results import rounding_pad
from ..model import NormKind, Placement, TransformerSpec
from ..norms import LayerMeasure, ModelNorms, NormMeasure, matrix_interval, measure_layer, measure_model, product_interval

__all__ = [
    "ROUNDING_PAD", "NormBounds", "LayerBounds", "ClassBounds", "spectral", "spectral_product", "class_bounds",
    "spec_norms", "class_max", "attention_kind", "check_radius",
]

ROUNDING_PAD = rounding_pad()


def spectral(W) -> float:  # noqa: ANN001
    """Certified upper end of ||W||_2 (``transcover.norms.spectral_norm_interval``, rounding included)."""
    return float(matrix_interval(W).upper)


def spectral_product(A, B) -> float:  # noqa: ANN001
    """Certified upper end of ||A B||_2 without forming A B (rank <= inner dimension)."""
    return float(product_interval(A, B).upper)


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
class LayerBounds:
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
    residual: str = "sequential"  # "parallel": x + attn(N_1 x) + ffn(N_2 x), THEORY F21
    has_rope_qk_bias: bool = False  # RoPE with query/key biases: G.3 charges the split scores (F22)
    # query/key normalisation (THEORY F23): per query head ||W_K^h||, ||b_Q^h||, ||b_K^h||, and each
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
    # Note [split scores] in ``norms._model``: G.3 charges W_Q, W_K, b_Q, b_K one by one (RoPE with
    # query/key biases, query/key normalisation); the biases present in either model of the class
    has_b_Q: bool = False
    has_b_K: bool = False
    has_pos_bias: bool = False  # T5's relative position bias: G.3 charges its table per head (F28)
    rope_positions: int | None = None  # RoPE: B_KQ is the sup over offsets below this (THEORY F22)

    @property
    def split_scores(self) -> bool:
        return self.has_rope_qk_bias or self.has_q_norm or self.has_k_norm
    qk_joint: bool = False  # q/k norms over the whole projection (OLMo 2): B_Q, B_K are then its norm bound
    # a norm on the branch output, x + N_post(f(N_pre x)) (Gemma 2/3, OLMo 2; THEORY F26); None: none
    post_norm_attn: NormBounds | None = None
    post_norm_ffn: NormBounds | None = None


def _norm_bounds(n: NormMeasure) -> NormBounds:
    if n.kind is NormKind.NONE:
        return NormBounds(NormKind.NONE)
    return NormBounds(n.kind, 1.0 if n.gamma_max is None else n.gamma_max,
                      0.0 if n.beta_norm is None else n.beta_norm, n.eps)


def layer_bounds(m: LayerMeasure) -> LayerBounds:
    """The class bounds of one measured layer (``s * ||W_Q W_K^T||`` and ``s ||b_Q W_K^T||`` in float64,
    covered by ``ROUNDING_PAD``; RoPE: ``s sup_{|delta| < P} ||W_Q R_delta W_K^T||``, the certified sup over
    every relative position of a sequence of at most P = max_position tokens, Note [RoPE score matrix]
    in ``norms._model``).

    RoPE with query/key biases (GPT-NeoX): ``s_ij = s (x_i W_Q + b_Q) R (x_j W_K + b_K)^T`` and
    ``|s_ij - s'_ij| <= s||W_Q|| (||W_K|| r + ||b_K||) ||dx_i|| + s||W_K|| (||W_Q|| r + ||b_Q||) ||dx_j||``,
    which F6's ``2 B_KQ r + ||b||`` dominates with ``||b|| = s (||W_Q|| ||b_K|| + ||b_Q|| ||W_K||)`` in both
    metrics (THEORY F22).
    """
    if m.experts is not None:  # measured expert by expert, but no Lipschitz constant exists (F25)
        from ..model import moe_refusal

        raise moe_refusal(m.index, "`analyze` reports its per-expert norms")
    s = m.scale
    post = {k: None if getattr(m, k) is None else _norm_bounds(getattr(m, k)) for k in ("post_norm_attn", "post_norm_ffn")}
    kq = tuple(s * h.W_QK.upper for h in m.heads)
    if m.rope and m.q_norm is None and m.k_norm is None:
        bkq = tuple(s * (h.W_Q.upper * (h.b_K or 0.0) + (h.b_Q or 0.0) * h.W_K.upper) for h in m.heads)
    else:
        bkq = tuple(0.0 if h.b_QK is None else s * h.b_QK for h in m.heads)
    fields_ = dict(
        index=m.index, placement=m.placement, d_model=m.d_model,
        B_KQ=kq, B_bKQ=bkq,
        B_OV=tuple(h.W_OV.upper for h in m.heads), B_V=tuple(h.W_V.upper for h in m.heads),
        B_O=m.W_O.upper, B_bout=m.b_out or 0.0,
        B_W1=m.W_1.upper, B_W2=m.W_2.upper, B_b1=m.b_1 or 0.0, B_b2=m.b_2 or 0.0,
        B_Wg=None if m.W_gate is None else m.W_gate.upper, B_bg=m.b_gate or 0.0, activation=m.activation,
        norm_attn=_norm_bounds(m.norm_attn), norm_ffn=_norm_bounds(m.norm_ffn),
        attention_kind=m.attention_kind, B_Q=tuple(h.W_Q.upper for h in m.heads), d_head=m.d_head,
        has_query_bias=m.has_query_bias, has_output_bias=m.b_out is not None,
        has_b1=m.b_1 is not None, has_b2=m.b_2 is not None, has_bg=m.b_gate is not None,
        residual=m.residual, has_rope_qk_bias=m.has_rope_qk_bias, has_pos_bias=m.pos_bias_heads is not None, **post,
        rope_positions=m.rope_positions,
    )
    fields_.update(_qk_norm_bounds(m))  # may replace B_Q (whole-projection norms)
    return LayerBounds(**fields_)


def _qk_norm_bounds(m: LayerMeasure) -> dict[str, object]:
    """The F22/F23 inputs of a layer with RoPE or query/key normalisation (empty without both): the
    key map's and the biases' own norms, and each query/key norm's Lipschitz constant and output size."""
    if not m.rope and m.q_norm is None and m.k_norm is None:
        return {}
    from ._normalisation import rmsnorm_lipschitz

    out: dict[str, object] = dict(has_q_norm=m.q_norm is not None, has_k_norm=m.k_norm is not None,
                                  softmax_scale=m.scale, has_b_Q=any(h.b_Q is not None for h in m.heads),
                                  has_b_K=any(h.b_K is not None for h in m.heads))
    for side, n in (("q", m.q_norm), ("k", m.k_norm)):
        if n is None:
            continue
        if n.kind is not NormKind.RMSNORM or n.beta_norm is not None:
            raise UnsupportedArchitectureError(f"query/key normalisation of kind {n.kind.value} with a shift: "
                                               "only RMSNorm (THEORY F23) is bounded")
        g = 1.0 if n.gamma_max is None else n.gamma_max
        out[f"{side}n_lip"] = rmsnorm_lipschitz(g, n.eps)
        out[f"{side}n_out"] = g * math.sqrt(m.d_head)
    out["B_K"] = tuple(h.W_K.upper for h in m.heads)
    out["B_bQ"] = tuple(h.b_Q or 0.0 for h in m.heads)
    out["B_bK"] = tuple(h.b_K or 0.0 for h in m.heads)
    if m.qk_norm_scope == "all":
        out.update(_joint_qk_bounds(m, out))
    return out


def _joint_qk_bounds(m: LayerMeasure, out: dict) -> dict[str, object]:
    """F23 with the norm over the whole projection (OLMo 2; Note [whole-projection q/k norm] in ``_qknorm``).

    Head h reads coordinates ``P_h`` of ``N(x W_all + b_all)``: ``||P_h N(u)|| <= ||N(u)|| < max|gamma|
    sqrt(H d_head)`` and ``||P_h (N(u) - N(u'))|| <= L_N ||W_all|| ||dx||`` with ``||W_all||_2 <=
    sqrt(sum_g ||W^g||_2^2)`` (the heads' column blocks).  So F23's per-head inputs are the size bound
    over the whole width and this norm bound for every head."""
    H = len(m.heads)
    groups = {h.kv: h.W_K.upper for h in m.heads}
    up = 1.0 + (H + 4) * 2.0 ** -52  # the float64 rounding of H squares, their sum and the root
    b_q = math.sqrt(sum(h.W_Q.upper ** 2 for h in m.heads)) * up
    b_k = math.sqrt(sum(v * v for v in groups.values())) * up
    res: dict[str, object] = dict(qk_joint=True, B_Q=(b_q,) * H, B_K=(b_k,) * H)
    if m.q_norm is not None:
        res["qn_out"] = out["qn_out"] * math.sqrt(H)
    if m.k_norm is not None:
        res["kn_out"] = out["kn_out"] * math.sqrt(len(groups))
    return res


def layer_norms(layer) -> LayerBounds:  # noqa: ANN001
    """The class bounds of one layer spec (measures it: ``norms.measure_model`` on that layer alone)."""
    return layer_bounds(measure_layer(layer))


@dataclass(frozen=True)
class ClassBounds:
    """Class bounds of a whole network: input norm, layers, final norm."""

    d_model: int
    input_norm: NormBounds
    layers: tuple[LayerBounds, ...]
    final_norm: NormBounds


def attention_kind(spec: TransformerSpec) -> str:
    """'l2' when the spec's attention is Kim et al.'s L2 attention (``AttentionSpec.kind``), else 'dot'."""
    return "l2" if any(layer.attention.kind == "l2" for layer in spec.layers) else "dot"


def class_bounds(norms: ModelNorms) -> ClassBounds:
    """The class of one measured model: every parameter set whose norms are at most these."""
    return ClassBounds(d_model=norms.d_model, input_norm=_norm_bounds(norms.input_norm),
                       layers=tuple(layer_bounds(m) for m in norms.layers),
                       final_norm=_norm_bounds(norms.final_norm))


def spec_norms(spec: TransformerSpec | ModelNorms) -> ClassBounds:
    """The class bounds of ``spec`` (measured once by ``norms.measure_model``), or of a measurement."""
    return class_bounds(spec if isinstance(spec, ModelNorms) else measure_model(spec))


def _architecture(n: ClassBounds) -> tuple:
    """What two classes must share to have a common superclass (a backstop for
    ``model.require_same_structure``; the head dimension and bias presence may differ, Note
    [structural differences] in ``model._compare``)."""
    return (n.d_model, n.input_norm.kind, n.final_norm.kind,
            tuple((L.placement, L.residual, L.has_q_norm, L.has_k_norm, L.qk_joint, len(L.B_KQ), L.B_Wg is None, L.activation,
                   L.attention_kind, L.norm_attn.kind, L.norm_ffn.kind,
                   *(None if n is None else n.kind for n in (L.post_norm_attn, L.post_norm_ffn)))
                  for L in n.layers))


def _max_norm(a: NormBounds, b: NormBounds) -> NormBounds:
    """The class of both: larger scale and shift, eps over [min, max] (Note [eps change] in ``_normalisation``)."""
    lo, hi = min(a.eps, b.eps), max(a.eps_max, b.eps_max)
    return replace(a, gamma_max=max(a.gamma_max, b.gamma_max), beta_norm=max(a.beta_norm, b.beta_norm),
                   eps=lo, eps_hi=None if hi == lo else hi)


def class_max(a: ClassBounds, b: ClassBounds) -> ClassBounds:
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
        for f in fields(LayerBounds):
            va, vb = getattr(la, f.name), getattr(lb, f.name)
            if f.name in ("norm_attn", "norm_ffn"):
                kw[f.name] = _max_norm(va, vb)
            elif f.name in ("post_norm_attn", "post_norm_ffn"):  # both present or both absent (_architecture)
                kw[f.name] = None if va is None else _max_norm(va, vb)
            elif f.name == "rope_positions":  # B_KQ of each model holds below its own P: both below the smaller
                kw[f.name] = min((v for v in (va, vb) if v is not None), default=None)
            elif f.name.startswith("has_"):  # a bias in either model is charged (absent = zero)
                kw[f.name] = va or vb
            elif isinstance(va, tuple):
                kw[f.name] = tuple(max(x, y) for x, y in zip(va, vb))
            elif isinstance(va, float) and not isinstance(va, bool):
                kw[f.name] = max(va, vb)
            else:
                kw[f.name] = va
        layers.append(LayerBounds(**kw))
    return ClassBounds(a.d_model, _max_norm(a.input_norm, b.input_norm), tuple(layers),
                     _max_norm(a.final_norm, b.final_norm))
