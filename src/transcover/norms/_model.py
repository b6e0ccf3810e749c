"""``measure_model``: every norm a bound reads, measured once per matrix (issue 11).

The Lipschitz chain (``transcover.lipschitz``), the perturbation lemma G.3, the covering terms
(``transcover.covering``) and the constrained-training monitors all read the same few numbers of
a model: per head ``||W_Q^h W_K^hT||_2`` and ``||W_V^h W_O^h||_2``, ``||W_V^h||_2``, ``||W_Q^h||_2``,
the stacked ``||W_O||_2``, the FFN's ``||W_1||_2``, ``||W_2||_2``, ``||W_gate||_2``, the bias and
normalisation norms, and, when the model is compared with a reference (an initialisation, or the
second model of ``perturb``), the distances ``||W_i - W~_i||``.  :class:`ModelNorms` holds them as
certified :class:`~transcover.Interval` s (spectral norms: the Cholesky certificates of
``_spectral``) or float64 vector norms, and every consumer reads them from here instead of
measuring again.

Note [one route per matrix]: each certified spectral norm is computed by exactly one call of
:func:`~transcover.norms.spectral_norm_interval` or :func:`~transcover.norms.product_norm_interval`
(a test counts them).  The score matrix is measured unscaled, ``W_Q^h W_K^hT``; the softmax scale
``s`` is applied by the reader (``s * upper`` inside a chain that carries a rounding pad, or
:meth:`HeadMeasure.W_KQ`, rounded outward).  With RoPE the score matrix is
``s W_Q^h R_Delta W_K^hT`` for every relative rotation: Note [RoPE score matrix].

Note [RoPE score matrix]: with RoPE, ``HeadMeasure.W_QK`` is the certified
``sup_{|delta| < P} ||W_Q^h R_delta W_K^kvT||_2`` of :func:`~transcover.norms._rope_sup.rope_kq_interval`
(P = ``RopeSpec.max_position``; THEORY F22, Note [RoPE supremum] there), unscaled like the rest: its
upper end is the smaller of ``||W_Q^h|| ||W_K^kv||`` and the slow/fast split, both built on the two
intervals certified here (passed in, not measured again), and ``analyze`` shows this interval as
``B_KQ``.  Every consumer (Lipschitz chain, G.3, covering, monitors) therefore reads the bound for
sequences of at most P positions, the range over which the supremum is taken (with dynamic NTK
scaling every length ``T <= P``, where the upper end is the rotation-free product).  The distances
stay rotation-free: ``||(s Q - s~ Q~) R K^T + s~ Q~ R (K - K~)^T|| <= ...`` with ``||R|| = 1``
(:func:`_kq_distance`).

Note [split scores]: where the scores are not ``x~_i A~ x_j^T`` with the folded ``A~`` (RoPE with
query/key biases, THEORY F22; query/key normalisation, F23), Lemma G.3 charges the pieces of the
scores one by one: per query head ``W_Q^h``, ``W_K^kv`` (spectral), ``b_Q^h``, ``b_K^kv`` (l2) and the
norms' scales ``q_norm.gamma``, ``k_norm.gamma`` (linf), instead of ``W_KQ.h`` and ``b_KQ.h``; the
two models of a pair must then share the softmax scale and the norms' eps (refused otherwise).

Note [distances]: a matrix present in both models is compared directly; a bias or normalisation
scale present in one model only is compared with zeros (ones for gamma), which is what the other
model's forward pass uses (Note [structural differences] in ``model._compare``).  Differences of
products are products of concatenated factors (rank <= 2 d_head), so no d x d matrix is formed: the
factors' differences balanced against the factors (Note [product differences]), so that the certificate's
error scales with the change, not with the weights.

Note [one engine]: this module is the only place the certified norms of a model's matrices are
measured.  Per layer, :func:`layer_arrays` makes one float64 copy of the attention weights and
every head's ``d_head x d_head`` Gram in four batched products (with the error bound of
``_certify.batched_gram_with_error``); every head's certificate reuses them.  ``transcover
analyze`` (``_analyze.analyze_spec``) is a view of the same :class:`LayerMeasure` s, adding only
what it alone shows (Frobenius and (2,1) norms of every matrix, the augmented query-bias matrix,
the embeddings); the Lipschitz chain, the covering terms, ``bound``, ``report`` and the training
monitors (``constrain.TrainingMonitor``) read the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from .._results import Interval, Kind, as_dict
from ..model import AttentionSpec, FFNSpec, LayerSpec, MoESpec, NormKind, NormSpec, Placement, TransformerSpec
from . import _entrywise, _spectral
from ._certify import batched_gram_with_error
from ._floating import gamma
from ._model_parts import split_distances, split_scores
from ._rope_sup import rope_kq_interval

__all__ = ["HeadMeasure", "NormMeasure", "Distance", "LayerMeasure", "ModelNorms", "measure_model", "measure_layer",
           "matrix_interval", "product_interval", "layer_arrays"]

_ZERO = Interval(0.0, 0.0, Kind.EXACT, "absent")


@dataclass(frozen=True)
class HeadMeasure:
    """One query head ``h`` (reading key/value head ``kv``): certified spectral norms, unscaled.

    ``W_QK = ||W_Q^h W_K^kvT||_2`` (with RoPE ``sup_{|delta| < P} ||W_Q^h R_delta W_K^kvT||_2``, Note
    [RoPE score matrix]),
    ``W_OV = ||W_V^kv W_O^h||_2``, ``b_QK = ||b_Q^h W_K^kvT||_2`` (float64; None without a query
    bias or with RoPE), and with ``entrywise`` the (2,1) norms of ``s W_Q^h W_K^kvT`` and ``W_OV``.
    """

    head: int
    kv: int
    W_QK: Interval
    W_OV: Interval
    W_Q: Interval
    W_V: Interval
    W_K: Interval | None = None  # RoPE or query/key normalisation only
    b_QK: float | None = None
    b_Q: float | None = None  # ||b_Q^h||, ||b_K^kv|| (RoPE or query/key normalisation: THEORY F22, F23)
    b_K: float | None = None
    l21_KQ: Interval | None = None
    l21_OV: Interval | None = None
    # (2,1) norms of W_Q^h and W_K^kv (entrywise, split scores only: Note [split scores])
    l21_Q: Interval | None = None
    l21_K: Interval | None = None

    def W_KQ(self, scale: float) -> Interval:
        """``||scale W_Q^h W_K^hT||_2`` (sup over relative positions with RoPE), rounded outward."""
        lo, hi = self.W_QK.lower * scale, self.W_QK.upper * scale
        if math.frexp(scale)[0] == 0.5 and (lo == 0.0 or lo >= 2.2250738585072014e-308) and hi < math.inf:
            # a power of two: the product is exact where it stays normal (a subnormal one rounds: the red team of
            # stop 35 had a scale 2^-1070 certify 9.4e-323 for an exact 9.49e-323), so no rounding to direct
            return Interval(lo, hi, self.W_QK.kind, self.W_QK.method)
        return _spectral.scale_interval(self.W_QK, scale)


@dataclass(frozen=True)
class NormMeasure:
    """A normalisation map: kind, ``max|gamma|`` and ``||beta||_2`` (None: no such parameter), eps."""

    kind: NormKind
    gamma_max: float | None
    beta_norm: float | None
    eps: float

    @classmethod
    def of(cls, n: NormSpec | None) -> "NormMeasure":
        if n is None:
            return cls(NormKind.NONE, None, None, 0.0)
        return cls(n.kind, None if n.weight is None else n.gamma_max_abs,
                   None if n.bias is None else n.beta_norm, float(n.eps))


@dataclass(frozen=True)
class Distance:
    """``||W_i - W~_i||`` of one role in ``norm`` (every value a certified upper end: "spectral" by its
    certificate, "l2" and "linf" with the float64 rounding of the differences and sums charged), with
    ``l21`` (certified upper end of the (2,1) norm) for matrices when measured ``entrywise``.  A
    normalisation's changed variance floor is ``norm="eps"`` with ``value`` the reference's eps
    (``transcover.lipschitz`` turns the pair into its ``eps_change_bound``)."""

    norm: str
    value: float
    l21: float | None = None


@dataclass(frozen=True)
class LayerMeasure:
    """Every norm of one layer (see the module docstring); ``b_*`` are float64 l2 norms, None when absent."""

    index: int
    placement: Placement
    d_model: int
    d_head: int
    scale: float
    rope: bool
    attention_kind: str
    activation: str
    heads: tuple[HeadMeasure, ...]
    W_O: Interval
    W_1: Interval
    W_2: Interval
    W_gate: Interval | None
    shapes: dict[str, tuple[int, int]]
    b_out: float | None
    b_1: float | None
    b_2: float | None
    b_gate: float | None
    norm_attn: NormMeasure
    norm_ffn: NormMeasure
    has_query_bias: bool
    l21: dict[str, Interval] = field(default_factory=dict)  # W_1, W_2, W_gate (entrywise only)
    residual: str = "sequential"  # "parallel": x + attn(N_1 x) + ffn(N_2 x) (THEORY F21)
    q_norm: NormMeasure | None = None  # query/key RMSNorm per head (THEORY F23)
    k_norm: NormMeasure | None = None
    has_rope_qk_bias: bool = False  # RoPE with query/key biases and no q/k norm (F22)
    # T5's relative position bias (THEORY F28): max |table[:, h]| per head (float64, exact); None without
    pos_bias_heads: tuple[float, ...] | None = None
    pos_bias_buckets: int = 0
    # mixture of experts (THEORY F29): every expert's, the router's and a shared expert's certified ||.||_2
    # ("expert.e.W_1", "router", "shared.W_2", ...); None for a dense FFN.  W_1, W_2, W_gate are the maxima.
    experts: dict[str, Interval] | None = None
    qk_norm_scope: str = "head"  # "all": q/k RMSNorm over the whole projection (OLMo 2; F23)
    post_norm_attn: NormMeasure | None = None  # a norm on the branch output, x + N_post(f(N_pre x)) (F26)
    post_norm_ffn: NormMeasure | None = None
    # RoPE: the score matrices (HeadMeasure.W_QK) are the sup over offsets |delta| < rope_positions
    # (max_position), so every bound reading them holds for sequences of at most that many tokens
    rope_positions: int | None = None

    @property
    def n_heads(self) -> int:
        return len(self.heads)

    @property
    def pos_bias(self) -> float | None:
        """max |B_ij| over every head and offset: how far T5's relative bias shifts any score (F28)."""
        return None if self.pos_bias_heads is None else max(self.pos_bias_heads)

    @property
    def split_scores(self) -> bool:
        """G.3 charges W_Q, W_K, b_Q, b_K (and the q/k norm scales) one by one: Note [split scores]."""
        return self.has_rope_qk_bias or self.q_norm is not None or self.k_norm is not None


