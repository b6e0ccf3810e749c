"""``analyze``: per layer and per head, the norms the founding document constrains (seed 2.1).

For every layer of a :class:`~transcover.model.TransformerSpec`:

* ``B_KQ = max_h ||W_KQ^h||_2`` with ``W_KQ^h = scale * W_Q^h (W_K^h)^T`` (the matrix inside the
  softmax; ``scale = 1/sqrt(d_head)`` by default);
* ``B_V = max_h ||W_OV^h||_2`` with ``W_OV^h = W_V^h W_O^h`` (the head's value-to-output map);
  also ``||W_V^h||_2`` per head and ``||W_O||_2``;
* ``B_W1 = ||W_1||_2``, ``B_W2 = ||W_2||_2``, ``B_b1 = ||b_1||_2``, ``B_b2 = ||b_2||_2``
  (gated FFNs add ``B_Wgate``);
* Frobenius and (2,1) norms of every matrix, the normalisation parameters (max|gamma|, ||beta||),
  and, outside the decomposition, the embedding matrices (with their largest row norm: the input
  radius of token embeddings).

Every norm is an :class:`~transcover.Interval`: certified (``lower <= true <= upper`` with
rounding accounted for) by default, or a Lanczos estimate with ``fast=True``.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable

import numpy as np

from .._results import Interval, Kind
from .._threads import limit_threads
from ..model import AttentionSpec, LayerSpec, MoESpec, TransformerSpec
from ._entrywise import (
    _enclose,
    _pow2,
    _scaled,
    enclosed_vector_norm,
    frobenius_l21_intervals,
    product_frobenius_l21,
    vector_norm_interval,
)
from ._spectral import (
    product_norm_estimate,
    product_norm_interval,
    scale_interval,
    spectral_norm_estimate,
    spectral_norm_interval,
    as_array,
    in_safe_range,
)
from ._certify import batched_gram_with_error
from ._rope_sup import rope_kq_estimate
from ._blocked import BLOCK_BYTES, blocked_matrix_norms
from ._floating import gamma
from ._model import (HeadMeasure, LayerMeasure, ModelNorms, NormMeasure, layer_arrays, measure_layer,
                     output_bias_enclosure)
from ._analysis_types import (HEAD_PREFIX, SCHEMA_VERSION, AnalysisResult, EmbeddingNorms, HeadNorms, LayerNorms,
                              MatrixNorms, NormParams)

_ZERO = Interval(0.0, 0.0, Kind.EXACT, "absent")

__all__ = ["MatrixNorms", "HeadNorms", "NormParams", "LayerNorms", "EmbeddingNorms", "AnalysisResult",
           "analyze_spec", "SCHEMA_VERSION"]

# ---------------------------------------------------------------------------------------------


def _np(t, dtype=np.float64) -> np.ndarray:
    """numpy view/copy of a spec array (numpy or torch: torch is never imported by this module)."""
    return as_array(t, dtype)


def _past_float32(t) -> bool:  # noqa: ANN001  (numpy array or torch tensor)
    """A float64 array with a nonzero entry outside [2^-100, 2^100], which float32 would lose or overflow (a
    float64 W_Q entry 1e300 made ``analyze --fast`` a LinAlgError).  Narrower dtypes fit float32 as they are."""
    if str(getattr(t, "dtype", "")).removeprefix("torch.") != "float64" or not getattr(t, "shape", ()):
        return False
    a = np.abs(_np(t))
    return bool(a.max(initial=0.0) > 2.0**100 or a.min(where=a > 0, initial=np.inf) < 2.0**-100)


def _estimate(value: float, method: str) -> Interval:
    return Interval(value, value, Kind.ESTIMATE, method)


class _Measurer:
    """Chooses certified or estimated routes once, so the per-layer code reads like the math.

    Certified mode works on float64 copies; ``--fast`` stays in float32 (no copies) and labels
    every number, Frobenius and (2,1) norms included, as an estimate.
    """

    def __init__(self, fast: bool, rtol: float):
        self.fast = fast
        self.rtol = rtol
        self.dtype = np.float32 if fast else np.float64

    def array(self, t) -> np.ndarray:
        if self.fast and _past_float32(t):  # float32 would make it inf or 0: it stays float64 (Note [float32 Grams])
            return _np(t)
        return _np(t, self.dtype)

    def matrix(self, role: str, W, tensor: str = "", gram: tuple[np.ndarray, float] | None = None) -> MatrixNorms:
        Wn = self.array(W)  # float32 arrays from files must become float64 before certified sums
        if self.fast:  # the column sums of squares at unit scale (Note [float32 Grams])
            Ws, (k,) = _unit_heads(Wn[None])
            k = int(k)
            col = np.sqrt(np.einsum("ij,ij->j", Ws[0], Ws[0]))
            return MatrixNorms(role, tuple(Wn.shape), spectral_norm_estimate(Wn, rtol=self.rtol),
                               _estimate(math.ldexp(float(np.sqrt((col * col).sum())), k), "float32"),
                               _estimate(math.ldexp(float(col.sum()), k), "float32"), tensor)
        spec = spectral_norm_interval(Wn, rtol=self.rtol, gram=gram)
        return MatrixNorms(role, tuple(Wn.shape), spec, *frobenius_l21_intervals(Wn), tensor)

    def product(self, role: str, A: np.ndarray, B: np.ndarray, scale: float = 1.0,
                grams: tuple[np.ndarray, float, np.ndarray, float] | None = None) -> MatrixNorms:
        shape = (A.shape[0], B.shape[1])
        if self.fast:  # the column norms at unit scale (Note [float32 Grams])
            (As,), (ka,) = _unit_heads(A[None])
            (Bs,), (kb,) = _unit_heads(B[None])
            ka, kb = int(ka), int(kb)
            col = np.sqrt(np.clip(np.einsum("ij,ij->j", (As.T @ As) @ Bs, Bs), 0.0, None))
            return MatrixNorms(role, shape, scale_interval(product_norm_estimate(A, B, rtol=self.rtol), scale),
                               _estimate(math.ldexp(float(np.sqrt((col * col).sum())), ka + kb) * scale, "float32"),
                               _estimate(math.ldexp(float(col.sum()), ka + kb) * scale, "float32"))
        spec = product_norm_interval(A, B, rtol=self.rtol, grams=grams)
        fro, l21 = product_frobenius_l21(A, B, None if grams is None else grams[0])  # reuse A^T A
        return MatrixNorms(role, shape, scale_interval(spec, scale),
                           scale_interval(fro, scale), scale_interval(l21, scale))


def _embedding_norms(name: str, E, m: _Measurer, tensor: str = "") -> EmbeddingNorms:
    """A matrix outside the decomposition; large numpy ones in row blocks (Note [large matrices]).  ``tensor``:
    the checkpoint tensor it comes from (the JSON's ``tensor`` was "" for every embedding: red team 217)."""
    if not m.fast and isinstance(E, np.ndarray) and E.size * 8 > BLOCK_BYTES:
        spec, fro, l21, max_row = blocked_matrix_norms(E, rtol=m.rtol)
        return EmbeddingNorms(name, MatrixNorms(name, tuple(E.shape), spec, fro, l21, tensor), max_row)
    E = m.array(E)
    return EmbeddingNorms(name, m.matrix(name, E, tensor), _max_row_norm(E))


# Note [large matrices]: the token embedding (and an untied un-embedding) is the largest tensor of
# most checkpoints.  The certified route on a float64 copy would hold 8 bytes per entry on top of
# the float32 decoding; ``blocked_matrix_norms`` visits it in row blocks instead, so its peak is the
# decoded matrix, one block and the small-side Gram.  ``--fast`` stays in float32 (no copy).


def _max_row_norm(E: np.ndarray) -> float:
    """Largest ``||row||_2``, a certified upper bound: each row's sum of ``n`` squares errs by
    ``<= gamma_n`` relative (the sqrt by an ulp), at a power-of-two scale where nothing flushes
    (Note [entrywise scale]).  Rounded to nearest before stop 36 (one ulp under the value possible)."""
    W, e = _pow2(E)
    if W.size == 0:
        return 0.0
    v = float(np.sqrt(np.einsum("ij,ij->i", W, W).max(initial=0.0)))
    return _scaled(_enclose(v, gamma(W.shape[-1] + 2), "float64 row sums of squares"), e).upper


def _max_interval(ivs: list[Interval], method: str) -> Interval:
    return Interval(max(i.lower for i in ivs), max(i.upper for i in ivs), ivs[0].kind, method)


def _kq_head_fast_rope(attn: AttentionSpec, h: int, m: _Measurer, f64: dict[str, np.ndarray]) -> tuple[Interval, MatrixNorms]:
    """``--fast`` with RoPE: the unrotated product's estimates and the sup over offsets estimated."""
    g = attn.kv_index(h)
    A, Bt = f64["W_Q"][h], np.ascontiguousarray(f64["W_K"][g].T)
    kq = m.product(f"W_KQ.h{h}", A, Bt, attn.softmax_scale)
    return rope_kq_estimate(A, f64["W_K"][g], attn.rope, attn.softmax_scale), kq


def _value_label(names: dict[str, str], attn: AttentionSpec, g: int) -> str:
    """The checkpoint tensor behind ``W_V.h{g}``: a fused block's slice narrowed to group ``g``'s columns or rows
    (GPT-2's label named the whole V block, ``c_attn.weight[:, 64:96]``, for every head), else the tensor with the
    head named."""
    name = names.get("W_V", "")
    n = attn.n_kv_heads
    for pat, fmt in ((r"(.*)\[:, (\d+):(\d+)\]", "{}[:, {}:{}]"), (r"(.*)\[(\d+):(\d+), :\]", "{}[{}:{}, :]")):
        hit = re.fullmatch(pat, name)
        if hit and (int(hit[3]) - int(hit[2])) % n == 0:
            w = (int(hit[3]) - int(hit[2])) // n
            return fmt.format(hit[1], int(hit[2]) + g * w, int(hit[2]) + (g + 1) * w)
    return f"{name} (head {g} of {n})" if name and n > 1 else name


def _head_norms(attn: AttentionSpec, h: int, m: _Measurer, f64: dict[str, np.ndarray],
                matrices: dict[str, MatrixNorms], names: dict[str, str], hm: HeadMeasure) -> HeadNorms:
    """Head ``h`` as ``analyze`` shows it: the certified spectral norms are ``measure_layer``'s
    (``hm``, Note [one engine] in ``_model``; with RoPE ``B_KQ`` is its sup over relative positions,
    Note [RoPE score matrix] there); only the Frobenius and (2,1) norms, the augmented query-bias
    matrix and, with RoPE, the unrotated product ``W_KQ.h`` (offset 0) are added here."""
    g = attn.kv_index(h)  # grouped-query heads share W_V^g: one entry
    d, scale = attn.d_model, attn.softmax_scale
    A, Bt = f64["W_Q"][h], np.ascontiguousarray(f64["W_K"][g].T)
    Wv, Wo = f64["W_V"][g], f64["W_O"][h]
    batched = "G_Q" in f64
    if attn.rope is not None:  # the matrix at offset 0 is shown too; the bound is the sup
        grams = None if not batched else (f64["G_Q"][h], f64["e_Q"][h], f64["G_K"][g], f64["e_K"][g])
        kq, B_KQ, B_KQ_bias = m.product(f"W_KQ.h{h}", A, Bt, scale, grams=grams), hm.W_KQ(scale), None
    else:
        fro, l21 = product_frobenius_l21(A, Bt, f64["G_Q"][h] if batched else None)
        B_KQ = hm.W_KQ(scale)
        kq = MatrixNorms(f"W_KQ.h{h}", (d, d), B_KQ, scale_interval(fro, scale), scale_interval(l21, scale))
        B_KQ_bias = None
        if attn.b_Q is not None:
            grams = None if "G_Qa" not in f64 else (f64["G_Qa"][h], f64["e_Qa"][h], f64["G_K"][g], f64["e_K"][g])
            aug = product_norm_interval(m.array(attn.W_Q_augmented(h)), Bt, rtol=m.rtol, grams=grams)
            B_KQ_bias = scale_interval(aug, scale)
    ov = MatrixNorms(f"W_OV.h{h}", (d, d), hm.W_OV, *product_frobenius_l21(Wv, Wo, f64["G_V"][g] if batched else None))
    if f"W_V.h{g}" not in matrices:
        matrices[f"W_V.h{g}"] = MatrixNorms(f"W_V.h{g}", tuple(Wv.shape), hm.W_V, *frobenius_l21_intervals(Wv),
                                            _value_label(names, attn, g))
    matrices[kq.role] = kq
    matrices[ov.role] = ov
    return HeadNorms(h, B_KQ, hm.W_OV, hm.W_V, B_KQ_bias)


def _head_norms_fast_rope(attn: AttentionSpec, h: int, m: _Measurer, f64: dict[str, np.ndarray],
                          matrices: dict[str, MatrixNorms], names: dict[str, str]) -> HeadNorms:
    """``--fast`` with RoPE: estimates head by head (the batched estimates know no rotations)."""
    B_KQ, kq = _kq_head_fast_rope(attn, h, m, f64)
    g = attn.kv_index(h)
    ov = m.product(f"W_OV.h{h}", f64["W_V"][g], f64["W_O"][h])
    if f"W_V.h{g}" not in matrices:
        matrices[f"W_V.h{g}"] = m.matrix(f"W_V.h{g}", f64["W_V"][g], _value_label(names, attn, g))
    matrices[kq.role] = kq
    matrices[ov.role] = ov
    return HeadNorms(h, B_KQ, ov.spectral, matrices[f"W_V.h{g}"].spectral, None)


def _unit_heads(W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every head of ``W`` (heads first) times an exact power of two, ``W_h / 2^k_h`` with its largest |entry| in
    [1/2, 1), and the exponents ``k`` (0 for an all-zero head); ``W`` itself, every ``k`` 0, when each head's largest
    |entry| is in [2^-16, 2^16] (Note [float32 Grams]: nothing to gain there, and the copy cost MiniLM's
    ``--fast`` ~15%)."""
    axes = tuple(range(1, W.ndim))
    k = np.frexp(np.maximum(W.max(axis=axes, initial=0.0), -W.min(axis=axes, initial=0.0)).astype(np.float64))[1]
    if np.all(np.abs(k) <= 16):
        return W, np.zeros_like(k)
    return np.ldexp(W, -k.reshape((-1,) + (1,) * len(axes))), k


# Note [float32 Grams]: ``--fast`` forms ``W^T W`` in float32, where a square overflows above ~1.8e19 and flushes
# to zero below ~1e-19.  A bfloat16 checkpoint holds entries up to 3.4e38 and down to 9e-41: one W_Q entry 3e38 made
# the Gram inf and ``analyze --fast`` an internal error (LinAlgError from eigvals), and W_Q, W_K entries ~1e-38 printed
# B_KQ 0 for 2.345e-76 (red team 221).  Each head is scaled to unit size first (exact: a power of two) and the
# estimates are scaled back in float64, where a product of two float32-range matrices neither overflows nor flushes.
# Away from overflow and underflow, float32 arithmetic on ``W 2^-k`` is the arithmetic on ``W`` times 2^-k (binary
# floating point), so scaling moves no estimate; it is skipped when every largest |entry| is in [2^-16, 2^16]: a
# Gram entry is then at most d 2^32, ``G_A B``'s at most r d 2^48 and a column's sum of squares at most
# r^2 d 2^64 (r, d <= 2^17: far below float32's 2^128), and the squares of the largest entries are at least 2^-32
# (far above its 2^-126 normal floor; entries 2^-40 below the largest weigh < 2^-80 relative).


def _lowrank_estimates(G_A: np.ndarray, G_B: np.ndarray, B: np.ndarray, scale: float,
                       k: np.ndarray) -> tuple[np.ndarray, ...]:
    """Batched over heads: ||A_h B_h||_2, ||.||_F, ||.||_{2,1} from G_A = A^T A, G_B = B B^T (estimates), of
    ``A_h B_h`` times ``scale 2^k_h`` (the inputs are unit-scaled heads, Note [float32 Grams])."""
    G_A64, G_B64 = G_A.astype(np.float64), G_B.astype(np.float64)
    try:  # lambda(G_A G_B) = lambda(L^T G_A L) with G_B = L L^T: a symmetric, cheaper eigen-problem
        L = np.linalg.cholesky(G_B64)
        lam = np.linalg.eigvalsh(L.transpose(0, 2, 1) @ G_A64 @ L)[:, -1]
    except np.linalg.LinAlgError:  # a rank-deficient head: the general solver
        lam = np.linalg.eigvals(G_A64 @ G_B64).real.max(axis=-1)
    sq = np.clip(np.einsum("hij,hij->hj", G_A @ B, B), 0.0, None)  # squared column norms of A B
    col = np.sqrt(sq)
    c = np.ldexp(np.full(len(k), scale, np.float64), k)  # float64: 2^k of a float32-range head stays finite
    return (np.sqrt(np.clip(lam, 0.0, None)) * c, np.sqrt(sq.sum(-1)).astype(np.float64) * c,
            col.sum(-1).astype(np.float64) * c)


def _heads_fast(attn: AttentionSpec, m: _Measurer, arr: dict[str, np.ndarray],
                matrices: dict[str, MatrixNorms], names: dict[str, str]) -> list[HeadNorms]:
    """``--fast``: every head of a layer at once (batched r x r problems), all labelled estimates."""
    H = attn.n_heads
    kv = [attn.kv_index(h) for h in range(H)]
    (WQ, eQ), (WK, eK), (WV, eV), (WO, eO) = (_unit_heads(W) for W in (arr["W_Q"], arr["W_K"], arr["W_V"], arr["W_O"]))
    WK, eK = WK[kv], eK[kv]  # (H,d,r) (H,d,r) (Hkv,d,r) (H,r,d), each head at unit scale
    KT = WK.transpose(0, 2, 1)  # (H, r, d): B = W_K^T
    G_K = KT @ WK
    scale = attn.softmax_scale
    kq = _lowrank_estimates(WQ.transpose(0, 2, 1) @ WQ, G_K, KT, scale, eQ + eK)
    kq_bias = None
    if attn.b_Q is not None:  # [W_Q; b_Q] (Note [attention biases]), at its own scale
        WQa, eQa = _unit_heads(np.concatenate([arr["W_Q"], m.array(attn.b_Q)[:, None, :]], axis=1))
        kq_bias = _lowrank_estimates(WQa.transpose(0, 2, 1) @ WQa, G_K, KT, scale, eQa + eK)[0]
    G_V = WV.transpose(0, 2, 1) @ WV  # (Hkv, r, r)
    ov = _lowrank_estimates(G_V[kv], WO @ WO.transpose(0, 2, 1), WO, 1.0, eV[kv] + eO)
    v_norm = np.ldexp(np.sqrt(np.clip(np.linalg.eigvalsh(G_V.astype(np.float64))[:, -1], 0.0, None)), eV)
    d = attn.d_model
    for g in sorted(set(kv)):
        matrices[f"W_V.h{g}"] = m.matrix(f"W_V.h{g}", arr["W_V"][g], _value_label(names, attn, g))
    heads = []
    for h in range(H):
        kq_h = [_estimate(float(x[h]), "batched low-rank") for x in kq]
        ov_h = [_estimate(float(x[h]), "batched low-rank") for x in ov]
        matrices[f"W_KQ.h{h}"] = MatrixNorms(f"W_KQ.h{h}", (d, d), *kq_h)
        matrices[f"W_OV.h{h}"] = MatrixNorms(f"W_OV.h{h}", (d, d), *ov_h)
        bias = None if kq_bias is None else _estimate(float(kq_bias[h]), "batched low-rank")
        heads.append(HeadNorms(h, kq_h[0], ov_h[0], _estimate(float(v_norm[kv[h]]), "float32 gram"), bias))
    return heads


# Per-head work is a few hundred tiny (d_head-sized) BLAS/LAPACK calls: they run single-threaded,
# the big Grams do not (Note [small problems] in ``transcover._threads``).


def _moe_norms(moe: MoESpec, matrix, matrices: dict[str, MatrixNorms],  # noqa: ANN001
               lm: LayerMeasure | None) -> tuple[Interval, Interval, Interval | None]:
    """Every expert's matrices (``expert.e.W_1`` ...), the router and a shared expert into ``matrices``
    (certified: the intervals ``measure_layer`` measured, ``lm.experts``); returns (B_W1, B_W2, B_Wgate),
    each the max over the experts (THEORY F29)."""
    own = {} if lm is None else lm.experts
    for e in range(moe.n_experts):
        for role in ("W_1", "W_2", "W_gate"):
            W = getattr(moe, role)
            if W is not None:
                key = f"expert.{e}.{role}"
                matrices[key] = matrix(key, W[e], own.get(key))
    matrices["router"] = matrix("router", moe.W_router, own.get("router"))
    if moe.shared is not None:
        for role in ("W_1", "W_2", "W_gate"):
            matrices[f"shared.{role}"] = matrix(f"shared.{role}", getattr(moe.shared, role), own.get(f"shared.{role}"))
    best = {role: _max_interval([matrices[f"expert.{e}.{role}"].spectral for e in range(moe.n_experts)],
                                "max over experts") for role in ("W_1", "W_2", "W_gate") if getattr(moe, role) is not None}
    return best["W_1"], best["W_2"], best.get("W_gate")


def _layer_norms(layer: LayerSpec, m: _Measurer, entrywise: bool = False) -> tuple[LayerNorms, LayerMeasure | None]:
    """One layer as ``analyze`` shows it and, in certified mode, the :class:`LayerMeasure` it is a
    view of (``--fast`` estimates are no certified measurement: None)."""
    attn, ffn = layer.attention, layer.ffn
    names = layer.names
    matrices: dict[str, MatrixNorms] = {}
    lm = None
    if m.fast:
        f64 = {k: m.array(getattr(attn, k)) for k in ("W_Q", "W_K", "W_V", "W_O")}  # float32, no copies
    else:
        f64 = layer_arrays(attn)  # the engine's arrays and batched Grams (Note [one engine] in _model)
        if attn.b_Q is not None and attn.rope is None and "G_Q" in f64:  # [W_Q; b_Q] on x~ = [x, 1]
            b_Q = m.array(attn.b_Q)
            if in_safe_range(b_Q):
                WQa = np.concatenate([f64["W_Q"], b_Q[:, None, :]], axis=1)
                f64["G_Qa"], f64["e_Qa"] = batched_gram_with_error(WQa)
        lm = measure_layer(layer, entrywise, arrays=f64)
    with limit_threads(1, torch=False):  # Note [small problems] in ``transcover._threads``
        if m.fast and attn.rope is None:
            heads = _heads_fast(attn, m, f64, matrices, names)
        elif m.fast:
            heads = [_head_norms_fast_rope(attn, h, m, f64, matrices, names) for h in range(attn.n_heads)]
        else:
            heads = [_head_norms(attn, h, m, f64, matrices, names, lm.heads[h]) for h in range(attn.n_heads)]

    def matrix(role: str, W, spectral: Interval | None) -> MatrixNorms:
        if spectral is None:  # --fast
            return m.matrix(role, W, names.get(role, ""))
        Wn = m.array(W)
        return MatrixNorms(role, tuple(Wn.shape), spectral, *frobenius_l21_intervals(Wn), names.get(role, ""))

    matrices["W_O"] = matrix("W_O", f64["W_O"].reshape(-1, attn.d_model), None if lm is None else lm.W_O)
    if isinstance(ffn, MoESpec):
        B_W1, B_W2, B_Wgate = _moe_norms(ffn, matrix, matrices, lm)
    else:
        matrices["W_1"] = matrix("W_1", f64.get("W_1", ffn.W_1), None if lm is None else lm.W_1)
        matrices["W_2"] = matrix("W_2", f64.get("W_2", ffn.W_2), None if lm is None else lm.W_2)
        B_W1, B_W2, B_Wgate = matrices["W_1"].spectral, matrices["W_2"].spectral, None
        if ffn.W_gate is not None:
            matrices["W_gate"] = matrix("W_gate", f64.get("W_gate", ffn.W_gate), None if lm is None else lm.W_gate)
            B_Wgate = matrices["W_gate"].spectral

    def bias_norm(b) -> Interval:
        return _ZERO if b is None else vector_norm_interval(_np(b))

    b_attn = output_bias_enclosure(attn)  # float64 sum with its error bound (Note [summed biases] in _model)
    return LayerNorms(
        index=layer.index,
        B_KQ=_max_interval([h.B_KQ for h in heads], "max over heads"),
        B_V=_max_interval([h.B_V for h in heads], "max over heads"),
        B_W1=B_W1,
        B_W2=B_W2,
        B_b1=bias_norm(getattr(ffn, "b_1", None)),
        B_b2=bias_norm(getattr(ffn, "b_2", None)),
        W_O=matrices["W_O"].spectral,
        B_Wgate=B_Wgate,
        B_b_attn=_ZERO if b_attn is None else enclosed_vector_norm(*b_attn),
        heads=tuple(heads),
        matrices=matrices,
        norm_attn=NormParams.of(layer.norm_attn),
        norm_ffn=NormParams.of(layer.norm_ffn),
        placement=layer.placement.value,
        rope=attn.rope is not None,
    ), lm


def _up4(x: float) -> str:
    """``x`` printed with 4 significant digits, rounded *up* (a printed bound must stay a bound)."""
    from .._printed import directed

    return directed(x, 4, "up")


def analyze_spec(
    spec: TransformerSpec,
    *,
    fast: bool = False,
    rtol: float = 1e-3,
    embeddings: bool = True,
    progress: Callable[[int, int], None] | None = None,
    entrywise: bool = False,
) -> AnalysisResult:
    """Measure every layer (and head) of ``spec``: the seed's section 2.1 quantities as intervals.

    Args:
        spec: the decomposition (``transcover.model.load`` gives one for any supported model).
        fast: Lanczos/low-rank *estimates* (``Kind.ESTIMATE``) instead of certified intervals.
        rtol: target relative gap of certified intervals (and stopping tolerance of estimates).
        embeddings: also measure the matrices outside the decomposition.
        progress: called as ``progress(done, total)`` after each layer.
        entrywise: also the (2,1) norms the covering bounds read, in ``result.norms``.

    Certified mode is a view of :func:`~transcover.norms.measure_model`'s engine (Note [one engine]
    in ``_model``): ``result.norms`` is the :class:`~transcover.norms.ModelNorms` every spectral
    interval shown was read from, for the Lipschitz and covering bounds to reuse (``report`` does).

    Raises:
        InputError: ``rtol`` not in (0, 1), or a model without layers.
    """
    from .._errors import InputError

    if not (0.0 < rtol < 1.0) or math.isnan(rtol):
        raise InputError(f"rtol must be in (0, 1), but got rtol={rtol}")
    n = len(spec.layers)
    if n == 0:
        raise InputError(f"model {spec.name!r} has no Transformer layers to analyze")
    m = _Measurer(fast, rtol)
    t0 = time.perf_counter()
    layers, measures = [], []
    # Note [one layer at a time]: spec.layers builds each layer on access and nothing here keeps a
    # LayerSpec past its iteration (only these facts about the first one), so the decoded weights
    # of layer i are released before layer i + 1 is read (issue 14, streaming analysis).
    first: dict[str, object] = {}
    moe_layers = 0
    pos_bias = -1.0  # max |relative position bias| (T5), -1: none
    qk_scores = 0.0  # THEORY F23: with query/key RMSNorm every score is <= s max|gamma_q| max|gamma_k| d_head
    for i, layer in enumerate(spec.layers):
        if not first:
            a = layer.attention
            first = {"rope": a.rope is not None, "b_Q": a.b_Q is not None, "H": a.n_heads, "dh": a.d_head,
                     "parallel": layer.residual.value == "parallel",
                     "post": layer.post_norm_attn is not None or layer.post_norm_ffn is not None}
        a = layer.attention
        if a.q_norm is not None and a.k_norm is not None:
            # a norm over the whole projection bounds one head's query by max|gamma| sqrt(H d_head) only
            # (Note [whole-projection q/k norm] in lipschitz._qknorm)
            width = math.sqrt(a.n_heads * a.n_kv_heads) if a.qk_norm_scope == "all" else 1.0
            qk_scores = max(qk_scores, a.softmax_scale * a.q_norm.gamma_max_abs * a.k_norm.gamma_max_abs
                            * a.d_head * width * (1 + 12 * 2.0**-52))
        moe_layers += isinstance(layer.ffn, MoESpec)
        if a.position_bias is not None:  # T5 (THEORY F28): exact max of the table, every layer's scores shift by it
            pos_bias = max(pos_bias, float(np.max(np.abs(_np(a.position_bias.table)))))
        view, lm = _layer_norms(layer, m, entrywise)
        layers.append(view)
        measures.append(lm)
        del layer
        if progress is not None:
            progress(i + 1, n)
    embs = []
    if embeddings:
        tensors = spec.config.get("embedding_names") or {}  # role -> checkpoint tensor, as --describe shows
        for name in list(spec.embeddings):
            E = spec.embeddings[name]  # read now, released after its norms
            if E.ndim != 2:
                E = E.reshape(E.shape[0], -1)  # e.g. a patch-embedding convolution kernel
            embs.append(_embedding_norms(name, E, m, str(tensors.get(name, ""))))
            del E
    if spec.head is not None:
        for j, W in enumerate(spec.head.weights):
            W = m.array(W)
            embs.append(EmbeddingNorms(f"{HEAD_PREFIX}{j}", m.matrix(f"{HEAD_PREFIX}{j}", W), _max_row_norm(W)))
    notes = []
    if first["rope"]:
        notes.append("RoPE: B_KQ is the sup over relative positions |delta| < max_position; its upper end is "
                     "the smaller of scale*||W_Q||*||W_K|| and a slow/fast-plane split (THEORY F22), and its gap "
                     "can exceed rtol")
    if first["b_Q"] and not first["rope"]:
        notes.append("query biases act through B_KQ_bias on x~=[x,1]; key biases cancel in the softmax")
    if first["parallel"]:
        notes.append("parallel residual: each layer is x + attn(LN1 x) + ffn(LN2 x) (THEORY F21)")
    if pos_bias >= 0:
        notes.append(f"relative position bias (T5): every score is x_i W_KQ x_j^T shifted by at most max|B| = "
                     f"{pos_bias:.4g}; the Lipschitz constants do not depend on it, G.3 charges its changes (THEORY F28)")
    if moe_layers:
        notes.append(f"mixture of experts in {moe_layers} layer(s): B_W1, B_W2, B_Wgate are the max over experts; "
                     "per-expert and router norms are in the matrices; no Lipschitz, G.3 or covering bound "
                     "exists for top-k routing (THEORY F25)")
    if qk_scores > 0:
        notes.append("query/key RMSNorm: B_KQ = ||scale W_Q W_K^T|| does not bound the scores; every score is "
                     f"<= scale*max|gamma_q|*max|gamma_k|*(normalised width) <= {_up4(qk_scores)} (THEORY F23)")
    if first["post"]:
        notes.append("branch-output norms: each sub-layer is x + N_post(f(N_pre x)) (THEORY F26); the "
                     "post norms' gains are not in the per-layer columns")
    return AnalysisResult(
        model=spec.name, arch=spec.arch, d_model=spec.d_model, n_heads=int(first["H"]),
        d_head=int(first["dh"]), mode="fast" if fast else "certified", rtol=rtol,
        layers=tuple(layers), embeddings=tuple(embs), final_norm=NormParams.of(spec.final_norm),
        seconds=time.perf_counter() - t0, notes=tuple(notes), warnings=tuple(spec.warnings),
        norms=None if fast else ModelNorms(spec.name, spec.d_model, tuple(measures), NormMeasure.of(spec.input_norm),
                                           NormMeasure.of(spec.final_norm), entrywise=entrywise),
    )
