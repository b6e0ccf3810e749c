"""The FFN stage seen through the preceding norm's scale (issue 12; THEORY F46).

The norm before the FFN (post-LN the first, pre-LN the second) outputs ``h = gamma o n + beta`` exactly, so
every move of ``h`` is ``gamma o dn`` with ``dn`` the move of the normalised vector, and the FFN as a function
of ``n`` is the same FFN with ``W_1`` replaced by ``W_1^gamma = diag(gamma) W_1`` (rows of ``W_1`` scaled, in the
row convention ``z = h W_1 + b_1``) at the same pre-activations ``z``.  Its Jacobian drift
``||(J_F(h + gamma o v) - J_F(h)) diag(gamma)||`` on ``||v|| <= r_n`` is any of ``FfnDrift``'s bounds for the folded
FFN on the ball of radius ``r_n``; the chain then carries ``sup ||D_n'||`` (the norm's Jacobian without
``gamma``) in place of ``max|gamma| / s_floor``.  Every use is one more branch of a ``min`` (the stages'
functions in ``_local_stages``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import torch
from torch import Tensor

from ..model import Activation, LayerSpec, NormKind, Placement
from ._local_jacobian import _f64, _ffn_weight_norms, pow2_norm
from . import _local_rows
from ._local_rows import _U, FfnDrift
from ._local_sharp import GELU_SLOPE_RANGE
from ._weights import ROUNDING_PAD

__all__ = ["FoldedFfnDrift", "fold_pad", "folded_layer"]


def _scaled_norm(layer: LayerSpec):  # noqa: ANN202
    """The norm whose output the FFN reads (post-LN the first, pre-LN the second)."""
    return layer.norm_attn if layer.placement is Placement.POST else layer.norm_ffn


def folded_layer(layer: LayerSpec) -> tuple[LayerSpec, float] | None:
    r"""The layer with ``W_1`` replaced by ``fl(diag(gamma) W_1)`` (float64) and ``e``, a bound on the Frobenius norm
    of its rounding ``E = diag(gamma) W_1 - fl(diag(gamma) W_1)``: every entry is one product, ``|E| <= u |A|
    <= u/(1 - u) |fl(A)|``, so ``||E||_F <= u/(1 - u) ||fl(A)||_F`` (0 when both factors hold float32 values, as
    MiniLM's stored weights: the product has at most 48 significant bits and is exact in float64).  None where the
    fold does not apply: no norm, a norm without ``gamma``, no centring/scaling norm, an activation with an
    unbounded ``sigma''`` (ReLU: the rounding's effect on the slopes is not bounded by a multiple of ``e``).
    THEORY F46.
    Norms at powers of two (``pow2_norm``, THEORY F96)."""
    from ._local import second_derivative_sup

    norm = _scaled_norm(layer)
    if norm is None or norm.weight is None or norm.kind not in (NormKind.LAYERNORM, NormKind.RMSNORM) \
            or not math.isfinite(second_derivative_sup(layer.ffn.activation)):
        return None
    g, W1 = _f64(norm.weight), _f64(layer.ffn.W_1)
    A = g[:, None] * W1
    narrow = all(bool((t == t.float().double()).all()) for t in (g, W1))  # float32 values (stored in float64)
    e = 0.0 if narrow else _U / (1 - _U) * float(pow2_norm(A)) * (1 + 1e-12)
    return replace(layer, ffn=replace(layer.ffn, W_1=A)), e


def fold_pad(ffn, norms: dict, e: float, rn: Tensor) -> Tensor:  # noqa: ANN001
    r"""(T,) the effect of ``W_1^gamma``'s rounding ``E`` (``||E||_F <= e``, ``folded_layer``) on a drift bound computed
    for ``fl(W_1^gamma) = A - E``: with ``S' = diag(sigma'(z + v A))``, ``\hat S' = diag(sigma'(z + v fl(A)))``,

    .. math:: W_2^\top (S' - S) A^\top = W_2^\top(\hat S' - S)\,\mathrm{fl}(A)^\top + W_2^\top(\hat S' - S) E^\top
              + W_2^\top (S' - \hat S') A^\top,

    the first the computed bound's, the second at most ``||W_2|| c e`` (``c`` the range of ``sigma'``), the third at
    most ``||W_2|| s_2 r_n e (||fl(A)|| + e)`` (``|sigma'(a) - sigma'(b)| <= s_2 |a - b|``, ``|v E_k| <= r_n e``);
    the same pad serves the segment mean.  THEORY F46.  Assumptions: ``s_2 = sup|sigma''|`` finite."""
    from ._activations import activation_lipschitz
    from ._local import second_derivative_sup

    if e == 0.0:
        return torch.zeros_like(rn)
    c = GELU_SLOPE_RANGE if Activation(ffn.activation) is Activation.GELU else 2 * activation_lipschitz(ffn.activation)
    s2 = second_derivative_sup(ffn.activation)
    return norms["W2"] * (c * e + s2 * rn * e * (norms["W1"] + e)) * (1 + ROUNDING_PAD)


class FoldedFfnDrift:
    """The FFN term of one layer's rows in two forms (THEORY F46): ``base``, ``FfnDrift`` on the FFN input ball of
    radii ``rh``, and ``fold``, ``FfnDrift`` of the ``gamma``-folded FFN on the normalised vector's ball of radii ``rn``
    (None where ``folded_layer`` is); the folded one's radius-free data cached in ``norms["gamma_fold"]``.  The
    tail then takes ``(dF, dFh, fold)`` with ``fold`` the folded ``(dG, dGh)`` (rounding pad included) or None."""

    def __init__(self, layer: LayerSpec, z: Tensor, norms: dict, tiers: bool = False, ez: Tensor | None = None) -> None:
        self.base = FfnDrift(layer, z, norms, tiers, ez)
        self.lip = self.base.lip
        if "gamma_fold" not in norms:
            fl = folded_layer(layer)
            norms["gamma_fold"] = None if fl is None else (fl[0], fl[1], _ffn_weight_norms(fl[0].ffn))
        self.fold = self.pad = None
        if norms["gamma_fold"] is not None:
            flayer, e, fnorms = norms["gamma_fold"]
            self.fold = FfnDrift(flayer, z, fnorms, tiers, ez)
            self.pad = partial(fold_pad, flayer.ffn, fnorms, e)

    def rows(self, tail, rh: Tensor, rn: Tensor | None, unit: bool) -> dict:  # noqa: ANN001
        """``tail(dF, dFh, fold)`` (``FfnDrift.rows`` with both drifts): a token's refinement refines both, each
        ``FfnDrift`` once to its final term; F37a's argument holds (every reported row is non-decreasing in each of
        the token's four terms and depends on its own only).  Without F45's tier (``_local_stack`` reads every
        token's row) a first pass refines ``base`` alone by the rows without the fold, so it refines the tokens it
        refined alone, to the same floats, and records the same F37b references; every token's row is then at most its row
        without the fold, and a second pass refines by the rows with it (their maxima as F37a's)."""
        if self.fold is None or rn is None:
            return self.base.rows(lambda dF, dFh: tail(dF, dFh, None), rh, unit)
        b, f = self.base, self.fold
        pad = self.pad(rn)
        dF, dFh = b.glob(rh)
        dG, dGh = f.glob(rn)
        if not unit:
            return tail(dF, dFh, (dG + pad, dGh + pad))
        dF, dFh = b.scaled_refs(rh, dF, dFh)
        dG, dGh = f.scaled_refs(rn, dG, dGh)
        cheap = tail(dF, dFh, (dG + pad, dGh + pad))
        if _local_rows.unbounded(cheap, rh, rn):  # F61c: no refinement can change a reported number
            return cheap
        refs = (torch.full_like(rh, math.inf), torch.full_like(rn, math.inf))
        levels = (torch.zeros(len(rh), dtype=torch.long), torch.zeros(len(rn), dtype=torch.long))
        one = (partial(b.refine, rh, dF, dFh, refs[0], (dF.clone(), dFh.clone()), levels[0]),
               partial(f.refine, rn, dG, dGh, refs[1], (dG.clone(), dGh.clone()), levels[1]))

        def refine(idx: Tensor, k: int = 2) -> Tensor:
            for step, level in zip(one[:k], levels[:k]):
                todo = idx[level[idx] < 2]
                if len(todo):
                    step(todo)
            return (levels[0][idx] == 2) & (levels[1][idx] == 2 if k == 2 else True)

        zero = torch.zeros_like(rh)
        if b.split_key is None:  # F37a alone (no tier): first as without the fold
            _local_rows.refine_lazily(lambda: tail(dF, dFh, None), b.asks, partial(refine, k=1), len(rh),
                          lowest=tail(zero, zero, None))
            b.refs.append((rh, refs[0].clone()))
        rows = _local_rows.refine_lazily(lambda: tail(dF, dFh, (dG + pad, dGh + pad)), b.asks, refine, len(rh),
                             lowest=tail(zero, zero, (zero, zero)))
        if b.split_key is not None:
            b.refs.append((rh, refs[0]))
        f.refs.append((rn, refs[1]))
        return rows