@dataclass(frozen=True)
class ModelNorms:
    """A model's norms, measured once (``measure_model``), and its distances from a reference.

    ``distances`` maps ``(layer, role)`` to :class:`Distance` (layer -1: the input norm,
    ``n_layers``: the final norm; roles as in ``transcover.lipschitz.perturbation_coefficients``);
    it is empty without a reference.
    """

    name: str
    d_model: int
    layers: tuple[LayerMeasure, ...]
    input_norm: NormMeasure
    final_norm: NormMeasure
    distances: dict[tuple[int, str], Distance] = field(default_factory=dict)
    reference: str | None = None
    entrywise: bool = False
    kind: Kind = Kind.CERTIFIED_INTERVAL

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict[str, object]:
        return as_dict(self, distances=[{"layer": k[0], "role": k[1], **as_dict(v)}
                                        for k, v in self.distances.items()])


def _t(x):  # noqa: ANN001, ANN202  (a spec array of either backend -> float64 torch)
    import torch

    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64)
    return torch.from_numpy(np.array(x, dtype=np.float64))  # a writable copy


def _np(x) -> np.ndarray:  # noqa: ANN001
    """A contiguous float64 numpy copy (one memory layout for every certificate call)."""
    return np.ascontiguousarray(_spectral.as_array(x, np.float64))


def matrix_interval(W) -> Interval:  # noqa: ANN001
    """Certified ``||W||_2`` by the one route ``measure_model`` uses (float64 contiguous copy, Cholesky
    certificate); the zero-size matrix has norm 0."""
    W = _np(W)
    if W.size == 0:
        return Interval(0.0, 0.0, Kind.CERTIFIED_INTERVAL, "empty")
    return _spectral.spectral_norm_interval(W, rtol=1e-6)


def product_interval(A, B) -> Interval:  # noqa: ANN001
    """Certified ``||A B||_2`` by the one low-rank route ``measure_model`` uses (``AB`` never formed)."""
    A, B = _np(A), _np(B)
    if A.size == 0 or B.size == 0:
        return Interval(0.0, 0.0, Kind.CERTIFIED_INTERVAL, "empty")
    return _spectral.product_norm_interval(A, B, rtol=1e-6)


def _l2(v) -> float | None:  # noqa: ANN001
    """An upper bound on ``||v||_2`` of a stored vector (numpy: ``analyze`` of a file never imports torch)."""
    return None if v is None else _entrywise.vector_norm_interval(_spectral.as_array(v, np.float64)).upper


# Note [summed biases]: the attention's output bias b_O + sum_h b_V^h W_O^h is formed in float64
# (``AttentionSpec.effective_output_bias``).  A sum of n products, each rounded at most once, in any order, is
# within gamma_n of the exact value relative to the sum of the terms' magnitudes (Higham, Thm 3.1), here
# n = d_head + H + 1; that magnitude is the same expression on |b_O|, |b_V|, |W_O| (non-negative terms: itself
# within gamma_n).  Without this error, bf16 biases of 2^100 that cancel in b_O left 2^40 behind: analyze
# certified B_b_attn = [0, 0] and G.3 a bound of 0 for two models 6.0 apart (red team 37d).
def output_bias_enclosure(a: AttentionSpec) -> tuple[np.ndarray, np.ndarray] | None:
    """``(v, err)``: ``v`` the float64 output bias, ``|v - exact| <= err`` entrywise; None without biases."""
    v = a.effective_output_bias()
    if v is None:
        return None
    mag = replace(a, W_O=abs(a.W_O), b_V=None if a.b_V is None else abs(a.b_V),
                  b_O=None if a.b_O is None else abs(a.b_O)).effective_output_bias()
    g = gamma(a.d_head + a.n_heads + 2)
    err = _spectral.as_array(mag, np.float64) * (g * (1.0 + g))
    return _spectral.as_array(v, np.float64), np.where(err > 0, np.nextafter(err, np.inf), 0.0)


def _bias_l2(a: AttentionSpec) -> float | None:
    enc = output_bias_enclosure(a)
    return None if enc is None else _entrywise.enclosed_vector_norm(*enc).upper


def layer_arrays(a: AttentionSpec) -> dict[str, np.ndarray]:
    """Float64 copies of one layer's attention weights and, batched over heads, every head's
    ``d_head x d_head`` Gram with its error bound (Note [one engine]).

    Keys ``W_Q``, ``W_K``, ``W_V``, ``W_O`` (stacked per head) and, when no power-of-two rescaling is
    needed (``in_safe_range``), ``G_Q``/``e_Q`` ... ``G_O``/``e_O`` (``W_O`` read as ``W_O^hT``).
    """
    arr = {k: _spectral.as_array(getattr(a, k), np.float64) for k in ("W_Q", "W_K", "W_V", "W_O")}
    if _spectral.in_safe_range(*arr.values()):
        for key, W in (("Q", arr["W_Q"]), ("K", arr["W_K"]), ("V", arr["W_V"]),
                       ("O", np.ascontiguousarray(arr["W_O"].transpose(0, 2, 1)))):
            arr[f"G_{key}"], arr[f"e_{key}"] = batched_gram_with_error(W)
    return arr


def _gram(arr: dict[str, np.ndarray], key: str, i: int) -> tuple[np.ndarray, float] | None:
    return (arr[f"G_{key}"][i], float(arr[f"e_{key}"][i])) if f"G_{key}" in arr else None


def _single(W: np.ndarray, gram: tuple[np.ndarray, float] | None) -> Interval:
    if W.size == 0:
        return Interval(0.0, 0.0, Kind.CERTIFIED_INTERVAL, "empty")
    return _spectral.spectral_norm_interval(W, rtol=1e-6, gram=gram)


def _pair(A: np.ndarray, B: np.ndarray, ga, gb) -> Interval:  # noqa: ANN001
    if A.size == 0 or B.size == 0:
        return Interval(0.0, 0.0, Kind.CERTIFIED_INTERVAL, "empty")
    grams = None if ga is None or gb is None else (*ga, *gb)
    return _spectral.product_norm_interval(A, B, rtol=1e-6, grams=grams)


def _heads(a: AttentionSpec, entrywise: bool, arr: dict[str, np.ndarray]) -> tuple[HeadMeasure, ...]:
    s = a.softmax_scale
    kvs = sorted({a.kv_index(h) for h in range(a.n_heads)})
    W_V = {g: _single(arr["W_V"][g], _gram(arr, "V", g)) for g in kvs}
    # the key map's own norm is read where the scores are not x_i W_Q W_K^T x_j^T: RoPE (sup over the
    # rotations) and query/key normalisation (THEORY F22, F23)
    split = a.rope is not None or a.q_norm is not None or a.k_norm is not None
    W_K = {g: _single(arr["W_K"][g], _gram(arr, "K", g)) for g in kvs} if split else {}
    if a.softcap is not None and a.b_K is not None:
        from .._errors import UnsupportedArchitectureError

        # c tanh(s / c) does not let the key bias cancel, which F6 (and so F24) uses
        raise UnsupportedArchitectureError("soft-capped attention with a key bias is not bounded (THEORY F24)")
    out = []
    for h in range(a.n_heads):
        g = a.kv_index(h)
        Wq, Wv, Wo = arr["W_Q"][h], arr["W_V"][g], arr["W_O"][h]
        Kt = np.ascontiguousarray(arr["W_K"][g].T)
        bqk = None
        if a.b_Q is not None and a.rope is None:
            bqk = _l2(_spectral.as_array(a.b_Q[h], np.float64) @ Kt)
        W_Q = _single(Wq, _gram(arr, "Q", h))
        if a.rope is None:
            W_QK = _pair(Wq, Kt, _gram(arr, "Q", h), _gram(arr, "K", g))
        else:  # the sup over relative positions, from the two norms just certified (Note [RoPE score matrix])
            grams = None if "G_Q" not in arr else (*_gram(arr, "Q", h), *_gram(arr, "K", g))
            W_QK = rope_kq_interval(Wq, arr["W_K"][g], a.rope, 1.0, grams=grams, norms=(W_Q, W_K[g]))
        head = HeadMeasure(h, g, W_QK, _pair(Wv, Wo, _gram(arr, "V", g), _gram(arr, "O", h)),
                           W_Q, W_V[g], W_K.get(g), bqk,
                           _l2(a.b_Q[h]) if split and a.b_Q is not None else None,
                           _l2(a.b_K[g]) if split and a.b_K is not None else None)
        if entrywise:
            if split:
                head = replace(head, l21_Q=_entrywise.l21_interval(Wq), l21_K=_entrywise.l21_interval(arr["W_K"][g]))
            if a.rope is None:
                l21_kq = _entrywise.product_l21_interval(_np(s * Wq), Kt)
            else:  # every relative rotation at once (see _rope_l21)
                up = _rope_l21(head.W_KQ(s).upper, a.d_model, a.d_head)
                l21_kq = Interval(0.0, up, Kind.CERTIFIED_INTERVAL, "RoPE: sqrt(d d_head) x spectral bound")
            head = replace(head, l21_KQ=l21_kq, l21_OV=_entrywise.product_l21_interval(_np(Wv), _np(Wo)))
        out.append(head)
    return tuple(out)


def measure_layer(layer: LayerSpec, entrywise: bool = False, *,
                  arrays: dict[str, np.ndarray] | None = None) -> LayerMeasure:
    """Every norm of one layer (the per-layer step of :func:`measure_model`).

    ``arrays``: the layer's :func:`layer_arrays`, when the caller needs them afterwards too
    (``analyze`` reads the Grams again for the Frobenius and (2,1) norms); computed here otherwise.
    A mixture-of-experts FFN is measured expert by expert (``LayerMeasure.experts``; W_1, W_2, W_gate
    the maxima); every bound built on it refuses (``lipschitz._weights``, THEORY F25).
    """
    a, f = layer.attention, layer.ffn
    arr = layer_arrays(a) if arrays is None else arrays
    if isinstance(f, MoESpec):
        from ._model_parts import moe_intervals

        spectral, l21, shapes, experts = moe_intervals(f, entrywise)
        return _layer_measure(layer, entrywise, arr, spectral, l21, shapes, experts)
    mats = {"W_1": f.W_1, "W_2": f.W_2, "W_gate": f.W_gate}
    # one float64 copy each, in the checkpoint's memory order (a transposed view stays Fortran-ordered:
    # the Gram's dsyrk reads it as is, no transposing copy), left in ``arr`` for the caller
    for k, W in mats.items():
        if W is not None and k not in arr:
            arr[k] = _spectral.as_array(W, np.float64)
    spectral = {k: None if W is None else _single(arr[k], None) for k, W in mats.items()}
    l21 = {k: _entrywise.l21_interval(arr[k]) for k, W in mats.items() if W is not None} if entrywise else {}
    return _layer_measure(layer, entrywise, arr, spectral, l21,
                          {k: tuple(W.shape) for k, W in mats.items() if W is not None}, None)


def _layer_measure(layer: LayerSpec, entrywise: bool, arr: dict, spectral: dict, l21: dict, shapes: dict,
                   experts: dict[str, Interval] | None) -> LayerMeasure:
    a, f = layer.attention, layer.ffn
    return LayerMeasure(
        index=layer.index, placement=layer.placement, d_model=a.d_model, d_head=a.d_head,
        scale=a.softmax_scale, rope=a.rope is not None, attention_kind=a.kind, activation=f.activation.value,
        heads=_heads(a, entrywise, arr), W_O=matrix_interval(arr["W_O"].reshape(-1, a.d_model)),
        W_1=spectral["W_1"], W_2=spectral["W_2"], W_gate=spectral["W_gate"], shapes=shapes, experts=experts,
        b_out=_bias_l2(a), b_1=_l2(getattr(f, "b_1", None)), b_2=_l2(getattr(f, "b_2", None)),
        b_gate=_l2(getattr(f, "b_gate", None)),
        norm_attn=NormMeasure.of(layer.norm_attn), norm_ffn=NormMeasure.of(layer.norm_ffn),
        has_query_bias=a.b_Q is not None and a.rope is None, l21=l21, residual=layer.residual.value,
        q_norm=None if a.q_norm is None else NormMeasure.of(a.q_norm),
        k_norm=None if a.k_norm is None else NormMeasure.of(a.k_norm),
        has_rope_qk_bias=a.rope is not None and a.q_norm is None and a.k_norm is None
        and (a.b_Q is not None or a.b_K is not None),
        pos_bias_heads=None if a.position_bias is None
        else tuple(float(v) for v in _t(a.position_bias.table).abs().amax(dim=0)),
        pos_bias_buckets=0 if a.position_bias is None else a.position_bias.num_buckets,
        qk_norm_scope=a.qk_norm_scope,
        post_norm_attn=None if layer.post_norm_attn is None else NormMeasure.of(layer.post_norm_attn),
        post_norm_ffn=None if layer.post_norm_ffn is None else NormMeasure.of(layer.post_norm_ffn),
        rope_positions=None if a.rope is None else int(a.rope.max_position),
    )


# ---------------------------------------------------------------------------------------------
# distances from a reference (Note [distances])


def _diff(a, b, what: str, fill: float = 0.0):  # noqa: ANN001, ANN202
    import torch

    from .._errors import InputError

    if a is None and b is None:
        return torch.zeros(1, dtype=torch.float64)
    ta, tb = _t(a), _t(b)
    ta = torch.full_like(tb, fill) if ta is None else ta
    tb = torch.full_like(ta, fill) if tb is None else tb
    if ta.shape != tb.shape:
        raise InputError(f"{what} has shape {tuple(ta.shape)} in one model and {tuple(tb.shape)} in the other")
    return ta - tb


def _rope_l21(spectral_upper: float, d: int, rank: int) -> float:
    """``||M||_{2,1} <= sqrt(d) ||M||_F <= sqrt(d rank) ||M||_2`` for a d x d matrix of rank <= ``rank``:
    the (2,1) norm is not rotation invariant, so with RoPE it is bounded through the spectral norm,
    which holds for every relative rotation at once."""
    return _spectral.up(_spectral.up(float(np.sqrt(d * min(d, rank))) * (1 + 2.0**-52)) * spectral_upper)


def _kq_distance(aa: AttentionSpec, ab: AttentionSpec, h: int, entrywise: bool) -> Distance:
    """Certified ``sup_R ||s W_Q^h R W_K^hT - s~ W~_Q^h R W~_K^hT||_2`` (R = I without RoPE)."""
    import torch

    s, st = aa.softmax_scale, ab.softmax_scale
    qa, ka, qb, kb = _t(aa.W_Q[h]), _t(aa.W_K[aa.kv_index(h)]), _t(ab.W_Q[h]), _t(ab.W_K[ab.kv_index(h)])
    if s == st and qa.shape == qb.shape and torch.equal(qa, qb) and torch.equal(ka, kb):
        return Distance("spectral", 0.0, 0.0 if entrywise else None)
    if aa.rope is not None:
        # s Q R K^T - s~ Q~ R K~^T = (s Q - s~ Q~) R K^T + s~ Q~ R (K - K~)^T with ||R|| = 1 (the same R
        # in both models: same RoPE and d_head, Note [structural differences]).
        sp = (matrix_interval(s * qa - st * qb).upper * matrix_interval(ka).upper + st * matrix_interval(qb).upper * matrix_interval(ka - kb).upper)
        sp = _spectral.up(sp * (1 + 4 * 2.0**-52))
        return Distance("spectral", sp, _rope_l21(sp, qa.shape[0], 2 * qa.shape[1]) if entrywise else None)
    if s == st:  # s (Q K^T - Q~ K~^T): the scale, a positive float, multiplied once and rounded up
        sp = _spectral.up(abs(s) * product_difference_upper(qa, ka.T, qb, kb.T) * (1 + 4 * 2.0**-52))
    else:  # the scaled factors as formed, plus their rounding (each entry within 2^-53 of itself, 2^-1075 below)
        sqa, sqb = s * qa, st * qb
        fro = _fro_upper
        slack = (2.0**-52 * (fro(sqa) * fro(ka) + fro(sqb) * fro(kb))
                 + 2.0**-1074 * math.sqrt(qa.numel()) * (fro(ka) + fro(kb)))
        sp = _spectral.up((product_difference_upper(sqa, ka.T, sqb, kb.T) + slack) * (1 + 4 * 2.0**-52))
    if not entrywise:
        return Distance("spectral", sp, None)
    P, Q = torch.cat([s * qa, -st * qb], 1), torch.cat([ka, kb], 1).T
    return Distance("spectral", sp, _entrywise.product_l21_interval(_np(P), _np(Q)).upper)


# Note [product differences]: ``A_a B_a - A_b B_b`` (a head's ``W_Q W_K^T`` or ``W_V W_O`` in two models) was
# certified as the product of the concatenations ``[A_a, -A_b] [B_a; B_b]``.  The Gram certificate of a product is
# accurate to about ``sqrt(r u) ||[A_a, -A_b]|| ||[B_a; B_b]||`` in absolute terms, which is the size of the weights,
# not of their change: two float32 checkpoints 1e-8 apart got 3.37e-6 for an exact 1.35e-8 (W_KQ) and 6.79e-6 for
# 3.07e-9 (W_OV), red team 220.  The same matrix is ``dA B_a + A_b dB`` (``dA = A_a - A_b``, ``dB = B_a - B_b``), the
# product of ``[dA t, A_b / t]`` and ``[B_a / t; dB t]`` for every ``t > 0``; ``t``, a power of two (exact; kept only
# where it scales back exactly, else 1), balances the blocks: ``t^4 = ||A_b|| ||B_a|| / (||dA|| ||dB||)`` brings the
# factors' Frobenius norms' product down to ``||dA|| ||B_a|| + ||A_b|| ||dB||``, so the certificate's error scales
# with the change.  The subtractions round: ``|fl(x - y) - (x - y)| <= 2^-53 |x - y| <= 2^-52 |fl(x - y)|`` (exact
# where the result is subnormal), so the exact matrix is within ``2^-52 (||dA||_F ||B_a||_F + ||A_b||_F ||dB||_F)``
# of the computed factors' product in spectral norm, and that is added.
def product_difference_upper(Aa, Ba, Ab, Bb) -> float:  # noqa: ANN001  (float64 torch)
    """A certified upper bound on ``||A_a B_a - A_b B_b||_2`` for float64 factors taken as exact, through one
    :func:`product_interval` of balanced factors (Note [product differences])."""
    import torch

    if Aa.shape != Ab.shape or Ba.shape != Bb.shape:  # head dimensions differ: no factor-wise difference
        return product_interval(torch.cat([Aa, -Ab], 1), torch.cat([Ba, Bb], 0)).upper
    dA, dB = Aa - Ab, Ba - Bb
    if not (bool(torch.isfinite(dA).all()) and bool(torch.isfinite(dB).all())):  # a difference beyond float64
        return product_interval(torch.cat([Aa, -Ab], 1), torch.cat([Ba, Bb], 0)).upper
    a, b, c, e = (_fro_upper(X) for X in (dA, Ab, Ba, dB))
    if (a == 0.0 or c == 0.0) and (b == 0.0 or e == 0.0):  # both terms vanish (the subtractions were exact)
        return 0.0
    if a == 0.0 or c == 0.0:  # only A_b dB is left
        P, Q = Ab, dB
    elif b == 0.0 or e == 0.0:  # only dA B_a
        P, Q = dA, Ba
    else:
        k = round((math.log2(b) + math.log2(c) - math.log2(a) - math.log2(e)) / 4)
        k = max(-1000, min(1000, k))
        t, it = 2.0**k, 2.0**-k
        blocks = (dA * t, Ab * it, Ba * it, dB * t)
        if not all(torch.equal(x * f, y) for x, f, y in zip(blocks, (it, t, t, it), (dA, Ab, Ba, dB))):
            blocks = (dA, Ab, Ba, dB)  # a block under- or overflowed: unbalanced, still the same matrix
        P, Q = torch.cat(blocks[:2], 1), torch.cat(blocks[2:], 0)
    main = product_interval(P, Q).upper
    return _spectral.up((main + 2.0**-52 * (a * c + b * e)) * (1 + 4 * 2.0**-52))


def _fro_upper(X) -> float:  # noqa: ANN001
    """An upper bound on ``||X||_F`` of a float64 torch matrix (0 for a zero one)."""
    return _entrywise.frobenius_interval(_np(X)).upper if bool(X.any()) else 0.0


def _attention_distances(aa: AttentionSpec, ab: AttentionSpec, i: int, entrywise: bool) -> dict:
    import torch

    out: dict[tuple[int, str], Distance] = {}
    s, st = aa.softmax_scale, ab.softmax_scale
    split = split_scores(aa) or split_scores(ab)
    if split:
        out.update(split_distances(aa, ab, i, entrywise))
    for h in range(aa.n_heads):
        if not split:
            out[(i, f"W_KQ.{h}")] = _kq_distance(aa, ab, h, entrywise)
        _, ka, va, oa = (_t(x) for x in aa.head(h))
        _, kb, vb, ob = (_t(x) for x in ab.head(h))
        if va.shape == vb.shape and torch.equal(va, vb) and torch.equal(oa, ob):
            out[(i, f"W_OV.{h}")] = Distance("spectral", 0.0, 0.0 if entrywise else None)
        else:
            P, Q = torch.cat([va, -vb], 1), torch.cat([oa, ob], 0)  # V O - V~ O~ (the (2,1) norm's factors)
            out[(i, f"W_OV.{h}")] = Distance(
                "spectral", product_difference_upper(va, oa, vb, ob),
                _entrywise.product_l21_interval(_np(P), _np(Q)).upper if entrywise else None)
        if not split and aa.rope is None and (aa.b_Q is not None or ab.b_Q is not None):
            # b_K cancels in the softmax; s b_Q W_K^T is the query bias's only effect (Note [attention biases])
            ba = torch.zeros(ka.shape[1], dtype=torch.float64) if aa.b_Q is None else _t(aa.b_Q[h])
            bb = torch.zeros(kb.shape[1], dtype=torch.float64) if ab.b_Q is None else _t(ab.b_Q[h])
            # s b_a K_a^T - s~ b_b K_b^T as differences (Note [summed biases]): exactly 0 for equal pieces, and
            # its rounding scales with the change
            dq, mag = _bilinear_difference(ba, ka.T, bb, kb.T)
            ds = s - st
            dq, mag = s * dq + ds * (bb @ kb.T), abs(s) * mag + abs(ds) * (bb.abs() @ kb.T.abs())
            g = gamma(int(ka.shape[1]) + 6)
            out[(i, f"b_KQ.{h}")] = Distance("l2", _difference_l2(_np(dq), _np(mag) * (g * (1.0 + g))))
    if aa.position_bias is not None:  # T5 (THEORY F28): max over offsets of the bias change, per head
        dB = (_t(aa.position_bias.table) - _t(ab.position_bias.table)).abs().amax(dim=0)
        for h in range(aa.n_heads):
            out[(i, f"pos_bias.{h}")] = Distance("linf", float(dB[h]))
    if any(x is not None for x in (aa.b_V, aa.b_O, ab.b_V, ab.b_O)):
        dv, mag = _output_bias_difference(aa, ab, i)
        g = gamma(aa.d_head + aa.n_heads + 4)
        out[(i, "b_out")] = Distance("l2", _difference_l2(_np(dv), _np(mag) * (g * (1.0 + g))))
    return out


def _bilinear_difference(xa, ya, xb, yb):  # noqa: ANN001, ANN202  (float64 torch)
    """``x_a y_a - x_b y_b`` formed as ``(x_a - x_b) y_a + x_b (y_a - y_b)``, and the magnitude
    ``|x_a - x_b||y_a| + |x_b||y_a - y_b|`` its rounding is relative to (Note [summed biases]): the two
    subtractions are exact or within u of their result, and each product sum within gamma of the magnitude,
    so an unchanged pair gives exactly 0 and a small change a small error."""
    dx, dy = xa - xb, ya - yb
    return dx @ ya + xb @ dy, dx.abs() @ ya.abs() + xb.abs() @ dy.abs()


def _output_bias_difference(aa: AttentionSpec, ab: AttentionSpec, i: int):  # noqa: ANN202
    """``(b_O^a + sum_h b_V^a,h W_O^a,h) - (the same of b)`` and its rounding magnitude, head by head through
    :func:`_bilinear_difference` (an absent bias is zeros)."""
    import torch

    d = aa.d_model
    zeros = torch.zeros(d, dtype=torch.float64)
    dv = _diff(aa.b_O, ab.b_O, f"layer {i} b_O") if (aa.b_O is not None or ab.b_O is not None) else zeros.clone()
    dv = dv.reshape(-1)
    mag = dv.abs()
    if aa.b_V is not None or ab.b_V is not None:
        for h in range(aa.n_heads):
            oa, ob = _t(aa.W_O[h]), _t(ab.W_O[h])
            va = torch.zeros(oa.shape[0], dtype=torch.float64) if aa.b_V is None else _t(aa.b_V[aa.kv_index(h)])
            vb = torch.zeros(ob.shape[0], dtype=torch.float64) if ab.b_V is None else _t(ab.b_V[ab.kv_index(h)])
            if va.shape != vb.shape or oa.shape != ob.shape:
                from .._errors import InputError

                raise InputError(f"layer {i} head {h}'s value bias or W_O differs in shape between the two models")
            term, m = _bilinear_difference(va, oa, vb, ob)
            dv, mag = dv + term, mag + m
    return dv, mag


def _difference_l2(d: np.ndarray, err: np.ndarray | float = 0.0) -> float:
    """An upper bound on ``||x - y||_2`` from ``d = fl(x - y)`` (each entry within ``2u|d|``: float64 subtraction)
    and the error ``err`` the two vectors already carried."""
    d = np.asarray(d, dtype=np.float64)
    e = np.abs(d) * 2.0**-52 + err
    return _entrywise.enclosed_vector_norm(d, np.where(e > 0, np.nextafter(e, np.inf), 0.0)).upper


def _ffn_distances(fa: FFNSpec, fb: FFNSpec, i: int, entrywise: bool) -> dict:
    if isinstance(fa, MoESpec) or isinstance(fb, MoESpec):
        # the distances feed G.3, which has no coefficient for routed experts (F25); the stacked expert
        # weights reached spectral_norm_interval as a ValueError ("internal error", red team of stop 36)
        from ..model import moe_refusal

        raise moe_refusal(i, "no perturbation bound (G.3) or distance to a reference is derived for it")
    out: dict[tuple[int, str], Distance] = {}
    for name in ("W_1", "W_2", "W_gate"):
        if getattr(fa, name) is not None:
            D = _diff(getattr(fa, name), getattr(fb, name), f"layer {i} {name}")
            out[(i, name)] = Distance("spectral", matrix_interval(D).upper,
                                      _entrywise.l21_interval(_np(D)).upper if entrywise else None)
    for name in ("b_1", "b_2", "b_gate"):
        if getattr(fa, name) is not None or getattr(fb, name) is not None:
            d = _diff(getattr(fa, name), getattr(fb, name), f"layer {i} {name}")
            out[(i, name)] = Distance("l2", _difference_l2(_np(d)))
    return out


def _norm_distances(na: NormSpec | None, nb: NormSpec | None, i: int, prefix: str) -> dict:
    """``||gamma - gamma~||_inf``, ``||beta - beta~||_2`` and, for different variance floors, the
    eps change bound of a LayerNorm/RMSNorm (no parameters otherwise)."""
    if na is None or nb is None or na.kind not in (NormKind.LAYERNORM, NormKind.RMSNORM):
        return {}
    dg = float(_diff(na.weight, nb.weight, f"{prefix} weight", 1.0).abs().max())
    out = {(i, f"{prefix}.gamma"): Distance("linf", 0.0 if dg == 0.0 else _spectral.up(dg * (1.0 + 2.0**-52))),
           (i, f"{prefix}.beta"): Distance("l2", _difference_l2(_np(_diff(na.bias, nb.bias, f"{prefix} bias"))))}
    if float(na.eps) != float(nb.eps):  # Note [eps change] in ``lipschitz._normalisation``
        out[(i, f"{prefix}.eps")] = Distance("eps", float(nb.eps))  # the reference's variance floor
    return out


def _layer_distances(la: LayerSpec, lb: LayerSpec, entrywise: bool) -> dict:
    i = la.index
    out = _attention_distances(la.attention, lb.attention, i, entrywise)
    out.update(_ffn_distances(la.ffn, lb.ffn, i, entrywise))
    for nm in ("norm_attn", "norm_ffn", "post_norm_attn", "post_norm_ffn"):
        out.update(_norm_distances(getattr(la, nm), getattr(lb, nm), i, nm))
    return out


def measure_model(spec: TransformerSpec, *, reference: TransformerSpec | None = None,
                  entrywise: bool = False) -> ModelNorms:
    """Measure every norm of ``spec`` once, and its distances from ``reference`` if given.

    .. math::

        \\|W\\|_2 \\in [\\ell, u] \\text{ (Cholesky certificate, seed 2.1)},\\qquad
        \\|AB\\|_2 \\in [\\ell, u] \\text{ (low-rank route, rank} \\le d_{head})

    Source: :func:`~transcover.norms.spectral_norm_interval` and
    :func:`~transcover.norms.product_norm_interval` (one call per matrix, Note [one route per
    matrix]); distances as in Note [distances].  Assumptions: the weights are given exactly by
    their float values (bf16/fp16/float32 upcast to float64 is exact); with RoPE, sequences of at
    most ``max_position`` tokens (the score matrix is the sup over their offsets, Note [RoPE score
    matrix]).

    Args:
        spec: the model (numpy or torch arrays; read one layer at a time).
        reference: a model of the same structure; ``distances`` then holds ``||W_i - W~_i||``.
        entrywise: also the (2,1) norms the covering bounds need (F2).

    Raises:
        InputError: ``reference`` with a different structure (``model.require_same_structure``).
        UnsupportedArchitectureError: RoPE attention with query/key biases.
    """
    from ..model import require_same_structure

    spec = spec.to_torch()  # one backend for every route (numpy specs from files; lazy layers stay lazy)
    reference = None if reference is None else reference.to_torch()
    if reference is not None:  # before any measurement: a mismatch is the user's, named in one line
        require_same_structure(spec, reference)
    distances: dict[tuple[int, str], Distance] = {}
    layers = []
    # one pass over the layers (a lazy spec decodes each layer once, Note [one layer at a time] in _analyze)
    for i, layer in enumerate(spec.layers):
        layers.append(measure_layer(layer, entrywise))
        if reference is not None:
            distances.update(_layer_distances(layer, reference.layers[i], entrywise))
    if reference is not None:
        distances.update(_norm_distances(spec.input_norm, reference.input_norm, -1, "input_norm"))
        distances.update(_norm_distances(spec.final_norm, reference.final_norm, spec.n_layers, "final_norm"))
    return ModelNorms(spec.name, spec.d_model, tuple(layers), NormMeasure.of(spec.input_norm), NormMeasure.of(spec.final_norm),
                      distances, None if reference is None else reference.name, entrywise)
